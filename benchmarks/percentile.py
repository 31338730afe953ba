"""Speed and error of the percentile methods behind ``clip_by_percentile``.

Compares, for one flat array of ``n`` elements (default 1e4 .. 1e7):

* ``exact``: :func:`clipjax._percentile.exact_percentile` (XLA sort);
* ``approx``: :func:`clipjax._percentile.approx_percentile` with its defaults
  (4096 bins, two radix passes for float32, bound ``2^-17`` relative);
* ``radix16``: ``approx_percentile(bins=2**16, passes=2)``, which resolves all
  31 bits of a float32 magnitude and so is exact;
* ``clip``: one jitted ``clip_by_percentile(99.0, method="auto")`` update of a
  one-leaf tree (bound, clamp, metrics).

Times are the median of ``--reps`` jitted calls after compilation, in
milliseconds. The error columns give, over several distributions (normal,
Cauchy, log-normal, integer ties, one huge outlier) and percentiles (0.1, 1,
50, 90, 99, 99.9, 100), the largest ``|approx - exact| / exact`` and the same
for ``radix16``, next to the documented bound; ``ok`` says whether every case
met ``|approx - exact| <= eps·exact + tiny + 4 ulp(exact)``.

Usage::

    PYTHONPATH=. .venv/bin/python benchmarks/percentile.py
    PYTHONPATH=. .venv/bin/python benchmarks/percentile.py --sizes 1e3 4096 1e5 --reps 9
    JAX_PLATFORMS=cuda PYTHONPATH=. python benchmarks/percentile.py   # on a GPU

The ``AUTO_EXACT_MAX_SIZE`` of ``clipjax/_percentile.py`` was chosen from this
table: the sort is the slower method at every size measured on CPU, but below
a few thousand elements both take well under a millisecond, so ``auto`` keeps
the exact result there.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _percentile, _value

PERCENTILES = (0.1, 1.0, 50.0, 90.0, 99.0, 99.9, 100.0)


def _data(kind: str, n: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "normal":
        x = rng.standard_normal(n)
    elif kind == "cauchy":
        x = rng.standard_cauchy(n)
    elif kind == "lognormal":
        x = rng.lognormal(0.0, 4.0, n)
    elif kind == "ties":
        x = rng.integers(-3, 4, n).astype(np.float64)
    elif kind == "outlier":
        x = rng.standard_normal(n)
        x[n // 2] = 1e30
    else:
        raise ValueError(kind)
    return x.astype(np.float32)


KINDS = ("normal", "cauchy", "lognormal", "ties", "outlier")


def _time(fn: Callable[..., Any], *args: Any, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - start)
    return 1e3 * statistics.median(samples)


def _all_percentiles(fn: Callable[..., Any], **kwargs: Any) -> Callable[[Any], Any]:
    # One jitted call per array for all percentiles (XLA shares the one sort).
    return jax.jit(lambda x: jnp.stack([fn(x, p, **kwargs) for p in PERCENTILES]))


def _errors(n: int, rng: np.random.Generator) -> tuple[float, float, bool]:
    exact = _all_percentiles(_percentile.exact_percentile)
    approx = _all_percentiles(_percentile.approx_percentile)
    radix16 = _all_percentiles(_percentile.approx_percentile, bins=2**16, passes=2)
    eps = _percentile.approx_relative_error()
    tiny = float(jnp.finfo(jnp.float32).tiny)
    worst = worst16 = 0.0
    ok = True
    for kind in KINDS:
        x = jnp.asarray(_data(kind, n, rng))
        e, a, r = (np.asarray(f(x), np.float64) for f in (exact, approx, radix16))
        ulp = np.spacing(e.astype(np.float32)).astype(np.float64)
        ok &= bool(np.all(np.abs(a - e) <= eps * e + tiny + 4 * ulp))
        ok &= bool(np.all(r == e))
        nonzero = e > 0
        if nonzero.any():
            worst = max(worst, float(np.max(np.abs(a - e)[nonzero] / e[nonzero])))
            worst16 = max(worst16, float(np.max(np.abs(r - e)[nonzero] / e[nonzero])))
    return worst, worst16, ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e4, 1e5, 1e6, 1e7])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-errors", action="store_true", help="timings only")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    exact = jax.jit(lambda x: _percentile.exact_percentile(x, 99.0))
    approx = jax.jit(lambda x: _percentile.approx_percentile(x, 99.0))
    radix16 = jax.jit(lambda x: _percentile.approx_percentile(x, 99.0, bins=2**16, passes=2))
    tx = _value.clip_by_percentile(99.0)
    print(f"device: {jax.devices()[0].device_kind}  ({jax.default_backend()})")
    print(f"auto: exact up to {_percentile.AUTO_EXACT_MAX_SIZE} elements")
    print(f"documented bound eps = {_percentile.approx_relative_error():.3g} (relative)")
    header = (
        f"{'n':>10} {'exact ms':>9} {'approx ms':>9} {'radix16 ms':>10} {'clip ms':>8} "
        f"{'speedup':>7} {'max rel err':>11} {'radix16 err':>11} {'ok':>3}"
    )
    print(header)
    for size in args.sizes:
        n = int(size)
        x = jnp.asarray(_data("normal", n, rng))
        tree = {"w": x}
        state = tx.init(tree)
        update = jax.jit(tx.update)
        t_exact = _time(exact, x, reps=args.reps)
        t_approx = _time(approx, x, reps=args.reps)
        t_radix16 = _time(radix16, x, reps=args.reps)
        t_clip = _time(update, tree, state, reps=args.reps)
        if args.no_errors:
            err = err16 = float("nan")
            ok = True
        else:
            err, err16, ok = _errors(n, rng)
        print(
            f"{n:>10} {t_exact:>9.3f} {t_approx:>9.3f} {t_radix16:>10.3f} {t_clip:>8.3f} "
            f"{t_exact / t_approx:>6.1f}x {err:>11.2e} {err16:>11.2e} {'yes' if ok else 'NO':>3}"
        )


if __name__ == "__main__":
    main()
