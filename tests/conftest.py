"""Shared fixtures: the small MLP's params tree, a gradient stream, x64; the hypothesis
profiles; the slow marks."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import pytest
from hypothesis import HealthCheck, settings

from tests import model

# Marks the long runs slow at collection (the lists are in tests/slow_marks.py).
from tests.slow_marks import pytest_collection_modifyitems  # noqa: F401

# Deterministic property tests: the same examples on every run and machine, no
# per-example deadline (the first call of a jitted function compiles).
settings.register_profile(
    "ci",
    derandomize=True,
    deadline=None,
    max_examples=50,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("dev", deadline=None, max_examples=50)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def version_of(module: Any) -> tuple[int, ...]:
    """``(major, minor, patch)`` of a module's ``__version__``."""
    return tuple(int(part) for part in module.__version__.split(".")[:3] if part.isdigit())


@pytest.fixture
def params() -> model.Params:
    """The small two-layer MLP's params tree (float32): ``model.mlp_params()``."""
    return model.mlp_params()


@pytest.fixture
def make_grad_stream() -> Callable[..., Iterator[model.Params]]:
    """``make_grad_stream(params, steps, seed=0, spikes=None, nonfinite=None)``:
    ``model.grad_stream``."""
    return model.grad_stream


@pytest.fixture
def x64() -> Iterator[None]:
    """Enables ``jax_enable_x64`` for one test and restores the previous value."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)
