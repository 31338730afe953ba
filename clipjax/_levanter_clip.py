"""``clip_by_historical_norm``: Levanter's clip at mean + k std of a window of past norms."""

from __future__ import annotations

from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp

from clipjax import _checks, _kit, _stats
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, SpikeFeedback
from clipjax._metrics import GroupInfo

# Levanter's floors: the std in the threshold, the norm in the scale's denominator.
STD_FLOOR = 1e-6
NORM_FLOOR = 1e-6


class HistoricalNormClipState(NamedTuple):
    """State of :func:`clip_by_historical_norm`: a window of norms per group.

    Attributes:
      window: ``[groups, rolling_interval_length]`` ring buffer of the observed norms.
      seen: ``int32[groups]`` norms ever written to the window.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.clip_by_historical_norm().init({"w": jnp.zeros(3)})
      >>> state.window.shape, state.info.groups
      ((1, 128), ('global',))
    """

    window: jax.Array
    seen: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]


def clip_by_historical_norm(
    rolling_interval_length: int | None = None,
    sigma_factor: float = 3.0,
    min_history: int | None = None,
    *,
    scope: Scope = "global",
    feedback: SpikeFeedback = "raw",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """Levanter's update clip: at mean + k std of the last norms, once half the window is full.

    Per group, with ``g`` the norm and the window the last
    ``rolling_interval_length`` observed norms (before this step)::

        T = mean + sigma_factor * max(std, 1e-6)   (population std of the window)
        scale = T / max(g, 1e-6)  where g > T and the window holds >= min_history norms
        then g enters the window

    Levanter places it after the optimizer, on the update; it clips gradients
    as well. ``feedback`` is what enters the window: the unclipped norm
    (``"raw"``, Levanter's), ``min(g, T)`` (``"clipped"``) or nothing on a
    clipped step (``"skip"``). Under ``"raw"`` a clipped spike's norm sits in
    the window and lifts the threshold, so a second, smaller spike in that
    time passes whole; ``feedback="clipped"`` is one argument away and
    catches it. A NaN or infinite norm passes unchanged and never enters the
    window. Why and how it differs from Levanter: :doc:`/defences`.

    Static arguments: ``rolling_interval_length`` (it sizes the window: name it in static_args);
    every other number may be injected.

    Args:
      rolling_interval_length: the window's length (an int ``>= 1``); default
        Levanter's 128.
      sigma_factor: how many standard deviations above the mean (``> 0``).
      min_history: norms in the window before any clip, an int in ``[1,
        rolling_interval_length]``; default Levanter's
        ``max(2, rolling_interval_length // 2)`` (so a window of length 1
        never clips unless ``min_history=1``).
      scope: the groups (:class:`~clipjax.ClipTransform`); ``"global"``: Levanter's.
      feedback: ``"raw"`` (default), ``"clipped"`` or ``"skip"``.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``clip_by_historical_norm``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.clip_by_historical_norm(8)
      >>> state = tx.init({"w": jnp.zeros(1)})
      >>> for g in [1.0, 1.1, 0.9, 1.0, 10.0]:
      ...     out, state = tx.update({"w": jnp.array([g])}, state)
      >>> round(float(out["w"][0]), 4)  # mean + 3 std of the first four
      1.2121

    References:
      Levanter ``clip_update_by_historical_norm`` (stanford-crfm/levanter,
      ``src/levanter/optim/clip_update_norm.py``, commit 9263f81).
    """
    if rolling_interval_length is None:
        rolling_interval_length = 128
    _checks.integer("rolling_interval_length", rolling_interval_length, 1)
    _checks.positive("sigma_factor", sigma_factor)
    given = min_history is not None
    if min_history is None:
        # Levanter's, even where it exceeds the window (length 1): its count, at
        # most the window's length, then never reaches it and nothing is clipped.
        min_history = max(2, rolling_interval_length // 2)
    _checks.integer("min_history", min_history, 1, static=False)
    concrete = _checks.concrete(min_history)
    if given and concrete is not None and concrete > rolling_interval_length:
        raise ValueError(
            f"min_history must be <= rolling_interval_length ({rolling_interval_length}), "
            f"got {min_history!r}"
        )
    _checks.feedback(feedback, get_args(SpikeFeedback))

    setup = _kit.setup(
        "clip_by_historical_norm",
        scope=scope,
        name=name,
        axis_name=axis_name,
        leaf_norms=leaf_norms,
    )

    def init_fn(params: Any) -> HistoricalNormClipState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        window = jnp.zeros((n, rolling_interval_length), dtype)
        seen = jnp.zeros((n,), jnp.int32)
        metrics = _kit.norm_metrics(n, dtype, ("mean", "std"))
        state = HistoricalNormClipState(
            window, seen, metrics, common.info, common.leaf_index, common.leaf_metrics
        )
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: HistoricalNormClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, HistoricalNormClipState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, HistoricalNormClipState, init_fn)
        g, window, seen = grads.norm, state.window, state.seen
        finite = jnp.isfinite(g)

        # The rule, from the window before this step (Levanter's jnp.mean/std over
        # its valid entries: population std).
        mean, std, held = _stats.ring_mean_std(window, seen, ddof=0)
        threshold = mean + sigma_factor * jnp.maximum(std, STD_FLOOR)
        threshold = jnp.where(held >= min_history, threshold, jnp.inf).astype(g.dtype)
        fires = finite & (g > threshold)
        scale = jnp.where(fires, threshold / jnp.maximum(g, NORM_FLOOR), 1.0).astype(g.dtype)

        # What the window learns.
        x, observed = _kit.observation(feedback, g, boundary=threshold, fires=fires)
        window, seen = _stats.ring_push(window, seen, x, observed)
        after_mean, after_std, _ = _stats.ring_mean_std(window, seen, ddof=0)

        metrics = _kit.step_metrics(
            state.metrics, norm=g, observed=observed, threshold=threshold, scale=scale,
            mean=after_mean, std=after_std,
        )  # fmt: skip
        new_state = HistoricalNormClipState(
            window, seen, metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as HistoricalNormClipState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
