"""clipjax.max_attention_logits: the full attention matrix's max, computed in blocks
(tests/qk_clip/test_flax.py takes it out of flax modules)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import clipjax


def full_max(q: jax.Array, k: jax.Array, allowed: Any = None, scale=None) -> np.ndarray:
    """The reference: every logit materialised, float64."""
    q, k = np.asarray(q, np.float64), np.asarray(k, np.float64)
    heads, kv_heads, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    k = np.repeat(k, heads // kv_heads, axis=-2)
    logits = np.einsum("...qhd,...khd->...hqk", q, k) * (dim**-0.5 if scale is None else scale)
    if allowed is not None:
        logits = np.where(np.broadcast_to(allowed, logits.shape), logits, -np.inf)
    return logits.reshape(-1, heads, *logits.shape[-2:]).max(axis=(0, 2, 3))


def qk(batch: tuple[int, ...], q_len: int, kv_len: int, heads: int, kv_heads: int, dim: int = 4):
    rng = np.random.default_rng(0)  # NumPy: no random-number program to compile per shape
    q = 2.0 * rng.standard_normal((*batch, q_len, heads, dim))
    k = rng.standard_normal((*batch, kv_len, kv_heads, dim))
    return jnp.asarray(q, jnp.float32), jnp.asarray(k, jnp.float32)


@pytest.mark.parametrize(
    ("batch", "q_len", "kv_len", "heads", "kv_heads", "chunk"),
    [
        ((2,), 16, 16, 4, 4, 4),  # MHA, blocks that divide
        ((3,), 10, 7, 6, 3, 3),  # GQA, blocks that do not divide, kv longer than a block
        ((2, 3), 9, 9, 4, 1, 512),  # MQA, two batch axes, one block
        ((), 5, 12, 2, 2, 5),  # no batch axis
    ],
)
@pytest.mark.parametrize("causal", [False, True])
def test_equals_the_full_matrix(batch, q_len, kv_len, heads, kv_heads, chunk, causal) -> None:
    q, k = qk(batch, q_len, kv_len, heads, kv_heads)
    allowed = np.tril(np.ones((q_len, kv_len), bool)) if causal else None
    helper = jax.jit(clipjax.max_attention_logits, static_argnames=("causal", "chunk_size"))
    got = helper(q, k, causal=causal, chunk_size=chunk)
    np.testing.assert_allclose(got, full_max(q, k, allowed), rtol=2e-6)
    assert got.dtype == jnp.float32 and got.shape == (heads,)


@pytest.mark.parametrize("mask_heads", [1, 4])
def test_a_mask_and_a_scale(mask_heads: int) -> None:
    q, k = qk((2,), 12, 12, 4, 2)
    mask = np.random.default_rng(3).random((2, mask_heads, 12, 12)) < 0.4
    got = jax.jit(
        lambda q, k, m: clipjax.max_attention_logits(q, k, mask=m, scale=0.3, chunk_size=5)
    )(q, k, mask)
    np.testing.assert_allclose(got, full_max(q, k, mask, scale=0.3), rtol=2e-6)
    # A [q_len, kv_len] mask broadcasts over the batch and heads.
    tri = np.tril(np.ones((12, 12), bool))
    np.testing.assert_allclose(
        clipjax.max_attention_logits(q, k, mask=tri),
        clipjax.max_attention_logits(q, k, causal=True),
    )


def test_a_head_that_sees_nothing_is_minus_infinity() -> None:
    q, k = qk((1,), 4, 4, 2, 2)
    mask = np.ones((1, 2, 4, 4), bool)
    mask[:, 1] = False
    got = jax.jit(lambda q, k: clipjax.max_attention_logits(q, k, mask=mask))(q, k)
    assert np.isneginf(got[1]) and np.isfinite(got[0])


def _largest_intermediate(jaxpr: Any) -> int:
    sizes = [0]
    for eqn in jaxpr.eqns:
        sizes += [int(np.prod(v.aval.shape)) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                sizes.append(_largest_intermediate(inner))
    return max(sizes)


def test_no_array_the_size_of_the_attention_matrix() -> None:
    batch, length, heads, chunk = 2, 64, 4, 8
    q, k = qk((batch,), length, length, heads, heads)
    jaxpr = jax.make_jaxpr(
        lambda q, k: clipjax.max_attention_logits(q, k, causal=True, chunk_size=chunk)
    )(q, k)
    block = batch * heads * chunk * chunk
    assert _largest_intermediate(jaxpr.jaxpr) <= max(block, q.size, k.size)
    assert block * (length // chunk) ** 2 > 8 * max(block, q.size)  # the full matrix


def test_no_gradient_flows_through_it() -> None:
    q, k = qk((1,), 6, 6, 2, 2)
    grad = jax.grad(lambda q, k: clipjax.max_attention_logits(q, k).sum(), argnums=(0, 1))
    for g in jax.jit(grad)(q, k):
        np.testing.assert_array_equal(g, 0.0)


def test_low_precision_inputs_give_float32() -> None:
    q, k = qk((2,), 8, 8, 2, 2)
    q, k = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
    got = jax.jit(clipjax.max_attention_logits)(q, k)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(
        got, full_max(q.astype(jnp.float32), k.astype(jnp.float32)), rtol=1e-5
    )


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "kwargs", "message"),
    [
        ((2, 4, 8), (2, 4, 8, 2), {}, "the same number of axes"),
        ((2, 4, 3, 8), (2, 4, 2, 8), {}, "multiple of the key's 2 heads"),
        ((2, 4, 2, 8), (2, 4, 2, 4), {}, "head_dim"),
        ((2, 4, 2, 8), (2, 4, 2, 8), dict(chunk_size=0), "chunk_size must be an int >= 1"),
        ((2, 4, 2, 8), (2, 4, 2, 8), dict(scale=0.0), "scale must be > 0"),
        ((2, 4, 2, 8), (2, 4, 2, 8), dict(mask=np.ones((3, 4, 4), bool)), "does not broadcast"),
    ],
)
def test_bad_input_is_named(q_shape, k_shape, kwargs, message) -> None:
    with pytest.raises(ValueError, match=message):
        clipjax.max_attention_logits(jnp.ones(q_shape), jnp.ones(k_shape), **kwargs)
