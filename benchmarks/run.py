"""Runs the benchmarks and writes benchmarks/RESULTS.md from their measurements (``make bench``).

    python benchmarks/run.py                        # everything, ~15 min on 2 CPU cores
    python benchmarks/run.py --quick                # smaller sizes, about a minute
    python benchmarks/run.py --only traffic,steptime --out /tmp/R.md

Each section is also a script of its own (``python benchmarks/traffic.py``).
The page shows measurements and optax comparisons; how each figure compares
with its target in ``common.TARGETS`` is printed to stderr at the end (the
targets are the benchmark's, and tests/release/test_benchmarks.py asserts them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import common
import percentile
import scaling
import steptime
import traffic


def _smartclip(quick: bool) -> tuple[str, list]:
    # smartclip (the reference package) is imported only for its section: the GPU image
    # that benchmarks/device.sh runs on does not have it.
    import smartclip_jax

    return smartclip_jax.section(quick)


SECTIONS = {
    "traffic": traffic.section,
    "steptime": steptime.section,
    "scaling": scaling.section,
    "smartclip": _smartclip,
    "percentile": percentile.section,
}


def gpu_section() -> str:
    """Where the GPU figures are: this page's, or not measured yet."""
    dev = common.jax.devices()[0]
    if dev.platform == "gpu":
        where = f"The figures on this page were measured on {dev.device_kind} (header above)."
    else:
        where = (
            "Every figure on this page is measured on the CPU above. "
            "`bash benchmarks/device.sh` measures the traffic, full-size copy, step-time and "
            "smartclip sections on a GPU (`benchmarks/RESULTS_GPU.md`)."
        )
    return "\n".join(["## GPU", "", where])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer rounds")
    parser.add_argument("--only", default=",".join(SECTIONS), help="comma-separated sections")
    parser.add_argument("--out", default=os.path.join(common.ROOT, "benchmarks", "RESULTS.md"))
    args = parser.parse_args()
    names = args.only.split(",")
    unknown = set(names) - set(SECTIONS)
    if unknown:
        parser.error(f"unknown sections {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    head = common.header(common.command("run.py", sys.argv[1:], out=True))
    texts, checks, took = [], [], []
    for name in names:
        common.log(f"== {name}")
        t0 = time.perf_counter()
        text, found = SECTIONS[name](args.quick)
        texts.append(text)
        checks += found
        took.append(f"{name} {time.perf_counter() - t0:.0f} s")
    head.append(f"* **load average at end**: {common.load_average()}")
    intro = (
        "Wall-clock figures come from interleaved runs on the machine below; memory traffic "
        "from XLA's cost analysis (repeatable)."
    )
    report = common.page("# clipjax benchmarks", intro, head, *texts, gpu_section())
    common.write(args.out, report, f" ({'quick' if args.quick else 'full'}: {', '.join(took)})")
    # The targets are the benchmark's own (common.TARGETS), not the page's.
    common.log("== targets")
    for target, measured, ok in checks:
        common.log(f"{'met   ' if ok else 'MISSED'} {target}: {measured}")


if __name__ == "__main__":
    main()
