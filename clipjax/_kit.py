"""What a clipper's factory and step are written with: plain functions.

A factory checks its own arguments and its grouping settings (:func:`setup`).
Its ``init`` builds its state, field by field, from :func:`common`; its
``update`` reads top to bottom, as optax's ``scale_by_adam`` does:
:func:`norms`, its own rule (threshold, scale), what its statistics observe
(:func:`observation`), the metrics (:func:`step_metrics`), the new state
built field by field, and the updates (:func:`scaled`). Nothing here calls
back into a clipper.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import optax

from clipjax import _checks, _grouping, _metrics, _xla
from clipjax._grouping import Grouping, KeyPath, Scope

Array = jax.Array

# What a clipper's statistics learn from a step (see :func:`observation`): the norm
# before judging it (observe_first), the raw norm, the norm capped at the spike
# boundary (clipped), or nothing on a spike (skip). Each clipper takes a subset.
Feedback = Literal["observe_first", "raw", "clipped", "skip"]
# The clippers that always judge a step before observing it.
SpikeFeedback = Literal["raw", "clipped", "skip"]
# zclip and hist_clip also offer the value their rule clips to (clip_target).
TargetFeedback = Literal["raw", "clipped", "clip_target", "skip"]

COUNTERS = ("count", "step", "clipped_count", "nonfinite_count")
FLAGS = (
    "clipped",
    "spike",
    "capped",
    "held",
    "skipped",
    "grad_norm_spike",
    "value_spike",
)  # boolean metrics
# The ceiling of the spike-defence setting (feedback="clipped") where the
# reference has none: the field's standard clip, ZClip's default.
DEFAULT_CEILING = 1.0
# The guard in a ceiling's multiplier, max_grad_norm / (g + 1e-6) (zclip's and torch's).
CEILING_EPS = 1e-6
# autoclip's and zscore_clip's gate when each step is judged before it is observed:
# its threshold then comes from few norms, but a spike feeds back its clipped value,
# so a short gate costs little and keeps early training's large norms out.
JUDGE_FIRST_GATE = 10


class ClipTransform(optax.GradientTransformationExtraArgs):
    """The transform every clipjax clipper returns: an optax transform.

    An ``optax.GradientTransformationExtraArgs``: it goes wherever optax takes
    a transform. Every clipper's state ends with ``metrics``, ``info``,
    ``leaf_index`` and ``leaf_metrics``, and every norm clipper takes
    ``scope``, ``axis_name``, ``leaf_norms`` and ``name``: :doc:`/clipper_fields`.
    Its numbers may be injected with ``optax.inject_hyperparams``
    (:doc:`/optax_wrappers`).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = clipjax.clip_by_global_norm(1.0)
      >>> isinstance(tx, clipjax.ClipTransform), isinstance(tx, optax.GradientTransformation)
      (True, True)
      >>> updates, state = tx.update({"w": jnp.full(4, 2.0)}, tx.init({"w": jnp.zeros(4)}))
      >>> float(clipjax.metrics(state)["clip_by_global_norm/global/scale"])
      0.25
    """


def resolve_ceiling(max_grad_norm: Any, feedback: str) -> float | None:
    """``max_grad_norm="auto"``: :data:`DEFAULT_CEILING` under ``feedback="clipped"``,
    else None (the reference's behaviour); a number must be positive."""
    if isinstance(max_grad_norm, str):
        if max_grad_norm != "auto":
            raise ValueError(
                f'max_grad_norm must be a positive number, None or "auto", got {max_grad_norm!r}'
            )
        return DEFAULT_CEILING if feedback == "clipped" else None
    if max_grad_norm is not None:
        _checks.positive("max_grad_norm", max_grad_norm)
    return max_grad_norm


def gate_defaults(feedback: str, warmup_steps: Any, min_history: Any) -> tuple[int, int]:
    """autoclip's and zscore_clip's gate, where ``warmup_steps`` / ``min_history`` are
    None: smartclip's 100 / 50 under ``"observe_first"``, :data:`JUDGE_FIRST_GATE`
    each when a step is judged before it is observed."""
    first = feedback == "observe_first"
    if warmup_steps is None:
        warmup_steps = 100 if first else JUDGE_FIRST_GATE
    if min_history is None:
        min_history = 50 if first else JUDGE_FIRST_GATE
    return warmup_steps, min_history


# --------------------------------------------------------------------------- the plumbing


def _placeholder_type() -> type:
    """The class of what ``optax.tree_utils.tree_map_params`` gives ``init``, asked of optax."""
    given = []
    optax.tree_utils.tree_map_params(lambda p: given.append(p) or {}, lambda x: x, {})
    return type(given[0])


_PLACEHOLDER = _placeholder_type()


def is_placeholder(params: Any) -> bool:
    """``init`` was given optax's leafless params placeholder (``tree_map_params``)."""
    return isinstance(params, _PLACEHOLDER)


def group_info(
    params: Any, scope: Scope, algo: str, name: str | None, grouping: Grouping | None = None
) -> _metrics.GroupInfo:
    """The ``info`` of a new state for ``params`` grouped by ``scope`` (into ``grouping``)."""
    grouping = _grouping.make_grouping(params, scope) if grouping is None else grouping
    info_class = _metrics.PlaceholderInfo if is_placeholder(params) else _metrics.GroupInfo
    return info_class(algo, name, grouping.names, grouping.leaf_names, grouping.leaf_shapes)


class Grads(NamedTuple):
    """A step's gradient: its leaves and groups, and their norms once taken.

    Attributes:
      leaves: the gradient's leaves.
      paths: their key paths.
      treedef: their tree structure.
      grouping: the groups of the leaves.
      norm: ``[groups]`` norms (averaged over ``axis_name``), or None.
      leaf_norms: ``[leaves]`` L2 norms with ``leaf_norms=True``, else None.
    """

    leaves: list[Array]
    paths: list[KeyPath]
    treedef: Any
    grouping: Grouping
    norm: Any = None
    leaf_norms: Any = None


# --------------------------------------------------------------------------- plain steps


class Setup(NamedTuple):
    """A clipper's grouping settings, checked once by its factory (:func:`setup`).

    Attributes:
      algo: the factory's name, the default metrics prefix.
      scope: how leaves become groups.
      name: the metrics prefix given, or None.
      axis_name: average the group norms over this mapped axis, or None.
      leaf_norms: also record each leaf's L2 norm.
      p: the order of the group norms (a leaf's own norm stays L2).
    """

    algo: str
    scope: Scope
    name: str | None
    axis_name: str | None = None
    leaf_norms: bool = False
    p: float = 2.0

    @property
    def who(self) -> str:
        """The clipper as its errors and metrics name it."""
        return self.name or self.algo


def setup(
    algo: str,
    *,
    scope: Scope,
    name: str | None,
    axis_name: str | None = None,
    leaf_norms: bool = False,
    p: float = 2.0,
    scopes: tuple[str, ...] = _grouping.SCOPES,
    stacked: bool = True,
) -> Setup:
    """A :class:`Setup`, once ``scope`` (one of ``scopes``; no :func:`clipjax.stacked`
    with ``stacked=False``) and ``name`` are checked."""
    _grouping.validate_scope(scope, scopes)
    _checks.name(name)
    if not stacked and isinstance(scope, _grouping.Stacked):
        raise ValueError(
            f"{algo}: clipjax.stacked scopes apply to the norm-based clippers; "
            f"{algo} changes elements, use scope='per_param' or 'per_layer'"
        )
    return Setup(algo, scope, name, axis_name, leaf_norms, p)


class Common(NamedTuple):
    """What ``init`` needs of ``params`` for every clipper (:func:`common`).

    Attributes:
      num_groups: the number of groups.
      dtype: the dtype of norms and statistics (float32, or float64 for float64 leaves).
      info: the new state's ``info``.
      leaf_index: the new state's ``leaf_index`` (:func:`clipjax._xla.leaf_index`).
      leaf_metrics: the new state's ``leaf_metrics``: ``grad_norm`` zeros per leaf
        with ``leaf_norms``, else empty.
    """

    num_groups: int
    dtype: Any
    info: _metrics.GroupInfo
    leaf_index: Any
    leaf_metrics: dict[str, Array]


def common(setup: Setup, params: Any) -> Common:
    """The :class:`Common` fields of a new state for ``params``."""
    placeholder = is_placeholder(params)
    leaves, _, _ = _grouping.leaves_with_names(params)
    grouping = _grouping.make_grouping(params, setup.scope)
    dtype = _grouping.norm_dtype(leaves)
    leaf_metrics = {"grad_norm": jnp.zeros((len(leaves),), dtype)} if setup.leaf_norms else {}
    return Common(
        grouping.num_groups,
        dtype,
        group_info(params, setup.scope, setup.algo, setup.name, grouping),
        _xla.leaf_index(grouping, placeholder),
        leaf_metrics,
    )


def owned(params: Any, state: Any) -> Any:
    """A new ``state`` whose leaves have buffers of their own (:func:`clipjax._xla.own_buffers`)."""
    return state if is_placeholder(params) else _xla.own_buffers(state)


def grads_of(
    setup: Setup,
    updates: Any,
    state: Any,
    state_class: type,
    init: Callable[[Any], Any],
    *,
    dtypes: bool = True,
) -> Grads:
    """``updates`` flattened and grouped, once ``state`` is checked against them and
    against what ``init`` builds for them (an error says what was expected and how
    to restore a checkpoint). With ``dtypes`` every leaf must be a float (a clipper
    that needs ``params`` checks them first and passes False)."""
    who = setup.who
    _checks.check_state(state, state_class, who)
    leaves, paths, treedef = _grouping.leaves_with_names(updates)
    grouping = _grouping.make_grouping(updates, setup.scope)
    grouping.check_matches(state.info.leaves, state.info.shapes, who)
    for field, value in state.metrics.items():
        if jnp.shape(_metrics.unwrap(value))[:1] != (grouping.num_groups,):
            groups = ", ".join(grouping.names[:4]) + (", ..." * (grouping.num_groups > 4))
            raise ValueError(
                f"{who}: the state does not fit the tree passed to update: its metric "
                f"{field!r} has shape {jnp.shape(value)}, expected [{grouping.num_groups}] "
                f"for the groups of this tree ({groups}); was the state restored from "
                "another model?"
            )
    # Traced once per trace, never cached: under optax.inject_hyperparams ``init``
    # closes over that trace's tracers, and a cache keyed by it would keep them.
    expected = jax.eval_shape(init, updates)
    for field, got, want in zip(state._fields, state, expected):
        if field not in ("info", "leaf_index", "leaf_metrics"):
            _checks.check_layout(who, field, got, want)
    if dtypes:
        _grouping.check_inexact(leaves, grouping, who)
    return Grads(leaves, paths, treedef, grouping)


def norms(
    setup: Setup, updates: Any, state: Any, state_class: type, init: Callable[[Any], Any]
) -> Grads:
    """:func:`grads_of` with each group's ``p``-norm (one read of each leaf, summed in
    float32 or float64) and each leaf's L2 norm; averaged over ``axis_name``."""
    grads = grads_of(setup, updates, state, state_class, init)
    leaves, grouping = grads.leaves, grads.grouping
    partial = _grouping.leaf_power_sums(leaves, setup.p, grouping)
    per_leaf = None
    if setup.leaf_norms:
        norm, per_leaf = _grouping.group_and_leaf_norms(leaves, grouping, setup.p, partial)
    else:
        norm = _grouping.group_norms(leaves, grouping, setup.p, partial)
    if setup.axis_name is not None:
        norm, per_leaf = jax.lax.pmean((norm, per_leaf), setup.axis_name)
    return grads._replace(norm=norm, leaf_norms=per_leaf)


def new_leaf_metrics(grads: Grads, state: Any) -> dict[str, Array]:
    """The new state's ``leaf_metrics``: this step's leaf norms, where recorded."""
    if grads.leaf_norms is None:
        return state.leaf_metrics
    return {"grad_norm": grads.leaf_norms.astype(state.leaf_metrics["grad_norm"].dtype)}


def kept_index(state: Any) -> Any:
    """The new state's ``leaf_index``: a copy, not the input passed through
    (:func:`clipjax._xla.returned`)."""
    return _xla.returned(state.leaf_index)


def scaled(grads: Grads, scale: Array, leaf_index: Any) -> Any:
    """The updates: each group's leaves times its ``scale``."""
    scales = _xla.computed_once(scale)
    leaves = _grouping.apply_scales(grads.leaves, grads.grouping, scales, leaf_index)
    return jax.tree_util.tree_unflatten(grads.treedef, leaves)


def rebuilt(grads: Grads, leaves: list[Array]) -> Any:
    """The updates: ``leaves`` in the tree of ``grads``."""
    return jax.tree_util.tree_unflatten(grads.treedef, leaves)


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
    """An absolute ceiling over the clipper's running level of the norm (+inf before any)."""
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
    * ``"clipped"``: ``min(norm, boundary)`` where it fires (a lasting rise is learnt);
    * ``"clip_target"``: ``target`` where it fires (the reference zclip rule);
    * ``"skip"``: the norm, but nothing is observed where it fires.

    A non-finite norm, or a value whose square overflows, is never observed,
    unless ``guard_nans=False``.
    """
    fires = jnp.zeros(jnp.shape(norm), bool) if fires is None else fires
    value = norm
    if feedback == "clipped":
        assert boundary is not None
        value = jnp.where(fires, jnp.minimum(norm, boundary), norm)
    elif feedback == "clip_target":
        assert target is not None
        value = jnp.where(fires, target, norm)
    # Statistics square what they observe: a value whose square overflows (a finite
    # norm past ~1.8e19 in float32) would make them infinite, so it is not observed.
    observed = (
        jnp.isfinite(norm) & jnp.isfinite(value * value)
        if guard_nans
        else jnp.ones(jnp.shape(norm), bool)
    )
    if feedback == "skip":
        observed = observed & ~fires
    return value, observed


def select_groups(mask: Array, new: Any, old: Any) -> Any:
    """Per group, ``new`` where ``mask`` holds, else ``old`` (stacked ``[groups, ...]``
    arrays, never full tensors; a scalar ``mask`` selects whole states)."""

    def pick(n: Array, o: Array) -> Array:
        m = mask.reshape(mask.shape + (1,) * (jnp.ndim(n) - 1))
        return jnp.where(m, n, o)

    return jax.tree.map(pick, new, old)


def new_metrics(
    num_groups: int,
    dtype: Any,
    fields: tuple[str, ...],
    counters: tuple[str, ...] = COUNTERS,
    **fill: Any,
) -> dict[str, Array]:
    """A new state's ``metrics``: each of ``fields`` ``fill[field]`` or zeros of
    ``dtype`` (``scale`` ones, a flag False), each of ``counters`` int32 zeros."""
    metrics = {}
    for field in fields:
        if field in FLAGS:
            metrics[field] = jnp.zeros((num_groups,), bool)
        else:
            metrics[field] = jnp.full((num_groups,), fill.get(field, field == "scale"), dtype)
    for counter in counters:
        metrics[counter] = jnp.zeros((num_groups,), jnp.int32)
    return metrics


def norm_metrics(
    num_groups: int,
    dtype: Any,
    fields: tuple[str, ...] = (),
    *,
    spike: bool = False,
    ceiling: bool = False,
) -> dict[str, Array]:
    """A norm clipper's new ``metrics``: ``grad_norm``, ``threshold``, ``scale``,
    ``clipped``, ``spike`` for a spike rule, ``capped`` with a ceiling, then
    ``fields`` and the counters (``capped_count`` with a ceiling)."""
    flags = ("spike",) * spike + ("capped",) * ceiling
    return new_metrics(
        num_groups,
        dtype,
        ("grad_norm", "threshold", "scale", "clipped", *flags, *fields),
        COUNTERS + ("capped_count",) * ceiling,
    )


def step_metrics(
    old: dict[str, Array],
    *,
    norm: Array | None = None,
    observed: Array | None = None,
    threshold: Array | None = None,
    scale: Array | None = None,
    clipped: Array | None = None,
    spike: Array | None = None,
    capped: Array | None = None,
    finite: Array | None = None,
    **fields: Array,
) -> dict[str, Array]:
    """This step's ``metrics``: ``grad_norm`` (``norm``), the fields given, and the
    counters of ``old`` advanced, each value in its dtype in ``old``.

    ``clipped`` defaults to ``scale < 1`` (where the state records it);
    ``spike`` says the spike rule fired, whatever bound the step. ``count``
    counts the ``observed`` groups, ``nonfinite_count`` those ``finite`` does
    not mark (default: a non-finite norm), ``clipped_count`` and
    ``capped_count`` the clipped and capped ones.
    """
    if clipped is None and scale is not None and "clipped" in old:
        clipped = scale < 1
    given = {"grad_norm": norm, "threshold": threshold, "scale": scale, "clipped": clipped}
    given.update(spike=spike, capped=capped)
    new = {**{k: v for k, v in given.items() if v is not None}, **fields}
    if finite is None:
        assert norm is not None, "step_metrics: give norm or finite"
        finite = jnp.isfinite(norm)
    increments = {
        "count": observed,
        "step": True,
        "clipped_count": False if clipped is None else clipped,
        "nonfinite_count": ~finite,
        "capped_count": False if capped is None else capped,
    }
    for counter, inc in increments.items():
        if counter in old:
            new[counter] = old[counter] + jnp.asarray(inc).astype(jnp.int32)
    return {k: jnp.asarray(v).astype(old[k].dtype) for k, v in new.items()}
