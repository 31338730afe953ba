"""The largest pre-softmax attention logit of each head, without the attention matrix."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _blocks(x: Array, length: int, chunk: int, axis: int) -> Array:
    """``x`` padded along ``axis`` to a multiple of ``chunk``, split into ``[blocks, ...]``."""
    blocks = -(-length // chunk)
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, blocks * chunk - length)
    x = jnp.pad(x, pad)
    shape = (*x.shape[:axis], blocks, chunk, *x.shape[axis + 1 :])
    return jnp.moveaxis(x.reshape(shape), axis, 0)


def _mask_blocks(
    mask: Any, batch: tuple[int, ...], heads: int, kv_heads: int, q_len: int, kv_len: int
) -> Array:
    """``mask`` as ``[batch or 1, kv_heads or 1, group or 1, q_len, kv_len]``."""
    full = (*batch, heads, q_len, kv_len)
    mask = jnp.asarray(mask, bool)
    try:
        jnp.broadcast_shapes(jnp.shape(mask), full)
        if mask.ndim > len(full):
            raise ValueError
    except ValueError:
        raise ValueError(
            f"max_attention_logits: mask of shape {jnp.shape(mask)} does not broadcast to "
            f"[..., heads, q_len, kv_len] = {full}"
        ) from None
    mask = mask.reshape((1,) * (len(full) - mask.ndim) + mask.shape)
    mask_batch, mask_heads = mask.shape[: len(batch)], mask.shape[len(batch)]
    if any(size != 1 for size in mask_batch):
        mask = jnp.broadcast_to(mask, (*batch, *mask.shape[len(batch) :]))
    n = math.prod(mask.shape[: len(batch)])
    hg = (kv_heads, heads // kv_heads) if mask_heads == heads else (1, 1)
    mask = jnp.broadcast_to(mask, (*mask.shape[:-2], q_len, kv_len))
    return mask.reshape(n, *hg, q_len, kv_len)


def max_attention_logits(
    query: Array,
    key: Array,
    *,
    scale: float | None = None,
    mask: Array | None = None,
    causal: bool = False,
    chunk_size: int = 512,
) -> Array:
    """The largest pre-softmax logit of each query head, computed in blocks.

    For every query head ``h`` (the key head it reads under GQA/MQA)::

        S_h = scale * max over batch, query i, key j (allowed by the mask) of q_hi . k_j

    the quantity :func:`clipjax.qk_clip` bounds, for a fused or flash attention that
    never holds its logits. Computed block by block (the largest array held is
    ``[batch, heads, chunk_size, chunk_size]``) under ``lax.stop_gradient``: one
    more ``q @ k^T`` in the forward pass.

    Args:
      query: ``[..., q_len, heads, head_dim]`` (the layout of
        ``jax.nn.dot_product_attention`` and flax), any leading batch axes.
      key: ``[..., kv_len, kv_heads, head_dim]``; ``heads`` a multiple of
        ``kv_heads`` (GQA, as ``jax.nn.dot_product_attention`` repeats them).
      scale: the logits' factor; default ``1 / sqrt(head_dim)``. Must be > 0.
      mask: boolean, broadcastable to ``[..., heads, q_len, kv_len]`` (flax's
        convention); False leaves a logit out.
      causal: query position ``i`` sees key positions ``j <= i`` only.
      chunk_size: queries and keys per block (an int >= 1).

    Returns:
      ``[heads]`` float32 (float64 for float64 inputs); ``-inf`` where no key is seen.

    Examples:
      >>> import jax, jax.numpy as jnp, clipjax
      >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))  # [batch, length, heads, dim]
      >>> k = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))  # two key heads (GQA)
      >>> s = clipjax.max_attention_logits(q, k, causal=True, chunk_size=4)
      >>> s.shape
      (4,)
      >>> full = jnp.einsum("bqhd,bkhd->bhqk", q, jnp.repeat(k, 2, axis=2)) / jnp.sqrt(8.0)
      >>> full = jnp.where(jnp.tril(jnp.ones((16, 16), bool)), full, -jnp.inf)
      >>> bool(jnp.allclose(s, full.max(axis=(0, 2, 3))))
      True
    """
    query, key = jnp.asarray(query), jnp.asarray(key)
    if query.ndim < 3 or key.ndim != query.ndim:
        raise ValueError(
            "max_attention_logits: query and key must be [..., length, heads, head_dim] with "
            f"the same number of axes, got shapes {query.shape} and {key.shape}"
        )
    batch, (q_len, heads, dim) = query.shape[:-3], query.shape[-3:]
    kv_len, kv_heads, key_dim = key.shape[-3:]
    if key.shape[:-3] != batch or key_dim != dim:
        raise ValueError(
            "max_attention_logits: key must have query's batch axes and head_dim, got "
            f"query {query.shape} and key {key.shape}"
        )
    if kv_heads < 1 or heads % kv_heads:
        raise ValueError(
            f"max_attention_logits: the query's {heads} heads must be a multiple of the "
            f"key's {kv_heads} heads"
        )
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)):
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    else:
        try:
            concrete = float(scale)
        except (TypeError, jax.errors.ConcretizationTypeError):
            concrete = None  # traced: checked by the caller's values, not here
        if concrete is not None and not concrete > 0:
            raise ValueError(f"scale must be > 0, got {scale!r}")

    dtype = jnp.promote_types(jnp.result_type(query, key), jnp.float32)
    group = heads // kv_heads
    n = math.prod(batch)
    # [batch, length, kv_heads, group, dim]: query head h = g * group + r reads key head g.
    q = jax.lax.stop_gradient(query).reshape(n, q_len, kv_heads, group, dim)
    k = jax.lax.stop_gradient(key).reshape(n, kv_len, kv_heads, dim)
    if mask is not None:
        allowed = _mask_blocks(mask, batch, heads, kv_heads, q_len, kv_len)

    q_chunk, kv_chunk = min(chunk_size, q_len), min(chunk_size, kv_len)
    q_blocks = _blocks(q, q_len, q_chunk, 1)  # [qb, n, q_chunk, kv_heads, group, dim]
    k_blocks = _blocks(k, kv_len, kv_chunk, 1)  # [kb, n, kv_chunk, kv_heads, dim]
    q_pos = _blocks(jnp.arange(q_len), q_len, q_chunk, 0)
    k_pos = _blocks(jnp.arange(kv_len), kv_len, kv_chunk, 0)
    q_valid = _blocks(jnp.ones(q_len, bool), q_len, q_chunk, 0)
    k_valid = _blocks(jnp.ones(kv_len, bool), kv_len, kv_chunk, 0)
    if mask is not None:
        allowed = _blocks(allowed, q_len, q_chunk, 3)  # [qb, n, g, r, q_chunk, kv_len]
    lowest = jnp.array(-jnp.inf, dtype)

    def query_block(args: Any) -> Array:
        qb, qp, qv, qa = args

        def key_block(kargs: Any) -> Array:
            kb, kp, kv, start = kargs
            logits = jnp.einsum("nqgrd,nkgd->ngrqk", qb, kb, preferred_element_type=dtype)
            ok = qv[:, None] & kv[None, :]
            if causal:
                ok = ok & (kp[None, :] <= qp[:, None])
            ok = ok[None, None, None]
            if qa is not None:
                ok = ok & jax.lax.dynamic_slice_in_dim(qa, start, kv_chunk, axis=-1)
            return jnp.max(jnp.where(ok, logits, lowest), axis=(0, 3, 4))

        starts = jnp.arange(k_blocks.shape[0]) * kv_chunk
        if qa is not None:  # the mask padded to whole key blocks
            qa = jnp.pad(qa, [(0, 0)] * 4 + [(0, k_blocks.shape[0] * kv_chunk - kv_len)])
        # A map, not a scan with a running max: no carry whose type under shard_map
        # (varying over the mapped axes or not) would have to match the inputs'.
        per_key_block = jax.lax.map(key_block, (k_blocks, k_pos, k_valid, starts))
        return jnp.max(per_key_block, axis=0)

    per_block = jax.lax.map(
        query_block, (q_blocks, q_pos, q_valid, allowed if mask is not None else None)
    )
    return (jnp.max(per_block, axis=0) * jnp.asarray(scale, dtype)).reshape(heads)
