"""Gradient spikes and what a clipper does about them.

Trains a small flax.nnx MLP on a synthetic regression task (on the CPU, in a few
seconds) with ``optax.chain(clipper, optax.adam(1e-3))``. At a few known steps
the batch is corrupted (inputs and targets multiplied by ``--spike-scale``),
which produces a gradient spike. Every ``--log-every`` steps it prints the loss
and the clipper's metrics, read from the optimizer state with
``clipjax.metrics(optimizer.opt_state)``; at the end it prints a summary table
and writes every step's metrics to ``--out``.

Usage::

    python examples/demo.py                        # clip_by_global_norm(1.0)
    python examples/demo.py --clipper zclip
    python examples/demo.py --clipper all          # every clipper, plus no clipping
"""

from __future__ import annotations

import argparse
import csv
import math
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import clipjax

# Clippers the demo knows how to build, in display order; only those present in
# the installed clipjax are offered.
CLIPPER_NAMES = ("clip_by_global_norm", "autoclip", "zscore_clip", "zclip", "hist_clip", "agc")
NO_CLIPPING = "none"

IN_FEATURES = 16
HIDDEN = 64
BATCH_SIZE = 64
EVAL_SIZE = 1024
LEARNING_RATE = 1e-3
RECOVERY_WINDOW = 50  # steps after a spike searched for the worst loss


def available_clippers() -> dict[str, Callable[[], optax.GradientTransformation]]:
    """Factories of the clippers present in the installed clipjax, default settings."""
    clippers: dict[str, Callable[[], optax.GradientTransformation]] = {}
    for name in CLIPPER_NAMES:
        factory = getattr(clipjax, name, None)
        if factory is None:
            continue
        if name == "clip_by_global_norm":
            clippers[name] = lambda factory=factory: factory(1.0)
        else:
            clippers[name] = factory
    clippers[NO_CLIPPING] = optax.identity
    return clippers


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.hidden1 = nnx.Linear(IN_FEATURES, HIDDEN, rngs=rngs)
        self.hidden2 = nnx.Linear(HIDDEN, HIDDEN, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, 1, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = nnx.gelu(self.hidden1(x))
        x = nnx.gelu(self.hidden2(x))
        return self.out(x)


def make_data(
    steps: int, seed: int, spike_steps: list[int], spike_scale: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Training batches for every step (spikes included) and a clean eval set.

    The target is a fixed random two-layer network of the inputs plus noise.
    """
    rng = np.random.default_rng(seed)
    w1 = rng.normal(size=(IN_FEATURES, 32)) / math.sqrt(IN_FEATURES)
    w2 = rng.normal(size=(32, 1)) / math.sqrt(32)

    def sample(*shape: int) -> tuple[np.ndarray, np.ndarray]:
        x = rng.normal(size=(*shape, IN_FEATURES))
        y = np.sin(x @ w1) @ w2 + 0.05 * rng.normal(size=(*shape, 1))
        return x.astype(np.float32), y.astype(np.float32)

    x_train, y_train = sample(steps, BATCH_SIZE)
    for step in spike_steps:
        x_train[step] *= spike_scale
        y_train[step] *= spike_scale
    x_eval, y_eval = sample(EVAL_SIZE)
    return x_train, y_train, x_eval, y_eval


def mse(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


@nnx.jit
def train_step(
    model: MLP,
    optimizer: nnx.Optimizer,
    x: jax.Array,
    y: jax.Array,
    x_eval: jax.Array,
    y_eval: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """One update; returns the batch loss and the eval loss after the update."""
    loss, grads = nnx.value_and_grad(mse)(model, x, y)
    optimizer.update(model, grads)
    return loss, mse(model, x_eval, y_eval)


def summarize(metrics: dict[str, float]) -> str:
    """A short line of the headline metrics, whatever the clipper and its groups."""
    by_field: dict[str, list[float]] = {}
    for key, value in metrics.items():
        by_field.setdefault(key.rsplit("/", 1)[-1], []).append(value)
    parts = []
    for field, reduce, label in (
        ("grad_norm", max, "grad_norm"),
        ("threshold", min, "threshold"),
        ("target", min, "target"),
        ("scale", min, "scale"),
        ("clipped_count", max, "clipped_count"),
    ):
        if field in by_field:
            values = by_field[field]
            label = label if len(values) == 1 else f"{reduce.__name__} {label}"
            parts.append(f"{label} {reduce(values):.4g}")
    return "  ".join(parts)


def train(
    name: str,
    make_clipper: Callable[[], optax.GradientTransformation],
    data: tuple[np.ndarray, ...],
    seed: int,
    log_every: int,
    spike_steps: list[int],
) -> list[dict[str, float]]:
    """Trains one model; returns one row per step (losses and clipper metrics)."""
    x_train, y_train, x_eval, y_eval = (jnp.asarray(a) for a in data)
    model = MLP(nnx.Rngs(seed))
    tx = optax.chain(make_clipper(), optax.adam(LEARNING_RATE))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    print(f"\n== {name}")
    rows = []
    for step in range(x_train.shape[0]):
        loss, eval_loss = train_step(model, optimizer, x_train[step], y_train[step], x_eval, y_eval)
        metrics = {k: float(v) for k, v in clipjax.metrics(optimizer.opt_state).items()}
        rows.append({"step": step, "loss": float(loss), "eval_loss": float(eval_loss), **metrics})
        if step % log_every == 0 or step in spike_steps or step == x_train.shape[0] - 1:
            mark = "  <- spike" if step in spike_steps else ""
            line = f"step {step:4d}  loss {float(loss):10.4g}  eval {float(eval_loss):8.4g}"
            print(f"{line}  {summarize(metrics)}".rstrip() + mark)
    return rows


def report(rows: list[dict[str, float]], spike_steps: list[int]) -> tuple[float, float, str]:
    """Final eval loss, worst eval loss in the windows after spikes, steps clipped."""
    final = rows[-1]["eval_loss"]
    after = [
        row["eval_loss"]
        for spike in spike_steps
        for row in rows[spike : spike + RECOVERY_WINDOW + 1]
    ]
    worst = max(after, default=float("nan"))
    counts = [v for k, v in rows[-1].items() if k.endswith("/clipped_count")]
    if not counts:
        clipped = "-"
    elif len(counts) == 1:
        clipped = f"{int(counts[0])} / {len(rows)}"
    else:
        clipped = f"{int(max(counts))} / {len(rows)} (max of {len(counts)} counters)"
    return final, worst, clipped


def write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def plot(path: Path, runs: dict[str, list[dict[str, float]]], spike_steps: list[int]) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rows in runs.items():
        ax.plot([r["step"] for r in rows], [r["eval_loss"] for r in rows], label=name)
    for spike in spike_steps:
        ax.axvline(spike, color="grey", linestyle=":", linewidth=1)
    ax.set(yscale="log", xlabel="step", ylabel="eval loss (MSE)", title="Gradient spikes (dotted)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def parse_args(clipper_names: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small MLP through injected gradient spikes; print clipper metrics.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--clipper",
        default="clip_by_global_norm",
        help=f"one of {', '.join(clipper_names)}; a comma-separated list; or 'all'",
    )
    parser.add_argument("--steps", type=int, default=400, help="training steps")
    parser.add_argument("--seed", type=int, default=0, help="seed for data and model")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder")
    parser.add_argument("--log-every", type=int, default=50, help="print every N steps")
    parser.add_argument(
        "--spike-steps", default="150,300", help="comma-separated steps whose batch is corrupted"
    )
    parser.add_argument(
        "--spike-scale", type=float, default=100.0, help="factor on inputs and targets at spikes"
    )
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    if args.log_every < 1:
        parser.error("--log-every must be at least 1")
    try:
        spikes = {int(s) for s in args.spike_steps.split(",") if s.strip()}
    except ValueError:
        parser.error(f"--spike-steps must be comma-separated integers, got {args.spike_steps!r}")
    args.spike_steps = sorted(s for s in spikes if 0 <= s < args.steps)
    names = clipper_names if args.clipper == "all" else args.clipper.split(",")
    unknown = [n for n in names if n not in clipper_names]
    if unknown:
        parser.error(
            f"unknown clipper {', '.join(unknown)}; choose from {', '.join(clipper_names)}"
        )
    args.clippers = names
    return args


def main() -> None:
    clippers = available_clippers()
    args = parse_args(list(clippers))
    data = make_data(args.steps, args.seed, args.spike_steps, args.spike_scale)
    print(
        f"{args.steps} steps of adam({LEARNING_RATE}) on a {IN_FEATURES}-{HIDDEN}-{HIDDEN}-1 MLP; "
        f"batches at steps {args.spike_steps} scaled by {args.spike_scale:g}"
    )

    start = time.perf_counter()
    runs = {
        name: train(name, clippers[name], data, args.seed, args.log_every, args.spike_steps)
        for name in args.clippers
    }
    elapsed = time.perf_counter() - start

    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in runs.items():
        write_csv(args.out / f"{name}.csv", rows)
    plotted = plot(args.out / "eval_loss.png", runs, args.spike_steps)

    width = max(len("clipper"), *(len(n) for n in runs))
    print(f"\n{'clipper':<{width}}  {'final loss':>10}  {'worst after spikes':>18}  steps clipped")
    for name, rows in runs.items():
        final, worst, clipped = report(rows, args.spike_steps)
        worst_text = f"{worst:18.4g}" if args.spike_steps else f"{'-':>18}"
        print(f"{name:<{width}}  {final:10.4g}  {worst_text}  {clipped}")
    print(
        f"\nLosses are eval MSE on {EVAL_SIZE} clean samples; 'worst after spikes' is the "
        f"highest within {RECOVERY_WINDOW} steps of a spike."
    )
    written = "per-step metrics (CSV)" + (" and eval_loss.png" if plotted else "")
    print(f"Wrote {written} to {args.out}/ in {elapsed:.1f} s of training.")


if __name__ == "__main__":
    main()
