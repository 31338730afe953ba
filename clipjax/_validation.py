"""Construction-time checks that name the offending argument.

Hyperparameters may arrive as arrays or tracers (``optax.inject_hyperparams``
calls the factory with them); those cannot be checked in Python and are let
through, every concrete number is checked.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.core import Tracer


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


def check(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``ok(value)`` holds."""
    try:
        x = _concrete(value)
    except ValueError:
        raise ValueError(f"{name} must be {expected}, got {value!r}") from None
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


def open_unit(name: str, value: Any) -> None:
    check(name, value, lambda x: 0 < x < 1, "in (0, 1)")


def _static_hint(name: str) -> str:
    return (
        f"{name} fixes shapes or Python control flow, so it must be a Python value; "
        f"with optax.inject_hyperparams pass it in static_args=({name!r},)"
    )


def integer(name: str, value: Any, minimum: int = 0, static: bool = True) -> None:
    """An integer ``>= minimum``.

    ``static=True``: a Python int (it fixes a shape or Python control flow).
    ``static=False``: it only enters arithmetic, so an array or tracer (from
    ``optax.inject_hyperparams``) is accepted and checked when concrete.
    """
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


def differs(value: Any, default: float) -> bool:
    """Whether a hyperparameter is a concrete number other than ``default``.

    A tracer (an injected hyperparameter inside ``jit``) cannot be compared
    and counts as not differing; an array is compared at its own precision
    (``optax.inject_hyperparams`` makes the default 0.99 a float32 array).
    """
    try:
        x = _concrete(value)
    except ValueError:
        return True
    if x is None:
        return False
    dtype = np.asarray(value).dtype if not isinstance(value, (int, float)) else np.float64
    tolerance = float(np.finfo(dtype).eps) if np.issubdtype(dtype, np.floating) else 0.0
    return not math.isclose(x, default, rel_tol=tolerance, abs_tol=0.0)


def choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
