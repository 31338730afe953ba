"""``skip_and_clip_by_global_norm`` and ``clip_norm_by_ema`` on 8 devices: under
``jax.pmap`` with ``axis_name`` (one replica spikes, one goes NaN) every replica drops the
same steps, applies the same scale and stays bit-identical (without ``axis_name`` they
disagree); sharded ``jit`` equals one device."""

from __future__ import annotations

import functools
from typing import Any

import jax
import numpy as np
import optax

import clipjax
from tests.model import loss_fn, mlp_params
from tests.parallel import reference
from tests.parallel.reference import DEVICES, replica, replicate
from tests.trees import assert_trees_close, assert_trees_equal

N = DEVICES
STEPS = 16
SPIKE_STEP, SPIKE_REPLICA = 9, 3
NAN_STEP, NAN_REPLICA = 12, 5


def data() -> list[tuple[np.ndarray, np.ndarray]]:
    return reference.per_replica_batches(
        STEPS, (SPIKE_STEP, SPIKE_REPLICA, 1000.0), (NAN_STEP, NAN_REPLICA)
    )


def make(axis_name: str | None) -> optax.GradientTransformation:
    rule = clipjax.drop_norm_by_grad_norm_ema((5,))
    # With axis_name, the clipped updates are averaged before adamw: every replica
    # then holds the same parameters and moments.
    average = [reference.pmean_updates(axis_name)] if axis_name else []
    return clipjax.skip_and_clip_by_global_norm(
        optax.chain(clipjax.clip_norm_by_ema(axis_name=axis_name), *average, clipjax.adamw(1e-2)),
        drop_norm=rule,
        max_norm=1.0,
        grad_norm_ema_decay=0.9,
        axis_name=axis_name,
    )


@functools.cache
def pmap_run(axis_name: str | None) -> list[Any]:
    tx = make(axis_name)

    @functools.partial(jax.pmap, axis_name="batch")
    def step(params: Any, state: Any, batch: Any) -> Any:
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    params, state = replicate(mlp_params()), replicate(tx.init(mlp_params()))
    out = []
    for batch in data():
        params, state = step(params, state, batch)
        out.append(jax.device_get((params, state)))
    return out


def test_pmap_replicas_drop_the_same_steps_and_stay_identical() -> None:
    run = pmap_run("batch")
    for t, (params, state) in enumerate(run):
        skipped = np.asarray(state.metrics["skipped"])[:, 0]
        assert skipped.all() or not skipped.any(), t
        # The EMAs of the updates differ between replicas (their gradients do);
        # the decisions, the scales, the parameters and adamw's moments do not.
        ema_state, adam_state = state.inner_state[0], state.inner_state[-1]
        same = (params, state.metrics, state.mean, state.var, ema_state.metrics, adam_state)
        for i in range(1, N):
            assert_trees_equal(replica(same, i), replica(same, 0), f"{t}")
    skipped = [bool(np.asarray(s.metrics["skipped"])[0, 0]) for _, s in run]
    assert skipped[SPIKE_STEP] and skipped[NAN_STEP] and sum(skipped) == 2


def test_pmap_without_axis_name_replicas_disagree() -> None:
    _, state = pmap_run(None)[SPIKE_STEP]
    skipped = np.asarray(state.metrics["skipped"])[:, 0]
    assert skipped[SPIKE_REPLICA] and skipped.sum() == 1


def test_sharded_jit_equals_one_device() -> None:
    sharded, single = (reference.sharded_or_single(make(None), data(), s) for s in (True, False))
    for t, ((params, state), (want_params, want)) in enumerate(zip(sharded, single)):
        assert_trees_close(params, want_params, rtol=1e-5, what=f"step {t}: ")
        assert_trees_close(state.inner_state, want.inner_state, rtol=1e-5, what=f"step {t}: ")
        assert_trees_close(state.metrics, want.metrics, rtol=1e-6, what=f"step {t}: ")
        # The spread of a few nearly equal norms: its square amplifies their rounding.
        np.testing.assert_allclose(np.sqrt(state.var), np.sqrt(want.var), rtol=1e-4, atol=1e-8)
    assert bool(single[NAN_STEP][1].metrics["skipped"][0])
