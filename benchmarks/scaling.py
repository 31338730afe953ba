"""How step time, compile time and state size grow with leaves and parameters.

Two sweeps over stacks of identical dense layers (``kernel`` + ``bias`` per
layer, so ``per_layer`` has half as many groups as ``per_param``):

* leaves: 10 ... 5,000 leaves at a fixed parameter count;
* parameters: 1e5 ... 1e8 at a fixed leaf count, as far as memory allows.

Each point compiles the jitted step of adam alone, ``optax.clip_by_global_norm``
+ adam, clipjax's ``clip_by_global_norm`` + adam and ``zclip`` + adam in
every scope (``zclip`` stands for the engine every adaptive clipper runs on),
records trace+compile seconds and the number of distinct compiled kernels,
then times the steps interleaved. State bytes are computed for every clipper
in the registry without compiling.

    PYTHONPATH=. .venv/bin/python benchmarks/scaling.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

import clipjax

ADAM = "adam (no clipping)"
BASE = "optax.clip_by_global_norm[global]"


def variants() -> dict[str, Any]:
    """label -> factory of the clipper (None: adam alone)."""
    out: dict[str, Any] = {
        ADAM: None,
        BASE: lambda: optax.clip_by_global_norm(1.0),
        "clip_by_global_norm[global]": lambda: clipjax.clip_by_global_norm(1.0),
    }
    for scope in common.SCOPES:
        out[f"zclip[{scope}]"] = lambda scope=scope: clipjax.zclip(
            warmup_steps=common.WARM, scope=scope
        )
    return out


def point(shapes: Any, rounds: int, target_s: float) -> dict[str, Any]:
    """Compile and time every variant on one tree."""
    params, grads = common.params_and_grads(shapes)
    runners: dict[str, common.Runner] = {}
    rows: dict[str, Any] = {}
    for label, make in variants().items():
        tx = common.with_adam(None if make is None else make())
        t0 = time.perf_counter()
        r = common.Runner(tx, params, grads)
        common.log(f"    {label}: compiled in {time.perf_counter() - t0:.1f} s")
        runners[label] = r
        rows[label] = {
            "trace_s": r.trace_s,
            "compile_s": r.compile_s,
            "total_compile_s": r.total_compile_s,
            "kernels": r.kernels,
            "distinct_kernels": r.distinct_kernels,
            "state_bytes": common.tree_bytes(r.state),
            "bytes_accessed": float(r.cost.get("bytes accessed", float("nan"))),
            "grad_bytes": common.tree_bytes(grads),
        }
    del params
    samples = common.interleave(
        {k: v.run for k, v in runners.items()}, rounds=rounds, target_s=target_s, warmup=2
    )
    for label, s in samples.items():
        q1, med, q3 = common.quantiles(s)
        rows[label].update({"median_s": med, "q1_s": q1, "q3_s": q3})
        rows[label]["vs_base"] = common.ratio_stats(s, samples[BASE])
        scope = label.split("[")[-1].rstrip("]")
        if label.startswith("zclip[") and scope != "global":
            rows[label]["vs_global"] = common.ratio_stats(s, samples["zclip[global]"])
    for r in runners.values():
        r.delete()
    return rows


def adam_state_bytes(total: int) -> int:
    return 2 * 4 * total + 4


def leaves_sweep(
    leaf_counts: Sequence[int], total: float, rounds: int, target_s: float, max_compile: int
) -> dict[str, Any]:
    out: dict[str, Any] = {"total": total, "points": {}, "skipped": {}}
    for n in leaf_counts:
        shapes = common.stack_shapes(n, total)
        key = common.num_leaves(shapes)
        if n > max_compile:
            out["skipped"][key] = (
                f"not compiled: more than --max-compile-leaves={max_compile} leaves "
                "(compile time on this machine)"
            )
            continue
        common.log(f"  scaling: {key} leaves, {common.num_params(shapes)} params")
        out["points"][key] = {
            "params": common.num_params(shapes),
            "rows": point(shapes, rounds, target_s),
        }
    return out


def params_sweep(
    totals: Sequence[float], n_leaves: int, rounds: int, target_s: float
) -> dict[str, Any]:
    out: dict[str, Any] = {"leaves": n_leaves, "points": {}, "skipped": {}}
    copies = 3 * len(variants()) + 3  # params, mu, nu per variant; grads; a spare pair
    for total in totals:
        shapes = common.stack_shapes(n_leaves, total)
        n = common.num_params(shapes)
        need = copies * 4 * n
        avail = common.memory_available()
        if need > 0.6 * avail:
            out["skipped"][n] = (
                f"needs about {common.fmt_bytes(need)} ({copies} float32 copies), "
                f"{common.fmt_bytes(avail)} available"
            )
            common.log(f"  scaling: {n} params skipped ({out['skipped'][n]})")
            continue
        common.log(f"  scaling: {n} params, {common.num_leaves(shapes)} leaves")
        out["points"][n] = {
            "leaves": common.num_leaves(shapes),
            "rows": point(shapes, rounds, target_s),
        }
    return out


def state_table(leaf_counts: Sequence[int], total: float) -> dict[str, Any]:
    """Clipper state bytes (no compile) for every clipper and scope."""
    clippers, _ = common.registry(refs=False)
    out: dict[str, Any] = {}
    for n in leaf_counts:
        shapes = common.stack_shapes(n, total)
        key = common.num_leaves(shapes)
        out[key] = {}
        for c in clippers:
            if c.scope not in ("global", "per_param", "unitwise"):
                continue
            try:
                out[key][c.name] = common.state_bytes(c.make, shapes)
            except Exception as err:
                out[key][c.name] = f"{type(err).__name__}: {err}"
    return out


def measure(quick: bool = False, max_compile: int | None = None) -> dict[str, Any]:
    if quick:
        leaf_counts, leaf_total = [10, 100], 1e5
        totals, rounds, target_s = [1e5, 1e6], 5, 0.05
        state_counts = [10, 1000, 5000]
    else:
        leaf_counts, leaf_total = [10, 100, 1000, 5000], 1e6
        totals, rounds, target_s = [1e5, 1e6, 1e7, 1e8], 9, 0.1
        state_counts = [10, 100, 1000, 5000]
    if max_compile is None:
        max_compile = 1000
    return {
        "leaves": leaves_sweep(leaf_counts, leaf_total, rounds, target_s, max_compile),
        "params": params_sweep(totals, 20, rounds, target_s),
        "state": state_table(state_counts, leaf_total),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--max-compile-leaves", type=int, default=None)
    args = parser.parse_args()
    print(json.dumps(measure(args.quick, args.max_compile_leaves), indent=1, default=str))


if __name__ == "__main__":
    main()
