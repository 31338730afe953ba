"""``jax.pmap`` and ``jax.shard_map`` on 8 devices, every clipper in one program
(``registry.all_clippers``); every device's copy of the state is read and compared.

Gradients averaged with ``lax.pmean``: every device's state is bit-identical and equals one
device on the full batch. Per-device gradients with ``axis_name=``: identical statistics and
scales, equal to one device fed the averaged norm; without it they drift apart. shard_map's
``out_specs=P()`` also makes JAX prove at trace time that the state does not vary.
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
from tests.model import BATCH, IN, OUT, batches, loss_fn, mlp_params
from tests.parallel import reference
from tests.parallel.reference import DEVICES, STEPS, mesh, replica, replicate
from tests.registry import AXIS_IDS, CLIPPER_IDS, all_clippers, optimizer
from tests.trees import assert_trees_close

N = DEVICES
MODES = ("pmap", "shard_map")


def one(mode: str, tree: Any) -> Any:
    """One copy of a replicated tree: pmap's replica 0 (shard_map's is a global array)."""
    return replica(tree, 0) if mode == "pmap" else tree


def assert_copies_identical(mode: str, tree: Any, what: str) -> None:
    """Every device holds the same bits: pmap's leading axis, shard_map's shards."""
    for x in jax.tree.leaves(tree):
        x = np.asarray(x) if mode == "pmap" else [np.asarray(s.data) for s in x.addressable_shards]
        copies = list(x)
        assert len(copies) == N
        for d in range(1, N):
            np.testing.assert_array_equal(copies[d], copies[0], err_msg=f"{what}: device {d} vs 0")


@functools.cache
def pmean_run(mode: str) -> list[tuple[Any, Any, Any]]:
    """``[(params, opt_state, updates)]`` per step, gradients averaged before the optimizer."""
    tx = optimizer(all_clippers())  # all of them: single_device_run is the reference
    if mode == "pmap":

        def local(params: Any, state: Any, batch: Any) -> Any:
            grads = jax.lax.pmean(jax.grad(loss_fn)(params, batch), "i")
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, updates

        step = jax.pmap(local, axis_name="i")
        params, state = replicate(mlp_params()), replicate(tx.init(mlp_params()))
        data = [(x.reshape(N, BATCH // N, IN), y.reshape(N, BATCH // N, OUT))
                for x, y in batches(STEPS)]  # fmt: skip
    else:
        # With check_vma the gradient of replicated (P()) parameters comes back already
        # summed over the axis (the transpose of an implicit pvary is a psum), so the loss
        # is averaged with pmean rather than the gradients.
        def local(params: Any, state: Any, batch: Any) -> Any:
            grads = jax.grad(lambda p: jax.lax.pmean(loss_fn(p, batch), "i"))(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state, updates

        specs = dict(in_specs=(P(), P(), P("i")), out_specs=(P(), P(), P()))
        step = jax.jit(jax.shard_map(local, mesh=mesh(), **specs))
        params, state = mlp_params(), tx.init(mlp_params())
        data = [jax.device_put(b, NamedSharding(mesh(), P("i"))) for b in batches(STEPS)]
    out = []
    for batch in data:
        params, state, updates = step(params, state, batch)
        checked = (params, state, updates) if mode == "pmap" else state[0]
        assert_copies_identical(mode, checked, f"step {len(out)}")
        out.append(jax.device_get((params, state, updates)))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_pmean_gradients_state_equals_one_device(name: str, mode: str) -> None:
    for t, ((_, state, _), (_, ref_state, _)) in enumerate(
        zip(pmean_run(mode), reference.single_device_run())
    ):
        mine = one(mode, state)[0][name]
        assert_trees_close(mine, ref_state[0][name], what=f"{mode} {name} step {t}: ")
    assert int(clipjax.metrics(mine)[f"{name}/{mine.info.groups[0]}/step"]) == STEPS


@pytest.mark.parametrize("mode", MODES)
def test_pmean_gradients_updates_and_params_equal_one_device(mode: str) -> None:
    for t, (mine, (ref_params, _, ref_updates)) in enumerate(
        zip(pmean_run(mode), reference.single_device_run())
    ):
        params, _, updates = one(mode, mine)
        assert_trees_close(updates, ref_updates, what=f"{mode} step {t} updates")
        assert_trees_close(params, ref_params, what=f"{mode} step {t} params")
    # The spike at step 5 was clipped, so equality covers a clipping step.
    spike = clipjax.metrics(one(mode, pmean_run(mode)[5][1]))
    assert bool(spike["zclip/global/clipped"]) and bool(spike["clip_by_global_norm/global/clipped"])


def test_metrics_of_a_replicated_state_have_one_value_per_replica() -> None:
    _, state, _ = pmean_run("pmap")[-1]
    m = clipjax.metrics(state)
    assert m["zclip/global/threshold"].shape == (N,)
    assert m["zclip_per_layer/params/Dense_1/scale"].shape == (N,)
    assert clipjax.metrics(replica(state, 0))["zclip/global/threshold"].shape == ()


@functools.cache
def axis_name_run(mode: str) -> list[tuple[Any, Any]]:
    """``[(updates, state)]`` per step: device d's gradient ``c_d * u``, ``axis_name="i"``."""
    tx = all_clippers(AXIS_IDS, axis_name="i")
    params = mlp_params()
    if mode == "pmap":
        update = jax.pmap(tx.update, axis_name="i", in_axes=(0, 0, None))
        state = replicate(tx.init(params))
    else:

        def local(grads: Any, state: Any, params: Any) -> Any:
            out, state = tx.update(jax.tree.map(lambda x: x[0], grads), state, params)
            return jax.tree.map(lambda x: x[None], out), state

        specs = dict(in_specs=(P("i"), P(), P()), out_specs=(P("i"), P()))
        update = jax.jit(jax.shard_map(local, mesh=mesh(), **specs))
        state = tx.init(params)
    out = []
    for u, c in reference.unaveraged_stream():
        updates, state = update(reference.per_device(u, c), state, params)
        assert_copies_identical(mode, state, f"state step {len(out)}")
        out.append(jax.device_get((updates, state)))
    return out


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", AXIS_IDS)
def test_axis_name_state_equals_one_device_fed_the_averaged_norm(name: str, mode: str) -> None:
    for t, ((_, state), (_, ref_state)) in enumerate(
        zip(axis_name_run(mode), reference.averaged_norm_reference())
    ):
        assert_trees_close(one(mode, state)[name], ref_state[name], what=f"{mode} {name} {t}: ")


@pytest.mark.parametrize("mode", MODES)
def test_axis_name_applies_the_same_scale_on_every_device(mode: str) -> None:
    for t, ((out, _), (ref_out, _), (_, c)) in enumerate(
        zip(axis_name_run(mode), reference.averaged_norm_reference(), reference.unaveraged_stream())
    ):
        # Device d's output is c_d / mean|c| times the reference output.
        for d in range(N):
            expected = reference.scaled_by_device(ref_out, c, d)
            assert_trees_close(replica(out, d), expected, what=f"{mode} step {t} device {d}: ")
    assert bool(clipjax.metrics(one(mode, axis_name_run(mode)[5][1]))["zclip/global/clipped"])


def test_without_axis_name_replicas_drift_apart() -> None:
    """The control: per-device gradients without ``axis_name`` give per-device statistics."""
    tx = clipjax.zclip(warmup_steps=3)
    params = mlp_params()
    update = jax.pmap(tx.update, axis_name="batch", in_axes=(0, 0, None))
    state = replicate(tx.init(params))
    for u, c in reference.unaveraged_stream()[:4]:
        _, state = update(reference.per_device(u, c), state, params)
    means = np.asarray(clipjax.metrics(state)["zclip/global/mean"])  # one per replica
    assert len(set(means.tolist())) == N
