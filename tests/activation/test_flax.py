"""The flax modules: linen's and NNX's training steps read the statistics from the gradient
of the carriers' collection; the modules compute what the function does; ``nn.scan`` and
``nnx.scan`` stacks give ``[layers]`` statistics; linen variables with carriers round-trip
through flax.serialization."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

nn = pytest.importorskip("flax.linen")
nnx = pytest.importorskip("flax.nnx")

K, PERCENTILES = 2, (50, 99.9)
X = jax.random.normal(jax.random.key(0), (4, 6, 8))  # [batch, tokens, features]
TARGET = jax.random.normal(jax.random.key(1), (4, 6, 1))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.gelu(nn.Dense(16)(x))
        y = nn.Dense(8)(h)
        y = clipjax.linen_activation_clip(k=K, percentiles=PERCENTILES)(y)  # the one line
        return x + y


class LinenModel(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = LinenBlock()(LinenBlock()(x))
        return nn.Dense(1)(x)


def test_linen_training_step_reads_the_statistics_from_the_collection_gradient() -> None:
    model = LinenModel()
    variables = model.init(jax.random.key(2), X)
    assert set(variables) == {"params", "activation_stats"}
    tx = optax.adamw(1e-2)
    opt_state = tx.init(variables["params"])

    @jax.jit
    def train_step(variables: Any, opt_state: Any) -> tuple[Any, Any, Any, dict]:
        loss_fn = lambda v: jnp.mean((model.apply(v, X) - TARGET) ** 2)
        loss, grads = jax.value_and_grad(loss_fn)(variables)  # params and activation_stats
        updates, opt_state = tx.update(grads["params"], opt_state, variables["params"])
        params = optax.apply_updates(variables["params"], updates)
        stats = clipjax.activation_metrics(grads["activation_stats"])
        return {**variables, "params": params}, opt_state, loss, stats

    losses = []
    for _ in range(5):
        variables, opt_state, loss, stats = train_step(variables, opt_state)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    prefix = "activation_grad/LinenBlock_0/ActivationGradientClip_0/stats/"
    assert int(stats[prefix + "clipped_tokens"]) == K
    assert float(stats[prefix + "top_norm"]) > float(stats[prefix + "p99.9"]) > 0
    assert len(stats) == 2 * (K + 3 + len(PERCENTILES))  # two blocks
    # The carriers are not trained: still zeros.
    assert not any(np.any(v) for v in jax.tree.leaves(variables["activation_stats"]))


def test_the_linen_module_is_the_function() -> None:
    """The same Dense layers with the function applied by hand: the same gradients."""
    model = LinenBlock()
    variables = model.init(jax.random.key(3), X)
    p = variables["params"]

    def by_hand(p: Any, stats: Any) -> jax.Array:
        dense = lambda q, x: x @ q["kernel"] + q["bias"]
        y = dense(p["Dense_1"], nn.gelu(dense(p["Dense_0"], X)))
        y = clipjax.clip_activation_gradient(y, stats, k=K, percentiles=PERCENTILES)
        return jnp.sum((X + y) ** 3)

    stats = variables["activation_stats"]["ActivationGradientClip_0"]["stats"]
    want = jax.grad(by_hand, argnums=(0, 1))(p, stats)
    got = jax.grad(lambda v: jnp.sum(model.apply(v, X) ** 3))(variables)
    jax.tree.map(np.testing.assert_allclose, got["params"], want[0])
    got_stats = got["activation_stats"]["ActivationGradientClip_0"]["stats"]
    np.testing.assert_allclose(got_stats.values, want[1].values, rtol=1e-6)
    # Applied without the collection (inference, or a loss that does not want the
    # statistics) it clips all the same.
    no_stats = jax.grad(lambda p: jnp.sum(model.apply({"params": p}, X) ** 3))(p)
    jax.tree.map(np.testing.assert_allclose, no_stats, want[0])


def test_linen_nn_scan_stacks_the_carriers() -> None:
    class ScannedBlock(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return LinenBlock()(x), None

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            stack = nn.scan(ScannedBlock, variable_axes={"params": 0, "activation_stats": 0},
                            split_rngs={"params": True}, length=3)  # fmt: skip
            return stack()(x, None)[0]

    model = Stack()
    variables = model.init(jax.random.key(4), X)
    grads = jax.jit(jax.grad(lambda v: jnp.sum(model.apply(v, X) ** 2)))(variables)
    m = clipjax.activation_metrics(grads["activation_stats"], name="stack")
    key = "activation_grad/stack/ScanScannedBlock_0/LinenBlock_0/ActivationGradientClip_0/stats/"
    assert m[key + "top_norm"].shape == (3,)
    np.testing.assert_array_equal(m[key + "clipped_tokens"], [K] * 3)


def test_linen_variables_with_carriers_round_trip_through_flax_serialization() -> None:
    serialization = pytest.importorskip("flax.serialization")
    variables = LinenModel().init(jax.random.key(5), X)
    restored = serialization.from_bytes(variables, serialization.to_bytes(variables))
    assert jax.tree.structure(restored) == jax.tree.structure(variables)
    jax.tree.map(np.testing.assert_array_equal, restored, variables)


class NNXBlock(nnx.Module):
    def __init__(self, rngs: Any) -> None:
        self.fc1, self.fc2 = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 8, rngs=rngs)
        self.clip = clipjax.nnx_activation_clip(k=K, percentiles=PERCENTILES)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.clip(self.fc2(nnx.gelu(self.fc1(x))))


class NNXModel(nnx.Module):
    def __init__(self, rngs: Any) -> None:
        self.blocks = nnx.List([NNXBlock(rngs), NNXBlock(rngs)])
        self.head = nnx.Linear(8, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def test_nnx_training_step_reads_the_statistics_from_the_tagged_variables() -> None:
    model = NNXModel(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, "activation_stats"))

    @nnx.jit
    def train_step(model: Any, optimizer: Any) -> tuple[jax.Array, dict]:
        loss_fn = lambda model: jnp.mean((model(X) - TARGET) ** 2)
        loss, grads = nnx.value_and_grad(loss_fn, argnums=wrt)(model)
        optimizer.update(model, nnx.filter_state(grads, nnx.Param))
        return loss, clipjax.activation_metrics(nnx.filter_state(grads, "activation_stats"))

    losses = []
    for _ in range(5):
        loss, stats = train_step(model, optimizer)
        losses.append(float(loss))
    assert losses[-1] < losses[0]
    assert sorted({k.rsplit("/", 1)[0] for k in stats}) == [
        "activation_grad/blocks/0/clip/stats", "activation_grad/blocks/1/clip/stats",
    ]  # fmt: skip
    assert int(stats["activation_grad/blocks/1/clip/stats/clipped_tokens"]) == K
    # The carriers are not parameters: the optimizer left them at zero.
    assert not any(np.any(v) for v in jax.tree.leaves(nnx.state(model, "activation_stats")))


def test_nnx_module_is_the_function_and_scans_into_layers() -> None:
    block = NNXBlock(nnx.Rngs(1))
    params = nnx.state(block, nnx.Param)

    def by_hand(p: Any, stats: Any) -> jax.Array:
        dense = lambda q, x: x @ q["kernel"][...] + q["bias"][...]
        y = dense(p["fc2"], nnx.gelu(dense(p["fc1"], X)))
        y = clipjax.clip_activation_gradient(y, stats, k=K, percentiles=PERCENTILES)
        return jnp.sum((X + y) ** 3)

    carrier = clipjax.activation_stats_init(k=K, percentiles=PERCENTILES)
    want_stats = jax.grad(by_hand, argnums=1)(params, carrier)
    wrt = nnx.DiffState(0, nnx.Any(nnx.Param, "activation_stats"))
    grads = nnx.grad(lambda b: jnp.sum(b(X) ** 3), argnums=wrt)(block)
    carriers = nnx.filter_state(grads, "activation_stats")
    is_carrier = lambda x: isinstance(x, clipjax.ActivationStats)
    (got,) = jax.tree.leaves(carriers, is_leaf=is_carrier)
    np.testing.assert_allclose(got.values, want_stats.values, rtol=1e-6)

    class Stack(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            @nnx.split_rngs(splits=3)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: Any) -> NNXBlock:
                return NNXBlock(rngs)

            self.blocks = make(rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def forward(x: jax.Array, block: NNXBlock) -> jax.Array:
                return block(x)

            return forward(x, self.blocks)

    stack = Stack(nnx.Rngs(2))
    grads = nnx.jit(nnx.grad(lambda s: jnp.sum(s(X) ** 2), argnums=wrt))(stack)
    m = clipjax.metrics(nnx.filter_state(grads, "activation_stats"))
    assert m["activation_grad/blocks/clip/stats/top_norm"].shape == (3,)
    np.testing.assert_array_equal(m["activation_grad/blocks/clip/stats/clipped_tokens"], [K] * 3)
