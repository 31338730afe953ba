"""Data-parallel training with a clipjax clipper: ``jax.pmap`` and sharded ``jax.jit``.

Trains a small MLP on a synthetic regression task, with a gradient spike at
``--spike-step``, three ways on 8 devices (on a CPU, 8 fake devices are made
with ``--xla_force_host_platform_device_count=8`` before JAX starts):

1. ``jax.pmap``: each device takes a slice of the batch, the gradients are
   averaged with ``lax.pmean`` before the optimizer, so every replica's
   clipper sees the same gradient and keeps the same state;
2. ``jax.jit`` with ``NamedSharding``, data parallel: parameters replicated,
   the batch split over the mesh;
3. ``jax.jit`` with ``NamedSharding``, FSDP-style: parameters, gradients and
   optimizer moments split over the mesh too.

All three print the same losses and clipper metrics as one device would, read
with ``clipjax.metrics``. For several processes (one per host), see the
"Multiple hosts" guide (``docs/multi_host.md``): the same sharded ``jit`` step,
with ``jax.distributed.initialize`` first.

Usage::

    python examples/data_parallel.py
    python examples/data_parallel.py --clipper autoclip --steps 40
"""

from __future__ import annotations

import os
import sys

if "jax" not in sys.modules:  # XLA reads the flag when JAX starts its backend.
    _flag = "--xla_force_host_platform_device_count=8"
    if _flag not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()

import argparse
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import clipjax

IN, HIDDEN, OUT = 8, 32, 8
PER_DEVICE_BATCH = 4

CLIPPERS = {
    "zclip": lambda: clipjax.zclip(warmup_steps=5),
    "hist_clip": lambda: clipjax.hist_clip(warmup_steps=5),
    "clip_by_global_norm": lambda: clipjax.clip_by_global_norm(1.0),
}
if hasattr(clipjax, "autoclip"):
    CLIPPERS["autoclip"] = lambda: clipjax.autoclip(warmup_steps=5, min_history=5)


def init_params(seed: int = 0) -> dict[str, Any]:
    k0, k1 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "Dense_0": {
            "kernel": jax.random.normal(k0, (IN, HIDDEN)) / np.sqrt(IN),
            "bias": jnp.zeros((HIDDEN,)),
        },
        "Dense_1": {
            "kernel": jax.random.normal(k1, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
            "bias": jnp.zeros((OUT,)),
        },
    }


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    h = jnp.tanh(x @ params["Dense_0"]["kernel"] + params["Dense_0"]["bias"])
    pred = h @ params["Dense_1"]["kernel"] + params["Dense_1"]["bias"]
    return jnp.mean((pred - y) ** 2)


def make_batches(steps: int, batch_size: int, spike_step: int) -> list[tuple[np.ndarray, ...]]:
    rng = np.random.default_rng(0)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    out = []
    for step in range(steps):
        x = rng.normal(size=(batch_size, IN)).astype(np.float32)
        y = np.sin(x @ w) * (100.0 if step == spike_step else 1.0)
        out.append((x, y.astype(np.float32)))
    return out


LOG_EVERY = 5


def report(label: str, step: int, loss: Any, metrics: dict[str, Any], algo: str) -> None:
    """Prints every ``LOG_EVERY`` steps, and every step the clipper clips."""
    if step % LOG_EVERY and not bool(metrics[f"{algo}/global/clipped"]):
        return
    print(
        f"{label:>14} step {step:3d}  loss {float(loss):9.4f}  "
        f"grad_norm {float(metrics[f'{algo}/global/grad_norm']):9.4f}  "
        f"scale {float(metrics[f'{algo}/global/scale']):.4f}"
    )


def train_pmap(tx: optax.GradientTransformation, batches: list, algo: str) -> Any:
    """``jax.pmap``: gradients averaged with ``lax.pmean`` before the optimizer."""
    n = jax.local_device_count()

    @functools.partial(jax.pmap, axis_name="batch")
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        grads = jax.lax.pmean(grads, "batch")  # every replica: the same gradient
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, jax.lax.pmean(loss, "batch")

    # Place the copies as pmap places its outputs (else step 2 compiles again).
    replicate = jax.pmap(lambda _, tree: tree, axis_name="batch", in_axes=(0, None))
    params = replicate(np.arange(n), init_params())
    opt_state = replicate(np.arange(n), tx.init(init_params()))
    for t, (x, y) in enumerate(batches):
        shards = (x.reshape(n, -1, IN), y.reshape(n, -1, OUT))
        params, opt_state, loss = step(params, opt_state, shards)
        # A replicated state gives one value per replica: take replica 0.
        metrics = {k: v[0] for k, v in clipjax.metrics(opt_state).items()}
        report("pmap", t, loss[0], metrics, algo)
    # Every replica holds the same clipper state.
    for leaf in jax.tree.leaves(clipjax.metrics(opt_state)):
        assert np.all(np.asarray(leaf) == np.asarray(leaf)[0])
    return jax.tree.map(lambda x: x[0], params)


def state_sharding(tx: optax.GradientTransformation, params: Any, param_sharding: Any) -> Any:
    """Optimizer-state shardings: parameter-shaped parts (moments) like the params,
    the rest (counters, clipjax statistics and metrics: a few scalars) replicated."""
    replicated = NamedSharding(jax.tree.leaves(param_sharding)[0].mesh, P())
    params_def = jax.tree.structure(params)

    def is_param_shaped(x: Any) -> bool:
        return jax.tree.structure(x) == params_def

    def sharding(x: Any) -> Any:
        return param_sharding if is_param_shaped(x) else replicated

    return jax.tree.map(sharding, jax.eval_shape(tx.init, params), is_leaf=is_param_shaped)


def train_sharded(tx: optax.GradientTransformation, batches: list, algo: str, fsdp: bool) -> Any:
    """``jax.jit`` on sharded arrays: XLA inserts the gradient all-reduce itself."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    params = init_params()
    # FSDP: every leaf split along its first axis; data parallel: replicated.
    spec = P("data") if fsdp else P()
    param_sharding = jax.tree.map(lambda _: NamedSharding(mesh, spec), params)
    params = jax.device_put(params, param_sharding)
    opt_sharding = state_sharding(tx, params, param_sharding)
    opt_state = jax.jit(tx.init, out_shardings=opt_sharding)(params)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        if fsdp:  # keep the gradients sharded like the parameters
            grads = jax.lax.with_sharding_constraint(grads, param_sharding)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    data = NamedSharding(mesh, P("data"))
    label = "jit fsdp" if fsdp else "jit data-par."
    for t, batch in enumerate(batches):
        params, opt_state, loss = step(params, opt_state, jax.device_put(batch, data))
        report(label, t, loss, clipjax.metrics(opt_state), algo)
    # The clipper's state (first in the chain) stays replicated on every device.
    assert all(x.sharding.is_fully_replicated for x in jax.tree.leaves(opt_state[0]))
    return params


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clipper", choices=sorted(CLIPPERS), default="zclip")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--spike-step", type=int, default=12)
    args = parser.parse_args(argv)

    n = jax.device_count()
    print(f"{n} devices: {jax.devices()[0].platform}")
    tx = optax.chain(CLIPPERS[args.clipper](), optax.adam(1e-2))
    batches = make_batches(args.steps, PER_DEVICE_BATCH * n, args.spike_step)
    results = [
        train_pmap(tx, batches, args.clipper),
        train_sharded(tx, batches, args.clipper, fsdp=False),
        train_sharded(tx, batches, args.clipper, fsdp=True),
    ]
    for other in results[1:]:
        for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-5)
    print("pmap, data-parallel jit and FSDP jit trained the same parameters.")


if __name__ == "__main__":
    main()
