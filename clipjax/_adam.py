"""The Adam family: optax's ``adam`` and ``adamw`` that can skip a step, and two clips of Adam.

``clipjax.adam`` and ``clipjax.adamw`` are optax's own (same state, same
updates bit for bit) and :class:`~clipjax.SkippableTransform`: their
``update_if(pred, ...)`` selects each moment element-wise in the loop that
computes the update (:func:`adam_arithmetic`). They also take StableAdamW's
per-tensor update clipping (``update_clipping=True``) and AdamWClip's
element-wise gradient clip (``clip_grad_adapt=k``).
"""

from __future__ import annotations

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _conditional, _elementwise, _grouping, _kit, _metrics, _xla
from clipjax._conditional import SkippableTransform

Array = jax.Array
_CLIP_ALGO = "adamw_clip"


def adam_arithmetic(
    pred: Array | None,
    grads: Any,
    state: optax.ScaleByAdamState,
    state_like: Any,
    b1: Any,
    b2: Any,
    eps: Any,
    eps_root: Any,
    nesterov: bool,
) -> tuple[Any, optax.ScaleByAdamState]:
    """optax's Adam arithmetic, in its order, with the moments selected by ``pred``.

    ``pred`` None takes the step. Returns the update and the new state, in the
    dtypes of ``state_like``.
    """

    def select(n: Any, o: Any) -> Any:
        return n if pred is None else jnp.where(pred, n, o)

    mu = jax.tree.map(select, optax.tree.update_moment(grads, state.mu, b1, 1), state.mu)
    nu = jax.tree.map(
        select, optax.tree.update_moment_per_elem_norm(grads, state.nu, b2, 2), state.nu
    )
    count = select(optax.safe_increment(state.count), state.count)
    if nesterov:
        mu_hat = jax.tree.map(
            lambda m, g: b1 * m + (1 - b1) * g,
            optax.tree.bias_correction(mu, b1, optax.safe_increment(count)),
            optax.tree.bias_correction(grads, b1, count),
        )
    else:
        mu_hat = optax.tree.bias_correction(mu, b1, count)
    nu_hat = optax.tree.bias_correction(nu, b2, count)
    out = jax.tree.map(lambda m, v: m / (jnp.sqrt(v + eps_root) + eps), mu_hat, nu_hat)
    new_state = optax.ScaleByAdamState(count=count, mu=mu, nu=nu)
    new_state = jax.tree.map(lambda x, like: x.astype(like.dtype), new_state, state_like)
    return out, new_state


def _scale_by_adam(
    b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any, nesterov: bool
) -> SkippableTransform:
    """``optax.scale_by_adam`` with a folded ``update_if`` (a taken step bit for bit ``update``)."""
    base = optax.with_extra_args_support(
        optax.scale_by_adam(
            b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
        )
    )

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        _checks.check_state(state, optax.ScaleByAdamState, "scale_by_adam")
        return base.update(updates, state, params, **extra_args)

    def keep_state_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del extra_args
        _checks.check_state(state, optax.ScaleByAdamState, "scale_by_adam")
        pred = jnp.asarray(pred, bool)
        # The state's dtypes after optax's own update (optax >= 0.2.6 casts nu
        # back to its dtype; 0.2.5 does not).
        out_state = _xla.adam_state_dtypes(base.update, updates, state, params)
        grads = _conditional.zero_unless(pred, updates)
        out, new_state = adam_arithmetic(
            pred,
            grads,
            state,
            out_state,
            b1,
            b2,
            eps,
            eps_root,
            nesterov,
        )
        return out, new_state

    return _conditional.skippable(base.init, update, keep_state_if=keep_state_if)


class UpdateClippingState(NamedTuple):
    """State of the Adam member of ``clipjax.adam``/``adamw(update_clipping=True)``.

    Attributes:
      adam: optax's ``ScaleByAdamState`` (count and moments), as in
        ``optax.adam``.
      decay: the weight decay's state (``adamw``), or ``()``.
      metrics: ``{"rms": [leaves], "divisor": [leaves]}``: each tensor's
        RMS on the last step taken and its divisor ``max(1, rms)``.
      info: static names, ``GroupInfo(algo="update_clipping", ...)``, a group per leaf.
      leaf_index: each leaf's index, int32 scalars (empty for one leaf).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.adamw(1e-3, update_clipping=True).init({"w": jnp.zeros(2)})
      >>> isinstance(state[0], clipjax.UpdateClippingState), state[0].info.groups
      (True, ('w',))
    """

    adam: optax.ScaleByAdamState
    decay: Any
    metrics: dict[str, jax.Array]
    info: _metrics.GroupInfo
    leaf_index: tuple[jax.Array, ...] = ()


def _scale_by_stable_adam(
    b1: Any,
    b2: Any,
    eps: Any,
    eps_root: Any,
    mu_dtype: Any,
    nesterov: bool,
    decay: optax.GradientTransformation | None,
) -> SkippableTransform:
    """Adam (and the weight decay) with StableAdamW's per-tensor update clipping."""
    base = optax.scale_by_adam(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
    )
    decay = None if decay is None else optax.with_extra_args_support(decay)

    def init(params: Any) -> UpdateClippingState:
        grouping = _grouping.make_grouping(params, "per_param")
        leaves, _, _ = _grouping.leaves_with_names(params)
        dtype = _grouping.norm_dtype(leaves)
        n = len(leaves)
        info = _metrics.GroupInfo(
            "update_clipping", None, grouping.leaf_names, grouping.leaf_names, grouping.leaf_shapes
        )
        metrics = {"rms": jnp.zeros((n,), dtype), "divisor": jnp.ones((n,), dtype)}
        adam = cast(optax.ScaleByAdamState, base.init(params))
        index = _xla.leaf_index(grouping)
        return UpdateClippingState(
            adam, () if decay is None else decay.init(params), metrics, info, index
        )

    def step(
        pred: Any, updates: Any, state: UpdateClippingState, params: Any
    ) -> tuple[Any, UpdateClippingState]:
        # pred None: every step is taken (update); else the state is selected as in
        # _scale_by_adam and the updates are left for update_if to zero.
        _checks.check_state(state, UpdateClippingState, "update_clipping")
        info = state.info
        grouping = _grouping.make_grouping(updates, "per_param")
        grouping.check_matches(info.leaves, info.shapes, "update_clipping")
        grads = updates if pred is None else _conditional.zero_unless(pred, updates)
        out, adam = adam_arithmetic(
            pred,
            grads,
            state.adam,
            jax.eval_shape(base.update, updates, state.adam, params)[1],
            b1,
            b2,
            eps,
            eps_root,
            nesterov,
        )
        new_decay = state.decay
        if decay is not None:
            if pred is None:
                out, new_decay = decay.update(out, state.decay, params)
            else:
                out, new_decay = _conditional.run_and_select(pred, decay, out, state.decay, params)

        g_leaves = jax.tree.leaves(grads)
        v_leaves = jax.tree.leaves(adam.nu)
        dtype = state.metrics["rms"].dtype
        # Wortsman et al.'s RMS_t = sqrt(mean(g_t**2 / max(v_hat_t, eps**2))), with v_hat_t
        # the bias-corrected second moment after this step (as both references), written
        # v_hat = nu / c: mean(g**2 / max(nu, c * eps**2)) * c reads the gradient and the
        # new moment the update writes anyway, not a materialised v_hat.
        correction = 1 - jnp.asarray(b2, dtype) ** jnp.asarray(adam.count).astype(dtype)
        floor = correction * jnp.asarray(eps, dtype) ** 2
        rms = [
            jnp.sqrt(
                correction
                * jnp.mean(
                    _grouping.abs_squared(g, dtype) / jnp.maximum(jnp.real(v).astype(dtype), floor)
                )
            )
            for g, v in zip(g_leaves, v_leaves)
        ]
        # A NaN RMS (a NaN gradient element) divides by 1, as torch-optimi's
        # max(1, rms.item()) does: the NaN stays in its own elements, as in Adam.
        rms = jnp.stack(rms) if rms else state.metrics["rms"]
        divisor = jnp.where(jnp.isnan(rms), 1.0, jnp.maximum(rms, 1.0))
        out_leaves, treedef = jax.tree.flatten(out)
        # Each leaf reads its divisor at a runtime offset (the state's leaf index):
        # with constant offsets every leaf's fusion is distinct and compiled anew.
        inverse = _grouping.leaf_scales(grouping, 1.0 / divisor, state.leaf_index)
        out = jax.tree.unflatten(
            treedef, [o * inv.astype(o.dtype) for o, inv in zip(out_leaves, inverse)]
        )
        metrics = {"rms": rms.astype(dtype), "divisor": divisor.astype(dtype)}
        if pred is not None:
            metrics = _kit.select_groups(pred, metrics, state.metrics)
        index = _xla.returned(state.leaf_index)
        return out, state._replace(adam=adam, decay=new_decay, metrics=metrics, leaf_index=index)

    return _conditional.skippable_step(init, step)


class AdamWClipState(NamedTuple):
    """The metrics of ``clipjax.adam``/``adamw(clip_grad_adapt=...)``, next to optax's moments.

    The chain's first slot is ``(ScaleByAdamState, AdamWClipState)``.

    Attributes:
      metrics: ``{field: [leaves]}``, one group per leaf: ``grad_norm`` (before
        the clip), ``clipped_fraction`` (of the leaf's elements), ``clipped``,
        and the counters ``step``, ``clipped_count``, ``nonfinite_count``.
      info: static names, ``GroupInfo(algo="adamw_clip", ...)``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.adamw(1e-3, clip_grad_adapt=3.0).init({"w": jnp.zeros(2)})
      >>> isinstance(state[0][1], clipjax.AdamWClipState), state[0][1].info.groups
      (True, ('w',))
    """

    metrics: dict[str, Array]
    info: _metrics.GroupInfo


def _check_clip(clip_grad_adapt: Any, clip_grad_min: Any, clip_grad_warm_up: Any) -> None:
    """The clip's arguments, by name."""
    _checks.positive("clip_grad_adapt", clip_grad_adapt)
    _checks.non_negative("clip_grad_min", clip_grad_min)
    _checks.integer("clip_grad_warm_up", clip_grad_warm_up, static=False)


def _clip_leaf(g: Array, v: Array, bound: Array, on: Array) -> tuple[Array, Array, Array]:
    """The clipped gradient, the leaf's sum of squares and clipped elements;
    ``bound`` is ``(1 / (1 - b2**(t - 1)), k, clip_grad_min)``."""
    dtype = _grouping.norm_dtype([g])
    threshold = jnp.sqrt(jnp.real(v).astype(dtype) * bound[0]) * bound[1]
    threshold = jnp.maximum(threshold, bound[2])
    over = on & (jnp.abs(g).astype(dtype) > threshold)
    squares, clipped = _xla.fused_sums(_grouping.abs_squared(g, dtype), over.astype(jnp.float32))
    out = jnp.where(on, _elementwise.clamp_leaf(g, threshold), g)
    return out, squares, clipped


def _scale_by_adam_clip(
    b1: Any,
    b2: Any,
    eps: Any,
    eps_root: Any,
    mu_dtype: Any,
    nesterov: bool,
    clip_grad_adapt: Any,
    clip_grad_min: Any,
    clip_grad_warm_up: Any,
) -> SkippableTransform:
    """optax's ``scale_by_adam`` on gradients clipped element-wise by AdamWClip's rule."""
    base = optax.scale_by_adam(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
    )

    setup = _kit.setup(_CLIP_ALGO, scope="per_param", name=None)
    fields = ("grad_norm", "clipped_fraction", "clipped")
    counters = ("step", "clipped_count", "nonfinite_count")

    def init(params: Any) -> tuple[Any, AdamWClipState]:
        adam = base.init(params)
        common = _kit.common(setup, params)
        metrics = _kit.new_metrics(common.num_groups, common.dtype, fields, counters)
        return adam, _kit.owned(params, AdamWClipState(metrics, common.info))

    def step(pred: Any, updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        # pred None: every step is taken (update); else the moments are selected
        # as in clipjax.adam and the updates are left for update_if to zero.
        _checks.check_members(state, (optax.ScaleByAdamState, AdamWClipState), _CLIP_ALGO)
        adam, clip_state = state
        info = clip_state.info
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        grouping = _grouping.make_grouping(updates, "per_param")
        grouping.check_matches(info.leaves, info.shapes, _CLIP_ALGO)
        _grouping.check_inexact(leaves, grouping, _CLIP_ALGO)
        if pred is not None:
            leaves = jax.tree.leaves(_conditional.zero_unless(pred, leaves))
        dtype = clip_state.metrics["grad_norm"].dtype

        # The reference's bias_correction_clip, 1 / (1 - b2**(t - 1)), with t - 1 the
        # steps taken. It clips from step 1, where v is 0, to clip_grad_min; here
        # the clip starts once v has seen a step.
        taken = jnp.asarray(adam.count).astype(dtype)
        on = adam.count >= jnp.maximum(jnp.asarray(clip_grad_warm_up), 1)
        correction = 1 / jnp.where(on, 1 - jnp.asarray(b2, dtype) ** taken, 1.0)
        bound = jnp.stack(
            [correction, jnp.asarray(clip_grad_adapt, dtype), jnp.asarray(clip_grad_min, dtype)]
        )
        clip_leaf = _xla.per_leaf(_clip_leaf, bound, on)
        nus = jax.tree.leaves(adam.nu)
        clipped_leaves, squares, counts, ordered = [], [], [], []
        for g, v in zip(leaves, nus):
            out, square, clipped = clip_leaf(g, v)
            clipped_leaves.append(out)
            squares.append(square)
            counts.append(clipped)
            # The count reads v, and the moments' loop overwrites it in place:
            # without an order between the two, XLA copies v.
            ordered.append(_xla.after(v, clipped.reshape(1)))
        adam = adam._replace(nu=jax.tree.unflatten(jax.tree.structure(adam.nu), ordered))
        grads = jax.tree.unflatten(treedef, clipped_leaves)
        out, new_adam = adam_arithmetic(
            pred,
            grads,
            adam,
            _xla.adam_state_dtypes(base.update, updates, state[0], params),
            b1,
            b2,
            eps,
            eps_root,
            nesterov,
        )

        if leaves:
            sizes = jnp.asarray([max(x.size, 1) for x in leaves], dtype)
            norm = jnp.sqrt(jnp.stack(squares)).astype(dtype)
            fraction = (jnp.stack(counts) / sizes).astype(dtype)
        else:
            norm = fraction = clip_state.metrics["grad_norm"]
        old = clip_state.metrics
        metrics = _kit.step_metrics(old, norm=norm, clipped=fraction > 0, clipped_fraction=fraction)
        if pred is not None:
            metrics = _kit.select_groups(pred, metrics, old)
        return out, (new_adam, clip_state._replace(metrics=metrics))

    return _conditional.skippable_step(init, step)


def _adam_clip(
    b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any, nesterov: bool,
    update_clipping: bool, clip_grad_adapt: Any, clip_grad_min: Any, clip_grad_warm_up: Any,
) -> SkippableTransform:  # fmt: skip
    """AdamWClip's Adam member, its arguments checked and defaulted."""
    if update_clipping:
        raise ValueError(
            "update_clipping=True and clip_grad_adapt are two clips of Adam; choose one"
        )
    # None, not numbers, by default: inject_hyperparams would inject a numeric
    # default, and inject_hyperparams(clipjax.adamw)'s state would differ from optax's.
    clip_grad_min = 1e-10 if clip_grad_min is None else clip_grad_min
    clip_grad_warm_up = 0 if clip_grad_warm_up is None else clip_grad_warm_up
    _check_clip(clip_grad_adapt, clip_grad_min, clip_grad_warm_up)
    return _scale_by_adam_clip(
        b1, b2, eps, eps_root, mu_dtype, nesterov, clip_grad_adapt, clip_grad_min,
        clip_grad_warm_up,
    )  # fmt: skip


def adam(
    learning_rate: optax.ScalarOrSchedule,
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-8,
    eps_root: Any = 0.0,
    mu_dtype: Any = None,
    *,
    nesterov: bool = False,
    update_clipping: bool = False,
    clip_grad_adapt: Any = None,
    clip_grad_min: Any = None,
    clip_grad_warm_up: Any = None,
) -> SkippableTransform:
    """``optax.adam`` that can skip a step without a conditional: :func:`adamw` without the
    weight decay.

    ``init`` and ``update`` are ``optax.adam``'s, bit for bit; ``update_if``
    folds a skip into the moments.

    Static arguments: none; every number may be injected (``mu_dtype``, a
    dtype, is static).

    Args:
      learning_rate: a float or a schedule (``step -> float``).
      b1: decay rate of the first moment.
      b2: decay rate of the second moment.
      eps: added to the denominator, outside the square root.
      eps_root: added inside the square root.
      mu_dtype: the first moment's dtype (None: that of the params).
      nesterov: use Nesterov momentum (NAdam).
      update_clipping: StableAdamW's update clipping.
      clip_grad_adapt: AdamWClip's clip in standard deviations, or None.
      clip_grad_min: AdamWClip's smallest threshold (None: 1e-10).
      clip_grad_warm_up: AdamWClip's steps before the clip starts (None: 0).

    Returns:
      A :class:`SkippableTransform`.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> params, grads = {"w": jnp.ones(2)}, {"w": jnp.array([0.5, -1.0])}
      >>> ours, theirs = clipjax.adam(0.1), optax.adam(0.1)
      >>> a, _ = ours.update(grads, ours.init(params))
      >>> b, _ = theirs.update(grads, theirs.init(params))
      >>> bool((a["w"] == b["w"]).all())
      True

    References:
      Kingma and Ba, `Adam: A Method for Stochastic Optimization
      <https://arxiv.org/abs/1412.6980>`_, 2014.
    """
    members = _members(
        b1, b2, eps, eps_root, mu_dtype, nesterov, update_clipping, clip_grad_adapt,
        clip_grad_min, clip_grad_warm_up, decay=None,
    )  # fmt: skip
    return _conditional.chain(
        *members, _conditional.selecting(optax.scale_by_learning_rate(learning_rate))
    )


def adamw(
    learning_rate: optax.ScalarOrSchedule,
    b1: Any = 0.9,
    b2: Any = 0.999,
    eps: Any = 1e-8,
    eps_root: Any = 0.0,
    mu_dtype: Any = None,
    weight_decay: Any = 1e-4,
    mask: Any = None,
    *,
    nesterov: bool = False,
    update_clipping: bool = False,
    clip_grad_adapt: Any = None,
    clip_grad_min: Any = None,
    clip_grad_warm_up: Any = None,
) -> SkippableTransform:
    """``optax.adamw`` that can skip a step without a conditional.

    ``init`` and ``update`` are ``optax.adamw``'s, bit for bit; ``update_if``
    (:class:`SkippableTransform`) folds a skip into the moments, for
    :func:`clipjax.skip_on_spike`.

    ``update_clipping=True`` is StableAdamW: per tensor, the step is divided
    by ``max(1, sqrt(mean(g**2 / max(v_hat, eps**2))))``, ``v_hat`` after the
    step (:class:`UpdateClippingState`). ``clip_grad_adapt=k`` is AdamWClip:
    each gradient element is clipped to ``max(k * sqrt(v_hat),
    clip_grad_min)``, ``v_hat`` before the step (:class:`clipjax.AdamWClipState`).
    Against their references: :doc:`/reference_spam`.

    Static arguments: none; every number may be injected (``mu_dtype`` and a
    callable ``mask`` go in ``static_args``).

    Args:
      learning_rate: a float or a schedule (``step -> float``).
      b1: decay rate of the first moment.
      b2: decay rate of the second moment.
      eps: added to the denominator, outside the square root.
      eps_root: added inside the square root.
      mu_dtype: the first moment's dtype (None: that of the params).
      weight_decay: the decoupled weight decay rate (a schedule too, where the
        installed optax takes one).
      mask: a tree of bools (or a function of the params returning one): the
        leaves to decay; None decays all.
      nesterov: use Nesterov momentum (NAdamW).
      update_clipping: StableAdamW's per-tensor update clipping (above).
      clip_grad_adapt: AdamWClip's threshold in standard deviations (``> 0``;
        the package's default is 3), or None (default) for plain AdamW.
      clip_grad_min: AdamWClip's smallest threshold (``>= 0``); None: 1e-10.
      clip_grad_warm_up: steps before AdamWClip's clip starts (an int
        ``>= 0``; never the first step); None: 0.

    Returns:
      A :class:`SkippableTransform`.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> params = {"w": jnp.ones(2)}
      >>> stable = clipjax.adamw(1e-3, update_clipping=True)
      >>> state = stable.init(params)
      >>> for g in [0.01, 0.01, 5.0]:  # a quiet gradient, then a spike
      ...     _, state = stable.update({"w": jnp.full(2, g)}, state, params)
      >>> m = clipjax.metrics(state)
      >>> [round(float(m[f"update_clipping/w/{k}"]), 2) for k in ("rms", "divisor")]
      [1.73, 1.73]

    References:
      Loshchilov and Hutter, `Decoupled Weight Decay Regularization
      <https://arxiv.org/abs/1711.05101>`_, 2019. Wortsman et al., `Stable and
      low-precision training for large-scale vision-language models
      <https://arxiv.org/abs/2304.13013>`_, 2023 (StableAdamW).
    """
    if mask is not None and isinstance(weight_decay, (int, float)) and weight_decay == 0:
        raise ValueError(
            "mask has no effect with weight_decay=0 (no leaf is decayed): pass a "
            "weight_decay > 0, or drop mask"
        )
    members = _members(
        b1, b2, eps, eps_root, mu_dtype, nesterov, update_clipping, clip_grad_adapt,
        clip_grad_min, clip_grad_warm_up, decay=optax.add_decayed_weights(weight_decay, mask),
    )  # fmt: skip
    return _conditional.chain(
        *members, _conditional.selecting(optax.scale_by_learning_rate(learning_rate))
    )


def _members(
    b1: Any, b2: Any, eps: Any, eps_root: Any, mu_dtype: Any, nesterov: bool,
    update_clipping: bool, clip_grad_adapt: Any, clip_grad_min: Any, clip_grad_warm_up: Any,
    *, decay: optax.GradientTransformation | None,
) -> list[SkippableTransform]:  # fmt: skip
    """The members of ``adam`` and ``adamw`` before the learning rate: Adam (or
    AdamWClip's, or StableAdamW's, which divides the decay too), then ``decay``."""
    if clip_grad_adapt is not None:
        adam = _adam_clip(
            b1, b2, eps, eps_root, mu_dtype, nesterov, update_clipping, clip_grad_adapt,
            clip_grad_min, clip_grad_warm_up,
        )  # fmt: skip
    elif update_clipping:
        return [_scale_by_stable_adam(b1, b2, eps, eps_root, mu_dtype, nesterov, decay)]
    else:
        adam = _scale_by_adam(b1, b2, eps, eps_root, mu_dtype, nesterov)
    return [adam] + ([] if decay is None else [_conditional.selecting(decay)])
