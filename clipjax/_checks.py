"""What clipjax refuses, and how it says so: a factory's arguments, an ``update``'s state.

Arguments are checked at construction (tracers let through), a state first thing in
``update``; each error names the mistake and the fix.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
from jax.core import Tracer

# --------------------------------------------------------------------------- arguments


def _concrete(value: Any) -> float | None:
    if isinstance(value, Tracer):
        return None
    try:
        arr = np.asarray(value)
    except Exception:
        return None
    if arr.shape != () or not np.issubdtype(arr.dtype, np.number):
        raise ValueError(f"expected a scalar number, got {value!r}")
    return float(arr)


def concrete(value: Any) -> float | None:
    """``value`` as a float where it is a concrete number, else None (a tracer, a non-number)."""
    try:
        return _concrete(value)
    except ValueError:
        return None


def check(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``ok(value)`` holds (``expected``: a range)."""
    try:
        x = _concrete(value)
    except ValueError:
        kind = type(value).__name__
        noun = expected if expected.startswith(("a ", "an ")) else f"a number {expected}"
        raise ValueError(f"{name} must be {noun}, got {value!r} (a {kind})") from None
    if x is not None and not ok(x):
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def positive(name: str, value: Any) -> None:
    check(name, value, lambda x: x > 0 and not math.isnan(x), "> 0")


def non_negative(name: str, value: Any) -> None:
    check(name, value, lambda x: x >= 0, ">= 0")


def nonzero_bound(name: str, value: Any) -> None:
    """A clipping bound: any number but 0 and NaN (a negative bound means its absolute value)."""
    expected = "a nonzero number (0 would zero every update)"
    check(name, value, lambda x: x != 0 and not math.isnan(x), expected)


def percentile(name: str, value: Any) -> None:
    """A percentile on the 0-100 scale, in ``(1, 100]`` (``(0, 1]`` is refused as a fraction)."""
    try:
        x = _concrete(value)
    except ValueError:
        kind = type(value).__name__
        raise ValueError(f"{name} must be a number in (1, 100], got {value!r} (a {kind})") from None
    if x is None:
        return
    if 0 < x <= 1:
        raise ValueError(
            f"{name}={value!r}: percentiles are on the 0-100 scale; did you mean a fraction, "
            f"the {_ordinal(100 * x)} percentile? Pass {name}={100 * x:g}. Percentiles at or "
            "below 1 are refused (they would clip nearly every step)."
        )
    if not 1 < x <= 100:
        raise ValueError(f"{name} must be in (1, 100] (a percentile, 0-100 scale), got {value!r}")


def _ordinal(x: float) -> str:
    if not float(x).is_integer():
        return f"{x:g}th"
    n = int(x)
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def open_unit(name: str, value: Any) -> None:
    check(name, value, lambda x: 0 < x < 1, "in (0, 1)")


def _static_hint(name: str) -> str:
    return (
        f"{name} fixes shapes or Python control flow, so it must be a Python value; "
        f"with optax.inject_hyperparams pass it in static_args=({name!r},)"
    )


def integer(name: str, value: Any, minimum: int = 0, static: bool = True) -> None:
    """An integer ``>= minimum``; ``static=False`` also accepts an array or tracer."""
    if isinstance(value, (jax.Array, Tracer)) and not isinstance(value, bool):
        if static:
            raise ValueError(_static_hint(name))
        check(name, value, lambda x: x >= minimum and float(x).is_integer(), f"an int >= {minimum}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def static_number(name: str, value: Any) -> None:
    """Raises the ``static_args`` hint for an array where a Python number is needed."""
    if isinstance(value, (jax.Array, Tracer)):
        raise ValueError(_static_hint(name))


def choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")


def name(name: Any) -> None:
    """``name`` is None or a non-empty str without ``/`` (the separator of metric names)."""
    if name is not None and (not isinstance(name, str) or not name):
        raise ValueError(f"name must be a non-empty str, got {name!r}")
    if name is not None and "/" in name:
        raise ValueError(
            f"name must not contain '/', which separates the parts of a metric name "
            f"('{{name}}/{{group}}/{{field}}'), got {name!r}; use '_' or '-'"
        )


def feedback(feedback: Any, allowed: tuple[str, ...]) -> None:
    if feedback not in allowed:
        raise ValueError(f"feedback must be one of {allowed}, got {feedback!r}")


# --------------------------------------------------------------------------- states

RESTORE_HINT = (
    "restore a checkpoint into the optimizer's own state, with tx.init(params) as the "
    "target (orbax: checkpointer.restore(path, tx.init(params)), or the tree of "
    "jax.ShapeDtypeStruct of it; flax: flax.serialization.from_bytes(tx.init(params), data))"
)

RESTORED = (
    "which is what a checkpoint restored without a target gives (named tuples come back "
    "as dicts, tuples as lists)"
)


def looks_restored(x: Any) -> bool:
    """Whether ``x`` is a clipjax state restored without a target (a mapping)."""
    if not isinstance(x, Mapping):
        return False
    metrics = x.get("metrics")
    return isinstance(metrics, Mapping) and "step" in metrics


def holds_restored(tree: Any) -> bool:
    """Whether a tree of mappings, lists and tuples holds a :func:`looks_restored` node."""
    if looks_restored(tree):
        return True
    if isinstance(tree, Mapping):
        return any(holds_restored(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(holds_restored(v) for v in tree)
    return False


def _article(word: str) -> str:
    return f"{'an' if word[:1].lower() in 'aeiou' else 'a'} {word}"


def _described(state: Any) -> str:
    info = getattr(state, "info", None)
    algo = getattr(info, "algo", None)
    if algo is not None:
        return f"{_article(type(state).__name__)} (the state of clipjax.{algo})"
    if isinstance(state, Mapping):
        return "a dict"
    if isinstance(state, list):
        return "a list"
    if isinstance(state, tuple) and not hasattr(state, "_fields"):
        return f"a tuple of {len(state)} (a chain's state?)"
    return _article(type(state).__name__)


def _fix(state: Any) -> str:
    """What to do instead, for a state an ``update`` cannot take."""
    if isinstance(state, (Mapping, list)) or holds_restored(state):
        return f", {RESTORED}: {RESTORE_HINT}"
    if getattr(getattr(state, "info", None), "algo", None) is not None:
        return (
            ": pass the state this transform's init returned (in an optax.chain each "
            "transform takes its own member of the chain's state, in the chain's order)"
        )
    return f": pass the state this transform's init returned, or {RESTORE_HINT}"


def check_state(state: Any, expected: type | tuple[type, ...], who: str) -> None:
    """Raises a ``TypeError`` naming the mistake unless ``state`` is an ``expected``."""
    if isinstance(state, expected):
        return
    names = expected if isinstance(expected, tuple) else (expected,)
    wanted = " or ".join(c.__name__ for c in names)
    raise TypeError(
        f"{who}.update expects the {wanted} that {who}'s init returns, "
        f"got {_described(state)}{_fix(state)}"
    )


def check_members(state: Any, expected: tuple[type, ...], who: str) -> None:
    """:func:`check_state` for a tuple state of ``len(expected)`` members (``object``: any)."""
    if (
        isinstance(state, tuple)
        and not hasattr(state, "_fields")
        and len(state) == len(expected)
        and all(isinstance(m, c) for m, c in zip(state, expected))
    ):
        return
    wanted = ", ".join("a state" if c is object else c.__name__ for c in expected)
    raise TypeError(
        f"{who}.update expects the tuple ({wanted}) that {who}'s init returns, "
        f"got {_described(state)}{_fix(state)}"
    )


def _shapes(tree: Any) -> list[tuple[int, ...]]:
    return [tuple(getattr(x, "shape", None) or np.shape(x)) for x in jax.tree.leaves(tree)]


def check_layout(who: str, field: str, got: Any, want: Any) -> None:
    """Raises a ``ValueError`` unless ``got`` has ``want``'s tree and leaf shapes."""
    if jax.tree.structure(got) == jax.tree.structure(want) and _shapes(got) == _shapes(want):
        return
    if isinstance(got, Mapping) and isinstance(want, Mapping) and set(got) != set(want):
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        parts = [f"lacks {missing}"] * bool(missing) + [f"has {extra} besides"] * bool(extra)
        found = "it " + " and ".join(parts)
    else:
        found = (
            f"{jax.tree.structure(got)} with shapes {_shapes(got)}, where init gives "
            f"{jax.tree.structure(want)} with shapes {_shapes(want)}"
        )
    raise ValueError(
        f"{who}.update: the state's {field!r} field has another layout than {who}'s init "
        f"gives ({found}): the state was made by a transform with other settings (mode, "
        f"history, window_size, max_grad_norm, ...). Pass the state this transform's init "
        f"returned, or {RESTORE_HINT}"
    )


def why_empty(opt_state: Any) -> str:
    """Why :func:`clipjax.metrics` found no clipjax state in ``opt_state``: the warning's end."""
    module = type(opt_state).__module__
    nnx = sys.modules.get("flax.nnx")
    if module.startswith("flax.nnx") and isinstance(opt_state, Mapping):
        if holds_restored(opt_state):
            return (
                ": flax's nnx.state() keeps no group names (flax holds a state's static "
                "part, the names, in the graphdef): pass optimizer.opt_state, the "
                "nnx.Optimizer itself, or all of nnx.split(optimizer)"
            )
        return ": this nnx state holds no clipjax transform's state"
    if nnx is not None and hasattr(opt_state, "opt_state") and hasattr(opt_state, "tx"):
        return (
            f": this {type(opt_state).__name__} holds no clipjax transform (its tx has none); "
            "put one in the optax transform it was built with"
        )
    if holds_restored(opt_state):
        return (
            ": it holds dicts shaped like a clipjax state restored without a target, which "
            f"keep no names; {RESTORE_HINT}"
        )
    return "; is a clipjax transform part of this optimizer?"
