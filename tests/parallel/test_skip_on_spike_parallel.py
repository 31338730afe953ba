"""``skip_on_spike`` on 8 devices: under ``jax.pmap`` with ``axis_name`` (a spike or a NaN
loss on one replica) the averaged norm and loss decide, as the float64 rule says, and the
replicas stay bit-identical (without ``axis_name`` they disagree); sharded ``jit`` equals
one device."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax
from tests.model import loss_fn, mlp_params
from tests.parallel import reference
from tests.parallel.reference import DEVICES, replica, replicate
from tests.trees import assert_trees_close, assert_trees_equal

N = DEVICES
STEPS = 24
WINDOW, MIN_HISTORY, SIGMA = 8, 4, 6.0
SPIKE_STEP, SPIKE_REPLICA = 12, 3  # that replica's targets times 100
NAN_STEP, NAN_REPLICA = 17, 5  # that replica's loss is NaN (its gradients too)


def data() -> list[tuple[np.ndarray, np.ndarray]]:
    return reference.per_replica_batches(
        STEPS, (SPIKE_STEP, SPIKE_REPLICA, 100.0), (NAN_STEP, NAN_REPLICA)
    )


@functools.cache
def pmap_run(axis_name: str | None) -> list[tuple[Any, Any, np.ndarray, np.ndarray]]:
    """``[(params, state, local norms, local losses)]`` per step, all replicas."""
    # Without axis_name the replicas take different branches of the skip's
    # lax.cond, so the inner transform must not hold a collective (pmean) then.
    average = [reference.pmean_updates("batch")] if axis_name else []
    tx = clipjax.skip_on_spike(
        optax.chain(*average, optax.adam(1e-2)),
        window_size=WINDOW,
        min_history=MIN_HISTORY,
        sigma=SIGMA,
        axis_name=axis_name,
    )

    @functools.partial(jax.pmap, axis_name="batch")
    def step(params: Any, state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state, clipjax.global_norm(grads), loss

    params = replicate(mlp_params())
    state = replicate(tx.init(mlp_params()))
    out = []
    for batch in data():
        params, state, norms, losses = step(params, state, batch)
        out.append(jax.device_get((params, state, norms, losses)))
    return out


def restated_skips(norms: list[float], values: list[float]) -> list[bool]:
    """The rule in float64 on the averaged norm and loss."""
    grad_buffer: list[float] = []
    value_buffer: list[float] = []
    skips = []
    for g, v in zip(norms, values):
        skip = not (np.isfinite(g) and np.isfinite(v))
        for x, buffer in ((g, grad_buffer), (v, value_buffer)):
            if len(buffer) >= MIN_HISTORY:
                skip = skip or x > np.mean(buffer) + SIGMA * np.std(buffer)
        if not skip:
            grad_buffer[:] = [*grad_buffer, g][-WINDOW:]
            value_buffer[:] = [*value_buffer, v][-WINDOW:]
        skips.append(bool(skip))
    return skips


def test_pmap_replicas_agree_on_every_skip_and_stay_identical() -> None:
    run = pmap_run("batch")
    for t, (params, state, _, _) in enumerate(run):
        for i in range(1, N):
            assert_trees_equal(replica((params, state), i), replica((params, state), 0), f"{t}")
    means = [(float(np.mean(n)), float(np.mean(v))) for _, _, n, v in run]
    skips = [bool(np.asarray(s.metrics["skipped"])[0, 0]) for _, s, _, _ in run]
    assert skips == restated_skips(*zip(*means))
    assert skips[SPIKE_STEP] and skips[NAN_STEP] and sum(skips) == 2
    for (_, state, _, _), (mean_norm, mean_loss) in zip(run, means):
        m = replica(state.metrics, 0)
        np.testing.assert_allclose(m["grad_norm"][0], mean_norm, rtol=1e-6)
        if np.isfinite(mean_loss):
            np.testing.assert_allclose(m["value"][0], mean_loss, rtol=1e-6)
    # A skipped step leaves parameters and the inner state untouched on every replica.
    for t in (SPIKE_STEP, NAN_STEP):
        assert_trees_equal(run[t][0], run[t - 1][0], f"params {t}")
        assert_trees_equal(run[t][1].inner_state, run[t - 1][1].inner_state, f"inner {t}")
    assert np.all(
        np.asarray(clipjax.metrics(run[-1][1])["skip_on_spike/global/skipped_count"]) == 2
    )


def test_pmap_without_axis_name_replicas_disagree() -> None:
    """The control: each replica judges its own norm and loss."""
    _, state, _, _ = pmap_run(None)[SPIKE_STEP]
    skipped = np.asarray(state.metrics["skipped"])[:, 0]
    assert skipped[SPIKE_REPLICA] and skipped.sum() == 1


def test_sharded_jit_equals_one_device() -> None:
    tx = clipjax.skip_on_spike(
        optax.sgd(0.05, momentum=0.9), window_size=WINDOW, min_history=MIN_HISTORY, sigma=SIGMA
    )
    sharded, single = (
        reference.sharded_or_single(tx, data(), s, value=True) for s in (True, False)
    )
    for t, (a, b) in enumerate(zip(sharded, single)):
        assert_trees_close(a, b, what=f"step {t}: ")
    skips = [bool(s.metrics["skipped"][0]) for _, s in single]
    assert skips[SPIKE_STEP] and skips[NAN_STEP]
    assert not jnp.isnan(jnp.asarray(jax.tree.leaves(sharded[-1][0])[0])).any()
