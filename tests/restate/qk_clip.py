"""QK-Clip (MuonClip) restated in float64, per head, and the public implementations' formulas.

The rule (Kimi K2 report, Section 2.1 and Algorithm 1), on each attention's
weights after the optimizer step, with ``S_h`` the largest pre-softmax logit
of query head ``h`` over the batch::

    gamma_h = min(1, tau / S_h)
    W_q[h] *= gamma_h ** alpha;  W_k[h] *= gamma_h ** (1 - alpha)   (alpha = 1/2)
    MLA: W_q_rope[h] *= gamma_h; the shared rotary key untouched

Under GQA a key head ``g`` serves the query heads ``g * r .. g * r + r - 1``
(``r = heads / kv_heads``): its factor is ``min(1, tau / max_h S_h)`` over them,
and every query head of the group takes it (Megatron-LM's rule; the K2 report
defines MHA and MLA only).

:func:`rule` works on per-head arrays (``[heads, ...]`` queries, ``[kv_heads,
...]`` keys); :func:`megatron_qkv`, :func:`megatron_mla` and :func:`maxtext_mla`
restate the public code line by line on its own weight layouts:

* Megatron-LM, NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553:
  ``megatron/core/transformer/attention.py`` ``clip_qk`` and
  ``_clip_linear_qkv`` (``linear_qkv`` weight ``[groups * (q_per_group + 2) *
  head_dim, hidden]``, each group's queries, key and value in a row block),
  ``megatron/core/transformer/multi_latent_attention.py`` ``clip_qk``,
  ``_clip_q_proj_weight``, ``_clip_kv_proj_weight``;
* MaxText, AI-Hypercomputer/maxtext at e591f30cbbf217ed67ef71263ec0538239f9c3b8:
  ``src/maxtext/utils/qk_clip_utils.py`` ``_scale_from_max_logits`` and
  ``_clip_mla_weight`` (``wq_b [rank, heads, nope + rope]``, ``wkv_b [rank,
  heads, nope + v]``; ``tau / (S + 1e-6)``).
"""

from __future__ import annotations

import numpy as np

F64 = np.float64


def group_factors(max_logits: np.ndarray, tau: float, kv_heads: int) -> np.ndarray:
    """``[..., kv_heads]``: ``min(1, tau / S)`` of each key head's largest query logit."""
    s = np.asarray(max_logits, F64)
    grouped = s.reshape(*s.shape[:-1], kv_heads, -1).max(axis=-1)
    return np.minimum(1.0, tau / grouped)


def rule(
    q: np.ndarray,
    k: np.ndarray,
    max_logits: np.ndarray,
    tau: float,
    *,
    alpha: float = 0.5,
    rope_q: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """The rescaled ``(q [heads, ...], k [kv_heads, ...], rope_q [heads, ...])``."""
    heads, kv_heads = q.shape[0], k.shape[0]
    gamma = group_factors(max_logits, tau, kv_heads)
    per_query = np.repeat(gamma, heads // kv_heads)
    expand = lambda f, x: f.reshape(-1, *([1] * (x.ndim - 1)))
    q = np.asarray(q, F64) * expand(per_query**alpha, q)
    k = np.asarray(k, F64) * expand(gamma ** (1 - alpha), k)
    if rope_q is not None:
        rope_q = np.asarray(rope_q, F64) * expand(per_query, rope_q)
    return q, k, rope_q


def megatron_qkv(
    weight: np.ndarray,
    max_logits: np.ndarray,
    tau: float,
    *,
    groups: int,
    head_dim: int,
    alpha: float = 0.5,
) -> np.ndarray:
    """``Attention.clip_qk`` on ``linear_qkv.weight``."""
    weight = np.asarray(weight, F64)
    s = np.asarray(max_logits, F64)
    grouped = s.reshape(groups, -1).max(axis=1)
    if not np.any(grouped > tau):
        return weight
    eta = np.minimum(tau / grouped, 1.0).reshape(groups, 1, 1)
    heads = s.shape[0]
    query_size, kv_size = heads * head_dim, groups * head_dim
    w = weight.reshape(groups, (query_size + 2 * kv_size) // groups, -1).copy()
    q_rows = query_size // groups
    k_rows = (query_size + kv_size) // groups
    w[:, :q_rows] *= eta**alpha
    w[:, q_rows:k_rows] *= eta ** (1 - alpha)
    return w.reshape(weight.shape)


def megatron_mla(
    q_proj: np.ndarray,
    kv_up: np.ndarray,
    max_logits: np.ndarray,
    tau: float,
    *,
    nope: int,
    alpha: float = 0.5,
) -> tuple[np.ndarray, np.ndarray]:
    """``MLASelfAttention.clip_qk``: ``linear_q_proj`` (or ``linear_q_up_proj``) weight
    ``[heads * (nope + rope), ...]`` and ``linear_kv_up_proj`` weight ``[heads * (nope +
    v), kv_lora_rank]``."""
    s = np.asarray(max_logits, F64)
    heads = s.shape[0]
    q_proj, kv_up = np.asarray(q_proj, F64), np.asarray(kv_up, F64)
    if not np.any(s > tau):
        return q_proj, kv_up
    eta = np.minimum(tau / s, 1.0).reshape(heads, 1, 1)
    q = q_proj.reshape(heads, q_proj.shape[0] // heads, -1).copy()
    q[:, :nope] *= eta**alpha
    q[:, nope:] *= eta
    kv = kv_up.reshape(heads, kv_up.shape[0] // heads, -1).copy()
    kv[:, :nope] *= eta ** (1 - alpha)
    return q.reshape(q_proj.shape), kv.reshape(kv_up.shape)


def maxtext_mla(
    wq_b: np.ndarray, wkv_b: np.ndarray, max_logits: np.ndarray, tau: float, *, nope: int
) -> tuple[np.ndarray, np.ndarray]:
    """``apply_qk_clip`` on ``wq_b`` and ``wkv_b``; ``max_logits`` ``[batch, heads]``."""
    s = np.asarray(max_logits, F64)
    s_max = s.max(axis=tuple(range(s.ndim - 1)))
    scale = np.minimum(1.0, tau / (s_max + 1e-6))[:, None]
    wq_b, wkv_b = np.asarray(wq_b, F64), np.asarray(wkv_b, F64)
    wq = np.concatenate([wq_b[..., :nope] * np.sqrt(scale), wq_b[..., nope:] * scale], axis=-1)
    wkv = np.concatenate([wkv_b[..., :nope] * np.sqrt(scale), wkv_b[..., nope:]], axis=-1)
    return wq, wkv
