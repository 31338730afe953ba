"""clipjax.qk_clip's contract: a fixed state, jit, scan, the optimizers and optax's
wrappers it goes with, its metrics, and bad input named."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax

TAU = 10.0
D, HEADS, HEAD_DIM = 8, 4, 2
FIELDS = ("max_logit", "clipped", "clipped_heads", "factor", "step", "clipped_count",
          "nonfinite_count")  # fmt: skip


def attention_params(seed: int = 0, layers: int | None = None) -> dict[str, Any]:
    """flax's layout, one attention module (``layers`` stacked along axis 0)."""
    keys = iter(jax.random.split(jax.random.key(seed), 8))
    lead = () if layers is None else (layers,)
    normal = lambda *shape: jax.random.normal(next(keys), lead + shape)
    attn = {
        "query": {"kernel": normal(D, HEADS, HEAD_DIM), "bias": normal(HEADS, HEAD_DIM)},
        "key": {"kernel": normal(D, HEADS, HEAD_DIM), "bias": normal(HEADS, HEAD_DIM)},
        "value": {"kernel": normal(D, HEADS, HEAD_DIM)},
    }
    out = jax.random.normal(next(keys), (D, D))
    return {"layers": {"attn": attn}, "out": out}


def logits_at(t: int, rows: int = 1) -> jax.Array:
    base = jnp.array([1.0, 5.0, 12.0, 30.0])
    return jnp.tile(base * (1.0 + 0.1 * t), (rows, 1))


def test_jit_traces_once_keeps_the_state_and_equals_eager() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU)
    traces = []

    def update(updates: Any, state: Any, params: Any, max_logits: Any) -> Any:
        traces.append(1)
        return tx.update(updates, state, params, max_logits=max_logits)

    jitted = jax.jit(update)
    state = eager_state = tx.init(params)
    shapes = jax.tree.map(lambda x: (x.shape, x.dtype), state)
    for t in range(4):
        updates = jax.tree.map(lambda p, c=0.1 * (t + 1): c * p, params)
        out, state = jitted(updates, state, params, logits_at(t))
        assert jax.tree.map(lambda x: (x.shape, x.dtype), state) == shapes
        assert jax.tree.structure(state) == jax.tree.structure(tx.init(params))
        eager, eager_state = tx.update(updates, eager_state, params, max_logits=logits_at(t))
        # XLA fuses the jitted rescale (a multiply-add): equal within float32 rounding.
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), out, eager
        )
    assert len(traces) == 1
    jax.tree.map(np.testing.assert_array_equal, state, eager_state)
    assert {k: v.dtype for k, v in state.metrics.items()} == {
        **dict.fromkeys(FIELDS, jnp.int32), "max_logit": jnp.float32, "factor": jnp.float32,
        "clipped": jnp.bool_,
    }  # fmt: skip


def test_metrics_names_and_counters() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.sgd(0.0), TAU, name="qk")
    state = tx.init(params)
    for t in range(3):
        _, state = tx.update(params, state, params, max_logits=logits_at(t))
    m = clipjax.metrics(state)
    assert sorted(m) == sorted(f"qk/layers/attn/{f}" for f in FIELDS)
    s = np.asarray(logits_at(2))[0]
    assert float(m["qk/layers/attn/max_logit"]) == pytest.approx(s.max())
    assert int(m["qk/layers/attn/clipped_heads"]) == 2
    assert float(m["qk/layers/attn/factor"]) == pytest.approx(TAU / s.max())
    assert int(m["qk/layers/attn/step"]) == 3 and int(m["qk/layers/attn/clipped_count"]) == 3


def test_a_nonfinite_logit_leaves_its_head_alone_and_is_counted() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU)
    s = jnp.array([[jnp.nan, jnp.inf, 30.0, 1.0]])
    out, state = tx.update(params, tx.init(params), params, max_logits=s)
    kernel = lambda tree: tree["layers"]["attn"]["query"]["kernel"][:, :2]
    np.testing.assert_array_equal(kernel(out), kernel(params))
    assert int(state.metrics["nonfinite_count"][0]) == 1
    assert int(state.metrics["clipped_heads"][0]) == 1


def scanned_model_loss(params: Any, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A stack of attention layers under lax.scan; the max logits come out as [layers, heads]."""

    def layer(h: jax.Array, p: Any) -> tuple[jax.Array, jax.Array]:
        q = (
            jnp.einsum("btd,dhk->bthk", h, p["attn"]["query"]["kernel"])
            + p["attn"]["query"]["bias"]
        )
        k = jnp.einsum("btd,dhk->bthk", h, p["attn"]["key"]["kernel"]) + p["attn"]["key"]["bias"]
        v = jnp.einsum("btd,dhk->bthk", h, p["attn"]["value"]["kernel"])
        s = clipjax.max_attention_logits(q, k, causal=True, chunk_size=4)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        return jnp.tanh(h + out.reshape((*h.shape[:2], -1)) @ jnp.ones((HEADS * HEAD_DIM, D))), s

    h, logits = jax.lax.scan(layer, x, params["layers"])
    return jnp.mean((h @ params["out"]) ** 2), logits


def test_a_scanned_model_trained_in_a_scan_over_steps() -> None:
    layers = 2
    params = attention_params(1, layers)
    x = jax.random.normal(jax.random.key(2), (2, 6, D))
    tx = clipjax.qk_clip(optax.adamw(0.05), 2.0, scope=clipjax.stacked(layers="layers"))
    state = tx.init(params)
    assert state.info.groups == tuple(f"layers/{k}/attn" for k in range(layers))

    def train_step(carry: Any, _: Any) -> tuple[Any, jax.Array]:
        params, state = carry
        (_, logits), grads = jax.value_and_grad(scanned_model_loss, has_aux=True)(params, x)
        updates, state = tx.update(grads, state, params, max_logits=logits)
        return (optax.apply_updates(params, updates), state), jnp.max(logits)

    (params, state), maxima = jax.jit(lambda c: jax.lax.scan(train_step, c, None, length=4))(
        (params, state)
    )
    _, after = scanned_model_loss(params, x)
    # The last step's weights were rescaled for the logits of the weights before it; the
    # logits of the rescaled weights are at most tau where they were clipped, up to the
    # step's own change.
    m = clipjax.metrics(state)
    assert int(m["qk_clip/layers/0/attn/step"]) == 4
    assert sum(int(m[f"qk_clip/layers/{k}/attn/clipped_count"]) for k in range(layers)) > 0
    assert float(jnp.max(after)) < float(jnp.max(maxima))


def test_update_under_vmap_takes_the_max_over_axis_name() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU, axis_name="data")
    state = tx.init(params)
    replicas = jnp.stack([logits_at(0), 2 * logits_at(0)])  # two data shards' own maxima
    stack = lambda tree: jax.tree.map(lambda x: jnp.stack([x, x]), tree)
    out, states = jax.vmap(lambda u, s, p, m: tx.update(u, s, p, max_logits=m), axis_name="data")(
        stack(params), stack(state), stack(params), replicas
    )
    single, _ = clipjax.qk_clip(optax.identity(), TAU).update(
        params, state, params, max_logits=2 * logits_at(0)
    )
    for replica in range(2):
        mine = jax.tree.map(lambda a, r=replica: a[r], out)
        jax.tree.map(np.testing.assert_allclose, mine, single)
    np.testing.assert_allclose(states.metrics["max_logit"][:, 0], [60.0, 60.0])


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_after_the_optimizer_heads_under_tau_keep_its_updates(optimizer: str) -> None:
    if optimizer == "muon" and not hasattr(optax.contrib, "muon"):
        pytest.skip("optax.contrib.muon is newer than this optax")
    shape = (D, HEADS * HEAD_DIM)
    params = {"attn": {"query": jax.random.normal(jax.random.key(0), shape),
                       "key": jax.random.normal(jax.random.key(1), shape)}}  # fmt: skip
    grads = jax.tree.map(lambda p: 0.3 * p + 0.1, params)
    make = {"adamw": lambda: optax.adamw(1e-2), "muon": lambda: optax.contrib.muon(1e-2)}[optimizer]
    tx = clipjax.qk_clip(make(), TAU, head_axis=-1)
    alone = make()
    s = jnp.array([1.0, 40.0, 5.0, 12.5])
    out, state = jax.jit(tx.update)(grads, tx.init(params), params, max_logits=s)
    ref, _ = jax.jit(alone.update)(grads, alone.init(params), params)
    for name in ("query", "key"):
        got = np.asarray(out["attn"][name]).reshape(D, HEADS, HEAD_DIM)
        want = np.asarray(ref["attn"][name]).reshape(D, HEADS, HEAD_DIM)
        np.testing.assert_array_equal(got[:, [0, 2]], want[:, [0, 2]])
        weights = np.asarray(params["attn"][name], np.float64).reshape(D, HEADS, HEAD_DIM) + want
        new = np.asarray(params["attn"][name]).reshape(D, HEADS, HEAD_DIM) + got
        for head, s_h in ((1, 40.0), (3, 12.5)):
            np.testing.assert_allclose(
                new[:, head], math.sqrt(TAU / s_h) * weights[:, head], rtol=1e-5
            )
    assert int(clipjax.metrics(state)["qk_clip/attn/clipped_heads"]) == 2


def test_inject_hyperparams_tau_equals_the_plain_transform() -> None:
    params = attention_params()
    injected = optax.inject_hyperparams(clipjax.qk_clip)(optax.identity(), tau=20.0)
    plain = clipjax.qk_clip(optax.identity(), 20.0)
    state, plain_state = injected.init(params), plain.init(params)
    for t in range(3):
        out, state = jax.jit(injected.update)(params, state, params, max_logits=logits_at(t))
        want, plain_state = plain.update(params, plain_state, params, max_logits=logits_at(t))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, want)
    jax.tree.map(np.testing.assert_array_equal, state.inner_state.metrics, plain_state.metrics)
    # A new tau, set in the state, with no recompilation of anything else.
    state.hyperparams["tau"] = jnp.asarray(5.0)
    _, state = jax.jit(injected.update)(params, state, params, max_logits=logits_at(0))
    assert int(state.inner_state.metrics["clipped_heads"][0]) == 2  # 12 and 30 > 5


def test_inject_hyperparams_static_arguments_say_so() -> None:
    with pytest.raises(ValueError, match=r"static_args=\('kv_heads',\)"):
        optax.inject_hyperparams(clipjax.qk_clip)(optax.identity(), tau=1.0, kv_heads=2).init(
            attention_params()
        )
    tx = optax.inject_hyperparams(clipjax.qk_clip, static_args=("kv_heads", "head_axis"))(
        optax.identity(), tau=1.0, kv_heads=2, head_axis=-2
    )
    tx.update(attention_params(), tx.init(attention_params()), attention_params(),
              max_logits=logits_at(0))  # fmt: skip


def test_multi_steps_clips_once_per_real_step_with_the_last_logits() -> None:
    params = attention_params()
    inner = lambda: clipjax.qk_clip(optax.sgd(0.1), TAU)
    tx = optax.MultiSteps(inner(), every_k_schedule=2)
    grads = [jax.tree.map(lambda p, c=c: c * p, params) for c in (0.5, 1.5)]
    state = tx.init(params)
    out0, state = jax.jit(tx.update)(grads[0], state, params, max_logits=logits_at(0))
    jax.tree.map(lambda x: np.testing.assert_array_equal(x, 0.0), out0)
    # The accumulation's max logits, taken by the caller, go with the emitting call.
    s = jnp.maximum(logits_at(0), logits_at(1))
    out1, state = jax.jit(tx.update)(grads[1], state, params, max_logits=s)
    mean = jax.tree.map(lambda a, b: (a + b) / 2, *grads)
    plain = inner()
    want, plain_state = plain.update(mean, plain.init(params), params, max_logits=s)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out1, want)
    m = clipjax.metrics(state)
    assert int(m["qk_clip/layers/attn/step"]) == 1
    assert int(m["qk_clip/layers/attn/clipped_heads"]) == int(
        plain_state.metrics["clipped_heads"][0]
    )


def test_multi_steps_with_a_tree_of_logits() -> None:
    params = attention_params()
    tx = optax.MultiSteps(clipjax.qk_clip(optax.sgd(0.1), TAU), every_k_schedule=2)
    state = tx.init(params)
    tree = {"intermediates": {"layers": {"attn": {"max_logits": (logits_at(3)[0],)}}}}
    for _ in range(2):
        _, state = jax.jit(tx.update)(params, state, params, max_logits=tree)
    assert int(clipjax.metrics(state)["qk_clip/layers/attn/clipped_heads"]) == 2


def test_tree_map_params_keeps_the_names() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.adam(1e-3), TAU)
    state = tx.init(params)
    mapped = optax.tree_utils.tree_map_params(tx, lambda x: x, state)
    assert mapped.info.groups == ("layers/attn",)
    assert sorted(clipjax.metrics(mapped)) == sorted(clipjax.metrics(state))


def test_flax_serialization_round_trip() -> None:
    serialization = pytest.importorskip("flax.serialization")
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU)
    _, state = tx.update(params, tx.init(params), params, max_logits=logits_at(2))
    restored = serialization.from_bytes(tx.init(params), serialization.to_bytes(state))
    jax.tree.map(np.testing.assert_array_equal, restored, state)
    assert restored.info == state.info


def test_a_tree_of_logits_is_read_by_module_path() -> None:
    params = {
        "params": {
            f"layers_{i}": {"attn": attention_params(i)["layers"]["attn"]} for i in (0, 1, 2, 10)
        }
    }
    tx = clipjax.qk_clip(optax.identity(), TAU)
    state = tx.init(params)
    assert state.info.groups == tuple(f"params/layers_{i}/attn" for i in (0, 1, 2, 10))
    batch = lambda i: jnp.stack([logits_at(i)[0], 0.5 * logits_at(i)[0]])  # [batch, heads]
    tree = {
        "intermediates": {
            f"layers_{i}": {"attn": {"max_logits": (batch(i),)}} for i in (0, 1, 2, 10)
        }
    }
    out_tree, state_tree = tx.update(params, state, params, max_logits=tree)
    rows = jnp.concatenate([logits_at(i) for i in (0, 1, 2, 10)])  # natural order
    out_rows, state_rows = tx.update(params, state, params, max_logits=rows)
    jax.tree.map(np.testing.assert_array_equal, out_tree, out_rows)
    jax.tree.map(np.testing.assert_array_equal, state_tree, state_rows)


def test_a_stacked_module_reads_layers_by_heads_from_a_tree() -> None:
    params = attention_params(0, 3)
    tx = clipjax.qk_clip(optax.identity(), TAU, scope=clipjax.stacked(layers="layers"))
    state = tx.init(params)
    s = jnp.stack([logits_at(t)[0] for t in range(3)])
    tree = {"layers": {"attn": {"max_logits": s[:, None, :]}}}  # [layers, batch, heads]
    out_tree, _ = tx.update(params, state, params, max_logits=tree)
    out_rows, _ = tx.update(params, state, params, max_logits=s)
    jax.tree.map(np.testing.assert_array_equal, out_tree, out_rows)


def test_missing_params_and_max_logits_are_named() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU)
    state = tx.init(params)
    with pytest.raises(ValueError, match="needs params"):
        tx.update(params, state, max_logits=logits_at(0))
    with pytest.raises(ValueError, match="needs max_logits="):
        tx.update(params, state, params)
    with pytest.raises(TypeError, match="QKClipState"):
        tx.update(params, optax.sgd(1.0).init(params), params, max_logits=logits_at(0))


@pytest.mark.parametrize(
    ("kwargs", "logits", "message"),
    [
        ({}, jnp.ones((2, 4)), r"max_logits must be \[groups, heads\].*1: layers/attn"),
        ({}, jnp.ones((3,)), r"3 query heads"),
        ({}, {"other": jnp.ones(4)}, r"holds nothing under layers/attn"),
        (dict(query="q_proj"), None, r"no parameter matches the pattern\(s\) \['q_proj'\]"),
        (dict(key="out"), None, r"attention module layers/attn has no key leaf"),
        (dict(key=clipjax.QKHeads("key", axis=-1)), None, r"2 entries do not split into 4 heads"),
        (dict(query=clipjax.QKHeads("query", span=(0, 9))), None, r"span \(0, 9\) exceeds"),
        (dict(query=clipjax.QKHeads("query", dims=(0, 5))), None, r"dims \(0, 5\) exceed"),
    ],
)
def test_bad_max_logits_and_layouts_are_named(kwargs: dict, logits: Any, message: str) -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU, **kwargs)
    with pytest.raises(ValueError, match=message):
        tx.update(
            params, tx.init(params), params, max_logits=logits_at(0) if logits is None else logits
        )


def test_a_module_without_a_key_is_named() -> None:
    params = {"a": {"query": jnp.ones((2, 2, 2)), "key": jnp.ones((2, 2, 2))},
              "b": {"query": jnp.ones((2, 2, 2))}}  # fmt: skip
    with pytest.raises(ValueError, match="attention module b has no key leaf"):
        clipjax.qk_clip(optax.identity(), TAU).init(params)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(tau=0.0), "tau must be > 0"),
        (dict(alpha=1.5), r"alpha must be in \[0, 1\]"),
        (dict(kv_heads=0), "kv_heads must be an int >= 1"),
        (dict(head_axis=1.5), "head_axis must be an int"),
        (dict(scope="per_layer"), r"scope must be None or clipjax.stacked"),
        (dict(query=3), "query must be a path pattern"),
        (dict(rotary_query="("), "bad pattern"),
        (dict(name=""), "name must be a non-empty str"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        clipjax.qk_clip(optax.identity(), **kwargs)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(span=(3, 3)), r"span must be \(start, stop\)"),
        (dict(dims=(0,)), r"dims must be \(start, stop\)"),
        (dict(count=0), "count must be an int >= 1"),
    ],
)
def test_bad_qkheads_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        clipjax.QKHeads("query", **kwargs)


def test_another_models_state_is_named() -> None:
    tx = clipjax.qk_clip(optax.identity(), TAU)
    state = tx.init(attention_params())
    other = {"enc": attention_params()["layers"]}
    with pytest.raises(ValueError, match="does not match the tree passed to init"):
        tx.update(other, state, other, max_logits=logits_at(0))


def test_qkheads_takes_lists_and_stays_hashable() -> None:
    heads = clipjax.QKHeads("query", span=[0, 4], dims=[0, 1])
    assert heads == clipjax.QKHeads("query", span=(0, 4), dims=(0, 1))
    assert hash(heads) == hash(clipjax.QKHeads("query", span=(0, 4), dims=(0, 1)))


def test_other_values_a_module_sowed_are_not_logits() -> None:
    params = attention_params()
    tx = clipjax.qk_clip(optax.identity(), TAU)
    state = tx.init(params)
    attn = {"max_logits": (logits_at(0),), "attention_weights": (jnp.full((2, 4, 3, 3), 1e6),)}
    out, state = tx.update(params, state, params, max_logits={"layers": {"attn": attn}})
    want, _ = tx.update(params, tx.init(params), params, max_logits=logits_at(0))
    jax.tree.map(np.testing.assert_array_equal, out, want)
    assert float(state.metrics["max_logit"][0]) == pytest.approx(30.0)
