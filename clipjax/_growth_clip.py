"""Growth-capped clipping: torchzero's ``ClipNormGrowth`` and ``ClipNormByEMA`` (commit 2b6a228)."""

from __future__ import annotations

from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp

from clipjax import _checks, _grouping, _kit
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, SpikeFeedback
from clipjax._metrics import GroupInfo


class ClipNormGrowthState(NamedTuple):
    """State of :func:`clip_norm_growth`: the previous norm per group.

    Attributes:
      prev_norm: ``[groups]`` the norm the next step may grow from (``p``), 0
        before the group's first finite norm.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.clip_norm_growth().init({"w": jnp.zeros(3), "b": jnp.zeros(2)})
      >>> state.info.groups, state.prev_norm.shape
      (('b', 'w'), (2,))
    """

    prev_norm: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``prev_norm``."""
        return {"prev_norm": self.prev_norm}


def clip_norm_growth(
    add: float | None = None,
    mul: float | None = 1.5,
    min_value: float | None = 1e-4,
    max_decay: float | None = 2.0,
    *,
    scope: Scope = "per_param",
    feedback: SpikeFeedback = "clipped",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Caps how fast a gradient norm may grow from one step to the next (torchzero).

    Per group, with ``g`` its norm and ``p`` the previous norm (``prev_norm``)::

        first finite norm: not clipped; p <- max(g, min_value)
        T = min(p + add, p * mul)           (the terms given)
        scale = T / g  where g > T, else 1
        p <- min(g, T), or p / max_decay where g / p < 1 / max_decay;
             then max(p, min_value)

    ``p`` learns the clipped norm (``feedback="clipped"``, torchzero's), ``g``
    (``"raw"``) or nothing on a clipped step (``"skip"``). A non-finite norm
    passes unchanged. Differences from torchzero: :doc:`/defences`. A
    callable ``scope`` goes in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      add: the largest increment of the norm over ``p`` (``>= 0``), or None.
      mul: the largest growth factor over ``p`` (``> 0``), or None; one of
        ``add`` and ``mul`` is required.
      min_value: the floor of ``p`` (``> 0``), or None.
      max_decay: how much ``p`` may fall in a step (``>= 1``), or None.
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"per_param"``: ``tensorwise=True``.
      feedback: ``"clipped"`` (default), ``"raw"`` or ``"skip"``.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_norm_growth``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_norm_growth(mul=1.5, scope="global")
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 1.2, 10.0]:
      ...     out, state = tx.update({"w": jnp.array([g])}, state)
      >>> round(float(out["w"][0]), 4)  # at most 1.5 x 1.2
      1.8

    References:
      torchzero ``ClipNormGrowth`` (inikishev/torchzero,
      ``torchzero/modules/clipping/growth_clipping.py``, commit 2b6a228).
    """
    if add is None and mul is None:
        raise ValueError("add and mul are both None: give at least one growth bound (mul=1.5)")
    if add is not None:
        _checks.non_negative("add", add)
    if mul is not None:
        _checks.positive("mul", mul)
    if min_value is not None:
        _checks.positive("min_value", min_value)
    if max_decay is not None:
        _checks.check("max_decay", max_decay, lambda x: x >= 1, ">= 1")
    _checks.feedback(feedback, get_args(SpikeFeedback))

    setup = _kit.setup(
        "clip_norm_growth", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )

    def init_fn(params: Any) -> ClipNormGrowthState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        prev_norm = jnp.zeros((n,), dtype)
        metrics = _kit.norm_metrics(n, dtype)
        state = ClipNormGrowthState(
            prev_norm, metrics, common.info, common.leaf_index, common.leaf_metrics
        )
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ClipNormGrowthState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipNormGrowthState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, ClipNormGrowthState, init_fn)
        g, prev = grads.norm, state.prev_norm
        finite = jnp.isfinite(g)
        first = state.metrics["count"] == 0

        # The rule: the norm the step may reach from the last one.
        allowed = jnp.full_like(g, jnp.inf)
        if add is not None:
            allowed = prev + add
        if mul is not None:
            allowed = jnp.minimum(allowed, prev * mul)
        threshold = jnp.where(first, jnp.inf, allowed)
        fires = finite & (g > threshold)
        scale = jnp.where(fires, threshold / jnp.where(fires, g, 1.0), 1.0).astype(g.dtype)

        # What p learns: the clipped norm (torchzero's norm / denom), decayed by at
        # most max_decay (from the raw norm's ratio, as torchzero), floored.
        x, observed = _kit.observation(feedback, g, boundary=threshold, fires=fires)
        if max_decay is not None:
            decays = ~first & (g / prev < 1 / jnp.asarray(max_decay, g.dtype))
            x = jnp.where(decays, prev / max_decay, x)
        if min_value is not None:
            x = jnp.maximum(x, min_value)
        prev = jnp.where(observed, x, prev).astype(prev.dtype)

        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=observed, threshold=threshold, scale=scale
        )
        new_state = ClipNormGrowthState(
            prev, metrics, state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state)
        )
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as ClipNormGrowthState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


class ClipNormByEMAState(NamedTuple):
    """State of :func:`clip_norm_by_ema`: the EMA of the updates and its norm.

    Attributes:
      exp_avg: the EMA of the updates, a tree like the params (at least float32).
      ema_norm: ``[groups]`` the norm of ``exp_avg`` after the growth cap (``e``).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.clip_norm_by_ema().init({"w": jnp.zeros(3)})
      >>> state.exp_avg["w"].shape, state.ema_norm.shape
      ((3,), (1,))
    """

    exp_avg: Any
    ema_norm: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``ema_norm``."""
        return {"ema_norm": self.ema_norm}


def _ema_dtype(leaf: Any) -> Any:
    """The EMA's dtype: at least float32 (a bfloat16 EMA would lose the small steps)."""
    return jnp.promote_types(jnp.result_type(leaf), jnp.float32)


def clip_norm_by_ema(
    beta: float = 0.99,
    max_ema_growth: float | None = 1.5,
    init: float = 0.0,
    min_norm: float = 1e-6,
    *,
    scope: Scope = "per_param",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Clips each update's norm to the norm of an EMA of the updates, whose growth is capped.

    Per group, with ``u`` this step's update and ``g`` its norm::

        m <- m + (1 - beta) (u - m)            (m starts at init; a full-size EMA)
        e = |m|;  cap = max(growth * e_prev, min_norm)  (e_prev = e on the first step)
        m <- m / max(1, e / cap);  e <- min(e, cap);  e_prev <- e
        scale = min(1, e / g)

    The EMA sees each update before its own clip (torchzero's order); with
    ``init=0`` the first steps are clipped hard. A non-finite norm passes its
    group unchanged (:doc:`/defences`). A callable ``scope`` goes in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      beta: EMA decay, in (0, 1).
      max_ema_growth: the EMA norm's largest growth factor a step (``> 0``), or None.
      init: the EMA's initial value, every element.
      min_norm: the cap never falls below this (``>= 0``).
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"per_param"``: ``tensorwise=True``.
      axis_name: average the update and EMA norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_norm_by_ema``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_norm_by_ema(beta=0.5, scope="global")
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 1.0, 1.0]:
      ...     out, state = tx.update({"w": jnp.array([g])}, state)
      >>> float(out["w"][0])  # the EMA's norm: 0.5, 0.75, 0.875
      0.875

    References:
      torchzero ``ClipNormByEMA`` (inikishev/torchzero,
      ``torchzero/modules/clipping/ema_clipping.py``, commit 2b6a228).
    """
    _checks.open_unit("beta", beta)
    if max_ema_growth is not None:
        _checks.positive("max_ema_growth", max_ema_growth)
    _checks.check("init", init, lambda x: x == x, "a number")
    _checks.non_negative("min_norm", min_norm)

    setup = _kit.setup(
        "clip_norm_by_ema", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms
    )

    def init_fn(params: Any) -> ClipNormByEMAState:
        exp_avg = jax.tree.map(lambda p: jnp.full(jnp.shape(p), init, _ema_dtype(p)), params)
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        ema_norm = jnp.zeros((n,), dtype)
        metrics = _kit.norm_metrics(n, dtype)
        state = ClipNormByEMAState(
            exp_avg, ema_norm, metrics, common.info, common.leaf_index, common.leaf_metrics
        )
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ClipNormByEMAState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ClipNormByEMAState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, ClipNormByEMAState, init_fn)
        g, grouping = grads.norm, grads.grouping
        finite = jnp.isfinite(g)
        first = state.metrics["count"] == 0
        ema_leaves, ema_tree = jax.tree.flatten(state.exp_avg)

        # The EMA with this step's update (torch's lerp_), its norm, the growth cap.
        moved = [m + (1 - beta) * (u.astype(m.dtype) - m) for u, m in zip(grads.leaves, ema_leaves)]
        e = _grouping.group_norms(moved, grouping) if moved else jnp.zeros_like(g)
        if axis_name is not None:
            e = jax.lax.pmean(e, axis_name)
        e = e.astype(g.dtype)
        divisor = jnp.ones_like(e)
        if max_ema_growth is not None:
            cap = jnp.maximum(jnp.where(first, e, state.ema_norm) * max_ema_growth, min_norm)
            divisor = jnp.maximum(e / cap, 1.0)
            e = e / divisor
        divisor = jnp.where(finite, divisor, 1.0)
        kept = _grouping.leaf_scales(grouping, finite, state.leaf_index)
        shrink = _grouping.leaf_scales(grouping, 1.0 / divisor, state.leaf_index)
        exp_avg = [
            jnp.where(k, n * s.astype(n.dtype), m)
            for n, m, k, s in zip(moved, ema_leaves, kept, shrink)
        ]

        # torchzero's denom = max(g / max(e, tiny), 1): the update's norm at most e.
        floor = 2 * jnp.finfo(g.dtype).tiny
        threshold = jnp.maximum(e, floor)
        fires = finite & (g > threshold)
        scale = jnp.where(fires, threshold / jnp.where(fires, g, 1.0), 1.0).astype(g.dtype)

        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=finite, threshold=threshold, scale=scale
        )
        new_state = ClipNormByEMAState(
            jax.tree.unflatten(ema_tree, exp_avg), jnp.where(finite, e, state.ema_norm), metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as ClipNormByEMAState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
