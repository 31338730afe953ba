"""Smoke test of the benchmark suite (benchmarks/): the repeatable figures only.

Memory traffic comes from XLA's cost analysis and does not depend on the
machine's load, so it is asserted (SPEC 7); wall-clock times never are.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import optax
import pytest

import clipjax

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def bench() -> Any:
    sys.path.insert(0, BENCH)
    try:
        traffic = importlib.import_module("traffic")
        run = importlib.import_module("run")
    finally:
        sys.path.remove(BENCH)
    return traffic, run


@pytest.fixture(scope="module")
def figures(bench: Any) -> dict[str, float]:
    traffic, _ = bench
    params = traffic.model_params()
    base = traffic.bytes_accessed(optax.adam(1e-3), params)
    makes = {
        "optax.clip_by_global_norm[global]": lambda: optax.clip_by_global_norm(1.0),
        "clip_by_global_norm[global]": lambda: clipjax.clip_by_global_norm(1.0),
        "zclip[global]": lambda: clipjax.zclip(),
    }
    return {k: traffic.extra_traffic(m, params, base) for k, m in makes.items()}


def test_clip_by_global_norm_reads_the_gradients_once(figures: dict[str, float]) -> None:
    assert figures["clip_by_global_norm[global]"] <= 1.2
    # optax's select and division over full tensors: about 5 gradient bytes.
    assert figures["optax.clip_by_global_norm[global]"] >= 3.0


def test_adaptive_clipper_reads_the_gradients_once(figures: dict[str, float]) -> None:
    assert figures["zclip[global]"] <= 1.2


def test_report_states_the_traffic_targets(bench: Any, figures: dict[str, float]) -> None:
    traffic, run = bench
    params = traffic.model_params()
    results = {
        "traffic": {
            "rows": figures,
            "params": 1,
            "leaves": len(params["params"]) * 2,
            "grad_bytes": 4.0,
            "adam_bytes": 40.0,
        }
    }
    text = run.Report(results, ["benchmarks/run.py"], {"device": "test"}).render(None)
    assert "## Targets" in text and "## Memory traffic" in text
    target_rows = [line for line in text.splitlines() if "extra traffic ≤ 1.2" in line]
    assert len(target_rows) == 2 and all(line.endswith("| met |") for line in target_rows)
