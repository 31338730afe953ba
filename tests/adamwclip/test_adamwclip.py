"""AdamWClip: ``clipjax.adam``/``adamw(clip_grad_adapt=k)`` against the ``adamwclip`` package.

Step by step against PyPI ``adamwclip`` 0.1.4 (``AdamWClip.step``): parameters within
``|Δθ| <= 1e-5`` over up to 400 steps of ``lr=1e-2`` (float32 in another order; measured at
most 5.3e-6) and clipped fractions equal; negative controls differ by over 0.1. **FIX**: the
package clips its first steps to ``clip_grad_min`` (``v`` is 0); clipjax starts the clip once
``v`` has seen a step. Then the fold, the metrics, inject_hyperparams and refused arguments.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import compiled_train_step, full_size_conditionals, full_size_copies
from tests.references.adamwclip import have_adamwclip, run_reference
from tests.references.spam import spiky_gradients
from tests.skip_streams import tree_equal

SHAPES = {"b": (5,), "w": (4, 3), "z": (2, 3, 2)}
LR = 1e-2
ATOL = 1e-5  # |Δθ|, float32 rounding over the traces (measured at most 5.3e-6)
needs_reference = pytest.mark.skipif(not have_adamwclip(), reason="needs torch and adamwclip")


def initial() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(42)
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in SHAPES.items()}


def trace(steps: int, spikes: dict[int, float]) -> list[dict[str, np.ndarray]]:
    return spiky_gradients(
        SHAPES, steps, seed=1, spikes=spikes, element_spikes={30: 1e3}, scale=1e-2
    )


TRACES = {"spikes": (60, {7: 50.0, 19: 300.0, 40: 10.0}), "long": (400, {100: 100.0, 250: 30.0})}


def clipjax_trace(tx: Any, grads: list[dict[str, np.ndarray]]) -> tuple[list, list]:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    state = tx.init(params)

    @jax.jit
    def step(p: Any, s: Any, g: Any) -> Any:
        updates, s = tx.update(g, s, p)
        return optax.apply_updates(p, updates), s, clipjax.metrics(s)

    out, fractions = [], []
    for g in grads:
        params, state, m = step(params, state, {k: jnp.asarray(v) for k, v in g.items()})
        out.append(jax.device_get(params))
        fractions.append({k: float(m[f"adamw_clip/{k}/clipped_fraction"]) for k in SHAPES})
    return out, fractions


def max_error(ours: list, theirs: list) -> float:
    return max(float(np.max(np.abs(a[k] - b[k]))) for a, b in zip(ours, theirs) for k in SHAPES)


# (trace, k, weight decay); k=1: most elements clipped on most steps.
CASES = [("spikes", 3.0, 0.01), ("spikes", 2.0, 0.1), ("spikes", 1.0, 0.0), ("long", 3.0, 0.01)]


@needs_reference
@pytest.mark.parametrize(("name", "k", "weight_decay"), CASES)
def test_trace_equals_the_package(name: str, k: float, weight_decay: float) -> None:
    steps, spikes = TRACES[name]
    grads = trace(steps, spikes)
    kw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)
    theirs, their_fractions = run_reference(
        initial(), grads, **kw, clip_grad_adapt=k, clip_grad_warm_up=1
    )
    tx = clipjax.adamw(LR, weight_decay=weight_decay, clip_grad_adapt=k, clip_grad_warm_up=1)
    ours, fractions = clipjax_trace(tx, grads)
    assert max_error(ours, theirs) <= ATOL
    for a, b in zip(fractions, their_fractions):
        for leaf in SHAPES:
            assert a[leaf] == pytest.approx(b[leaf], abs=1e-6)
    assert max(f[leaf] for f in fractions for leaf in SHAPES) > 0  # the clip acted
    # Negative controls: the package's plain AdamW, and its clip from the first step.
    plain, _ = run_reference(initial(), grads, **kw, clip_grad_adapt=None)
    assert max_error(ours, plain) > 100 * ATOL
    first, _ = run_reference(initial(), grads, **kw, clip_grad_adapt=k, clip_grad_warm_up=0)
    assert max_error(ours, first) > 100 * ATOL


@needs_reference
def test_a_later_warm_up_and_a_threshold_floor_equal_the_package() -> None:
    grads = trace(*TRACES["spikes"])
    kw = dict(clip_grad_adapt=2.5, clip_grad_min=3e-3, clip_grad_warm_up=10)
    theirs, _ = run_reference(initial(), grads, lr=LR, weight_decay=0.0, **kw)
    ours, _ = clipjax_trace(clipjax.adam(LR, **kw), grads)
    assert max_error(ours, theirs) <= ATOL


@needs_reference
def test_fix_the_package_clips_its_first_steps_to_clip_grad_min() -> None:
    """**FIX**: with ``v`` still 0 the package's first threshold is ``clip_grad_min``."""
    params = {"w": np.zeros(64, np.float32)}
    grads = spiky_gradients({"w": (64,)}, 160, seed=1, scale=1e-2)
    kw = dict(lr=1e-3, weight_decay=0.0)
    plain, _ = run_reference(params, grads, **kw, clip_grad_adapt=None)
    package, fractions = run_reference(params, grads, **kw, clip_grad_adapt=3)
    step = lambda tr, t: np.linalg.norm(tr[t]["w"] - (tr[t - 1]["w"] if t else params["w"]))
    assert step(package, 0) < 0.02 * step(plain, 0)  # the first update: 1% of Adam's
    assert min(f["w"] for f in fractions[:140]) > 0.9  # every element clipped, every step
    tx = clipjax.adam(1e-3, clip_grad_adapt=3.0)
    state = tx.init({"w": jnp.zeros(64)})
    update = jax.jit(tx.update)
    ours = []
    for g in grads[:140]:
        _, state = update({"w": jnp.asarray(g["w"])}, state)
        ours.append(float(state[0][1].metrics["clipped_fraction"][0]))
    assert np.mean(ours) < 0.02  # the tail beyond 3 sigma, not every element


def test_default_path_is_optax_adamw_and_the_clip_changes_only_the_clipped_elements() -> None:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    grads = {k: jnp.asarray(v) for k, v in trace(3, {})[0].items()}
    a, _ = clipjax.adamw(LR).update(grads, clipjax.adamw(LR).init(params), params)
    b, _ = optax.adamw(LR).update(grads, optax.adamw(LR).init(params), params)
    assert tree_equal(a, b)
    # The first step is never clipped: equal to adamw's, metrics at 0.
    tx = clipjax.adamw(LR, clip_grad_adapt=1.0)
    c, state = tx.update(grads, tx.init(params), params)
    assert tree_equal(jax.tree.map(np.asarray, c), jax.tree.map(np.asarray, a))
    m = clipjax.metrics(state)
    assert all(float(m[f"adamw_clip/{k}/clipped_fraction"]) == 0 for k in SHAPES)


def test_state_is_optax_adam_state_next_to_the_metrics() -> None:
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    state = clipjax.adamw(LR, clip_grad_adapt=3.0).init(params)
    adam, clip_state = state[0]
    assert isinstance(adam, optax.ScaleByAdamState)
    assert isinstance(clip_state, clipjax.AdamWClipState)
    assert jax.tree.structure(adam) == jax.tree.structure(optax.adam(LR).init(params)[0])
    assert clip_state.info.groups == tuple(sorted(SHAPES))


def test_metrics_count_clipped_elements_and_non_finite_steps() -> None:
    tx = clipjax.adam(0.1, clip_grad_adapt=3.0)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    for g in ([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0], [100.0, 1.0, 1.0, -100.0]):
        _, state = tx.update({"w": jnp.asarray(g)}, state)
    m = clipjax.metrics(state)
    assert float(m["adamw_clip/w/clipped_fraction"]) == 0.5
    assert int(m["adamw_clip/w/clipped_count"]) == 1 and int(m["adamw_clip/w/step"]) == 3
    assert float(m["adamw_clip/w/grad_norm"]) == pytest.approx(np.sqrt(2e4 + 2), rel=1e-6)
    _, state = tx.update({"w": jnp.asarray([np.nan, 1.0, 1.0, 1.0])}, state)
    assert int(clipjax.metrics(state)["adamw_clip/w/nonfinite_count"]) == 1


def test_update_if_skips_bit_identically_and_takes_as_update() -> None:
    tx = clipjax.adamw(LR, weight_decay=0.1, clip_grad_adapt=2.0)
    params = {k: jnp.asarray(v) for k, v in initial().items()}
    state = tx.init(params)
    for g in trace(4, {2: 100.0}):
        g = {k: jnp.asarray(v) for k, v in g.items()}
        skipped, kept = tx.update_if(jnp.bool_(False), g, state, params)
        assert tree_equal(kept, state)
        assert all(float(jnp.abs(u).max()) == 0 for u in jax.tree.leaves(skipped))
        with jax.disable_jit():
            taken = tx.update_if(jnp.bool_(True), g, state, params)
            updates, state = tx.update(g, state, params)
        assert tree_equal(taken, (updates, state))


def test_skip_on_spike_folds_it_with_no_conditional_and_no_copy() -> None:
    tx = clipjax.skip_on_spike(clipjax.adamw(1e-3, weight_decay=0.1, clip_grad_adapt=3.0))
    assert tx.route == "fold"
    compiled, _ = compiled_train_step(tx)
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    assert full_size_conditionals(text, {(64, 64), (64,)}) == 0
    # Alone it copies no more than adamw (the parameters the backward pass read).
    adamw, _ = compiled_train_step(clipjax.adamw(1e-3, weight_decay=0.1))
    alone, _ = compiled_train_step(clipjax.adamw(1e-3, weight_decay=0.1, clip_grad_adapt=3.0))
    shapes = {(64, 64), (64,)}
    assert full_size_copies(alone.as_text(), shapes) <= full_size_copies(adamw.as_text(), shapes)


def test_inject_hyperparams_schedules_the_threshold() -> None:
    tx = optax.inject_hyperparams(clipjax.adamw)(learning_rate=LR, clip_grad_adapt=3.0)
    params = {"w": jnp.zeros(4)}
    state = tx.init(params)
    for g in ([1.0] * 4, [1.0] * 4, [9.0, 1.0, 1.0, 1.0]):
        _, state = jax.jit(tx.update)({"w": jnp.asarray(g)}, state, params)
    assert float(clipjax.metrics(state)["adamw_clip/w/clipped_fraction"]) == 0.25


@pytest.mark.parametrize(("kwargs", "argument"), [
    ({"clip_grad_adapt": 0.0}, "clip_grad_adapt"), ({"clip_grad_adapt": -3.0}, "clip_grad_adapt"),
    ({"clip_grad_adapt": 3.0, "clip_grad_min": -1.0}, "clip_grad_min"),
    ({"clip_grad_adapt": 3.0, "clip_grad_warm_up": 1.5}, "clip_grad_warm_up"),
    ({"clip_grad_adapt": 3.0, "clip_grad_warm_up": -1}, "clip_grad_warm_up"),
    ({"clip_grad_adapt": 3.0, "update_clipping": True}, "update_clipping"),
])  # fmt: skip
@pytest.mark.parametrize("factory", [clipjax.adam, clipjax.adamw])
def test_bad_arguments_are_named(factory: Any, kwargs: dict, argument: str) -> None:
    with pytest.raises(ValueError, match=argument):
        factory(1e-3, **kwargs)


def test_integer_gradients_and_another_tree_are_refused() -> None:
    tx = clipjax.adamw(LR, clip_grad_adapt=3.0)
    state = tx.init({"w": jnp.ones(3)})
    with pytest.raises(ValueError, match="does not match"):
        tx.update({"w": jnp.ones(4)}, state)
    int_tree = {"w": jnp.ones(3), "n": jnp.ones(2, jnp.int32)}
    with pytest.raises(ValueError, match="integer"):
        tx.update(int_tree, tx.init(int_tree))
