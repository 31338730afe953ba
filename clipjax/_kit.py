"""The small steps a norm clipper's ``init`` and ``update`` are written with.

A clipper calls these from its own ``init_fn`` / ``update_fn``, top to bottom,
the way optax's ``scale_by_adam`` reads: the norms of the groups, its own rule
(threshold, scale), what its statistics observe this step, the metrics, the
scaled leaves. Nothing here calls back into a clipper.

Every clipper state ends with the same four fields (its own variables come
first, typed and named after the algorithm's):

* ``metrics``: ``{field: [groups] array}`` of this step (``grad_norm``,
  ``threshold``, ``scale``, ``clipped``, ...) and the counters ``count``
  (finite observations), ``step``, ``clipped_count``, ``nonfinite_count``
  (``capped``/``capped_count`` with a ceiling), read by
  :func:`clipjax.metrics`, which also reads the statistics a state reports
  from its own variables (its ``statistics()`` method);
* ``info``: the static :class:`~clipjax.GroupInfo` (algorithm, prefix, group
  and leaf names), a pytree node with no leaves;
* ``leaf_index``: each leaf's group index as a runtime int32 scalar (empty for
  one group), so that leaves of one shape compile to the same fusions;
* ``leaf_metrics``: ``{"grad_norm": [leaves]}`` with ``leaf_norms=True``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple, get_args

import jax
import jax.numpy as jnp
import optax

from clipjax import _grouping, _metrics, _state_check, _validation
from clipjax._grouping import Grouping, Scope
from clipjax._types import Feedback, TargetFeedback

Array = jax.Array

# What a step may teach a clipper's statistics (``feedback``); each clipper
# accepts a subset.
FEEDBACKS: tuple[str, ...] = tuple(dict.fromkeys(get_args(Feedback) + get_args(TargetFeedback)))
COUNTERS = ("count", "step", "clipped_count", "nonfinite_count", "capped_count")
# The guard in a ceiling's multiplier, max_grad_norm / (g + 1e-6) (zclip's and torch's).
CEILING_EPS = 1e-6


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
# autoclip's and zscore_clip's gate under judge-first feedback: the threshold of
# the first steps comes from few norms, but each is judged before it is observed
# and a spike feeds back its clipped value, so a short gate costs little and keeps
# the large norms of early training out of the statistics.
JUDGE_FIRST_GATE = 10


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
    """``name`` is None or a non-empty str without ``/`` (the separator of metric names)."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name is not None and "/" in name:
        raise ValueError(
            f"name must not contain '/', which separates the parts of a metric name "
            f"('{{name}}/{{group}}/{{field}}'), got {name!r}; use '_' or '-'"
        )


# --------------------------------------------------------------------------- init


class Start(NamedTuple):
    """What ``init`` needs besides the clipper's own variables.

    Attributes:
      num_groups: the number of groups of the tree.
      dtype: the statistics' dtype (float32, float64 for float64 leaves).
      info: the state's ``info`` field.
      leaf_index: the state's ``leaf_index`` field.
      leaf_metrics: the state's ``leaf_metrics`` field.
      placeholder: ``init`` got optax's params placeholder (``tree_map_params``).
    """

    num_groups: int
    dtype: Any
    info: _metrics.GroupInfo
    leaf_index: Any
    leaf_metrics: dict[str, Array]
    placeholder: bool


def is_placeholder(params: Any) -> bool:
    """``init`` was given optax's leafless params placeholder (``tree_map_params``
    calls init on one): the state's names are then a leaf, so that the real
    state's names are mapped onto them."""
    return type(params).__name__ == "_ParamsPlaceholder"


def start(params: Any, scope: Scope, algo: str, name: str | None, leaf_norms: bool) -> Start:
    """The groups of ``params`` under ``scope`` and the shared fields of a new state."""
    placeholder = is_placeholder(params)
    leaves, _, _ = _grouping.leaves_with_names(params)
    grouping = _grouping.make_grouping(params, scope)
    info_class = _metrics.PlaceholderInfo if placeholder else _metrics.GroupInfo
    info = info_class(algo, name, grouping.names, grouping.leaf_names, grouping.leaf_shapes)
    dtype = _grouping.norm_dtype(leaves)
    leaf_metrics = {"grad_norm": jnp.zeros((len(leaves),), dtype)} if leaf_norms else {}
    index = _grouping.leaf_index(grouping, placeholder)
    return Start(grouping.num_groups, dtype, info, index, leaf_metrics, placeholder)


def metric_arrays(
    num_groups: int, dtype: Any, fields: tuple[str, ...], ceiling: bool = False
) -> dict[str, Array]:
    """The ``metrics`` of a new state: ``grad_norm``, ``threshold`` and ``fields``
    (zeros of ``dtype``), ``scale`` (ones), ``clipped`` (False), and the
    counters; ``capped`` and ``capped_count`` with a ceiling."""
    zeros = jnp.zeros((num_groups,), dtype)
    metrics = {"grad_norm": zeros, "threshold": zeros}
    metrics["scale"] = jnp.ones((num_groups,), dtype)
    metrics["clipped"] = jnp.zeros((num_groups,), bool)
    if ceiling:
        metrics["capped"] = jnp.zeros((num_groups,), bool)
    for field in fields:
        metrics[field] = zeros
    for counter in COUNTERS:
        if counter != "capped_count" or ceiling:
            metrics[counter] = jnp.zeros((num_groups,), jnp.int32)
    return metrics


def new_state(state_class: type, start: Start, own: dict[str, Any], **more: Any) -> Any:
    """A clipper's new state: its own arrays ``own``, the shared fields from
    ``start``, and ``more`` (hist_clip's ``nested``); each leaf its own buffer
    (a donated state), except on optax's params placeholder."""
    shared = {"info": start.info, "leaf_index": start.leaf_index}
    if "leaf_metrics" in state_class._fields:  # not in adaclip's and ada_norm's
        shared["leaf_metrics"] = start.leaf_metrics
    state = state_class(**own, **shared, **more)
    return state if start.placeholder else own_buffers(state)


def own_buffers(state: Any) -> Any:
    """Gives every state leaf its own buffer.

    ``init`` builds several fields from one ``zeros``; a jitted step that
    donates the state would then donate one buffer twice and fail.
    """
    return jax.tree.map(lambda x: jnp.array(x, copy=True), state)


# --------------------------------------------------------------------------- norms


class Norms(NamedTuple):
    """The gradient of one step, grouped.

    Attributes:
      norm: ``[groups]`` norms (averaged over ``axis_name`` when given).
      leaves: the gradient's leaves.
      treedef: their tree structure.
      grouping: the groups of the leaves.
      leaf_norms: ``[leaves]`` L2 norms, or None without ``leaf_norms``.
    """

    norm: Array
    leaves: list[Array]
    treedef: Any
    grouping: Grouping
    leaf_norms: Array | None


def check_tree(
    updates: Any, state: Any, state_class: type, layout: Callable[[int], Any], *, who: str,
    scope: Scope, dtypes: bool = True,
) -> tuple[list[Any], list[Any], Any, Grouping]:  # fmt: skip
    """The state checks of :func:`group_norms`, without the norms.

    ``state`` must be a ``state_class`` built by ``init`` for a tree like
    ``updates`` (``layout(num_groups)`` gives its arrays' shapes): otherwise a
    ``TypeError`` or ``ValueError`` says what was expected. With ``dtypes``
    every leaf must be inexact (``_grouping.check_inexact``); a clipper that
    needs ``params`` passes False and checks them after its params. Returns
    the leaves of ``updates``, their paths, the tree structure and the groups.
    """
    _state_check.check_state(state, state_class, who)
    info: _metrics.GroupInfo = state.info
    leaves, paths, treedef = _grouping.leaves_with_names(updates)
    grouping = _grouping.make_grouping(updates, scope)
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
    for field, value in layout(grouping.num_groups).items():
        _state_check.check_layout(who, field, getattr(state, field), value)
    if dtypes:
        _grouping.check_inexact(leaves, grouping, who)
    return leaves, paths, treedef, grouping


def group_norms(
    updates: Any,
    state: Any,
    state_class: type,
    layout: Callable[[int], Any],
    *,
    who: str,
    scope: Scope,
    axis_name: str | None = None,
    leaf_norms: bool = False,
) -> Norms:
    """Checks ``state`` against ``updates`` and returns the group norms of ``updates``.

    ``state`` must be a ``state_class`` built by ``init`` for a tree like
    ``updates`` (``layout(num_groups)`` gives the shapes and dtypes of its
    arrays, from ``jax.eval_shape``): otherwise a ``TypeError`` or
    ``ValueError`` says what was expected and how to restore a checkpoint.
    The norms take one pass over the gradient (squares summed in float32, or
    float64 for float64 leaves); with ``axis_name`` they are averaged over
    that mapped axis, so every replica applies the same scale.
    """
    leaves, _, treedef, grouping = check_tree(
        updates, state, state_class, layout, who=who, scope=scope
    )
    partial = _grouping.leaf_power_sums(leaves, 2.0, grouping)
    norm = _grouping.group_norms(leaves, grouping, 2.0, partial)
    per_leaf = None
    if leaf_norms:
        # A stacked leaf's per-slice sums add up to the whole leaf's.
        squares = [jnp.sum(s) if jnp.ndim(s) else s for s in partial]
        per_leaf = jnp.sqrt(jnp.stack(squares)) if squares else state.leaf_metrics["grad_norm"]
    if axis_name is not None:
        norm, per_leaf = jax.lax.pmean((norm, per_leaf), axis_name)
    return Norms(norm, leaves, treedef, grouping, per_leaf)


@functools.lru_cache(maxsize=64)
def _cached_layout(build: Callable[[int], Any], num_groups: int) -> Any:
    return jax.eval_shape(lambda: build(num_groups))


def layout_of(build: Callable[[int], Any]) -> Callable[[int], Any]:
    """``num_groups -> shapes and dtypes`` of the arrays ``build(num_groups)`` makes
    (its fields other than ``info``, ``leaf_index`` and ``leaf_metrics``), cached."""
    return functools.partial(_cached_layout, build)


# --------------------------------------------------------------------------- a step


def ceiling_scale(
    scale: Array, norm: Array, ceiling: Any, eps: float = CEILING_EPS
) -> tuple[Array, Array]:
    """``(scale, capped)`` of a step bounded by a ceiling on its group norm.

    The multiplier is the smaller of the rule's ``scale`` and
    ``ceiling / (norm + eps)`` where the norm exceeds the ceiling; ``capped``
    says the ceiling was the binding bound. A non-finite norm passes.
    """
    finite = jnp.isfinite(norm)
    over = finite & (norm > ceiling)
    bound = jnp.where(over, ceiling / (norm + eps), 1.0).astype(scale.dtype)
    capped = over & (bound <= scale)
    return jnp.minimum(scale, bound), capped


def headroom(ceiling: Any, level: Array) -> Array:
    """An absolute ceiling over the clipper's running level of the norm (+inf before
    any level): below 1 the ceiling binds on most steps (a static clip); far above 1
    in the first steps it bounds nothing there."""
    positive = level > 0
    return jnp.where(positive, ceiling / jnp.where(positive, level, 1.0), jnp.inf)


def observation(
    feedback: str,
    norm: Array,
    *,
    boundary: Array | None = None,
    target: Array | None = None,
    fires: Array | None = None,
    guard_nans: bool = True,
) -> tuple[Array, Array]:
    """What a step teaches the statistics: ``(value, observed)``, per group.

    ``fires`` marks the groups the rule judges a spike this step (None: none);
    ``boundary`` is the norm above which it fires, ``target`` the value it clips to.

    * ``"raw"`` (and ``"observe_first"``): the norm;
    * ``"clipped"``: ``min(norm, boundary)`` where it fires: a spike teaches no
      more than a norm at the boundary would, and a norm at the boundary still
      widens a spread-based boundary, so a lasting rise of the norm is learnt;
    * ``"clip_target"``: ``target`` where it fires (the reference zclip rule);
    * ``"skip"``: the norm, but nothing is observed where it fires.

    A non-finite norm is never observed, unless ``guard_nans=False`` (smartclip
    unguarded: it is observed, and the statistic floors it, a NaN as ``eps``).
    """
    fires = jnp.zeros(jnp.shape(norm), bool) if fires is None else fires
    value = norm
    if feedback == "clipped":
        assert boundary is not None
        value = jnp.where(fires, jnp.minimum(norm, boundary), norm)
    elif feedback == "clip_target":
        assert target is not None
        value = jnp.where(fires, target, norm)
    observed = jnp.isfinite(norm) if guard_nans else jnp.ones(jnp.shape(norm), bool)
    if feedback == "skip":
        observed = observed & ~fires
    return value, observed


def gate_defaults(feedback: str, warmup_steps: Any, min_history: Any) -> tuple[int, int]:
    """autoclip's and zscore_clip's gate, where ``warmup_steps`` / ``min_history`` are
    None: smartclip's 100 / 50 under ``"observe_first"``, :data:`JUDGE_FIRST_GATE` each
    under the judge-first feedbacks."""
    first = feedback == "observe_first"
    if warmup_steps is None:
        warmup_steps = 100 if first else JUDGE_FIRST_GATE
    if min_history is None:
        min_history = 50 if first else JUDGE_FIRST_GATE
    return warmup_steps, min_history


def select_groups(mask: Array, new: Any, old: Any) -> Any:
    """Per group, ``new`` where ``mask`` holds, else ``old`` (stacked ``[groups, ...]``
    arrays, never full tensors)."""

    def pick(n: Array, o: Array) -> Array:
        m = mask.reshape(mask.shape + (1,) * (jnp.ndim(n) - 1))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


def step_metrics(
    old: dict[str, Array],
    *,
    norm: Array,
    threshold: Array,
    scale: Array,
    observed: Array,
    capped: Array | None = None,
    **fields: Array,
) -> dict[str, Array]:
    """This step's ``metrics``: the per-step fields, and the counters advanced.

    ``clipped`` is ``scale < 1``; ``nonfinite_count`` counts non-finite norms,
    ``count`` the observations. Every value is cast to the dtype it has in
    ``old`` (the state's structure never changes).
    """
    clipped = scale < 1
    new = {"grad_norm": norm, "threshold": threshold, "scale": scale, "clipped": clipped}
    if capped is not None:
        new["capped"] = capped
    new.update(fields)
    increments = {
        "count": observed,
        "step": True,
        "clipped_count": clipped,
        "nonfinite_count": ~jnp.isfinite(norm),
        "capped_count": False if capped is None else capped,
    }
    for counter, inc in increments.items():
        if counter in old:
            new[counter] = old[counter] + jnp.asarray(inc).astype(jnp.int32)
    return {k: jnp.asarray(v).astype(old[k].dtype) for k, v in new.items()}


def counters(num_groups: int, names: tuple[str, ...]) -> dict[str, Array]:
    """The counters ``names`` of a new state's metrics, int32 zeros per group."""
    return {counter: jnp.zeros((num_groups,), jnp.int32) for counter in names}


def counted(
    old: dict[str, Array],
    finite: Array,
    clipped: Array | None = None,
    /,
    *,
    observed: Array | None = None,
    **fields: Array,
) -> dict[str, Array]:
    """This step's ``metrics``: ``fields``, then the counters of ``old`` advanced.

    ``count`` counts the groups ``observed`` marks (default: the finite norms),
    ``nonfinite_count`` the non-finite ones, ``clipped_count`` the groups
    ``clipped`` marks. Every value is cast to its dtype in ``old``.
    """
    increments = {
        "count": finite if observed is None else observed,
        "step": True,
        "clipped_count": jnp.zeros_like(finite) if clipped is None else clipped,
        "nonfinite_count": ~finite,
    }
    new = dict(fields)
    for counter, inc in increments.items():
        if counter in old:
            new[counter] = old[counter] + jnp.asarray(inc).astype(jnp.int32)
    return {k: jnp.asarray(v).astype(old[k].dtype) for k, v in new.items()}


def scaled(norms: Norms, scale: Array, state: Any) -> Any:
    """The gradient with each group multiplied by its scale (one multiply a leaf)."""
    scale = _grouping.computed_once(scale)
    leaves = _grouping.apply_scales(norms.leaves, norms.grouping, scale, state.leaf_index)
    return jax.tree_util.tree_unflatten(norms.treedef, leaves)


def shared_fields(state: Any, norms: Norms, metrics: dict[str, Array]) -> dict[str, Any]:
    """The new state's ``metrics``, ``leaf_index`` and ``leaf_metrics`` (for ``_replace``)."""
    leaf_metrics = state.leaf_metrics
    if norms.leaf_norms is not None:
        leaf_metrics = {"grad_norm": norms.leaf_norms.astype(leaf_metrics["grad_norm"].dtype)}
    # Returned through a copy, not passed through: a pass-through output cannot
    # reuse its donated input buffer (and JAX warns about it).
    index = _grouping.returned_index(state.leaf_index)
    return {"metrics": metrics, "leaf_index": index, "leaf_metrics": leaf_metrics}


# ------------------------------------------------------------ element-wise transforms

# An element-wise step: (leaves, grouping, statistics dtype, leaf index) -> (the new
# leaves, its [groups] metrics ("clipped" where it clips), [groups] finite norms,
# [leaves] L2 norms or None).
ElementStep = Callable[[list[Array], Grouping, Any, Any], tuple[list[Array], dict, Array, Any]]


def element_transform(
    algo: str,
    state_class: type,
    step: ElementStep,
    fields: dict[str, Any],
    counter_names: tuple[str, ...],
    *,
    name: str | None,
    scope: Scope,
    leaf_norms: bool = False,
    axis_name: str | None = None,
) -> ClipTransform:
    """A transform that changes elements (not a norm's scale) by ``step``: the
    element clippers and the normalisers. Its state holds the ``[groups]``
    ``fields`` (``{metric: dtype}``, None: the statistics dtype) and the
    counters ``counter_names``. ``configure`` may give another ``scope``;
    ``axis_name`` is accepted and has no effect (each replica changes its own
    elements, no norm is shared)."""
    del axis_name
    if isinstance(scope, _grouping.Stacked):
        raise ValueError(
            f"{algo}: clipjax.stacked scopes apply to the norm-based clippers; "
            f"{algo} changes elements, use scope='per_param' or 'per_layer'"
        )
    who = name or algo

    def arrays(num_groups: int, dtype: Any = jnp.float32) -> dict[str, Any]:
        metrics = {
            field: jnp.zeros((num_groups,), dtype if kind is None else kind)
            for field, kind in fields.items()
        }
        return {"metrics": {**metrics, **counters(num_groups, counter_names)}}

    layout = layout_of(arrays)

    def init_fn(params: Any) -> Any:
        start_ = start(params, scope, algo, name, leaf_norms)
        return new_state(state_class, start_, arrays(start_.num_groups, start_.dtype))

    def update_fn(updates: Any, state: Any, params: Any = None, **extra_args: Any) -> Any:
        del params, extra_args
        leaves, _, treedef, grouping = check_tree(
            updates, state, state_class, layout, who=who, scope=scope
        )
        dtype = _grouping.norm_dtype(leaves)
        out, values, finite, leaf_norm = step(leaves, grouping, dtype, state.leaf_index)
        metrics = counted(state.metrics, finite, values.get("clipped"), **values)
        per_leaf = leaf_norm if leaf_norms else None
        norms = Norms(values["grad_norm"], leaves, treedef, grouping, per_leaf)
        new = state._replace(**shared_fields(state, norms, metrics))
        return jax.tree_util.tree_unflatten(treedef, out), new

    tx = ClipTransform(init_fn, update_fn)
    tx.configure = lambda **overrides: element_transform(
        algo, state_class, step, fields, counter_names,
        **{"name": name, "scope": scope, "leaf_norms": leaf_norms, **overrides},
    )  # fmt: skip
    return tx
