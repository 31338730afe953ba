"""skip_on_spike returns the inner optimizer's own dtypes on every route.

Params and gradients float32/bfloat16 x ``mu_dtype`` None/float32, on the fold route and
two ``lax.cond`` routes: updates and inner state have the dtypes the inner optimizer alone
gives, on taken and skipped steps, and a taken step's values are the inner optimizer's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.compiled_step import full_size_copies

F32, BF16 = jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16)
DTYPES = {"f32": F32, "bf16": BF16}
MU_DTYPES = {"mu_none": None, "mu_f32": F32}

# route -> (skip_on_spike's inner, the optimizer alone), given mu_dtype.
ADAMW = (clipjax.adamw, optax.adamw)
ROUTES: dict[str, Callable[[Any], tuple[Any, Any]]] = {
    "fold_clipjax_adamw": lambda mu: tuple(adamw(1e-2, mu_dtype=mu) for adamw in ADAMW),
    "cond_chain_zclip_adam": lambda mu: (
        2 * (optax.chain(clipjax.zclip(warmup_steps=2), optax.adam(1e-2, mu_dtype=mu)),)
    ),
    "cond_optax_adam": lambda mu: 2 * (optax.adam(1e-2, mu_dtype=mu),),
}
SPIKE_STEP, STEPS = 3, 5

GRID = list(itertools.product(ROUTES, DTYPES, DTYPES, MU_DTYPES))


def dtypes(tree: Any) -> list[Any]:
    return [jnp.result_type(x) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize(("route", "params_dtype", "grads_dtype", "mu"), GRID)
def test_updates_and_state_keep_the_inner_optimizers_dtypes(
    route: str, params_dtype: str, grads_dtype: str, mu: str
) -> None:
    inner, alone = ROUTES[route](MU_DTYPES[mu])
    # sigma 6: the ramp 1.0, 1.1, 1.2 stays well below mean + sigma std in bfloat16 too.
    tx = clipjax.skip_on_spike(inner, window_size=4, min_history=2, sigma=6.0)
    key = jax.random.PRNGKey(0)
    params = {
        "w": jax.random.normal(key, (4, 3)).astype(DTYPES[params_dtype]),
        "b": jnp.ones((3,), DTYPES[params_dtype]),
    }
    state, alone_state = tx.init(params), alone.init(params)
    step = jax.jit(tx.update)
    skipped = []
    for t in range(STEPS):
        factor = 1.0 + 0.1 * t + (1e3 if t == SPIKE_STEP else 0.0)
        grads = jax.tree.map(lambda p, f=factor: (p * f).astype(DTYPES[grads_dtype]), params)
        updates, new_state = step(grads, state, params)
        expected, expected_state = alone.update(grads, alone_state, params)
        assert dtypes(updates) == dtypes(expected), (t, dtypes(updates), dtypes(expected))
        assert dtypes(new_state.inner_state) == dtypes(expected_state), t
        if bool(new_state.metrics["skipped"][0]):
            skipped.append(t)
            for u in jax.tree.leaves(updates):
                assert not np.asarray(u, np.float32).any()
        else:
            alone_state = expected_state
            for got, want in zip(jax.tree.leaves(updates), jax.tree.leaves(expected)):
                np.testing.assert_allclose(
                    np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=1e-2
                )
        state = new_state
    assert skipped == [SPIKE_STEP]


@pytest.mark.parametrize(
    ("params_dtype", "mu"), [("bf16", "mu_none"), ("bf16", "mu_f32"), ("f32", "mu_none")]
)
def test_the_conditional_route_copies_no_full_size_buffer(params_dtype: str, mu: str) -> None:
    """The pass-through branch casts only where the inner update changes a dtype."""
    if params_dtype == "bf16" and tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 5):
        pytest.skip("jaxlib 0.4's XLA:CPU copies the bfloat16 buffers of a conditional's branch")
    dtype = DTYPES[params_dtype]
    params = {f"layer{i}": {"w": jnp.full((64, 64), 0.01, dtype)} for i in range(3)}
    tx = clipjax.skip_on_spike(optax.adam(1e-3, mu_dtype=MU_DTYPES[mu]))

    def step(p: Any, state: Any, scale: jax.Array) -> tuple[Any, Any]:
        grads = jax.tree.map(lambda x: (x * scale).astype(x.dtype), p)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state

    compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, tx.init(params), 1.0).compile()
    assert full_size_copies(compiled.as_text(), {(64, 64)}) == 0
