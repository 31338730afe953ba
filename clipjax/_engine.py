"""The one engine every clipjax transform runs on.

An algorithm is a rule, and there are two kinds:

* a :class:`NormRule` clips each group by one scalar. It states its
  statistics (a :class:`clipjax._stats.Statistic`) and how they and the
  current group norm judge a step (a :class:`Judgement`: threshold, scale,
  whether it fired and what it clips to). The engine does everything else:
  group norms in one pass, ``axis_name`` averaging, the warm-up gate, the
  order (observe first, or judge first and then feed back the raw norm, the
  norm capped at the spike boundary, the rule's clip target or nothing),
  keeping non-finite norms out of the statistics,
  scaling with one multiply per leaf, counters and metrics;
* an :class:`ElementwiseRule` changes elements (clamping, normalising,
  per-unit AGC). It returns the new leaves and its ``[groups]`` metrics; the
  engine does grouping, tree checks, counters and metrics.

Both kinds share one state layout (see :func:`transform`) and one
``init``/``update`` skeleton.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from clipjax import _grouping, _metrics, _state_check, _stats
from clipjax._conditional import idle_metrics, run_if
from clipjax._grouping import Grouping, Scope
from clipjax._kit import (
    COUNTERS,
    FEEDBACKS,
    ClipTransform,
    ceiling_scale,
    check_feedback,  # noqa: F401 (the clippers not yet written on the kit call these here)
    check_name,
    is_placeholder,
    own_buffers,
    resolve_ceiling,  # noqa: F401
    select_groups,
)

Array = jax.Array


class Judgement(NamedTuple):
    """How a norm rule judges one step, per group (all ``[groups]``).

    Attributes:
      threshold: the threshold to report (``target`` for AGC), or None: the
        group norm above which this step is clipped.
      scale: the multiplier to apply, assuming a finite norm and an open gate.
      fires: where the rule judges the step a spike (feedback applies there);
        default ``scale < 1``.
      boundary: the spike boundary ``feedback="clipped"`` caps a firing
        step's observation at (``min(norm, boundary)``); default ``threshold``.
      target: what ``feedback="clip_target"`` observes where the rule fires
        (the value it clips to), or None where the rule has no such value.
      observation: what is observed where it does not fire; default the norm.
      warming: groups whose warm-up transform applies this step, or None.
      extra: per-step metrics beyond the statistics (zclip's ``z``, ...).
    """

    threshold: Array | None
    scale: Array
    fires: Array | None = None
    boundary: Array | None = None
    target: Array | None = None
    observation: Array | None = None
    warming: Array | None = None
    extra: dict[str, Array] = {}


Judge = Callable[[Any, Array, Array, dict[str, Array]], Judgement]


@dataclasses.dataclass(frozen=True)
class NormRule:
    """An algorithm that scales each group by one scalar.

    Attributes:
      algo: the factory's name, the metrics prefix.
      judge: ``(stats, norm, count, aux) -> Judgement``. ``stats`` are the
        statistics before this step (after it with ``"observe_first"``);
        ``count`` the group's finite observations before this step; ``aux``
        holds ``weight_norm`` when ``needs_params``.
      statistic: the statistics, or None for a stateless rule.
      feedback: ``"observe_first"``, ``"raw"``, ``"clipped"``,
        ``"clip_target"`` or ``"skip"``.
      gate: finite observations a group needs before the rule may clip
        (scale 1 until then), or None when the rule handles its own warm-up.
      extra_fields: the names in ``Judgement.extra``.
      threshold_name: the metric name of ``Judgement.threshold``.
      ord: the norm's order.
      needs_params: whether ``judge`` needs the group norms of ``params``.
      leaf_filter: ``(path, leaf) -> bool``; leaves it rejects are left out of
        the norms and pass through unscaled.
      ceiling: an absolute bound on every step's group norm (``max_grad_norm``),
        applied from the first step whatever the gate, or None. The metrics
        then add ``capped`` (the ceiling was the binding bound of this step)
        and ``capped_count``; ``threshold`` is at most the ceiling.
    """

    algo: str
    judge: Judge
    statistic: _stats.Statistic | None = None
    feedback: str = "raw"
    gate: Any = None
    extra_fields: tuple[str, ...] = ()
    threshold_name: str | None = "threshold"
    ord: float = 2.0
    needs_params: bool = False
    leaf_filter: Callable[[Any, Any], bool] | None = None
    ceiling: float | None = None


class Step(NamedTuple):
    """What an element-wise kernel returns for one update.

    Attributes:
      leaves: the new leaves, each in its input dtype.
      metrics: ``{field: [groups] array}`` for this step.
      finite: ``[groups]`` bool, the group's norm is finite.
      clipped: ``[groups]`` bool, some element was clipped (None: never).
      leaf_norms: ``[leaves]`` L2 norms, when the kernel has them anyway.
    """

    leaves: list[Array]
    metrics: dict[str, Array]
    finite: Array
    clipped: Array | None = None
    leaf_norms: Array | None = None


@dataclasses.dataclass(frozen=True)
class ElementwiseRule:
    """An algorithm that changes elements.

    Attributes:
      algo: the factory's name, the metrics prefix.
      kernel: ``(leaves, param_leaves, grouping, dtype) -> Step``.
      fields: ``{metric: dtype}`` (None: the statistics dtype).
      needs_params: whether ``kernel`` needs ``params``.
      clipped_count: whether the state counts clipped steps.
      check_leaves: ``(leaves) -> None``, run at ``init``.
      indexed: ``kernel`` also takes ``index=``, each leaf's group index as
        a runtime int32 scalar (from the state), for
        :func:`clipjax._grouping.leaf_scales`.
    """

    algo: str
    kernel: Callable[..., Step]
    fields: dict[str, Any]
    needs_params: bool = False
    clipped_count: bool = True
    check_leaves: Callable[[list[Any]], None] | None = None
    indexed: bool = False


Rule = NormRule | ElementwiseRule


def _advance_counters(
    old: dict[str, Array], observed: Array, clipped: Array, finite: Array, capped: Any = False
) -> dict[str, Array]:
    increments = {
        "count": observed,
        "step": True,
        "clipped_count": clipped,
        "nonfinite_count": ~finite,
        "capped_count": capped,
    }
    return {k: old[k] + jnp.asarray(v).astype(jnp.int32) for k, v in increments.items() if k in old}


def _state_metrics(rule: Rule, num_groups: int, dtype: Any, stats: Any) -> dict[str, Array]:
    zeros = jnp.zeros((num_groups,), dtype)
    if isinstance(rule, ElementwiseRule):
        metrics = {
            f: (jnp.ones if f == "scale" else jnp.zeros)(
                (num_groups,), dtype if kind is None else kind
            )
            for f, kind in rule.fields.items()
        }
    else:
        metrics = {"grad_norm": zeros}
        if rule.threshold_name is not None:
            metrics[rule.threshold_name] = zeros
        metrics["scale"] = jnp.ones((num_groups,), dtype)
        metrics["clipped"] = jnp.zeros((num_groups,), bool)
    ceiling = getattr(rule, "ceiling", None) is not None
    if ceiling:
        metrics["capped"] = jnp.zeros((num_groups,), bool)
    for counter in COUNTERS:
        if counter == "clipped_count" and not getattr(rule, "clipped_count", True):
            continue
        if counter == "capped_count" and not ceiling:
            continue
        metrics[counter] = jnp.zeros((num_groups,), jnp.int32)
    if isinstance(rule, NormRule):
        if rule.statistic is not None:
            for key, value in rule.statistic.report(stats).items():
                metrics[key] = jnp.zeros_like(value)
        for key in rule.extra_fields:
            metrics[key] = zeros
    return metrics


def _norm_step(
    rule: NormRule, state: Any, norm: Array, aux: dict[str, Array], guard_nans: bool
) -> tuple[Array, Any, dict[str, Array], Judgement]:
    """One step of a norm rule from group norms alone: scale, stats, metrics."""
    finite = jnp.isfinite(norm)
    observable = finite if guard_nans else jnp.ones_like(finite)
    count = state.metrics["count"]
    before = state.stats
    stat = rule.statistic
    observe_first = rule.feedback == "observe_first"
    if rule.gate is None:
        gate_open = jnp.ones_like(finite)
    elif observe_first:
        # smartclip: the gate counts the current observation.
        gate_open = count + 1 >= rule.gate
    else:
        gate_open = count >= jnp.maximum(rule.gate, 1)

    if stat is None:
        after = before
        judgement = rule.judge(before, norm, count, aux)
        observed = observable
    elif observe_first:
        after = select_groups(observable, stat.observe(before, norm, count), before)
        judgement = rule.judge(after, norm, count, aux)
        observed = observable
    else:
        judgement = rule.judge(before, norm, count, aux)
        fires = judgement.scale < 1 if judgement.fires is None else judgement.fires
        fires = fires & gate_open & finite
        x = norm if judgement.observation is None else judgement.observation
        if rule.feedback == "clipped":
            # min(x, B): a spike teaches no more than a norm at the boundary
            # would, and a norm at the boundary still widens it, so a lasting
            # rise of the norm is learnt.
            boundary = judgement.threshold if judgement.boundary is None else judgement.boundary
            assert boundary is not None, f"{rule.algo}: feedback='clipped' needs a boundary"
            x = jnp.where(fires, jnp.minimum(x, boundary), x)
        elif rule.feedback == "clip_target":
            assert judgement.target is not None, f"{rule.algo}: 'clip_target' needs a target"
            x = jnp.where(fires, judgement.target, x)
        observed = observable & ~fires if rule.feedback == "skip" else observable
        after = select_groups(observed, stat.observe(before, x, count), before)

    scale = jnp.where(finite & gate_open, judgement.scale, 1.0).astype(norm.dtype)
    threshold = judgement.threshold
    capped = False
    if rule.ceiling is not None:
        scale, capped = ceiling_scale(scale, norm, rule.ceiling)
        if threshold is not None:
            threshold = jnp.where(gate_open, jnp.minimum(threshold, rule.ceiling), rule.ceiling)
    clipped = scale < 1
    metrics: dict[str, Any] = {"grad_norm": norm}
    if rule.threshold_name is not None and threshold is not None:
        metrics[rule.threshold_name] = threshold
    metrics["scale"] = scale
    metrics["clipped"] = clipped
    if rule.ceiling is not None:
        metrics["capped"] = capped
    extra = dict(judgement.extra)
    if rule.ceiling is not None and "clip_to" in extra:
        # The norm the step leaves with: the ceiling where it was the bound.
        extra["clip_to"] = jnp.where(capped, rule.ceiling, extra["clip_to"])
    metrics.update(_advance_counters(state.metrics, observed, clipped, finite, capped))
    if stat is not None:
        metrics.update(stat.report(after))
    metrics.update(extra)
    metrics = {k: jnp.asarray(v).astype(state.metrics[k].dtype) for k, v in metrics.items()}
    return scale, after, metrics, judgement


def _elementwise_metrics(state: Any, step: Step) -> dict[str, Array]:
    old = dict(state.metrics)
    clipped = jnp.zeros_like(step.finite) if step.clipped is None else step.clipped
    metrics = dict(step.metrics)
    metrics.update(_advance_counters(old, step.finite, clipped, step.finite))
    return {k: jnp.asarray(v).astype(old[k].dtype) for k, v in metrics.items()}


def transform(
    rule: Rule,
    state_class: type,
    *,
    scope: Scope = "global",
    name: str | None = None,
    axis_name: str | None = None,
    guard_nans: bool = True,
    leaf_norms: bool = False,
    warmup: Any = None,
) -> ClipTransform:
    """Builds the optax transform that runs ``rule`` over groups of leaves.

    The state is ``state_class(stats, metrics, info, leaf_index,
    leaf_metrics[, nested])``: the rule's statistics (stacked ``[groups, ...]``
    arrays), the ``[groups]`` metrics, the static :class:`GroupInfo`, each
    leaf's group index, the ``[leaves]`` norms when ``leaf_norms`` (else an
    empty dict) and, with ``warmup``, the warm-up transform's state.

    Args:
      rule: the algorithm.
      state_class: its ``NamedTuple`` state class.
      scope: ``"global"``, ``"per_param"``, ``"per_layer"`` or a callable.
      name: metrics prefix replacing ``rule.algo``.
      axis_name: average the group norms over this mapped axis first.
      guard_nans: keep non-finite norms out of the statistics.
      leaf_norms: record each leaf's pre-clip L2 norm.
      warmup: a transform applied to the groups whose ``Judgement.warming``
        is set, under ``lax.cond`` (it costs nothing once warm-up is over). A
        clipjax transform is rebuilt for ``scope`` and ``axis_name``, so that
        it clips each group by the same (averaged) norms; its metrics read as
        at init for groups it did not run on this step.
    """
    check_name(name)
    if isinstance(rule, ElementwiseRule) and isinstance(scope, _grouping.Stacked):
        raise ValueError(
            f"{rule.algo}: clipjax.stacked scopes apply to the norm-based clippers; "
            f"{rule.algo} changes elements, use scope='per_param' or 'per_layer'"
        )
    if isinstance(rule, NormRule):
        _grouping.validate_scope(scope)
        if rule.feedback not in FEEDBACKS:
            raise ValueError(f"feedback must be one of {FEEDBACKS}, got {rule.feedback!r}")
    if warmup is not None and getattr(warmup, "configure", None) is not None:
        warmup = warmup.configure(scope=scope, axis_name=axis_name)

    def arrays(num_groups: int, dtype: Any) -> tuple[Any, dict[str, Array]]:
        """The statistics and metrics ``init`` builds for ``num_groups`` groups."""
        stats = (
            ()
            if isinstance(rule, ElementwiseRule) or rule.statistic is None
            else (rule.statistic.init(num_groups, dtype))
        )
        return stats, _state_metrics(rule, num_groups, dtype, stats)

    @functools.lru_cache(maxsize=8)
    def layout(num_groups: int) -> tuple[Any, dict[str, Any]]:
        return jax.eval_shape(lambda: arrays(num_groups, jnp.float32))

    def init_fn(params: Any) -> Any:
        placeholder = is_placeholder(params)
        leaves, _, _ = _grouping.leaves_with_names(params)
        grouping = _grouping.make_grouping(params, scope)
        if isinstance(rule, ElementwiseRule) and rule.check_leaves is not None:
            rule.check_leaves(leaves)
        dtype = _grouping.norm_dtype(leaves)
        stats, metrics = arrays(grouping.num_groups, dtype)
        # On optax's placeholder (tree_map_params) the names are a leaf, so
        # that the real state's names are mapped onto them.
        info_class = _metrics.PlaceholderInfo if placeholder else _metrics.GroupInfo
        info = info_class(
            rule.algo, name, grouping.names, grouping.leaf_names, grouping.leaf_shapes
        )
        leaf_metrics = {"grad_norm": jnp.zeros((len(leaves),), dtype)} if leaf_norms else {}
        index = _grouping.leaf_index(grouping, placeholder)
        fields = [stats, metrics, info, index, leaf_metrics]
        if warmup is not None:
            fields.append(warmup.init(params))
        if placeholder:
            return state_class(*fields)  # a template for tree_map_params, never updated
        return own_buffers(state_class(*fields))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del extra_args
        _state_check.check_state(state, state_class, name or rule.algo)
        leaves, paths, treedef = _grouping.leaves_with_names(updates)
        grouping = _grouping.make_grouping(updates, scope)
        info: _metrics.GroupInfo = state.info
        who = info.name or info.algo
        grouping.check_matches(info.leaves, info.shapes, who)
        for field, value in state.metrics.items():
            if jnp.shape(_metrics.unwrap(value))[:1] != (grouping.num_groups,):
                groups = ", ".join(grouping.names[:4]) + (", ..." * (grouping.num_groups > 4))
                raise ValueError(
                    f"{who}: the state does not fit the tree passed to update: its metric "
                    f"{field!r} has shape {jnp.shape(value)}, expected [{grouping.num_groups}] "
                    f"for the groups of this tree ({groups}); was the state restored from "
                    "another model?"
                )
        want_stats, want_metrics = layout(grouping.num_groups)
        _state_check.check_layout(who, "stats", state.stats, want_stats)
        _state_check.check_layout(who, "metrics", state.metrics, want_metrics)
        p_leaves: list[Any] | None = None
        if rule.needs_params:
            if params is None:
                raise ValueError(
                    f"{who} needs the parameters: call update(updates, state, params)."
                )
            p_leaves, _, _ = _grouping.leaves_with_names(params)
            _grouping.make_grouping(params, scope).check_matches(
                info.leaves, info.shapes, who, "update's params"
            )
        leaf_metrics = state.leaf_metrics
        if isinstance(rule, ElementwiseRule):
            index = {"index": state.leaf_index} if rule.indexed else {}
            step = rule.kernel(leaves, p_leaves, grouping, _grouping.norm_dtype(leaves), **index)
            new_leaves = step.leaves
            new_state = state._replace(metrics=_elementwise_metrics(state, step))
            if leaf_norms:
                leaf_metrics = {"grad_norm": step.leaf_norms}
        else:
            _grouping.check_inexact(leaves, grouping, who)
            keep: list[bool] | None = None
            if rule.leaf_filter is not None:
                # A stacked leaf is judged by one layer's slice (what the unstacked model has).
                views = _grouping.layer_views(leaves, grouping)
                keep = [bool(rule.leaf_filter(p, x)) for p, x in zip(paths, views)]
            partial = _grouping.leaf_power_sums(leaves, rule.ord, grouping)
            kept = partial if keep is None else [s * k for s, k in zip(partial, keep)]
            norm = _grouping.group_norms(leaves, grouping, rule.ord, kept)
            aux = {}
            if p_leaves is not None:
                p_keep = (
                    p_leaves
                    if keep is None
                    else [p if k else jnp.zeros((), p.dtype) for p, k in zip(p_leaves, keep)]
                )
                aux["weight_norm"] = _grouping.group_norms(p_keep, grouping)
            if leaf_norms:
                squares = partial if rule.ord == 2.0 else _grouping.leaf_power_sums(leaves)
                # A stacked leaf's per-slice sums add up to the whole leaf's.
                squares = [jnp.sum(s) if jnp.ndim(s) else s for s in squares]
                leaf_metrics = {"grad_norm": jnp.sqrt(_stack(squares, state.leaf_metrics))}
            if axis_name is not None:
                norm, aux, leaf_metrics = jax.lax.pmean((norm, aux, leaf_metrics), axis_name)
            scale, stats, metrics, judgement = _norm_step(rule, state, norm, aux, guard_nans)
            scale = _grouping.materialize(scale)
            new_state = state._replace(stats=stats, metrics=metrics)
            if keep is not None:
                scale_leaves = _grouping.apply_scales(leaves, grouping, scale, state.leaf_index)
                new_leaves = [s if k else x for x, s, k in zip(leaves, scale_leaves, keep)]
            else:
                new_leaves = _grouping.apply_scales(leaves, grouping, scale, state.leaf_index)
            if warmup is not None and judgement.warming is not None:
                warming = judgement.warming & jnp.isfinite(norm)
                # With a ceiling, the warm-up transform sees the capped gradient.
                warm_in = (
                    updates
                    if rule.ceiling is None
                    else jax.tree_util.tree_unflatten(treedef, new_leaves)
                )
                new_leaves, nested = _run_warmup(
                    warmup,
                    warm_in,
                    state.nested,
                    params,
                    new_leaves,
                    grouping,
                    warming,
                    state.leaf_index,
                )
                new_state = new_state._replace(nested=nested)
        # Returned through a copy, not passed through: a pass-through output
        # cannot reuse its donated input buffer (and JAX warns about it).
        new_state = new_state._replace(
            leaf_index=_grouping.returned_index(state.leaf_index),
            leaf_metrics={
                k: jnp.asarray(v).astype(state.leaf_metrics[k].dtype)
                for k, v in leaf_metrics.items()
            },
        )
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

    tx = ClipTransform(init_fn, update_fn)
    settings = dict(
        scope=scope,
        name=name,
        axis_name=axis_name,
        guard_nans=guard_nans,
        leaf_norms=leaf_norms,
        warmup=warmup,
    )
    tx.configure = lambda **overrides: transform(rule, state_class, **{**settings, **overrides})
    return tx


def _stack(values: list[Array], like: dict[str, Array]) -> Array:
    if not values:
        return like["grad_norm"]
    return jnp.stack([jnp.asarray(v) for v in values])


def _run_warmup(
    warmup: Any,
    updates: Any,
    nested: Any,
    params: Any,
    scaled: list[Array],
    grouping: Grouping,
    warming: Array,
    index: tuple[Array, ...] = (),
) -> tuple[list[Array], Any]:
    """The warm-up transform on the groups that warm up, only while one does."""

    def quiet(state: Any) -> Any:
        # Groups the warm-up transform did not run on report idle metrics: a
        # stale clipped=True from the last warm-up step would be a lie.
        def fix(node: Any) -> Any:
            if not _metrics.is_clipjax_state(node):
                return node
            idle = idle_metrics(node.metrics)
            if len(node.info.groups) == grouping.num_groups:
                return node._replace(metrics=select_groups(warming, node.metrics, idle))
            return node._replace(metrics=idle)

        return jax.tree.map(fix, state, is_leaf=_metrics.is_clipjax_state)

    out, new_nested = run_if(jnp.any(warming), warmup, updates, nested, params)
    out_leaves = jax.tree_util.tree_leaves(out)
    mask = _grouping.leaf_scales(grouping, warming, index)
    # A select with a per-leaf mask that fuses into the scaling multiply.
    leaves = [jnp.where(m, w, s) for m, w, s in zip(mask, out_leaves, scaled)]
    return leaves, quiet(select_groups_state(warming, new_nested, nested))


def select_groups_state(mask: Array, new: Any, old: Any) -> Any:
    """Keeps a nested clipjax state's ``[groups]`` arrays from ``old`` where ``mask`` is off.

    Other transforms' states advance as a whole (the step ran for some group).
    """

    def pick(n: Any, o: Any) -> Any:
        if _metrics.is_clipjax_state(n) and n.metrics["step"].shape == mask.shape:
            metrics = select_groups(mask, n.metrics, o.metrics)
            return n._replace(metrics=metrics)
        return n

    return jax.tree.map(pick, new, old, is_leaf=_metrics.is_clipjax_state)
