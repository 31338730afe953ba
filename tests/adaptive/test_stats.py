"""clipjax._stats, the stacked streaming statistics, against smartclip's pure-Python
estimators and float64 restatements, through ``lax.scan`` (one compile per test)."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sc = pytest.importorskip("smartclip.core.stats", reason="needs smartclip (a test reference)")

from clipjax import _stats as S
from tests.restate.p2 import p2_restated


@functools.cache
def _scanner(update, read):
    def scan(state, xs, *args):
        def step(carry, x):
            carry = update(carry, x, *args)
            return carry, read(carry, *args)

        return jax.lax.scan(step, state, xs)

    return jax.jit(scan)


def run(update, state, xs, read, *args):
    """``xs`` ([T] or [T, G]) through ``update(state, x, *args)``: the final state and
    ``read(state, *args)`` after every step (one compile per (update, read) pair)."""
    dtype = next(
        leaf.dtype for leaf in jax.tree.leaves(state) if jnp.issubdtype(leaf.dtype, jnp.floating)
    )
    xs = jnp.asarray(xs, dtype)
    if xs.ndim == 1:
        xs = xs[:, None]
    return _scanner(update, read)(state, xs, *args)


def assert_same_structure(before, after):
    assert type(before) is type(after)
    assert jax.tree.structure(before) == jax.tree.structure(after)
    for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
        assert a.shape == b.shape and a.dtype == b.dtype


p2_textbook = lambda state, x, p: S.p2_update(state, x, p, textbook=True)
p2_smartclip = lambda state, x, p: S.p2_update(state, x, p, textbook=False)
p2_read = lambda state, p: S.p2_value(state)
window_push = lambda state, x, percentile: S.window_update(state, x)
ema_read = lambda state, decay: S.ema_moments_std(state)
squantile_read = lambda state, q, decay: S.squantile_value(state)


def _ref_trace(ref, xs, push, read):
    """A smartclip estimator's value after each of ``xs``."""
    out = []
    for x in xs:
        getattr(ref, push)(x)
        out.append(read(ref))
    return out


# Each entry: init(G, dtype), update(state, x, *args), read(state, *args), args.
STATS = {
    "welford": (S.welford_init, S.welford_update, S.welford_std, ()),
    "p2": (lambda g, dt: S.p2_init(g, 0.5, dt), p2_textbook, p2_read, (0.5,)),
    "p2_smartclip": (lambda g, dt: S.p2_init(g, 0.9, dt), p2_smartclip, p2_read, (0.9,)),
    "ema": (S.ema_moments_init, S.ema_moments_update, ema_read, (0.9,)),
    "window": (lambda g, dt: S.window_init(g, 6, dt), window_push, S.window_percentile, (80.0,)),
    "squantile": (S.squantile_init, S.squantile_update, squantile_read, (0.95, 0.9)),
}


@pytest.mark.parametrize("name", sorted(STATS))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_state_structure_never_changes(name, dtype, x64):
    init, update, read, args = STATS[name]
    state = init(3, jnp.dtype(dtype))
    assert state.count.dtype == jnp.int32
    floats = [leaf for leaf in jax.tree.leaves(state) if leaf.dtype != jnp.int32]
    assert floats and all(leaf.dtype == jnp.dtype(dtype) for leaf in floats)
    assert all(leaf.shape[0] == 3 for leaf in jax.tree.leaves(state))
    xs = np.random.default_rng(0).lognormal(size=(40, 3))
    after, reads = run(update, state, xs, read, *args)
    assert_same_structure(state, after)
    assert reads.shape == (40, 3) and reads.dtype == jnp.dtype(dtype)
    assert np.isfinite(np.asarray(reads)).all()


def test_state_classes_are_unique_and_documented():
    classes = [
        S.WelfordState,
        S.P2State,
        S.EmaMomentsState,
        S.WindowState,
        S.StreamingQuantileState,
    ]
    assert len({c.__name__ for c in classes}) == len(classes)
    for cls in classes:
        assert "Attributes:" in cls.__doc__
        assert all(field in cls.__doc__ for field in cls._fields)


@pytest.mark.parametrize("name", sorted(STATS))
def test_groups_are_independent(name):
    init, update, read, args = STATS[name]
    rng = np.random.default_rng(1)
    xs = np.stack([rng.lognormal(size=40), rng.normal(5, 2, 40), rng.uniform(size=40)], axis=1)
    _, together = run(update, init(3, jnp.float32), xs, read, *args)
    for g in range(3):
        _, alone = run(update, init(1, jnp.float32), xs[:, g], read, *args)
        np.testing.assert_array_equal(np.asarray(together)[:, g], np.asarray(alone)[:, 0])


def test_empty_states_read_zero():
    for init, _, read, args in STATS.values():
        value = jax.jit(read)(init(2, jnp.float32), *args)
        np.testing.assert_array_equal(value, np.zeros(2, np.float32))


def test_welford_matches_smartclip_and_numpy(x64):
    xs = np.random.default_rng(2).lognormal(0, 1, 300)
    final, stds = run(S.welford_update, S.welford_init(1, jnp.float64), xs, S.welford_std)
    expected = _ref_trace(sc.WelfordVariance(), xs, "update", lambda r: r.std or 0.0)
    np.testing.assert_allclose(stds[:, 0], expected, rtol=1e-12)
    assert stds[0, 0] == 0.0
    np.testing.assert_allclose(final.mean[0], xs.mean(), rtol=1e-12)
    np.testing.assert_allclose(stds[-1, 0], xs.std(ddof=1), rtol=1e-12)
    assert final.count[0] == 300


def p2_run(xs, p, textbook, dtype):
    return run(p2_textbook if textbook else p2_smartclip, S.p2_init(1, p, dtype), xs, p2_read, p)


@pytest.mark.parametrize("p", [0.5, 0.9, 0.25])
def test_p2_smartclip_mode_matches_smartclip_float64(p, x64):
    xs = np.random.default_rng(3).lognormal(0, 1, 2000)
    _, values = p2_run(xs, p, False, jnp.float64)
    expected = _ref_trace(sc.P2Quantile(p), xs, "update", lambda r: r.value)
    np.testing.assert_allclose(values[4:, 0], expected[4:], rtol=1e-12)


def test_p2_smartclip_mode_matches_smartclip_float32():
    xs = np.random.default_rng(4).lognormal(0, 1, 2000).astype(np.float32)
    _, values = p2_run(xs, 0.5, False, jnp.float32)
    expected = _ref_trace(sc.P2Quantile(0.5), map(float, xs), "update", lambda r: r.value)
    np.testing.assert_allclose(values[-1, 0], expected[-1], rtol=1e-5)
    assert values.dtype == jnp.float32


@pytest.mark.parametrize("p", [0.5, 0.9])
def test_p2_textbook_matches_reference(p, x64):
    xs = np.random.default_rng(5).gamma(2.0, 1.0, 2000)
    expected = p2_restated(xs, p, textbook=True)  # Jain & Chlamtac (1985), float64
    _, values = p2_run(xs, p, True, jnp.float64)
    np.testing.assert_allclose(values[:, 0], expected, rtol=1e-12)
    _, values32 = p2_run(xs.astype(np.float32), p, True, jnp.float32)
    # float32 desired positions are exact only for dyadic increments (p = 0.5);
    # for p = 0.9 their rounding moves markers on different steps.
    np.testing.assert_allclose(values32[-1, 0], expected[-1], rtol=1e-5 if p == 0.5 else 1e-2)
    # The two formulas really differ (why clipjax does not use smartclip's).
    _, buggy = p2_run(xs, p, False, jnp.float64)
    assert not np.allclose(buggy[:, 0], expected, rtol=1e-6)


def test_p2_warmup_is_exact_median():
    xs = np.array([3.0, -1.0, 7.0, 2.0, 2.5, 10.0])
    _, values = p2_run(xs, 0.5, True, jnp.float32)
    expected = [np.median(xs[: k + 1]) for k in range(5)]
    np.testing.assert_array_equal(values[:5, 0], np.asarray(expected, np.float32))
    assert values[4, 0] == 2.5


def test_p2_textbook_tracks_true_median():
    rng = np.random.default_rng(6)
    n = 10_000
    xs = np.stack(
        [rng.lognormal(0, 1, n), rng.normal(3, 1, n), rng.exponential(1, n), rng.uniform(0, 1, n)],
        axis=1,
    )
    init = S.p2_init(4, 0.5)
    _, values = run(p2_textbook, init, xs, p2_read, 0.5)
    _, buggy = run(p2_smartclip, init, xs, p2_read, 0.5)
    error = np.abs(np.asarray(values[-1]) / np.median(xs, axis=0) - 1)
    assert error.max() < 0.02, error
    # smartclip's parabola overshoots on skewed streams (lognormal: +40 %).
    assert np.abs(np.asarray(buggy[-1]) / np.median(xs, axis=0) - 1).max() > 0.2


def test_ema_moments_match_smartclip(x64):
    xs = np.random.default_rng(7).lognormal(0, 1, 500)
    final, stds = run(S.ema_moments_update, S.ema_moments_init(1, jnp.float64), xs, ema_read, 0.97)
    ref = sc.EmaMoments(0.97)
    expected = _ref_trace(ref, xs, "update", lambda r: r.std())
    np.testing.assert_allclose(stds[:, 0], expected, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(final.mean[0], ref.mean(), rtol=1e-12)
    assert stds[0, 0] == 0.0


def test_ema_variance_does_not_cancel_in_float32():
    d = 0.99
    xs = (
        (1e4 + np.random.default_rng(8).normal(0, 0.05, 3000)).astype(np.float32).astype(np.float64)
    )
    exact_mean, exact_var = xs[0], 0.0
    m32, m2_32 = np.float32(xs[0]), np.float32(xs[0]) ** 2
    for x in xs[1:]:
        exact_var = d * exact_var + d * (1 - d) * (x - exact_mean) ** 2
        exact_mean = d * exact_mean + (1 - d) * x
        m32 = np.float32(d) * m32 + np.float32(1 - d) * np.float32(x)
        m2_32 = np.float32(d) * m2_32 + np.float32(1 - d) * np.float32(x) ** 2
    _, stds = run(S.ema_moments_update, S.ema_moments_init(1), xs, ema_read, d)
    np.testing.assert_allclose(stds[-1, 0], math.sqrt(exact_var), rtol=1e-3)
    # smartclip's m2 - m² in float32 is off by orders of magnitude here.
    naive = math.sqrt(max(float(m2_32) - float(m32) ** 2, 0.0))
    assert abs(naive / math.sqrt(exact_var) - 1) > 10


def window_run(xs, size, percentile, dtype=jnp.float32):
    return run(window_push, S.window_init(1, size, dtype), xs, S.window_percentile, percentile)


@pytest.mark.parametrize("size", [1, 7, 64])
def test_window_matches_smartclip_and_numpy(size, x64):
    rng = np.random.default_rng(9)
    xs = np.round(rng.lognormal(0, 1, 300), 1)  # many duplicates
    for pct in (0.5, 50.0, 95.0, 100.0):
        final, values = window_run(xs, size, pct, jnp.float64)
        expected = _ref_trace(
            sc.RollingWindow(size), xs, "append", lambda r, p=pct: r.percentile(p)
        )
        numpy_expected = [np.percentile(xs[max(0, t - size + 1) : t + 1], pct) for t in range(300)]
        np.testing.assert_allclose(values[:, 0], expected, rtol=1e-12)
        np.testing.assert_allclose(values[:, 0], numpy_expected, rtol=1e-12)
    np.testing.assert_array_equal(final.sorted[0], np.sort(xs[-size:]))
    np.testing.assert_array_equal(np.sort(final.values[0]), np.sort(xs[-size:]))


def test_window_float32_matches_smartclip_to_spec_tolerance():
    """Float32 thresholds within 3e-5 of smartclip's float64 ones."""
    rng = np.random.default_rng(12)
    xs = rng.lognormal(0, 0.3, 1500) * np.where(rng.uniform(size=1500) < 0.02, 20.0, 1.0)
    xs = xs.astype(np.float32)
    for pct in (99.0, 95.0, 50.0):
        _, values = window_run(xs, 1024, pct)
        ref = sc.RollingWindow(1024)
        expected = _ref_trace(ref, map(float, xs), "append", lambda r, p=pct: r.percentile(p))
        np.testing.assert_allclose(values[:, 0], expected, rtol=3e-5)


@settings(max_examples=30, deadline=None)
@given(
    xs=st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.5, 2.0, 7.25, 1e3]), min_size=40, max_size=40),
    pct=st.floats(0.1, 100.0),
)
def test_window_percentile_property(xs, pct):
    final, values = window_run(np.asarray(xs), 9, pct)
    expected = [np.percentile(np.float32(xs[max(0, t - 8) : t + 1]), pct) for t in range(40)]
    np.testing.assert_allclose(values[:, 0], expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(final.sorted[0], np.sort(np.float32(xs[-9:])))


def squantile_reference(xs, q, decay):
    """The documented estimator restated in float64 NumPy."""
    a = 1 - decay
    p = min(max(q, a), 1 - a)
    gain = 0.2 * a / min(p, 1 - p)
    b = a / 8
    r, spread, spread_w, avg, avg_w = float(xs[0]), 0.0, 0.0, 0.0, 0.0
    out = [r]
    for x in xs[1:]:
        scale = spread / spread_w if spread_w > 0 else 0.0
        new = r + gain * scale * (p - float(x < r))
        spread, spread_w = (1 - a) * spread + a * abs(x - r), (1 - a) * spread_w + a
        r = new
        avg, avg_w = (1 - b) * avg + b * r, (1 - b) * avg_w + b
        out.append(avg / avg_w)
    return np.array(out)


def squantile_run(xs, q=0.95, decay=0.99, dtype=jnp.float32):
    xs = np.asarray(xs)
    init = S.squantile_init(1 if xs.ndim == 1 else xs.shape[1], dtype)
    return run(S.squantile_update, init, xs, squantile_read, q, decay)


def test_squantile_matches_reference(x64):
    xs = np.random.default_rng(10).lognormal(0, 0.5, 3000)
    for q, decay in [(0.95, 0.99), (0.5, 0.9), (0.1, 0.98), (1.0, 0.99)]:
        expected = squantile_reference(xs, q, decay)
        _, values = squantile_run(xs, q, decay, jnp.float64)
        np.testing.assert_allclose(values[:, 0], expected, rtol=1e-10)
    _, values32 = squantile_run(xs.astype(np.float32))
    np.testing.assert_allclose(
        values32[:, 0], squantile_reference(xs.astype(np.float32), 0.95, 0.99), rtol=1e-4
    )


def test_squantile_starts_at_first_value_and_is_scale_free():
    xs = np.random.default_rng(11).lognormal(0, 0.3, 500).astype(np.float32)
    final, values = squantile_run(xs)
    assert values[0, 0] == xs[0]
    for c in (4.0, 0.125):  # powers of two: scaling is exact
        scaled, scaled_values = squantile_run(xs * np.float32(c))
        np.testing.assert_array_equal(scaled_values, values * np.float32(c))
        for field in ("estimate", "spread", "average"):
            np.testing.assert_array_equal(
                getattr(scaled, field), getattr(final, field) * np.float32(c)
            )
        np.testing.assert_array_equal(scaled.average_weight, final.average_weight)


STATIONARY = {
    "abs_normal": lambda rng, n: np.abs(rng.normal(1, 0.2, n)),
    "lognormal": lambda rng, n: rng.lognormal(0, 0.25, n),
    "uniform": lambda rng, n: rng.uniform(0.5, 1.5, n),
    "gamma9": lambda rng, n: rng.gamma(9, 1 / 9, n),
}
SEEDS = range(5)


@pytest.fixture(scope="module")
def streams():
    """[T, G] streams, G = distributions x seeds, and their true 0.95-quantiles."""
    n = 10_000
    cols, true = [], []
    for draw in STATIONARY.values():
        true_q = np.quantile(draw(np.random.default_rng(1234), 2_000_000), 0.95)
        for seed in SEEDS:
            cols.append(draw(np.random.default_rng(seed), n + 6_000))
            true.append(true_q)
    return np.stack(cols, axis=1).astype(np.float32), np.asarray(true)


def test_squantile_converges_on_stationary_streams(streams):
    """Within 5 % of the true 0.95-quantile (decay 0.99)."""
    xs, true = streams
    _, values = squantile_run(xs[:10_000])
    final = np.abs(values[-1] / true - 1)
    last = np.abs(np.asarray(values[-2000:]).mean(axis=0) / true - 1)
    assert final.max() < 0.05, final
    assert last.max() < 0.05, last
    assert np.median(final) < 0.02


@pytest.mark.parametrize("decay", [0.99, 0.95])
@pytest.mark.parametrize("factor", [0.2, 5.0])
def test_squantile_follows_a_shift(streams, factor, decay):
    """Within 20 % of the new quantile by 50/(1-decay) steps after."""
    xs, true = streams
    shifted = xs.copy()
    shifted[10_000:] *= np.float32(factor)
    _, values = squantile_run(shifted, decay=decay)
    after = np.abs(np.asarray(values[10_000:]) / (factor * true) - 1)
    bound = round(50 / (1 - decay))
    assert (after[bound:] < 0.2).all(), after[bound:].max()
    assert (after[: bound // 50] > 0.2).all()  # it is a real shift, not instant


def test_smartclip_ema_quantile_never_decreases(streams):
    """smartclip's q += a(x-q)(p-1[x<q]) fails the down-shift test; ours passes."""
    xs, true = streams
    stream = xs[:, 0].astype(np.float64)
    stream[10_000:] *= 0.2
    ref = sc.EmaQuantile(0.95, 0.01)
    trace = np.array([ref.update(x) for x in stream])
    assert (np.diff(trace) >= 0).all()
    assert trace[15_000] > 1.2 * 0.2 * true[0]
    _, ours = squantile_run(stream[:15_001].astype(np.float32))
    assert abs(ours[15_000, 0] / (0.2 * true[0]) - 1) < 0.2
