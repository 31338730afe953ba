"""adagc: AdaGC, each group clipped against an EMA of its own clipped norms."""

from __future__ import annotations

from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp

from clipjax import _grouping, _kit, _validation
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo
from clipjax._types import SpikeFeedback


class AdaGCState(NamedTuple):
    """State of :func:`adagc`: ``gamma`` per group, then the shared fields.

    Attributes:
      gamma: ``[groups]`` EMA of the clipped norms (the minimum of the clipped
        norms during warm-up; +inf before the first observation).
      metrics: this step's metrics and the counters (``clipjax._kit``).
      info: static names (algorithm, prefix, groups, leaves).
      leaf_index: each leaf's group index, int32 scalars (empty for one group).
      leaf_metrics: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.adagc().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.AdaGCState), state.info.groups, state.gamma.shape
      (True, ('w',), (1,))
    """

    gamma: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``mean`` (``gamma``)."""
        return {"mean": self.gamma}


def adagc(
    relative_threshold: float = 1.05,
    beta: float = 0.98,
    warmup_steps: int = 100,
    absolute_threshold: float = 1.0,
    eps: float = 1e-6,
    scope: Scope = "per_param",
    *,
    feedback: SpikeFeedback = "clipped",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """AdaGC: clip each tensor against an EMA of its own clipped gradient norms.

    Per group ``i`` (each leaf by default), with ``g_i`` its gradient norm:

    * warm-up, the group's first ``warmup_steps`` finite norms: global
      clipping, ``h = min(1, absolute_threshold / (G + eps))`` with ``G`` the
      global norm (over the groups whose norm is finite), applied to every
      group; ``gamma_i <- min(gamma_i, h * g_i)``, ``gamma`` starting at +inf;
      the reported threshold is ``absolute_threshold``;
    * afterwards: ``T_i = relative_threshold * gamma_i`` (``gamma`` from before
      the step), ``scale_i = min(1, T_i / (g_i + eps))``, then
      ``gamma_i <- beta * gamma_i + (1 - beta) * scale_i * g_i``.

    The EMA absorbs the *clipped* norm (``feedback="clipped"``, the paper's
    rule), so a spike cannot raise its own threshold. ``feedback="raw"``
    absorbs ``g_i`` instead; ``feedback="skip"`` leaves ``gamma`` (and the
    group's ``count``) unchanged on a clipped step, which can hold the
    threshold at an old level after a lasting rise of the norm.

    AdaGC is a smoothing clip rather than a spike detector, and it follows a
    rise of the norm slowly: ``gamma`` grows by at most
    ``(1 - beta) * (relative_threshold - 1)`` per step (0.1% with the
    defaults), so a lasting x2 rise takes about 700 steps to learn. On the
    open-loop grid of ``python benchmarks/follow.py`` (one group) it clips
    about half the steps of a stationary stream with 5% noise (over 90% with 20%
    noise), and 99-100% of the steps from 120 to 400 steps after a lasting
    rise of x2 to x10, while every x10 spike leaves at about the level (at most 1.12x).

    A non-finite group norm passes that group through unchanged (scale 1),
    never enters ``gamma`` and increments ``nonfinite_count``; chain
    ``optax.apply_if_finite`` to drop such steps.

    Static arguments: none; every number may be injected or scheduled with
    ``optax.inject_hyperparams``, with no ``static_args``; a callable ``scope``
    goes in ``static_args`` (inject_hyperparams would call it as a schedule).

    Args:
      relative_threshold: ``T_i / gamma_i`` (``> 0``; the paper uses 1.05).
      beta: EMA decay of ``gamma``, in (0, 1).
      warmup_steps: finite norms of global clipping per group (``>= 0``).
      absolute_threshold: the global-norm bound during warm-up (``> 0``).
      eps: added to the norms in the denominators (``>= 0``).
      scope: ``"per_param"`` (the paper's per-tensor rule), ``"per_layer"``,
        ``"global"`` or a callable ``(path, leaf) -> str``.
      feedback: ``"clipped"`` (default), ``"raw"`` or ``"skip"``.
      axis_name: average the group norms over this mapped axis first, so
        every replica applies the same scale.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``adagc``).

    Returns:
      A :class:`~clipjax.ClipTransform`; metrics per group:
      ``grad_norm``, ``threshold``, ``scale``, ``clipped``, ``mean`` (``gamma``
      after the update) and the counters ``count``, ``step``,
      ``clipped_count``, ``nonfinite_count``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = optax.chain(clipjax.adagc(warmup_steps=2, absolute_threshold=5.0), optax.sgd(0.1))
      >>> params = {"w": jnp.zeros(2), "b": jnp.zeros(1)}
      >>> state = tx.init(params)
      >>> for x in [0.5, 0.6, 0.55, 5.0]:
      ...     _, state = tx.update({"w": jnp.array([x, 0.0]), "b": jnp.ones(1)}, state)
      >>> m = clipjax.metrics(state)
      >>> bool(m["adagc/w/clipped"]), bool(m["adagc/b/clipped"])
      (True, False)
      >>> round(float(m["adagc/w/threshold"]), 4)
      0.5255

    References:
      Wang et al., `Adaptive Gradient Clipping for Robust Large Language Model
      Pre-training <https://arxiv.org/abs/2502.11034>`_, 2025.
    """
    settings = dict(locals())
    _validation.positive("relative_threshold", relative_threshold)
    _validation.open_unit("beta", beta)
    _validation.integer("warmup_steps", warmup_steps, static=False)
    _validation.positive("absolute_threshold", absolute_threshold)
    _validation.non_negative("eps", eps)
    _kit.check_feedback(feedback, get_args(SpikeFeedback))
    _grouping.validate_scope(scope)
    _kit.check_name(name)

    def arrays(num_groups: int, dtype: Any = jnp.float32) -> dict[str, Any]:
        return {
            "gamma": jnp.full((num_groups,), jnp.inf, dtype),
            "metrics": _kit.metric_arrays(num_groups, dtype, ()),
        }

    layout = _kit.layout_of(arrays)

    def init_fn(params: Any) -> Any:
        start = _kit.start(params, scope, "adagc", name, leaf_norms)
        return _kit.new_state(AdaGCState, start, arrays(start.num_groups, start.dtype))

    def update_fn(
        updates: Any, state: AdaGCState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AdaGCState]:
        del params, extra_args
        grads = _kit.group_norms(
            updates, state, AdaGCState, layout, who=name or "adagc", scope=scope,
            axis_name=axis_name, leaf_norms=leaf_norms,
        )  # fmt: skip
        g, gamma, count = grads.norm, state.gamma, state.metrics["count"]
        finite = jnp.isfinite(g)
        warming = count < warmup_steps

        # The rule: one global clip in warm-up, then each group against its gamma.
        total = jnp.sqrt(jnp.sum(jnp.where(finite, g * g, 0.0)))
        global_scale = jnp.minimum(1.0, absolute_threshold / (total + eps))
        threshold = relative_threshold * gamma
        relative_scale = jnp.minimum(1.0, threshold / (g + eps))
        scale = jnp.where(warming, global_scale, relative_scale)
        scale = jnp.where(finite, scale, 1.0).astype(g.dtype)
        fires = ~warming & (relative_scale < 1) & finite

        # What gamma learns: the clipped norm (feedback="clipped": a spike
        # teaches no more than the threshold); its minimum during warm-up.
        x, observed = _kit.observation(
            feedback,
            jnp.where(warming, global_scale * g, g),
            boundary=relative_scale * g,
            target=None,
            fires=fires,
        )
        observed = observed & finite
        ema = beta * gamma + (1 - beta) * x
        # Without warm-up, gamma starts at the first norm rather than staying +inf.
        starting = warming | jnp.isinf(gamma)
        gamma = jnp.where(observed, jnp.where(starting, jnp.minimum(gamma, x), ema), gamma)

        metrics = _kit.step_metrics(
            state.metrics,
            norm=g,
            threshold=jnp.where(warming, jnp.asarray(absolute_threshold, g.dtype), threshold),
            scale=scale,
            observed=observed,
        )
        new_state = state._replace(gamma=gamma, **_kit.shared_fields(state, grads, metrics))
        return _kit.scaled(grads, scale, state), new_state

    # optax types a state as OptState (an array tree), not as AdaGCState.
    tx = ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
    tx.configure = lambda **overrides: adagc(**{**settings, **overrides})
    return tx
