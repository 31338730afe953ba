"""The benchmarks run and write every section; the repeatable figures (XLA's bytes accessed, not
the machine's load) hold; wall-clock times are never asserted."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import pytest

from tests.compiled_step import ordinary_path
from tests.paths import ROOT

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import common
import traffic

pytestmark = pytest.mark.slow  # runs the benchmark scripts

compile_bench = __import__("compile")  # benchmarks/compile.py

SHAPES = common.transformer_shapes(**common.QUICK.model)

# jaxlib 0.4's cost analysis counts one more full read in every optimizer
# (clipjax 4.0 vs optax 8.0 gradient bytes, the same difference): the bounds
# below are for the current one.
traffic_bounds = pytest.mark.skipif(
    tuple(int(p) for p in jax.__version__.split(".")[:2]) < (0, 5),
    reason="bytes-accessed bounds are calibrated on jaxlib >= 0.5's cost analysis",
)
SECTIONS = (
    "## Memory traffic",
    "## Step time",
    "## Scaling with the number of leaves",
    "## smartclip's JAX backend",
    "## Percentile clipping: exact vs approximate",
    "## GPU",
)


@traffic_bounds
def test_the_clippers_read_the_gradients_once() -> None:
    groups = {g.title: g for g in common.groups(("global",))}
    with ordinary_path():  # what an ordinary step reads (tests/compiled_step.py)
        figures = {
            k: v for name in ("clip_by_global_norm", "zclip", "agc")
            for k, v in traffic.extra(groups[name], SHAPES).items()
        }  # fmt: skip
    assert figures["clipjax.clip_by_global_norm + adam"] <= common.TARGETS["traffic"]
    # optax's select and division over full tensors: about 5 gradient bytes.
    assert figures[common.OPTAX_GN] >= 3.0
    assert figures["clipjax.zclip[global] + adam"] <= common.TARGETS["traffic"]
    # agc reads the gradients and the params once.
    assert figures["clipjax.agc[global] + adam"] <= 2.0 + 0.2
    assert figures["clipjax.agc[unitwise] + adam"] <= figures[common.OPTAX_AGC] + 0.1


@traffic_bounds
def test_unitwise_agc_traffic_target_on_the_benchmark_tree() -> None:
    # Unit norms weigh more on the small tree; the target is set on the benchmark's.
    group = {g.title: g for g in common.groups(("global",))}["agc"]
    with ordinary_path():
        full = traffic.extra(group, common.transformer_shapes(**common.FULL.model))
    assert (
        full["clipjax.agc[unitwise] + adam"]
        <= full[common.OPTAX_AGC] + common.TARGETS["agc_traffic"]
    )


# A compiled module's text, trimmed: a fusion whose body holds a copy, a conditional whose
# branch copies a [4,8] buffer, and copies of a scalar and of a shape that no leaf has.
HLO = """HloModule jit_step, entry_computation_layout={(f32[4,8]{1,0}, f32[8]{0})->f32[4,8]{1,0}}

%fused_computation (param_0: f32[4,8]) -> f32[4,8] {
  %param_0 = f32[4,8]{1,0} parameter(0)
  ROOT %copy.1 = f32[4,8]{0,1} copy(%param_0)
}

%branch_1 (arg: (f32[4,8], s32[])) -> (f32[4,8], s32[]) {
  %arg = (f32[4,8]{1,0}, s32[]) parameter(0)
  %get-tuple-element.1 = f32[4,8]{1,0} get-tuple-element(%arg), index=0
  %copy.2 = f32[4,8]{1,0} copy(%get-tuple-element.1)
  %get-tuple-element.2 = s32[] get-tuple-element(%arg), index=1
  %copy.3 = s32[] copy(%get-tuple-element.2)
  ROOT %tuple = (f32[4,8]{1,0}, s32[]) tuple(%copy.2, %copy.3)
}

ENTRY %main.9 (p0: f32[4,8], p1: f32[8]) -> f32[4,8] {
  %p0 = f32[4,8]{1,0} parameter(0)
  %p1 = f32[8]{0} parameter(1)
  %copy.4 = f32[8]{0} copy(%p1)
  %copy.5 = f32[2,8]{1,0} copy(%p0)
  ROOT %fusion = f32[4,8]{1,0} fusion(%p0), kind=kLoop, calls=%fused_computation
}
"""


def test_full_size_copies_counts_unfused_copies_of_leaf_shapes() -> None:
    shapes = {
        "w": jax.ShapeDtypeStruct((4, 8), "float32"),
        "b": jax.ShapeDtypeStruct((8,), "float32"),
    }
    # copy.2 (a branch's [4,8]) and copy.4 ([8]); not the fused copy.1, the scalar copy.3
    # or copy.5, whose shape no leaf has.
    assert common.full_size_copies(HLO, shapes) == 2
    assert common.full_size_copies(HLO, {"w": shapes["w"]}) == 1


def test_adam_step_has_no_full_size_copy() -> None:
    group = common.groups(("global",))[0]
    assert common.copies(common.ADAM, group, SHAPES) == 0


def test_skip_on_spike_steps_have_no_full_size_copy() -> None:
    skip = [g for g in common.new_groups() if g.title.startswith("skip_on_spike")]
    labels = [(g, label) for g in skip for label in g.configs if "clipjax.skip_on_spike" in label]
    # around adam and chain(zclip, adam): optax's and clipjax's; around StableAdamW
    assert len(labels) == 5
    for group, label in labels:
        assert common.copies(label, group, SHAPES) == 0, label


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
    # The page shows measurements; the targets are the benchmark's, on stderr.
    assert "Targets" not in text and "do not edit" not in text
    targets = proc.stderr.split("== targets")[1]
    assert targets.count("\nmet ") + targets.count("\nMISSED ") >= 8


def test_compile_page_says_what_each_row_computes_and_where_compile_time_goes() -> None:
    # Every row that can miss its target has its explanation (a missing one is a KeyError).
    assert set(compile_bench.CLIPJAX) <= set(compile_bench.NEEDS)
    text = compile_bench.constructs(4, 1, ["spam", "clip_by_value"])
    assert text.startswith("## Where the compile time goes\n")
    rows = [line for line in text.splitlines() if line.startswith("| ")][1:]
    assert [r.split(" | ")[0][2:] for r in rows] == list(compile_bench.CONSTRUCTS)
    assert "| +0.00 |" in rows[0]  # the element-wise-only baseline
    for label in ("spam", "clip_by_value"):
        assert f"* `{label}`: {compile_bench.NEEDS[label]}." in text
    assert "adaclip`:" not in text
    assert compile_bench.constructs(4, 1, []).count("\n* `") == 0


def test_train_step_page_has_its_header_and_a_row_per_configuration(tmp_path: str) -> None:
    # The smoke test's model, one layout, one row and its counterpart, one round (~15 s).
    cmd = [sys.executable, os.path.join("benchmarks", "train_step.py"), "--size", "tiny"]
    cmd += ["--rows", "clip_by_global_norm", "--layouts", "scanned", "--rounds", "1"]
    proc = subprocess.run([*cmd, "--out", str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(os.path.join(tmp_path, "TRAIN_STEP.md")) as f:
        text = f.read()
    fields = ("command", "date", "device", "machine", "load average at start", "versions")
    for field in (*fields, "load average at end"):
        assert f"* **{field}**: " in text
    for package in ("jax", "jaxlib", "optax", "clipjax", "numpy"):
        assert f" {package} " in text
    assert "`python benchmarks/train_step.py --size tiny --rows clip_by_global_norm" in text
    assert str(tmp_path) not in text  # no machine path
    assert "\n## Scanned layers\n" in text and "\n## Unscanned layers\n" not in text
    header, *rows = [line for line in text.splitlines() if line.startswith("| ")]
    columns = [c.strip() for c in header.strip("|").split("|")]
    assert [r.split(" | ")[0][2:] for r in rows] == ["`optax_clip`", "`clip_by_global_norm`"]
    for row in rows:
        cells = dict(zip(columns, (c.strip() for c in row.strip("|").split("|"))))
        assert cells["bytes accessed"].isdigit() and int(cells["bytes accessed"]) > 0
        assert cells["full-size copies"].isdigit()
        assert float(cells["step ms (wall)"]) > 0 and float(cells["step ms (CPU)"]) > 0
    assert "`optax_clip`" in rows[1] and "≤ 1.01" in rows[1]
