"""The benchmarks run and write every section; the repeatable figures (bytes accessed) hold.

Memory traffic comes from XLA's cost analysis and does not depend on the
machine's load, so it is asserted (SPEC 7); wall-clock times never are.
"""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common
import traffic

SHAPES = common.transformer_shapes(**common.QUICK.model)

# jaxlib 0.4's cost analysis counts one more full read in every optimizer
# (clipjax 4.0 vs optax 8.0 gradient bytes, the same difference): the bounds
# below are for the current one.
traffic_bounds = pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 5),
    reason="bytes-accessed bounds are calibrated on jaxlib >= 0.5's cost analysis",
)
SECTIONS = (
    "## Targets",
    "## Memory traffic",
    "## Step time",
    "## Scaling with the number of leaves",
    "## smartclip's JAX backend",
    "## Percentile clipping: exact vs approximate",
)


@pytest.fixture(scope="module")
def figures() -> dict[str, float]:
    groups = {g.title: g for g in common.groups(("global",))}
    return {
        **traffic.extra(groups["clip_by_global_norm"], SHAPES),
        **traffic.extra(groups["zclip"], SHAPES),
        **traffic.extra(groups["agc"], SHAPES),
    }


@traffic_bounds
def test_clip_by_global_norm_reads_the_gradients_once(figures: dict[str, float]) -> None:
    assert figures["clipjax.clip_by_global_norm + adam"] <= common.TARGETS["traffic"]
    # optax's select and division over full tensors: about 5 gradient bytes.
    assert figures[common.OPTAX_GN] >= 3.0


@traffic_bounds
def test_adaptive_clipper_reads_the_gradients_once(figures: dict[str, float]) -> None:
    assert figures["clipjax.zclip[global] + adam"] <= common.TARGETS["traffic"]


@traffic_bounds
def test_agc_reads_gradients_and_params_once(figures: dict[str, float]) -> None:
    assert figures["clipjax.agc[global] + adam"] <= 2.0 + 0.2
    assert figures["clipjax.agc[unitwise] + adam"] <= figures[common.OPTAX_AGC] + 0.1


def test_quick_run_writes_every_section(tmp_path: str) -> None:
    pytest.importorskip("smartclip", reason="the smartclip benchmark needs smartclip")
    out = os.path.join(tmp_path, "RESULTS.md")
    cmd = [sys.executable, os.path.join("benchmarks", "run.py"), "--quick", "--out", out]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(out) as f:
        text = f.read()
    for heading in SECTIONS:
        assert f"\n{heading}\n" in text
    for field in ("command", "date", "device", "machine", "versions"):
        assert f"* **{field}**: " in text
    assert "jaxlib" in text and "optax" in text
    targets = text.split("## Targets")[1].split("\n## ")[0]
    assert targets.count("| met |") + targets.count("| **missed** |") >= 8
