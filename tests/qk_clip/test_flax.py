"""The max logits out of flax modules (NNX's nnx.capture, linen's sow) into clipjax.qk_clip,
and docs/qk_clip.md's two flax recipes."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
import pytest

import clipjax
from tests.qk_clip.test_docs import run

# Slow, `make test` skips it: compiles the training steps of four small flax models.
pytestmark = pytest.mark.slow


def test_nnx_capture_of_sown_max_logits_reaches_qk_clip() -> None:
    nnx = pytest.importorskip("flax.nnx")
    if not hasattr(nnx, "capture"):
        pytest.skip("nnx.capture is newer than this flax")

    def attention(query, key, value, *, mask=None, module=None, **kwargs):
        module.sow(
            nnx.Intermediate, "max_logits", clipjax.max_attention_logits(query, key, mask=mask)
        )
        return nnx.dot_product_attention(query, key, value, mask=mask, **kwargs)

    class Model(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            make = lambda: nnx.MultiHeadAttention(4, 16, num_kv_heads=2, attention_fn=attention,
                                                  decode=False, rngs=rngs)  # fmt: skip
            self.layers = nnx.List([make(), make()])

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers:
                x = x + layer(x, sow_weights=True)
            return x

    model = Model(nnx.Rngs(0))
    tx = clipjax.qk_clip(optax.sgd(0.0), 1.0, kv_heads=2)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (2, 5, 16))

    @nnx.jit
    def train_step(model: Any, optimizer: Any, x: jax.Array) -> Any:
        def loss_fn(model: Any) -> Any:
            y, intermediates = nnx.capture(model, nnx.Intermediate)(x)
            return jnp.mean(y**2), intermediates

        (_, intermediates), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads, max_logits=intermediates)
        return intermediates

    intermediates = train_step(model, optimizer, x)
    m = clipjax.metrics(optimizer.opt_state)
    for i in range(2):
        sown = intermediates["layers"][i]["max_logits"]
        sown = jax.tree.leaves(sown)[0]
        assert float(m[f"qk_clip/layers/{i}/max_logit"]) == pytest.approx(float(jnp.max(sown)))
        assert int(m[f"qk_clip/layers/{i}/clipped_heads"]) == int(jnp.sum(sown > 1.0))


def test_linen_sow_reaches_qk_clip() -> None:
    nn = pytest.importorskip("flax.linen")

    def attention(query, key, value, *, mask=None, module=None, **kwargs):
        module.sow(
            "intermediates", "max_logits", clipjax.max_attention_logits(query, key, mask=mask)
        )
        return nn.dot_product_attention(query, key, value, mask=mask, **kwargs)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for i in range(2):
                attn = nn.MultiHeadDotProductAttention(4, attention_fn=attention, name=f"attn_{i}")
                x = x + attn(x, sow_weights=True)
            return x

    model, x = Model(), jax.random.normal(jax.random.key(0), (2, 5, 16))
    params = model.init(jax.random.key(1), x)["params"]
    tx = clipjax.qk_clip(optax.sgd(0.0), 1.0)
    state = tx.init(params)
    _, variables = model.apply({"params": params}, x, mutable=["intermediates"])
    _, state = jax.jit(tx.update)(params, state, params, max_logits=variables)
    m = clipjax.metrics(state)
    for i in range(2):
        (sown,) = variables["intermediates"][f"attn_{i}"]["max_logits"]
        assert float(m[f"qk_clip/attn_{i}/max_logit"]) == pytest.approx(float(jnp.max(sown)))


def test_the_docs_nnx_recipe(capsys: pytest.CaptureFixture) -> None:
    nnx = pytest.importorskip("flax.nnx")
    if not hasattr(nnx, "capture"):
        pytest.skip("nnx.capture is newer than this flax")
    namespace, out = run(4, capsys)
    assert out.strip() == "['qk_clip/layers/0', 'qk_clip/layers/1']"
    metrics = namespace["metrics"]
    assert int(metrics["qk_clip/layers/0/step"]) == 3
    assert sum(int(metrics[f"qk_clip/layers/{i}/clipped_count"]) for i in (0, 1)) > 0


def test_the_docs_linen_recipe(capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("flax.linen")
    _, out = run(5, capsys)
    assert out.strip() == "['qk_clip/attn_0', 'qk_clip/attn_1']"
