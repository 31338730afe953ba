"""Step time of ``chain(clipper, adam)`` next to ``chain(optax.clip_by_global_norm, adam)``.

The whole training step is jitted (gradients are inputs; ``update`` +
``apply_updates``; params and optimizer state donated). Each clipper family
(its scopes, ``optax.clip_by_global_norm`` + adam as the baseline, adam alone
as the floor; for AGC also ``optax.adaptive_grad_clip``) is timed interleaved:
every round runs each configuration once for a block of steps, in a rotating
order. Figures are medians over rounds; ratios are medians of the per-round
ratios, with their inter-quartile range.

    PYTHONPATH=. .venv/bin/python benchmarks/steptime.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

BASE = "optax.clip_by_global_norm[global]"
AGC_BASE = "optax.adaptive_grad_clip[unitwise]"
ADAM = "adam (no clipping)"


def families(clippers: Sequence[common.Clipper]) -> dict[str, list[common.Clipper]]:
    """clipjax clippers grouped by algorithm, in registry order."""
    out: dict[str, list[common.Clipper]] = {}
    for c in clippers:
        if c.owner == "clipjax":
            out.setdefault(c.algo, []).append(c)
    return out


def measure(
    clippers: Sequence[common.Clipper], shapes: Any, rounds: int = 15, target_s: float = 0.05
) -> dict[str, Any]:
    params, grads = common.params_and_grads(shapes)
    refs = {c.name: c for c in clippers if c.owner == "optax"}
    rows: dict[str, Any] = {}
    errors: dict[str, str] = {}
    aliased: dict[str, Any] = {}

    def runner(name: str, tx: optax.GradientTransformation | None) -> common.Runner | None:
        try:
            r = common.Runner(common.with_adam(tx), params, grads)
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
            return None
        rows[name] = {
            "compile_s": r.total_compile_s,
            "bytes_accessed": float(r.cost.get("bytes accessed", float("nan"))),
        }
        if r.aliased:
            aliased[name] = r.aliased
        return r

    common.log("  steptime: compiling baselines")
    base = runner(BASE, refs[BASE].make())
    adam = runner(ADAM, None)
    agc_base = runner(AGC_BASE, refs[AGC_BASE].make()) if AGC_BASE in refs else None
    for algo, members in families(clippers).items():
        common.log(f"  steptime: {algo}")
        runners: dict[str, common.Runner] = {BASE: base, ADAM: adam}
        if members[0].kind == "agc" and agc_base is not None:
            runners[AGC_BASE] = agc_base
        for c in members:
            r = runner(c.name, c.make())
            if r is not None:
                runners[c.name] = r
        samples = common.interleave(
            {k: v.run for k, v in runners.items()}, rounds=rounds, target_s=target_s
        )
        global_name = f"{algo}[global]"
        for c in members:
            if c.name not in samples:
                continue
            s = samples[c.name]
            q1, med, q3 = common.quantiles(s)
            row = rows[c.name]
            row.update({"median_s": med, "q1_s": q1, "q3_s": q3})
            row["vs_base"] = common.ratio_stats(s, samples[BASE])
            row["vs_adam"] = common.ratio_stats(s, samples[ADAM])
            if c.scope != "global" and global_name in samples:
                row["vs_global"] = common.ratio_stats(s, samples[global_name])
            if AGC_BASE in samples:
                row["vs_agc_base"] = common.ratio_stats(s, samples[AGC_BASE])
        for ref in (BASE, ADAM, AGC_BASE):
            if ref in samples:
                rows.setdefault(ref, {}).setdefault("samples", []).extend(samples[ref])
                if ref != BASE:
                    rows[ref].setdefault("vs_base_samples", []).extend(
                        a / b for a, b in zip(samples[ref], samples[BASE])
                    )
        for name, r in runners.items():
            if name not in (BASE, ADAM, AGC_BASE):
                r.delete()
    for ref in (BASE, ADAM, AGC_BASE):
        if ref in rows and "samples" in rows[ref]:
            q1, med, q3 = common.quantiles(rows[ref]["samples"])
            rows[ref].update({"median_s": med, "q1_s": q1, "q3_s": q3})
            if ref != BASE:
                q1r, medr, q3r = common.quantiles(rows[ref]["vs_base_samples"])
                rows[ref]["vs_base"] = {"median": medr, "q1": q1r, "q3": q3r}
            del rows[ref]["samples"]
            rows[ref].pop("vs_base_samples", None)
    return {
        "params": common.num_params(shapes),
        "leaves": common.num_leaves(shapes),
        "grad_bytes": common.tree_bytes(grads),
        "rounds": rounds,
        "rows": rows,
        "errors": errors,
        "aliased_init_state": aliased,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    clippers, notes = common.registry()
    for note in notes:
        print(note)
    result = measure(clippers, common.transformer_shapes(), rounds=args.rounds)
    print(json.dumps(result, indent=1, default=str))


if __name__ == "__main__":
    main()
