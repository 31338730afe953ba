"""What the 8-device tests compare with: every training clipper on one device on the full
batch (:func:`single_device_run`), one device fed ``mean(|c|) * u_t`` for per-device
gradients ``c_d * u_t`` (:func:`averaged_norm_reference`), and the pieces of their runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.model import BATCH, IN, OUT, batches, loss_fn, mlp_params
from tests.model import train_step as model_train_step
from tests.registry import AXIS_IDS, all_clippers, optimizer

STEPS = 8
DEVICES = 8


def mesh(axis: str = "i") -> Mesh:
    """Every device along one mesh axis named ``axis``."""
    return Mesh(np.array(jax.devices()), (axis,))


def replicate(tree: Any) -> Any:
    """``tree`` on every device, placed as ``pmap`` places its outputs (inputs placed
    otherwise, e.g. by ``jnp.broadcast_to``, make the second step compile again)."""
    return jax.pmap(lambda _: tree, axis_name="batch")(np.arange(DEVICES))


def replica(tree: Any, i: int) -> Any:
    """Replica ``i``'s copy of a ``pmap`` output (its leading axis), as NumPy."""
    return jax.tree.map(lambda x: np.asarray(x)[i], tree)


def pmean_updates(axis_name: str) -> optax.GradientTransformation:
    """Averages the (per-device) updates over ``axis_name``: a stateless transform."""
    return optax.stateless(lambda updates, params: jax.lax.pmean(updates, axis_name))


@functools.cache
def single_device_run(steps: int = STEPS) -> list[tuple[Any, Any, Any]]:
    """``[(params, opt_state, updates)]`` after each step of :func:`all_clippers` on one device."""
    tx = optimizer(all_clippers())
    params = mlp_params()
    state = tx.init(params)
    step = jax.jit(model_train_step(tx))
    out = []
    for batch in batches(steps):
        params, state, updates = step(params, state, batch)
        out.append(jax.device_get((params, state, updates)))
    return out


# Device d's gradient is c_d * u_t: its group norms are |c_d| * ||u_t||, their
# average over the devices mean(|c|) * ||u_t||.
COEFFS = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 0.25, 1.5], np.float32)


@functools.cache
def unaveraged_stream() -> list[tuple[Any, np.ndarray]]:
    """``[(u_t, c_t)]``: a gradient direction per step and the 8 device coefficients."""
    params = mlp_params()
    treedef = jax.tree.structure(params)
    out = []
    for t in range(STEPS):
        keys = jax.random.split(jax.random.PRNGKey(100 + t), treedef.num_leaves)
        leaves = [
            0.3 * jax.random.normal(k, p.shape) for k, p in zip(keys, jax.tree.leaves(params))
        ]
        c = np.roll(COEFFS, t) * np.float32(20.0 if t == 5 else 1.0)
        out.append((jax.tree.unflatten(treedef, leaves), c))
    return out


def scaled_by_device(tree: Any, c: np.ndarray, d: int) -> Any:
    """``tree * c[d] / mean(|c|)``: device d's output when the reference is ``tree``."""
    factor = c[d] / np.mean(np.abs(c))
    return jax.tree.map(lambda x: x * factor, tree)


def per_device(u: Any, c: np.ndarray) -> Any:
    """``[8, ...]`` leaves: device d's gradient ``c[d] * u``."""
    return jax.tree.map(lambda x: jnp.asarray(c).reshape((DEVICES,) + (1,) * x.ndim) * x, u)


@functools.cache
def averaged_norm_reference() -> list[tuple[Any, Any]]:
    """One device fed ``mean(|c|) * u``: ``[(updates, state)]`` per step."""
    tx = all_clippers(AXIS_IDS)
    params = mlp_params()
    update = jax.jit(tx.update)
    state = tx.init(params)
    out = []
    for u, c in unaveraged_stream():
        mean_abs = np.mean(np.abs(c))
        updates, state = update(jax.tree.map(lambda x, m=mean_abs: m * x, u), state, params)
        out.append(jax.device_get((updates, state)))
    return out


def state_sharding(
    tx: optax.GradientTransformation, params: Any, param_sharding: Any, replicated: Any
) -> Any:
    """Shardings for ``tx.init(params)``: parameter-shaped parts (momentum) like the
    parameters, the rest (counters, clipjax states) replicated. Without them, ``jit(tx.init)``
    leaves what does not depend on the parameters on one device and the first step compiles
    twice (``optax.tree_utils.tree_map_params`` builds the same; ``test_compat`` checks it)."""
    params_def = jax.tree.structure(params)

    def is_param_shaped(x: Any) -> bool:
        return jax.tree.structure(x) == params_def

    def sharding(x: Any) -> Any:
        return param_sharding if is_param_shaped(x) else replicated

    return jax.tree.map(sharding, jax.eval_shape(tx.init, params), is_leaf=is_param_shaped)


def per_replica_batches(
    steps: int, spike: tuple[int, int, float], nan: tuple[int, int]
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Batches ``[8, BATCH // 8, ...]`` without :data:`model.SPIKES`; ``spike = (step, replica,
    factor)`` multiplies its targets, ``nan = (step, replica)`` makes one of them NaN."""
    (spike_step, spike_replica, factor), (nan_step, nan_replica) = spike, nan
    out = []
    for t, (x, y) in enumerate(batches(steps, spikes=None)):
        x = x.reshape(DEVICES, BATCH // DEVICES, IN).copy()
        y = y.reshape(DEVICES, BATCH // DEVICES, OUT).copy()
        if t == spike_step:
            y[spike_replica] *= factor
        if t == nan_step:
            y[nan_replica, 0, 0] = np.nan
        out.append((x, y))
    return out


def train_step(tx: optax.GradientTransformation, value: bool) -> Callable[..., tuple[Any, Any]]:
    """``(params, state, batch) -> (params, state)``; ``value``: the loss goes to ``tx``."""

    def step(params: Any, state: Any, batch: Any) -> tuple[Any, Any]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params, **({"value": loss} if value else {}))
        return optax.apply_updates(params, updates), state

    return step


def sharded_or_single(
    tx: optax.GradientTransformation, data: list[Any], sharded: bool, value: bool = False
) -> list[tuple[Any, Any]]:
    """``[(params, state)]`` after each ``step(params, state, batch)`` under ``jit`` on the
    joined batches: split over a mesh axis (state replicated, and stays so) or on one device."""
    params = mlp_params()
    full = [(x.reshape(BATCH, IN), y.reshape(BATCH, OUT)) for x, y in data]
    if sharded:
        m = mesh("data")
        replicated = NamedSharding(m, P())
        params = jax.device_put(params, replicated)
        state = jax.jit(tx.init, out_shardings=replicated)(params)
        full = [jax.device_put(b, NamedSharding(m, P("data"))) for b in full]
        jitted = jax.jit(train_step(tx, value), out_shardings=replicated)
    else:
        device = jax.devices()[0]
        params = jax.device_put(params, device)
        state = jax.device_put(tx.init(params), device)  # committed, as the step's outputs
        full = [jax.device_put(b, device) for b in full]
        jitted = jax.jit(train_step(tx, value))
    out = []
    for batch in full:
        params, state = jitted(params, state, batch)
        out.append(jax.device_get((params, state)))
    assert jitted._cache_size() == 1
    if sharded:
        assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(state))
    return out
