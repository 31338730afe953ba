"""One contract, every public transform: a stable state (structure, shapes, dtypes) with and
without jit, a scan carry traced once, no host transfer, leaf dtypes kept, donation, and
``metrics()`` found inside every optax wrapper."""

from __future__ import annotations

from typing import Any

import chex
import jax
import jax.numpy as jnp
import optax
import pytest
from absl.testing import parameterized

import clipjax
from tests.model import OUT, contract_params, grads_at, mlp_params
from tests.registry import ALL_IDS, CASES, CLIPPER_IDS, NORMLESS, TRANSFORM_IDS, Case, Factory


@pytest.fixture(params=ALL_IDS)
def case(request: Any) -> Case:
    return CASES[request.param]


class TestContractWithAndWithoutJit(chex.TestCase):
    """init/update of every transform, eagerly and under ``jit`` (chex variants)."""

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_state_is_stable_and_dtypes_kept(self, name: str) -> None:
        tx = CASES[name].make()
        params = contract_params()
        first = tx.init(params)
        state = first
        update = self.variant(tx.update)
        for step in range(8):
            grads = grads_at(params, step)
            out, state = update(grads, state, params)
            chex.assert_trees_all_equal_structs(state, first)
            chex.assert_trees_all_equal_shapes_and_dtypes(state, first)
            chex.assert_trees_all_equal_shapes_and_dtypes(out, grads)
        chex.assert_tree_all_finite(out)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        *(
            (f"{name}_{jnp.dtype(dtype).name}", name, dtype)
            for name in ALL_IDS
            for dtype in (jnp.bfloat16, jnp.float16)
        )
    )
    def test_low_precision_leaves_keep_dtype(self, name: str, dtype: Any) -> None:
        tx = CASES[name].make()
        params = contract_params(dtype)
        state = tx.init(params)
        out, state = self.variant(tx.update)(grads_at(params, 1), state, params)
        chex.assert_trees_all_equal_dtypes(out, params)
        norms = {k: v for k, v in clipjax.metrics(state).items() if k.endswith("/grad_norm")}
        if name in NORMLESS:
            norms = clipjax.metrics(state)
        self.assertTrue(norms)
        chex.assert_tree_all_finite(norms)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_two_of_a_kind_get_distinct_names(self, name: str) -> None:
        make, prefix = CASES[name].make, CASES[name].algo
        params = contract_params()
        tx = optax.chain(make(), make(), optax.sgd(0.1))
        state = tx.init(params)
        _, state = self.variant(tx.update)(grads_at(params, 0), state, params)
        names = {k.split("/")[0] for k in clipjax.metrics(state)}
        self.assertLessEqual({prefix, prefix + "_1"}, names)

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(*((name, name) for name in ALL_IDS))
    def test_empty_tree(self, name: str) -> None:
        tx = CASES[name].make()
        state = tx.init({})
        out, new_state = self.variant(tx.update)({}, state, {})
        self.assertEqual(out, {})
        chex.assert_trees_all_equal_structs(new_state, state)
        chex.assert_trees_all_equal_shapes_and_dtypes(new_state, state)


def test_scan_carry_and_single_trace(case: Case) -> None:
    tx = case.make()
    params = contract_params()
    traces = []

    def step(state: Any, i: jax.Array) -> Any:
        traces.append(1)
        grads = jax.tree.map(lambda p: p * (1.0 + 0.01 * i.astype(p.dtype)), params)
        _, state = tx.update(grads, state, params)
        return state, None

    state, _ = jax.lax.scan(step, tx.init(params), jnp.arange(12.0))
    assert len(traces) == 1
    chex.assert_trees_all_equal_structs(state, tx.init(params))
    chex.assert_trees_all_equal_shapes_and_dtypes(state, tx.init(params))

    jitted = jax.jit(tx.update)
    state = tx.init(params)
    for i in range(5):
        _, state = jitted(grads_at(params, i), state, params)
    assert jitted._cache_size() == 1


def test_state_can_be_donated(case: Case) -> None:
    tx, params = case.make(), contract_params()
    update = jax.jit(tx.update, donate_argnums=(1,))
    state = tx.init(params)
    for i in range(3):
        _, state = update(grads_at(params, i), state, params)
    jax.block_until_ready(state)


def test_no_host_transfer_inside_update(case: Case) -> None:
    tx = case.make()
    params = contract_params()
    state = tx.init(params)
    grads = grads_at(params, 0)
    update = jax.jit(tx.update)
    update(grads, state, params)  # compile outside the guard
    with jax.transfer_guard("disallow"):
        _, state = update(grads, state, params)
        jax.block_until_ready(state)


def _wrappers(make: Factory) -> dict[str, optax.GradientTransformation]:
    mask_fn = lambda params: jax.tree.map(lambda _: True, params)
    labels = lambda params: jax.tree.map(lambda _: "a", params)
    return {
        "chain": optax.chain(make(), optax.sgd(0.1)),
        "named_chain": optax.named_chain(("clip", make()), ("sgd", optax.sgd(0.1))),
        "multisteps": optax.MultiSteps(optax.chain(make(), optax.sgd(0.1)), 2),
        "masked": optax.masked(make(), mask_fn),
        "partition": optax.partition({"a": make()}, labels),
        "apply_if_finite": optax.apply_if_finite(optax.chain(make(), optax.sgd(0.1)), 3),
        "inject": optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
    }


def test_metrics_found_in_every_wrapper(case: Case) -> None:
    make, prefix, field = case.make, case.algo, case.field
    params = contract_params()
    for label, tx in _wrappers(make).items():
        if label == "inject":
            tx = optax.chain(make(), tx)
        state = tx.init(params)
        update = jax.jit(tx.update)
        for i in range(3):
            _, state = update(grads_at(params, i), state, params)
        found = clipjax.metrics(state)
        keys = [k for k in found if k.startswith(prefix + "/") and k.endswith("/" + field)]
        assert keys, (label, sorted(found)[:5])
        assert all(jnp.shape(found[k]) == () for k in keys)
        inside = jax.jit(clipjax.metrics)(state)
        assert set(inside) == set(found)


@pytest.mark.parametrize("name", sorted({*ALL_IDS, *CLIPPER_IDS}))
def test_update_on_another_tree_fails_clearly(name: str) -> None:
    """Other leaves, or a layer more: 'does not match'; a leaf of another shape: the leaf and
    both shapes, init's first (the registry's clippers; its optimizers for other leaves)."""
    tx = CASES[name].make()
    if name in ALL_IDS:
        other = {"w": jnp.ones((2, 2))}
        with pytest.raises(ValueError, match="does not match"):
            tx.update(other, tx.init(contract_params()), other)
    if name in CLIPPER_IDS:
        big = mlp_params()
        big["params"]["Dense_2"] = {"kernel": jnp.ones((OUT, OUT)), "bias": jnp.zeros((OUT,))}
        with pytest.raises(ValueError, match="does not match"):
            tx.update(big, tx.init(mlp_params()), big)
    if name in TRANSFORM_IDS:
        seen = {"params": {"bias": jnp.ones((2,)), "kernel": jnp.ones((3,))}}
        other = {"params": {"bias": jnp.ones((2,)), "kernel": jnp.ones((4,))}}
        with pytest.raises(ValueError) as info:
            tx.update(other, tx.init(seen), other)
        msg = str(info.value)
        assert "params/kernel" in msg and "(3,)" in msg and "(4,)" in msg, msg
        assert msg.index("(3,)") < msg.index("(4,)"), f"init's shape first: {msg}"
