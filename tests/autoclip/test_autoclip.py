"""autoclip against smartclip's AutoClip core, and its FIXes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import drive
from tests import references as R
from tests import restate as S

needs_smartclip = pytest.mark.skipif(not R.have_smartclip(), reason="smartclip not installed")
STREAMS = {"spikes": lambda: R.spikes()[0], "regime_shift": R.regime_shift, "constant": R.constant}
RTOL = 3e-5
WARMUP = dict(warmup_steps=30, min_history=20)  # the reference traces' warm-up


@needs_smartclip
@pytest.mark.parametrize("stream", sorted(STREAMS))
@pytest.mark.parametrize(
    "window_size, percentile", [(50, 95.0), (7, 50.0), (1024, 99.0), (1, 100.0)]
)
def test_window_percentile_matches_smartclip(stream: str, window_size: int, percentile: float):
    norms = STREAMS[stream]()
    kw = dict(mode="percentile", history="window", window_size=window_size, percentile=percentile)
    kw.update(WARMUP)
    ref = R.smartclip_autoclip(norms, **kw)
    got = drive.run(clipjax.autoclip(**kw), norms)
    drive.assert_close(got["threshold"], ref["threshold"])
    drive.assert_close(got["scale"], ref["scale"])
    drive.assert_close(got["applied"], ref["scale"])
    drive.assert_close(got["quantile"], ref["quantile"])


@needs_smartclip
@pytest.mark.parametrize("stream", sorted(STREAMS))
def test_auto_mode_textbook_median_and_welford_std(stream: str) -> None:
    norms = STREAMS[stream]()
    got = drive.run(clipjax.autoclip(**WARMUP), norms)
    ref = R.smartclip_autoclip(norms, **WARMUP)
    median = S.p2_restated(norms, textbook=True)
    drive.assert_close(got["median"], median)
    drive.assert_close(got["std"][1:], ref["std"][1:])  # Welford ddof=1 as smartclip
    assert got["std"][0] == 0.0  # one sample: 0, not undefined
    drive.assert_close(got["threshold"], np.maximum(median + 3 * np.nan_to_num(ref["std"]), 1e-8))


@needs_smartclip
def test_fix_median_before_five_observations() -> None:
    norms = np.array([3.0, 1.0, 2.0, 10.0, 4.0, 5.0])
    got = drive.run(clipjax.autoclip(warmup_steps=1, min_history=1), norms)
    ref = R.smartclip_autoclip(norms, warmup_steps=1, min_history=1)
    np.testing.assert_allclose(got["median"][:4], [3.0, 2.0, 2.0, 2.5])
    assert (ref["threshold"][:4] == 1e-8).all(), "smartclip's threshold is eps before 5 samples"
    assert (got["threshold"][:4] > 1.0).all()


@needs_smartclip
def test_fix_streaming_quantile_comes_down() -> None:
    """smartclip's EMA quantile can only rise; clipjax's follows a 5x downward shift."""
    rng = np.random.default_rng(0)
    high = np.abs(rng.normal(5.0, 0.5, 3000))
    low = high / 5.0
    norms = np.r_[high, low[:5000]]
    kw = dict(mode="percentile", history="ema", percentile=95.0, ema_decay=0.99)
    got = drive.run(clipjax.autoclip(**kw), norms)
    ref = R.smartclip_autoclip(norms, **kw)
    true_low = np.percentile(low, 95)
    assert abs(got["quantile"][-1] / true_low - 1) < 0.2
    assert abs(got["quantile"][2999] / np.percentile(high, 95) - 1) < 0.05
    assert ref["quantile"][-1] >= ref["quantile"][2999], "reference never decreases"
    assert ref["quantile"][-1] / true_low > 4


def test_observe_then_clip_spike_raises_its_own_threshold() -> None:
    """SPEC 4.1 note: with 200 samples of history a x1000 spike passes at about a fifth."""
    rng = np.random.default_rng(0)
    norms = np.r_[np.abs(rng.normal(1.0, 0.05, 200)), [1000.0]]
    auto = drive.run(clipjax.autoclip(), norms)
    passed = auto["applied"][-1] * 1000.0
    assert 100.0 < passed < 400.0
    window = drive.run(clipjax.autoclip(mode="percentile"), norms)
    assert window["applied"][-1] * 1000.0 < 2.0  # the window percentile stops it


def test_nan_never_enters_the_statistics() -> None:
    clean = R.spikes()[0]
    for kw in [{}, {"mode": "percentile"}, {"mode": "percentile", "history": "ema"}]:
        tx = clipjax.autoclip(**kw)
        got = drive.run(tx, R.with_nan(clean, at=70))
        skip = drive.run(tx, np.delete(clean, 70))
        np.testing.assert_allclose(got["threshold"][71:], skip["threshold"][70:], rtol=1e-6)
        assert got["nonfinite_count"][-1] == 1 and got["scale"][70] == 1.0


@needs_smartclip
def test_guard_nans_false_reproduces_smartclip_unguarded() -> None:
    """SPEC 8.3: unguarded, NaN enters as eps (smartclip's ensure_positive) and inf as inf."""
    norms = R.with_nan(R.with_nan(R.spikes(200)[0], at=40), at=90, value=np.inf)
    kw = dict(
        mode="percentile",
        history="window",
        window_size=20,
        warmup_steps=10,
        min_history=10,
        guard_nans=False,
    )
    got = drive.run(clipjax.autoclip(**kw), norms)
    ref = R.smartclip_autoclip(norms, **kw)
    assert got["count"][-1] == 200
    finite = np.isfinite(norms)
    drive.assert_close(got["threshold"], ref["threshold"])
    np.testing.assert_allclose(got["scale"][finite], ref["scale"][finite], rtol=RTOL)
    assert got["scale"][40] == 1.0 and got["scale"][90] == 1.0  # the gradient itself passes


def test_gate_counts_per_group() -> None:
    """FIX: each group's warm-up counts its own observations (smartclip: one per group per call)."""
    norms = np.stack([R.constant(12, 1.0), R.constant(12, 1.0)], axis=1)
    norms[-1] = 50.0
    got = drive.run(clipjax.autoclip(scope="per_param", warmup_steps=12, min_history=12), norms)
    assert (got["scale"][:-1] == 1.0).all()
    assert (got["scale"][-1] < 1.0).all()
    got = drive.run(clipjax.autoclip(scope="per_param", warmup_steps=13, min_history=1), norms)
    assert (got["scale"] == 1.0).all()


@pytest.mark.parametrize("kwargs, arg", [
    ({"percentile": 0.0}, "percentile"), ({"percentile": 101.0}, "percentile"),
    ({"window_size": 0}, "window_size"), ({"ema_decay": 1.0}, "ema_decay"), ({"mode": "x"}, "mode"),
    ({"history": "x"}, "history"), ({"eps": 0.0}, "eps"), ({"warmup_steps": -1}, "warmup_steps"),
])  # fmt: skip
def test_invalid_hyperparameters(kwargs: dict, arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        clipjax.autoclip(**kwargs)


@pytest.mark.parametrize("kwargs, arg", [
    ({"percentile": 90.0}, "percentile"), ({"window_size": 50}, "window_size"),
    ({"ema_decay": 0.9}, "ema_decay"), ({"mode": "percentile", "quantile_lr": 0.1}, "quantile_lr"),
    ({"mode": "percentile", "history": "geometric", "window_size": 64}, "window_size"),
    # Issue 37: at their default values they used to be accepted.
    ({"percentile": 95.0}, "percentile"), ({"ema_decay": 0.99}, "ema_decay"),
    ({"quantile_lr": 0.2}, "quantile_lr"), ({"mode": "percentile", "ema_decay": 0.99}, "ema_decay"),
    ({"mode": "percentile", "history": "ema", "quantile_lr": 0.2}, "quantile_lr"),
])  # fmt: skip
def test_an_argument_without_effect_in_the_mode_names_itself(kwargs, arg) -> None:
    with pytest.raises(ValueError, match=f"{arg}=.* has no effect with mode="):
        clipjax.autoclip(**kwargs)


def test_auto_mode_ema_history_says_what_smartclip_does() -> None:
    with pytest.raises(ValueError, match="smartclip accepts history='ema' in auto mode"):
        clipjax.autoclip(mode="auto", history="ema")


@pytest.mark.parametrize("mode", ["auto", "percentile"])
def test_injected_defaults_are_not_taken_for_other_values(mode) -> None:
    """optax.inject_hyperparams turns every numeric default into a float32 array: autoclip
    takes them for its defaults (no "has no effect" error for an argument the user never
    passed) and clips as the plain autoclip(mode=mode) does, step by step."""
    kw = dict(mode=mode, warmup_steps=3, min_history=3)  # past the warm-up within the run
    injected = optax.inject_hyperparams(clipjax.autoclip, static_args=("window_size",))(**kw)
    plain = clipjax.autoclip(**kw)
    params = {"w": jnp.zeros(2)}
    state, plain_state = injected.init(params), plain.init(params)
    update, plain_update = jax.jit(injected.update), jax.jit(plain.update)
    for x in [*(1.0 + 0.1 * np.sin(np.arange(20.0))), 1000.0, 1.05]:
        grads = {"w": jnp.array([x, -0.5 * x])}
        out, state = update(grads, state, params)
        expected, plain_state = plain_update(grads, plain_state, params)
        np.testing.assert_allclose(out["w"], expected["w"], rtol=1e-6)
        if x == 1000.0:  # the comparison covers a clipped step
            assert clipjax.metrics(plain_state)["autoclip/global/clipped"]
    m, want = clipjax.metrics(state), clipjax.metrics(plain_state)
    assert m.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(m[key], want[key], rtol=1e-6, err_msg=key)


@pytest.mark.parametrize("fraction", [0.95, 0.5, 1.0, 1])
def test_a_percentile_that_looks_like_a_fraction_is_refused(fraction) -> None:
    """Issue 37: autoclip(mode="percentile", percentile=0.95) meant the 95th."""
    with pytest.raises(ValueError, match=r"0-100 scale; did you mean a fraction.*Pass percentile="):
        clipjax.autoclip(mode="percentile", percentile=fraction)


def test_percentile_range_and_its_default() -> None:
    for bad in (0.0, -5.0, 100.5, float("nan")):
        with pytest.raises(ValueError, match=r"percentile must be in \(1, 100\]"):
            clipjax.autoclip(mode="percentile", percentile=bad)
    clipjax.autoclip(mode="percentile", percentile=1.5)
    params = {"w": jnp.zeros(2)}
    # None is the 95th percentile.
    kw = dict(mode="percentile", window_size=8, warmup_steps=1, min_history=1)
    implicit, explicit = clipjax.autoclip(**kw), clipjax.autoclip(percentile=95.0, **kw)
    states = [tx.init(params) for tx in (implicit, explicit)]
    for x in [1.0, 2.0, 3.0, 10.0]:
        g = {"w": jnp.array([x, 0.0])}
        states = [tx.update(g, s)[1] for tx, s in zip((implicit, explicit), states)]
    a, b = (clipjax.metrics(s) for s in states)
    assert a["autoclip/global/quantile"] == b["autoclip/global/quantile"]
