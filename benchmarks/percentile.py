"""``clip_by_percentile``: exact (sort) vs approximate (radix select) bound, speed and error.

For one flat leaf of ``n`` float32 elements, one jitted
``clipjax.clip_by_percentile(p, method=...).update`` per method, timed as the
median of several calls after compilation. The error column is the largest
``|bound - numpy's percentile| / numpy's percentile`` of the approximate
method over several distributions (normal, Cauchy, log-normal, integer ties,
one huge outlier) and percentiles; the exact method's is shown next to it.

    python benchmarks/percentile.py [--quick]
"""

from __future__ import annotations

from typing import Any

import common
import jax
import jax.numpy as jnp
import numpy as np

import clipjax

PERCENTILES = (2.0, 50.0, 99.0, 99.9)


def data(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    x = {
        "normal": lambda: rng.standard_normal(n),
        "cauchy": lambda: rng.standard_cauchy(n),
        "lognormal": lambda: rng.lognormal(0.0, 4.0, n),
        "ties": lambda: rng.integers(-3, 4, n).astype(np.float64),
        "outlier": lambda: np.where(np.arange(n) == n // 2, 1e15, rng.standard_normal(n)),
    }[kind]()
    return x.astype(np.float32)


def clip(p: float, method: str) -> tuple[Any, Any]:
    tx = clipjax.clip_by_percentile(p, method=method)
    return jax.jit(tx.update), tx.init


def bound(update: Any, init: Any, x: np.ndarray) -> float:
    tree = {"w": jnp.asarray(x)}
    state = update(tree, init(tree))[1]
    return float(clipjax.metrics(state)["clip_by_percentile/w/bound"])


def seconds(update: Any, init: Any, n: int, reps: int) -> list[float]:
    """Wall seconds of ``reps`` calls, each timed alone, after one."""
    tree = {"w": jnp.asarray(data("normal", n, np.random.default_rng(0)))}
    state = init(tree)

    def calls(count: int) -> None:
        for _ in range(count):
            jax.block_until_ready(update(tree, state))

    return common.interleave({"update": calls}, reps, 1, warm=1)[0]["update"]


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    rng = np.random.default_rng(0)
    rows, worst = [], 0.0
    for n in size.percentile_sizes:
        common.log(f"  percentile: {n}")
        exact, approx = clip(99.0, "exact"), clip(99.0, "approx")
        t_exact, t_approx = seconds(*exact, n, size.reps), seconds(*approx, n, size.reps)
        errors = {"exact": 0.0, "approx": 0.0}
        for p in PERCENTILES if n <= size.error_max_n else ():
            fns = {m: clip(p, m) for m in errors}
            for kind in ("normal", "cauchy", "lognormal", "ties", "outlier"):
                x = data(kind, n, rng)
                ref = float(np.percentile(np.abs(x).astype(np.float64), p))
                for m, fn in fns.items():
                    errors[m] = max(errors[m], abs(bound(*fn, x) - ref) / (ref or 1.0))
        worst = max(worst, errors["approx"])
        rows.append(
            [
                n,
                common.ms(t_exact),
                common.ms(t_approx),
                f"{common.median(t_exact) / common.median(t_approx):.1f}×",
                *(f"{e:.2e}" if n <= size.error_max_n else "" for e in errors.values()),
            ]
        )
    header = ["n", "exact ms", "approx ms", "speed-up", "exact max rel. error"]
    text = [
        "## Percentile clipping: exact vs approximate",
        "",
        f"One jitted `clipjax.clip_by_percentile(99.0, method=...)` update of a one-leaf tree "
        f"({size.reps} timed calls, median [IQR]); errors (up to n = {size.error_max_n}) "
        "against numpy's float64 percentile over 5 distributions and percentiles "
        f"{', '.join(map(str, PERCENTILES))}.",
        "",
        common.table([*header, "approx max rel. error"], rows),
    ]
    limit = common.TARGETS["percentile_error"]
    checks = [
        (
            f"`method='approx'`: bound within a relative {limit:.2e} of the exact percentile",
            f"{worst:.2e}",
            worst <= limit,
        )
    ]
    return "\n".join(text), checks


if __name__ == "__main__":
    common.main(section, __doc__)
