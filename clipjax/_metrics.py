"""The metrics carried in every clipjax state, and :func:`metrics` that reads them.

A clipjax state is a ``NamedTuple`` with (at least) two fields:

* ``metrics``: a ``dict`` of ``[groups]`` arrays, one entry per metric field
  (``grad_norm``, ``threshold``, ``scale``, ``clipped``, ``count``, ...);
* ``info``: a :class:`GroupInfo`, a pytree node with no leaves that holds the
  static names (algorithm, user name, groups). Being static, it is part of the
  tree structure: it never changes across updates, costs nothing under ``jit``
  and makes a state built for another tree fail loudly.

:func:`metrics` walks any optax state, finds every clipjax state and flattens
their metrics into ``{"{algo}/{group}/{field}": scalar array}``.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import jax
import jax.numpy as jnp

_STATE_TYPES: list[type] = []


def register_state(cls: type) -> type:
    """Class decorator: marks a NamedTuple class as a clipjax state."""
    _STATE_TYPES.append(cls)
    return cls


def is_clipjax_state(x: Any) -> bool:
    return isinstance(x, tuple(_STATE_TYPES))


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class GroupInfo:
    """Static names of a clipjax state: a pytree node with no leaves.

    Attributes:
      algo: the factory's name (``autoclip``, ``zclip``, ...).
      name: the user-given prefix, or ``None`` for the automatic one.
      groups: the group names, in the order of the ``[groups]`` arrays.
      tree: a digest of the leaf names and shapes seen by ``init``, so that
        ``update`` on another tree fails clearly (see ``Grouping.fingerprint``).
    """

    algo: str
    name: str | None
    groups: tuple[str, ...]
    tree: str = ""


# flax.serialization turns NamedTuples into dicts field by field and keeps an
# unknown object as it is, which msgpack cannot write. GroupInfo is static: it
# serialises to an empty dict and is restored from the target state.
_flax_registered = False


def _register_flax_serialization() -> None:
    global _flax_registered
    if _flax_registered or "flax.serialization" not in sys.modules:
        return
    serialization = sys.modules["flax.serialization"]
    serialization.register_serialization_state(
        GroupInfo, lambda info: {}, lambda target, state: target, override=True
    )
    _flax_registered = True


def ensure_serializable() -> None:
    """Registers :class:`GroupInfo` with flax.serialization once flax is loaded."""
    if not _flax_registered:
        _register_flax_serialization()


def _unwrap(x: Any) -> Any:
    # flax NNX wraps optimizer-state arrays in Variables (OptArray, ...). Their
    # `.value` is deprecated (flax 0.12): use `get_value()` where it exists, and
    # test the class, as hasattr(x, "value") would call the deprecated property.
    if isinstance(x, (jax.Array, GroupInfo)):
        return x
    if callable(getattr(type(x), "get_value", None)):
        return x.get_value()
    if hasattr(type(x), "value") or "value" in getattr(x, "__dict__", ()):
        return x.value
    return x


def _group_values(values: Any, num_groups: int) -> list[Any]:
    # The group axis is the last one: a state stacked by pmap (replicas), vmap
    # or a scan over steps has [..., groups] metrics, read as [...] per group.
    values = _unwrap(values)
    if isinstance(values, jax.core.Tracer) or num_groups == 1:
        return [values[..., i] for i in range(num_groups)]
    # One unstack instead of one slice per group.
    return list(jnp.moveaxis(jnp.asarray(values), -1, 0))


def _emit(state: Any, prefix: str, out: dict[str, Any]) -> None:
    info: GroupInfo = state.info
    for field, values in state.metrics.items():
        for group, value in zip(info.groups, _group_values(values, len(info.groups))):
            out[f"{prefix}/{group}/{field}"] = value
    inner = getattr(state, "inner", None)
    if inner is not None:
        _walk(inner, prefix + "/", out)


def _walk(tree: Any, prefix: str, out: dict[str, Any]) -> None:
    found = jax.tree_util.tree_leaves(tree, is_leaf=is_clipjax_state)
    seen: dict[str, int] = {}
    for node in found:
        if not is_clipjax_state(node):
            continue
        info: GroupInfo = node.info
        if info.name is not None:
            label = info.name
        else:
            k = seen.get(info.algo, 0)
            seen[info.algo] = k + 1
            label = info.algo if k == 0 else f"{info.algo}_{k}"
        _emit(node, prefix + label, out)


def metrics(opt_state: Any) -> dict[str, jax.Array]:
    """Reads the metrics of every clipjax transform inside an optax state.

    Works on any optax state (``chain``, ``named_chain``,
    ``inject_hyperparams``, ``MultiSteps``, ``masked``, ``partition``,
    ``apply_if_finite``, flax optimizer wrappers), inside or outside ``jit``.

    Args:
      opt_state: an optimizer state, or any pytree containing one.

    Returns:
      A flat ``dict`` of scalar arrays named ``"{algo}/{group}/{field}"``, e.g.
      ``"autoclip/global/threshold"``. Two transforms of one kind are named
      ``algo``, ``algo_1``, ... in tree order unless given ``name=``. A
      state with leading axes (replicated by ``jax.pmap``, stacked by
      ``vmap`` or collected from a ``lax.scan``) gives arrays of those axes
      instead of scalars, e.g. one value per replica.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> tx = optax.chain(clipjax.clip_by_global_norm(1.0), optax.sgd(0.1))
      >>> params = {"w": jnp.ones(3)}
      >>> state = tx.init(params)
      >>> _, state = tx.update({"w": jnp.full(3, 2.0)}, state, params)
      >>> round(float(clipjax.metrics(state)["clip_by_global_norm/global/grad_norm"]), 3)
      3.464
    """
    out: dict[str, Any] = {}
    _walk(opt_state, "", out)
    return out
