"""The repository's scripts (examples/), run in a subprocess or imported, as the tests do
(:class:`Script`); and Python code run in a fresh interpreter (on fake CPU devices where
a test needs them)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

from tests.paths import ROOT

# This session's variables, which a fresh interpreter must not inherit: pytest's (a
# nested pytest would think it is an xdist worker) and the 8-device switch of
# tests/parallel/conftest.py.
_SESSION_VARIABLES = ("PYTEST_XDIST", "PYTEST_CURRENT", "CLIPJAX_TEST_DEVICES")


def python(
    *args: str, timeout: float, devices: int | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``python *args`` from the repository root, with it on ``PYTHONPATH``.

    Args:
      *args: the interpreter's arguments (``"-c", code``, a script, ``"-m", module``).
      timeout: seconds before the subprocess is killed (and the test fails).
      devices: that many CPU devices (``--xla_force_host_platform_device_count``),
        JAX on the CPU.
      env: variables to set besides, after the above.
    """
    variables = {k: v for k, v in os.environ.items() if not k.startswith(_SESSION_VARIABLES)}
    variables["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    if devices is not None:
        flag = f"--xla_force_host_platform_device_count={devices}"
        variables["XLA_FLAGS"] = f"{variables.get('XLA_FLAGS', '')} {flag}".strip()
        variables["JAX_PLATFORMS"] = "cpu"
    variables.update(env or {})
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=variables,
        cwd=ROOT,
    )


def run(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python script *args``: :func:`python` on a script."""
    return python(str(script), *args, timeout=timeout)


def load(script: Path, name: str) -> ModuleType:
    """``script`` imported as the module ``name`` (registered first: dataclasses looks
    the module up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Script(NamedTuple):
    """One of examples/: run in a subprocess (within ``timeout`` seconds), or imported
    as the module ``module``."""

    path: Path
    module: str
    timeout: float = 300

    def run(self, *args: str, timeout: float | None = None) -> subprocess.CompletedProcess[str]:
        return run(self.path, *args, timeout=timeout or self.timeout)

    def load(self) -> ModuleType:
        return load(self.path, self.module)

    def check_help_and_refusal(self, options: tuple[str, ...], *bad: str) -> None:
        """``--help`` names every one of ``options``; the arguments ``bad`` (an unknown
        setting) exit with status 2, saying so."""
        result = self.run("--help")
        assert result.returncode == 0
        for option in options:
            assert option in result.stdout
        result = self.run(*bad)
        assert result.returncode == 2
        assert "unknown setting" in result.stderr
