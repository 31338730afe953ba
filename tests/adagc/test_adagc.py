"""clipjax.adagc (SPEC 9.3 + CONTRACT) against the float64 restatement ``restate.adagc``.

Per group i, warm-up (its first ``warmup_steps`` finite observations): global
clipping ``h = min(1, A / (G + eps))`` with G the L2 norm over the groups whose
norm is finite this step, ``gamma_i <- min(gamma_i, h g_i)``; after:
``T_i = r gamma_i`` (before the step), ``scale_i = min(1, T_i / (g_i + eps))``,
``gamma_i <- beta gamma_i + (1 - beta) x_i`` (x = scale g "clipped", g "raw",
nothing and no count on a fire "skip"). Tolerance rtol 3e-5 (SPEC 8.14), counters exact.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import references as R
from tests import restate as S

N = 200
WARMUP = 10
KW = dict(warmup_steps=WARMUP, relative_threshold=1.05, beta=0.9, absolute_threshold=2.0)

# three groups: different scales, spikes at different steps, NaN/Inf in and after warm-up
SPIKES = [(40, 90, 120, 170), (50, 95, 130, 160), (45, 80, 140, 190)]
STREAMS = np.stack(
    [
        R.with_nan(R.spikes(N, 1, at=SPIKES[0])[0], [3, 100]),
        0.3 * R.with_nan(R.spikes(N, 2, at=SPIKES[1])[0], [60], math.inf),
        1.5 * R.with_nan(R.spikes(N, 3, at=SPIKES[2])[0], [0, 1, 150]),
    ],
    axis=1,
)
FIELDS = ["grad_norm", "threshold", "scale", "clipped", "mean", "count", "step",
          "clipped_count", "nonfinite_count"]  # fmt: skip
GROUPS = ["g0", "g1", "g2"]


def _leaf(tree, path):
    for part in path.split("/"):
        tree = tree[part]
    return tree


def _check(tx, norms, make_tree, groups, want_norms, leaves_of, feedback="clipped"):
    """Metrics of every group and the applied per-leaf scale vs the restatement."""
    got, (outs, ins), same = S.run_tree(tx, norms, make_tree)
    want = S.adagc(want_norms, feedback=feedback, **KW)
    for j, group in enumerate(groups):
        w = {k: v[:, j] for k, v in want.items()}
        S.compare(got, w, f"adagc/{group}/", FIELDS)
        finite = np.isfinite(w["grad_norm"])
        for leaf in leaves_of[group]:
            with np.errstate(invalid="ignore"):  # NaN/Inf steps: compared only where finite
                ratio = _leaf(outs, leaf) / _leaf(ins, leaf)
            np.testing.assert_allclose(ratio[finite], w["scale"][finite], rtol=S.RTOL)
            assert np.all(np.asarray(_leaf(same, leaf))[~finite]), f"{leaf}: non-finite must pass"


@pytest.mark.parametrize("feedback", ["clipped", "raw", "skip"])
def test_per_param_matches_restatement(feedback):
    tx = clipjax.adagc(scope="per_param", feedback=feedback, **KW)
    _check(tx, STREAMS, S.flat_tree, GROUPS, STREAMS, {g: [g] for g in GROUPS}, feedback)


def test_default_feedback_is_clipped_and_default_scope_per_param():
    a, _, _ = S.run_tree(clipjax.adagc(**KW), STREAMS, S.flat_tree)
    b, _, _ = S.run_tree(
        clipjax.adagc(scope="per_param", feedback="clipped", **KW), STREAMS, S.flat_tree
    )
    assert sorted(a) == sorted(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


@pytest.mark.parametrize("feedback", ["clipped", "skip"])
def test_per_layer_matches_restatement(feedback):
    tx = clipjax.adagc(scope="per_layer", feedback=feedback, **KW)
    leaves = {g: [f"{g}/kernel", f"{g}/bias"] for g in ("l0", "l1", "l2")}
    _check(tx, STREAMS, S.layer_tree, ["l0", "l1", "l2"], STREAMS, leaves, feedback)


@pytest.mark.parametrize("feedback", ["clipped", "raw"])
def test_global_matches_restatement(feedback):
    tx = clipjax.adagc(scope="global", feedback=feedback, **KW)
    with np.errstate(invalid="ignore"):
        g = np.sqrt((STREAMS**2).sum(axis=1, keepdims=True))  # NaN/Inf wherever a leaf is
    _check(tx, STREAMS, S.flat_tree, ["global"], g, {"global": GROUPS}, feedback)


def test_callable_scope_matches_restatement():
    tx = clipjax.adagc(scope=lambda path, leaf: "odd" if path[-1].key == "g1" else "even", **KW)
    with np.errstate(invalid="ignore"):
        even = np.sqrt(STREAMS[:, 0] ** 2 + STREAMS[:, 2] ** 2)
    want_norms = np.stack([even, STREAMS[:, 1]], axis=1)
    leaves = {"even": ["g0", "g2"], "odd": ["g1"]}
    _check(tx, STREAMS, S.flat_tree, ["even", "odd"], want_norms, leaves)


def test_nonfinite_group_passes_and_warmup_global_norm_uses_finite_groups():
    norms = np.array([[3.0, 4.0, 0.5], [math.nan, 4.0, 0.5], [3.0, math.inf, 12.0]])
    tx = clipjax.adagc(warmup_steps=5, absolute_threshold=1.0, eps=0.0)
    got, _, same = S.run_tree(tx, norms, S.flat_tree)
    # step 0: G = sqrt(9 + 16 + 0.25); every group scaled by 1/G
    g0 = math.sqrt(9 + 16 + 0.25)
    for g in GROUPS:
        assert got[f"adagc/{g}/scale"][0] == pytest.approx(1 / g0, rel=S.RTOL)
    # step 1: g0 is NaN: passes unchanged, not counted; G from g1, g2 only
    assert bool(same["g0"][1]) and got["adagc/g0/scale"][1] == 1.0
    assert got["adagc/g0/count"][1] == 1 and got["adagc/g0/nonfinite_count"][1] == 1
    g1 = math.sqrt(16 + 0.25)
    assert got["adagc/g1/scale"][1] == pytest.approx(1 / g1, rel=S.RTOL)
    assert got["adagc/g0/mean"][1] == pytest.approx(3.0 / g0, rel=S.RTOL)  # gamma unchanged
    # step 2: g1 is +inf
    g2 = math.sqrt(9 + 144)
    assert got["adagc/g2/scale"][2] == pytest.approx(1 / g2, rel=S.RTOL)
    assert got["adagc/g1/nonfinite_count"][2] == 1 and bool(same["g1"][2])
    # gamma is the running min of h * g over warm-up
    assert got["adagc/g2/mean"][2] == pytest.approx(min(0.5 / g0, 0.5 / g1, 12 / g2), rel=S.RTOL)
    assert np.all(got["adagc/g0/threshold"] == 1.0)  # absolute_threshold during warm-up


def test_mean_is_inf_before_any_observation():
    norms = np.array([[math.nan, 1.0], [math.nan, 1.0], [2.0, 1.0]])
    got, _, _ = S.run_tree(clipjax.adagc(warmup_steps=2), norms, S.flat_tree)
    assert np.all(np.isposinf(got["adagc/g0/mean"][:2]))
    assert np.isfinite(got["adagc/g0/mean"][2])


@pytest.mark.parametrize("name", [None, "ag"])
def test_metric_names_and_name_prefix(name):
    got, _, _ = S.run_tree(clipjax.adagc(name=name, **KW), STREAMS[:3], S.flat_tree)
    assert {f"{name or 'adagc'}/{g}/{f}" for g in GROUPS for f in FIELDS} <= set(got)
    if name:
        assert not any(k.startswith("adagc/") for k in got)


def test_skip_leaves_count_unchanged_on_a_fired_step():
    got, _, _ = S.run_tree(clipjax.adagc(feedback="skip", **KW), STREAMS, S.flat_tree)
    want = S.adagc(STREAMS, feedback="skip", **KW)
    for j, spikes in enumerate(SPIKES):
        count = got[f"adagc/g{j}/count"]
        np.testing.assert_array_equal(count, want["count"][:, j])
        for t in spikes:  # every spike fires and is not counted
            assert got[f"adagc/g{j}/clipped"][t] and count[t] == count[t - 1], (j, t)


@pytest.mark.parametrize("feedback", ["clipped", "raw"])
def test_axis_name_replicas_use_averaged_group_norms(feedback):
    """Assumed (SPEC 8.7), run under vmap: each group norm is averaged over the axis
    first, and the warm-up's global norm G is built from the averaged group norms."""
    factors = np.array([0.5, 1.0, 2.0, 1.3])
    reps = len(factors)
    tx = clipjax.adagc(feedback=feedback, axis_name="i", **KW)
    params = S.flat_tree(jnp.ones(3))
    state0 = jax.tree.map(lambda a: jnp.broadcast_to(a, (reps, *a.shape)), tx.init(params))
    local = STREAMS[:, None, :] * factors[None, :, None]  # [steps, replicas, groups]

    def step(state, rows):
        grads = jax.vmap(S.flat_tree)(rows)
        out, state = jax.vmap(lambda g, s: tx.update(g, s, params), axis_name="i")(grads, state)
        ratio = {k: jnp.linalg.norm(out[k], axis=1) / jnp.linalg.norm(grads[k], axis=1)
                 for k in grads}  # fmt: skip
        return state, (clipjax.metrics(state), ratio)

    metrics, ratio = jax.jit(lambda s: jax.lax.scan(step, state0, s)[1])(
        jnp.asarray(local, jnp.float32)
    )
    want = S.adagc(local.mean(axis=1), feedback=feedback, **KW)
    for r in range(reps):
        got = {k: np.asarray(v)[:, r] for k, v in metrics.items()}
        for j in range(3):
            w = {k: v[:, j] for k, v in want.items()}
            S.compare(got, w, f"adagc/g{j}/", FIELDS)
            fin = np.isfinite(w["grad_norm"])
            np.testing.assert_allclose(
                np.asarray(ratio[f"g{j}"])[fin, r], w["scale"][fin], rtol=S.RTOL
            )


BAD = [("relative_threshold", 0.0), ("relative_threshold", -1.0), ("beta", 0.0), ("beta", 1.0),
       ("beta", -0.5), ("beta", 1.5), ("warmup_steps", -1), ("warmup_steps", 2.5),
       ("absolute_threshold", 0.0), ("absolute_threshold", -1.0), ("eps", -1e-6),
       ("feedback", "observe_first"), ("feedback", "bogus")]  # fmt: skip


@pytest.mark.parametrize("arg, value", BAD)
def test_validation_names_the_argument(arg, value):
    with pytest.raises(ValueError, match=arg):
        clipjax.adagc(**{arg: value})


def test_valid_edge_values():
    """No warm-up (gamma starts at the first norm), eps 0 and beta 0.5 are accepted,
    and the clipper they build follows the rule."""
    edge = dict(warmup_steps=0, eps=0.0, beta=0.5)
    got, _, _ = S.run_tree(clipjax.adagc(**edge), STREAMS, S.flat_tree)
    want = S.adagc(STREAMS, **edge)
    for j in range(3):
        S.compare(got, {k: v[:, j] for k, v in want.items()}, f"adagc/g{j}/", FIELDS)
        assert got[f"adagc/g{j}/clipped"].any(), "some step must be clipped"
    assert np.isposinf(got["adagc/g0/threshold"][0])  # no norm seen yet: nothing bounds step 0


def test_chain_with_adam_jit_and_scan(params):
    tx = optax.chain(clipjax.adagc(warmup_steps=3), optax.adam(1e-2))
    state0 = tx.init(params)
    struct = jax.tree.structure(state0)
    shapes = [(a.shape, a.dtype) for a in jax.tree.leaves(state0)]

    def step(carry, key):
        p, s = carry
        grads = jax.tree.map(lambda x: jax.random.normal(key, x.shape, x.dtype), p)
        upd, s = tx.update(grads, s, p)
        return (optax.apply_updates(p, upd), s), clipjax.metrics(s)

    (p, state), trace = jax.jit(lambda c, k: jax.lax.scan(step, c, k))(
        (params, state0), jax.random.split(jax.random.PRNGKey(0), 20)
    )
    assert jax.tree.structure(state) == struct
    assert [(a.shape, a.dtype) for a in jax.tree.leaves(state)] == shapes
    key = "adagc/params/Dense_0/kernel/"
    assert trace[key + "step"][-1] == 20 and trace[key + "count"][-1] == 20
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(p))
    # one jitted step re-used without re-tracing
    traces = []
    jitted = jax.jit(lambda g, s, p: (traces.append(1), tx.update(g, s, p))[1])
    g = jax.tree.map(jnp.ones_like, params)
    _, s1 = jitted(g, state, params)
    jitted(g, s1, params)
    assert len(traces) == 1
