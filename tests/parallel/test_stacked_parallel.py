"""``clipjax.stacked`` on 8 devices: ``jit`` over stacked leaves sharded along their layer
axis or another equals one device; ``shard_map`` with ``axis_name=`` keeps the same
per-layer statistics on every device, those of one device fed the averaged norms."""

from __future__ import annotations

import functools
from typing import Any

import chex
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import clipjax
from tests.parallel.reference import mesh

LAYERS = 8
STEPS = 10
# float32: the norms are averaged over 8 devices in another order, and z-scores
# divide by small standard deviations.
RTOL, ATOL = 5e-5, 1e-5


def stacked_grads(step: int) -> dict[str, Any]:
    """``params/layers/{kernel,bias}`` of 8 layers, a spike in layer 5 at step 6."""
    rng = np.random.default_rng(step)
    kernel = rng.standard_normal((LAYERS, 16, 8)).astype(np.float32)
    if step == 6:
        kernel[5] *= 40.0
    return {
        "params": {
            "embed": rng.standard_normal((16, 8)).astype(np.float32),
            "layers": {
                "kernel": kernel,
                "bias": rng.standard_normal((LAYERS, 8)).astype(np.float32),
            },
        }
    }


def make() -> Any:
    return clipjax.zclip(warmup_steps=3, max_grad_norm=None, scope=clipjax.stacked("per_layer"))


def single_device() -> list[tuple[Any, Any]]:
    tx, out = make(), []
    state = tx.init(stacked_grads(0))
    for t in range(STEPS):
        updates, state = jax.jit(tx.update)(stacked_grads(t), state)
        out.append(jax.device_get((updates, clipjax.metrics(state))))
    return out


@pytest.mark.parametrize("spec", [P("i"), P(None, "i")], ids=["layer_axis", "other_axis"])
def test_sharded_stacked_leaves_under_jit(spec: P) -> None:
    m = mesh()
    tx = make()
    expected = single_device()
    assert expected[6][1]["zclip/params/layers/5/clipped"]

    def shard(g: Any) -> Any:
        def put(path: Any, x: np.ndarray) -> jax.Array:
            stacked = "layers" in clipjax.path_name(path)
            return jax.device_put(x, NamedSharding(m, spec if stacked else P()))

        return jax.tree_util.tree_map_with_path(put, g)

    state = tx.init(shard(stacked_grads(0)))
    step = jax.jit(tx.update)
    for t in range(STEPS):
        g = shard(stacked_grads(t))
        updates, state = step(g, state)
        kernel = updates["params"]["layers"]["kernel"]
        assert kernel.sharding.is_equivalent_to(g["params"]["layers"]["kernel"].sharding, 3)
        chex.assert_trees_all_close(
            jax.device_get((updates, clipjax.metrics(state))), expected[t], rtol=RTOL, atol=ATOL
        )


def test_shard_map_with_axis_name_averages_the_per_layer_norms() -> None:
    """Device d holds ``(d + 1) * g``: the averaged norms are those of ``4.5 * g``."""
    m = mesh()
    tx = clipjax.zclip(
        warmup_steps=3, max_grad_norm=None, scope=clipjax.stacked("per_layer"), axis_name="i"
    )
    reference = make()
    factor = np.arange(1, 9, dtype=np.float32)

    @functools.partial(jax.shard_map, mesh=m, in_specs=(P("i"), P()), out_specs=(P("i"), P()))
    def step(g: Any, state: Any) -> tuple[Any, Any]:
        g = jax.tree.map(lambda x: x[0], g)
        updates, state = tx.update(g, state)
        return jax.tree.map(lambda x: x[None], updates), state

    state = tx.init(stacked_grads(0))
    ref_state = reference.init(stacked_grads(0))
    jitted = jax.jit(step)
    for t in range(STEPS):
        g = stacked_grads(t)
        per_device = jax.tree.map(lambda x: factor.reshape((8,) + (1,) * x.ndim) * x[None], g)
        updates, state = jitted(per_device, state)
        ref_updates, ref_state = reference.update(jax.tree.map(lambda x: 4.5 * x, g), ref_state)
        chex.assert_trees_all_close(
            clipjax.metrics(state), clipjax.metrics(ref_state), rtol=RTOL, atol=ATOL
        )
        # Each device scales its own gradient by the scale of the averaged norms.
        for d in (0, 7):
            chex.assert_trees_all_close(
                jax.tree.map(lambda u, d=d: np.asarray(u)[d] / factor[d], updates),
                jax.tree.map(lambda u: np.asarray(u) / 4.5, ref_updates),
                rtol=RTOL,
                atol=ATOL,
            )
        if t == 6:
            assert bool(clipjax.metrics(state)["zclip/params/layers/5/clipped"])
