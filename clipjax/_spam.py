"""SPAM and Stable-SPAM: Adam with element-wise spike clipping and moment resets.

The step is one loop per leaf (reset, clip, moments, update), skip folded in.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _conditional, _grouping, _kit, _xla
from clipjax._adaclip import ada_norm, adaclip
from clipjax._grouping import Scope
from clipjax._metrics import GroupInfo

Array = jax.Array

ALGO = "spam"
# The reference's warm-up: a cosine decay of a "death rate" from 0.99 to 0.
DEATH_RATE = 0.99


class SpamState(NamedTuple):
    """The metrics of :func:`clipjax.spam` (and :func:`clipjax.stable_spam`'s moments).

    Attributes:
      metrics: ``dict`` of ``[1]``-shaped arrays (group ``global``):
        ``clipped_fraction`` (share of elements the spike clip replaced),
        ``warmup_scale`` (the update's factor, below 1 in a warm-up),
        ``steps_since_reset`` (0 on a reset step), ``resets``,
        ``nonfinite_count`` (steps with a non-finite element) and ``step``;
        the two counts only with ``count_clipped=True``.
      info: static names, ``GroupInfo(algo="spam", ...)``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.spam(1e-3).init({"w": jnp.zeros(3)})
      >>> isinstance(state[0][1], clipjax.SpamState), state[0][1].info.groups
      (True, ('global',))
    """

    metrics: dict[str, Array]
    info: GroupInfo


def _init_metrics(count_clipped: bool) -> dict[str, Array]:
    f32 = lambda x: jnp.full((1,), x, jnp.float32)
    i32 = lambda: jnp.zeros((1,), jnp.int32)
    counted = {"clipped_fraction": f32(0.0), "nonfinite_count": i32()} if count_clipped else {}
    return {
        **counted,
        "warmup_scale": f32(1.0),
        "steps_since_reset": i32(),
        "resets": i32(),
        "step": i32(),
    }


def warmup_factor(steps_since_reset: Array, warmup_steps: Any) -> Array:
    """``1 - 0.99 * (1 + cos(pi * (c + 1) / (W + 1))) / 2`` for ``c < W`` steps after a reset,
    else 1 (pytorch-optimizer's ``CosineDecay(0.99, W)``)."""
    c = steps_since_reset.astype(jnp.float32)
    w = jnp.asarray(warmup_steps, jnp.float32)
    death = DEATH_RATE * (1.0 + jnp.cos(math.pi * (c + 1.0) / (w + 1.0))) / 2.0
    return jnp.where(c < w, 1.0 - death, 1.0)


class _StepArgs(NamedTuple):
    """The scalars of one SPAM step, shared by every leaf."""

    pred: Array
    reset: Array
    clip_on: Array
    threshold: Any
    b1: Any
    b2: Any
    eps: Any
    bc1: Array
    bc2: Array
    warm: Array
    eps_inside_correction: bool


def _clip(g: Array, finite: Array, v: Array, a: _StepArgs) -> tuple[Array, Array, Array]:
    """``(v before the step, its limit threshold * v, where g spikes)``."""
    v0 = jnp.where(a.reset, jnp.zeros((), v.dtype), v)
    limit = jnp.asarray(a.threshold, v.dtype) * v0
    # An element whose second moment is 0 has no history: it is not
    # clipped (the reference clips it to 0, and then it stays there).
    # |g| * |g|, not g * g: the norm of a skip_on_spike around this takes
    # g * g, and XLA would write that shared product out.
    magnitude = jnp.abs(g)
    spike = a.clip_on & (magnitude * magnitude > limit) & (v0 > 0) & finite
    return v0, limit, spike


def _leaf_step(
    g: Array, m: Array, v: Array, a: _StepArgs, count_clipped: bool
) -> tuple[Array, Array, Array, tuple[Array, ...] | None]:
    """One leaf: the new moments (in their dtypes), the update, and the counts."""
    dtype = jnp.promote_types(jnp.promote_types(g.dtype, m.dtype), v.dtype)
    dtype = jnp.promote_types(dtype, jnp.float32)
    gx, mx, vx = g.astype(dtype), m.astype(dtype), v.astype(dtype)
    finite = jnp.isfinite(gx)
    sums = None
    if count_clipped:
        # A reduction of its own (XLA:CPU fuses no reduction into a loop):
        # two reads of the gradient's size. The first moment's loop waits
        # for it, so that v is not copied.
        _, _, spike = _clip(gx, finite, vx, a)
        sums = _xla.fused_sums(spike.astype(jnp.float32), (~finite).astype(jnp.float32))
        vx = _xla.after(vx, sums[0])
    v0, limit, spike = _clip(gx, finite, vx, a)
    m0 = jnp.where(a.reset, jnp.zeros((), dtype), mx)
    gc = jnp.where(spike, jnp.sign(gx) * jnp.sqrt(limit), gx)
    # Selected before the update is computed from them, as in clipjax.adam:
    # the new moments are written once and read by the same loop. A
    # non-finite element keeps its moments.
    m1 = jnp.where(a.pred & finite, a.b1 * m0 + (1 - a.b1) * gc, jnp.where(a.pred, m0, mx))
    vx = _xla.after(v.astype(dtype), m1)
    v0, limit, spike = _clip(gx, finite, vx, a)
    # The clipped square is threshold * v itself: no square root in this loop.
    gc2 = jnp.where(spike, limit, jnp.abs(gx) * jnp.abs(gx))
    v1 = jnp.where(a.pred & finite, a.b2 * v0 + (1 - a.b2) * gc2, jnp.where(a.pred, v0, vx))
    if a.eps_inside_correction:
        out = (m1 / a.bc1) / (jnp.sqrt(v1) / jnp.sqrt(a.bc2) + a.eps)
    else:
        out = (jnp.sqrt(a.bc2) / a.bc1) * (m1 / (jnp.sqrt(v1) + a.eps))
    # A non-finite element's update is NaN here: the decay stage after this
    # (_decay_finite) reads that as "leave this parameter where it is" and
    # returns 0 for it, weight decay included.
    out = jnp.where(finite, a.warm * out, jnp.full((), jnp.nan, dtype))
    out = jnp.where(a.pred, out, jnp.zeros((), dtype))
    return m1.astype(m.dtype), v1.astype(v.dtype), out.astype(g.dtype), sums


def scale_by_spam(
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-6,
    *,
    threshold: Any = 5000,
    reset_interval: Any = 500,
    warmup_steps: Any = 50,
    clip_delay: Any = 20,
    mu_dtype: Any = None,
    restart_bias_correction: bool = False,
    eps_inside_correction: bool = False,
    count_clipped: bool = True,
    name: str | None = None,
    algo: str = ALGO,
) -> _conditional.SkippableTransform:
    """SPAM without the learning rate; a non-finite element's update is NaN.

    ``restart_bias_correction`` and ``eps_inside_correction``: Stable-SPAM's variant.
    """
    mu_dtype = None if mu_dtype is None else jnp.dtype(mu_dtype)

    def init_fn(params: Any) -> Any:
        adam = optax.scale_by_adam(mu_dtype=mu_dtype).init(params)
        info = _kit.group_info(params, "global", algo, name)
        return adam, SpamState(_init_metrics(count_clipped), info)

    def step(pred: Any, updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        _checks.check_members(state, (optax.ScaleByAdamState, SpamState), name or algo)
        adam, spam_state = state
        info = spam_state.info
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        grouping = _grouping.make_grouping(updates, "global")
        grouping.check_matches(info.leaves, info.shapes, info.name or info.algo)
        _grouping.check_inexact(leaves, grouping, info.name or info.algo)
        mus, nus = jax.tree.leaves(adam.mu), jax.tree.leaves(adam.nu)
        pred = jnp.asarray(pred, bool)

        count = adam.count
        t = jnp.asarray(
            optax.safe_increment(count)
        )  # this step's 1-based number, as the reference counts
        interval = jnp.asarray(reset_interval, t.dtype)
        since = t % interval
        reset = since == 0
        # The reference's warm-up starts at the first reset after step 1.
        reset_seen = t >= jnp.maximum(interval, 2)
        steps_since_reset = jnp.asarray(jnp.where(reset_seen, since, t - 1))
        warm = jnp.where(reset_seen, warmup_factor(since, warmup_steps), 1.0)
        clip_on = (
            (jnp.asarray(threshold) != 0)
            & (t >= clip_delay)
            & (since >= jnp.asarray(clip_delay, t.dtype))
        )
        if restart_bias_correction:
            bc_step = jnp.where(t >= interval, since + 1, t).astype(jnp.float32)
        else:
            bc_step = t.astype(jnp.float32)
        bc1 = 1.0 - jnp.asarray(b1, jnp.float32) ** bc_step
        bc2 = 1.0 - jnp.asarray(b2, jnp.float32) ** bc_step

        new_mus, new_nus, outs, clipped_sums, bad_sums = [], [], [], [], []
        step_args = _StepArgs(
            pred, reset, clip_on, threshold, b1, b2, eps, bc1, bc2, warm, eps_inside_correction
        )
        leaf_step = _xla.per_leaf(_leaf_step, step_args, count_clipped)
        for g, m, v in zip(leaves, mus, nus):
            m1, v1, out, sums = leaf_step(g, m, v)
            new_mus.append(m1)
            new_nus.append(v1)
            outs.append(out)
            if sums is not None:
                clipped_sums.append(sums[0])
                bad_sums.append(sums[1])

        size = sum(math.prod(x.shape) for x in leaves)
        clipped = sum(clipped_sums) if clipped_sums else jnp.zeros((), jnp.float32)
        bad = sum(bad_sums) if bad_sums else jnp.zeros((), jnp.float32)
        fraction = clipped / max(size, 1)
        old = spam_state.metrics
        one = lambda x, dtype: jnp.asarray(x).astype(dtype).reshape(1)
        taken = pred.astype(jnp.int32)
        metrics = {
            "warmup_scale": one(warm, jnp.float32),
            "steps_since_reset": one(steps_since_reset, jnp.int32),
            "resets": old["resets"] + taken * one(reset, jnp.int32),
            "step": old["step"] + taken,
        }
        if count_clipped:
            metrics["clipped_fraction"] = one(fraction, jnp.float32)
            metrics["nonfinite_count"] = old["nonfinite_count"] + taken * one(bad > 0, jnp.int32)
        metrics = _kit.select_groups(pred, metrics, old)
        new_adam = optax.ScaleByAdamState(
            count=jnp.where(pred, t, count).astype(count.dtype),
            mu=jax.tree_util.tree_unflatten(jax.tree.structure(adam.mu), new_mus),
            nu=jax.tree_util.tree_unflatten(jax.tree.structure(adam.nu), new_nus),
        )
        new_state = (new_adam, SpamState(metrics, info))
        return jax.tree_util.tree_unflatten(treedef, outs), new_state

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        return step(True, updates, state, params)

    def update_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del extra_args
        return step(pred, updates, state, params)

    base = optax.with_extra_args_support(optax.GradientTransformation(init_fn, update_fn))
    return _conditional.skippable(base.init, base.update, update_if=update_if)


def _kept(u: Array) -> Array:
    return ~jnp.isnan(u)


def _decay_finite(decay: optax.GradientTransformation) -> optax.GradientTransformation:
    """``decay`` (optax's decoupled weight decay) that turns a NaN update into 0, undecayed."""
    decay = optax.with_extra_args_support(decay)

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        kept = jax.tree.map(_kept, updates)
        zero = lambda u, k: jnp.where(k, u, jnp.zeros((), u.dtype))
        out, state = decay.update(jax.tree.map(zero, updates, kept), state, params, **extra_args)
        return jax.tree.map(zero, out, kept), state

    return optax.GradientTransformationExtraArgs(decay.init, update_fn)


def _check_common(learning_rate: Any, b1: Any, b2: Any, eps: Any, weight_decay: Any) -> None:
    if not callable(learning_rate):
        _checks.non_negative("learning_rate", learning_rate)
    _checks.check("b1", b1, lambda x: 0 <= x < 1, "in [0, 1)")
    _checks.check("b2", b2, lambda x: 0 <= x < 1, "in [0, 1)")
    _checks.non_negative("eps", eps)
    if not callable(weight_decay):
        _checks.non_negative("weight_decay", weight_decay)


def spam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-6,
    weight_decay: Any = 0.0,
    *,
    threshold: Any = 5000,
    reset_interval: Any = 500,
    warmup_steps: Any = 50,
    clip_delay: Any = 20,
    mu_dtype: Any = None,
    mask: Any = None,
    count_clipped: bool = True,
    name: str | None = None,
) -> _conditional.SkippableTransform:
    """SPAM: Adam that clips gradient spikes element-wise and resets its moments.

    Each step ``t`` (counted from 1), for every gradient element ``g`` with
    Adam's second moment ``v`` before the step:

    1. on a reset step (``t % reset_interval == 0``) ``m`` and ``v`` are set to 0;
    2. spike clip: where ``g**2 > threshold * v``, ``g`` is replaced by
       ``sign(g) * sqrt(threshold * v)``; off while ``t < clip_delay``, for
       the first ``clip_delay`` steps after each reset, and with ``threshold=0``;
    3. Adam's moments: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g**2``;
    4. the update ``-lr * w * sqrt(1 - b2**t) / (1 - b1**t) * m / (sqrt(v) + eps)``,
       then decoupled weight decay ``-lr * weight_decay * param``. ``w`` is 1,
       except for the ``warmup_steps`` steps after each reset (from the first
       on): ``w = 1 - 0.99 (1 + cos(pi (c + 1) / (warmup_steps + 1))) / 2`` on
       the ``c``-th step after the reset.

    Defaults are pytorch-optimizer's ``SPAM``'s (differences:
    :doc:`/reference_spam`). A non-finite gradient element leaves its parameter
    and moments as they were. ``mu_dtype`` and a callable ``mask`` go in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      learning_rate: a float or a schedule (``step -> float``).
      b1: decay rate of the first moment.
      b2: decay rate of the second moment.
      eps: added to ``sqrt(v)`` (before the bias correction, as the reference).
      weight_decay: the decoupled weight decay rate.
      threshold: ``theta``: an element spikes when ``g**2 > theta * v``; 0
        turns the clip off.
      reset_interval: the moments are reset every this many steps (an int >= 1).
      warmup_steps: steps of cosine warm-up after each reset (an int >= 0).
      clip_delay: the clip waits this many steps after the start and after
        each reset (an int >= 0).
      mu_dtype: the first moment's dtype (None: that of the params).
      mask: a tree of bools (or a function of the params giving one): the leaves to
        decay; None decays all.
      count_clipped: report ``clipped_fraction`` and ``nonfinite_count`` (one more reduction).
      name: metrics prefix (default ``spam``).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.spam(1e-3, reset_interval=4, warmup_steps=2, clip_delay=1)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> for g in [1.0, 1.0, 1.0, 1.0, 1e4]:
      ...     updates, state = tx.update({"w": jnp.full(3, g)}, state, params)
      >>> m = clipjax.metrics(state)
      >>> int(m["spam/global/resets"]), round(float(m["spam/global/clipped_fraction"]), 2)
      (1, 1.0)

    References:
      Huang et al., `SPAM: Spike-Aware Adam with Momentum Reset for Stable LLM
      Training <https://arxiv.org/abs/2501.06842>`_, ICLR 2025;
      pytorch-optimizer ``SPAM`` (``pytorch_optimizer/optimizer/spam.py``).
    """
    _check_common(learning_rate, b1, b2, eps, weight_decay)
    _checks.non_negative("threshold", threshold)
    _checks.integer("reset_interval", reset_interval, 1, static=False)
    _checks.integer("warmup_steps", warmup_steps, 0, static=False)
    _checks.integer("clip_delay", clip_delay, 0, static=False)
    _checks.name(name)
    return _conditional.chain(
        scale_by_spam(
            b1,
            b2,
            eps,
            threshold=threshold,
            reset_interval=reset_interval,
            warmup_steps=warmup_steps,
            clip_delay=clip_delay,
            mu_dtype=mu_dtype,
            count_clipped=count_clipped,
            name=name,
        ),
        _conditional.selecting(_decay_finite(optax.add_decayed_weights(weight_decay, mask))),
        _conditional.selecting(optax.scale_by_learning_rate(learning_rate)),
    )


def stable_spam(
    learning_rate: optax.ScalarOrSchedule = 1e-3,
    b1: Any = 0.9,
    b2: Any = 0.999,
    gamma1: Any = 0.7,
    gamma2: Any = 0.9,
    theta: Any = 0.999,
    eps: Any = 1e-8,
    weight_decay: Any = 0.0,
    *,
    reset_interval: Any = 1000,
    scope: Scope = "per_param",
    mu_dtype: Any = None,
    mask: Any = None,
    count_clipped: bool = True,
    name: str | None = None,
) -> _conditional.SkippableTransform:
    """Stable-SPAM: AdaClip, AdaGN and Adam with SPAM's moment reset.

    ``clipjax.chain(adaclip(theta), ada_norm(gamma1, gamma2, eps), <Adam with
    moment reset>, add_decayed_weights(weight_decay), scale_by_learning_rate)``:

    the Adam's moments and bias correction restart on steps ``t`` with ``t %
    reset_interval == 0`` (no warm-up, no spike clip, as in the reference).
    Defaults are pytorch-optimizer's ``StableSPAM``'s (differences:
    :doc:`/reference_spam`). A callable ``scope``, ``mu_dtype`` and a
    callable ``mask`` go in ``static_args``.

    Static arguments: none; every number may be injected.

    Args:
      learning_rate: a float or a schedule (``step -> float``).
      b1: decay rate of Adam's first moment.
      b2: decay rate of Adam's second moment.
      gamma1: AdaGN's norm EMA decay rate.
      gamma2: AdaGN's squared norm EMA decay rate.
      theta: AdaClip's max EMA decay rate.
      eps: added to Adam's ``sqrt(v_hat)`` and to AdaGN's ``sqrt(mean_square)``.
      weight_decay: the decoupled weight decay rate.
      reset_interval: Adam's moments are reset every this many steps (an int >= 1).
      scope: AdaClip's and AdaGN's groups (default ``"per_param"``, the reference's).
      mu_dtype: the first moment's dtype (None: that of the params).
      mask: a tree of bools (or a function of the params giving one): the leaves to
        decay; None decays all.
      count_clipped: report AdaClip's ``clipped_fraction`` (one more read of the gradient).
      name: prefix of its own metrics (``resets``; default ``stable_spam``).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.stable_spam(1e-3, reset_interval=2)
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> for g in [1.0, 2.0, 3.0]:
      ...     updates, state = tx.update({"w": jnp.full(3, g)}, state, params)
      >>> int(clipjax.metrics(state)["stable_spam/global/resets"])
      1

    References:
      Huang et al., `Stable-SPAM: How to Train in 4-Bit More Stably than 16-Bit
      Adam <https://arxiv.org/abs/2502.17055>`_, 2025; pytorch-optimizer
      ``StableSPAM`` (``pytorch_optimizer/optimizer/spam.py``).
    """
    _check_common(learning_rate, b1, b2, eps, weight_decay)
    _checks.integer("reset_interval", reset_interval, 1, static=False)
    _checks.name(name)
    return _conditional.chain(
        adaclip(theta, scope=scope, count_clipped=count_clipped),
        ada_norm(gamma1, gamma2, eps, scope=scope),
        scale_by_spam(
            b1,
            b2,
            eps,
            threshold=0,
            reset_interval=reset_interval,
            warmup_steps=0,
            clip_delay=0,
            mu_dtype=mu_dtype,
            restart_bias_correction=True,
            eps_inside_correction=True,
            count_clipped=False,
            name=name,
            algo="stable_spam",
        ),
        _conditional.selecting(_decay_finite(optax.add_decayed_weights(weight_decay, mask))),
        _conditional.selecting(optax.scale_by_learning_rate(learning_rate)),
    )
