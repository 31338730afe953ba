"""No tracer outlives its trace: every public factory under ``optax.inject_hyperparams`` runs
two jitted updates under ``jax.checking_leaks()`` (0.4 cached tracers in module-level caches
keyed by what the factory built)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import optax
import pytest

import clipjax
from tests.contract.test_inject import PARAMS, static_arguments
from tests.model import grads_at
from tests.registry import CASES

# The public factories the registry builds only inside others (or not at all).
MORE: dict[str, Callable[..., Any]] = {
    "skip_on_spike": lambda sigma=6.0: clipjax.skip_on_spike(clipjax.adamw(1e-2), sigma=sigma),
    "adam": lambda learning_rate=1e-2: clipjax.adam(learning_rate),
    "adamw": lambda learning_rate=1e-2: clipjax.adamw(learning_rate),
}
FACTORIES: dict[str, Callable[..., Any]] = {
    **{name: case.make for name, case in CASES.items()},
    **MORE,
}


def static_args(factory: Any) -> tuple[str, ...]:
    """The numbers given that the docstring lists as static, and callables (schedules else)."""
    if not isinstance(factory, functools.partial):
        return ()
    static = static_arguments(factory.func)
    return tuple(
        k for k, v in factory.keywords.items() if callable(v) or (k in static and v is not None)
    )


@pytest.mark.parametrize("case", sorted(FACTORIES))
def test_no_tracer_leaks_under_inject_hyperparams(case: str) -> None:
    tx = optax.inject_hyperparams(FACTORIES[case], static_args=static_args(FACTORIES[case]))()
    state = tx.init(PARAMS)
    update = jax.jit(tx.update)
    with jax.checking_leaks():
        for t in range(2):
            _, state = update(grads_at(PARAMS, t, spike=1), state, PARAMS)
    jax.block_until_ready(state)


def test_qk_clip_leaks_no_tracer_under_inject_hyperparams() -> None:
    """qk_clip's plan of the params tree is cached by static keys only."""
    params = {"attn": {"query": jax.numpy.ones((4, 2, 3)), "key": jax.numpy.ones((4, 2, 3))}}

    def factory(tau: float = 100.0, alpha: float = 0.5) -> Any:
        return clipjax.qk_clip(optax.sgd(0.1), tau=tau, alpha=alpha)

    tx = optax.inject_hyperparams(factory)()
    state = tx.init(params)
    update = jax.jit(tx.update)
    with jax.checking_leaks():
        for _ in range(2):
            _, state = update(params, state, params, max_logits=jax.numpy.array([400.0, 50.0]))
    jax.block_until_ready(state)
