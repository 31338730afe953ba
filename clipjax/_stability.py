"""``stability_monitor``: OLMo-core's spike score, as a pass-through optax transform."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _grouping, _kit
from clipjax._metrics import GroupInfo
from clipjax._skip_on_spike import norm_and_loss
from clipjax._stats import ring_mean_std, ring_push

ALGO = "stability_monitor"
# OLMo-core's guard: a window whose std is below this judges no spike.
MIN_STD = 1e-10


class StabilityMonitorState(NamedTuple):
    """State of :func:`stability_monitor`.

    Attributes:
      grad_norm_window: ``float32[window_size]`` ring buffer of the last finite
        global gradient norms.
      value_window: ``float32[window_size]`` the same for the losses.
      grad_norm_seen: ``int32`` norms ever written to ``grad_norm_window``.
      value_seen: ``int32`` the same for ``value_window``.
      spike_window: ``bool[rolling_window]`` ring buffer of the last steps'
        spike flags, written at slot ``step % rolling_window``.
      spikes_in_window: ``int32`` how many of ``spike_window`` are True.
      metrics: ``[1]``-shaped arrays (group ``global``): ``grad_norm``,
        ``value``, ``grad_norm_spike``, ``value_spike``, ``spike``,
        ``spike_score``, ``spike_score_total``, ``spike_count``, ``step`` and
        ``nonfinite_count``.
      info: static names, ``GroupInfo(algo="stability_monitor", ...)``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.stability_monitor().init({"w": jnp.zeros(3)})
      >>> state.spike_window.shape, state.info.groups
      ((10000,), ('global',))
    """

    grad_norm_window: jax.Array
    value_window: jax.Array
    grad_norm_seen: jax.Array
    value_seen: jax.Array
    spike_window: jax.Array
    spikes_in_window: jax.Array
    metrics: dict[str, jax.Array]
    info: GroupInfo


def _judged(
    x: jax.Array, window: jax.Array, seen: jax.Array, threshold_std: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(spike, window, seen)``: whether ``x`` spikes against the window, and the
    window with ``x`` written where it is finite.

    OLMo-core's rule: a spike needs a full window and ``x > mean +
    threshold_std * std`` (population std, at least ``MIN_STD``). A NaN or Inf
    is a spike and never enters the window (OLMo-core appends it, and then
    judges nothing while it is held: a deliberate deviation).
    """
    mean, std, held = ring_mean_std(window, seen, ddof=0)
    threshold = mean + jnp.asarray(threshold_std, window.dtype) * std
    finite = jnp.isfinite(x)
    spike = ~finite | ((held >= window.shape[-1]) & (std >= MIN_STD) & (x > threshold))
    window, seen = ring_push(window, seen, x, finite)
    return spike, window, seen


def stability_monitor(
    window_size: int | None = None,
    rolling_window: int | None = None,
    threshold_std: float = 6.0,
    *,
    axis_name: str | None = None,
    name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Scores a run's stability: the share of recent steps whose loss or gradient norm spikes.

    Passes the updates through unchanged (the same arrays) and records, in its
    state, OLMo-core's ``StabilityMonitorCallback`` score. Each step the
    global L2 norm ``g`` of the updates and the loss (``update(...,
    value=loss)``, optional) are each a **spike** when the previous
    ``window_size`` finite values of it fill its window and the value exceeds
    ``mean + threshold_std * std`` (population std; none while ``std <
    1e-10``); a NaN or Inf is a spike and stays out of the window. A step
    spikes when either does. ``spike_score`` is the spikes among the last
    ``rolling_window`` steps over ``rolling_window`` (NaN until that many
    steps), ``spike_score_total`` all spikes over all steps (NaN until
    ``window_size`` steps). Chain it first, to see the raw gradients.

    Static arguments: ``window_size`` and ``rolling_window`` (they size the
    buffers); ``threshold_std`` may be injected.

    Args:
      window_size: values each spike test is judged against (``>= 1``);
        default 128.
      rolling_window: steps ``spike_score`` covers (``>= 1``); default 10000.
      threshold_std: how many standard deviations above the mean is a spike (> 0).
      axis_name: under ``pmap``/``shard_map``, the mapped axis the norm and the
        loss are averaged over, so every replica records the same score.
      name: metrics prefix (default ``stability_monitor``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update(updates,
      state, params=None, *, value=None, **extra_args)`` returns ``updates``
      themselves; its state is a :class:`StabilityMonitorState`, read with
      ``clipjax.metrics(state)["stability_monitor/global/spike_score"]``.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> monitor = clipjax.stability_monitor(window_size=4, rolling_window=5)
      >>> tx = optax.chain(monitor, optax.sgd(0.1))
      >>> params = {"w": jnp.ones(2)}
      >>> state = tx.init(params)
      >>> for loss in [1.0, 1.1, 0.9, 1.0, 50.0]:
      ...     updates, state = tx.update({"w": jnp.ones(2)}, state, params, value=loss)
      >>> m = clipjax.metrics(state)
      >>> bool(m["stability_monitor/global/value_spike"])
      True
      >>> round(float(m["stability_monitor/global/spike_score"]), 6)  # 1 spike in 5 steps
      0.2

    References:
      OLMo-core ``StabilityMonitorCallback`` (allenai/OLMo-core,
      ``src/olmo_core/train/callbacks/stability_monitor.py``).
    """
    window_size = 128 if window_size is None else window_size
    rolling_window = 10000 if rolling_window is None else rolling_window
    _checks.integer("window_size", window_size, 1)
    _checks.integer("rolling_window", rolling_window, 1)
    _checks.positive("threshold_std", threshold_std)
    _checks.name(name)
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")
    who = name or ALGO

    def init_fn(params: Any) -> StabilityMonitorState:
        return StabilityMonitorState(
            grad_norm_window=jnp.zeros((window_size,), jnp.float32),
            value_window=jnp.zeros((window_size,), jnp.float32),
            grad_norm_seen=jnp.zeros((), jnp.int32),
            value_seen=jnp.zeros((), jnp.int32),
            spike_window=jnp.zeros((rolling_window,), bool),
            spikes_in_window=jnp.zeros((), jnp.int32),
            metrics=_initial_metrics(),
            info=_kit.group_info(params, "global", ALGO, name),
        )

    def update_fn(
        updates: Any,
        state: StabilityMonitorState,
        params: Any = None,
        *,
        value: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, StabilityMonitorState]:
        del params, extra_args
        _checks.check_state(state, StabilityMonitorState, who)
        grouping = _grouping.make_grouping(updates, "global")
        grouping.check_matches(state.info.leaves, state.info.shapes, who)
        norm, loss = norm_and_loss(updates, value, axis_name, who)

        norm_spike, grad_norm_window, grad_norm_seen = _judged(
            norm, state.grad_norm_window, state.grad_norm_seen, threshold_std
        )
        finite = jnp.isfinite(norm)
        if value is not None:
            value_spike, value_window, value_seen = _judged(
                loss, state.value_window, state.value_seen, threshold_std
            )
            finite = finite & jnp.isfinite(loss)
        else:
            # No loss this step: only the norm is judged, as OLMo-core does
            # when the loss metric is absent.
            value_spike = jnp.zeros((), bool)
            value_window, value_seen = state.value_window, state.value_seen
        spike = norm_spike | value_spike

        # One slot of the (long) spike window read and written per step, in place,
        # and its count kept: no pass over rolling_window flags.
        step = state.metrics["step"][0]
        slot = step % rolling_window
        evicted = jax.lax.dynamic_index_in_dim(state.spike_window, slot, keepdims=False)
        spike_window = jax.lax.dynamic_update_index_in_dim(state.spike_window, spike, slot, axis=0)
        spikes_in_window = state.spikes_in_window + spike.astype(jnp.int32) - evicted
        steps = step + 1
        spike_count = state.metrics["spike_count"] + spike.astype(jnp.int32)
        spike_score = jnp.where(
            steps >= rolling_window,
            spikes_in_window.astype(jnp.float32) / rolling_window,
            jnp.nan,
        )
        spike_score_total = jnp.where(
            steps >= window_size, spike_count.astype(jnp.float32) / steps, jnp.nan
        )

        metrics = _kit.step_metrics(
            state.metrics,
            norm=norm.reshape(1),
            finite=finite.reshape(1),
            value=loss.reshape(1),
            grad_norm_spike=norm_spike.reshape(1),
            value_spike=value_spike.reshape(1),
            spike=spike.reshape(1),
            spike_score=spike_score.reshape(1),
            spike_score_total=spike_score_total.reshape(1),
            spike_count=spike_count,
        )
        new_state = StabilityMonitorState(
            grad_norm_window=grad_norm_window,
            value_window=value_window,
            grad_norm_seen=grad_norm_seen,
            value_seen=value_seen,
            spike_window=spike_window,
            spikes_in_window=spikes_in_window,
            metrics=metrics,
            info=state.info,
        )
        return updates, new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def _initial_metrics() -> dict[str, jax.Array]:
    fields = ("grad_norm", "value", "grad_norm_spike", "value_spike", "spike", "spike_score")
    counters = ("spike_count", "step", "nonfinite_count")
    nan = dict(grad_norm=jnp.nan, value=jnp.nan, spike_score=jnp.nan, spike_score_total=jnp.nan)
    return _kit.new_metrics(1, jnp.float32, (*fields, "spike_score_total"), counters, **nan)
