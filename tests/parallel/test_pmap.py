"""``jax.pmap`` data parallelism on 8 devices.

* Gradients averaged with ``lax.pmean`` before the optimizer: every replica's
  clipjax state is bit-identical and equals a single-device run on the full
  batch.
* Per-device, not yet averaged gradients and ``axis_name=``: the clipper
  averages the group norms over the axis, so every replica keeps identical
  statistics and applies the same scale, equal to a single-device run fed the
  averaged norm. Without ``axis_name`` the replicas drift apart.

Every clipper runs in one program (``registry.all_clippers``); the tests
parametrised by clipper check that clipper's part of the state.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax
import pytest

import clipjax
from tests.model import BATCH, IN, OUT, batches, loss_fn, mlp_params
from tests.parallel import reference
from tests.parallel.reference import DEVICES, STEPS, replica, replicate
from tests.registry import AXIS_IDS, CLIPPER_IDS, all_clippers, optimizer
from tests.trees import assert_trees_close

N = DEVICES


def assert_replicas_identical(tree: Any, what: str) -> None:
    """Bit-identical on every replica (the leading axis)."""
    for path, x in jax.tree_util.tree_leaves_with_path(tree):
        x = np.asarray(x)
        for i in range(1, N):
            np.testing.assert_array_equal(
                x[i], x[0], err_msg=f"{what}{jax.tree_util.keystr(path)}: replica {i} vs 0"
            )


def clipper_states(opt_state: Any) -> dict[str, Any]:
    """``{case name: clipjax state}`` from ``chain(all_clippers(), sgd)``'s state."""
    return opt_state[0]


@functools.cache
def pmean_run() -> list[tuple[Any, Any, Any]]:
    """``[(params, opt_state, updates)]`` per step, replicated over 8 devices."""
    tx = optimizer(all_clippers())

    @functools.partial(jax.pmap, axis_name="batch")
    def step(params: Any, state: Any, batch: Any) -> Any:
        grads = jax.lax.pmean(jax.grad(loss_fn)(params, batch), "batch")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, updates

    params = replicate(mlp_params())
    state = replicate(tx.init(mlp_params()))
    out = []
    for x, y in batches(STEPS):
        shards = (x.reshape(N, BATCH // N, IN), y.reshape(N, BATCH // N, OUT))
        params, state, updates = step(params, state, shards)
        out.append(jax.device_get((params, state, updates)))
    return out


@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_pmean_gradients_keep_replicas_identical_and_equal_to_one_device(name: str) -> None:
    for t, ((_, state, _), (_, ref_state, _)) in enumerate(
        zip(pmean_run(), reference.single_device_run())
    ):
        mine = clipper_states(state)[name]
        assert_replicas_identical(mine, f"{name} step {t}: ")
        assert_trees_close(
            replica(mine, 0), clipper_states(ref_state)[name], what=f"{name} step {t}: "
        )
    assert int(clipjax.metrics(replica(mine, 0))[f"{name}/{mine.info.groups[0]}/step"]) == STEPS


def test_pmean_updates_and_params_equal_one_device() -> None:
    for t, ((params, _, updates), (ref_params, _, ref_updates)) in enumerate(
        zip(pmean_run(), reference.single_device_run())
    ):
        assert_replicas_identical((params, updates), f"step {t}: ")
        assert_trees_close(replica(updates, 0), ref_updates, what=f"step {t} updates")
        assert_trees_close(replica(params, 0), ref_params, what=f"step {t} params")
    # The spike at step 5 was clipped, so equality covers a clipping step.
    spike = clipjax.metrics(replica(pmean_run()[5][1], 0))
    assert bool(spike["zclip/global/clipped"]) and bool(spike["clip_by_global_norm/global/clipped"])


def test_metrics_of_a_replicated_state_have_one_value_per_replica() -> None:
    _, state, _ = pmean_run()[-1]
    m = clipjax.metrics(state)
    assert m["zclip/global/threshold"].shape == (N,)
    assert m["zclip_per_layer/params/Dense_1/scale"].shape == (N,)
    assert clipjax.metrics(replica(state, 0))["zclip/global/threshold"].shape == ()


@functools.cache
def axis_name_run() -> list[tuple[Any, Any]]:
    tx = all_clippers(AXIS_IDS, axis_name="batch")
    params = mlp_params()
    update = jax.pmap(tx.update, axis_name="batch", in_axes=(0, 0, None))
    state = replicate(tx.init(params))
    out = []
    for u, c in reference.unaveraged_stream():
        updates, state = update(reference.per_device(u, c), state, params)
        out.append(jax.device_get((updates, state)))
    return out


@pytest.mark.parametrize("name", AXIS_IDS)
def test_axis_name_keeps_replicas_identical_and_uses_the_averaged_norm(name: str) -> None:
    for t, ((_, state), (_, ref_state)) in enumerate(
        zip(axis_name_run(), reference.averaged_norm_reference())
    ):
        assert_replicas_identical(state[name], f"{name} step {t}: ")
        assert_trees_close(replica(state[name], 0), ref_state[name], what=f"{name} {t}: ")


def test_axis_name_applies_the_same_scale_on_every_replica() -> None:
    for t, ((out, _), (ref_out, _), (_, c)) in enumerate(
        zip(axis_name_run(), reference.averaged_norm_reference(), reference.unaveraged_stream())
    ):
        # Replica d's output is c_d / mean|c| times the reference output.
        for d in range(N):
            expected = reference.scaled_by_device(ref_out, c, d)
            assert_trees_close(replica(out, d), expected, what=f"step {t} replica {d}: ")
    spike = clipjax.metrics(replica(axis_name_run()[5][1], 0))
    assert bool(spike["zclip/global/clipped"])


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
