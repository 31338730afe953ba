"""``stability_monitor`` against a float64 restatement of OLMo-core's
``StabilityMonitorCallback`` definition: the recorded GPU streams of
``tests/data/lm_spikes_gpu_norms.npz``, a stationary stream, a lasting shift, and
clipjax's one deviation (a NaN or Inf is a spike and never enters a window)."""

from __future__ import annotations

import functools
import math
from collections import deque
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax

DATA = Path(__file__).parents[1] / "data" / "lm_spikes_gpu_norms.npz"
ROWS = ("none", "zclip_fb_cap1", "recommended", "static_2")
WINDOW, ROLLING = 128, 500  # the callback's window; a rolling window 2000 steps fill
P = "stability_monitor/global/"
U = 2.0**-24  # float32 unit roundoff


def gamma(k: int) -> float:
    """Higham's gamma_k = k u / (1 - k u): the bound on k float32 roundings."""
    return k * U / (1 - k * U)


def restate(
    norms: Any, losses: Any = None, window_size: int = WINDOW, rolling_window: int = ROLLING,
    threshold_std: float = 6.0,
) -> dict[str, np.ndarray]:  # fmt: skip
    """The callback's definition, in float64 Python, per step: each series' spike flag,
    the distance of its value from its threshold over the float32 rounding budget of that
    threshold (``margin``: |margin| <= 1 where float32 may decide otherwise), and the
    scores (NaN where the callback records none). Non-finite values: clipjax's rule."""
    series = {"grad_norm": norms} if losses is None else {"grad_norm": norms, "value": losses}
    histories = {k: deque(maxlen=window_size) for k in series}
    recent: deque[bool] = deque(maxlen=rolling_window)
    out: dict[str, list[float]] = {k: [] for k in ("spike", "score", "total")}
    for k in series:
        out[f"{k}_spike"], out[f"{k}_margin"] = [], []
    spikes = 0
    for t in range(len(norms)):
        step_spike = False
        for k, values in series.items():
            x, history = float(values[t]), histories[k]
            spike, margin = not math.isfinite(x), math.inf
            if math.isfinite(x) and len(history) == window_size:
                mean = sum(history) / window_size
                std = math.sqrt(sum((h - mean) ** 2 for h in history) / window_size)
                threshold = mean + threshold_std * std
                spike = std >= 1e-10 and x > threshold
                # float32: the sum's and the mean's roundings (gamma_n of mean|h|), the
                # deviations' and squares' (gamma_{n+4} of std), a mean off by d moving the
                # std by at most d, and the threshold's own few roundings.
                mean_abs = sum(abs(h) for h in history) / window_size
                budget = gamma(window_size + 8) * (
                    (1 + threshold_std) * mean_abs + threshold_std * std + abs(threshold)
                )
                margin = (x - threshold) / budget
            if math.isfinite(x):
                history.append(x)
            out[f"{k}_spike"].append(spike)
            out[f"{k}_margin"].append(margin)
            step_spike |= spike
        recent.append(step_spike)
        spikes += step_spike
        steps = t + 1
        out["spike"].append(step_spike)
        out["score"].append(sum(recent) / rolling_window if steps >= rolling_window else math.nan)
        out["total"].append(spikes / steps if steps >= window_size else math.nan)
    return {k: np.asarray(v) for k, v in out.items()}


def _monitor_step(tx: Any, state: Any, norm: Any, loss: Any) -> tuple[Any, dict[str, Any]]:
    kwargs = {} if loss is None else {"value": loss}
    _, state = tx.update({"w": jnp.reshape(norm, (1,))}, state, **kwargs)
    return state, clipjax.metrics(state)


@functools.partial(jax.jit, static_argnames=("window_size", "rolling_window"))
def scanned(
    norms: Any, losses: Any, threshold_std: Any = 6.0, window_size: int = WINDOW,
    rolling_window: int = ROLLING,
) -> tuple[Any, dict[str, Any]]:  # fmt: skip
    """The monitor over a stream under ``lax.scan`` (``losses=None``: no loss): the last
    state and every step's metrics."""
    tx = clipjax.stability_monitor(window_size, rolling_window, threshold_std)
    state = tx.init({"w": jnp.zeros(1)})
    if losses is None:
        return jax.lax.scan(lambda s, n: _monitor_step(tx, s, n, None), state, norms)
    return jax.lax.scan(lambda s, x: _monitor_step(tx, s, *x), state, (norms, losses))


def jitted(norms: Any, losses: Any) -> dict[str, np.ndarray]:
    """The monitor step by step, each step one call of a jitted update."""
    tx = clipjax.stability_monitor(WINDOW, ROLLING)
    state = tx.init({"w": jnp.zeros(1)})
    step = jax.jit(functools.partial(_monitor_step, tx))
    rows = []
    for norm, loss in zip(norms, losses):
        state, metrics = step(state, norm, loss)
        rows.append(metrics)
    return {k: np.asarray([r[k] for r in rows]) for k in rows[0]}


@functools.cache
def streams() -> dict[str, tuple[np.ndarray, np.ndarray]]:
    data = np.load(DATA)
    return {
        f"{row}/{seed}": (data[f"{row}/grad_norm"][seed], data[f"{row}/loss"][seed])
        for row in ROWS
        for seed in range(3)
    }


@functools.cache
def restated(key: str, threshold_std: float = 6.0) -> dict[str, np.ndarray]:
    norms, losses = streams()[key]
    return restate(norms, losses, threshold_std=threshold_std)


def mismatches(got: dict[str, Any], want: dict[str, np.ndarray], series: tuple[str, ...]) -> Any:
    """``(outside, near)``: the steps whose flags differ with the value outside the float32
    budget of the threshold, and those within it (where float32 may decide otherwise)."""
    outside, near = [], []
    for k in series:
        flags, margins = np.asarray(got[P + f"{k}_spike"]), want[f"{k}_margin"]
        for t in np.flatnonzero(flags != want[f"{k}_spike"]):
            (near if abs(margins[t]) <= 1 else outside).append((k, int(t), float(margins[t])))
    return outside, near


def check(got: dict[str, Any], want: dict[str, np.ndarray], series: tuple[str, ...]) -> int:
    """Every flag as restated outside the rounding budget, the scores within the flags
    that float32 may decide otherwise; returns how many steps lie within the budget."""
    outside, near = mismatches(got, want, series)
    assert not outside, outside
    within = sum(int(np.sum(np.abs(want[f"{k}_margin"]) <= 1)) for k in series)
    spike = np.asarray(got[P + "spike"])
    if not near:
        np.testing.assert_array_equal(spike, want["spike"])
    steps = np.arange(1, len(spike) + 1)
    for field, key, denominator in (
        ("spike_score", "score", ROLLING),
        ("spike_score_total", "total", steps),
    ):
        score = np.asarray(got[P + field], np.float64)
        np.testing.assert_array_equal(np.isnan(score), np.isnan(want[key]))
        slack = within / denominator + 1e-6 * np.nan_to_num(want[key])
        assert np.all(np.nan_to_num(np.abs(score - want[key])) <= slack), field
    np.testing.assert_array_equal(np.asarray(got[P + "spike_count"]), np.cumsum(spike))
    assert abs(int(spike.sum()) - int(want["spike"].sum())) <= len(near)
    return within


def test_recorded_gpu_streams_match_the_restatement_under_scan() -> None:
    keys = sorted(streams())
    within, spikes = {}, {}
    for key in keys:
        norms, losses = streams()[key]
        _, got = scanned(jnp.asarray(norms), jnp.asarray(losses))
        # The monitor judges the recorded float32 values themselves.
        np.testing.assert_array_equal(np.asarray(got[P + "grad_norm"]), norms)
        np.testing.assert_array_equal(np.asarray(got[P + "value"]), losses)
        within[key] = check(got, restated(key), ("grad_norm", "value"))
        spikes[key] = int(restated(key)["spike"].sum())
    # Values within float32 rounding of their threshold are rare: listed, at most 2 of 48000.
    assert sum(within.values()) <= 2, within
    # The streams spike: the comparison judges spikes, not only calm steps.
    assert sum(spikes.values()) >= 20 and spikes["none/0"] > 0, spikes


def test_recorded_stream_matches_the_restatement_step_by_step_under_jit() -> None:
    norms, losses = streams()["none/0"]
    check(jitted(norms, losses), restated("none/0"), ("grad_norm", "value"))


def test_negative_control_a_threshold_of_5_9_is_told_from_6() -> None:
    """The comparison has teeth: the monitor at 5.9 fails against the restatement at 6."""
    differing = [
        k for k in sorted(streams()) if (restated(k, 5.9)["spike"] != restated(k)["spike"]).any()
    ]
    assert differing
    norms, losses = streams()[differing[0]]
    _, got = scanned(jnp.asarray(norms), jnp.asarray(losses), 5.9)
    outside, _ = mismatches(got, restated(differing[0]), ("grad_norm", "value"))
    assert outside
    check(got, restated(differing[0], 5.9), ("grad_norm", "value"))


def test_stationary_stream_scores_near_zero() -> None:
    norms = (1.0 + 0.01 * np.random.default_rng(0).standard_normal(3000)).astype(np.float32)
    _, got = scanned(jnp.asarray(norms), None)
    want = restate(norms)
    check(got, want, ("grad_norm",))
    assert want["spike"].sum() <= 2
    assert float(np.asarray(got[P + "spike_score"])[-1]) <= 2 / ROLLING
    assert not np.asarray(got[P + "value_spike"]).any()  # no loss: only the norm judged
    assert np.isnan(np.asarray(got[P + "value"])).all()


def test_lasting_shift_spikes_until_the_window_takes_it_in() -> None:
    """From 1 to 2 (noise 0.01) at step 1000: with j shifted values in the window, 2 spikes
    while 1 - p > 6 sqrt(p (1 - p)), p = j / 128, that is j <= 3: steps 1000 to 1003."""
    noise = 0.01 * np.random.default_rng(1).standard_normal(2000)
    norms = (np.where(np.arange(2000) < 1000, 1.0, 2.0) + noise).astype(np.float32)
    _, got = scanned(jnp.asarray(norms), None)
    want = restate(norms)
    check(got, want, ("grad_norm",))
    assert np.flatnonzero(want["spike"]).tolist() == [1000, 1001, 1002, 1003]
    score = np.asarray(got[P + "spike_score"])
    assert score[1003] == pytest.approx(4 / ROLLING) and score[1503] == 0  # rolled out
    assert np.asarray(got[P + "spike_score_total"])[-1] == pytest.approx(4 / 2000)


def test_scores_are_nan_until_their_windows_fill() -> None:
    norms, losses = streams()["none/0"]
    _, got = scanned(jnp.asarray(norms[:600]), jnp.asarray(losses[:600]))
    score, total = np.asarray(got[P + "spike_score"]), np.asarray(got[P + "spike_score_total"])
    assert np.isnan(score[: ROLLING - 1]).all() and np.isfinite(score[ROLLING - 1 :]).all()
    assert np.isnan(total[: WINDOW - 1]).all() and np.isfinite(total[WINDOW - 1 :]).all()
    assert not np.asarray(got[P + "spike"])[:WINDOW].any()  # no full window yet


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["grad_norm", "value"])
def test_nonfinite_step_is_a_spike_and_leaves_its_window_unchanged(bad: float, where: str) -> None:
    """clipjax's deviation from the callback, which appends the NaN or Inf and then judges
    nothing for a window: the step spikes, its window is as before, and the steps after it
    are judged as if it had not been there."""
    rng = np.random.default_rng(2)
    norms = (1.0 + 0.01 * rng.standard_normal(400)).astype(np.float32)
    losses = (3.0 + 0.01 * rng.standard_normal(400)).astype(np.float32)
    norms[350] = losses[350] = 5.0  # a spike after the bad step, judged as before
    at = 200
    bad_norms, bad_losses = norms.copy(), losses.copy()
    (bad_norms if where == "grad_norm" else bad_losses)[at] = bad
    s = functools.partial(scanned, window_size=32, rolling_window=100)
    before, _ = s(jnp.asarray(norms[:at]), jnp.asarray(losses[:at]))
    state, got = s(jnp.asarray(bad_norms[: at + 1]), jnp.asarray(bad_losses[: at + 1]))
    # The bad series' window is unchanged; the other series' took its finite value.
    window = f"{where}_window"
    np.testing.assert_array_equal(getattr(state, window), getattr(before, window))
    assert int(getattr(state, f"{where}_seen")) == at
    other = "value" if where == "grad_norm" else "grad_norm"
    assert int(getattr(state, f"{other}_seen")) == at + 1
    last = {k: np.asarray(v)[at] for k, v in got.items()}
    assert last[P + f"{where}_spike"] and last[P + "spike"]
    assert last[P + "nonfinite_count"] == 1
    # The whole run: every other step judged as the clean run judges it.
    _, with_bad = s(jnp.asarray(bad_norms), jnp.asarray(bad_losses))
    _, clean = s(jnp.asarray(np.delete(norms, at)), jnp.asarray(np.delete(losses, at)))
    for field in ("grad_norm_spike", "value_spike"):
        np.testing.assert_array_equal(
            np.delete(np.asarray(with_bad[P + field]), at), np.asarray(clean[P + field])
        )
    assert np.asarray(clean[P + "spike"])[349]  # the later spike is seen
    count = np.asarray(with_bad[P + "spike_count"])[-1]
    assert count == np.asarray(clean[P + "spike_count"])[-1] + 1
    outside, _ = mismatches(
        with_bad, restate(bad_norms, bad_losses, 32, 100), ("grad_norm", "value")
    )
    assert not outside
