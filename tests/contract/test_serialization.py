"""Every clipjax state (each public transform, and skip_on_spike on its fold, select, cond and
chain routes) round-trips through flax.serialization and orbax into a fresh ``init`` of other
params and then steps like the original; clipjax registers its static ``GroupInfo`` with flax
at its own import, with no import hook."""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

ocp = pytest.importorskip("orbax.checkpoint", reason="needs orbax-checkpoint")
serialization = pytest.importorskip("flax.serialization", reason="needs flax")
import clipjax
from tests import registry, scripts
from tests.model import contract_params, grads_at
from tests.trees import assert_trees_equal

CASES: dict[str, Callable[[], optax.GradientTransformation]] = {
    name: registry.CASES[name].make for name in registry.TRANSFORM_IDS
} | {
    "skip_on_spike_fold": lambda: clipjax.skip_on_spike(clipjax.adamw(1e-3), window_size=4),
    "skip_on_spike_select": lambda: clipjax.skip_on_spike(clipjax.zclip(), window_size=4),
    "skip_on_spike_cond": lambda: clipjax.skip_on_spike(optax.adamw(1e-3), window_size=4),
    "skip_on_spike_chain": lambda: clipjax.skip_on_spike(
        clipjax.chain(clipjax.zclip(warmup_steps=2), clipjax.adamw(1e-3)), window_size=4
    ),
}
STEPS = 3


@functools.cache
def stepped(name: str) -> tuple[Any, Any, Any]:
    """``(tx, params, state)`` after ``STEPS`` updates; ``tx.update`` jitted (not through
    ``_replace``: it would drop a fold optimizer's ``update_if``)."""
    tx = CASES[name]()
    tx = optax.GradientTransformationExtraArgs(tx.init, jax.jit(tx.update))
    params = contract_params()
    state = tx.init(params)
    for step in range(STEPS):
        _, state = tx.update(grads_at(params, step), state, params)
    return tx, params, state


def fresh_target(tx: optax.GradientTransformation, params: Any) -> Any:
    """The state of the same model built from other values: a restore target."""
    return tx.init(jax.tree.map(lambda p: p * 2 + 1, params))


def assert_continues(tx: Any, params: Any, restored: Any, state: Any) -> None:
    grads = grads_at(params, STEPS)
    restored = jax.tree.map(jnp.asarray, restored)
    ours, ours_state = tx.update(grads, restored, params)
    theirs, theirs_state = tx.update(grads, state, params)
    assert_trees_equal(ours, theirs)
    assert_trees_equal(ours_state, theirs_state)
    assert clipjax.metrics(ours_state).keys() == clipjax.metrics(theirs_state).keys()


@pytest.mark.parametrize("name", sorted(CASES))
def test_flax_bytes_round_trip(name: str) -> None:
    tx, params, state = stepped(name)
    data = serialization.to_bytes(state)
    restored = serialization.from_bytes(fresh_target(tx, params), data)
    assert_trees_equal(restored, state)
    assert_continues(tx, params, restored, state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_flax_state_dict_round_trip(name: str) -> None:
    tx, params, state = stepped(name)
    state_dict = serialization.to_state_dict(state)
    for leaf in jax.tree.leaves(state_dict):  # only arrays: the names stay static
        assert isinstance(leaf, jax.Array), type(leaf)
    restored = serialization.from_state_dict(fresh_target(tx, params), state_dict)
    assert_trees_equal(restored, state)


@pytest.mark.parametrize("name", sorted(CASES))
def test_orbax_round_trip(name: str, tmp_path: Path) -> None:
    tx, params, state = stepped(name)
    target = fresh_target(tx, params)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "standard", state)
        checkpointer.wait_until_finished()
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = checkpointer.restore(tmp_path / "standard", abstract)
    assert_trees_equal(restored, state)
    assert_continues(tx, params, restored, state)
    with ocp.PyTreeCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "pytree", state)
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = checkpointer.restore(tmp_path / "pytree", item=target, restore_args=restore_args)
    assert_trees_equal(restored, state)


def test_group_info_is_registered_at_import() -> None:
    """Registered before any ``init`` (skip_on_spike's init never registered it)."""
    assert clipjax.GroupInfo in serialization._STATE_DICT_REGISTRY
    info = clipjax.GroupInfo("zclip", None, ("global",), ("w",), ((3,),))
    assert serialization.to_state_dict(info) == {}
    assert serialization.from_state_dict(info, {}) is info


def test_no_import_hook() -> None:
    """Issue 37: clipjax inserted a finder at sys.meta_path[0] to wait for flax."""
    finders = [f"{type(f).__module__}.{type(f).__name__}" for f in sys.meta_path]
    assert not [f for f in finders if f.startswith("clipjax")], finders
    assert not hasattr(clipjax._metrics, "register_serialization")


# The state is made and stepped before the program imports flax ("after"): clipjax
# registered at its own import, with no finder in sys.meta_path.
SCRIPT = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp, optax
    if sys.argv[1] == "before":
        import flax.serialization
    import clipjax
    routes = {
        "fold": clipjax.skip_on_spike(clipjax.adamw(1e-3), window_size=4),
        "select": clipjax.skip_on_spike(clipjax.zclip(), window_size=4),
        "cond": clipjax.skip_on_spike(optax.adamw(1e-3), window_size=4),
        "zclip": optax.chain(clipjax.zclip(), optax.adam(1e-3)),
    }
    params = {"w": jnp.arange(3.0), "b": jnp.ones(2)}
    states = {}
    for route, tx in routes.items():
        state = tx.init(params)
        _, states[route] = tx.update(jax.tree.map(jnp.ones_like, params), state, params)
    if sys.argv[1] == "after":
        hooks = [f for f in sys.meta_path if type(f).__module__.startswith("clipjax")]
        assert not hooks, hooks
        import flax.serialization
    for route, tx in routes.items():
        data = flax.serialization.to_bytes(states[route])
        restored = flax.serialization.from_bytes(tx.init(params), data)
        assert jax.tree.structure(restored) == jax.tree.structure(states[route])
        for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(states[route])):
            assert (jnp.asarray(a) == b).all() or (jnp.isnan(b).all() and jnp.isnan(a).all())
    print("round-tripped", sorted(routes))
    """
)


@pytest.mark.parametrize("order", ["before", "after"])
def test_flax_imported_before_or_after_clipjax(order: str) -> None:
    """A real import order, in a fresh interpreter."""
    result = scripts.python("-c", SCRIPT, order, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "round-tripped ['cond', 'fold', 'select', 'zclip']" in result.stdout


WITHOUT_FLAX = textwrap.dedent(
    """
    import sys
    sys.modules["flax"] = None  # as if flax were not installed: importing it fails
    import jax.numpy as jnp
    import clipjax
    assert not clipjax._serialization.register()
    assert not [m for m in sys.modules if m.startswith("flax.")]
    tx = clipjax.zclip()
    _, state = tx.update({"w": jnp.ones(3)}, tx.init({"w": jnp.zeros(3)}))
    print(sorted(clipjax.metrics(state))[0])
    """
)


def test_without_flax_clipjax_imports_and_works() -> None:
    result = scripts.python("-c", WITHOUT_FLAX, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "zclip/global/capped"
