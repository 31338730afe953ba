"""ZClip: z-score spike detection on EMA statistics, clip then observe."""

from __future__ import annotations

import math
from typing import Any, Literal, NamedTuple, cast, get_args

import jax
import jax.numpy as jnp

from clipjax import _checks, _kit, _metrics, _stats
from clipjax._grouping import Scope
from clipjax._kit import ClipTransform, TargetFeedback
from clipjax._metrics import GroupInfo

ZClipMode = Literal["zscore", "percentile"]
ClipOption = Literal["adaptive_scaling", "mean"]
StartRule = Literal["hold", "weight"]

# zclip's fixed guard in the applied multiplier, T / (g + 1e-6).
_DIV_EPS = 1e-6


def _zscore(deviation: jax.Array, spread: jax.Array) -> jax.Array:
    """``deviation / spread``; where the spread is 0, +inf above the mean and 0 otherwise."""
    safe = jnp.where(spread > 0, spread, 1.0)
    return jnp.where(spread > 0, deviation / safe, jnp.where(deviation > 0, jnp.inf, 0.0))


class ZClipState(NamedTuple):
    """State of :func:`zclip`: its statistics per group.

    Attributes:
      mean: ``[groups]`` EMA of the observed norms.
      var: ``[groups]`` EMA variance.
      sample: the warm-up sample's running sums, ``[groups]`` each.
      window: the last ``ceiling_window`` positive finite norms, with a sorted
        copy (None without a relative ceiling).
      low: ``[groups]`` the smallest positive finite norm so far (None without
        a relative ceiling).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> state = clipjax.zclip().init({"w": jnp.zeros((3, 2))})
      >>> isinstance(state, clipjax.ZClipState), state.info.groups, state.mean.shape
      (True, ('global',), (1,))
    """

    mean: jax.Array
    var: jax.Array
    sample: _stats.SampleState
    window: _stats.WindowState | None
    low: jax.Array | None
    metrics: dict[str, jax.Array]
    info: GroupInfo
    leaf_index: tuple[jax.Array, ...]
    leaf_metrics: dict[str, jax.Array]

    def statistics(self) -> dict[str, jax.Array]:
        """The statistics :func:`clipjax.metrics` reports: ``mean`` and ``std``."""
        return {"mean": self.mean, "std": _metrics.sqrt(self.var)}


def _rule(
    state: ZClipState, g: jax.Array, relative: bool, *, eps: Any, z_thresh: Any, mode: str,
    clip_option: str, clip_factor: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """``(z, B, spike, clip_val)`` from the statistics before the step."""
    std = jnp.sqrt(state.var)
    guard = eps * state.mean if relative else eps
    z = _zscore(g - state.mean, std + guard) if relative else (g - state.mean) / (std + eps)
    if mode == "percentile":
        boundary = state.mean + z_thresh * std
        return z, boundary, g > boundary, boundary
    boundary = state.mean + z_thresh * (std + guard)
    spike = z > z_thresh
    if clip_option == "mean":
        return z, boundary, spike, state.mean
    # Only read where spike (z > z_thresh > 0), so z is never 0 there.
    safe_z = jnp.where(spike, z, 1.0)
    return z, boundary, spike, clip_factor * (state.mean + z_thresh**2 * std / safe_z)


def _checked(
    alpha: Any,
    z_thresh: Any,
    max_grad_norm: Any,
    eps: Any,
    warmup_steps: Any,
    mode: Any,
    clip_option: Any,
    clip_factor: Any,
    skip_update_on_spike: bool,
    feedback: Any,
    relative_ceiling: Any,
    ceiling_window: Any,
) -> tuple[ClipOption, float, TargetFeedback, Any, Any]:
    """Validates zclip's arguments; returns them with their defaults filled in."""
    _checks.open_unit("alpha", alpha)
    _checks.positive("z_thresh", z_thresh)
    _checks.non_negative("eps", eps)
    _checks.integer("warmup_steps", warmup_steps, minimum=1, static=False)
    _checks.choice("mode", mode, ("zscore", "percentile"))
    if mode == "percentile" and clip_option is not None:
        raise ValueError(
            f'clip_option={clip_option!r} has no effect with mode="percentile", which '
            "clips to its boundary mean + z_thresh * std; leave clip_option out"
        )
    if clip_factor is not None and (mode == "percentile" or clip_option == "mean"):
        raise ValueError(
            f"clip_factor={clip_factor!r} has no effect with mode={mode!r}"
            + ("" if clip_option is None else f", clip_option={clip_option!r}")
            + ": it scales adaptive_scaling's clip value only; leave clip_factor out"
        )
    clip_option = "adaptive_scaling" if clip_option is None else clip_option
    clip_factor = 1.0 if clip_factor is None else clip_factor
    _checks.choice("clip_option", clip_option, ("adaptive_scaling", "mean"))
    _checks.positive("clip_factor", clip_factor)
    _checks.feedback(feedback, get_args(TargetFeedback))
    if skip_update_on_spike:
        if feedback not in ("clip_target", "skip"):
            raise ValueError(
                f'skip_update_on_spike=True is feedback="skip"; it conflicts with '
                f"feedback={feedback!r}"
            )
        feedback = "skip"
    max_grad_norm, relative_ceiling = _ceilings(max_grad_norm, relative_ceiling, feedback)
    if ceiling_window is not None:
        _checks.integer("ceiling_window", ceiling_window, minimum=1)
    # clip_factor stays as given: a traced value under inject_hyperparams.
    return (
        cast(ClipOption, clip_option),
        cast(float, clip_factor),
        cast(TargetFeedback, feedback),
        max_grad_norm,
        relative_ceiling,
    )


def _start(start: Any, relative: bool) -> StartRule | None:
    """The start rule, ``"auto"`` resolved: ``"hold"`` with a relative ceiling, else None."""
    if start == "auto":
        return "hold" if relative else None
    if start is not None:
        _checks.choice("start", start, ("hold", "weight"))
    return cast("StartRule | None", start)


# The relative ceiling of feedback="clipped": a multiple of the run's own level.
DEFAULT_RELATIVE_CEILING = 1.5
# ... over the median of this many norms (None: this; a shape, so not injected).
DEFAULT_CEILING_WINDOW = 100


def _ceilings(max_grad_norm: Any, relative_ceiling: Any, feedback: str) -> tuple[Any, Any]:
    """``(max_grad_norm, relative_ceiling)`` with ``"auto"`` resolved (see :func:`zclip`'s Args)."""
    for name, value in (("max_grad_norm", max_grad_norm), ("relative_ceiling", relative_ceiling)):
        if isinstance(value, str) and value != "auto":
            raise ValueError(f'{name} must be a positive number, None or "auto", got {value!r}')
    scale_free = feedback == "clipped"
    if max_grad_norm == "auto":
        max_grad_norm = None if scale_free else _kit.DEFAULT_CEILING
    if relative_ceiling == "auto":
        relative_ceiling = (
            DEFAULT_RELATIVE_CEILING if scale_free and max_grad_norm is None else None
        )
    if max_grad_norm is not None:
        _checks.positive("max_grad_norm", max_grad_norm)
    if relative_ceiling is not None:
        _checks.check(
            "relative_ceiling", relative_ceiling, lambda x: x > 1, "> 1 (a multiple of the level)"
        )
    return max_grad_norm, relative_ceiling


def zclip(
    alpha: float = 0.97,
    z_thresh: float = 2.5,
    max_grad_norm: float | Literal["auto"] | None = "auto",
    eps: float = 1e-6,
    warmup_steps: int = 25,
    mode: ZClipMode = "zscore",
    clip_option: ClipOption | None = None,
    clip_factor: float | None = None,
    skip_update_on_spike: bool = False,
    *,
    scope: Scope = "global",
    feedback: TargetFeedback = "clip_target",
    relative_ceiling: float | Literal["auto"] | None = "auto",
    ceiling_window: int | None = None,
    start: StartRule | Literal["auto"] | None = "auto",
    axis_name: str | None = None,
    leaf_norms: bool = False,
    name: str | None = None,
) -> ClipTransform:
    """ZClip: clip a gradient norm that stands out from EMA statistics of the norms before it.

    Per group, with ``g`` the norm and ``mean``, ``std`` the statistics before
    the step (clip, then observe)::

        warm-up (the first warmup_steps finite norms): collected, clipped only
            at the ceiling; the last one sets mean and var to the sample's
        z = (g - mean) / (std + eps)
        zscore mode:     spike when z > z_thresh (g > B = mean + z_thresh (std + eps));
                         clip_val = clip_factor (mean + z_thresh**2 std / z)  (adaptive_scaling)
                                  = mean                                      (clip_option="mean")
        percentile mode: spike when g > B = mean + z_thresh std;  clip_val = B
        T = min(clip_val if spike else g, ceiling);  scale = T / (g + 1e-6) if g > T
        mean <- alpha mean + (1 - alpha) v;  var <- alpha var + (1 - alpha) (v - mean)**2

    ``feedback`` sets ``v``: ``clip_val`` on a spike (``"clip_target"``, the
    reference's), ``min(g, B)`` (``"clipped"``), ``g`` (``"raw"``) or nothing
    on a spike (``"skip"``). The ceiling is ``max_grad_norm`` or, under
    ``"clipped"``, 1.5 times the run's level (the smallest norm so far in the
    warm-up, then the median of the last 100). A non-finite norm passes
    unchanged and is never observed. ``start="hold"`` holds the warm-up's
    steps (:func:`clipjax.chain` skips them for the optimizer); ``"weight"``
    multiplies step ``t`` by ``(t + 1) / warmup_steps``. Details and the
    ``zclip`` package: :doc:`/reference_zclip`.

    Static arguments: ``mode``, ``clip_option``, ``scope``, ``feedback``, ``ceiling_window`` and
    ``start``; every other number may be injected.

    Args:
      alpha: EMA smoothing factor of mean and variance, in (0, 1).
      z_thresh: z-score threshold (``> 0``).
      max_grad_norm: an absolute ceiling on every step's norm, or None.
        ``"auto"``: 1.0, except None under ``feedback="clipped"``.
      eps: added to the standard deviation in the z-score.
      warmup_steps: finite norms collected before the rule applies (``>= 1``).
      mode: ``"zscore"`` or ``"percentile"``.
      clip_option: ``"adaptive_scaling"`` (None: the default) or ``"mean"``.
      clip_factor: multiplier of the adaptive clip value (None: 1.0).
      skip_update_on_spike: the reference's name for ``feedback="skip"``.
      scope: the groups (:class:`~clipjax.ClipTransform`); each has its own statistics.
      feedback: ``"clip_target"`` (default), ``"clipped"``, ``"raw"`` or ``"skip"``.
      relative_ceiling: the relative ceiling's multiple of the level (``> 1``),
        or None. ``"auto"``: 1.5 under ``feedback="clipped"`` without an
        absolute ceiling, else None.
      ceiling_window: the norms whose median is the level (None: 100).
      start: ``"hold"``, ``"weight"`` or None (the warm-up only collects).
        ``"auto"``: ``"hold"`` with a relative ceiling, else None.
      axis_name: average the group norms over this mapped axis first.
      leaf_norms: also record each leaf's L2 norm before clipping.
      name: metrics prefix (default ``zclip``).

    Returns:
      A :class:`~clipjax.ClipTransform`; its metrics: :doc:`/metrics_logging`.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.chain(clipjax.zclip(feedback="clipped", warmup_steps=5), clipjax.adam(1e-3))
      >>> params = {"w": jnp.zeros(4)}
      >>> state = tx.init(params)
      >>> for g in [0.10, 0.11, 0.09, 0.10, 0.105, 5.0]:  # global norms; a spike last
      ...     _, state = tx.update({"w": jnp.full(4, g / 2)}, state, params)
      >>> m = clipjax.metrics(state)
      >>> bool(m["zclip/global/clipped"]), float(m["zclip/global/threshold"]) < 0.13
      (True, True)
      >>> bool(m["zclip/global/capped"])  # a spike clip, below the relative ceiling
      False

    References:
      Kumar et al., `ZClip: Adaptive Spike Mitigation for LLM Pre-Training
      <https://arxiv.org/abs/2504.02507>`_, 2025; package ``zclip``.
    """
    clip_option, clip_factor, feedback, max_grad_norm, relative_ceiling = _checked(
        alpha, z_thresh, max_grad_norm, eps, warmup_steps, mode, clip_option, clip_factor,
        skip_update_on_spike, feedback, relative_ceiling, ceiling_window,
    )  # fmt: skip
    start_rule = _start(start, relative_ceiling is not None)
    window_size = DEFAULT_CEILING_WINDOW if ceiling_window is None else ceiling_window
    absolute = max_grad_norm is not None
    relative = relative_ceiling is not None
    cap = max_grad_norm if absolute else math.inf
    start_field = {"hold": ("held",), "weight": ("weight",), None: ()}[start_rule]
    fields = ("clip_to", "z", *start_field) + ("headroom",) * absolute
    statistic = _stats.WarmupEma(alpha=alpha, warmup_steps=warmup_steps)

    setup = _kit.setup("zclip", scope=scope, name=name, axis_name=axis_name, leaf_norms=leaf_norms)

    def init_fn(params: Any) -> ZClipState:
        common = _kit.common(setup, params)
        n, dtype = common.num_groups, common.dtype
        mean, var, sample = statistic.init(n, dtype)
        window, low = None, None
        if relative:
            window = _stats.window_init(n, window_size, dtype)
            low = jnp.full((n,), jnp.inf, dtype)
        metrics = _kit.norm_metrics(n, dtype, fields, spike=True, ceiling=absolute or relative)
        state = ZClipState(
            mean, var, sample, window, low, metrics,
            common.info, common.leaf_index, common.leaf_metrics,
        )  # fmt: skip
        return _kit.owned(params, state)

    def update_fn(
        updates: Any, state: ZClipState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ZClipState]:
        del params, extra_args
        grads = _kit.norms(setup, updates, state, ZClipState, init_fn)
        g = grads.norm
        count = state.metrics["count"]
        warming = count < warmup_steps
        limit = jnp.asarray(cap, g.dtype)
        finite = jnp.isfinite(g)
        window, low = state.window, state.low
        if relative:
            assert window is not None and low is not None
            # The run's own level: the smallest norm so far while warming up,
            # then the median of the last ceiling_window norms: a change of the
            # norm that lasts half the window is learnt, a shorter one is bounded.
            level = jnp.where(warming, low, _stats.window_percentile(window, 50.0))
            limit = jnp.minimum(
                limit, jnp.where(window.count > 0, cast(float, relative_ceiling) * level, jnp.inf)
            )

        # The rule, from the statistics before this step. With a relative
        # ceiling the multiplier is T / g, so a loss times k is the same run.
        z, boundary, spike, clip_val = _rule(
            state, g, relative, eps=eps, z_thresh=z_thresh, mode=mode,
            clip_option=clip_option, clip_factor=clip_factor,
        )  # fmt: skip
        div_eps = 0.0 if relative else _DIV_EPS
        spike = spike & ~warming
        applied = jnp.minimum(jnp.where(spike, clip_val, g), limit)
        # zclip uses torch's clip_grad_norm_ rule in warm-up (min(1, c / (g + 1e-6)))
        # and scales only when g > T afterwards.
        ratio = jnp.minimum(1.0, jnp.where(warming, limit, applied) / (g + div_eps))
        scale = jnp.where(warming | (g > applied), ratio, 1.0)
        scale = jnp.where(finite, scale, 1.0)
        capped = None
        if absolute or relative:
            scale, capped = _kit.ceiling_scale(scale, g, limit, eps=div_eps)
        weight, held = None, None
        if start_rule == "weight":
            # 0.4's ramp: step t's gradient weighs (t + 1) / warmup_steps. It leaves
            # adam's second moment short of the later gradients (SPEC 9.8).
            steps = (state.metrics["step"] + 1).astype(g.dtype)
            weight = jnp.where(
                finite, jnp.minimum(1.0, steps / jnp.asarray(warmup_steps, g.dtype)), 1.0
            )
            scale = scale * weight
        elif start_rule == "hold":
            # The warm-up's steps cannot be judged: held, for clipjax.chain and
            # skip_on_spike to skip the optimizer on (no deficit in its moments).
            # What optax.chain gets: no norm seen yet bounds the first one, so 0.
            held = warming & finite
            if window is not None:
                scale = jnp.where(held & (window.count == 0), 0.0, scale)

        # What the statistics learn: the warm-up sample, then the EMAs.
        x, observed = _kit.observation(
            feedback, g, boundary=boundary, target=clip_val, fires=spike & finite
        )
        before = _stats.WarmupEmaState(state.mean, state.var, state.sample)
        stats = _kit.select_groups(observed, statistic.observe(before, x, count), before)
        if window is not None and low is not None:
            # A zero norm carries no scale: only positive finite norms enter.
            enters = finite & (g > 0)
            window, low = _kit.select_groups(
                enters,
                (_stats.window_update(window, g), jnp.minimum(low, g)),
                (window, low),
            )

        more = {} if weight is None else {"weight": weight}
        if held is not None:
            more["held"] = held
        if absolute:
            level = jnp.where(warming, _stats.sample_mean(stats.warmup), stats.mean)
            more["headroom"] = _kit.headroom(max_grad_norm, level)
        metrics = _kit.step_metrics(
            state.metrics,
            norm=g,
            observed=observed,
            threshold=jnp.where(warming, limit, jnp.minimum(boundary, limit)),
            scale=scale,
            spike=spike & finite,
            capped=capped,
            clip_to=jnp.where(
                finite & (scale < 1), scale * (g + div_eps) if start_rule else applied, g
            ),
            z=jnp.where(warming, jnp.zeros_like(z), z),
            **more,
        )
        new_state = ZClipState(
            stats.mean, stats.var, stats.warmup, window, low, metrics,
            state.info, _kit.kept_index(state), _kit.new_leaf_metrics(grads, state),
        )  # fmt: skip
        return _kit.scaled(grads, scale, state.leaf_index), new_state

    # optax types a state as OptState (an array tree), not as ZClipState.
    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
