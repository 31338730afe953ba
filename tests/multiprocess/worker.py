"""One JAX process of a multi-process run: ``python -m tests.multiprocess.worker OUT I N PORT
SCENARIOS``, started by :func:`tests.multiprocess.launch.launch`. With ``N > 1`` it joins the
others through ``jax.distributed`` on ``127.0.0.1:PORT`` (gloo); with ``N == 1`` it runs alone
on all its devices (the reference). It writes ``OUT/process{I}.pkl``: ``{scenario: result}``.

* ``jit``: a flax MLP trained under ``jax.jit`` on a ``("data", "model")`` mesh by each case
  of :data:`CASES`, the batch split over ``data``, the first layer and the second layer's
  kernel (and their moments) over ``model``, clipjax states replicated;
  ``jit_checkpoint`` also saves with orbax after ``SPLIT`` steps, restores into a fresh
  target after the run and trains ``RESUMED`` more steps.
* ``shard_map``: per-process data, clippers with ``axis_name`` over all 8 devices.
* ``mismatch``: process 0 builds ``zclip(scope="global")``, the others ``"per_layer"``; the
  check of ``docs/multi_host.md``, run as written there, must raise. ``mismatch_run``
  trains them without it (the control).
"""

from __future__ import annotations

import os
import pickle
import re
import sys
import traceback
from pathlib import Path
from typing import Any

from tests.paths import ROOT

OUT, PROCESS, PROCESSES, PORT, SCENARIOS = sys.argv[1:6]
PROCESS_ID, NUM_PROCESSES = int(PROCESS), int(PROCESSES)

# jax.distributed must start before anything uses the backend.
import jax

if NUM_PROCESSES > 1:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"127.0.0.1:{PORT}",
        num_processes=NUM_PROCESSES,
        process_id=PROCESS_ID,
        initialization_timeout=60,
    )

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import clipjax
from tests.model import BATCH, HIDDEN, batches, mlp_params
from tests.model import OUT as OUT_FEATURES
from tests.parallel.reference import STEPS, pmean_updates, state_sharding
from tests.registry import fan_out

DEVICES = 8
SPLIT = 4  # the checkpoint is taken after this many steps
RESUMED = 3  # steps trained after the restore
SPIKE_STEP = 5  # model.SPIKES: the targets times 30 on this step

out = Path(OUT)
assert jax.device_count() == DEVICES, f"{jax.device_count()} devices, expected {DEVICES}"
assert jax.process_count() == NUM_PROCESSES


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.tanh(nn.Dense(HIDDEN)(x))
        return nn.Dense(OUT_FEATURES)(x)


MODEL = MLP()


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((MODEL.apply(params, x) - y) ** 2)


def clipper(name: str, **kw: Any) -> optax.GradientTransformation:
    if name == "autoclip":
        return clipjax.autoclip(warmup_steps=3, min_history=3, feedback="clipped", name=name, **kw)
    if name == "zclip_per_layer":
        return clipjax.zclip(warmup_steps=3, scope="per_layer", leaf_norms=True, name=name, **kw)
    if name == "agc":
        # Unitwise AGC needs no collective; with per-device gradients (kw holds
        # axis_name) it runs per layer on the averaged norms.
        return clipjax.agc(clipping=0.05, name=name, **({"scope": "per_layer", **kw} if kw else {}))
    if name == "adagc":
        return clipjax.adagc(warmup_steps=3, name=name, **kw)
    raise ValueError(f"unknown clipper {name!r}")


CLIPPERS = ("autoclip", "zclip_per_layer", "agc", "adagc")


def make(case: str, axis_name: str | None = None) -> optax.GradientTransformation:
    """``"clippers"``: every clipper of :data:`CLIPPERS` (``registry.fan_out``), then momentum
    SGD; ``"skip_on_spike"``: ``skip_on_spike(chain(zclip(), adamw))``. With ``axis_name``,
    for per-device gradients."""
    kw = {} if axis_name is None else {"axis_name": axis_name}
    average = [] if axis_name is None else [pmean_updates(axis_name)]
    if case == "clippers":
        fanned = fan_out({n: clipper(n, **kw) for n in CLIPPERS})
        return optax.chain(fanned, *average, optax.sgd(0.05, momentum=0.9))
    if case == "skip_on_spike":
        inner = optax.chain(
            clipjax.zclip(warmup_steps=3, **kw), *average, optax.adamw(1e-2, weight_decay=1e-4)
        )
        return clipjax.skip_on_spike(inner, window_size=8, min_history=3, sigma=3.0, **kw)
    raise ValueError(f"unknown case {case!r}")


CASES = ("clippers", "skip_on_spike")


def put(tree: Any, shardings: Any) -> Any:
    """Host arrays, equal on every process, as global arrays with ``shardings``."""
    return jax.tree.map(
        lambda x, s: jax.make_array_from_callback(np.shape(x), s, lambda idx: np.asarray(x)[idx]),
        tree,
        shardings,
    )


def gather(tree: Any) -> Any:
    """Every leaf of a tree of global arrays as one full NumPy array on this process."""
    return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))


def read_metrics(state: Any) -> tuple[dict[str, float], list[str], int]:
    """``clipjax.metrics`` as floats, the names of any that are not replicated scalars,
    and how many are fully addressable (all on this process's devices)."""
    values, not_replicated, addressable = {}, [], 0
    for key, value in clipjax.metrics(state).items():
        if isinstance(value, (np.ndarray, np.generic)):
            # Read on this host already (clipjax.metrics copies what is addressable
            # here): a scalar is readable by float() on every process.
            if np.shape(value) != ():
                not_replicated.append(key)
            values[key] = float(value)
            continue
        addressable += value.is_fully_addressable
        if not (
            isinstance(value, jax.Array)
            and value.shape == ()
            and value.sharding.is_fully_replicated
        ):
            not_replicated.append(key)
        values[key] = float(value)  # on every process, with no gather
    return values, not_replicated, addressable


def local_copy(tree: Any) -> Any:
    """A tree of fully replicated global arrays as NumPy, from this process's own copy."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0)), tree)


def snapshot_record(snapshot: Any, state: Any) -> dict[str, Any]:
    """One step's ``(params, state, loss, metrics)``, replicated by the step, on the host."""
    params, state_copy, loss, metrics = local_copy(snapshot)
    return {
        "params": params,
        "state": state_copy,
        "loss": float(loss),
        "metrics": {k: float(v) for k, v in metrics.items()},
        "skipped": skipped(state),
    }


def skipped(state: Any) -> bool | None:
    return bool(state.metrics["skipped"]) if isinstance(state, clipjax.SkipOnSpikeState) else None


def documented_check() -> str:
    """The structure check of docs/multi_host.md (its ``structure_digest`` block)."""
    guide = (ROOT / "docs" / "multi_host.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", guide, re.DOTALL)
    found = [b for b in blocks if "def structure_digest" in b and "assert_equal" in b]
    assert len(found) == 1, "docs/multi_host.md: no single structure_digest block"
    return found[0]


def jit_scenario(checkpoint: bool, names: tuple[str, ...] = CASES) -> dict[str, Any]:
    import orbax.checkpoint as ocp  # only here: a slow import

    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    replicated = NamedSharding(mesh, P())
    specs = {
        "Dense_0": {"kernel": P(None, "model"), "bias": P("model")},
        "Dense_1": {"kernel": P("model", None), "bias": P()},
    }
    init = mlp_params()
    # model.mlp_params is the linen MLP's parameter tree, with its own values.
    flax_init = MODEL.init(
        jax.random.PRNGKey(0),
        np.zeros((1, init["params"]["Dense_0"]["kernel"].shape[0]), np.float32),
    )
    assert jax.tree.structure(flax_init) == jax.tree.structure(init)
    param_sharding = {"params": jax.tree.map(lambda s: NamedSharding(mesh, s), specs)}
    batch_sharding = NamedSharding(mesh, P("data"))
    data = [put(b, (batch_sharding, batch_sharding)) for b in batches(STEPS)]
    results: dict[str, Any] = {}
    for name in names:
        tx = make(name)
        value = name == "skip_on_spike"

        def step(params: Any, state: Any, batch: Any, tx: Any = tx, value: bool = value) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            grads = jax.lax.with_sharding_constraint(grads, param_sharding)
            updates, state = tx.update(grads, state, params, **({"value": loss} if value else {}))
            params = optax.apply_updates(params, updates)
            # A replicated copy for the host (cheaper than gathering every step).
            return params, state, (params, state, loss, clipjax.metrics(state))

        params = put(init, param_sharding)
        shardings = state_sharding(tx, params, param_sharding, replicated)
        state = jax.jit(tx.init, out_shardings=shardings)(params)
        jitted = jax.jit(step, out_shardings=(param_sharding, shardings, replicated))
        record: dict[str, Any] = {"steps": []}
        record["sharded_leaves"] = sum(
            not x.sharding.is_fully_replicated for x in jax.tree.leaves(state)
        )
        saved = None
        for t, batch in enumerate(data):
            params, state, snapshot = jitted(params, state, batch)
            record["steps"].append(snapshot_record(snapshot, state))
            (out / f"progress{PROCESS_ID}").touch()
            if checkpoint and t == SPLIT - 1:
                saved = (params, state)
                path = out / "checkpoints" / name
                with ocp.StandardCheckpointer() as checkpointer:
                    checkpointer.save(path, {"params": params, "opt_state": state})
        record["metrics"], record["not_replicated"], record["addressable"] = read_metrics(state)
        record["compiled"] = jitted._cache_size()
        results[name] = record
        if not checkpoint:
            continue
        assert saved is not None
        # Restore into a fresh target (tx.init's structure, the step's shardings).
        fresh = jax.jit(tx.init, out_shardings=shardings)(put(init, param_sharding))
        target = {"params": put(init, param_sharding), "opt_state": fresh}
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), target
        )
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(out / "checkpoints" / name, abstract)
        record["restored"] = gather((restored["params"], restored["opt_state"]))
        record["saved"] = gather(saved)
        saved_dict = {"params": saved[0], "opt_state": saved[1]}
        record["sharding_differences"] = [
            f"{jax.tree_util.keystr(path)}: {a.sharding} restored, {b.sharding} saved"
            for (path, a), b in zip(
                jax.tree_util.tree_leaves_with_path(restored), jax.tree.leaves(saved_dict)
            )
            if not a.sharding.is_equivalent_to(b.sharding, a.ndim)
        ]
        params, state = restored["params"], restored["opt_state"]
        resumed = []
        for batch in data[SPLIT : SPLIT + RESUMED]:
            params, state, snapshot = jitted(params, state, batch)
            resumed.append(snapshot_record(snapshot, state))
        record["resumed"] = resumed
    return results


def shard_map_scenario(names: tuple[str, ...] = CASES) -> dict[str, Any]:
    mesh = Mesh(np.array(jax.devices()), ("i",))
    replicated = NamedSharding(mesh, P())
    split = NamedSharding(mesh, P("i"))
    init = mlp_params()
    # Per-process data: each process hands over only its own rows of the batch.
    rows = BATCH // NUM_PROCESSES
    mine = slice(PROCESS_ID * rows, (PROCESS_ID + 1) * rows)
    data = [
        tuple(jax.make_array_from_process_local_data(split, x[mine], x.shape) for x in batch)
        for batch in batches(STEPS)
    ]
    results: dict[str, Any] = {}
    for name in names:
        tx = make(name, axis_name="i")
        value = name == "skip_on_spike"

        def local(params: Any, state: Any, batch: Any, tx: Any = tx, value: bool = value) -> Any:
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, state = tx.update(grads, state, params, **({"value": loss} if value else {}))
            per_device = jax.tree.map(lambda g: g[None], grads)
            return optax.apply_updates(params, updates), state, per_device, loss[None]

        mapped = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P("i")),
            out_specs=(P(), P(), P("i"), P("i")),
            # The parameters are replicated, the gradients each device's own:
            # without the varying-axis check, their gradient is not summed.
            check_vma=False,
        )

        def step(params: Any, state: Any, batch: Any, mapped: Any = mapped) -> Any:
            params, state, grads, losses = mapped(params, state, batch)
            snapshot = (params, state, grads, losses, clipjax.metrics(state))
            return params, state, jax.lax.with_sharding_constraint(snapshot, replicated)

        jitted = jax.jit(step)
        params = put(init, jax.tree.map(lambda _: replicated, init))
        state = jax.jit(tx.init, out_shardings=replicated)(params)
        record: dict[str, Any] = {"steps": []}
        for batch in data:
            params, state, snapshot = jitted(params, state, batch)
            params_copy, state_copy, grads, losses, metrics = local_copy(snapshot)
            record["steps"].append(
                {
                    "params": params_copy,
                    "state": state_copy,
                    "metrics": {k: float(v) for k, v in metrics.items()},
                    "grads": grads,
                    "losses": losses,
                    "skipped": skipped(state),
                }
            )
        record["metrics"], record["not_replicated"], record["addressable"] = read_metrics(state)
        record["compiled"] = jitted._cache_size()
        results[name] = record
    return results


def mismatched_scope() -> str:
    return "global" if PROCESS_ID == 0 else "per_layer"


def mismatch_scenario() -> dict[str, Any]:
    tx = optax.chain(clipjax.zclip(scope=mismatched_scope()), optax.sgd(0.1))
    state = tx.init(mlp_params())
    try:
        exec(documented_check(), {"jax": jax, "np": np, "opt_state": state})
    except AssertionError as error:
        return {"raised": f"{type(error).__name__}: {error}"}
    return {"raised": None}


def mismatch_run() -> dict[str, Any]:
    """The control: :func:`mismatch_scenario`'s optimizers trained without the check."""
    tx = optax.chain(clipjax.zclip(scope=mismatched_scope(), warmup_steps=2), optax.sgd(0.1))
    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
    params = put(mlp_params(), jax.tree.map(lambda _: replicated, mlp_params()))
    state = jax.jit(tx.init, out_shardings=replicated)(params)

    def step(params: Any, state: Any, batch: Any) -> Any:
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jitted = jax.jit(step, out_shardings=replicated)
    for batch in batches(STEPS):
        params, state = jitted(params, state, put(batch, (split, split)))
    return {"params": local_copy(params)}


def main() -> None:
    results: dict[str, Any] = {"process_index": jax.process_index()}
    for scenario in SCENARIOS.split(","):
        if scenario in ("jit", "jit_checkpoint"):
            results["jit"] = jit_scenario(checkpoint=scenario == "jit_checkpoint")
        elif scenario == "shard_map":
            results[scenario] = shard_map_scenario()
        elif scenario == "mismatch_run":
            results[scenario] = mismatch_run()
        elif scenario == "mismatch":
            results[scenario] = mismatch_scenario()
        else:
            raise ValueError(f"unknown scenario {scenario!r}")
    with open(out / f"process{PROCESS_ID}.pkl", "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)  # do not wait in jax.distributed's shutdown for a dead peer
