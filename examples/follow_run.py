"""A closed-loop run whose data changes for good: does a clipper follow it?

A linear regression (``DIM`` inputs, x ~ N(0, I), targets x . w + noise of std
``NOISE``) is trained on fresh batches of ``BATCH``, first with
``optax.sgd(lr, momentum=0.9)``, then with ``optax.adam(lr)``. At step
``CHANGE`` the targets change for good: a new weight vector, drawn afresh and
scaled to ``SHIFT`` times the norm of the first, so the gradient norm rises
for good. A clipper that follows the run lets the larger gradients of the new
normal through after a short while; one whose statistics ratchet keeps
clipping every step to the old level, a static clip at an accidental value.

Each row is one optax transform in front of the optimizer. The page gives the
population loss E[(x . w - y)^2] = |w - w_true|^2 + NOISE^2 (exact, no
sampling) just before the change and after the last step, and the share of
steps clipped from step ``LATE`` on (read from ``clipjax.metrics`` every
step; for optax's static clip: the global norm above its max_norm). Rows whose
arguments the installed clipjax does not accept are reported as "n/a".

Usage::

    python examples/follow_run.py                 # writes docs/generated/follow_run.{md,png}
    python examples/follow_run.py --steps 60 --change 30 --late 40 --out /tmp/f   # a smoke test
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_spikes import page_header  # the same page header

DIM = 16
BATCH = 32
NOISE = 0.1  # the loss floor is NOISE**2 = 0.01
STEPS = 700
CHANGE = 300  # the targets change for good at this step
LATE = 420  # "clipped after": the share of steps >= LATE that the clipper clipped
SHIFT = 4.0  # the new weight vector's norm over the old one's
SGD_LR = 0.01  # optax.sgd(SGD_LR, momentum=0.9)
ADAM_LR = 0.03  # optax.adam(ADAM_LR)
# The static clip: about the gradient norm of the first steps (2 |w| ~ 8), so it
# clips the start of training and the first steps after the change only.
STATIC_MAX_NORM = 10.0


class Row(NamedTuple):
    """One setting: a clipper that goes in front of the optimizer.

    Attributes:
      name: the row's name in the tables and the figure.
      make: builds the clipper (an optax transform).
      about: the code, as the page shows it.
      static_max_norm: for optax.clip_by_global_norm, which keeps no metrics.
    """

    name: str
    make: Callable[[], optax.GradientTransformation]
    about: str
    static_max_norm: float | None = None


# One list: add a row here and it appears in the tables and the loss figure.
ROWS: list[Row] = [
    Row("none", optax.identity, "optax.identity() (no clipping)"),
    Row(
        "static",
        lambda: optax.clip_by_global_norm(STATIC_MAX_NORM),
        f"optax.clip_by_global_norm({STATIC_MAX_NORM:g})",
        STATIC_MAX_NORM,
    ),
    Row(
        "zclip_old_recommended",
        lambda: clipjax.zclip(max_grad_norm=None, warmup_steps=10),
        "clipjax.zclip(max_grad_norm=None, warmup_steps=10)",
    ),
    Row(
        "zclip_clipped",
        lambda: clipjax.zclip(feedback="clipped"),
        'clipjax.zclip(feedback="clipped")',
    ),
    Row(
        "hist_clip_clipped",
        lambda: clipjax.hist_clip(feedback="clipped"),
        'clipjax.hist_clip(feedback="clipped")',
    ),
    Row(
        "autoclip_clipped",
        lambda: clipjax.autoclip(feedback="clipped"),
        'clipjax.autoclip(feedback="clipped")',
    ),
    Row(
        "zscore_clip_clipped",
        lambda: clipjax.zscore_clip(feedback="clipped"),
        'clipjax.zscore_clip(feedback="clipped")',
    ),
    Row(
        "zclip_percentile",
        lambda: clipjax.zclip(mode="percentile", max_grad_norm=None, warmup_steps=10),
        'clipjax.zclip(mode="percentile", max_grad_norm=None, warmup_steps=10)',
    ),
]
# The rows whose gradient norm and threshold the figure draws.
THRESHOLD_ROWS = ("zclip_old_recommended", "zclip_clipped", "zclip_percentile")

OPTIMIZERS: dict[str, tuple[Callable[[], optax.GradientTransformation], str]] = {
    "sgd": (lambda: optax.sgd(SGD_LR, momentum=0.9), f"optax.sgd({SGD_LR:g}, momentum=0.9)"),
    "adam": (lambda: optax.adam(ADAM_LR), f"optax.adam({ADAM_LR:g})"),
}


class Trace(NamedTuple):
    """One run, per step."""

    loss: np.ndarray  # population loss after the step's update
    grad_norm: np.ndarray  # global norm of the raw gradient
    threshold: np.ndarray  # the clipper's reported threshold (NaN where none)
    clipped: np.ndarray  # the clipper scaled the gradient down


def targets(seed: int) -> tuple[jax.Array, jax.Array]:
    """The weight vector before the change, and the one after (SHIFT x its norm)."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    w1 = jax.random.normal(k1, (DIM,))
    w2 = jax.random.normal(k2, (DIM,))
    return w1, w2 * (SHIFT * jnp.linalg.norm(w1) / jnp.linalg.norm(w2))


def quiet_metrics(state: Any) -> dict[str, jax.Array]:
    with warnings.catch_warnings():  # optax's own states hold no clipjax metrics
        warnings.simplefilter("ignore", UserWarning)
        return clipjax.metrics(state)


def run(row: Row, optimizer: optax.GradientTransformation, steps: int, change: int, seed: int):
    """Trains one setting for `steps` steps under one lax.scan; returns a Trace."""
    clipper = row.make()
    w1, w2 = targets(seed)
    data_key = jax.random.fold_in(jax.random.key(seed), 1)

    def loss_fn(w: jax.Array, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.mean((x @ w - y) ** 2)

    def step(carry: tuple, t: jax.Array) -> tuple[tuple, jax.Array]:
        w, clip_state, opt_state = carry
        w_true = jnp.where(t < change, w1, w2)
        kx, ke = jax.random.split(jax.random.fold_in(data_key, t))
        x = jax.random.normal(kx, (BATCH, DIM))
        y = x @ w_true + NOISE * jax.random.normal(ke, (BATCH,))
        grad = jax.grad(loss_fn)(w, x, y)
        clipped_grad, clip_state = clipper.update(grad, clip_state, w)
        updates, opt_state = optimizer.update(clipped_grad, opt_state, w)
        w = optax.apply_updates(w, updates)
        norm = jnp.linalg.norm(grad)
        metrics = quiet_metrics(clip_state)
        if row.static_max_norm is not None:
            threshold = jnp.asarray(row.static_max_norm, jnp.float32)
            clipped = norm > row.static_max_norm
        else:
            found = [v for k, v in metrics.items() if k.endswith("/threshold")]
            flags = [jnp.any(v > 0) for k, v in metrics.items() if k.endswith("/clipped")]
            threshold = found[0].astype(jnp.float32) if found else jnp.float32(jnp.nan)
            clipped = jnp.any(jnp.stack(flags)) if flags else jnp.zeros((), bool)
        loss = jnp.sum((w - w_true) ** 2) + NOISE**2
        return (w, clip_state, opt_state), jnp.stack(
            [loss, norm, threshold, clipped.astype(jnp.float32)]
        )

    w0 = jnp.zeros(DIM)
    carry = (w0, clipper.init(w0), optimizer.init(w0))
    _, record = jax.jit(lambda c: jax.lax.scan(step, c, jnp.arange(steps)))(carry)
    loss, norm, threshold, clipped = np.asarray(record).T
    return Trace(loss, norm, threshold, clipped > 0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Linear regression whose targets change for good, trained with SGD + "
        "momentum and with adam behind each clipper: final loss and share of steps clipped.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--change", type=int, default=CHANGE, help="step of the change")
    parser.add_argument("--late", type=int, default=LATE, help="share clipped from this step on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--optimizers", default=",".join(OPTIMIZERS), help="comma-separated, from these"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "docs" / "generated",
        help="folder of follow_run.md and .png",
    )
    args = parser.parse_args(argv)
    if not 0 < args.change < args.late < args.steps:
        parser.error("need 0 < --change < --late < --steps")
    args.optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if not args.optimizers or set(args.optimizers) - set(OPTIMIZERS):
        parser.error(f"--optimizers takes names from {', '.join(OPTIMIZERS)}")
    return args


def markdown(args: argparse.Namespace, argv: list[str], results: dict, missing: dict) -> str:
    header = ["setting", "loss before the change", "final loss", f"clipped from step {args.late}"]
    lines = [
        "# Following a run whose data changes for good",
        "",
        *page_header(argv, "follow_run.py"),
        f"Linear regression, {DIM} inputs x ~ N(0, I), batches of {BATCH}, targets x . w + "
        f"N(0, {NOISE:g}^2); seed {args.seed}. At step {args.change} the targets change for "
        f"good: a new w, {SHIFT:g}x the norm of the first. {args.steps} steps. Each setting is "
        "a clipper in front of the optimizer.",
        "",
        f"*loss*: the population loss |w - w_true|^2 + {NOISE:g}^2 (the floor is "
        f"{NOISE**2:g}); *loss before the change*: after step {args.change - 1}; *final loss*: "
        f"after the last step; *clipped from step {args.late}*: the share of steps "
        f"{args.late}..{args.steps - 1} on which the clipper scaled the gradient down "
        "(`clipped` of `clipjax.metrics`; for optax's static clip, the global norm above its "
        "max_norm). *n/a*: the installed clipjax does not accept these arguments.",
        "",
    ]
    for opt in args.optimizers:
        lines += [f"## {OPTIMIZERS[opt][1]}", "", "| " + " | ".join(header) + " |"]
        lines.append("|---|" + "---:|" * (len(header) - 1))
        for row in ROWS:
            trace = results.get((opt, row.name))
            if trace is None:
                cells = ["n/a"] * 3
            else:
                cells = [
                    f"{trace.loss[args.change - 1]:.3g}",
                    f"{trace.loss[-1]:.3g}",
                    f"{trace.clipped[args.late :].mean():.0%}",
                ]
            lines.append(f"| {row.name} | " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["## Settings", ""]
    for row in ROWS:
        note = f" (n/a: {missing[row.name]})" if row.name in missing else ""
        lines.append(f"- `{row.name}`: `{row.about}`{note}")
    lines += [
        "",
        "![population loss of every setting under each optimizer; gradient norm and "
        "threshold of three settings](follow_run.png)",
        "",
    ]
    return "\n".join(lines)


def plot(path: Path, args: argparse.Namespace, results: dict) -> None:
    """Top: the loss of every setting, one panel per optimizer, legend below.
    Bottom: gradient norm and threshold of THRESHOLD_ROWS under the first optimizer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = args.optimizers[0]
    shown = [name for name in THRESHOLD_ROWS if (first, name) in results]
    cols = max(len(shown), 2)
    fig = plt.figure(figsize=(11, 8.5), layout="constrained")
    grid = fig.add_gridspec(2, cols * 2, height_ratios=[1.3, 1])
    steps = np.arange(args.steps)
    colours = plt.get_cmap("tab10").colors
    for k, opt in enumerate(args.optimizers):
        about = OPTIMIZERS[opt][1]
        ax = fig.add_subplot(grid[0, k * cols : (k + 1) * cols])
        for i, row in enumerate(ROWS):
            trace = results.get((opt, row.name))
            if trace is not None:
                style = "-" if i < 10 else "--"
                ax.plot(steps, trace.loss, style, color=colours[i % 10], label=row.name, lw=1.3)
        ax.axvline(args.change, color="grey", lw=0.8, ls=":")
        ax.set(yscale="log", xlabel="step", ylabel="population loss", title=about)
        if k == 0:
            fig.legend(loc="outside upper center", ncol=4, fontsize="medium")
    for j, name in enumerate(shown):
        trace = results[(first, name)]
        ax = fig.add_subplot(grid[1, j * 2 * cols // len(shown) : (j + 1) * 2 * cols // len(shown)])
        ax.plot(steps, trace.grad_norm, color="C0", lw=0.8, label="grad norm")
        ax.plot(steps, trace.threshold, color="C3", lw=1.3, label="threshold")
        ax.axvline(args.change, color="grey", lw=0.8, ls=":")
        ax.set(yscale="log", xlabel="step", title=f"{name}, {first}")
        if j == 0:
            ax.set_ylabel("gradient norm")
            ax.legend(fontsize="small")
    fig.savefig(path, dpi=65)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    start = time.perf_counter()
    results: dict[tuple[str, str], Trace] = {}
    missing: dict[str, str] = {}
    for opt in args.optimizers:
        make_opt = OPTIMIZERS[opt][0]
        for row in ROWS:
            if row.name in missing:
                continue
            try:
                row.make()
            except (TypeError, ValueError) as error:  # an argument this clipjax lacks
                missing[row.name] = f"{type(error).__name__}: {error}"
                continue
            trace = run(row, make_opt(), args.steps, args.change, args.seed)
            results[(opt, row.name)] = trace
            print(
                f"{opt:5s} {row.name:22s} before {trace.loss[args.change - 1]:9.3g}  "
                f"final {trace.loss[-1]:9.3g}  clipped from {args.late}: "
                f"{trace.clipped[args.late :].mean():4.0%}",
                flush=True,
            )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "follow_run.md").write_text(markdown(args, argv, results, missing))
    plot(args.out / "follow_run.png", args, results)
    print(f"Wrote follow_run.md and .png under {args.out} ({time.perf_counter() - start:.0f} s).")
    return results


if __name__ == "__main__":
    main()
