"""``clipjax.adam``, ``adamw`` and ``chain``: optax's optimizers that skip without a cond.

``init`` and ``update`` are optax's bit for bit; ``update_if(False, ...)`` leaves the
state bit-identical and returns zeros; ``skip_on_spike`` around them is the same as
around optax's own, and its donated step has no conditional and no full-size copy.
"""

from __future__ import annotations

import platform
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests import scripts
from tests.compiled_step import (
    bytes_accessed,
    compiled_train_step,
    full_size_conditionals,
    full_size_copies,
)
from tests.conftest import version_of
from tests.skip_streams import RULE, SHAPES, make_stream, run, tree_equal

PARAMS = {"w": jnp.linspace(-1.0, 1.0, 12).reshape(4, 3), "b": jnp.full((3,), 0.5)}
SCHEDULE = optax.linear_schedule(1e-2, 1e-3, transition_steps=6)
OPTIONS = [
    ("adam", {"learning_rate": 1e-2}),
    ("adam", {"learning_rate": SCHEDULE}),
    ("adam", {"learning_rate": 1e-2, "nesterov": True}),
    ("adam", {"learning_rate": 1e-2, "eps_root": 1e-8, "b1": 0.8}),
    ("adam", {"learning_rate": 1e-2, "mu_dtype": jnp.bfloat16}),
    ("adamw", {"learning_rate": 1e-2}),
    ("adamw", {"learning_rate": SCHEDULE, "weight_decay": 0.1}),
    ("adamw", {"learning_rate": 1e-2, "weight_decay": 0.1, "mask": {"w": True, "b": False}}),
    ("adamw", {"learning_rate": 1e-2, "mask": lambda p: jax.tree.map(lambda x: x.ndim > 1, p)}),
    ("adamw", {"learning_rate": SCHEDULE, "nesterov": True, "mu_dtype": jnp.bfloat16}),
]
# A weight-decay schedule (its own count in the state), where the installed optax takes one.
if jax.tree.leaves(optax.add_decayed_weights(SCHEDULE).init(PARAMS)):
    OPTIONS.append(("adamw", {"learning_rate": 1e-2, "weight_decay": SCHEDULE}))
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(OPTIONS)]


def gradients(steps: int, seed: int = 0) -> list[dict[str, jax.Array]]:
    rng = np.random.default_rng(seed)
    return [
        {k: jnp.asarray(rng.standard_normal(v.shape), jnp.float32) for k, v in PARAMS.items()}
        for _ in range(steps)
    ]


def pair(name: str, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    return getattr(clipjax, name)(**kwargs), getattr(optax, name)(**kwargs)


@pytest.mark.parametrize(("name", "kwargs"), OPTIONS, ids=IDS)
def test_init_and_update_are_optax_bit_for_bit(name: str, kwargs: dict[str, Any]) -> None:
    ours, theirs = pair(name, kwargs)
    state, expected_state = ours.init(PARAMS), theirs.init(PARAMS)
    assert jax.tree.structure(state) == jax.tree.structure(expected_state)
    chex.assert_trees_all_equal(state, expected_state)
    params = PARAMS
    # Both jitted (or both eager): XLA's fusions may round differently from op-by-op.
    ours_step, theirs_step = jax.jit(ours.update), jax.jit(theirs.update)
    for g in gradients(10):
        updates, state = ours_step(g, state, params)
        expected, expected_state = theirs_step(g, expected_state, params)
        chex.assert_trees_all_equal((updates, state), (expected, expected_state))
        params = optax.apply_updates(params, updates)


@pytest.mark.parametrize(("name", "kwargs"), OPTIONS, ids=IDS)
def test_update_if_skips_bit_identically_and_takes_as_update(
    name: str, kwargs: dict[str, Any]
) -> None:
    tx, _ = pair(name, kwargs)
    state, params = tx.init(PARAMS), PARAMS
    skip = jax.jit(lambda g, s, p: tx.update_if(False, g, s, p))
    for t, g in enumerate(gradients(6, seed=1)):
        for bad in (None, np.nan, np.inf, -np.inf):
            dirty = g if bad is None else {**g, "w": g["w"].at[1, 2].set(bad)}
            skipped, kept = skip(dirty, state, params)
            chex.assert_trees_all_equal(kept, state)
            chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g), strict=True)
        with jax.disable_jit():
            taken = tx.update_if(jnp.bool_(True), g, state, params)
            updates, state = tx.update(g, state, params)
        chex.assert_trees_all_equal(taken, (updates, state), custom_message=str(t))
        params = optax.apply_updates(params, updates)


def test_under_jit_a_taken_step_differs_from_update_by_fma_rounding_at_most() -> None:
    """Compiled, ``update_if`` and ``update`` are different programs whose FMAs XLA:CPU
    contracts differently: the last bit or two may differ (op by op they are bit-identical)."""
    tx = clipjax.adamw(1e-2, weight_decay=0.1)
    update, update_if = jax.jit(tx.update), jax.jit(tx.update_if)
    state, params = tx.init(PARAMS), PARAMS
    for g in gradients(10, seed=3):
        taken = update_if(jnp.bool_(True), g, state, PARAMS)
        updates, state = update(g, state, params)
        chex.assert_trees_all_close(taken, (updates, state), rtol=1e-6, atol=0)
        assert taken[1][0].count == state[0].count


def test_chain_is_optax_chain_and_skips_each_member() -> None:
    ours = clipjax.chain(clipjax.zclip(warmup_steps=2), clipjax.adamw(1e-2, weight_decay=0.1))
    theirs = optax.chain(clipjax.zclip(warmup_steps=2), optax.adamw(1e-2, weight_decay=0.1))
    state, expected_state = ours.init(PARAMS), theirs.init(PARAMS)
    assert jax.tree.structure(state) == jax.tree.structure(expected_state)
    for g in gradients(3, seed=2):
        skipped, kept = ours.update_if(False, {**g, "b": g["b"] * np.nan}, state, PARAMS)
        assert tree_equal(kept, state)
        chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g))
        with jax.disable_jit():
            taken, taken_state = ours.update_if(True, g, state, PARAMS)
            updates, state = ours.update(g, state, PARAMS)
            expected, expected_state = theirs.update(g, expected_state, PARAMS)
        assert tree_equal((updates, state), (expected, expected_state))
        assert tree_equal((taken, taken_state), (updates, state))


def test_chain_of_an_optax_optimizer_still_skips_through_the_conditional() -> None:
    tx = clipjax.chain(clipjax.zclip(), optax.sgd(0.1, momentum=0.9))
    state = tx.init(PARAMS)
    g = gradients(1)[0]
    _, state = tx.update(g, state, PARAMS)
    skipped, kept = tx.update_if(False, {**g, "w": g["w"] * np.inf}, state, PARAMS)
    assert tree_equal(kept, state)
    chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g))


def spiky_stream() -> tuple[list[Any], list[float]]:
    """40 steps: norm and loss spikes (``make_stream("both")``), a NaN and an Inf gradient."""
    grads, losses = make_stream("both")
    grads[12]["w"][1, 1] = np.nan
    grads[33]["b"][0] = np.inf
    return grads[:40], losses[:40]


def skipping(inner: Any) -> Any:
    return clipjax.skip_on_spike(inner, **RULE)


@pytest.mark.parametrize("chained", [False, True], ids=["adamw", "chain_zclip_adamw"])
def test_skip_on_spike_is_the_same_as_around_optax(chained: bool) -> None:
    """Op by op, bit for bit; compiled, the same decisions and metrics (without FMA, bit for
    bit: test_compiled_without_fma_skip_on_spike_is_optax_bit_for_bit)."""

    def ours() -> Any:
        if chained:
            return clipjax.chain(clipjax.zclip(warmup_steps=5), clipjax.adamw(1e-2, nesterov=True))
        return clipjax.adamw(SCHEDULE, weight_decay=0.1)

    def theirs() -> Any:
        if chained:
            return optax.chain(clipjax.zclip(warmup_steps=5), optax.adamw(1e-2, nesterov=True))
        return optax.adamw(SCHEDULE, weight_decay=0.1)

    grads, losses = spiky_stream()
    params = {k: jnp.full(s, 0.3, jnp.float32) for k, s in SHAPES.items()}
    with jax.disable_jit():
        got = eager_run(skipping(ours()), grads, losses, params)
        expected = eager_run(skipping(theirs()), grads, losses, params)
    skipped = [bool(s.metrics["skipped"][0]) for _, s in expected]
    assert skipped[12] and skipped[33] and 4 <= sum(skipped) < len(grads) // 2, skipped
    for t, ((u, s), (eu, es)) in enumerate(zip(got, expected)):
        assert tree_equal(u, eu), t
        assert tree_equal(s.inner_state, es.inner_state), t
        assert tree_equal(clipjax.metrics(s), clipjax.metrics(es)), t
    compiled = run(skipping(ours()), grads, losses, params)
    compiled_expected = run(skipping(theirs()), grads, losses, params)
    for (u, s), (eu, es) in zip(compiled, compiled_expected):
        assert tree_equal(s.metrics, es.metrics)
        chex.assert_trees_all_close(
            (u, s.inner_state, clipjax.metrics(s)),
            (eu, es.inner_state, clipjax.metrics(es)),
            rtol=1e-5,
            atol=1e-8,
        )


def eager_run(tx: Any, grads: list[Any], values: list[float], params: Any) -> list[Any]:
    state, out = tx.init(params), []
    for g, value in zip(grads, values):
        updates, state = tx.update(jax.tree.map(jnp.asarray, g), state, params, value=value)
        out.append(jax.device_get((updates, state)))
    return out


DONATED = {
    "adamw": lambda: clipjax.adamw(1e-3),
    "chain_zclip_adamw": lambda: clipjax.chain(clipjax.zclip(),
                                               clipjax.adamw(1e-3, weight_decay=0.1)),
    "cond_adam": lambda: optax.adam(1e-3),
    "cond_chain_zclip_adamw": lambda: optax.chain(clipjax.zclip(), optax.adamw(1e-3)),
}  # fmt: skip


@pytest.mark.filterwarnings("ignore::clipjax.ConditionalRouteWarning")
@pytest.mark.parametrize("inner", list(DONATED))
def test_the_donated_step_has_no_conditional_and_no_copy(inner: str) -> None:
    """No full-size copy of the optimizer state on any route; no conditional on the fold's."""
    compiled, _ = compiled_train_step(clipjax.skip_on_spike(DONATED[inner]()))
    text = compiled.as_text()
    assert full_size_copies(text, {(64, 64), (64,)}) == 0
    if not inner.startswith("cond"):
        assert full_size_conditionals(text, {(64, 64), (64,)}) == 0


@pytest.mark.skipif(
    version_of(jax) < (0, 5),
    reason="bytes accessed are calibrated on jaxlib >= 0.5's cost analysis",
)
def test_a_taken_step_costs_no_more_than_the_optimizer() -> None:
    """Bytes accessed over ``clipjax.adamw`` alone, in gradient reads.

    jax 0.10.2 (XLA:CPU): -0.17 (the norm's read merges with the moments' loop), where
    skip_on_spike(optax.adamw) pays +1.83 for its conditional; the overflow-safe norm's
    branch (SPEC 9.8, never run by an ordinary step) adds about 2.25 to XLA's static count.
    """
    alone, grad_bytes = compiled_train_step(clipjax.adamw(1e-3))
    skip, _ = compiled_train_step(clipjax.skip_on_spike(clipjax.adamw(1e-3)))
    extra = (bytes_accessed(skip) - bytes_accessed(alone)) / grad_bytes
    assert extra <= 2.5, extra


def test_lax_scan_traces_once_and_equals_the_loop() -> None:
    grads, losses = spiky_stream()
    tx = skipping(clipjax.chain(clipjax.zclip(), clipjax.adam(1e-2)))
    params = {k: jnp.zeros(s, jnp.float32) for k, s in SHAPES.items()}
    traces = []

    def body(carry: Any, xs: Any) -> tuple[Any, Any]:
        traces.append(1)
        state = carry
        g, loss = xs
        _, state = tx.update(g, state, params, value=loss)
        return state, state.metrics["skipped"][0]

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *grads)
    state, skipped = jax.jit(lambda c, xs: jax.lax.scan(body, c, xs))(
        tx.init(params), (stacked, jnp.asarray(losses, jnp.float32))
    )
    assert len(traces) == 1
    loop = run(tx, grads, losses, params)  # one compile: `run` asserts it
    assert list(np.asarray(skipped)) == [bool(s.metrics["skipped"][0]) for _, s in loop]
    assert tree_equal(jax.device_get(state.inner_state), loop[-1][1].inner_state)


COMPILED_WITHOUT_FMA = """
import jax.numpy as jnp, optax, clipjax
from tests.skip_on_spike.test_fold import SCHEDULE, SHAPES, skipping, spiky_stream
from tests.skip_streams import run, tree_equal
grads, losses = spiky_stream()
params = {k: jnp.full(s, 0.3, jnp.float32) for k, s in SHAPES.items()}
ours = clipjax.chain(clipjax.zclip(warmup_steps=5), clipjax.adamw(SCHEDULE, weight_decay=0.1))
theirs = optax.chain(clipjax.zclip(warmup_steps=5), optax.adamw(SCHEDULE, weight_decay=0.1))
got, expected = (run(skipping(tx), grads, losses, params) for tx in (ours, theirs))
print([t for t, (a, b) in enumerate(zip(got, expected)) if not tree_equal(a, b)])
"""


@pytest.mark.skipif(
    platform.machine() not in ("x86_64", "AMD64") or version_of(jax) < (0, 5),
    reason="--xla_cpu_max_isa names x86 instruction sets (jaxlib >= 0.5)",
)
def test_compiled_without_fma_skip_on_spike_is_optax_bit_for_bit() -> None:
    """Off FMA instructions the compiled steps agree bit for bit: the compiled differences of
    test_skip_on_spike_is_the_same_as_around_optax are the contraction of multiply-adds alone."""
    flags = {"XLA_FLAGS": "--xla_cpu_max_isa=SSE4_2", "JAX_PLATFORMS": "cpu"}
    proc = scripts.python("-c", COMPILED_WITHOUT_FMA, timeout=300, env=flags)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout


def test_composes_with_inject_hyperparams_multisteps_and_low_precision_params() -> None:
    params = {"w": jnp.ones((3,), jnp.bfloat16), "v": jnp.ones((2, 2))}
    g = {"w": jnp.full((3,), 0.5, jnp.float32), "v": jnp.full((2, 2), 0.5)}
    pairs = [
        (
            optax.inject_hyperparams(clipjax.adamw)(learning_rate=0.1, weight_decay=0.01),
            optax.inject_hyperparams(optax.adamw)(learning_rate=0.1, weight_decay=0.01),
        ),
        (optax.MultiSteps(clipjax.adam(0.1), 2), optax.MultiSteps(optax.adam(0.1), 2)),
    ]
    for ours, theirs in pairs:
        chex.assert_trees_all_equal(
            ours.update(g, ours.init(params), params), theirs.update(g, theirs.init(params), params)
        )
    # float32 gradients of bfloat16 params, and a weakly typed leaf (jnp.full of a Python
    # float): the moments promote as in optax's update, the state keeps its dtypes.
    tx = clipjax.adamw(0.1, mu_dtype=jnp.bfloat16)
    state = tx.init(params)
    with jax.disable_jit():
        taken = tx.update_if(True, g, state, params)
        chex.assert_trees_all_equal(taken, tx.update(g, state, params), strict=True)
    skipped, kept = jax.jit(tx.update_if)(False, g, state, params)
    chex.assert_trees_all_equal(kept, state, strict=True)
    chex.assert_trees_all_equal(skipped, jax.tree.map(jnp.zeros_like, g), strict=True)


def test_an_argument_without_effect_raises() -> None:
    with pytest.raises(ValueError, match="mask has no effect with weight_decay=0"):
        clipjax.adamw(1e-3, weight_decay=0.0, mask={"w": True})
    # A schedule or an injected value may be zero at some steps only: allowed.
    clipjax.adamw(1e-3, weight_decay=optax.constant_schedule(0.0), mask={"w": True})
    clipjax.adamw(1e-3, weight_decay=0.0)
