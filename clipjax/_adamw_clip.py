"""AdamWClip: Adam whose gradient elements are clipped at ``k`` of its own standard deviations.

``clipjax.adam(..., clip_grad_adapt=3.0)`` and ``clipjax.adamw(...)`` build it;
the rule is the ``AdamWClip`` package's (PyPI ``adamwclip`` 0.1.4,
``AdamWClip/optimizer.py``, ``AdamWClip.step``; github.com/wandeln/AdamWClip).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _fold, _grouping, _kit, _metrics, _spam, _state_check, _validation
from clipjax._elementwise import _clamp_leaf

Array = jax.Array
ALGO = "adamw_clip"


class AdamWClipState(NamedTuple):
    """The metrics of ``clipjax.adam``/``adamw(clip_grad_adapt=...)``, next to optax's moments.

    The moments stay in optax's ``ScaleByAdamState``: the optimizer's state is
    ``(ScaleByAdamState, AdamWClipState)`` in the chain's first slot, and the
    clip keeps no state of its own (it reads the second moment).

    Attributes:
      metrics: ``{field: [leaves]}``, one group per leaf: ``grad_norm`` (before
        the clip), ``clipped_fraction`` (the share of the leaf's elements
        clipped this step), ``clipped`` (any), and the counters ``step``,
        ``clipped_count`` (steps with a clipped element) and
        ``nonfinite_count`` (steps with a NaN or infinite element).
      info: static names, ``GroupInfo(algo="adamw_clip", ...)``.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> state = clipjax.adamw(1e-3, clip_grad_adapt=3.0).init({"w": jnp.zeros(2)})
      >>> isinstance(state[0][1], clipjax.AdamWClipState), state[0][1].info.groups
      (True, ('w',))
    """

    metrics: dict[str, Array]
    info: _metrics.GroupInfo


def check(clip_grad_adapt: Any, clip_grad_min: Any, clip_grad_warm_up: Any) -> None:
    """The clip's arguments, by name."""
    _validation.positive("clip_grad_adapt", clip_grad_adapt)
    _validation.non_negative("clip_grad_min", clip_grad_min)
    _validation.integer("clip_grad_warm_up", clip_grad_warm_up, static=False)


def _clip_leaf(g: Array, v: Array, bound: Array, on: Array) -> tuple[Array, Array, Array]:
    """The clipped gradient, the leaf's sum of squares and clipped elements (one reduction).

    ``bound`` is ``sqrt(1 / (1 - b2**(t - 1)))`` times ``k``: the threshold is
    ``max(k * sqrt(v_hat), clip_grad_min)`` with ``v_hat`` the bias-corrected
    second moment before the step, as the reference computes it.
    """
    dtype = _grouping.norm_dtype([g])
    threshold = jnp.sqrt(jnp.real(v).astype(dtype) * bound[0]) * bound[1]
    threshold = jnp.maximum(threshold, bound[2])
    over = on & (jnp.abs(g).astype(dtype) > threshold)
    squares, clipped = _grouping.fused_sums(
        _grouping.abs_squared(g, dtype), over.astype(jnp.float32)
    )
    out = jnp.where(on, _clamp_leaf(g, threshold), g)
    return out, squares, clipped


def scale_by_adam_clip(
    b1: Any,
    b2: Any,
    eps: Any,
    eps_root: Any,
    mu_dtype: Any,
    nesterov: bool,
    clip_grad_adapt: Any,
    clip_grad_min: Any,
    clip_grad_warm_up: Any,
) -> _fold.SkippableTransform:
    """optax's ``scale_by_adam`` on gradients clipped element-wise by AdamWClip's rule.

    Step ``t`` (from 1), every element: ``g <- clip(g, -T, T)`` with ``T =
    max(clip_grad_adapt * sqrt(v / (1 - b2**(t - 1))), clip_grad_min)`` and ``v``
    the second moment before the step, once ``t > max(clip_grad_warm_up, 1)``;
    then Adam's moments and update from the clipped gradient.
    """
    base = optax.scale_by_adam(
        b1=b1, b2=b2, eps=eps, eps_root=eps_root, mu_dtype=mu_dtype, nesterov=nesterov
    )

    def init(params: Any) -> tuple[Any, AdamWClipState]:
        start = _kit.start(params, "per_param", ALGO, None, False)
        n = start.num_groups
        metrics = {
            "grad_norm": jnp.zeros((n,), start.dtype),
            "clipped_fraction": jnp.zeros((n,), start.dtype),
            "clipped": jnp.zeros((n,), bool),
            **_kit.counters(n, ("step", "clipped_count", "nonfinite_count")),
        }
        clip_state = AdamWClipState(metrics, start.info)
        if not start.placeholder:
            clip_state = _kit.own_buffers(clip_state)
        return base.init(params), clip_state

    def step(pred: Any, updates: Any, state: Any, params: Any) -> tuple[Any, Any]:
        # pred None: every step is taken (update); else the moments are selected
        # as in clipjax.adam and the updates are left for update_if to zero.
        _state_check.check_members(state, (optax.ScaleByAdamState, AdamWClipState), ALGO)
        adam, clip_state = state
        info = clip_state.info
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        grouping = _grouping.make_grouping(updates, "per_param")
        grouping.check_matches(info.leaves, info.shapes, ALGO)
        _grouping.check_inexact(leaves, grouping, ALGO)
        if pred is not None:
            leaves = jax.tree.leaves(_fold._zero_unless(pred, leaves))
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
        clip_leaf = _grouping.per_leaf(_clip_leaf, bound, on)
        nus = jax.tree.leaves(adam.nu)
        clipped_leaves, squares, counts, ordered = [], [], [], []
        for g, v in zip(leaves, nus):
            out, square, clipped = clip_leaf(g, v)
            clipped_leaves.append(out)
            squares.append(square)
            counts.append(clipped)
            # The count reads v, and the moments' loop overwrites it in place:
            # without an order between the two, XLA copies v.
            ordered.append(_spam._after(v, clipped.reshape(1)))
        adam = adam._replace(nu=jax.tree.unflatten(jax.tree.structure(adam.nu), ordered))
        grads = jax.tree.unflatten(treedef, clipped_leaves)
        out, new_adam = _fold._adam_arithmetic(
            pred,
            grads,
            adam,
            _fold._adam_state_dtypes(base.update, updates, state[0], params),
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
        clipped = fraction > 0
        metrics = {
            "grad_norm": norm,
            "clipped_fraction": fraction,
            "clipped": clipped,
            "step": old["step"] + 1,
            "clipped_count": old["clipped_count"] + clipped,
            "nonfinite_count": old["nonfinite_count"] + ~jnp.isfinite(norm),
        }
        metrics = {k: jnp.asarray(v).astype(old[k].dtype) for k, v in metrics.items()}
        if pred is not None:
            metrics = jax.tree.map(lambda n, o: jnp.where(pred, n, o), metrics, old)
        return out, (new_adam, clip_state._replace(metrics=metrics))

    def update(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        return step(None, updates, state, params)

    def keep_state_if(
        pred: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
    ) -> tuple[Any, Any]:
        del extra_args
        return step(jnp.asarray(pred, bool), updates, state, params)

    return _fold.skippable(init, update, _fold._zeroing(keep_state_if), keep_state_if)
