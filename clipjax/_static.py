"""Static clippers and normalisers: no statistics, metrics in state (SPEC 4.6)."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from clipjax import _engine, _grouping, _validation
from clipjax._engine import Decision, NormRule

ClipByGlobalNormState = _engine.register_algo(
    "clip_by_global_norm",
    "State of :func:`clip_by_global_norm`: no statistics, only metrics.",
    "ClipByGlobalNormState",
)


def _norm_type(norm_type: Any) -> float:
    _validation.static_number("norm_type", norm_type)
    try:
        p = float(norm_type)
    except (TypeError, ValueError):
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}") from None
    if not p > 0:
        raise ValueError(f"norm_type must be a number > 0 or inf, got {norm_type!r}")
    return p


def _clip_by_norm(
    max_norm: Any, norm_type: float, eps: Any, scope: Any, name: str | None
) -> _engine.ClipTransform:
    p = _norm_type(norm_type)
    _validation.check("max_norm", max_norm, lambda x: not math.isnan(x), "a number")
    _validation.non_negative("eps", eps)

    def decide(before: Any, after: Any, norm: jax.Array, count: jax.Array, aux: Any) -> Decision:
        limit = jnp.abs(jnp.asarray(max_norm, norm.dtype))
        ratio = limit / (norm + jnp.asarray(eps, norm.dtype))
        # lucid/torch: scale only when the norm exceeds |max_norm|.
        scale = jnp.where(norm > limit, jnp.minimum(ratio, 1.0), jnp.ones_like(norm))
        return Decision(threshold=None, scale=scale)

    rule = NormRule("clip_by_global_norm", decide, ord=p, threshold_name=None)
    return _engine.norm_transform(
        rule,
        scope=scope,
        name=name,
        rebuild=lambda s: _clip_by_norm(max_norm, p, eps, s, name),
    )


def clip_by_global_norm(
    max_norm: float, norm_type: float = 2.0, eps: float = 1e-7, *, name: str | None = None
) -> _engine.ClipTransform:
    """Clips updates to a maximum global p-norm, recording metrics in state.

    The p-norm is taken over all leaves (``norm_type`` any ``p > 0`` or
    ``inf``), accumulated in float32. If ``norm > |max_norm|`` every leaf is
    multiplied by ``|max_norm| / (norm + eps)`` (lucid's and torch's rule);
    otherwise updates pass unchanged. With ``eps=0`` and ``p=2`` this equals
    ``optax.clip_by_global_norm``, but reads the gradients once instead of
    several times: one scalar multiplier, no select, no full-size division.

    A non-finite norm leaves the updates unchanged and increments
    ``nonfinite_count`` (optax would produce NaNs; chain
    ``optax.apply_if_finite`` to drop such steps).

    Args:
      max_norm: the maximum norm; its absolute value is used.
      norm_type: the order p of the norm, ``> 0`` or ``float("inf")``.
      eps: added to the norm in the denominator.
      name: metrics prefix (default ``clip_by_global_norm``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose state records
      ``grad_norm``, ``scale``, ``clipped`` and the counters.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_by_global_norm(1.0)
      >>> g = {"w": jnp.array([3.0, 4.0])}
      >>> out, state = tx.update(g, tx.init(g))
      >>> [round(float(v), 4) for v in out["w"]]
      [0.6, 0.8]

    References:
      Pascanu et al., `On the difficulty of training recurrent neural networks
      <https://arxiv.org/abs/1211.5063>`_, 2013.
    """
    return _clip_by_norm(max_norm, norm_type, eps, "global", name)


def global_norm(tree: Any, norm_type: float = 2.0) -> jax.Array:
    """The p-norm of all leaves of ``tree`` (float32 accumulation; ``inf`` allowed).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> float(clipjax.global_norm({"a": jnp.array([3.0]), "b": jnp.array([4.0])}))
      5.0
    """
    p = _norm_type(norm_type)
    leaves, _, _ = _grouping.leaves_with_names(tree)
    grouping = _grouping.make_grouping(tree, "global")
    return _grouping.group_norms(leaves, grouping, p)[0]
