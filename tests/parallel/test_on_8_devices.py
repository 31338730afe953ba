"""Runs this package's data-parallel tests in a subprocess with 8 fake CPU devices
(``CLIPJAX_TEST_DEVICES=8``, see ``conftest.py``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests import scripts
from tests.parallel.conftest import DEVICES, ENV

# Slow, `make test` skips it: starts `pytest tests/parallel` in a subprocess with 8
# CPU devices.
pytestmark = pytest.mark.slow

HERE = Path(__file__).resolve().parent


def test_data_parallel_suite_on_8_fake_devices() -> None:
    pytest_args = [str(HERE), "-q", "-p", "no:cacheprovider", "-rfE"]
    proc = scripts.python(
        "-m", "pytest", *pytest_args, timeout=900, devices=DEVICES, env={ENV: str(DEVICES)}
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"8-device tests failed:\n{output[-20000:]}"
    summary = re.search(r"(\d+) passed", output)
    assert summary and int(summary.group(1)) >= 40, output[-4000:]
    assert not re.search(r"\d+ (skipped|xfailed|deselected)", output), output[-4000:]
    print(output.strip().splitlines()[-1])
