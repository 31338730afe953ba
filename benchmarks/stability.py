"""The stability score of the recorded GPU runs, and what the monitor costs a step.

1. ``clipjax.stability_monitor`` (OLMo-core's spike score) replayed over the
   recorded streams of ``tests/data/lm_spikes_gpu_norms.npz`` (the raw gradient
   norm and the loss of each of 2000 steps, 3 seeds, four rows): its spikes,
   ``spike_score`` at the last step (the last ``--rolling-window`` steps) and
   ``spike_score_total``.
2. XLA's "bytes accessed" (``compiled.cost_analysis()``, repeatable) of a jitted
   step with and without the monitor chained first before adamw: the optimizer step
   alone (update + apply_updates, params and state donated) on the benchmarks'
   transformer-shaped tree, and the whole training step (loss, gradient, update,
   apply) of ``benchmarks/train_step.py``'s model, scanned layers (``--quick``: its
   ``--size cpu`` only, else ``cpu`` and ``gpu``, compiled for this machine).
   "Ordinary path" leaves out the overflow-safe norm's recompute, a ``lax.cond``
   branch taken only when a float32 sum of squares overflows, which the cost
   analysis counts although no ordinary step runs it (tests/compiled_step.py).

    python benchmarks/stability.py [--rolling-window 500] [--quick] [--out FOLDER]

Writes ``benchmarks/STABILITY.md``.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
import train_step
from train_step import SIZES

import clipjax
from tests.compiled_step import ordinary_path

DATA = os.path.join(common.ROOT, "tests", "data", "lm_spikes_gpu_norms.npz")
ROWS = ("none", "zclip_fb_cap1", "recommended", "static_2")
P = "stability_monitor/global/"


def replay(norms: np.ndarray, losses: np.ndarray, rolling_window: int) -> dict[str, np.ndarray]:
    """The monitor's metrics after every step of one stream, under ``lax.scan``; each
    step's updates are a one-leaf tree whose global norm is the recorded norm."""
    tx = clipjax.stability_monitor(rolling_window=rolling_window)

    def step(state: object, x: tuple[jax.Array, jax.Array]) -> tuple[object, dict]:
        _, state = tx.update({"w": x[0].reshape(1)}, state, value=x[1])
        return state, clipjax.metrics(state)

    state = tx.init({"w": jnp.zeros(1)})
    _, metrics = jax.jit(lambda s, xs: jax.lax.scan(step, s, xs))(state, (norms, losses))
    return {k: np.asarray(v) for k, v in metrics.items()}


def scores(rolling_window: int) -> str:
    data = np.load(DATA)
    rows = []
    for row in ROWS:
        cells = {"spikes": [], "score": [], "total": []}
        for seed in range(data[f"{row}/grad_norm"].shape[0]):
            m = replay(data[f"{row}/grad_norm"][seed], data[f"{row}/loss"][seed], rolling_window)
            cells["spikes"].append(f"{int(m[P + 'spike_count'][-1])}")
            cells["score"].append(f"{m[P + 'spike_score'][-1]:.4f}")
            cells["total"].append(f"{m[P + 'spike_score_total'][-1]:.4f}")
        rows.append([row, *(" / ".join(cells[k]) for k in ("spikes", "score", "total"))])
    head = ["row", "spikes (seeds 0 / 1 / 2)", f"spike_score (last {rolling_window})"]
    return common.table([*head, "spike_score_total"], rows)


def bytes_of(compile_step: Callable[[Callable], common.Compiled]) -> list[tuple[int, int]]:
    """``[(static, ordinary path)]`` bytes accessed of the step without and with the monitor."""
    makes = (
        lambda: optax.adamw(1e-3),
        lambda: optax.chain(clipjax.stability_monitor(), optax.adamw(1e-3)),
    )
    out = []
    for make in makes:
        static = compile_step(make).bytes
        with ordinary_path():
            out.append((static, compile_step(make).bytes))
    return out


def cost(quick: bool) -> str:
    shapes = common.transformer_shapes(**common.sizes(quick).model)
    grad_bytes = common.tree_bytes(shapes)

    def optimizer_step(make: Callable) -> common.Compiled:
        tx = make()
        return common.compile_jit(common.train_step(tx, True), *common.step_args(tx, shapes))

    def model_step(size: str) -> Callable[[Callable], common.Compiled]:
        return lambda make: train_step.compile_step(make, SIZES[size], "scanned", value=True)

    steps = {"optimizer step": optimizer_step}
    for size in ("cpu",) if quick else ("cpu", "gpu"):
        steps[f"training step, size {size}"] = model_step(size)
    rows = []
    for label, compile_step in steps.items():
        common.log(f"  {label}")
        (plain, plain_ordinary), (monitored, ordinary) = bytes_of(compile_step)
        extra = f"{(ordinary - plain_ordinary) / grad_bytes:+.3f}" if "optimizer" in label else ""
        rows.append([label, f"{monitored / plain:.4f}", f"{ordinary / plain_ordinary:.4f}", extra])
    head = ["step", "bytes × adamw, static", "bytes × adamw, ordinary path", "extra gradient bytes"]
    sizes = "; ".join(
        f"*size {k}*: {s.layers} layers, d_model {s.d}, batch {s.batch} x {s.context}"
        for k, s in SIZES.items()
        if k == "cpu" or (k == "gpu" and not quick)
    )
    about = (
        f"*optimizer step*: update and apply_updates on {common.describe(shapes)} "
        f"(`benchmarks/common.py`'s transformer tree); *training step, size ...*: loss, "
        f"gradient, update and apply of `benchmarks/train_step.py`'s model, scanned layers "
        f"({sizes}), compiled for this machine's backend. *extra gradient bytes*: the bytes "
        "the monitor adds, over the gradients' bytes."
    )
    return about + "\n\n" + common.table(head, rows)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rolling-window", type=int, default=500)
    parser.add_argument("--quick", action="store_true", help="the cpu-sized model only")
    parser.add_argument("--out", help="folder of the page (default benchmarks/)")
    args = parser.parse_args(argv)
    head = common.header(common.command("stability.py", argv), load=False)
    text = common.page(
        ["# The stability score of the recorded runs, and its cost", "", *head],
        "## Scores of the recorded GPU runs",
        f"`clipjax.stability_monitor(rolling_window={args.rolling_window})` (window_size 128, "
        "threshold_std 6) over `tests/data/lm_spikes_gpu_norms.npz`: 2000 steps of each "
        "seed, the raw gradient norm and the loss of each step; the scores at the last step.",
        scores(args.rolling_window),
        "## Cost",
        cost(args.quick),
    )
    print(text)
    common.write(common.page_path(args.out, "STABILITY.md"), text)


if __name__ == "__main__":
    main()
