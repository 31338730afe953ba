"""``skip_on_spike``: drop a step whose gradient norm or loss spikes.

Against the float64 restatement ``tests/restate/skip_on_spike.py``: the same
decisions, thresholds and buffers (never a skipped value) on streams with spikes,
NaN/Inf and a lasting shift. A skipped step leaves the inner state bit-identical
and returns zeros in each leaf's dtype.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax._metrics import state_fields
from tests import restate as S
from tests.conftest import version_of
from tests.registry import clipjax_states
from tests.skip_streams import (
    RULE,
    SHAPES,
    STEPS,
    WINDOW,
    directions,
    held,
    make_stream,
    norm64,
    run,
    tree_equal,
)

FIELDS = {"grad_norm", "value", "grad_threshold", "value_threshold", "skipped", "skipped_count",
          "consecutive_skips", "nonfinite_count", "step", "count"}  # fmt: skip

# (stream, with a loss, max_consecutive_skips)
CASES = [("clean", True, None), ("loss_spike", True, None), ("norm_spike", True, None),
         ("norm_spike", False, None), ("both", True, None), ("burst", False, None),
         ("nan_loss", True, None), ("nan_grad", True, None), ("nan_grad", False, None),
         ("shift", True, None), ("shift", True, 3), ("shift", False, 3)]  # fmt: skip


@pytest.mark.parametrize("feedback", ["clipped", "skip", "raw"])
@pytest.mark.parametrize(
    ("case", "with_value", "max_skips"),
    CASES,
    ids=[f"{c}-{'value' if v else 'novalue'}-{k}" for c, v, k in CASES],
)
def test_decisions_match_the_float64_restatement(case, with_value, max_skips, feedback) -> None:
    grads, losses = make_stream(case)
    values = losses if with_value else None
    ref = S.skip_on_spike(
        [norm64(g) for g in grads], values, max_consecutive_skips=max_skips, feedback=feedback
    )
    assert min(r["margin"] for r in ref) > 1e-4, "a step too close to its threshold"
    tx = clipjax.skip_on_spike(
        optax.sgd(1.0), **RULE, max_consecutive_skips=max_skips, feedback=feedback
    )
    skips = []
    for t, ((updates, state), r) in enumerate(zip(run(tx, grads, values), ref)):
        m = {k: v[0] for k, v in state.metrics.items()}
        assert bool(m["skipped"]) == r["skipped"], f"step {t}"
        skips.append(r["skipped"])
        np.testing.assert_allclose(m["grad_threshold"], r["grad_threshold"], rtol=1e-5)
        np.testing.assert_allclose(m["value_threshold"], r["value_threshold"], rtol=1e-5)
        np.testing.assert_allclose(m["grad_norm"], norm64(grads[t]), rtol=1e-6)
        if with_value:
            np.testing.assert_array_equal(m["value"], np.float32(losses[t]))
        else:
            assert np.isnan(m["value"]) and m["value_threshold"] == np.inf
        assert m["consecutive_skips"] == r["consecutive_skips"]
        assert m["step"] == t + 1
        assert m["skipped_count"] == sum(skips)
        assert m["count"] == t + 1 - sum(skips)
        assert state.grad_norm_seen == r["grad_seen"]
        if feedback == "skip":
            assert state.grad_norm_seen == m["count"]
        np.testing.assert_allclose(
            held(state.grad_norm_window, int(state.grad_norm_seen)), r["grad_buffer"], rtol=1e-5
        )
        assert np.all(np.isfinite(state.grad_norm_window))
        if with_value:
            np.testing.assert_allclose(
                held(state.value_window, int(state.value_seen)), r["value_buffer"], rtol=1e-5
            )
            assert np.all(np.isfinite(state.value_window))
            assert state.value_seen == r["value_seen"]
        else:
            assert state.value_seen == 0 and not np.any(state.value_window)
        if r["skipped"]:
            for leaf in jax.tree.leaves(updates):
                assert leaf.dtype == np.float32 and not np.any(leaf)
        else:
            for k in SHAPES:
                np.testing.assert_array_equal(updates[k], -grads[t][k])
    if feedback != "skip":
        # A lasting shift is learnt: training goes on under "clipped" and "raw".
        if case == "shift":
            assert not any(skips[-10:]), skips
        assert sum(skips) <= {"shift": 20}.get(case, 4), skips
        return
    # Each scenario actually exercises what it is named after.
    expected_skips = {
        "clean": 0,
        "loss_spike": 2 if with_value else 0,
        "norm_spike": 2,
        "both": 2 + with_value,
        "burst": 4,
        "nan_loss": 4 if with_value else 0,
        "nan_grad": 3,
        "shift": STEPS - 30 if max_skips is None else None,
    }[case]
    if expected_skips is not None:
        assert sum(skips) == expected_skips, skips
    if case == "shift" and max_skips is not None:
        # Forced after 3 skips, then the buffers learn the new level.
        assert skips[30:34] == [True, True, True, False]
        assert not any(skips[40:])


def test_nonfinite_steps_are_counted_and_always_skipped() -> None:
    grads, losses = make_stream("nan_grad")
    losses[40] = np.nan
    tx = clipjax.skip_on_spike(optax.sgd(1.0), window_size=WINDOW, max_consecutive_skips=1)
    states = [s for _, s in run(tx, grads, losses)]
    # Two non-finite steps in a row with max_consecutive_skips=1: both skipped.
    assert [bool(s.metrics["skipped"][0]) for s in states[29:33]] == [False, True, True, False]
    assert int(states[-1].metrics["nonfinite_count"][0]) == 4


def spike_run(
    inner: optax.GradientTransformation, params: Any, spike_at: int = 12
) -> list[tuple[Any, Any]]:
    tx = clipjax.skip_on_spike(inner, window_size=8, min_history=4)
    grads = []
    for t, d in enumerate(directions(spike_at + 3)):
        scale = 100.0 if t == spike_at else 1.0
        grads.append({k: (scale * d[k]).astype(params[k].dtype) for k in SHAPES})
    return run(tx, grads, [1.0] * len(grads), params)


@pytest.mark.parametrize("inner", [
    optax.adam(1e-3), optax.inject_hyperparams(optax.adam)(learning_rate=1e-3),
    optax.chain(clipjax.zclip(warmup_steps=3), optax.adamw(1e-3)),
], ids=["adam", "inject_hyperparams_adam", "chain_zclip_adamw"])  # fmt: skip
def test_a_skipped_step_leaves_the_inner_state_bit_identical(inner: Any) -> None:
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    steps = spike_run(inner, params)
    before, at, after = (steps[t][1] for t in (11, 12, 13))
    assert bool(at.metrics["skipped"][0]) and not bool(after.metrics["skipped"][0])
    assert tree_equal(at.inner_state, before.inner_state)
    assert not tree_equal(after.inner_state, at.inner_state)
    for a, b in zip(adam_states(at.inner_state), adam_states(before.inner_state), strict=True):
        assert np.array_equal(a.count, b.count)
        for x, y in zip(jax.tree.leaves((a.mu, a.nu)), jax.tree.leaves((b.mu, b.nu))):
            assert np.array_equal(x, y)


def adam_states(tree: Any) -> list[optax.ScaleByAdamState]:
    is_adam = lambda x: isinstance(x, optax.ScaleByAdamState)
    found = [s for s in jax.tree.leaves(tree, is_leaf=is_adam) if is_adam(s)]
    assert len(found) == 1
    return found


def test_skipped_updates_are_zeros_of_each_leafs_dtype() -> None:
    params = {"w": jnp.zeros(SHAPES["w"], jnp.bfloat16), "b": jnp.zeros(SHAPES["b"], jnp.float32)}
    steps = spike_run(optax.adam(1e-3), params)
    for t, (updates, state) in enumerate(steps):
        assert {k: v.dtype for k, v in updates.items()} == {"w": jnp.bfloat16, "b": np.float32}
        if t == 12:
            assert bool(state.metrics["skipped"][0])
            assert not any(np.any(np.asarray(v, np.float32)) for v in updates.values())


@pytest.mark.skipif(
    version_of(optax) < (0, 2, 6),
    reason="optax 0.2.5's reduce_on_plateau state changes after its first update (a retrace)",
)
def test_value_and_extra_args_reach_the_inner_transform() -> None:
    inner = optax.chain(optax.sgd(1.0), optax.contrib.reduce_on_plateau(patience=1, factor=0.5))
    grads, _ = make_stream("clean")
    tx = clipjax.skip_on_spike(inner, window_size=WINDOW)
    _, state = run(tx, grads[:6], [5.0, 4.0, 4.0, 4.0, 4.0, 4.0])[-1]
    plateau = state.inner_state[1]
    assert float(plateau.scale) < 1.0  # it saw the losses


def test_state_structure_is_fixed_and_typed() -> None:
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    tx = clipjax.skip_on_spike(optax.adam(1e-3), window_size=WINDOW)
    state = tx.init(params)
    assert isinstance(state, clipjax.SkipOnSpikeState)
    assert set(state.metrics) == FIELDS
    assert state.info == clipjax.GroupInfo(algo="skip_on_spike", name=None, groups=("global",))
    for x in jax.tree.leaves(state):
        assert not getattr(x, "weak_type", False)
    assert state.metrics["skipped"].dtype == np.bool_
    assert all(v.shape == (1,) for v in state.metrics.values())
    grads = {k: jnp.ones(s) for k, s in SHAPES.items()}
    with_value = jax.eval_shape(lambda s: tx.update(grads, s, params, value=1.0)[1], state)
    without = jax.eval_shape(lambda s: tx.update(grads, s, params)[1], state)
    expected = jax.eval_shape(lambda: state)
    assert jax.tree.structure(with_value) == jax.tree.structure(expected)
    assert jax.tree.structure(without) == jax.tree.structure(expected)
    for a, b, c in zip(*(jax.tree.leaves(x) for x in (with_value, without, expected))):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        assert not a.weak_type and not b.weak_type


def test_metrics_reports_its_fields_and_the_inner_clippers() -> None:
    inner = optax.chain(clipjax.zclip(warmup_steps=3), optax.adam(1e-3))
    grads, losses = make_stream("loss_spike")
    tx = clipjax.skip_on_spike(inner, **RULE)
    _, state = run(tx, grads[:26], losses[:26])[-1]
    found = clipjax.metrics(state)
    ours = {k.rsplit("/", 1)[1] for k in found if k.startswith("skip_on_spike/global/")}
    assert ours == FIELDS
    assert "zclip/global/threshold" in found
    assert bool(found["skip_on_spike/global/skipped"])  # the loss spike at 25
    np.testing.assert_array_equal(found["skip_on_spike/global/value"], np.float32(losses[25]))
    assert int(found["skip_on_spike/global/step"]) == 26
    assert int(found["skip_on_spike/global/skipped_count"]) == 1
    nested = clipjax.metrics(state, flat=False)
    assert set(nested["skip_on_spike"]["global"]) == FIELDS and "zclip" in nested
    window = optax.tree_utils.tree_get(state, "grad_norm_window")
    assert window.shape == (WINDOW,)
    named = clipjax.skip_on_spike(optax.sgd(1.0), name="guard")
    keys = clipjax.metrics(named.init({"w": jnp.ones(2)}))
    assert set(keys) == {f"guard/global/{f}" for f in FIELDS}


@pytest.mark.parametrize(("factor", "most_skips"), [(10.0, 40), (50.0, 60)])
def test_a_lasting_shift_is_learnt_within_the_steps_the_restatement_predicts(factor, most_skips):
    """Window 128, sigma 6, lognormal noise: "clipped" learns a x10 / x50 shift."""
    norms = np.exp(0.1 * np.random.default_rng(0).standard_normal(400))
    norms[200:] *= factor
    norms = [float(np.float32(x)) for x in norms]
    ref = S.skip_on_spike(norms, None, window=128, sigma=6.0, min_history=64, feedback="clipped")
    expected = [r["skipped"] for r in ref]
    tx = clipjax.skip_on_spike(optax.sgd(1.0))
    directions_ = directions(len(norms))
    grads = [{k: v * np.float32(n) for k, v in d.items()} for d, n in zip(directions_, norms)]
    got = [bool(s.metrics["skipped"][0]) for _, s in run(tx, grads, None)]
    assert got == expected
    assert not any(got[:200])  # nothing before the shift
    skipped = sum(got)
    assert 5 < skipped <= most_skips and not any(got[200 + most_skips :]), skipped
    # Under "skip" the same shift stalls training for good.
    stalled = S.skip_on_spike(norms, None, window=128, sigma=6.0, min_history=64, feedback="skip")
    assert all(r["skipped"] for r in stalled[200:])


# One zclip inside skip_on_spike, on each route a skipped step can take.
ROUTES = {
    "fold": lambda z: clipjax.chain(z, clipjax.adam(1e-3)),
    "select": lambda z: z,
    "cond": lambda z: optax.chain(z, optax.adam(1e-3)),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_skipped_step_reads_as_skipped_on_every_route(route: str) -> None:
    """The clipper saw no gradient: grad_norm and z NaN, skipped True, nothing clipped (0.4
    reported grad_norm 0, scale 1: a calm step on a chart); its state untouched."""
    inner = ROUTES[route](clipjax.zclip(warmup_steps=3, max_grad_norm=None))
    tx = clipjax.skip_on_spike(inner, window_size=8, min_history=4)
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    # A spike at step 12, a NaN gradient at step 14.
    grads = [
        {k: jnp.asarray((100.0 if t == 12 else 1.0) * d[k], jnp.float32) for k in SHAPES}
        for t, d in enumerate(directions(16))
    ]
    grads[14] = jax.tree.map(lambda g: jnp.full_like(g, jnp.nan), grads[14])
    steps = [state for _, state in run(tx, grads, [1.0] * len(grads), params)]
    assert tx.route == route
    assert [bool(s.metrics["skipped"][0]) for s in steps[11:16]] == [
        t in (12, 14) for t in range(11, 16)
    ]
    for state, previous in ((steps[12], steps[11]), (steps[14], steps[13])):
        for found in (clipjax.metrics(state), jax.jit(clipjax.metrics)(state)):
            assert np.isnan(float(found["zclip/global/grad_norm"]))
            assert np.isnan(float(found["zclip/global/z"]))
            assert bool(found["zclip/global/skipped"])
            assert float(found["zclip/global/scale"]) == 1.0
            assert not bool(found["zclip/global/clipped"])
            # Thresholds, statistics and counters as they stand; the state is untouched.
            zclip_state = clipjax_states(state.inner_state)[0]
            assert tree_equal(zclip_state, clipjax_states(previous.inner_state)[0])
            for field in ("threshold", "mean", "std", "step", "count"):
                np.testing.assert_array_equal(
                    found[f"zclip/global/{field}"], state_fields(zclip_state)[field][0]
                )
    # A taken step reports what the clipper did, and that it was not skipped.
    taken = clipjax.metrics(steps[13])
    assert float(taken["zclip/global/grad_norm"]) > 0.0
    assert not bool(taken["zclip/global/skipped"])
    # A clipper outside any skipping wrapper reports no skipped field.
    alone = clipjax.zclip(warmup_steps=3)
    _, state = alone.update(params, alone.init(params), params)
    assert "zclip/global/skipped" not in clipjax.metrics(state)


# Each refused for its last argument.
BAD = [(kw, list(kw)[-1]) for kw in [
    {"window_size": 0}, {"window_size": 2.0}, {"window_size": True}, {"sigma": 0.0},
    {"sigma": -1.0}, {"sigma": float("nan")}, {"sigma": "6"}, {"min_history": 0},
    {"window_size": 4, "min_history": 5}, {"min_history": 1.5}, {"max_consecutive_skips": 0},
    {"max_consecutive_skips": 2.0}, {"name": ""}, {"name": 3}, {"axis_name": 3},
    {"feedback": "observe_first"}, {"feedback": None},
]]  # fmt: skip


@pytest.mark.parametrize(("kwargs", "argument"), BAD)
def test_invalid_arguments_name_the_argument(kwargs: dict[str, Any], argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        clipjax.skip_on_spike(optax.sgd(1.0), **kwargs)


def test_value_must_be_a_scalar_and_empty_trees_are_allowed() -> None:
    tx = clipjax.skip_on_spike(optax.sgd(1.0))
    params = {"w": jnp.ones(3)}
    with pytest.raises(ValueError, match="value"):
        tx.update(params, tx.init(params), params, value=jnp.ones(2))
    updates, state = tx.update({}, tx.init({}), {}, value=1.0)
    assert updates == {} and not bool(state.metrics["skipped"][0])


def test_default_min_history_is_half_the_window() -> None:
    grads, losses = make_stream("clean")
    for window, gate in ((16, 8), (1, 1)):
        tx = clipjax.skip_on_spike(optax.sgd(1.0), window_size=window)
        states = [s for _, s in run(tx, grads[: gate + 1], losses[: gate + 1])]
        thresholds = [float(s.metrics["grad_threshold"][0]) for s in states]
        assert all(th == np.inf for th in thresholds[:gate]) and np.isfinite(thresholds[gate])


@pytest.mark.parametrize("inner", [optax.adam, None, "adam"], ids=["factory", "none", "str"])
def test_inner_must_be_a_transform(inner: Any) -> None:
    with pytest.raises(TypeError, match="inner") as raised:
        clipjax.skip_on_spike(inner)
    if inner is optax.adam:
        assert "call it" in str(raised.value)


def test_integer_gradients_name_the_leaf() -> None:
    tx = clipjax.skip_on_spike(optax.adam(1e-3))
    params = {"w": jnp.ones(3), "steps": jnp.ones(2, jnp.int32)}
    with pytest.raises(ValueError, match="steps"):
        tx.update(params, tx.init(params), params)
