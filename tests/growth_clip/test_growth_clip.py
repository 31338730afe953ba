"""``clip_norm_growth`` and ``clip_norm_by_ema`` against float64 restatements of torchzero.

The restatements (``tests/restate/growth_clip.py``) follow torchzero's published
code (inikishev/torchzero at 2b6a2287df3aec9e7801249a691088f958c15ed9,
``torchzero/modules/clipping/growth_clipping.py`` and ``ema_clipping.py``) line
by line; ``fix=True`` adds clipjax's documented changes. Error budget: float32
clipjax against float64, relative 3e-5 on every reported value and the applied
scale (``tests/restate/_common.RTOL``; measured below 2e-6); counters exact.
Negative controls: another growth factor, another feedback, the unfixed code on
the inputs where clipjax fixes it.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests import restate as S
from tests.references.spam import spiky_gradients
from tests.restate import growth_clip as G

N = 200
# Three groups: spikes, a slow rise (growth above mul every step), a fall (max_decay), NaN/Inf.
RISE = np.r_[np.ones(60), 1.8 ** np.arange(1, 21), 1.8**20 * np.ones(120)]
FALL = np.r_[np.ones(80), 1e-3 * np.ones(120)]
STREAMS = np.stack(
    [
        R.with_nan(R.spikes(N, 1, at=[40, 90, 120, 170])[0], [3, 100]),
        0.3 * R.with_nan(RISE * R.spikes(N, 2, factors=())[0], [60], math.inf),
        2.0 * R.with_nan(FALL * R.spikes(N, 3, factors=())[0], [150]),
    ],
    axis=1,
)
FINITE = np.stack(
    [
        R.spikes(N, 1, at=[40, 90, 120, 170])[0],
        0.3 * RISE * R.spikes(N, 2, factors=())[0],
        2.0 * FALL * R.spikes(N, 3, factors=())[0],
    ],
    axis=1,
)
FIELDS = [*S.COMMON, "prev_norm"]
GROUPS = ["g0", "g1", "g2"]
PER_PARAM = {g: [g] for g in GROUPS}
SETTINGS = [
    {},  # torchzero's defaults: mul=1.5, min_value=1e-4, max_decay=2
    {"add": 0.5, "mul": None},
    {"add": 0.2, "mul": 1.2, "max_decay": None},
    {"mul": 2.0, "min_value": None, "max_decay": 4.0},
]


def _leaf(tree: Any, path: str) -> Any:
    for part in path.split("/"):
        tree = tree[part]
    return tree


def check_growth(tx: Any, norms: np.ndarray, make_tree: Any, groups: list[str], want_norms: Any,
                 leaves_of: dict[str, list[str]], **kw: Any) -> float:  # fmt: skip
    """Metrics of every group and the applied per-leaf scale vs the restatement; the
    largest relative error of the threshold."""
    got, (outs, ins), same = S.run_tree(tx, norms, make_tree)
    worst = 0.0
    for j, group in enumerate(groups):
        want = G.clip_norm_growth(want_norms[:, j], **kw)
        S.compare(got, want, f"clip_norm_growth/{group}/", FIELDS)
        finite = np.isfinite(want["grad_norm"])
        for leaf in leaves_of[group]:
            with np.errstate(invalid="ignore", divide="ignore"):
                ratio = _leaf(outs, leaf) / _leaf(ins, leaf)
            ok = finite & (_leaf(ins, leaf) > 0)
            np.testing.assert_allclose(ratio[ok], want["scale"][ok], rtol=S.RTOL)
            assert np.all(np.asarray(_leaf(same, leaf))[~finite])
        t, w = got[f"clip_norm_growth/{group}/threshold"], want["threshold"]
        both = np.isfinite(w) & np.isfinite(t)
        worst = max(worst, float(np.max(np.abs(t[both] / w[both] - 1), initial=0.0)))
    return worst


def settings_id(settings: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in settings.items()) or "defaults"


@pytest.mark.parametrize("settings", SETTINGS, ids=settings_id)
def test_per_param_trace_equals_torchzero(settings: dict) -> None:
    tx = clipjax.clip_norm_growth(**settings)
    # Finite traces: the published code itself (fix=False) is the reference.
    check_growth(tx, FINITE, S.flat_tree, GROUPS, FINITE, PER_PARAM, fix=False, **settings)
    # With NaN and inf: clipjax's documented fix.
    check_growth(tx, STREAMS, S.flat_tree, GROUPS, STREAMS, PER_PARAM, **settings)


def test_per_layer_and_global_traces_equal_torchzero() -> None:
    groups = ["l0", "l1", "l2"]
    leaves = {g: [f"{g}/kernel", f"{g}/bias"] for g in groups}
    tx = clipjax.clip_norm_growth(scope="per_layer")
    check_growth(tx, STREAMS, S.layer_tree, groups, STREAMS, leaves)
    with np.errstate(invalid="ignore"):
        total = np.sqrt((FINITE**2).sum(axis=1, keepdims=True))
    tx = clipjax.clip_norm_growth(scope="global")
    check_growth(tx, FINITE, S.flat_tree, ["global"], total, {"global": GROUPS}, fix=False)


@pytest.mark.parametrize("feedback", ["raw", "skip"])
def test_other_feedbacks_equal_their_restatement(feedback: str) -> None:
    tx = clipjax.clip_norm_growth(feedback=feedback)
    check_growth(tx, STREAMS, S.flat_tree, GROUPS, STREAMS, PER_PARAM, feedback=feedback)


def test_negative_controls_are_far_over_the_budget() -> None:
    got, _, _ = S.run_tree(clipjax.clip_norm_growth(), FINITE, S.flat_tree)
    errors = {}
    for label, kw in {"mul=1.4": {"mul": 1.4}, "raw": {"feedback": "raw"}}.items():
        want = G.clip_norm_growth(FINITE[:, 1], fix=False, **kw)
        t, w = got["clip_norm_growth/g1/threshold"], want["threshold"]
        both = np.isfinite(t) & np.isfinite(w)
        errors[label] = float(np.max(np.abs(t[both] / w[both] - 1)))
    assert min(errors.values()) > 100 * S.RTOL, errors


def test_fix_torchzero_divides_every_step_by_a_min_value_above_one() -> None:
    """**FIX**: ``denom = max(denom, min_value)`` divides every step once min_value > 1."""
    norms = FINITE[:, :1] * 10
    theirs = G.clip_norm_growth(norms[:, 0], min_value=2.0, fix=False)
    assert np.all(theirs["scale"][1:] <= 0.5)
    got, _, _ = S.run_tree(clipjax.clip_norm_growth(min_value=2.0), norms, S.flat_tree)
    S.compare(got, G.clip_norm_growth(norms[:, 0], min_value=2.0), "clip_norm_growth/g0/", FIELDS)
    assert np.mean(got["clip_norm_growth/g0/scale"] == 1) > 0.9


def test_fix_a_zero_first_norm_does_not_zero_the_second_step() -> None:
    """**FIX**: torchzero keeps a first norm of 0 unfloored, so the next step's bound is 0."""
    norms = np.array([[0.0], [1.0], [1.2], [1.5]])
    theirs = G.clip_norm_growth(norms[:, 0], fix=False)
    assert theirs["scale"][1] == 0.0
    got, _, _ = S.run_tree(clipjax.clip_norm_growth(), norms, S.flat_tree)
    S.compare(got, G.clip_norm_growth(norms[:, 0]), "clip_norm_growth/g0/", FIELDS)
    assert got["clip_norm_growth/g0/scale"][1] == pytest.approx(1.5e-4 / 1.0, rel=S.RTOL)


def test_fix_a_nan_norm_does_not_unclip_the_next_step() -> None:
    """**FIX**: torchzero's ``prev_norm`` turns NaN, and the step after it is not clipped."""
    norms = np.array([1.0, 1.0, np.nan, 50.0, 1.0])
    theirs = G.clip_norm_growth(norms, fix=False)
    assert theirs["scale"][3] == 1.0
    got, _, same = S.run_tree(clipjax.clip_norm_growth(), norms[:, None], S.flat_tree)
    assert got["clip_norm_growth/g0/scale"][3] == pytest.approx(1.5 / 50.0, rel=S.RTOL)
    assert bool(np.asarray(same["g0"])[2]) and got["clip_norm_growth/g0/nonfinite_count"][-1] == 1


SHAPES = {"a": (6,), "b": (3, 4), "c": (2, 2, 2)}


def ema_trace(steps: int = 150, nonfinite: dict[int, float] | None = None) -> list[dict]:
    grads = spiky_gradients(SHAPES, steps, seed=3, spikes={30: 40.0, 80: 300.0},
                            element_spikes={50: 1e3}, nonfinite=nonfinite, scale=0.1)  # fmt: skip
    # A slow drift of direction, so the EMA's norm is not only noise.
    drift = {k: 0.05 * np.ones(s, np.float32) for k, s in SHAPES.items()}
    return [{k: v + drift[k] for k, v in g.items()} for g in grads]


def run_ema(tx: Any, grads: list[dict]) -> tuple[list[dict], dict[str, np.ndarray]]:
    params = {k: jnp.zeros(s) for k, s in SHAPES.items()}
    state = tx.init(params)

    def step(state: Any, g: Any) -> Any:
        out, state = tx.update(g, state, params)
        return state, (out, clipjax.metrics(state))

    stacked = {k: jnp.asarray(np.stack([g[k] for g in grads])) for k in SHAPES}
    _, (outs, metrics) = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(state, stacked)
    outs = jax.device_get(outs)
    return [{k: outs[k][t] for k in SHAPES} for t in range(len(grads))], jax.device_get(metrics)


EMA_SETTINGS = [{}, {"beta": 0.9, "max_ema_growth": 1.1}, {"max_ema_growth": None, "init": 0.1}]


@pytest.mark.parametrize("settings", EMA_SETTINGS, ids=str)
@pytest.mark.parametrize("scope", ["per_param", "global"])
def test_ema_trace_equals_torchzero(scope: str, settings: dict) -> None:
    grads = ema_trace()
    ours, metrics = run_ema(clipjax.clip_norm_by_ema(scope=scope, **settings), grads)
    theirs, log = G.clip_norm_by_ema(grads, tensorwise=scope == "per_param", fix=False, **settings)
    worst = 0.0
    for a, b in zip(ours, theirs):
        for k in SHAPES:
            scale = np.max(np.abs(b[k]))
            worst = max(worst, float(np.max(np.abs(a[k] - b[k]))) / scale)
    assert worst <= S.RTOL, worst
    for group, want in log.items():
        prefix = f"clip_norm_by_ema/{group}/"
        for field in ("grad_norm", "threshold", "scale"):
            np.testing.assert_allclose(metrics[prefix + field], want[field], rtol=S.RTOL)
        # Negative control: the same updates through another beta.
        other, _ = G.clip_norm_by_ema(grads, tensorwise=scope == "per_param", fix=False,
                                      **{**settings, "beta": 0.95})  # fmt: skip
        assert max(np.max(np.abs(a[k] - b[k]) / np.max(np.abs(b[k])))
                   for a, b in zip(ours, other) for k in SHAPES) > 100 * S.RTOL  # fmt: skip


def test_fix_a_nan_update_leaves_the_ema_finite() -> None:
    """**FIX**: torchzero's EMA turns NaN for good; clipjax passes that step unchanged."""
    grads = ema_trace(60, nonfinite={20: np.nan})
    theirs, _ = G.clip_norm_by_ema(grads, fix=False)
    assert np.isnan(theirs[-1]["a"]).all()
    ours, metrics = run_ema(clipjax.clip_norm_by_ema(), grads)
    want, _ = G.clip_norm_by_ema(grads)
    for a, b in zip(ours, want):
        for k in SHAPES:
            np.testing.assert_allclose(a[k], b[k], rtol=S.RTOL, atol=1e-7)
    assert np.isfinite(ours[-1]["a"]).all()
    assert metrics["clip_norm_by_ema/a/nonfinite_count"][-1] == 1


def test_ema_growth_is_capped_per_step() -> None:
    tx = clipjax.clip_norm_by_ema(beta=0.5, max_ema_growth=1.5, scope="global")
    state = tx.init({"w": jnp.zeros(1)})
    seen = []
    for g in [1.0, 1.0, 1.0, 1000.0, 1000.0]:
        _, state = tx.update({"w": jnp.array([g])}, state)
        seen.append(float(clipjax.metrics(state)["clip_norm_by_ema/global/ema_norm"]))
    assert seen[3] == pytest.approx(1.5 * seen[2], rel=1e-6)
    assert seen[4] == pytest.approx(1.5 * seen[3], rel=1e-6)


GROWTH, EMA = clipjax.clip_norm_growth, clipjax.clip_norm_by_ema
BAD = [(GROWTH, {"mul": 0.0}, "mul"), (GROWTH, {"add": -1.0}, "add"),
       (GROWTH, {"mul": None, "add": None}, "add and mul"),
       (GROWTH, {"min_value": 0.0}, "min_value"), (GROWTH, {"max_decay": 0.5}, "max_decay"),
       (GROWTH, {"feedback": "clip_target"}, "feedback"), (GROWTH, {"scope": "per_leaf"}, "scope"),
       (GROWTH, {"name": ""}, "name"), (EMA, {"beta": 1.0}, "beta"),
       (EMA, {"max_ema_growth": 0.0}, "max_ema_growth"), (EMA, {"min_norm": -1.0}, "min_norm"),
       (EMA, {"init": float("nan")}, "init"), (EMA, {"scope": "per_leaf"}, "scope")]  # fmt: skip


@pytest.mark.parametrize(("factory", "kwargs", "argument"), BAD)
def test_bad_arguments_are_named(factory: Any, kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        factory(**kwargs)


@pytest.mark.parametrize("make", [clipjax.clip_norm_growth, clipjax.clip_norm_by_ema])
def test_inject_hyperparams(make: Any) -> None:
    tx = optax.inject_hyperparams(make, static_args=("scope",))(scope="global")
    params = {"w": jnp.zeros(3)}
    state = tx.init(params)
    for g in (1.0, 1.0, 30.0):
        out, state = jax.jit(tx.update)({"w": jnp.full(3, g)}, state, params)
    assert float(jnp.linalg.norm(out["w"])) < 30.0
