"""``scope=clipjax.stacked(...)``: each slice of a layer-stacked leaf is a group that behaves
exactly like the same layer unstacked into a list under the plain scope (names, norms,
statistics, scales, metrics, updates), for every norm-based clipper with a scope, on
synthetic trees and real flax ``nn.scan`` / ``nnx.scan`` models."""

from __future__ import annotations

import re
from functools import partial
from typing import Any

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _grouping

LAYERS = 4

# Every clipper with a scope whose rule is norm-based, set to clip within a few steps.
W3 = {"warmup_steps": 3}
PERCENTILE = {"mode": "percentile", "warmup_steps": 3, "min_history": 3}
CLIPPERS = {
    "zclip": partial(clipjax.zclip, **W3),
    "autoclip_ema": partial(clipjax.autoclip, **PERCENTILE, history="ema", ema_decay=0.9),
    "autoclip_window": partial(clipjax.autoclip, **PERCENTILE, percentile=80.0, window_size=4),
    "zscore_clip": partial(clipjax.zscore_clip, **W3, min_history=3),
    "hist_clip": partial(clipjax.hist_clip, **W3),
    "hist_clip_ema": partial(clipjax.hist_clip, clipjax.ema_criterion(), **W3),
    "adagc": partial(clipjax.adagc, **W3),
    "agc": partial(clipjax.agc, clipping=0.05),
    "agc_exclude_bias": partial(clipjax.agc, clipping=0.05, exclude_bias_bn=True),
    "clip_norm_growth": partial(clipjax.clip_norm_growth, mul=1.05),
    "clip_norm_by_ema": clipjax.clip_norm_by_ema,
    "clip_by_historical_norm": partial(
        clipjax.clip_by_historical_norm, 4, sigma_factor=0.5, min_history=2
    ),
}


def stacked_tree(seed: int, axis: int = 0) -> dict[str, Any]:
    """``params/layers/{attn,mlp}/{kernel,bias}`` stacked on ``axis``, plus unstacked leaves."""
    rng = np.random.default_rng(seed)

    def leaf(*shape: int) -> jax.Array:
        x = rng.standard_normal((LAYERS, *shape)).astype(np.float32)
        return jnp.asarray(np.moveaxis(x, 0, axis) if x.ndim > 1 else x)

    return {
        "params": {
            "embed": jnp.asarray(rng.standard_normal((5, 3)), jnp.float32),
            "layers": {
                "attn": {"kernel": leaf(3, 3), "bias": leaf(3)},
                "mlp": {"kernel": leaf(3, 2), "bias": leaf(2)},
            },
            "head": jnp.asarray(rng.standard_normal((3,)), jnp.float32),
        }
    }


def unstack(tree: dict[str, Any], axis: int = 0) -> dict[str, Any]:
    """The same parameters with the layers unstacked into a list."""
    params = dict(tree["params"])
    layers = params.pop("layers")
    take = lambda k: jax.tree.map(lambda x: jnp.take(x, k, axis=axis if x.ndim > 1 else 0), layers)
    return {"params": {**params, "layers": [take(k) for k in range(LAYERS)]}}


def gradient_stream(steps: int, axis: int = 0) -> list[dict[str, Any]]:
    """Gradients with a spike in layer 2 at step 6 and a NaN in layer 1 at step 8."""
    out = []
    for t in range(steps):
        g = stacked_tree(100 + t, axis)
        if t == 6:
            k = g["params"]["layers"]["attn"]["kernel"]
            g["params"]["layers"]["attn"]["kernel"] = k * jnp.where(
                jnp.arange(LAYERS) == 2, 50.0, 1.0
            ).reshape([-1 if a == axis else 1 for a in range(k.ndim)])
        if t == 8:
            b = g["params"]["layers"]["mlp"]["bias"]
            g["params"]["layers"]["mlp"]["bias"] = b.at[1, 0].set(jnp.nan)
        out.append(g)
    return out


def run(tx: Any, grads: list[Any], params: Any, jit: bool = True) -> list[tuple[Any, Any]]:
    step = jax.jit(tx.update) if jit else tx.update
    state, out = tx.init(params), []
    for g in grads:
        updates, state = step(g, state, params)
        out.append((updates, state))
    return out


def assert_same_groups(stacked_metrics: dict, plain_metrics: dict) -> None:
    assert set(stacked_metrics) == set(plain_metrics)
    for key, value in plain_metrics.items():
        np.testing.assert_allclose(
            np.asarray(stacked_metrics[key]), np.asarray(value), rtol=2e-6, atol=1e-7, err_msg=key
        )


@pytest.mark.parametrize("name", sorted(CLIPPERS))
@pytest.mark.parametrize(("base", "axis"), [("per_layer", 0), ("per_param", 1)])
def test_each_slice_is_the_unstacked_layer(name: str, base: str, axis: int) -> None:
    grads = gradient_stream(12, axis)
    params = stacked_tree(0, axis)
    make = CLIPPERS[name]
    ours = run(make(scope=clipjax.stacked(base, axis=axis)), grads, params)
    plain = run(make(scope=base), [unstack(g, axis) for g in grads], unstack(params, axis))
    state = ours[-1][1]
    names = state.info.groups
    assert len(names) == (1 + 2 * LAYERS if base == "per_layer" else 2 + 4 * LAYERS)
    assert f"params/layers/3/attn{'/kernel' if base == 'per_param' else ''}" in names
    clipped = 0
    for (u, s), (pu, ps) in zip(ours, plain):
        assert_same_groups(clipjax.metrics(s), clipjax.metrics(ps))
        chex.assert_trees_all_close(unstack(u, axis), pu, rtol=2e-6, atol=1e-7)
        clipped += sum(bool(v) for k, v in clipjax.metrics(s).items() if k.endswith("/clipped"))
    assert clipped > 0  # the comparison covers clipping steps, not only pass-through ones


def test_group_norms_are_per_slice_against_numpy() -> None:
    tree = stacked_tree(3, axis=1)
    leaves, _, _ = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, clipjax.stacked("per_layer", axis=1))
    expected: dict[str, list[np.ndarray]] = {}
    for path, x in jax.tree_util.tree_flatten_with_path(unstack(tree, 1))[0]:
        expected.setdefault(clipjax.path_name(path[:-1]), []).append(np.asarray(x, np.float64))
    expected = {k: [x.ravel() for x in v] for k, v in expected.items()}
    for ord in (1.0, 2.0, 3.0, np.inf):
        got = np.asarray(_grouping.group_norms(leaves, grouping, ord))
        for name, norm in zip(grouping.names, got):
            want = np.linalg.norm(np.concatenate(expected[name]), ord)
            np.testing.assert_allclose(norm, want, rtol=1e-6, err_msg=f"{name} ord={ord}")


def test_names_say_the_layer_index() -> None:
    tree = stacked_tree(0)
    per_param = _grouping.make_grouping(tree, clipjax.stacked("per_param"))
    assert per_param.names[:3] == ("params/embed", "params/head", "params/layers/0/attn/bias")
    assert "params/layers/3/mlp/kernel" in per_param.names
    # A callable declares which leaves are stacked; the index goes before the leaf's key.
    by_rank = _grouping.make_grouping(
        tree, clipjax.stacked("per_param", layers=lambda path, leaf: jnp.ndim(leaf) == 3)
    )
    assert "params/layers/attn/2/kernel" in by_rank.names
    assert "params/layers/attn/bias" in by_rank.names  # rank 2: not declared stacked
    stacked = _grouping.make_grouping(tree, clipjax.stacked("per_layer"))
    plain = _grouping.make_grouping(unstack(tree), "per_layer")
    assert sorted(stacked.names) == sorted(plain.names)


def test_bad_declarations_raise_at_construction() -> None:
    with pytest.raises(ValueError, match="scope must be"):
        clipjax.stacked("global")
    with pytest.raises(ValueError, match="layers must be"):
        clipjax.stacked("per_layer", layers=3)
    with pytest.raises(ValueError, match="axis must be an int"):
        clipjax.stacked("per_layer", axis=1.0)
    with pytest.raises(ValueError, match="clip_by_value"):
        clipjax.clip_by_value(1.0, scope=clipjax.stacked("per_layer"))
    tx = clipjax.zclip(scope=clipjax.stacked("per_layer", axis=2))
    with pytest.raises(ValueError, match=r"params/layers/attn/bias of shape .* no layer axis 2"):
        tx.init(stacked_tree(0))


def test_state_is_fixed_and_the_scaling_is_one_multiply_per_leaf() -> None:
    """The stacked leaf is scaled by its [layers] scales in one multiply, compiled once."""
    params = stacked_tree(0)
    tx = clipjax.zclip(warmup_steps=3, scope=clipjax.stacked("per_layer"))
    state = tx.init(params)
    step = jax.jit(tx.update)
    for g in gradient_stream(5):
        _, new = step(g, state, None)
        assert jax.tree.structure(new) == jax.tree.structure(state)
        chex.assert_trees_all_equal_shapes_and_dtypes(new, state)
        state = new
    assert step._cache_size() == 1
    text = step.lower(params, state, None).compile().as_text()
    # No select over a stacked leaf: the clip is a multiply.
    assert not re.search(r"f32\[4,3,3\]\{[^}]*\} select\(", text)


def test_jit_and_eager_agree() -> None:
    grads = gradient_stream(8)
    params = stacked_tree(0)
    tx = clipjax.zclip(warmup_steps=3, scope=clipjax.stacked("per_layer"))
    for (u, s), (eu, es) in zip(run(tx, grads, params), run(tx, grads, params, jit=False)):
        chex.assert_trees_all_close(
            (u, clipjax.metrics(s)), (eu, clipjax.metrics(es)), rtol=1e-5, atol=1e-6
        )


def test_in_a_chain_with_an_optimizer_under_lax_scan() -> None:
    params = stacked_tree(0)
    tx = optax.chain(clipjax.zclip(warmup_steps=3, scope=clipjax.stacked()), optax.adam(1e-2))
    grads = gradient_stream(10)
    xs = jax.tree.map(lambda *x: jnp.stack(x), *grads)

    def body(carry: Any, g: Any) -> tuple[Any, Any]:
        p, state = carry
        updates, state = tx.update(g, state, p)
        return (optax.apply_updates(p, updates), state), clipjax.metrics(state)

    (_, _), ms = jax.lax.scan(body, (params, tx.init(params)), xs)
    assert ms["zclip/params/layers/2/attn/clipped"].shape == (10,)
    assert bool(ms["zclip/params/layers/2/attn/clipped"][6])
    assert float(ms["zclip/params/layers/2/attn/scale"][6]) < 0.1
    assert float(ms["zclip/params/layers/0/attn/scale"][6]) > 0.5


def _unstack_subtree(tree: Any, key: str) -> Any:
    """``tree`` with the node under ``key`` replaced by the list of its layer slices."""
    if not isinstance(tree, dict):
        return tree
    slices = lambda v: [jax.tree.map(lambda x, i=i: x[i], v) for i in range(LAYERS)]
    return {k: slices(v) if k == key else _unstack_subtree(v, key) for k, v in tree.items()}


def _compare_on_model_gradients(grad: Any) -> list[Any]:
    """``grad(x, c)`` (the loss times ``c``) on 10 batches, x40 at step 6, clipped stacked and
    unstacked: the same groups, metrics and updates; returns the gradients."""
    rng = np.random.default_rng(0)
    xs = [jnp.asarray(rng.standard_normal((8, 3)), jnp.float32) for _ in range(10)]
    grads = [grad(x, 40.0 if t == 6 else 1.0) for t, x in enumerate(xs)]
    plain = [_unstack_subtree(jax.tree.map(np.asarray, g), "layers") for g in grads]
    tx = clipjax.zclip(warmup_steps=3, scope=clipjax.stacked("per_layer"))
    plain_tx = clipjax.zclip(warmup_steps=3, scope="per_layer")
    ours = run(tx, grads, grads[0])
    theirs = run(plain_tx, plain, plain[0])
    assert any("/layers/3/" in k for k in clipjax.metrics(ours[-1][1]))
    clipped = 0
    for (u, s), (pu, ps) in zip(ours, theirs):
        m = clipjax.metrics(s)
        assert_same_groups(m, clipjax.metrics(ps))
        u = _unstack_subtree(jax.tree.map(np.asarray, u), "layers")
        chex.assert_trees_all_close(u, pu, rtol=2e-6, atol=1e-7)
        clipped += sum(bool(m[k]) for k in m if "/layers/" in k and k.endswith("/clipped"))
    assert clipped > 0
    return grads


def test_flax_linen_nn_scan_model() -> None:
    """A real ``nn.scan`` model: params ``params/layers/Dense_0/kernel`` of shape [4, 3, 3]."""
    nn = pytest.importorskip("flax.linen")

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array, _: Any) -> tuple[jax.Array, None]:
            return jnp.tanh(nn.Dense(3)(x)), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            scan = nn.scan(
                Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS
            )
            x, _ = scan(name="layers")(nn.Dense(3)(x), None)
            return nn.Dense(1)(x)

    model = Model()
    params = model.init(jax.random.PRNGKey(0), jnp.ones((2, 3)))
    assert params["params"]["layers"]["Dense_0"]["kernel"].shape == (LAYERS, 3, 3)
    _compare_on_model_gradients(
        lambda x, c: jax.grad(lambda p: c * jnp.mean(model.apply(p, x) ** 2))(params)
    )


def test_flax_nnx_scan_model() -> None:
    """A real ``nnx.scan`` model (layers made by ``nnx.vmap``): its ``nnx.State`` gradients."""
    nnx = pytest.importorskip("flax.nnx")

    class Block(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.Dense_0 = nnx.Linear(3, 3, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return jnp.tanh(self.Dense_0(x))

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            @nnx.split_rngs(splits=LAYERS)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs: Any) -> Block:
                return Block(rngs)

            self.layers = make(rngs)
            self.head = nnx.Linear(3, 1, rngs=rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
            def body(h: jax.Array, block: Block) -> jax.Array:
                return block(h)

            return self.head(body(x, self.layers))

    model = Model(nnx.Rngs(0))
    grad = lambda x, c: nnx.grad(lambda m: c * jnp.mean(m(x) ** 2))(model)
    grads = _compare_on_model_gradients(lambda x, c: {"params": nnx.to_pure_dict(grad(x, c))})
    assert grads[0]["params"]["layers"]["Dense_0"]["kernel"].shape == (LAYERS, 3, 3)
    # The State itself (Variables, paths ending in .value) groups like its pure dict.
    grouping = _grouping.make_grouping(grad(jnp.ones((2, 3)), 1.0), clipjax.stacked("per_layer"))
    assert "layers/3/Dense_0" in grouping.names


def test_leaf_norms_are_whole_leaf_norms() -> None:
    params = stacked_tree(0)
    tx = clipjax.zclip(warmup_steps=3, scope=clipjax.stacked(), leaf_norms=True)
    _, state = tx.update(params, tx.init(params))
    m = clipjax.metrics(state)
    kernel = params["params"]["layers"]["attn"]["kernel"]
    np.testing.assert_allclose(
        float(m["zclip/leaf/params/layers/attn/kernel/grad_norm"]),
        float(np.linalg.norm(np.asarray(kernel, np.float64).ravel())),
        rtol=1e-6,
    )
