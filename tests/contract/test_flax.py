"""flax: every clipper trains a small model through ``nnx.Optimizer`` and linen's ``TrainState``;
its metrics read the same inside and outside ``jit``, its groups named by flax's module paths."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("flax", reason="needs flax")
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx, traverse_util
from flax.training import train_state

import clipjax
from tests.model import HIDDEN, IN, OUT, batches
from tests.registry import CASES, CLIPPER_IDS, optimizer

STEPS = 10
EVAL = next(batches(1, seed=1))  # a held-out batch: the loss on it must go down


def top_level(metrics: dict[str, Any]) -> dict[str, Any]:
    """The clipper's own metrics (hist_clip also nests its warm-up clip's)."""
    nested = lambda k: k.startswith("hist_clip/") and k.split("/")[1] == "clip_by_global_norm"
    return {k: v for k, v in metrics.items() if k.count("/") >= 2 and not nested(k)}


def expected_groups(name: str, param_paths: list[tuple[Any, ...]]) -> set[str]:
    joined = ["/".join(str(k) for k in path) for path in param_paths]
    scope = CASES[name].scope
    if scope == "per_layer":
        return {j.rsplit("/", 1)[0] for j in joined}
    if scope == "per_param":
        return set(joined)
    return {"global"}


def groups_of(metrics: dict[str, Any], algo: str) -> set[str]:
    return {
        k[len(algo) + 1 : k.rindex("/")] for k in top_level(metrics) if k.startswith(algo + "/")
    }


def check_metrics(name: str, metrics: dict[str, Any], param_paths: list[tuple[Any, ...]]) -> None:
    algo = CASES[name].algo
    assert groups_of(metrics, algo) == expected_groups(name, param_paths)
    steps = {int(v) for k, v in top_level(metrics).items() if k.endswith("/step")}
    assert steps == {STEPS}
    # (hist_clip's threshold is +inf on steps its criterion does not fire.)
    for field in ("grad_norm", "scale"):
        assert all(np.isfinite(v) for k, v in metrics.items() if k.endswith("/" + field))


class NnxMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [nnx.Linear(IN, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, OUT, rngs=rngs)]
        )
        # BatchStat variables are not parameters: wrt=nnx.Param leaves them out.
        self.norm = nnx.BatchNorm(HIDDEN, use_running_average=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.layers[1](jnp.tanh(self.norm(self.layers[0](x))))


@nnx.jit
def nnx_loss(model: NnxMLP, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def nnx_step(model: NnxMLP, opt: nnx.Optimizer, batch: Any) -> tuple[jax.Array, dict[str, Any]]:
    x, y = batch
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss, clipjax.metrics(opt.opt_state)


@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_nnx_optimizer_trains_with_every_clipper(name: str) -> None:
    model = NnxMLP(nnx.Rngs(0))
    opt = nnx.Optimizer(model, optimizer(CASES[name]), wrt=nnx.Param)
    before = nnx_loss(model, EVAL)
    for batch in batches(STEPS, spikes=None):
        _, inside = nnx_step(model, opt, batch)
    outside = clipjax.metrics(opt.opt_state)
    assert inside.keys() == outside.keys()
    for key in inside:
        np.testing.assert_array_equal(np.asarray(inside[key]), np.asarray(outside[key]), key)
    paths = [path for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    check_metrics(name, outside, paths)
    assert nnx_loss(model, EVAL) < before


def test_nnx_group_names_are_module_paths() -> None:
    model = NnxMLP(nnx.Rngs(0))
    tx = optax.chain(clipjax.zclip(warmup_steps=2, scope="per_param"), optax.sgd(0.1))
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    nnx_step(model, opt, next(batches(1)))
    names = groups_of(clipjax.metrics(opt.opt_state), "zclip")
    layers = {f"layers/{i}/{leaf}" for i in (0, 1) for leaf in ("kernel", "bias")}
    assert names == layers | {"norm/scale", "norm/bias"}


class LinenMLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.tanh(nn.LayerNorm()(nn.Dense(HIDDEN)(x)))
        return nn.Dense(OUT)(x)


@jax.jit
def linen_loss(state: train_state.TrainState, batch: Any) -> jax.Array:
    x, y = batch
    return jnp.mean((state.apply_fn({"params": state.params}, x) - y) ** 2)


@jax.jit
def linen_step(state: train_state.TrainState, batch: Any) -> Any:
    x, y = batch

    def loss_fn(params: Any) -> jax.Array:
        return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("name", CLIPPER_IDS)
def test_linen_train_state_trains_with_every_clipper(name: str) -> None:
    module = LinenMLP()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, IN)))["params"]
    state = train_state.TrainState.create(
        apply_fn=module.apply, params=params, tx=optimizer(CASES[name])
    )
    before = linen_loss(state, EVAL)
    for batch in batches(STEPS, spikes=None):
        state, _ = linen_step(state, batch)
    paths = list(traverse_util.flatten_dict(state.params))
    check_metrics(name, clipjax.metrics(state.opt_state), paths)
    assert linen_loss(state, EVAL) < before


def test_linen_per_layer_names_are_module_names() -> None:
    module = LinenMLP()
    params = module.init(jax.random.PRNGKey(0), jnp.zeros((1, IN)))["params"]
    tx = optax.chain(clipjax.hist_clip(warmup_steps=2, scope="per_layer"), optax.sgd(0.1))
    state = train_state.TrainState.create(apply_fn=module.apply, params=params, tx=tx)
    state, _ = linen_step(state, next(batches(1)))
    names = groups_of(clipjax.metrics(state.opt_state), "hist_clip")
    assert names == {"Dense_0", "LayerNorm_0", "Dense_1"}
