"""Two JAX processes of 4 CPU devices each, joined by ``jax.distributed`` over loopback,
against one process on 8 devices (``tests/parallel``'s tolerances): ``jax.jit`` on a
``("data", "model")`` mesh (autoclip, zclip per layer, agc, adagc, and ``skip_on_spike``
fed the loss), replicated metrics, an orbax checkpoint restored bit-identically;
``jax.shard_map`` with per-process data and ``axis_name``; a killed process named; a
mismatched clipper scope caught by the documented structure check.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("flax", reason="the multi-process worker trains a flax model")
pytest.importorskip("orbax.checkpoint", reason="the multi-process worker checkpoints with orbax")
import jax

if not hasattr(jax, "shard_map"):
    pytest.skip("the multi-process worker uses jax.shard_map (jax >= 0.7)", allow_module_level=True)

from tests.multiprocess.launch import LaunchError, free_loopback_port, launch
from tests.parallel.reference import STEPS
from tests.trees import assert_trees_close, assert_trees_equal

pytestmark = pytest.mark.slow

SPLIT, RESUMED, SPIKE_STEP = 4, 3, 5  # as in worker.py
CLIPPERS = ("autoclip", "zclip_per_layer", "agc", "adagc")


def assert_processes_agree(results: list[dict[str, Any]], scenario: str) -> None:
    """Every process gathered the same values, bit for bit."""
    first = results[0][scenario]
    for i, result in enumerate(results[1:], 1):
        other = result[scenario]
        for case, record in first.items():
            for t, (a, b) in enumerate(zip(other[case]["steps"], record["steps"])):
                what = f"{scenario} {case} step {t}: process {i} vs 0: "
                assert_trees_equal((a["params"], a["state"]), (b["params"], b["state"]), what)
                # NaN equals NaN here: a skipped step's clipper reads grad_norm NaN.
                np.testing.assert_equal(a["metrics"], b["metrics"], err_msg=what)
                assert a["skipped"] == b["skipped"], what
            np.testing.assert_equal(
                other[case]["metrics"], record["metrics"], err_msg=f"{scenario} {case}"
            )


def assert_equals_one_process(mine: dict[str, Any], ref: dict[str, Any], scenario: str) -> None:
    """The multi-process run equals one process on 8 devices (tests/parallel's tolerances)."""
    assert mine.keys() == ref.keys()
    for case in ref:
        assert len(mine[case]["steps"]) == len(ref[case]["steps"]) == STEPS
        for t, (a, b) in enumerate(zip(mine[case]["steps"], ref[case]["steps"])):
            what = f"{scenario} {case} step {t}: "
            assert_trees_close(a["params"], b["params"], what=what + "params ")
            assert_trees_close(a["state"], b["state"], what=what + "state ")
            assert a["metrics"].keys() == b["metrics"].keys(), what
            keys = sorted(b["metrics"])
            mine_m, ref_m = ([x["metrics"][k] for k in keys] for x in (a, b))
            np.testing.assert_allclose(
                mine_m, ref_m, rtol=1e-5, atol=1e-5, err_msg=what + "metrics"
            )
            assert a["skipped"] == b["skipped"], what


def assert_metrics_are_replicated_scalars(results: list[dict[str, Any]], scenario: str) -> None:
    """``clipjax.metrics`` outside jit: replicated scalars (not fully addressable on either
    process) that ``float()`` reads on each, equal to the metrics the step returned."""
    for i, result in enumerate(results):
        for case, record in result[scenario].items():
            assert record["not_replicated"] == [], f"process {i} {case}"
            assert record["addressable"] == 0, f"process {i} {case}"
            assert record["metrics"] == record["steps"][-1]["metrics"], f"process {i} {case}"


def one_process(scenario: str, tmp_path: Path) -> dict[str, Any]:
    """The same scenario in one process on 8 devices."""
    return launch([scenario], tmp_path / "one_process", processes=1, devices=8)[0]


def test_sharded_jit_and_orbax_checkpoint_on_two_processes(tmp_path: Path) -> None:
    reference = one_process("jit", tmp_path)
    results = launch(["jit_checkpoint"], tmp_path / "two_processes", processes=2, devices=4)
    assert [r["process_index"] for r in results] == [0, 1]
    assert_processes_agree(results, "jit")
    assert_equals_one_process(results[0]["jit"], reference["jit"], "jit")
    assert_metrics_are_replicated_scalars(results, "jit")
    for result in results:
        clippers, skip = result["jit"]["clippers"], result["jit"]["skip_on_spike"]
        # The momentum (adamw: mu and nu) of the model-sharded leaves is sharded:
        # Dense_0's kernel and bias, Dense_1's kernel.
        assert clippers["sharded_leaves"] == 3 and skip["sharded_leaves"] == 6
        assert clippers["compiled"] == skip["compiled"] == 1
        # leaf_norms=True: per-leaf norms are replicated scalars too.
        leaf_keys = [k for k in clippers["metrics"] if "/leaf/" in k]
        assert len(leaf_keys) == 4, sorted(clippers["metrics"])
        for name in CLIPPERS:
            assert any(k.startswith(f"{name}/") for k in clippers["metrics"]), name
        assert clippers["steps"][SPIKE_STEP]["metrics"]["autoclip/global/clipped"] == 1.0
        decisions = [s["skipped"] for s in skip["steps"]]
        assert decisions == [t == SPIKE_STEP for t in range(STEPS)], decisions
        # The orbax checkpoint (written by both processes) restores bit-identically
        # with the same shardings, and 3 more steps equal the uninterrupted run.
        for case, record in result["jit"].items():
            assert_trees_equal(record["restored"], record["saved"], f"{case} restored")
            assert record["sharding_differences"] == [], case
            for t, step in enumerate(record["resumed"]):
                expected = record["steps"][SPLIT + t]
                assert_trees_equal(
                    (step["params"], step["state"]),
                    (expected["params"], expected["state"]),
                    f"{case} resumed step {SPLIT + t}",
                )
                assert step["skipped"] == expected["skipped"]
            assert_trees_equal(
                (record["saved"][0], record["saved"][1]),
                (record["steps"][SPLIT - 1]["params"], record["steps"][SPLIT - 1]["state"]),
                f"{case} saved",
            )


def _norm(tree: Any) -> float:
    return float(
        np.sqrt(sum(np.sum(np.asarray(x, np.float64) ** 2) for x in jax.tree.leaves(tree)))
    )


def test_shard_map_with_per_process_data_on_two_processes(tmp_path: Path) -> None:
    reference = one_process("shard_map", tmp_path)
    results = launch(["shard_map"], tmp_path / "two_processes", processes=2, devices=4)
    assert_processes_agree(results, "shard_map")
    assert_equals_one_process(results[0]["shard_map"], reference["shard_map"], "shard_map")
    assert_metrics_are_replicated_scalars(results, "shard_map")
    record = results[0]["shard_map"]
    for t, step in enumerate(record["skip_on_spike"]["steps"]):
        # The decision is taken on the mean over all 8 devices (both processes)
        # of each device's own gradient norm and loss.
        grads = step["grads"]
        norms = [_norm(jax.tree.map(lambda g, d=d: g[d], grads)) for d in range(8)]
        m = step["metrics"]
        np.testing.assert_allclose(m["skip_on_spike/global/grad_norm"], np.mean(norms), rtol=1e-5)
        np.testing.assert_allclose(
            m["skip_on_spike/global/value"], np.mean(step["losses"], dtype=np.float64), rtol=1e-5
        )
        assert step["skipped"] == (t == SPIKE_STEP), t
    for t, step in enumerate(record["clippers"]["steps"]):
        for layer in ("params/Dense_0", "params/Dense_1"):
            per_device = [
                _norm(jax.tree.map(lambda g, d=d: g[d], step["grads"]["params"][layer[7:]]))
                for d in range(8)
            ]
            got = step["metrics"][f"zclip_per_layer/{layer}/grad_norm"]
            np.testing.assert_allclose(got, np.mean(per_device), rtol=1e-5, err_msg=f"{t} {layer}")


def test_mismatched_clipper_scope_across_processes_raises(tmp_path: Path) -> None:
    """zclip(scope="global") on process 0, scope="per_layer" on process 1."""
    results = launch(["mismatch", "mismatch_run"], tmp_path, processes=2, devices=4)
    for i, result in enumerate(results):
        raised = result["mismatch"]["raised"]
        assert raised is not None, f"process {i}: the structure check passed"
        assert "the optimizer states differ across processes" in raised, raised
    # The control, why the check is needed: JAX runs the two different programs
    # without an error, and the "replicated" parameters silently differ.
    a, b = (r["mismatch_run"]["params"] for r in results)
    difference = max(
        float(np.max(np.abs(x - y))) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )
    assert difference > 1e-4, difference


def test_a_dead_process_is_named_and_the_other_is_killed(tmp_path: Path) -> None:
    with pytest.raises(LaunchError) as info:
        launch(["jit"], tmp_path, processes=2, devices=4, grace=5.0, kill=(1, "progress1"))
    message = str(info.value)
    assert re.match(r"process 1 \(pid \d+\) was killed by SIGKILL", message), message
    assert (tmp_path / "progress1").exists()
    assert not (tmp_path / "process0.pkl").exists()  # process 0 did not finish
    # Process 0 either failed on its own (its peer gone) or was killed after the grace time.
    assert re.search(
        r"process 0 (exited with status [1-9]|was killed)|process\(es\) \[0\]", message
    )


def test_a_run_past_its_time_is_killed(tmp_path: Path) -> None:
    with pytest.raises(LaunchError, match=r"ran past 1 s; process\(es\) \[0, 1\] still running"):
        launch(["jit"], tmp_path, processes=2, devices=4, timeout=1.0)


def test_no_loopback_port_fails_with_a_clear_message(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(self: socket.socket, address: Any) -> None:
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(socket.socket, "bind", refuse)
    with pytest.raises(LaunchError, match=r"cannot bind a TCP port on the loopback address"):
        free_loopback_port()
