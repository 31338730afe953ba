"""zscore_clip: smartclip's ZScoreClip, observe then clip."""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.core import Tracer

from clipjax import _checks, _kit, _metrics, _stats
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, Feedback
from clipjax._metrics import GroupInfo

# The EMAs' decay under judge-first feedback: smartclip's 0.99 remembers a
# level for hundreds of steps, so after a lasting drop of the norm its std stays
# wide and spikes pass at several times the new level; 0.97 forgets within
# about a hundred (measured by benchmarks/follow.py).
JUDGE_FIRST_DECAY = 0.97


class ZScoreClipState(NamedTuple):
    """State of :func:`zscore_clip`: its EMA moments per group.

    Attributes:
      moments: the EMAs of the observed norms, ``count``, ``mean`` and ``var``
        (:class:`clipjax._stats.EmaMomentsState`).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zscore_clip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZScoreClipState), state.info.groups
      (True, ('global',))
      >>> state.moments.mean.shape
      (1,)
    """

    moments: _stats.EmaMomentsState
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]

    def statistics(self) -> dict[str, Any]:
        """The statistics :func:`clipjax.metrics` reports: ``mean`` and ``std``."""
        return {"mean": self.moments.mean, "std": _std(self.moments.var)}


def _std(var: Any) -> Any:
    """``sqrt(max(var, 0))``: NumPy's on a value that can be read here, jax's inside ``jit``."""
    var = _metrics.unwrap(var)
    if isinstance(var, Tracer) or (isinstance(var, jax.Array) and not var.is_fully_addressable):
        return jnp.sqrt(jnp.maximum(var, 0))
    return np.sqrt(np.maximum(np.asarray(var), 0))


def zscore_clip(
    zmax: float = 3.0,
    ema_decay: float | None = None,
    *,
    scope: Scope = "global",
    warmup_steps: int | None = None,
    min_history: int | None = None,
    eps: float = 1e-8,
    guard_nans: bool = True,
    feedback: Feedback = "observe_first",
    max_grad_norm: float | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clip norms more than ``zmax`` EMA standard deviations above the EMA mean.

    Per step and group, with ``g`` the norm (smartclip's ``ZScoreClip`` under
    the default ``feedback="observe_first"``)::

        observe g (floored at eps) into EMAs m of x and x**2, no bias correction
        T = max(eps, m + zmax std)
        scale = min(1, T / (g + eps))  once the group's gate is open, else 1
        scale = min(scale, max_grad_norm / (g + 1e-6))  where g > max_grad_norm

    The gate opens at ``max(warmup_steps, min_history)`` finite observations.
    ``feedback="observe_first"`` observes ``g`` before its own threshold; the
    others judge ``g`` first, then observe ``g`` (``"raw"``), ``min(g, T)``
    (``"clipped"``) or nothing on a clipped step (``"skip"``). A non-finite
    norm passes unchanged and is never observed. Where this differs from
    smartclip: :doc:`/reference_smartclip`. A callable ``scope`` goes in
    ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      zmax: z-score above which norms are clipped (``> 0``).
      ema_decay: decay of the EMAs, in (0, 1). None (default) means
        smartclip's 0.99 under ``"observe_first"`` and 0.97 otherwise.
      scope: the groups (:class:`~clipjax.ClipTransform`), each with its statistics and gate.
      warmup_steps: the finite norms a group observes before it may be
        clipped; default 100 under ``"observe_first"``, 10 otherwise.
      min_history: a second such bound, the larger opening the gate; default
        50 under ``"observe_first"``, 10 otherwise.
      eps: the threshold's floor, also added to the norm in the scale (``> 0``).
      guard_nans: True (default) keeps non-finite norms out of the EMAs;
        False lets them in as smartclip does (a NaN as ``eps``).
      feedback: ``"observe_first"`` (default), ``"raw"``, ``"clipped"`` or ``"skip"``.
      max_grad_norm: an absolute ceiling or None; ``"auto"`` (default) is 1.0
        under ``feedback="clipped"``, none otherwise.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``zscore_clip``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose state is a :class:`ZScoreClipState`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.zscore_clip(warmup_steps=3, min_history=3)
      >>> g = lambda x: {"w": jnp.array([x])}
      >>> state = tx.init(g(0.0))
      >>> for x in [1.0, 1.2, 0.8, 1.1, 30.0]:
      ...     out, state = tx.update(g(x), state)
      >>> float(out["w"][0]) < 30.0
      True

    References:
      smartclip ``ZScoreClip`` (PyPI ``smartclip``).
    """
    _checks.positive("zmax", zmax)
    _checks.feedback(feedback, ("observe_first", "raw", "clipped", "skip"))
    ceiling = _kit.resolve_ceiling(max_grad_norm, feedback)
    if ema_decay is None:
        ema_decay = 0.99 if feedback == "observe_first" else JUDGE_FIRST_DECAY
    _checks.open_unit("ema_decay", ema_decay)
    warmup_steps, min_history = _kit.gate_defaults(feedback, warmup_steps, min_history)
    _checks.integer("warmup_steps", warmup_steps, static=False)
    _checks.integer("min_history", min_history, static=False)
    _checks.positive("eps", eps)
    observe_first = feedback == "observe_first"
    gate = jnp.maximum(warmup_steps, min_history)

    setup = _kit.setup(
        "zscore_clip", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )

    def init_fn(params: Any) -> ZScoreClipState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        fields = () if ceiling is None else ("headroom",)
        metrics = _kit.norm_metrics(n, dtype, fields, spike=True, ceiling=ceiling is not None)
        state = ZScoreClipState(
            _stats.ema_moments_init(n, dtype), metrics,
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def observe(moments: _stats.EmaMomentsState, x: jax.Array) -> _stats.EmaMomentsState:
        """The EMAs after one observation per group, floored at ``eps``."""
        return _stats.ema_moments_update(moments, _stats.positive_part(x, eps), ema_decay)

    def threshold_of(moments: _stats.EmaMomentsState) -> jax.Array:
        return jnp.maximum(eps, moments.mean + zmax * _stats.ema_moments_std(moments))

    def update_fn(
        updates: Any, state: ZScoreClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ZScoreClipState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, ZScoreClipState, init_fn)
        g = grads.norm
        finite = jnp.isfinite(g)
        count = state.metrics["count"]  # the group's observations before this step
        before = state.moments

        if observe_first:
            # smartclip's order: the norm enters the EMAs, then its threshold
            # is read from them; the gate counts this observation.
            gate_open = count + 1 >= gate
            x, observed = _kit.observation(feedback, g, guard_nans=guard_nans)
            moments = _kit.select_groups(observed, observe(before, x), before)
            threshold = threshold_of(moments)
            scale = jnp.minimum(1.0, threshold / (g + eps))
        else:
            # Judged by the EMAs before the step (none yet: +inf), then observed.
            gate_open = count >= jnp.maximum(gate, 1)
            threshold = jnp.where(count == 0, jnp.inf, threshold_of(before))
            scale = jnp.minimum(1.0, threshold / (g + eps))
            fires = (scale < 1) & gate_open & finite
            x, observed = _kit.observation(
                feedback, g, boundary=threshold, fires=fires, guard_nans=guard_nans
            )
            moments = _kit.select_groups(observed, observe(before, x), before)
        scale = jnp.where(finite & gate_open, scale, 1.0).astype(g.dtype)
        spike = scale < 1  # the rule's own decision, before any ceiling
        capped = None
        if ceiling is not None:
            scale, capped = _kit.ceiling_scale(scale, g, ceiling)
            threshold = jnp.where(gate_open, jnp.minimum(threshold, ceiling), ceiling)

        more = {} if ceiling is None else {"headroom": _kit.headroom(ceiling, moments.mean)}
        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=observed, threshold=threshold, scale=scale,
            spike=spike, capped=capped, **more,
        )  # fmt: skip
        new_state = ZScoreClipState(
            moments, metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as ZScoreClipState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
