"""adagc: AdaGC, each group clipped against an EMA of its own clipped norms."""

from __future__ import annotations

from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp

from clipjax import _checks, _grouping, _kit
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, SpikeFeedback
from clipjax._metrics import GroupInfo


class AdaGCState(NamedTuple):
    """State of :func:`adagc`: ``gamma`` per group.

    Attributes:
      gamma: ``[groups]`` EMA of the clipped norms (the minimum of the clipped
        norms during warm-up; +inf before the first observation).

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
    *,
    scope: Scope = "per_param",
    feedback: SpikeFeedback = "clipped",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """AdaGC: clip each tensor against an EMA of its own clipped gradient norms.

    Per group ``i`` (each leaf by default), with ``g_i`` its gradient norm:

    * warm-up, the group's first ``warmup_steps`` finite norms: global
      clipping, ``h = min(1, absolute_threshold / (G + eps))`` with ``G`` the
      global norm, applied to every group; ``gamma_i <- min(gamma_i, h * g_i)``,
      ``gamma`` starting at +inf;
    * afterwards: ``T_i = relative_threshold * gamma_i`` (``gamma`` from before
      the step), ``scale_i = min(1, T_i / (g_i + eps))``, then
      ``gamma_i <- beta * gamma_i + (1 - beta) * scale_i * g_i``.

    The EMA absorbs the clipped norm (``feedback="clipped"``, the paper's),
    ``g_i`` (``"raw"``) or nothing on a clipped step (``"skip"``); see
    :doc:`/reference_adagc`. A non-finite group norm passes unchanged. A
    callable ``scope`` goes in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      relative_threshold: ``T_i / gamma_i`` (``> 0``; the paper uses 1.05).
      beta: EMA decay of ``gamma``, in (0, 1).
      warmup_steps: finite norms of global clipping per group (``>= 0``).
      absolute_threshold: the global-norm bound during warm-up (``> 0``).
      eps: added to the norms in the denominators (``>= 0``).
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"per_param"``: the paper's.
      feedback: ``"clipped"`` (default), ``"raw"`` or ``"skip"``.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``adagc``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

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
    _checks.positive("relative_threshold", relative_threshold)
    _checks.open_unit("beta", beta)
    _checks.integer("warmup_steps", warmup_steps, static=False)
    _checks.positive("absolute_threshold", absolute_threshold)
    _checks.non_negative("eps", eps)
    _checks.feedback(feedback, get_args(SpikeFeedback))

    setup = _kit.setup("adagc", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms)

    def init_fn(params: Any) -> AdaGCState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        gamma = jnp.full((n,), jnp.inf, dtype)
        metrics = _kit.norm_metrics(n, dtype)
        state = AdaGCState(gamma, metrics, common.info, common.leaf_index, common.leaf_metrics)
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: AdaGCState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, AdaGCState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, AdaGCState, init_fn)
        g, gamma, count = grads.norm, state.gamma, state.metrics["count"]
        finite = jnp.isfinite(g)
        warming = count < warmup_steps

        # The rule: one global clip in warm-up, then each group against its gamma.
        total = _grouping.vector_norm(jnp.where(finite, g, 0.0))
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
            observed=observed,
            threshold=jnp.where(warming, jnp.asarray(absolute_threshold, g.dtype), threshold),
            scale=scale,
        )
        new_state = AdaGCState(
            gamma, metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as AdaGCState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
