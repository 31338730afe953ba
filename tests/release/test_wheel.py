"""The wheel installs into a clean virtual environment (no system site packages, jax, optax, chex
and numpy from the package index) and, from outside the checkout, imports clipjax and runs an
``optax.chain(clipjax.autoclip(), optax.adam(1e-3))`` update. ``make test-wheel`` (CI) runs it
with ``CLIPJAX_TEST_WHEEL=1``; without it, it skips (it downloads a few hundred megabytes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.paths import ROOT

# Read, not imported: `make test-wheel` runs this file (with --noconftest) from an
# environment that needs only pytest, build and twine.
VERSION = re.search(
    r'^__version__ = "([^"]+)"', (ROOT / "clipjax" / "__init__.py").read_text(), re.M
).group(1)

# Slow, `make test` skips it.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("CLIPJAX_TEST_WHEEL") != "1",
        reason=(
            "set CLIPJAX_TEST_WHEEL=1 (make test-wheel): installs the wheel from the package index"
        ),
    ),
]

SMOKE = """
import pathlib, sys
import jax.numpy as jnp
import optax
import clipjax

expected_version, checkout = sys.argv[1], pathlib.Path(sys.argv[2])
location = pathlib.Path(clipjax.__file__).resolve()
assert checkout not in location.parents, f"imported the checkout: {location}"
assert "site-packages" in location.parts, location
assert clipjax.__version__ == expected_version, clipjax.__version__
assert (location.parent / "py.typed").exists(), "py.typed is not installed"

params = {"w": jnp.ones(3), "b": jnp.zeros(2)}
tx = optax.chain(clipjax.autoclip(), optax.adam(1e-3))
state = tx.init(params)
grads = {"w": jnp.full(3, 2.0), "b": jnp.ones(2)}
updates, state = tx.update(grads, state, params)
params = optax.apply_updates(params, updates)
metrics = clipjax.metrics(state)
assert abs(float(metrics["autoclip/global/grad_norm"]) - 14.0**0.5) < 1e-5, metrics
assert all(bool(jnp.isfinite(u).all()) for u in updates.values())
print("clipjax", clipjax.__version__, "from", location.parent)
"""


def run(*args: str | Path, cwd: Path) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, f"{args}\n{result.stdout}\n{result.stderr}"
    return result.stdout


def wheel(tmp_path: Path) -> Path:
    """The wheel of this version from dist/ (``make dist``), else one built now."""
    built = sorted((ROOT / "dist").glob(f"clipjax-{VERSION}-*.whl"))
    if built:
        return built[-1]
    out = tmp_path / "wheelhouse"
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", out, ROOT, cwd=tmp_path)
    return next(out.glob("clipjax-*.whl"))


def test_wheel_contents(tmp_path: Path) -> None:
    names = zipfile.ZipFile(wheel(tmp_path)).namelist()
    package = {n for n in names if not n.startswith(f"clipjax-{VERSION}.dist-info/")}
    assert all(n.startswith("clipjax/") for n in package), sorted(package)
    assert {"clipjax/__init__.py", "clipjax/py.typed"} <= package
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names


def test_wheel_installs_and_updates(tmp_path: Path) -> None:
    path = wheel(tmp_path)
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", venv, cwd=tmp_path)
    python = venv / "bin" / "python"
    run(python, "-m", "pip", "install", "--quiet", path, cwd=tmp_path)
    out = run(python, "-c", SMOKE, VERSION, ROOT, cwd=tmp_path)
    assert f"clipjax {VERSION}" in out
