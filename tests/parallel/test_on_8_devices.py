"""Runs the data-parallel tests of this package on 8 fake CPU devices.

XLA fixes the number of host devices when JAX starts its backend, so the
8-device tests cannot share the main test process: this launcher starts
``python -m pytest tests/parallel`` in a subprocess with
``CLIPJAX_TEST_DEVICES=8`` (see ``conftest.py``), where every test asserts
``jax.device_count() == 8``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.parallel.conftest import DEVICES, ENV
from tests.paths import ROOT

# Slow, `make test` skips it: starts `pytest tests/parallel` in a subprocess with 8
# CPU devices.
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def test_data_parallel_suite_on_8_fake_devices() -> None:
    env = dict(os.environ)
    for name in list(env):
        if name.startswith(("PYTEST_XDIST", "PYTEST_CURRENT")):
            del env[name]
    env[ENV] = str(DEVICES)
    env["XLA_FLAGS"] = (
        f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES}".strip()
    )
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(HERE), "-q", "-p", "no:cacheprovider", "-rfE"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"8-device tests failed:\n{output[-20000:]}"
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) >= 40, output[-4000:]
    assert not re.search(r"\d+ (skipped|xfailed|deselected)", output), output[-4000:]
    print(output.strip().splitlines()[-1])
