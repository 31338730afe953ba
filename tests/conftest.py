"""Shared fixtures: a small MLP-shaped params tree, gradient generators, x64."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, settings

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


Params = dict[str, Any]
GradFn = Callable[..., Params]

# (in_features, out_features) of each Dense layer of the reference MLP.
MLP_LAYERS = ((4, 8), (8, 3))


def mlp_params(
    seed: int = 0, layers: tuple[tuple[int, int], ...] = MLP_LAYERS, dtype: Any = jnp.float32
) -> Params:
    """A flax-linen-shaped MLP params tree: ``{"params": {"Dense_i": {kernel, bias}}}``."""
    key = jax.random.PRNGKey(seed)
    dense = {}
    for i, (n_in, n_out) in enumerate(layers):
        key, sub = jax.random.split(key)
        dense[f"Dense_{i}"] = {
            "kernel": (jax.random.normal(sub, (n_in, n_out)) / np.sqrt(n_in)).astype(dtype),
            "bias": jnp.zeros((n_out,), dtype),
        }
    return {"params": dense}


def random_grads(params: Params, seed: int = 0, scale: float = 1.0) -> Params:
    """Gaussian gradients shaped and typed like ``params``, times ``scale``."""
    leaves, treedef = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    grads = [
        (scale * jax.random.normal(k, leaf.shape, jnp.float32)).astype(leaf.dtype)
        for k, leaf in zip(keys, leaves)
    ]
    return jax.tree_util.tree_unflatten(treedef, grads)


def grad_stream(
    params: Params,
    steps: int,
    seed: int = 0,
    spikes: dict[int, float] | None = None,
    nonfinite: dict[int, float] | None = None,
) -> Iterator[Params]:
    """Yields ``steps`` gradient trees of roughly constant norm.

    Args:
      params: the tree whose shapes and dtypes the gradients take.
      steps: how many gradients to yield.
      seed: base seed; step ``i`` uses ``seed + i``.
      spikes: ``{step: factor}``, gradients multiplied by ``factor`` at ``step``.
      nonfinite: ``{step: value}``, the first leaf's first element set to
        ``value`` (``nan`` or ``inf``) at ``step``.
    """
    spikes = spikes or {}
    nonfinite = nonfinite or {}
    for i in range(steps):
        grads = random_grads(params, seed + i, spikes.get(i, 1.0))
        if i in nonfinite:
            leaves, treedef = jax.tree_util.tree_flatten(grads)
            first = leaves[0]
            leaves[0] = first.reshape(-1).at[0].set(nonfinite[i]).reshape(first.shape)
            grads = jax.tree_util.tree_unflatten(treedef, leaves)
        yield grads


@pytest.fixture
def params() -> Params:
    """A small two-layer MLP params tree (float32)."""
    return mlp_params()


@pytest.fixture
def grads(params: Params) -> Params:
    """One gradient tree shaped like ``params``."""
    return random_grads(params, seed=1)


@pytest.fixture
def make_grads() -> Callable[..., Params]:
    """``make_grads(params, seed=0, scale=1.0)``: Gaussian gradients like ``params``."""
    return random_grads


@pytest.fixture
def make_grad_stream() -> Callable[..., Iterator[Params]]:
    """``make_grad_stream(params, steps, seed=0, spikes=None, nonfinite=None)``."""
    return grad_stream


@pytest.fixture
def x64() -> Iterator[None]:
    """Enables ``jax_enable_x64`` for one test and restores the previous value."""
    previous = jax.config.read("jax_enable_x64")
    jax.config.update("jax_enable_x64", True)
    try:
        yield
    finally:
        jax.config.update("jax_enable_x64", previous)


# `make test` runs `-m "not slow"` (a few minutes on 2 cores); `make test-all`
# and .ci/run run everything. Long runs are marked here, in one place, rather
# than in each file. Measured one file at a time with `--durations`.
#
# Whole files, relative to tests/, and why each is slow.
SLOW_FILES = {
    # Executes both notebooks top to bottom (training runs, plots).
    "test_notebooks.py": "runs the notebooks",
    # Builds the Sphinx site (and its notebooks) before checking it.
    "test_docs_site.py": "builds the docs site",
    # Long scans: thousands of steps per clipper.
    "test_long_run.py": "long scans",
    # Trains the byte-level transformer of examples/lm_spikes.py.
    "test_lm_spikes.py": "trains a small language model",
    # Runs examples/demo.py in a subprocess (13 training runs at full size).
    "test_demo.py": "runs the demo",
    # Builds the wheel and installs it into a fresh virtual environment.
    "test_wheel.py": "builds and installs the wheel",
    # Runs the benchmark scripts.
    "test_benchmarks.py": "runs the benchmarks",
    # Step-by-step traces of smartclip, zclip and drytorch (torch) next to
    # clipjax, hundreds of steps each; each clipper's own file keeps a short
    # reference check in the fast suite.
    "test_references.py": "reference traces against smartclip, zclip, drytorch",
    # Starts `pytest tests/parallel` in a subprocess with 8 CPU devices.
    "parallel/test_on_8_devices.py": "8-device subprocess",
}

# Single tests (node id prefixes, relative to tests/), and why.
SLOW_TESTS = {
    # Starts a subprocess with 8 CPU devices.
    "test_compat.py::test_tree_map_params_derives_sharding_on_8_devices": "8-device subprocess",
    # Seven wrappers, each compiled twice (update and metrics), per clipper:
    # the heaviest clippers run here; the fast suite keeps the others
    # (global, per_param, per_layer, agc, adagc, the element-wise clippers)
    # and every wrapper.
    **{
        f"test_contract.py::test_metrics_found_in_every_wrapper[{name}]": "7 wrappers compiled"
        for name in (
            "autoclip",
            "autoclip_ema_per_param",
            "autoclip_window",
            "clip_by_percentile",
            "hist_clip",
            "hist_clip_ema_per_layer",
            "zscore_clip",
        )
    },
    # Accumulates over MultiSteps for many steps, compiled per clipper; the
    # contract tests keep MultiSteps (and every other wrapper) in the fast suite.
    "test_wrappers.py::test_multi_steps_clips_the_accumulated_gradient_once_per_real_step": (
        "long accumulation run"
    ),
    # inject_hyperparams against the clipper rebuilt per value: the history
    # clippers compile the longest; the others stay in the fast suite.
    **{
        "test_wrappers.py::test_inject_hyperparams_equals_the_clipper_built_with_those_values"
        f"[{name}]": "compiles per hyperparameter value"
        for name in ("autoclip", "autoclip_window")
    },
    # Hypothesis examples through autoclip's sorted history, one compile per
    # example shape; the other clippers' properties stay in the fast suite.
    "test_properties.py::test_dtype_preserved_and_unclipped_leaves_untouched[float32-autoclip]": (
        "50 hypothesis examples"
    ),
    "test_properties.py::test_scale_threshold_identity[autoclip]": "50 hypothesis examples",
    "test_properties.py::test_scale_threshold_identity[autoclip_window]": "50 hypothesis examples",
    # Full flax training runs saved and resumed; the orbax standard
    # checkpointer round trip stays in the fast suite.
    "test_checkpoint.py::test_flax_serialization_resumes_bit_identically": "train, save, resume",
    "test_checkpoint.py::test_nnx_optimizer_orbax_resumes_bit_identically": "train, save, resume",
    # A linen TrainState training run per clipper; the nnx.Optimizer run per
    # clipper and the linen per-layer names test stay in the fast suite.
    "test_flax.py::test_linen_train_state_trains_with_every_clipper": "a training run per clipper",
}

_TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the long runs listed above ``slow``."""
    for item in items:
        try:
            relative = item.path.relative_to(_TESTS_DIR).as_posix()
        except ValueError:  # doctests under clipjax/
            continue
        node = relative + "::" + item.nodeid.split("::", 1)[-1] if "::" in item.nodeid else relative
        if relative in SLOW_FILES or any(node.startswith(prefix) for prefix in SLOW_TESTS):
            item.add_marker(pytest.mark.slow)
