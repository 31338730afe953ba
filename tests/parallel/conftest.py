"""8 fake CPU devices for the data-parallel tests, in a process of their own.

XLA reads ``--xla_force_host_platform_device_count`` once, when JAX starts its backend,
so ``test_on_8_devices.py`` starts ``python -m pytest tests/parallel`` with
``CLIPJAX_TEST_DEVICES=8``, and this conftest sets ``XLA_FLAGS`` before anything starts
the backend. Without that variable only the launcher is collected. Directly::

    CLIPJAX_TEST_DEVICES=8 python -m pytest tests/parallel
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

DEVICES = 8
ENV = "CLIPJAX_TEST_DEVICES"
LAUNCHER = "test_on_8_devices.py"

_FLAG = f"--xla_force_host_platform_device_count={DEVICES}"

MULTI_DEVICE = os.environ.get(ENV) == str(DEVICES)

if MULTI_DEVICE:
    if _FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _named_on_command_line(path: Path, config: pytest.Config) -> bool:
    root = config.invocation_params.dir
    return any((root / arg.split("::")[0]).resolve() == path for arg in config.args)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """The launcher alone in the main process; everything else under 8 devices.

    An 8-device module named on the command line is collected anyway, and its
    tests fail with instructions instead of silently not running.
    """
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    if name == LAUNCHER:
        return True if MULTI_DEVICE else None
    if MULTI_DEVICE or _named_on_command_line(collection_path, config):
        return None
    return True


@pytest.fixture(autouse=True)
def _eight_devices(request: pytest.FixtureRequest) -> None:
    """Every test here runs with 8 devices, or fails (never silently on 1)."""
    import jax

    if request.path.name == LAUNCHER:
        return
    if MULTI_DEVICE:
        assert jax.device_count() == DEVICES, (
            f"expected {DEVICES} devices, got {jax.device_count()}: the backend started "
            "before XLA_FLAGS was set"
        )
    else:
        pytest.fail(
            f"the data-parallel tests need {DEVICES} devices: run them with {ENV}={DEVICES} "
            f"python -m pytest tests/parallel, or through {LAUNCHER}"
        )
