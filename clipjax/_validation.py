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


def concrete(value: Any) -> float | None:
    """``value`` as a float where it is a concrete number, else None (a tracer, a non-number)."""
    try:
        return _concrete(value)
    except ValueError:
        return None


def check(name: str, value: Any, ok: Callable[[float], bool], expected: str) -> None:
    """Raises ``ValueError`` naming ``name`` unless ``ok(value)`` holds."""
    try:
        x = _concrete(value)
    except ValueError:
        kind = type(value).__name__
        raise ValueError(f"{name} must be a number {expected}, got {value!r} (a {kind})") from None
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
    """A percentile on the 0-100 scale, in ``(1, 100]``.

    A value in ``(0, 1]`` is almost surely a fraction (0.95 for the 95th
    percentile) and is refused with that question; a clipper at the 1st
    percentile or below would clip nearly every step or element, so nothing
    is lost.
    """
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


def choice(name: str, value: Any, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ValueError(f"{name} must be one of {options}, got {value!r}")
