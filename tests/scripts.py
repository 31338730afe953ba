"""The repository's scripts (examples/), run in a subprocess or imported, as the tests do."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

from tests.paths import ROOT


def run(script: Path, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """``python script *args`` from the repository root, with it on ``PYTHONPATH``."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    return subprocess.run(
        [sys.executable, str(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def load(script: Path, name: str) -> ModuleType:
    """``script`` imported as the module ``name`` (registered first: dataclasses looks
    the module up in ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, script)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
