"""Gradient spikes, and what each clipper does about them.

Trains a small flax.nnx MLP on a synthetic regression task, on the CPU, once per
setting: no clipping, optax's static ``clip_by_global_norm``, and the clipjax
clippers, each as ``clipjax.chain(clipper, clipjax.adam(1e-3))`` (optax's chain
and adam, which skip adam on the steps a clipper holds: the recommended
setting's warm-up; for every other clipper the same as optax's). Every setting
sees the same initial weights and the same batches, among which a few are
corrupted (inputs and targets multiplied by ``--spike-scale``): the gradient
spikes that would wreck an unprotected run.

Every step, the train step reads the clipper's metrics from the optimizer state
with ``clipjax.metrics(optimizer.opt_state)`` -- the gradient norm, the
threshold, the scale applied -- and returns them next to the losses. At the end
the demo prints a table and writes, under ``--out``, a figure (eval loss of
every setting, then each clipper's gradient norm against its threshold) and
one CSV of per-step metrics per setting.

Usage::

    python examples/demo.py                          # the default settings, ~2 minutes
    python examples/demo.py --clippers none,zclip --steps 200
    python examples/demo.py --clippers all --out /tmp/spikes
"""

from __future__ import annotations

import argparse
import csv
import math
import re
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from tqdm.auto import tqdm

import clipjax

IN_FEATURES = 16
HIDDEN = 64
BATCH_SIZE = 64
EVAL_SIZE = 1024
LEARNING_RATE = 1e-3
STATIC_MAX_NORM = 1.0  # a few times the typical gradient norm of this task (~0.2-0.5)
WARMUP = 25  # steps of history before the adaptive clippers act: short, for a short run


TABLE_NOTES = """
final loss: eval MSE on {eval_size} clean samples after the last step.
worst jump: the highest eval loss between a spike and the next, over the eval loss just before it.
spike norm passed: the gradient norm that reached adam at the worst spike, after clipping
(n/a: an optimizer that reports no gradient norm).
steps clipped: steps on which the clipper scaled any gradient down.
(No step time: on a model this small it measures call overhead, not the clipper;
benchmarks/RESULTS.md times every clipper's step.)

x spike-free: final loss over the final loss of adam alone on the same batches without spikes.

Rows without "+clipped" use each clipper's defaults, which reproduce its reference: autoclip and
zscore_clip observe a norm before they clip it (a spike raises its own threshold and passes at a
fraction of its size, as in smartclip); hist_clip judges first but learns from the raw spike
(drytorch); zclip's reference rule learns the value it clips to (feedback="clip_target").
"+clipped" is feedback="clipped": judge the step by the statistics from before it and let them
learn the norm capped at the spike boundary, min(g, B), so a spike cannot raise its own threshold
and a lasting rise of the norm is still learnt.
notebooks/spike_mitigation.ipynb discusses these results."""


class Setting(NamedTuple):
    """One training run of the comparison.

    Attributes:
      make: builds the gradient transformation chained in front of adam.
      about: one line for the legend.
      static_max_norm: for optax's clip_by_global_norm, which keeps no metrics:
        the demo computes the same fields itself so that every run plots alike.
      optimizer: a whole optimizer that replaces ``clipjax.chain(make(), adam)`` (the
        spike-aware optimizers SPAM, Stable-SPAM, StableAdamW).
    """

    make: Callable[[], optax.GradientTransformation]
    about: str
    static_max_norm: float | None = None
    optimizer: Callable[[], optax.GradientTransformation] | None = None


SETTINGS: dict[str, Setting] = {
    "none": Setting(optax.identity, "adam alone"),
    "optax": Setting(
        lambda: optax.clip_by_global_norm(STATIC_MAX_NORM),
        f"optax.clip_by_global_norm({STATIC_MAX_NORM:g}): a fixed threshold you must pick",
        static_max_norm=STATIC_MAX_NORM,
    ),
    # smartclip's AutoClip, auto mode: T = median + 3 std of all norms so far.
    # It observes the norm before computing its threshold, so a spike raises
    # its own threshold and still gets through at a fraction of its size.
    "autoclip": Setting(
        lambda: clipjax.autoclip(warmup_steps=WARMUP, min_history=WARMUP),
        "autoclip(): median + 3 std of the history, observe then clip",
    ),
    # The window percentile mode is observe-then-clip too, but one spike moves
    # the 95th percentile of the last 100 norms by at most one rank.
    "autoclip_p95": Setting(
        lambda: clipjax.autoclip(
            mode="percentile",
            percentile=95.0,
            window_size=100,
            warmup_steps=WARMUP,
            min_history=WARMUP,
        ),
        "autoclip(mode='percentile'): 95th percentile of the last 100 norms",
    ),
    # max_grad_norm=None: no static cap behind the z-score test, so what you
    # see is ZClip's adaptive threshold alone.
    "zclip": Setting(
        lambda: clipjax.zclip(max_grad_norm=None, warmup_steps=WARMUP),
        "zclip(max_grad_norm=None): EMA mean + z-score test, learns its clip target",
    ),
    # drytorch's defaults: z-statistic criterion, 20 warm-up steps under
    # clip_by_global_norm(1.0).
    "hist_clip": Setting(
        clipjax.hist_clip,
        "hist_clip(): EMA z-statistic criterion, clip then observe",
    ),
    # AGC bounds each layer's gradient norm to `clipping` times its weight
    # norm. The NFNet value, 0.01 unit-wise, was tuned for SGD at batch 4096:
    # here it would rescale every step (adam, being scale-invariant, mostly
    # undoes that). Per layer, with clipping=1.0, it sits above this model's
    # normal ratios (~0.02 for the hidden layers, ~0.4 for the output layer)
    # and acts on spikes only.
    "agc": Setting(
        lambda: clipjax.agc(clipping=1.0, scope="per_layer"),
        "agc(clipping=1.0, scope='per_layer'): relative to the weight norm",
    ),
    "zscore_clip": Setting(
        lambda: clipjax.zscore_clip(warmup_steps=WARMUP, min_history=WARMUP),
        "zscore_clip(): EMA mean + 3 std, observe then clip",
    ),
    # feedback="clipped": judged by the statistics from before the step, which
    # then learn the clipped norm, so a spike cannot raise its own threshold.
    "autoclip+clipped": Setting(
        lambda: clipjax.autoclip(warmup_steps=WARMUP, min_history=WARMUP, feedback="clipped"),
        "autoclip(feedback='clipped'): judge first, learn the clipped norm",
    ),
    "autoclip_p95+clipped": Setting(
        lambda: clipjax.autoclip(
            mode="percentile",
            percentile=95.0,
            window_size=100,
            warmup_steps=WARMUP,
            min_history=WARMUP,
            feedback="clipped",
        ),
        "autoclip(mode='percentile', feedback='clipped'): judge first",
    ),
    "zscore_clip+clipped": Setting(
        lambda: clipjax.zscore_clip(warmup_steps=WARMUP, min_history=WARMUP, feedback="clipped"),
        "zscore_clip(feedback='clipped'): judge first, learn the clipped norm",
    ),
    "zclip+clipped": Setting(
        lambda: clipjax.zclip(warmup_steps=WARMUP, feedback="clipped"),
        "zclip(feedback='clipped'): judge first, learn min(g, boundary)",
    ),
    "hist_clip+clipped": Setting(
        lambda: clipjax.hist_clip(feedback="clipped"),
        "hist_clip(feedback='clipped'): judge first, learn min(g, boundary)",
    ),
    # The field's other defences, with their own defaults (reported, not tuned).
    "adaclip": Setting(clipjax.adaclip, "adaclip(): Stable-SPAM's element-wise bound, then adam"),
    "ada_norm": Setting(clipjax.ada_norm, "ada_norm(): Stable-SPAM's norm EMA, then adam"),
    "spam": Setting(
        optax.identity,
        f"spam({LEARNING_RATE:g}): SPAM, element-wise clip against v and moment resets",
        optimizer=lambda: clipjax.spam(LEARNING_RATE),
    ),
    "stable_spam": Setting(
        optax.identity,
        f"stable_spam({LEARNING_RATE:g}): AdaClip, AdaGN, Adam with moment resets",
        optimizer=lambda: clipjax.stable_spam(LEARNING_RATE),
    ),
    "stable_adamw": Setting(
        optax.identity,
        f"adam({LEARNING_RATE:g}, update_clipping=True): StableAdamW's per-tensor step bound",
        optimizer=lambda: clipjax.adam(LEARNING_RATE, update_clipping=True),
    ),
    # AdaGC clips each tensor against an EMA of its own clipped norms.
    "adagc": Setting(
        lambda: clipjax.adagc(warmup_steps=WARMUP),
        "adagc(): per tensor, relative to an EMA of its clipped norms",
    ),
    # Not in the default comparison.
    "clip_by_global_norm": Setting(
        lambda: clipjax.clip_by_global_norm(STATIC_MAX_NORM),
        f"clipjax.clip_by_global_norm({STATIC_MAX_NORM:g}): optax's, with metrics",
    ),
}
DEFAULT_SETTINGS = (
    "none",
    "optax",
    "autoclip",
    "autoclip+clipped",
    "autoclip_p95",
    "autoclip_p95+clipped",
    "zscore_clip",
    "zscore_clip+clipped",
    "zclip",
    "zclip+clipped",
    "hist_clip",
    "hist_clip+clipped",
    "adagc",
    "agc",
    "adaclip",
    "ada_norm",
    "spam",
    "stable_spam",
    "stable_adamw",
)


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
) -> tuple[np.ndarray, ...]:
    """One training batch per step (the corrupted ones included) and a clean eval set.

    The target is a fixed random two-layer network of the inputs, plus noise.
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
) -> tuple[jax.Array, jax.Array, jax.Array, dict[str, jax.Array]]:
    """One update. Returns the batch loss, the eval loss after the update, the
    gradient's global norm and the clipper's metrics."""
    loss, grads = nnx.value_and_grad(mse)(model, x, y)
    optimizer.update(model, grads)
    # Read inside jit, the metrics come back to the host with the losses in one
    # transfer. Outside, clipjax.metrics(optimizer.opt_state) gives the same dict.
    with warnings.catch_warnings():
        # The baselines (no clipping, optax's clipper) hold no clipjax state: {}.
        warnings.simplefilter("ignore", UserWarning)
        metrics = clipjax.metrics(optimizer.opt_state)
    return loss, mse(model, x_eval, y_eval), optax.global_norm(grads), metrics


def static_metrics(grad_norm: float, max_norm: float | None) -> dict[str, float]:
    """The fields clipjax records, for settings that record none."""
    if max_norm is None:
        return {"grad_norm": grad_norm}
    scale = min(1.0, max_norm / grad_norm) if grad_norm > 0 else 1.0
    return {"grad_norm": grad_norm, "threshold": max_norm, "scale": scale, "clipped": scale < 1}


def train(
    name: str,
    setting: Setting,
    data: tuple[np.ndarray, ...],
    seed: int,
    width: int = 0,
    show_bars: bool = False,
) -> list[dict[str, float]]:
    """Trains one model; returns one row per step: losses, step time and metrics.

    Progress: a tqdm bar when ``show_bars``, else one line once the run ends;
    ``width`` pads the setting's name so that the lines align.
    """
    x_train, y_train, x_eval, y_eval = (jnp.asarray(a) for a in data)
    model = MLP(nnx.Rngs(seed))
    if setting.optimizer is not None:
        tx = setting.optimizer()
    else:
        tx = clipjax.chain(setting.make(), clipjax.adam(LEARNING_RATE))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # cached_partial skips re-walking the model graph on every call.
    step_fn = nnx.cached_partial(train_step, model, optimizer)

    rows = []
    # Bars on a terminal only: redirected to a file, each redraw would be a line.
    progress = tqdm(
        range(len(x_train)),
        desc=name.ljust(width),
        unit="step",
        leave=True,
        disable=not show_bars,
    )
    for step in progress:
        start = time.perf_counter()
        out = jax.device_get(step_fn(x_train[step], y_train[step], x_eval, y_eval))
        seconds = time.perf_counter() - start
        loss, eval_loss, grad_norm, metrics = out
        if not metrics:
            own = static_metrics(float(grad_norm), setting.static_max_norm)
            metrics = {f"{name}/global/{field}": value for field, value in own.items()}
        rows.append(
            {
                "step": step,
                "loss": float(loss),
                "eval_loss": float(eval_loss),
                "seconds": seconds,
                **{key: float(value) for key, value in metrics.items()},
            }
        )
        if step % 25 == 0:
            progress.set_postfix(eval_loss=f"{float(eval_loss):.3g}")
    if not show_bars:
        elapsed = sum(r["seconds"] for r in rows)
        print(
            f"  {name.ljust(width)}  {len(rows)} steps in {elapsed:.1f} s, "
            f"eval loss {rows[-1]['eval_loss']:.4f}",
            flush=True,
        )
    return rows


def series(row: dict[str, float], field: str) -> dict[str, float]:
    """``{"{algo}/{group}": value}`` of one metric field in a row."""
    suffix = "/" + field
    return {key[: -len(suffix)]: v for key, v in row.items() if key.endswith(suffix)}


def limit_field(row: dict[str, float]) -> str | None:
    """The field a clipper compares the norm with: ``threshold``, or AGC's ``target``.

    Only the clipper's own groups have it: not the warm-up clip that hist_clip
    nests under its name (``hist_clip/clip_by_global_norm/global/...``).
    """
    return next((f for f in ("target", "threshold") if series(row, f)), None)


def applied_norm(row: dict[str, float]) -> float:
    """The gradient norm that reached adam: root sum of squares of grad_norm x scale."""
    field = limit_field(row)
    norms = series(row, "grad_norm")
    groups = series(row, field) if field else norms
    if not groups:  # an optimizer that reports no gradient norm (spam, StableAdamW)
        return math.nan
    return math.sqrt(sum((norms[g] * row.get(f"{g}/scale", 1.0)) ** 2 for g in groups))


class Summary(NamedTuple):
    final_loss: float
    worst_jump: float  # highest eval loss after a spike over the eval loss before it
    passed: float  # largest gradient norm let through at a spike (after clipping)
    steps_clipped: int


def summarize(rows: list[dict[str, float]], spike_steps: list[int]) -> Summary:
    jumps, passed = [], []
    ends = [*spike_steps[1:], len(rows)]
    for spike, end in zip(spike_steps, ends):
        before = rows[spike - 1]["eval_loss"] if spike > 0 else rows[0]["eval_loss"]
        jumps.append(max(r["eval_loss"] for r in rows[spike:end]) / before)
        passed.append(applied_norm(rows[spike]))
    clipped = sum(any(v > 0 for v in series(r, "clipped").values()) for r in rows)
    return Summary(
        final_loss=rows[-1]["eval_loss"],
        worst_jump=max(jumps, default=math.nan),
        passed=max(passed, default=math.nan),
        steps_clipped=clipped,
    )


def table(
    runs: dict[str, list[dict[str, float]]], spike_steps: list[int], clean_loss: float
) -> list[list[str]]:
    """The comparison table, header first."""
    header = ["setting", "final loss", "x spike-free", "worst jump", "spike norm passed"]
    header += ["steps clipped"]
    lines = [header]
    for name, rows in runs.items():
        s = summarize(rows, spike_steps)
        lines.append(
            [
                name,
                f"{s.final_loss:.4f}",
                f"{s.final_loss / clean_loss:.2f}",
                f"x{s.worst_jump:.2f}" if spike_steps else "-",
                "-" if not spike_steps else "n/a" if math.isnan(s.passed) else f"{s.passed:.3g}",
                f"{s.steps_clipped} / {len(rows)}",
            ]
        )
    return lines


def print_table(lines: list[list[str]]) -> None:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    print()
    for line in [lines[0], ["-" * width for width in widths], *lines[1:]]:
        cells = [line[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(line[1:], widths[1:])]
        print("  ".join(cells))


def write_markdown(path: Path, lines: list[list[str]], command: str, note: str) -> None:
    rows = [lines[0], ["---"] * len(lines[0]), *lines[1:]]
    text = "\n".join("| " + " | ".join(row) + " |" for row in rows)
    path.write_text(f"Produced by `{command}`; {note}\n\n{text}\n")


# Below this fraction of the panel's smallest gradient norm a threshold is a
# placeholder (autoclip's 1e-8 before its first norm), not a limit: not drawn.
THRESHOLD_FLOOR = 1e-6
# Above this many groups a panel shows one global-equivalent line instead of
# one line per group (adagc: one group per tensor).
MAX_GROUP_LINES = 3


def setting_styles(names: list[str]) -> dict[str, dict[str, object]]:
    """A look per setting that no other setting shares: "none" black, the rest
    twenty distinct colours (tab20, dark shades first), "+clipped" dashed."""
    import matplotlib

    cmap = matplotlib.colormaps["tab20"]
    colours = [cmap(i) for i in [*range(0, 20, 2), *range(1, 20, 2)]]
    order = [n for n in SETTINGS if n != "none"]
    order += [n for n in names if n not in order and n != "none"]
    styles: dict[str, dict[str, object]] = {}
    for name in names:
        if name == "none":
            styles[name] = {"color": "black", "linewidth": 2, "linestyle": "-"}
            continue
        styles[name] = {
            "color": colours[order.index(name) % len(colours)],
            "linewidth": 1.3,
            "linestyle": "--" if name.endswith("+clipped") else "-",
        }
    return styles


def limit_line(rows: list[dict[str, float]], group: str, field: str) -> np.ndarray:
    """A group's threshold per step, NaN where it is not a limit to draw.

    Every adaptive clipper's ``threshold`` is the norm above which the step is
    clipped, on every step; thresholds at or below ``THRESHOLD_FLOOR`` and
    non-finite ones (warm-up) are masked.
    """
    limit = np.array([r[f"{group}/{field}"] for r in rows], dtype=float)
    return np.where(np.isfinite(limit) & (limit > THRESHOLD_FLOOR), limit, np.nan)


def global_equivalent(
    rows: list[dict[str, float]], groups: list[str], field: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray, list[int]]:
    """Root sum of squares over groups of the norm, of the norm x scale and of
    the thresholds (the global norm at which every group sits at its own
    threshold), and the steps on which any group was clipped."""
    norm = np.sqrt(sum(np.array([r[f"{g}/grad_norm"] for r in rows]) ** 2 for g in groups))
    passed = np.sqrt(
        sum(
            (np.array([r[f"{g}/grad_norm"] * r.get(f"{g}/scale", 1.0) for r in rows])) ** 2
            for g in groups
        )
    )
    limit = np.sqrt(sum(limit_line(rows, g, field) ** 2 for g in groups))
    clipped = [j for j, r in enumerate(rows) if any(r.get(f"{g}/clipped", 0) > 0 for g in groups)]
    return norm, passed, limit, clipped


def y_range(curves: list[np.ndarray]) -> tuple[float, float]:
    """Log-axis limits around the finite positive values of the curves."""
    values = np.concatenate([c[np.isfinite(c) & (c > 0)] for c in curves])
    if values.size == 0:
        return 1e-3, 1.0
    return float(values.min()) / 2, float(values.max()) * 2


def plot(path: Path, runs: dict[str, list[dict[str, float]]], spike_steps: list[int]) -> None:
    """Eval loss of every run on top; below, one panel per clipper from its metrics."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    clippers = [name for name in runs if limit_field(runs[name][0])]
    cols = min(3, max(1, len(clippers)))
    grid_rows = math.ceil(len(clippers) / cols)
    fig = plt.figure(figsize=(5 * cols, 4.5 + 3 * grid_rows), layout="constrained")
    grid = fig.add_gridspec(1 + grid_rows, cols, height_ratios=[1.6] + [1] * grid_rows)

    ax = fig.add_subplot(grid[0, :])
    styles = setting_styles(list(runs))
    for name, rows in runs.items():
        ax.plot([r["eval_loss"] for r in rows], label=name, **styles[name])
    for spike in spike_steps:
        ax.axvline(spike, color="red", linestyle=":", linewidth=1)
    ax.set(yscale="log", xlabel="step", ylabel="eval loss (MSE)")
    ax.set_title("Eval loss; dotted red lines: corrupted batches (gradient spikes)")
    ax.legend(ncol=5, fontsize="small")

    for i, name in enumerate(clippers):
        ax = fig.add_subplot(grid[1 + i // cols, i % cols])
        rows = runs[name]
        field = limit_field(rows[0])
        groups = list(series(rows[0], field))
        title = f"{name}: red x = clipped"
        curves = []
        if len(groups) == 1 or len(groups) > MAX_GROUP_LINES:
            if len(groups) == 1:
                group = groups[0]
                norm = np.array([r[f"{group}/grad_norm"] for r in rows])
                passed = norm * np.array([r[f"{group}/scale"] for r in rows])
                limit = limit_line(rows, group, field)
                clipped = [j for j, r in enumerate(rows) if r.get(f"{group}/clipped", 0) > 0]
                label = field
            else:
                norm, passed, limit, clipped = global_equivalent(rows, groups, field)
                label = f"{field}, root sum of squares"
                title = f"{name}: {len(groups)} groups as one; red x = any clipped"
            ax.plot(norm, color="0.6", linewidth=0.8, label="grad_norm")
            ax.plot(passed, color="C0", linewidth=1, label="grad_norm x scale")
            ax.plot(limit, "--", color="C1", linewidth=1.2, label=label)
            if len(groups) == 1 and f"{groups[0]}/clip_to" in rows[0]:
                # zclip and hist_clip clip below their boundary: the norm a clipped step left with.
                clip_to = np.array([r[f"{groups[0]}/clip_to"] for r in rows])
                ax.plot(clipped, clip_to[clipped], "o", color="C1", markersize=3, label="clip_to")
            ax.plot(clipped, norm[clipped], "x", color="red", markersize=5)
            curves += [norm, passed, limit]
        else:
            for k, group in enumerate(groups):
                label = group.split("/", 1)[-1]
                norm = np.array([r[f"{group}/grad_norm"] for r in rows])
                limit = limit_line(rows, group, field)
                ax.plot(norm, color=f"C{k}", linewidth=0.8, label=f"{label} grad_norm")
                ax.plot(limit, "--", color=f"C{k}", linewidth=1.2, label=f"{label} {field}")
                clipped = [j for j, r in enumerate(rows) if r.get(f"{group}/clipped", 0) > 0]
                ax.plot(clipped, norm[clipped], "x", color="red", markersize=5)
                curves += [norm, limit]
        ax.set(yscale="log", xlabel="step", ylim=y_range(curves))
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="x-small", loc="upper left")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(path: Path, rows: list[dict[str, float]]) -> None:
    fields = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


def update_docs(table: Path) -> None:
    """Copies the measured table to docs/generated/demo_table.md (which "Choosing a
    clipper" includes) and rewrites the figures that README.md and docs/*.md quote
    from it: no figure is typed by hand."""
    root = Path(__file__).resolve().parents[1]
    generated = root / "docs" / "generated"
    generated.mkdir(parents=True, exist_ok=True)
    text = table.read_text()
    (generated / "demo_table.md").write_text(text)
    for page in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        quoted = quote_table(page.read_text(), text)
        if quoted != page.read_text():
            page.write_text(quoted)


QUOTE = re.compile(
    r"(<!-- from: docs/generated/demo_table\.md; (.+?); (.+?) -->)(.*?)(<!-- end -->)"
)


def quote_table(prose: str, table: str) -> str:
    """Rewrites the figures that prose quotes from the demo table (marked spans
    ``<!-- from: docs/generated/demo_table.md; ROW; COLUMN -->1.02x<!-- end -->``)
    with the table's current value, keeping a trailing ``x``."""
    lines = [line for line in table.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    cells = {}
    for line in lines[2:]:
        row = [c.strip() for c in line.strip("|").split("|")]
        cells.update({(row[0], h): v for h, v in zip(header, row)})

    def fill(m: re.Match) -> str:
        value = cells.get((m.group(2), m.group(3)))
        if value is None:
            return m.group(0)
        suffix = "x" if m.group(4).endswith(("x", "×")) else ""
        return f"{m.group(1)}{value}{suffix}{m.group(5)}"

    return QUOTE.sub(fill, prose)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a small MLP through injected gradient spikes, once per clipper, "
        "and compare. Settings: " + "; ".join(f"{name}: {s.about}" for name, s in SETTINGS.items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--clippers",
        "--clipper",
        default=",".join(DEFAULT_SETTINGS),
        help=f"comma-separated settings, or 'all'; from {', '.join(SETTINGS)}",
    )
    parser.add_argument("--steps", type=int, default=400, help="training steps per setting")
    parser.add_argument(
        "--spike-steps",
        default=None,
        help="comma-separated steps whose batch is corrupted (default: five, from 1/4 to 7/8 of "
        "the run)",
    )
    parser.add_argument(
        "--spike-scale", type=float, default=100.0, help="factor on a corrupted batch's data"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the data and the model")
    parser.add_argument("--out", type=Path, default=Path("demo_out"), help="output folder")
    parser.add_argument(
        "--update-docs",
        action="store_true",
        help="also write the table to docs/generated/demo_table.md and update the figures "
        "README.md and docs/*.md quote from it",
    )
    args = parser.parse_args()

    if args.steps < 2:
        parser.error("--steps must be at least 2")
    if args.spike_steps is None:
        spikes = {(2 + k) * args.steps // 8 for k in range(5)}
    else:
        try:
            spikes = {int(s) for s in args.spike_steps.split(",") if s.strip()}
        except ValueError:
            parser.error(f"--spike-steps takes comma-separated integers, not {args.spike_steps!r}")
    args.spike_steps = sorted(s for s in spikes if 0 <= s < args.steps)
    names = list(SETTINGS) if args.clippers == "all" else args.clippers.split(",")
    names = [n.strip() for n in names if n.strip()]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        parser.error(f"unknown setting {', '.join(unknown)!r}; choose from {', '.join(SETTINGS)}")
    args.clippers = list(dict.fromkeys(names))
    return args


def main() -> None:
    args = parse_args()
    data = make_data(args.steps, args.seed, args.spike_steps, args.spike_scale)
    print(
        f"{args.steps} steps of adam({LEARNING_RATE:g}) on a {IN_FEATURES}-{HIDDEN}-{HIDDEN}-1 "
        f"MLP, batch {BATCH_SIZE}; the batches at steps {args.spike_steps} are scaled by "
        f"{args.spike_scale:g}."
    )
    width = max(len(name) for name in [*args.clippers, "spike-free"])
    for name in args.clippers:
        print(f"  {name.ljust(width)}  {SETTINGS[name].about}")
    print(flush=True)

    # tqdm draws on stderr: bars when both streams are a terminal, plain lines otherwise.
    bars = sys.stdout.isatty() and sys.stderr.isatty()
    start = time.perf_counter()
    clean = make_data(args.steps, args.seed, [], args.spike_scale)
    clean_rows = train("spike-free", SETTINGS["none"], clean, args.seed, width, bars)
    clean_loss = clean_rows[-1]["eval_loss"]
    runs = {
        name: train(name, SETTINGS[name], data, args.seed, width, bars) for name in args.clippers
    }
    elapsed = time.perf_counter() - start

    lines = table(runs, args.spike_steps, clean_loss)
    print_table(lines)
    print(f"\nspike-free final loss (adam alone, no corrupted batch): {clean_loss:.4f}")
    print(TABLE_NOTES.format(eval_size=EVAL_SIZE))

    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in runs.items():
        write_csv(args.out / f"{name}.csv", rows)
    plot(args.out / "spikes.png", runs, args.spike_steps)
    command = "python examples/demo.py " + " ".join(sys.argv[1:])
    note = (
        f"{args.steps} steps of adam({LEARNING_RATE:g}), corrupted batches at steps "
        f"{args.spike_steps} (x{args.spike_scale:g}); spike-free final loss {clean_loss:.4f}."
    )
    write_markdown(args.out / "table.md", lines, command.strip(), note)
    if args.update_docs:
        update_docs(args.out / "table.md")
    print(
        f"\nWrote {args.out / 'spikes.png'}, {args.out / 'table.md'} and one CSV of per-step "
        f"metrics per setting ({elapsed:.0f} s of training, compilation included)."
    )


if __name__ == "__main__":
    main()
