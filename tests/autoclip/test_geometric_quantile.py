"""autoclip(mode="percentile", history="geometric"): a quantile tracked in log space.

``q <- q * exp(-quantile_lr * (1[x <= q] - p))`` from the first finite norm
(Andrew et al. 2021). Checked step by step against the float64 restatement in
``tests/restate/autoclip.py``, then statistically: convergence on stationary light- and
heavy-tailed streams and tracking of a drifting scale.

Long streams run as one ``lax.scan`` with ``scope="per_param"``: each of the
``SEEDS`` leaves is an independent stream (its own group), so one compile covers
all seeds.

Measured with the float64 restatement (8 seeds, 8000 steps, p = 0.95), which
sets the tolerances below with about 1.3-2x headroom:

====================  =========================  ===========================
stream                lr=0.05: rel. err / rank   lr=0.2: rel. err / rank
====================  =========================  ===========================
|N(1, 0.2)|           1.7% / 0.011               5.0% / 0.026
uniform(0, 1)         0.5% / 0.004               2.8% / 0.027
lognormal(0, 1)       6.4% / 0.006               7.9% / 0.007
Pareto(2.5) (x_m=1)   11.2% / 0.012              11.8% / 0.012
====================  =========================  ===========================

"rel. err" is that of the geometric mean of q over the second half; "rank" is
``|F(that value) - p|`` with F the true CDF. The heavy-tailed value errors are
large because the density at the 95th percentile is low (a rank error of ~1%
is a value error of ~10%): the rank error is the honest measure there. The
coverage ``mean(x_t <= q_{t-1})`` is p up to ``|log(q_T / q_0)| / (lr T)``
(an identity of the update: log q is a sum of ``-lr (1[x<=q] - p)``); measured
within 5e-4 of p at both rates.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax
from tests import references as R
from tests import restate as S

P = 0.95
SEEDS = 8
STEPS = 8000
# Exact quantiles of the stationary streams (closed form where there is one).
_Z95 = 1.6448536269514722
DISTS = {
    # |N(1, 0.2)|: P(|X| < 0) is ~3e-7, so the 95th percentile is that of N(1, 0.2)
    "abs_normal": (lambda r, n: np.abs(r.normal(1.0, 0.2, n)), 1.0 + 0.2 * _Z95, "light"),
    "uniform": (lambda r, n: r.uniform(0.0, 1.0, n), P, "light"),
    "lognormal": (lambda r, n: r.lognormal(0.0, 1.0, n), math.exp(_Z95), "heavy"),
    "pareto": (lambda r, n: r.pareto(2.5, n) + 1.0, (1 - P) ** (-1 / 2.5), "heavy"),
}
CDF = {
    "abs_normal": lambda q: 0.5 * (1 + math.erf((q - 1.0) / (0.2 * math.sqrt(2)))),
    "uniform": lambda q: q,
    "lognormal": lambda q: 0.5 * (1 + math.erf(math.log(q) / math.sqrt(2))),
    "pareto": lambda q: 1 - q ** (-2.5),
}
# (relative error of the second-half geometric mean, rank error) allowed, per
# tail and quantile_lr; see the module docstring for the measured values.
TOL = {("light", 0.05): (0.03, 0.02), ("heavy", 0.05): (0.15, 0.02),
       ("light", 0.2): (0.08, 0.04), ("heavy", 0.2): (0.15, 0.02)}  # fmt: skip


def _tx(quantile_lr=0.2, scope="per_param"):
    kw = dict(percentile=100 * P, quantile_lr=quantile_lr, scope=scope, warmup_steps=1)
    return clipjax.autoclip(mode="percentile", history="geometric", min_history=1, **kw)


def _quantiles(tx, x):
    """q_t per step and stream, ``[steps, SEEDS]``, from one scan."""
    got, _, _ = S.run_tree(tx, x, S.flat_tree)
    return np.stack([got[f"autoclip/g{i}/quantile"] for i in range(x.shape[1])], axis=1)


@pytest.mark.parametrize("quantile_lr, percentile", [(0.2, 95.0), (0.05, 50.0), (0.5, 99.0)])
def test_matches_restatement_step_by_step(quantile_lr, percentile):
    norms = R.with_nan(R.with_nan(R.spikes(300, 4)[0], [0, 3, 150]), 160, math.inf)
    kw = dict(mode="percentile", history="geometric", percentile=percentile,
              quantile_lr=quantile_lr, warmup_steps=30, min_history=20)  # fmt: skip
    want = S.autoclip(norms, **kw)  # observe_first: the default
    got, (outs, ins), same = S.run_tree(clipjax.autoclip(**kw), norms[:, None], S.flat_tree)
    # the stream starts with a NaN: the quantile starts at the first *finite* norm
    assert np.isnan(want["quantile"][0]) and want["quantile"][1] == norms[1]
    S.compare(got, want, "autoclip/global/")
    finite = np.isfinite(norms)
    np.testing.assert_allclose(outs["g0"][finite] / ins["g0"][finite], want["scale"][finite],
                               rtol=S.RTOL)  # fmt: skip
    assert np.all(same["g0"][~finite])


def test_threshold_is_quantile_floored_at_eps():
    eps = 1e-3
    norms = np.concatenate([[1e-5], np.full(40, 1e-6)])
    tx = clipjax.autoclip(mode="percentile", history="geometric", warmup_steps=1,
                          min_history=1, eps=eps)  # fmt: skip
    got, _, _ = S.run_tree(tx, norms[:, None], S.flat_tree)
    q = got["autoclip/global/quantile"]
    np.testing.assert_allclose(got["autoclip/global/threshold"], np.maximum(q, eps), rtol=S.RTOL)
    assert q[0] == pytest.approx(1e-5, rel=1e-6)


@pytest.mark.parametrize("quantile_lr", [0.05, 0.2])
@pytest.mark.parametrize("dist", sorted(DISTS))
def test_converges_to_the_true_quantile(dist, quantile_lr):
    gen, true_q, tail = DISTS[dist]
    x = gen(np.random.default_rng(0), (STEPS, SEEDS))
    q = _quantiles(_tx(quantile_lr), x)
    assert np.all(np.isfinite(q)) and np.all(q > 0)
    half = q[STEPS // 2 :]
    avg = np.exp(np.log(half).mean(axis=0))  # one value per seed
    rel_tol, rank_tol = TOL[(tail, quantile_lr)]
    rel = np.abs(avg / true_q - 1)
    rank = np.abs(np.array([CDF[dist](v) for v in avg]) - P)
    assert rel.max() < rel_tol, (rel.max(), rel)
    assert rank.max() < rank_tol, (rank.max(), rank)
    # coverage of the pre-step quantile: p up to |log(q_T/q_0)|/(lr T) (module docstring)
    cover = np.mean(x[STEPS // 2 :] <= q[STEPS // 2 - 1 : -1], axis=0)
    assert np.abs(cover - P).max() < 0.005, cover


@pytest.mark.parametrize("quantile_lr", [0.05, 0.2])
def test_follows_a_5x_downward_shift(quantile_lr):
    """q must fall ln 5 in log space; the fastest it can is lr (1 - p) per step
    (every norm below q), i.e. ln5 / (lr (1-p)) = 161 steps at lr 0.2, 644 at
    0.05. Allowing N = twice that, the 200-step geometric mean of q from step
    shift + N on is within X = 20% of the new quantile (measured in float64:
    <= 10.2% at lr 0.2, <= 5.8% at 0.05; the pointwise value still swings
    +-35% at lr 0.2, which is why a window mean is checked)."""
    shift = 3000
    x = np.abs(np.random.default_rng(1).normal(1.0, 0.2, (6000, SEEDS)))
    x[shift:] /= 5.0
    new_q = (1.0 + 0.2 * _Z95) / 5.0
    q = _quantiles(_tx(quantile_lr), x)
    n = math.ceil(2 * math.log(5.0) / (quantile_lr * (1 - P)))
    window = q[shift + n : shift + n + 200]
    avg = np.exp(np.log(window).mean(axis=0))
    assert np.abs(avg / new_q - 1).max() < 0.20, avg / new_q
    # and it is well on its way down before that: below the old level in n/2 steps
    assert np.all(q[shift + n // 2] < 1.0 + 0.2 * _Z95)


@pytest.mark.parametrize("quantile_lr", [0.05, 0.2])
def test_follows_a_slow_exponential_drift(quantile_lr):
    """Scale exp(-t/2000) over 8000 steps (a factor 55 decline): after 1000 steps
    every 200-step geometric mean of q / true quantile is within 20% of 1
    (measured in float64: <= 11.6% at lr 0.2, <= 10.1% at 0.05)."""
    tau, steps = 2000.0, 8000
    t = np.arange(steps)[:, None]
    x = np.abs(np.random.default_rng(1).normal(1.0, 0.2, (steps, SEEDS))) * np.exp(-t / tau)
    true_q = (1.0 + 0.2 * _Z95) * np.exp(-t / tau)
    q = _quantiles(_tx(quantile_lr), x)
    ratio = np.log(q / true_q)
    for a in range(1000, steps - 200 + 1, 200):
        dev = np.abs(np.exp(ratio[a : a + 200].mean(axis=0)) - 1)
        assert dev.max() < 0.20, (a, dev)


@pytest.mark.parametrize("quantile_lr", [0.0, -0.1, -1.0])
def test_quantile_lr_must_be_positive(quantile_lr):
    with pytest.raises(ValueError, match="quantile_lr"):
        clipjax.autoclip(mode="percentile", history="geometric", quantile_lr=quantile_lr)


def test_geometric_rejects_skip_and_accepts_the_rest():
    with pytest.raises(ValueError, match="feedback"):
        clipjax.autoclip(mode="percentile", history="geometric", feedback="skip")
    for fb in ("observe_first", "raw", "clipped"):
        clipjax.autoclip(mode="percentile", history="geometric", feedback=fb)


def test_geometric_state_is_stable_under_jit():
    tx = _tx(0.2, scope="global")
    params = {"w": jnp.ones(4)}
    state = tx.init(params)
    shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(state)]
    for v in (1.0, 2.0, float("nan"), 0.5):
        _, state = jax.jit(tx.update)({"w": jnp.full(4, v)}, state)
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(state)] == shapes
