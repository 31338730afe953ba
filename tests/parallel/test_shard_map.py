"""``jax.shard_map`` on 8 devices.

``out_specs=P()`` for the clipjax state makes JAX prove at trace time that the
state does not vary over the mesh axis (``check_vma``); the tests also read
every device's copy and compare it with the single-device references.

* Per-device, not yet averaged gradients with ``axis_name=``: identical
  statistics on every device, equal to one device fed the averaged norm.
* Gradients averaged with ``lax.pmean`` in the step, no ``axis_name``:
  identical states, equal to one device on the full batch.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipjax
from tests.model import batches, loss_fn, mlp_params
from tests.parallel import reference
from tests.parallel.reference import DEVICES, STEPS, mesh
from tests.registry import AXIS_IDS, CLIPPER_IDS, all_clippers, optimizer
from tests.trees import assert_trees_close


def device_copies(tree: Any) -> list[Any]:
    """Each device's copy of a replicated tree, as NumPy."""
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = [[np.asarray(s.data) for s in x.addressable_shards] for x in leaves]
    assert all(len(p) == DEVICES for p in per_leaf)
    return [jax.tree.unflatten(treedef, [p[d] for p in per_leaf]) for d in range(DEVICES)]


def assert_copies_identical(tree: Any, what: str) -> None:
    copies = device_copies(tree)
    for d, copy in enumerate(copies[1:], 1):
        for a, b in zip(jax.tree.leaves(copy), jax.tree.leaves(copies[0])):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: device {d} vs 0")


@functools.cache
def axis_name_run() -> list[tuple[Any, Any]]:
    """Per-device gradients ``c_d * u``, clippers with ``axis_name="i"``."""
    tx = all_clippers(AXIS_IDS, axis_name="i")
    params = mlp_params()

    def local(state: Any, grads: Any, params: Any) -> Any:
        out, state = tx.update(jax.tree.map(lambda x: x[0], grads), state, params)
        return jax.tree.map(lambda x: x[None], out), state

    update = jax.jit(
        jax.shard_map(local, mesh=mesh(), in_specs=(P(), P("i"), P()), out_specs=(P("i"), P()))
    )
    state = tx.init(params)
    out = []
    for u, c in reference.unaveraged_stream():
        updates, state = update(state, reference.per_device(u, c), params)
        assert_copies_identical(state, "state")
        out.append(jax.device_get((updates, state)))
    return out


@pytest.mark.parametrize("name", AXIS_IDS)
def test_axis_name_state_equals_one_device_fed_the_averaged_norm(name: str) -> None:
    axis_name_run()  # asserts that every device holds the same state
    for t, ((_, state), (_, ref_state)) in enumerate(
        zip(axis_name_run(), reference.averaged_norm_reference())
    ):
        assert_trees_close(state[name], ref_state[name], what=f"{name} step {t}: ")


def test_axis_name_applies_the_same_scale_on_every_device() -> None:
    for t, ((out, _), (ref_out, _), (_, c)) in enumerate(
        zip(axis_name_run(), reference.averaged_norm_reference(), reference.unaveraged_stream())
    ):
        for d in range(DEVICES):
            expected = reference.scaled_by_device(ref_out, c, d)
            mine = jax.tree.map(lambda x, d=d: x[d], out)
            assert_trees_close(mine, expected, what=f"step {t} device {d}: ")
    assert bool(clipjax.metrics(axis_name_run()[5][1])["zclip/global/clipped"])


@functools.cache
def pmean_run() -> list[tuple[Any, Any, Any]]:
    """A shard_map train step whose gradients are averaged before the optimizer.

    With ``check_vma`` the gradient of replicated (``P()``) parameters comes back
    already summed over the axis (the transpose of an implicit ``pvary`` is a
    ``psum``), so the loss is averaged with ``pmean`` rather than the gradients.
    """
    tx = optimizer(all_clippers())  # all of them: single_device_run is the reference

    def local(params: Any, state: Any, batch: Any) -> Any:
        grads = jax.grad(lambda p: jax.lax.pmean(loss_fn(p, batch), "i"))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    step = jax.jit(
        jax.shard_map(local, mesh=mesh(), in_specs=(P(), P(), P("i")), out_specs=(P(), P(), P()))
    )
    params = mlp_params()
    state = tx.init(params)
    data = NamedSharding(mesh(), P("i"))
    out = []
    for batch in batches(STEPS):
        params, state, updates = step(params, state, jax.device_put(batch, data))
        assert_copies_identical(state[0], "state")
        out.append(jax.device_get((params, state, updates)))
    return out


@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_pmean_gradients_state_equals_one_device(name: str) -> None:
    for t, ((_, state, _), (_, ref_state, _)) in enumerate(
        zip(pmean_run(), reference.single_device_run())
    ):
        assert_trees_close(state[0][name], ref_state[0][name], what=f"{name} step {t}: ")


def test_pmean_gradients_updates_equal_one_device() -> None:
    for t, ((params, _, updates), (ref_params, _, ref_updates)) in enumerate(
        zip(pmean_run(), reference.single_device_run())
    ):
        assert_trees_close(updates, ref_updates, what=f"step {t} updates")
        assert_trees_close(params, ref_params, what=f"step {t} params")
