"""agc: Adaptive Gradient Clipping (Brock et al. 2021), unitwise or grouped."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from clipjax import _engine, _grouping, _metrics, _validation
from clipjax._engine import Decision, NormRule

AGCState = _engine.register_algo(
    "agc", "State of :func:`agc`: metrics per group (per leaf when unitwise).", "AGCState"
)

# optax's guard in unitwise_clip, "distinct from the normal eps".
_DIV_EPS = 1e-6


def _exclude_small(path: Any, leaf: Any) -> bool:
    return jnp.ndim(leaf) > 1


def unit_axes(x: Any) -> Any:
    """optax's unit convention: the reduction axes of :func:`optax.unitwise_norm`."""
    shape = jnp.shape(x)
    if sum(d != 1 for d in shape) <= 1:  # scalars and (squeezed) vectors
        return None
    if len(shape) in (2, 3):
        return 0
    if len(shape) == 4:
        return (0, 1, 2)
    if len(shape) == 5:
        return (0, 1, 2, 3)
    raise ValueError(
        f"agc: unitwise scope expects parameters of rank 1 to 5, got shape {shape}; "
        "use a grouped scope for other shapes."
    )


def _unit_norm(x: jax.Array, dtype: Any) -> jax.Array:
    sq = jnp.real(x * jnp.conj(x)).astype(dtype) if jnp.iscomplexobj(x) else x.astype(dtype) ** 2
    return jnp.sqrt(jnp.sum(sq, axis=unit_axes(x), keepdims=True))


def agc(
    clipping: float = 0.01,
    eps: float = 1e-3,
    scope: Any = "unitwise",
    exclude_bias_bn: bool = False,
    *,
    axis_name: str | None = None,
    name: str | None = None,
) -> optax.GradientTransformationExtraArgs:
    """Adaptive Gradient Clipping: bound each gradient relative to its weights.

    * ``scope="unitwise"`` (default) is exactly ``optax.adaptive_grad_clip``:
      per-unit norms with optax's axis rule, ``max_norm = clipping *
      max(||w||, eps)``, the unit kept where ``||g|| < max_norm`` and scaled by
      ``max_norm / max(||g||, 1e-6)`` otherwise. The scale is formed on the
      unit-norm array and broadcast-multiplied, instead of optax's full-size
      select between two full-size arrays.
    * ``scope`` in ``"global"``, ``"per_layer"``, ``"per_param"`` or a
      callable: smartclip's grouped AGC on whole-group norms,
      ``target = max(eps, clipping * (||w|| + eps))`` and
      ``scale = min(1, target / (||g|| + eps))``, one scalar per group.

    ``exclude_bias_bn=True`` leaves parameters with ``ndim <= 1`` (biases,
    norm scales) unclipped; grouped norms leave them out and they report
    scale 1. A non-finite gradient norm passes unchanged (scale 1) and
    increments ``nonfinite_count``.

    Args:
      clipping: the maximum ratio of gradient norm to weight norm (``> 0``).
      eps: floor of the weight norm (unitwise) / additive guard (grouped).
      scope: ``"unitwise"``, ``"global"``, ``"per_layer"``, ``"per_param"`` or
        a callable.
      exclude_bias_bn: do not clip leaves with ``ndim <= 1``.
      axis_name: average the gradient norms (per unit, or per group) over this
        mapped axis first, so every replica applies the same scale (SPEC 5).
      name: metrics prefix (default ``agc``).

    Returns:
      An ``optax.GradientTransformationExtraArgs`` whose ``update`` needs
      ``params``. Metrics per group (per leaf when unitwise): ``grad_norm``,
      ``weight_norm``, ``target``, ``scale``, ``clipped`` and the counters;
      unitwise also ``clipped_fraction`` (share of clipped units), with
      ``scale`` the smallest unit scale, ``target`` the leaf's
      ``clipping * max(||w||, eps)`` and the norms over the whole leaf.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> tx = clipjax.agc(clipping=0.01)
      >>> params = {"w": jnp.ones((3, 2))}
      >>> out, state = tx.update({"w": jnp.ones((3, 2))}, tx.init(params), params)
      >>> round(float(out["w"][0, 0]), 4)
      0.01

    References:
      Brock et al., `High-Performance Large-Scale Image Recognition Without
      Normalization <https://arxiv.org/abs/2102.06171>`_, 2021.
    """
    _validation.positive("clipping", clipping)
    _validation.non_negative("eps", eps)
    if scope == "unitwise":
        return _unitwise(clipping, eps, exclude_bias_bn, name, axis_name)

    def decide(before: Any, after: Any, g: jax.Array, count: jax.Array, aux: Any) -> Decision:
        weight_norm = aux["weight_norm"]
        target = jnp.maximum(eps, clipping * (weight_norm + eps))
        scale = jnp.minimum(1.0, target / (g + eps))
        return Decision(target, scale, {"weight_norm": weight_norm})

    rule = NormRule(
        "agc",
        decide,
        threshold_name="target",
        needs_params=True,
        leaf_filter=_exclude_small if exclude_bias_bn else None,
    )
    return _engine.norm_transform(rule, scope=scope, name=name, axis_name=axis_name)


def _unitwise(
    clipping: Any, eps: Any, exclude_bias_bn: bool, name: str | None, axis_name: str | None
) -> optax.GradientTransformationExtraArgs:
    fields = ("grad_norm", "weight_norm", "target", "scale", "clipped", "clipped_fraction")

    def init_fn(params: Any) -> Any:
        _metrics.ensure_serializable()
        leaves, _, _ = _grouping.leaves_with_names(params)
        for x in leaves:
            unit_axes(x)
        grouping = _grouping.make_grouping(params, "per_param")
        num = grouping.num_groups
        dtype = _grouping.norm_dtype(leaves)
        metrics = {f: jnp.zeros((num,), dtype) for f in fields}
        metrics["scale"] = jnp.ones((num,), dtype)
        metrics["clipped"] = jnp.zeros((num,), bool)
        metrics.update(_engine.counters(num))
        info = _metrics.GroupInfo("agc", name, grouping.names, grouping.fingerprint)
        return _engine.own_buffers(AGCState((), metrics, info, None))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        if params is None:
            raise ValueError("agc needs the parameters: call update(updates, state, params).")
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        p_leaves, _, _ = _grouping.leaves_with_names(params)
        grouping = _grouping.make_grouping(updates, "per_param")
        _engine._check_state(state, grouping, state.info)
        grouping.check_matches(_grouping.make_grouping(params, "per_param"), "update's params")
        dtype = _grouping.norm_dtype(leaves)
        out, rows = [], {f: [] for f in fields}
        for x, p in zip(leaves, p_leaves):
            g_unit = _unit_norm(x, dtype)
            w_unit = _unit_norm(p, dtype)
            if axis_name is not None:
                # Every replica decides from the same (averaged) unit norms.
                g_unit = jax.lax.pmean(g_unit, axis_name)
            max_norm = clipping * jnp.maximum(w_unit, eps)
            # optax's rule, formed on the unit-norm array: keep where g < max_norm.
            unit_scale = jnp.where(
                (g_unit < max_norm) | ~jnp.isfinite(g_unit),
                1.0,
                max_norm / jnp.maximum(g_unit, _DIV_EPS),
            )
            if exclude_bias_bn and jnp.ndim(x) <= 1:
                unit_scale = jnp.ones_like(unit_scale)
            out.append(x * unit_scale.astype(x.dtype))
            w_norm = jnp.sqrt(jnp.sum(w_unit * w_unit))
            smallest = jnp.min(unit_scale, initial=1.0)
            rows["grad_norm"].append(jnp.sqrt(jnp.sum(g_unit * g_unit)))
            rows["weight_norm"].append(w_norm)
            rows["target"].append(clipping * jnp.maximum(w_norm, eps))
            rows["scale"].append(smallest)
            rows["clipped_fraction"].append(jnp.mean(unit_scale < 1))
            rows["clipped"].append(smallest < 1)
        num = grouping.num_groups
        metrics = {
            f: (jnp.stack(v) if v else jnp.zeros((num,))).astype(state.metrics[f].dtype)
            for f, v in rows.items()
        }
        finite = jnp.isfinite(metrics["grad_norm"])
        metrics.update(_engine.advance_counters(state.metrics, finite, metrics["clipped"], finite))
        new_state = state._replace(metrics=metrics)
        return jax.tree_util.tree_unflatten(treedef, out), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
