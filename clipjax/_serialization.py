"""clipjax's states and ``flax.serialization``: registered when clipjax is imported.

:class:`GroupInfo`, ``PlaceholderInfo`` and the layout of an activation-statistics
carrier serialise to an empty dict and are restored from the target state;
msgpack could not write them otherwise (:doc:`/checkpointing`). Without flax
installed nothing is registered.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import jax.numpy as jnp

from clipjax._activation import StatsLayout
from clipjax._metrics import GroupInfo, PlaceholderInfo, is_clipjax_state

FLAX_MODULE = "flax.serialization"


class StateMismatchError(ValueError):
    """A checkpointed clipjax state does not fit the restore target's tree."""


def _count(n: int, what: str, plural: str | None = None) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {plural or what + 's'}"


def _saved_sizes(state_dict: Any) -> str:
    """What a checkpointed state was built for: its groups and, where known, leaves."""
    parts = []
    metrics = state_dict.get("metrics") if isinstance(state_dict, dict) else None
    if isinstance(metrics, dict) and metrics:
        shape = jnp.shape(next(iter(metrics.values())))
        if shape:
            parts.append(_count(shape[-1], "group"))
    index = state_dict.get("leaf_index") if isinstance(state_dict, dict) else None
    leaf_metrics = state_dict.get("leaf_metrics") if isinstance(state_dict, dict) else None
    if isinstance(index, dict) and index:
        parts.append(_count(len(index), "leaf", "leaves"))
    elif isinstance(leaf_metrics, dict) and leaf_metrics:
        shape = jnp.shape(next(iter(leaf_metrics.values())))
        if shape:
            parts.append(_count(shape[-1], "leaf", "leaves"))
    return " and ".join(parts) or "another tree"


def _target_sizes(info: GroupInfo) -> str:
    groups = ", ".join(info.groups[:4]) + (", ..." if len(info.groups) > 4 else "")
    leaves = _count(len(info.leaves), "leaf", "leaves")
    return f"{_count(len(info.groups), 'group')} ({groups}) and {leaves}"


def _a(name: str) -> str:
    return f"{'an' if name[:1] in 'AEIOU' else 'a'} {name}"


def _saved_class(state_dict: Any, target: Any) -> str | None:
    """The clipjax state class(es) whose fields the checkpointed state has, where those
    are not the target's (flax keeps a NamedTuple's fields, not its class)."""
    if not isinstance(state_dict, dict) or set(state_dict) == set(target._fields):
        return None
    import clipjax  # loaded by now: a restore runs after clipjax's import

    names = [
        _a(value.__name__)
        for value in vars(clipjax).values()
        if isinstance(value, type)
        and issubclass(value, tuple)
        and set(getattr(value, "_fields", ())) == set(state_dict)
    ]
    return " or ".join(names) or f"a state with the fields {', '.join(map(str, state_dict))}"


def _checked_restore(restore: Any, current_path: Any) -> Any:
    """flax's NamedTuple restore, naming the clipjax state that does not fit."""

    def restore_namedtuple(target: Any, state_dict: Any) -> Any:
        if not is_clipjax_state(target):
            return restore(target, state_dict)
        try:
            return restore(target, state_dict)
        except StateMismatchError:
            raise
        except ValueError as error:
            info: GroupInfo = target.info
            who = info.name or info.algo
            path = current_path()
            at = "" if path in ("", ".") else f" at {path}"
            saved = _saved_class(state_dict, target)
            if saved is not None:
                raise StateMismatchError(
                    f"{who}: the checkpointed state{at} and the restore target do not "
                    f"match: the checkpoint holds {saved}, the target is "
                    f"{_a(type(target).__name__)} (another transform). Restore into "
                    f"tx.init(params) of the transform and model the checkpoint was saved "
                    f"from."
                ) from error
            saved_fields = state_dict.get("metrics") if isinstance(state_dict, dict) else None
            if isinstance(saved_fields, dict) and set(saved_fields) != set(target.metrics):
                extra = sorted(set(saved_fields) - set(target.metrics))
                missing = sorted(set(target.metrics) - set(saved_fields))
                raise StateMismatchError(
                    f"{who}: the checkpointed state{at} and the restore target do not "
                    f"match: both are {_a(type(target).__name__)}, but the checkpoint's "
                    f"metrics have {extra or 'no other field'} where the target's have "
                    f"{missing or 'none'}: the same transform with other arguments (a "
                    f"0.4 zclip(feedback='clipped') checkpoint has 'weight', today's "
                    f"'held': pass start='weight' to restore it). Restore into "
                    f"tx.init(params) of the transform, arguments and model the "
                    f"checkpoint was saved from."
                ) from error
            raise StateMismatchError(
                f"{who}: the checkpointed state{at} and the restore target do not "
                f"match: the checkpoint holds a state for "
                f"{_saved_sizes(state_dict)}, the target was built by init on a tree of "
                f"{_target_sizes(info)}. Restore into tx.init(params) of the model the "
                f"checkpoint was saved from."
            ) from error

    restore_namedtuple.clipjax_checked = True  # type: ignore[attr-defined]
    return restore_namedtuple


def register_with(serialization: Any) -> None:
    """Registers the static names with one loaded ``flax.serialization`` module."""
    for info_class in (GroupInfo, PlaceholderInfo, StatsLayout):
        serialization.register_serialization_state(
            info_class, lambda info: {}, lambda target, state: target, override=True
        )
    # A restore that does not fit a clipjax state says which transform and
    # which trees (flax's own message names the internal field that failed,
    # ``./0/leaf_index``). flax has no public hook for NamedTuples, so its
    # NamedTuple handler is wrapped where it is found, and left alone otherwise.
    marker = getattr(serialization, "_NamedTuple", None)
    registry = getattr(serialization, "_STATE_DICT_REGISTRY", None)
    current_path = getattr(serialization, "current_path", None)
    if isinstance(registry, dict) and marker in registry and callable(current_path):
        to_state_dict, restore = registry[marker]
        if not getattr(restore, "clipjax_checked", False):
            serialization.register_serialization_state(
                marker, to_state_dict, _checked_restore(restore, current_path), override=True
            )


def register() -> bool:
    """Registers clipjax's states with ``flax.serialization`` where flax is installed.

    Called once, at clipjax's import. Returns whether it registered. A flax
    that is installed but fails to import warns (clipjax works without it).
    """
    module = sys.modules.get(FLAX_MODULE)
    if module is None:
        try:
            import flax.serialization as module
        except ImportError:
            return False  # flax is not installed: nothing to register with
        except Exception as error:  # a broken flax install must not break clipjax
            warnings.warn(
                f"clipjax: flax is installed but {FLAX_MODULE} failed to import ({error!r}); "
                "clipjax states cannot be saved with flax.serialization in this process",
                ImportWarning,
                stacklevel=2,
            )
            return False
    register_with(module)
    return True
