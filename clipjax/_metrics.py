"""The metrics carried in every clipjax state, and :func:`metrics` that reads them.

A clipjax state is a ``NamedTuple`` with (at least) ``metrics``, a ``dict``
of ``[groups]`` arrays, and ``info``, a :class:`GroupInfo` (a pytree node with
no leaves holding the static names). :func:`metrics` recognises any such
``NamedTuple``, with no registration, and walks the state's other fields at
the same level, except ``nested``, whose states it reports under the
wrapper's prefix. An optional ``leaf_metrics`` field (``[leaves]`` arrays)
is reported as ``{prefix}/leaf/{leaf path}/{field}``.
"""

from __future__ import annotations

import dataclasses
import functools
import sys
import types
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.core import Tracer

from clipjax import _checks

Array = jax.Array


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class GroupInfo:
    """Static names of a clipjax state: a pytree node with no leaves.

    Attributes:
      algo: the factory's name (``autoclip``, ``zclip``, ...).
      name: the user-given prefix, or ``None`` for the automatic one.
      groups: the group names, in the order of the ``[groups]`` arrays.
      leaves: the path names of the leaves seen by ``init``.
      shapes: their shapes, so that ``update`` on another tree fails clearly.
    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> clipjax.zclip().init({"w": jnp.zeros(2)}).info.groups
      ('global',)
    """

    algo: str
    name: str | None = None
    groups: tuple[str, ...] = ("global",)
    leaves: tuple[str, ...] = ()
    shapes: tuple[tuple[int, ...], ...] = ()

    def _key(self) -> tuple[Any, ...]:
        return (self.algo, self.name, self.groups, self.leaves, self.shapes)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GroupInfo):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash((self.algo, self.name))


class PlaceholderInfo(GroupInfo):
    """The names of a state built by ``init`` on optax's params placeholder.

    A leaf rather than a pytree node, so that ``optax.tree_utils.tree_map_params``
    maps the real state's :class:`GroupInfo` onto it and the mapped state keeps its names.
    """


def is_clipjax_state(x: Any) -> bool:
    """Whether ``x`` is a clipjax state: a NamedTuple with ``metrics`` and ``info``."""
    fields = getattr(type(x), "_fields", None)
    return (
        isinstance(x, tuple)
        and fields is not None
        and "metrics" in fields
        and "info" in fields
        and isinstance(getattr(x, "info", None), GroupInfo)
    )


def unwrap(x: Any) -> Any:
    """The array inside a flax NNX optimizer-state Variable (or ``x`` itself)."""
    # `.value` is deprecated (flax 0.12): use `get_value()` where it exists, and
    # test the class, as hasattr(x, "value") would call the deprecated property.
    if isinstance(x, (jax.Array, GroupInfo)):
        return x
    if callable(getattr(type(x), "get_value", None)):
        return x.get_value()
    if hasattr(type(x), "value") or "value" in getattr(x, "__dict__", ()):
        return x.value
    return x


def host(values: Any) -> Any:
    """``values`` as one NumPy array when it can be read here (no compile), else as it is."""
    values = unwrap(values)
    if isinstance(values, Tracer):
        return values
    if isinstance(values, jax.Array) and not values.is_fully_addressable:
        return values
    return np.asarray(values)


def _split(values: Any, n: int) -> list[Any]:
    # The group axis is the last one: a state stacked by pmap (replicas), vmap
    # or a scan over steps has [..., groups] metrics, read as [...] per group.
    values = host(values)
    if isinstance(values, (np.ndarray, Tracer)) or n == 1:
        return [values[..., i] for i in range(n)]
    # One unstack instead of one slice per group.
    return list(jnp.moveaxis(jnp.asarray(values), -1, 0))


# What a transform that did not run this step reports for its per-step fields
# (hist_clip's warm-up clip on the groups past their warm-up); thresholds,
# statistics and counters read as they stand (clipjax._conditional.idle_metrics).
IDLE_VALUES = {
    "grad_norm": 0,
    "scale": 1,
    "clipped": False,
    "capped": False,
    "clipped_fraction": 0,
    "z": 0,
}
# What clipjax.metrics reports for a clipjax transform inside a wrapper that
# skipped this step (skip_on_spike, skip_and_clip_by_global_norm), on every
# route: it saw no gradient, so its norm and z-score read NaN (a 0 would chart
# as a calm step at exactly the bad one) and it scaled and clipped nothing; its
# ``skipped`` field, reported inside such a wrapper only, reads True.
SKIPPED_VALUES = {
    **IDLE_VALUES,
    "grad_norm": np.nan,
    "z": np.nan,
    "spike": False,
    "held": False,
}


def _idle_view(values: Any, field: str, idle: Any) -> Any:
    if idle is None or field not in SKIPPED_VALUES:
        return values
    values, idle = host(values), host(idle)
    if isinstance(values, np.ndarray) and isinstance(idle, np.ndarray):
        return np.where(idle, np.asarray(SKIPPED_VALUES[field], values.dtype), values)
    return jnp.where(idle, jnp.asarray(SKIPPED_VALUES[field], values.dtype), values)


def _skipped_view(fields: dict[str, Any], idle: Any) -> dict[str, Any]:
    """``fields`` with ``skipped`` ([..., groups]): whether the wrapper around skipped
    this step (or, for a wrapper inside another, either skipped it)."""
    if idle is None or not fields:
        return fields
    shape = np.shape(host(next(iter(fields.values()))))
    idle = host(idle)
    own = fields.get("skipped")
    if isinstance(idle, np.ndarray) and (own is None or isinstance(host(own), np.ndarray)):
        skipped = np.broadcast_to(idle if own is None else idle | host(own), shape)
    else:
        skipped = jnp.broadcast_to(idle if own is None else idle | own, shape)
    return {**fields, "skipped": skipped}


def sqrt(x: Any) -> Any:
    """``sqrt`` for a statistic a state reports: NumPy's on a value that can be read
    here (no program to compile for a concrete state), jax's inside ``jit``."""
    x = host(x)
    return np.sqrt(x) if isinstance(x, np.ndarray) else jnp.sqrt(x)


def state_fields(state: Any) -> dict[str, Any]:
    """A clipjax state's ``[groups]`` metrics: its ``metrics`` and the statistics it
    reports from its own variables (its ``statistics()`` method, where it has one)."""
    statistics = getattr(state, "statistics", None)
    if statistics is None:
        return dict(state.metrics)
    return {**state.metrics, **statistics()}


def _emit(state: Any, prefix: str, out: dict[str, Any], idle: Any = None) -> None:
    info: GroupInfo = state.info
    for field, values in _skipped_view(state_fields(state), idle).items():
        values = _idle_view(values, field, idle)
        for group, value in zip(info.groups, _split(values, len(info.groups))):
            out[f"{prefix}/{group}/{field}"] = value
    for field, values in (getattr(state, "leaf_metrics", None) or {}).items():
        values = _idle_view(values, field, idle)
        for leaf, value in zip(info.leaves, _split(values, len(info.leaves))):
            out[f"{prefix}/leaf/{leaf}/{field}"] = value


def _skipped(node: Any, idle: Any) -> Any:
    """``idle`` for the inner state of a wrapper that skipped this step."""
    skipped = node.metrics.get("skipped")
    if skipped is None:
        return idle
    # [..., 1]: broadcasts against the [..., groups] metrics inside.
    skipped = host(skipped)
    return skipped if idle is None else idle | skipped


def held(tree: Any) -> Any:
    """Whether a clipjax clipper of ``tree`` (not one inside a wrapper's inner
    state) held this step (``zclip(start="hold")``): a scalar bool, or None
    where no clipper in it holds."""
    flags = [
        jnp.any(node.metrics["held"])
        for node in jax.tree_util.tree_leaves(tree, is_leaf=is_clipjax_state)
        if is_clipjax_state(node) and "held" in node.metrics
    ]
    return functools.reduce(jnp.logical_or, flags) if flags else None


def _states(tree: Any, idle: Any = None) -> list[tuple[Any, Any]]:
    """The clipjax states of one naming scope, in tree order, with their idle masks."""
    found = []
    for node in jax.tree_util.tree_leaves(tree, is_leaf=is_clipjax_state):
        if not is_clipjax_state(node):
            continue
        found.append((node, idle))
        for field in node._fields:
            if field == "inner_state":
                found.extend(_states(node.inner_state, _skipped(node, idle)))
            elif field not in ("metrics", "info", "leaf_metrics", "nested"):
                found.extend(_states(getattr(node, field), idle))
    return found


def _labels(infos: list[GroupInfo], prefix: str) -> list[str]:
    """Each state's metrics prefix: its ``name=``, else an unused ``algo``, ``algo_1``, ..."""
    given: dict[str, GroupInfo] = {}
    for info in infos:
        if info.name is None:
            continue
        other = given.get(info.name)
        if other is not None:
            where = f" inside {prefix.rstrip('/')!r}" if prefix else ""
            raise ValueError(
                f"clipjax.metrics: two clipjax transforms{where} are named {info.name!r} "
                f"(a {other.algo} and a {info.algo}), so their metrics would overwrite each "
                f"other under the prefix {prefix + info.name!r}. Give each its own name=, "
                f'e.g. clipjax.{info.algo}(..., name="{info.name}_2").'
            )
        given[info.name] = info
    taken = set(given)
    counts: dict[str, int] = {}
    labels = []
    for info in infos:
        label = info.name
        if label is None:
            k = counts.get(info.algo, 0)
            label = info.algo if k == 0 else f"{info.algo}_{k}"
            while label in taken:
                k += 1
                label = f"{info.algo}_{k}"
            counts[info.algo] = k + 1
            taken.add(label)
        labels.append(label)
    return labels


def _walk(tree: Any, prefix: str, out: dict[str, Any], idle: Any = None) -> bool:
    """Reports every clipjax state in ``tree`` into ``out``; whether there was one."""
    states = _states(tree, idle)
    labels = _labels([node.info for node, _ in states], prefix)
    for (node, node_idle), label in zip(states, labels):
        _emit(node, prefix + label, out, node_idle)
        if "nested" in node._fields:
            _walk(node.nested, f"{prefix}{label}/", out, node_idle)
    return bool(states)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in flat.items():
        prefix, rest = key.split("/", 1)
        if rest.startswith("leaf/"):
            leaf, field = rest[len("leaf/") :].rsplit("/", 1)
            out.setdefault(prefix, {}).setdefault("leaf", {}).setdefault(leaf, {})[field] = value
            continue
        node = out.setdefault(prefix, {})
        parts = rest.split("/")
        group, field = "/".join(parts[:-1]), parts[-1]
        node.setdefault(group, {})[field] = value
    return out


def _merge_nnx_split(opt_state: Any) -> Any:
    """``nnx.split(optimizer)``'s ``(graphdef, state, ...)`` merged back (names in the graphdef)."""
    nnx = sys.modules.get("flax.nnx")
    graphdef = getattr(nnx, "GraphDef", None)
    if graphdef is not None and opt_state and isinstance(opt_state, tuple):
        return nnx.merge(*opt_state) if isinstance(opt_state[0], graphdef) else opt_state  # type: ignore[union-attr]
    return opt_state


def metrics(opt_state: Any, flat: bool = True) -> dict[str, Any]:
    """Reads the metrics of every clipjax transform inside an optax state.

    Works on any optax state (``chain``, ``inject_hyperparams``,
    ``MultiSteps``, ``masked``, flax optimizer wrappers), inside ``jit``
    (traced arrays) or outside it (NumPy arrays, nothing compiled). Each
    transform reports under its ``name=`` or its kind (``algo``, then
    ``algo_1``, ... in tree order); a nested one under its owner's prefix.
    The gradients of :func:`clipjax.clip_activation_gradient`'s carriers, in
    any tree it is given, report as :func:`clipjax.activation_metrics` does.

    Args:
      opt_state: an optimizer state, or any pytree containing one: with flax
        NNX, ``optimizer.opt_state``, the ``nnx.Optimizer`` itself, or the
        tuple ``nnx.split(optimizer)`` returns (not ``nnx.state(optimizer)``,
        whose names flax keeps in the graphdef).
      flat: return one flat ``dict`` (True, default) or a nested one (False).

    Returns:
      With ``flat=True``, a ``dict`` of scalar arrays named
      ``"{algo}/{group}/{field}"``, e.g. ``"autoclip/global/threshold"``; with
      ``leaf_norms=True`` also ``"{algo}/leaf/{leaf path}/grad_norm"``. With
      ``flat=False`` the same values nested as ``{algo: {group: {field:
      array}}}``. A state with leading axes (``pmap``, ``vmap``, ``scan``)
      gives arrays of those axes instead of scalars.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = optax.chain(clipjax.clip_by_global_norm(1.0), optax.sgd(0.1))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
      >>> round(float(clipjax.metrics(state)["clip_by_global_norm/global/grad_norm"]), 3)
      3.464
      >>> nested = clipjax.metrics(state, flat=False)
      >>> round(float(nested["clip_by_global_norm"]["global"]["scale"]), 3)
      0.289

    Raises:
      TypeError: ``opt_state`` is a transform or a factory (``tx`` or
        ``clipjax.autoclip``) rather than a state (``tx.init(params)``).
      TypeError: ``flat`` is not a bool.
      ValueError: two transforms in ``opt_state`` were given the same
        ``name=``: their metrics would overwrite each other.

    Warns:
      UserWarning: ``opt_state`` holds no clipjax state, so the result is
        ``{}``; it says why where it can tell; once per calling line.
    """
    if isinstance(opt_state, (optax.GradientTransformation, types.FunctionType, functools.partial)):
        raise TypeError(
            "clipjax.metrics reads an optimizer state, got a transform or its factory "
            f"({getattr(opt_state, '__name__', type(opt_state).__name__)}): pass "
            "tx.init(params) or the state returned by tx.update"
        )
    if not isinstance(flat, (bool, np.bool_)):
        raise TypeError(f"flat must be a bool (True: one flat dict; False: nested), got {flat!r}")
    opt_state = _merge_nnx_split(opt_state)
    out: dict[str, Any] = {}
    found = _walk(opt_state, "", out)
    # The carriers of clip_activation_gradient's statistics (their gradients), where the
    # tree holds some; imported here, as _activation imports this module.
    from clipjax import _activation

    found = _activation.report(opt_state, out) or found
    if not found:
        warnings.warn(
            "clipjax.metrics found no clipjax state in the optimizer state "
            f"({type(opt_state).__name__}) and returns {{}}{_checks.why_empty(opt_state)}",
            UserWarning,
            stacklevel=2,
        )
    return out if flat else _nest(out)
