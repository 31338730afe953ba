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

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _grouping, _metrics, _state_check, _stats, _validation
from clipjax._grouping import Grouping, Scope

Array = jax.Array

FEEDBACKS = ("observe_first", "raw", "clipped", "clip_target", "skip")
COUNTERS = ("count", "step", "clipped_count", "nonfinite_count", "capped_count")
# The guard in a ceiling's multiplier, max_grad_norm / (g + 1e-6) (zclip's and torch's).
CEILING_EPS = 1e-6


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


class ClipTransform(optax.GradientTransformationExtraArgs):
    """The transform every clipjax clipper returns: an optax transform.

    A ``ClipTransform`` is an ``optax.GradientTransformationExtraArgs`` (a
    named tuple of ``init`` and ``update``), so it goes wherever optax takes
    a transform: ``optax.chain``, ``MultiSteps``, ``inject_hyperparams``, flax
    optimizers. ``init(params)`` returns the clipper's state, a pytree whose
    metrics :func:`clipjax.metrics` reads; ``update(updates, state,
    params=None, **extra_args)`` returns the clipped updates and the new
    state (the clippers that need ``params``, such as :func:`clipjax.agc`, say
    so).

    It adds one attribute, ``configure``: ``configure(scope=...,
    axis_name=...)`` returns the same clipper with other grouping settings.
    :func:`clipjax.hist_clip` uses it to run a clipjax ``warmup_clip`` on its
    own groups.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.clip_by_global_norm(1.0)
      >>> isinstance(tx, clipjax.ClipTransform), isinstance(tx, optax.GradientTransformation)
      (True, True)
      >>> updates, state = tx.update({"w": jnp.full(4, 2.0)}, tx.init({"w": jnp.zeros(4)}))
      >>> float(clipjax.metrics(state)["clip_by_global_norm/global/scale"])
      0.25
    """

    configure: Callable[..., ClipTransform] | None = None


def check_feedback(feedback: Any, allowed: tuple[str, ...]) -> None:
    if feedback not in allowed:
        raise ValueError(f"feedback must be one of {allowed}, got {feedback!r}")


# The ceiling of the spike-defence setting (feedback="clipped") where the
# reference has none: the field's standard clip, ZClip's default.
DEFAULT_CEILING = 1.0


def resolve_ceiling(max_grad_norm: Any, feedback: str) -> float | None:
    """``max_grad_norm="auto"``: :data:`DEFAULT_CEILING` under ``feedback="clipped"``
    (a spike defence bounds every step from the first), None otherwise (the
    reference's behaviour); a number must be positive."""
    if isinstance(max_grad_norm, str):
        if max_grad_norm != "auto":
            raise ValueError(
                f'max_grad_norm must be a positive number, None or "auto", got {max_grad_norm!r}'
            )
        return DEFAULT_CEILING if feedback == "clipped" else None
    if max_grad_norm is not None:
        _validation.positive("max_grad_norm", max_grad_norm)
    return max_grad_norm


def check_name(name: Any) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")


def own_buffers(state: Any) -> Any:
    """Gives every state leaf its own buffer.

    ``init`` builds several fields from one ``zeros``; a jitted step that
    donates the state would then donate one buffer twice and fail.
    """
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


class FoldClaim:
    """A predicate handed to the :class:`clipjax.SkippableTransform` inside a wrapper.

    ``optax.inject_hyperparams(clipjax.adamw)`` or
    ``optax.MultiSteps(clipjax.adamw(...))`` has no ``update_if`` of its own,
    but it calls its inner optimizer's ``update``. While a claim is active
    (``with claim:``), a ``SkippableTransform``'s ``update`` runs its
    ``update_if(claim.pred, ...)`` instead, records that it did and which
    state leaves it returned (already selected), and the wrapper's own
    bookkeeping around it is then selected by :func:`run_if`.
    """

    def __init__(self, pred: Any) -> None:
        self.pred = pred
        self.claimed = False
        self.selected: list[Any] = []
        self.previous: Any = None

    def __enter__(self) -> FoldClaim:
        self.previous = getattr(_PENDING, "claim", None)
        _PENDING.claim = self
        return self

    def __exit__(self, *exc: Any) -> None:
        _PENDING.claim = self.previous


_PENDING = threading.local()


def fold_or_update(
    update: Callable[..., Any], update_if: Callable[..., Any], *args: Any, **kwargs: Any
) -> Any:
    """A ``SkippableTransform``'s ``update``: ``update_if`` under an active claim."""
    claim = getattr(_PENDING, "claim", None)
    if claim is None:
        return update(*args, **kwargs)
    claim.claimed = True
    _PENDING.claim = None  # the members inside fold through their own update_if
    try:
        out, new_state = update_if(claim.pred, *args, **kwargs)
    finally:
        _PENDING.claim = claim
    claim.selected.extend(jax.tree.leaves(new_state))
    return out, new_state


def run_if(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """``tx.update`` on the steps where ``pred`` holds; elsewhere its state stays as it was.

    The one way clipjax runs a transform on some steps only (skip_on_spike's
    inner optimizer, hist_clip's warm-up clip). Where ``pred`` is False the
    returned updates are not ``tx``'s: the caller masks them.

    Three routes, all free of full-size copies in the compiled step:

    * a transform with its own ``update_if`` (a
      :class:`clipjax.SkippableTransform`: :func:`clipjax.adam`,
      :func:`clipjax.adamw`, :func:`clipjax.chain`) folds ``pred`` into its
      arithmetic: each moment is selected element-wise in the loop that
      computes the update from it, and the updates come back zero where
      ``pred`` is False. No conditional: the whole step fuses with
      ``apply_updates`` and costs no pass over the updates beyond the
      optimizer's own;
    * a transform that calls a ``SkippableTransform``'s ``update`` inside it
      (``optax.inject_hyperparams(clipjax.adamw)(...)``,
      ``optax.MultiSteps(clipjax.adamw(...), k)``) runs every step under a
      :class:`FoldClaim`: the optimizer inside folds ``pred`` in, and the
      rest of the wrapper's state is selected. This is found by tracing its
      update once (the same trace then runs it);
    * a clipjax transform holds only small ``[groups]`` arrays: it runs on
      every step and its state is selected. Its norms are the ones the caller
      computes anyway (XLA merges the identical reductions) and its scaling
      fuses with the caller's, so it costs no extra pass over the gradients;
    * any other transform (an optimizer with full-size moments) runs under
      ``lax.cond`` whose pass-through branch is branch 0 (the false branch)
      and returns its operands as they are: XLA elides the buffer copies of
      such a branch only then. Skipping in branch 0, or returning fresh zeros,
      copies the optimizer state or the updates every step; computing the
      update unconditionally and selecting the moments afterwards copies them
      too, because the parameter update then recomputes the new moments from
      the old ones after they were overwritten in place. The conditional
      still writes the updates out and reads them back (it cannot fuse with
      ``apply_updates``): about two passes over the updates. The branches
      return the inner update's own output types (from the one trace of
      it, ``jax.make_jaxpr``, which the taken branch then runs): where
      it changes a dtype (``optax.adam(mu_dtype=jnp.float32)`` on bfloat16
      gradients returns float32 updates), the pass-through branch casts its
      operands to them; where the dtypes agree it casts nothing and stays
      copy-free.
    """
    _, out, new_state = run_if_routed(pred, tx, updates, state, params, **extra_args)
    return out, new_state


def run_if_routed(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[str, Any, Any]:
    """:func:`run_if`, also saying which route it took: ``fold``, ``select`` or ``cond``."""
    update_if = getattr(tx, "update_if", None)
    if update_if is not None:
        return ("fold", *update_if(pred, updates, state, params, **extra_args))
    if isinstance(tx, ClipTransform):
        return ("select", *run_and_select(pred, tx, updates, state, params, **extra_args))

    # One trace of the update, under a claim: a SkippableTransform inside it
    # (a wrapper's optimizer) folds pred in and marks the state it selected.
    operands, in_tree = jax.tree.flatten((updates, state))
    claim = FoldClaim(pred)
    folded: list[bool] = []

    def run(*leaves: Any) -> Any:
        out = tx.update(*jax.tree.unflatten(in_tree, leaves), params, **extra_args)
        active = getattr(_PENDING, "claim", None)
        selected = {id(leaf) for leaf in active.selected} if active is not None else set()
        folded[:] = [id(leaf) in selected for leaf in jax.tree.leaves(out[1])]
        return out

    with claim:
        traced, out_types = jax.make_jaxpr(run, return_shape=True)(*operands)
    out_tree = jax.tree.structure(out_types)
    update = _jaxpr_as_fun(traced)
    if jax.config.jax_disable_jit:  # pyright: ignore[reportAttributeAccessIssue]
        # Op by op, as the transform's own update runs there (its Python may
        # compute on concrete values where the traced program cannot).
        def update(*leaves: Any) -> list[Any]:
            with FoldClaim(pred) if claim.claimed else contextlib.nullcontext():
                return jax.tree.leaves(run(*leaves))

    if claim.claimed:
        # A wrapper around a SkippableTransform runs every step; the rest of
        # its state (its count, hyperparameters, accumulators) is selected.
        out, new_state = jax.tree.unflatten(out_tree, update(*operands))
        kept = iter(folded)
        new_state = jax.tree.map(
            lambda n, o: n if next(kept) else _select(pred, n, o), new_state, state
        )
        return "fold", out, new_state

    # The branches must return the same types: the inner update's, which may
    # differ from its inputs' (optax.adam(mu_dtype=float32) on bfloat16
    # gradients returns float32 updates; bfloat16 params with float32
    # gradients give bfloat16 moments...). The pass-through branch casts its
    # operands to them, which is no operation (and no copy) where they agree.
    if out_tree != in_tree:
        raise ValueError(
            "a transform run on some steps only returns updates and a state of another "
            f"tree structure than it was given ({in_tree} in, {out_tree} out), so a step "
            "it does not run cannot pass its inputs through"
        )

    def taken(leaves: list[Any]) -> list[Any]:
        return update(*leaves)

    def pass_through(leaves: list[Any]) -> list[Any]:
        return [_cast_like(x, t) for x, t in zip(leaves, jax.tree.leaves(out_types))]

    out_leaves = jax.lax.cond(pred, taken, pass_through, operands)
    return ("cond", *jax.tree.unflatten(out_tree, out_leaves))


def _jaxpr_as_fun(closed: Any) -> Callable[..., Any]:
    try:
        from jax.extend.core import jaxpr_as_fun
    except ImportError:  # jax < 0.4.38
        from jax.core import jaxpr_as_fun  # type: ignore[no-redef]
    return jaxpr_as_fun(closed)


def _select(pred: Array, new: Any, old: Any) -> Array:
    return jnp.where(pred, new, jnp.asarray(old, jnp.result_type(new)))


def _cast_like(x: Any, like: jax.ShapeDtypeStruct) -> Any:
    return x if jnp.result_type(x) == like.dtype else jnp.asarray(x).astype(like.dtype)


def run_and_select(
    pred: Array, tx: Any, updates: Any, state: Any, params: Any = None, **extra_args: Any
) -> tuple[Any, Any]:
    """``tx.update`` on every step; its new state only where ``pred`` holds.

    For transforms whose state is small (no full-size buffer to select).
    """
    out, new_state = tx.update(updates, state, params, **extra_args)
    return out, jax.tree.map(lambda n, o: jnp.where(pred, n, o), new_state, state)


def select_groups(mask: Array, new: Any, old: Any) -> Any:
    """Per-group select on stacked ``[groups, ...]`` arrays (never full tensors)."""

    def pick(n: Array, o: Array) -> Array:
        m = mask.reshape(mask.shape + (1,) * (jnp.ndim(n) - 1))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


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


def idle_metrics(metrics: dict[str, Array]) -> dict[str, Array]:
    """The metrics of a step on which the transform did not run: as at init.

    ``scale`` 1, ``clipped`` False, every other per-step field 0; counters
    keep their totals.
    """
    out = {}
    for key, value in metrics.items():
        if key in COUNTERS:
            out[key] = value
        elif key == "scale":
            out[key] = jnp.ones_like(value)
        else:
            out[key] = jnp.zeros_like(value)
    return out


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


def ceiling_scale(scale: Array, norm: Array, ceiling: float) -> tuple[Array, Array]:
    """``(scale, capped)`` of a step bounded by an absolute ceiling on its group norm.

    The multiplier is the smaller of the rule's ``scale`` and
    ``ceiling / (norm + 1e-6)`` where the norm exceeds the ceiling; ``capped``
    says the ceiling was the binding bound. A non-finite norm passes (scale
    1, section "non-finite norms" of the clippers' docs).
    """
    finite = jnp.isfinite(norm)
    over = finite & (norm > ceiling)
    bound = jnp.where(over, ceiling / (norm + CEILING_EPS), 1.0).astype(scale.dtype)
    capped = over & (bound <= scale)
    return jnp.minimum(scale, bound), capped


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


def _is_placeholder(params: Any) -> bool:
    # optax.tree_utils.tree_map_params calls init on a leafless placeholder.
    return type(params).__name__ == "_ParamsPlaceholder"


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
        placeholder = _is_placeholder(params)
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
