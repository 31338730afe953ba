"""Natural loss spikes in a small language model, and what each clipper does about them.

A byte-level transformer (plain JAX: pre-LayerNorm blocks, learned positions,
no QK norm) learns to predict the Python standard library's
own sources -- the ``*.py`` files directly under
``sysconfig.get_paths()["stdlib"]``, sorted by name; every tenth file is held
out -- with ``optax.adamw`` (b2 = 0.999) at a learning rate high enough that,
unclipped, the gradient norm spikes by itself (nothing is injected) and adam
turns some spikes into set-backs that cost a run most of its progress (the
comment above ``Config`` in ``examples/lm_model.py`` gives the evidence).
Each setting is one optax transform; every setting trains the same seeds (a
seed sets the initial weights and the batches), all seeds at once under
``jax.vmap``.

Four configurations (``CONFIGS``): ``--config gpu`` (the default; the
configuration the comment above ``Config`` describes: unclipped, or with a warm-up that lets its
first steps through, 2 of 3 runs stall on a plateau; about six minutes for
the table on one H200), ``--config cpu`` (2 layers, d_model 64, 300 steps,
adamw b2 0.9999 warmed up over 50 steps to lr 0.3, for two CPU cores:
unclipped, it blows up by itself some 100 steps later; at half the learning
rate it trains) and ``--config cpu_long`` (the GPU configuration's optimizer
on the 2-layer model, 1000 steps: unclipped it loses a few percent on most
seeds; the comment above ``CONFIGS`` says why it does not stall) and
``--config cpu_cosine`` (the 2-layer model, adamw with a 30-step warm-up and a
cosine decay over 300 steps, the schedule most recipes use).

The model, its data, its configurations (``Config``, ``CONFIGS``) and its
training loop are in ``examples/lm_model.py``: the model's loss and gradient
are one jitted function compiled once for all settings; each setting adds one
small jitted update that also reads, from ``clipjax.metrics(opt_state)``,
whether the clipper clipped this step. This script holds the table: the
settings (``ROWS``, one optax transform each), the measures of a run, the
paired comparison with the best static clip, the page and the figure. The
tables give, per seed, the final held-out loss and its ratio to the best
static clip of the sweep, loss set-backs, the largest loss jump, gradient
spikes, the share of steps clipped, steps skipped (skip_on_spike's
``skipped_count``), and diverged runs (one definition: ``DIVERGED_LOSS``).
The script writes ``lm_spikes_<config>.md`` (the tables, headed by the
command, machine, versions and date; rewritten after each setting) and
``lm_spikes_<config>.png`` (batch loss curves, one panel per group of
settings) under ``--out`` (default ``docs/generated``); ``--npz`` adds the
per-step loss, gradient norm and clip flags of every run. Settings the
installed clipjax does not offer are listed as unavailable.

Usage::

    python examples/lm_spikes.py --config gpu         # every setting, 6 seeds, one GPU
    python examples/lm_spikes.py --config cpu         # the smaller model, two CPU cores
    python examples/lm_spikes.py --config cpu_long --only none,recommended,zclip
    python examples/lm_spikes.py --config cpu --quick # 40 steps: a smoke test
    python examples/lm_spikes.py --only none,zclip,adagc --seeds 2 --out /tmp/lm
    python examples/lm_spikes.py --config cpu --only none --static-sweep 0.1,0.3,1
"""

from __future__ import annotations

import argparse
import importlib.metadata
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

import clipjax

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lm_model import (  # the model, its data and its training loop
    CONFIGS,
    Config,
    Run,
    build_model,
    held_out_windows,
    load_text,
    train,
)

# --quick: the same model as --config cpu, 40 steps: a smoke test, numbers mean nothing.
QUICK_STEPS = 40
DEFAULT_SEEDS = 6  # a page of another count is named lm_spikes_<config>..._seeds<n>

# A gradient spike: a step whose global gradient norm exceeds GRAD_SPIKE times
# the median of the SPIKE_WINDOW norms before it.
SPIKE_WINDOW = 50
GRAD_SPIKE = 10.0
# A loss spike (set-back): the batch loss averaged over SMOOTH steps rises more
# than LOSS_SPIKE nats above the lowest such average so far; it ends when it is
# back within LOSS_SPIKE / 3. Healthy runs of the default configuration stay
# within 0.1 nats; the unclipped runs that spike go 0.27-0.32 nats back.
SMOOTH = 20
LOSS_SPIKE = 0.15
# A diverged run: some batch loss is not finite, or the final held-out loss is
# above DIVERGED_LOSS = ln 256 nats per byte, worse than a uniform guess over
# the 256 bytes (the loss of the model at initialisation).
DIVERGED_LOSS = math.log(256)
# A loss jump: a batch loss divided by the median of the JUMP_WINDOW batch
# losses before it; the table gives the largest over a setting's runs.
JUMP_WINDOW = 50
# The figure averages the batch loss over this many steps.
PLOT_SMOOTH = 10


class Setting(NamedTuple):
    """One row of the table.

    Attributes:
      make: builds the whole optimizer from the run's Config.
      about: one line for --help and the markdown.
      needs_value: update() takes the batch loss as ``value=`` (skip_on_spike).
      static_max_norm: for optax's clip_by_global_norm, which keeps no metrics:
        a step counts as clipped when the global norm exceeds it (its value at
        loss x 1: the sweep scales it with ``--loss-scale``).
      panel: the figure's panel that draws it (a key of PANELS).
      scaled: the static clip's max_norm is multiplied by the loss scale (the
        sweep); False for an absolute one (``clip_1``).
    """

    make: Callable[[Config], optax.GradientTransformation]
    about: str
    needs_value: bool = False
    static_max_norm: float | None = None
    panel: str = "clipped"
    scaled: bool = True

    def max_norm(self, cfg: Config) -> float | None:
        """The static clip's max_norm in this run (None: not a static clip)."""
        if self.static_max_norm is None:
            return None
        return self.static_max_norm * (cfg.loss_scale if self.scaled else 1.0)


def schedule(cfg: Config, lr: float | None = None) -> optax.Schedule:
    """Linear warm-up to the peak learning rate, then constant, or (``decay="cosine"``)
    a cosine decay to 0 at the last step."""
    peak = cfg.lr if lr is None else lr
    if cfg.decay == "cosine":
        return optax.warmup_cosine_decay_schedule(0.0, peak, max(cfg.warmup, 1), cfg.steps)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, peak, max(cfg.warmup, 1)), optax.constant_schedule(peak)],
        [max(cfg.warmup, 1)],
    )


def adam_kwargs(cfg: Config) -> dict[str, Any]:
    """The run's adamw hyperparameters, for the optimizers of the same family."""
    return dict(b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay)


def adamw(cfg: Config, lr: float | None = None) -> optax.GradientTransformation:
    return optax.adamw(schedule(cfg, lr), **adam_kwargs(cfg))


def skippable_adamw(cfg: Config) -> optax.GradientTransformation:
    """``clipjax.adamw``: optax's adamw (same arithmetic and state) into which
    ``skip_on_spike`` folds its skip, with no conditional and no copy."""
    return clipjax.adamw(schedule(cfg), **adam_kwargs(cfg))


def clipped_adamw(clipper: Callable[[], optax.GradientTransformation]) -> Callable:
    return lambda cfg: optax.chain(clipper(), adamw(cfg))


# The figure draws the settings in these panels (Setting.panel).
PANELS = {
    "baselines": "adamw alone, half its learning rate, static clips",
    "reference": "adaptive clippers, reference defaults",
    "clipped": 'adaptive clippers, feedback="clipped"; adagc; recommended',
    "skip": "skip_on_spike",
    "other": "SPAM, Stable-SPAM, StableAdamW",
}


def static(max_norm: float, scaled: bool = True) -> Setting:
    """optax's clip at ``max_norm`` (times the loss scale when ``scaled``)."""
    setting = Setting(
        lambda cfg: optax.chain(optax.clip_by_global_norm(setting.max_norm(cfg)), adamw(cfg)),
        f"optax.clip_by_global_norm({max_norm:g}"
        + (" x the loss scale" if scaled else ", whatever the loss scale")
        + "), then adamw",
        static_max_norm=max_norm,
        panel="baselines",
        scaled=scaled,
    )
    return setting


# The setting the documentation recommends: the "recommended" and
# "skip_recommended" rows. Change it here, in one place.
RECOMMENDED = 'zclip(feedback="clipped")'


def recommended() -> optax.GradientTransformation:
    return clipjax.zclip(feedback="clipped")


def clipper(code: str, make: Callable[[], optax.GradientTransformation], panel: str) -> Setting:
    """A clipjax clipper in front of adamw; `code` is how the page shows it."""
    return Setting(clipped_adamw(make), f"{code}, then adamw", panel=panel)


def skipping(about: str, inner: Callable[[Config], Any], **kwargs: Any) -> Setting:
    return Setting(
        lambda cfg: clipjax.skip_on_spike(inner(cfg), **kwargs),
        about,
        needs_value=True,
        panel="skip",
    )


def SPECTRAL(name: str, shape: tuple[int, ...]) -> Any:
    """spectral_clip's matrices: each layer's slice of the stacked leaves (a matrix, or
    a vector for the layer norms and biases); the embeddings and the head are left,
    as the reference leaves them by name."""
    if not name.startswith("layers/"):
        return None
    return ((-2,), (-1,)) if len(shape) == 3 else ((-1,), ())


# Every row of the table but the static sweep, in the order they run (the sweep
# goes after "none"): one (name, Setting) entry per row; add a row here.
ROWS: list[tuple[str, Setting]] = [
    ("none", Setting(adamw, "adamw alone", panel="baselines")),
    (
        "low_lr",
        Setting(
            lambda cfg: adamw(cfg, cfg.lr * cfg.low_lr_factor),
            "adamw alone at lr x low_lr_factor (CPU configuration: half the learning rate)",
            panel="baselines",
        ),
    ),
    # The field's untuned default, at 1.0 whatever the loss scale (the sweep's
    # static_1 is 1.0 x the loss scale).
    ("clip_1", static(1.0, scaled=False)),
    (
        "recommended",
        Setting(
            lambda cfg: clipjax.chain(recommended(), skippable_adamw(cfg)),
            f"clipjax.chain({RECOMMENDED}, clipjax.adamw) (the recommended setting: "
            "adamw skips the steps the clipper holds)",
            panel="clipped",
        ),
    ),
    (
        "recommended_optax_chain",
        clipper(
            f"{RECOMMENDED} in optax.chain (the held steps reach adamw: the first zeroed)",
            recommended,
            "clipped",
        ),
    ),
    (
        "zclip_fb_weight",
        clipper(
            'zclip(feedback="clipped", start="weight") (0.4\'s recommended setting: a time weight)',
            lambda: clipjax.zclip(feedback="clipped", start="weight"),
            "clipped",
        ),
    ),
    (
        "skip_recommended",
        skipping(
            f"skip_on_spike(clipjax.chain({RECOMMENDED}, clipjax.adamw)) (defaults)",
            lambda cfg: clipjax.chain(recommended(), skippable_adamw(cfg)),
        ),
    ),
    ("skip", skipping("skip_on_spike(clipjax.adamw) (defaults)", skippable_adamw)),
    (
        "skip_fb_skip",
        skipping(
            'skip_on_spike(clipjax.adamw, feedback="skip") (0.2\'s behaviour)',
            skippable_adamw,
            feedback="skip",
        ),
    ),
    ("autoclip", clipper("autoclip() (defaults)", clipjax.autoclip, "reference")),
    (
        "autoclip_fb",
        clipper(
            'autoclip(feedback="clipped")',
            lambda: clipjax.autoclip(feedback="clipped"),
            "clipped",
        ),
    ),
    (
        "autoclip_fb_window",
        clipper(
            'autoclip(feedback="clipped", history="window")',
            lambda: clipjax.autoclip(feedback="clipped", history="window"),
            "clipped",
        ),
    ),
    (
        "spectral_ema",
        clipper(
            'spectral_clip(rule="ema", matrices=SPECTRAL) (the reference\'s defaults)',
            lambda: clipjax.spectral_clip(rule="ema", matrices=SPECTRAL),
            "reference",
        ),
    ),
    (
        "spectral_quantile",
        clipper(
            'spectral_clip(rule="quantile", matrices=SPECTRAL) (the reference\'s defaults)',
            lambda: clipjax.spectral_clip(rule="quantile", matrices=SPECTRAL),
            "reference",
        ),
    ),
    (
        "spectral_ema_fb",
        clipper(
            'spectral_clip(rule="ema", feedback="clipped", matrices=SPECTRAL)',
            lambda: clipjax.spectral_clip(rule="ema", feedback="clipped", matrices=SPECTRAL),
            "clipped",
        ),
    ),
    ("zscore_clip", clipper("zscore_clip() (defaults)", clipjax.zscore_clip, "reference")),
    (
        "zscore_clip_fb",
        clipper(
            'zscore_clip(feedback="clipped")',
            lambda: clipjax.zscore_clip(feedback="clipped"),
            "clipped",
        ),
    ),
    ("zclip", clipper("zclip() (defaults)", clipjax.zclip, "reference")),
    (
        "zclip_nocap_w10",
        clipper(
            "zclip(max_grad_norm=None, warmup_steps=10) (the former recommended setting)",
            lambda: clipjax.zclip(max_grad_norm=None, warmup_steps=10),
            "reference",
        ),
    ),
    (
        "zclip_fb_cap1",
        clipper(
            'zclip(feedback="clipped", max_grad_norm=1.0) (an absolute ceiling: recommended '
            "in 0.3)",
            lambda: clipjax.zclip(feedback="clipped", max_grad_norm=1.0),
            "clipped",
        ),
    ),
    (
        "zclip_fb_nocap",
        clipper(
            'zclip(feedback="clipped", max_grad_norm=None, relative_ceiling=None) (no ceiling, '
            "no time weight: recommended at 0b10f73)",
            lambda: clipjax.zclip(feedback="clipped", max_grad_norm=None, relative_ceiling=None),
            "clipped",
        ),
    ),
    (
        "autoclip_p50",
        clipper(
            'autoclip(mode="percentile", percentile=50, window_size=100, feedback="clipped") '
            "(clips about half the steps by design, 1.0 ceiling)",
            lambda: clipjax.autoclip(
                mode="percentile", percentile=50, window_size=100, feedback="clipped"
            ),
            "clipped",
        ),
    ),
    ("agc", clipper("agc() (defaults: unitwise, clipping 0.01)", clipjax.agc, "other")),
    ("hist_clip", clipper("hist_clip() (defaults)", clipjax.hist_clip, "reference")),
    (
        "hist_clip_fb",
        clipper(
            'hist_clip(feedback="clipped")',
            lambda: clipjax.hist_clip(feedback="clipped"),
            "clipped",
        ),
    ),
    ("adagc", clipper("adagc() (defaults)", clipjax.adagc, "clipped")),
    # The field's other defences, with their own defaults and the run's adam
    # hyperparameters (reported, not tuned).
    (
        "spam",
        Setting(
            lambda cfg: clipjax.spam(schedule(cfg), **adam_kwargs(cfg)),
            "spam(run's lr schedule, b1, b2, eps, weight decay; SPAM's defaults otherwise)",
            panel="other",
        ),
    ),
    (
        "stable_spam",
        Setting(
            lambda cfg: clipjax.stable_spam(schedule(cfg), **adam_kwargs(cfg)),
            "stable_spam(run's lr schedule, b1, b2, eps, weight decay; Stable-SPAM's defaults)",
            panel="other",
        ),
    ),
    ("adaclip", clipper("adaclip() (defaults)", clipjax.adaclip, "other")),
    ("ada_norm", clipper("ada_norm() (defaults)", clipjax.ada_norm, "other")),
    (
        "stable_adamw",
        Setting(
            lambda cfg: clipjax.adamw(schedule(cfg), **adam_kwargs(cfg), update_clipping=True),
            "clipjax.adamw(..., update_clipping=True) (StableAdamW)",
            panel="other",
        ),
    ),
]
SETTINGS: dict[str, Setting] = dict(ROWS)


def static_name(max_norm: float) -> str:
    return f"static_{max_norm:g}"


def settings_for(cfg: Config) -> dict[str, Setting]:
    """Every setting of the table, in the order they run: adamw alone, the static
    clip sweep (the reference of the "x best static" column), then the rest."""
    out = dict(ROWS[:1])
    out.update({static_name(v): static(v) for v in cfg.static_sweep})
    out.update(ROWS[1:])
    return out


# ----------------------------------------------------------------------------- summary


def spike_events(loss: np.ndarray, grad_norm: np.ndarray) -> tuple[int, float, int]:
    """(loss spikes, largest set-back in nats, gradient spikes) of one run."""
    finite = np.isfinite(loss)
    if not finite.all():
        loss = loss[: np.argmin(finite)]  # up to the first NaN: the run diverged
    events, largest, inside = 0, 0.0, False
    if len(loss) >= SMOOTH:
        smooth = np.convolve(loss, np.ones(SMOOTH) / SMOOTH, mode="valid")
        setback = smooth - np.minimum.accumulate(smooth)
        largest = float(setback.max())
        for value in setback:
            if not inside and value > LOSS_SPIKE:
                events, inside = events + 1, True
            elif inside and value < LOSS_SPIKE / 3:
                inside = False
    grad_spikes = 0
    for t in range(SPIKE_WINDOW, len(grad_norm)):
        level = np.median(grad_norm[t - SPIKE_WINDOW : t])
        grad_spikes += bool(grad_norm[t] > GRAD_SPIKE * level)
    return events, largest, grad_spikes


def largest_jump(loss: np.ndarray) -> float:
    """The largest batch loss over the median of the JUMP_WINDOW batch losses before it
    (inf once the loss is not finite)."""
    if not np.isfinite(loss).all():
        return math.inf
    ratios = [loss[t] / np.median(loss[t - JUMP_WINDOW : t]) for t in range(JUMP_WINDOW, len(loss))]
    return float(max(ratios, default=1.0))


class Summary(NamedTuple):
    final: np.ndarray  # [seeds] final held-out loss
    events: np.ndarray  # [seeds] loss spikes
    largest: np.ndarray  # [seeds] largest set-back (nats)
    jump: np.ndarray  # [seeds] largest loss jump (ratio)
    grad_spikes: np.ndarray  # [seeds]
    clipped: np.ndarray  # [seeds] share of the steps on which the clipper clipped
    capped: np.ndarray | None  # [seeds] share of the steps a ceiling bounded
    skipped: np.ndarray | None  # [seeds] skip_on_spike's skipped_count
    diverged: np.ndarray  # [seeds] bool: see DIVERGED_LOSS
    seconds: float


def diverged(loss: np.ndarray, final: np.ndarray) -> np.ndarray:
    """[seeds] bool: a batch loss not finite, or the final held-out loss above DIVERGED_LOSS."""
    return ~np.isfinite(loss).all(axis=1) | ~(final <= DIVERGED_LOSS)


def summarize(run: Run, cfg: Config) -> Summary:
    final = run.eval_loss[:, -1]
    spikes = [spike_events(loss, norm) for loss, norm in zip(run.loss, run.grad_norm)]
    skipped = run.metrics.get("skip_on_spike/global/skipped_count")
    return Summary(
        final=final,
        events=np.array([e for e, _, _ in spikes]),
        largest=np.array([j for _, j, _ in spikes]),
        jump=np.array([largest_jump(loss) for loss in run.loss]),
        grad_spikes=np.array([g for _, _, g in spikes]),
        clipped=run.clipped.mean(axis=1),
        capped=None if run.capped is None else run.capped.mean(axis=1),
        skipped=None if skipped is None else skipped.reshape(len(final), -1)[:, 0],
        diverged=diverged(run.loss, final),
        seconds=run.seconds,
    )


def mean_spread(x: np.ndarray, fmt: str = ".3f") -> str:
    if not np.all(np.isfinite(x)):
        finite = x[np.isfinite(x)]
        nans = f"{len(x) - len(finite)} NaN"
        return nans if not len(finite) else f"{np.mean(finite):{fmt}} ({nans})"
    if len(x) == 1:
        return f"{x[0]:{fmt}}"
    return f"{np.mean(x):{fmt}} ± {np.std(x):{fmt}}"


def per_seed(x: np.ndarray, fmt: str) -> str:
    return " / ".join(f"{v:{fmt}}" for v in x)


# A setting is called better or worse than the best static clip only where the
# per-seed difference is consistent: the mean over seeds of the paired log ratio
# of final held-out losses (same seed, same batches; a diverged run counts as
# DIVERGED_LOSS), with a 95% bootstrap interval over seeds (BOOTSTRAP resamples,
# a fixed generator); "worse" / "better" when the interval excludes 0, "tie"
# otherwise. The count of seeds on which the setting is worse is shown beside it.
BOOTSTRAP = 10_000

# Two tables, so that each fits a documentation column.
LOSS_HEADER = [
    "setting",
    "final held-out loss",
    "x best static",
    "per seed",
    "vs best static, paired",
    "diverged",
]
SPIKE_HEADER = [
    "setting",
    "loss spikes",
    "largest set-back",
    "largest jump",
    "grad spikes",
    "share clipped",
    "share capped",
    "steps skipped",
    "wall s",
]


def best_static(summaries: dict[str, Summary]) -> tuple[str, float] | None:
    """The static_<max_norm> row with the lowest mean final held-out loss (finite)."""
    means = {
        name: float(np.mean(s.final))
        for name, s in summaries.items()
        if name.startswith("static_") and np.all(np.isfinite(s.final))
    }
    if not means:
        return None
    name = min(means, key=means.get)
    return name, means[name]


def paired(final: np.ndarray, reference: np.ndarray) -> tuple[str, float, float, float, int]:
    """``(verdict, mean, low, high, worse)``: the paired log ratio of final losses (its
    mean and 95% bootstrap interval over seeds) and the number of seeds on which
    ``final`` is worse; see :data:`BOOTSTRAP`."""
    capped = lambda x: np.where(np.isfinite(x), np.minimum(x, DIVERGED_LOSS), DIVERGED_LOSS)
    d = np.log(capped(final) / capped(reference))
    rng = np.random.default_rng(0)
    means = d[rng.integers(0, len(d), (BOOTSTRAP, len(d)))].mean(axis=1)
    low, high = np.percentile(means, [2.5, 97.5])
    verdict = "worse" if low > 0 else "better" if high < 0 else "tie"
    return verdict, float(d.mean()), float(low), float(high), int(np.sum(d > 0))


def paired_cell(final: np.ndarray, reference: np.ndarray) -> str:
    verdict, mean, low, high, worse = paired(final, reference)
    pct = lambda x: f"{np.expm1(x):+.1%}"
    return f"{verdict}: {pct(mean)} [{pct(low)}, {pct(high)}], {worse}/{len(final)} worse"


def table_rows(
    summaries: dict[str, Summary], missing: list[str], seeds: int
) -> tuple[list[list[str]], list[list[str]]]:
    best = best_static(summaries)
    loss_rows, spike_rows = [], []
    for name, s in summaries.items():
        ratio = "-" if best is None else f"{np.mean(s.final) / best[1]:.3f}"
        versus = "-"
        if best is not None and name != best[0]:
            versus = paired_cell(s.final, summaries[best[0]].final)
        loss_rows.append(
            [
                name,
                mean_spread(s.final),
                ratio,
                per_seed(s.final, ".3f"),
                versus,
                f"{int(np.sum(s.diverged))} / {seeds}",
            ]
        )
        spike_rows.append(
            [
                name,
                per_seed(s.events, "d"),
                f"{np.max(s.largest):.2f}",
                " / ".join(f"x{v:.1f}" for v in s.jump),
                per_seed(s.grad_spikes, "d"),
                " / ".join(f"{v:.0%}" for v in s.clipped),
                "-" if s.capped is None else " / ".join(f"{v:.0%}" for v in s.capped),
                "-" if s.skipped is None else per_seed(s.skipped.astype(int), "d"),
                f"{s.seconds:.0f}",
            ]
        )
    for name in missing:
        loss_rows.append([name, "unavailable", *["-"] * (len(LOSS_HEADER) - 2)])
        spike_rows.append([name, "unavailable", *["-"] * (len(SPIKE_HEADER) - 2)])
    return loss_rows, spike_rows


def print_table(header: list[str], rows: list[list[str]]) -> None:
    lines = [header, *rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    lines.insert(1, ["-" * w for w in widths])
    for line in lines:
        cells = [line[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(line[1:], widths[1:])]
        print("  ".join(cells))


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def machine() -> str:
    """The CPU model (or accelerator kind) and core count; no host name."""
    device = jax.devices()[0]
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    text = f"{cpu}, {os.cpu_count()} cores"
    if device.platform != "cpu":
        kind = getattr(device, "device_kind", device.platform)
        text = f"{jax.device_count()} x {kind} ({device.platform}); host: {text}"
    return text


def versions() -> str:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (
        f"Python {platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {version('jaxlib')}, optax {optax.__version__}, flax {version('flax')}, "
        f"clipjax {clipjax.__version__}, numpy {np.__version__}"
    )


def command(argv: list[str], script: str = "lm_spikes.py") -> str:
    """The command line of examples/<script>, without --out (where the page goes
    does not change it)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            shown.append(arg)
    return " ".join([f"python examples/{script}", *shown])


def page_header(argv: list[str], script: str = "lm_spikes.py") -> list[str]:
    """The lines that head a generated page: command, machine, versions, date."""
    return [
        f"Command: `{command(argv, script)}`",
        "",
        f"Machine: {machine()}",
        "",
        f"Versions: {versions()}",
        "",
        f"Date: {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        "",
    ]


def table_notes() -> str:
    return f"""\
*final held-out loss*: mean ± std over seeds of the next-byte cross-entropy (nats) on the
held-out files after the last step; *x best static*: that mean over the best mean of the
static_<max_norm> rows (the static clip sweep); *diverged*: runs on which some batch loss
was not finite or the final held-out loss is above ln 256 = {DIVERGED_LOSS:.3f} (worse than a
uniform guess over the 256 bytes). *loss spikes*: the batch loss averaged over {SMOOTH} steps
rises more than {LOSS_SPIKE} nats above its lowest value so far (a set-back; it ends once back
within {LOSS_SPIKE / 3:.2f}); *largest set-back*: the largest such rise over all seeds, in
nats; *largest jump*: the largest batch loss over the median of the {JUMP_WINDOW} batch losses
before it (inf: a loss not finite). *grad spikes*: steps whose raw gradient norm exceeds
{GRAD_SPIKE:g}x the median of the {SPIKE_WINDOW} before it. *share clipped*: the share of
steps on which the clipper scaled a gradient down, read every step from
`clipjax.metrics(opt_state)` (for optax.clip_by_global_norm: global norm above max_norm).
*share capped*: the share of steps on which a ceiling (`max_grad_norm`) was the bound,
from the `capped` metric; the rest of the clipped steps are spike clips.
*vs best static, paired*: the mean over seeds of the per-seed ratio of final held-out
losses to the best static clip's (same seeds and batches; a diverged run counts as
ln 256), its 95% bootstrap interval over seeds, and the seeds on which it is worse; a
setting is *worse* or *better* only where that interval excludes 0, else a *tie*.
*steps skipped*: `skip_on_spike/global/skipped_count` of the final state. Figures separated
by `/` are per seed. *wall s*: all seeds (vmapped), compilation included. *unavailable*: a
setting the installed clipjax does not offer."""


def markdown(
    config: str,
    summaries: dict[str, Summary],
    missing: dict[str, str],
    settings: dict[str, Setting],
    cfg: Config,
    seeds: list[int],
    text_info: str,
    argv: list[str],
    figure: str | None,
) -> str:
    loss_rows, spike_rows = table_rows(summaries, list(missing), len(seeds))
    best = best_static(summaries)
    names = [*summaries, *missing]
    lines = [
        f"# Natural loss spikes, {config.upper()} configuration"
        + ("" if cfg.loss_scale == 1 else f", loss x {cfg.loss_scale:g}"),
        "",
        *page_header(argv),
        f"Model: byte-level transformer, {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads, context {cfg.context}, batch {cfg.batch}; adamw(lr {cfg.lr:g}, "
        f"b1 {cfg.b1:g}, b2 {cfg.b2:g}, eps {cfg.eps:g}, weight decay {cfg.weight_decay:g}), "
        f"{cfg.warmup} warm-up steps then constant; {cfg.steps} steps; seeds {seeds}. "
        f"Data: {text_info}."
        + (
            ""
            if cfg.loss_scale == 1
            else f" The loss is multiplied by {cfg.loss_scale:g} (so is every gradient); the "
            f"static sweep's max_norm too (static_<v> clips at v x {cfg.loss_scale:g}), while "
            "clip_1 stays at 1.0. Held-out and batch losses are shown at x 1."
        ),
        "",
        f"## Final held-out loss, {config.upper()} configuration",
        "",
        *markdown_table(LOSS_HEADER, loss_rows),
        "",
        *([] if best is None else [f"Best static clip: `{best[0]}` ({best[1]:.3f}).", ""]),
        f"## Spikes, clipping and skipping, {config.upper()} configuration",
        "",
        *markdown_table(SPIKE_HEADER, spike_rows),
        "",
        table_notes(),
        "",
        f"## Settings, {config.upper()} configuration",
        "",
        *(f"- `{name}`: {settings[name].about}" for name in names),
        "",
    ]
    if figure:
        lines += [
            f"![batch loss of every setting by group, {config} configuration]({figure})",
            "",
        ]
    return "\n".join(lines)


def plot(path: Path, runs: dict[str, Run], settings: dict[str, Setting], cfg: Config) -> None:
    """One panel per group of settings (PANELS): the batch loss of each setting,
    median over seeds, averaged over PLOT_SMOOTH steps; adamw alone (black) in
    every panel; legends below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [key for key in PANELS if any(settings[n].panel == key for n in runs)]
    cols = 2 if len(panels) > 1 else 1
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(5.2 * cols, 5.0 * rows), layout="constrained", squeeze=False
    )
    steps = np.arange(cfg.steps)
    kernel = np.ones(PLOT_SMOOTH) / PLOT_SMOOTH

    def curve(run: Run) -> np.ndarray:
        loss = np.nanmedian(np.where(np.isfinite(run.loss), run.loss, np.nan), axis=0)
        if len(loss) < PLOT_SMOOTH:
            return loss
        smooth = np.convolve(loss, kernel, mode="valid")
        return np.concatenate([loss[: PLOT_SMOOTH - 1], smooth])

    for ax, key in zip(axes.flat, panels):
        names = [n for n in runs if settings[n].panel == key and n != "none"]
        if "none" in runs:
            ax.plot(steps, curve(runs["none"]), color="black", lw=2, label="none")
        for i, name in enumerate(names):
            style = ["-", "--"][i // 10 % 2]
            ax.plot(steps, curve(runs[name]), style, color=f"C{i % 10}", lw=1.2, label=name)
        ax.set(yscale="log", xlabel="step", ylabel="batch loss (nats/byte)")
        ax.set_title(PANELS[key], fontsize="medium")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize="small")
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"Batch loss, median over {runs[next(iter(runs))].loss.shape[0]} seeds, "
        f"{PLOT_SMOOTH}-step mean"
    )
    fig.savefig(path, dpi=70)
    plt.close(fig)


# ----------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Train a byte-level transformer on the Python standard library's sources at "
        "a learning rate where it spikes by itself, once per setting and seed, and compare. "
        "Settings: " + "; ".join(f"{n}: {s.about}" for n, s in SETTINGS.items()),
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument(
        "--config",
        choices=sorted(CONFIGS),
        default="gpu",
        help="gpu: 4 layers, d_model 256, 2000 steps (one GPU); cpu: 2 layers, d_model 64, "
        "300 steps at a learning rate where adamw alone blows up (two CPU cores); cpu_long: "
        "the GPU configuration's optimizer on a 2-layer d_model 64 model, 1000 steps (two "
        "CPU cores, about 100 s a setting); cpu_cosine: the 2-layer model, adamw with a "
        "30-step warm-up and a cosine decay over 300 steps",
    )
    parser.add_argument(
        "--seeds", type=int, default=DEFAULT_SEEDS, help="seeds per setting (0, 1, ...)"
    )
    parser.add_argument("--steps", type=int, default=None, help="steps per run (config's)")
    parser.add_argument("--only", default=None, help="comma-separated settings (default: all)")
    parser.add_argument("--lr", type=float, default=None, help="peak learning rate (config's)")
    parser.add_argument(
        "--static-sweep",
        default=None,
        help="comma-separated max_norm values of the static clip sweep (static_<value> rows; "
        "default: the config's, 0.25,0.5,1,2); with --only, adds these rows to the named ones",
    )
    parser.add_argument(
        "--loss-scale",
        type=float,
        default=1.0,
        help="multiply the loss (and so every gradient) by this; the static sweep's max_norm "
        "is multiplied too (its rows keep their names at x 1), clip_1 stays at 1.0; the page "
        "is lm_spikes_<config>_loss_x<k>.md",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_STEPS} steps, small eval: a smoke test, numbers mean nothing",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a model/optimizer field of Config (e.g. --set n_layers=2 --set b2=0.99)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(__file__).resolve().parents[1] / "docs" / "generated",
        help="folder of lm_spikes_<config>.md and .png",
    )
    parser.add_argument(
        "--npz", action="store_true", help="also write lm_spikes_<config>.npz (per-step curves)"
    )
    args = parser.parse_args(argv)

    cfg = CONFIGS[args.config]
    if args.quick:
        cfg = replace(cfg, steps=QUICK_STEPS, eval_every=QUICK_STEPS // 2, eval_windows=32)
    if args.steps is not None:
        if args.steps < 1:
            parser.error("--steps must be positive")
        every = min(cfg.eval_every, args.steps)
        while args.steps % every:
            every -= 1
        cfg = replace(cfg, steps=args.steps, eval_every=every)
    if args.lr is not None:
        cfg = replace(cfg, lr=args.lr)
    for item in args.set:
        field, _, value = item.partition("=")
        if field not in Config.__dataclass_fields__ or field == "static_sweep" or not value:
            parser.error(f"--set takes FIELD=VALUE with FIELD in {', '.join(vars(cfg))}")
        cfg = replace(cfg, **{field: type(getattr(cfg, field))(float(value))})
    cfg = replace(cfg, warmup=min(cfg.warmup, cfg.steps // 4))
    if args.seeds < 1:
        parser.error("--seeds must be positive")
    if not (args.loss_scale > 0 and math.isfinite(args.loss_scale)):
        parser.error("--loss-scale must be a positive number")
    cfg = replace(cfg, loss_scale=args.loss_scale)

    sweep = None
    if args.static_sweep:
        try:
            sweep = tuple(float(v) for v in args.static_sweep.split(",") if v.strip())
        except ValueError:
            parser.error(f"--static-sweep takes comma-separated numbers, not {args.static_sweep!r}")
        if not sweep or min(sweep) <= 0:
            parser.error("--static-sweep takes positive numbers")
        cfg = replace(cfg, static_sweep=sweep)
    args.cfg = cfg
    args.settings = settings_for(cfg)
    if args.only is None:
        names = list(args.settings)
    else:
        names = [n.strip() for n in args.only.split(",") if n.strip()]
        names += [static_name(v) for v in sweep or ()]
    unknown = [n for n in names if n not in args.settings]
    if unknown or not names:
        parser.error(
            f"unknown setting {', '.join(unknown)!r}; choose from {', '.join(args.settings)}"
        )
    args.names = list(dict.fromkeys(names))
    return args


def page_stem(config: str, cfg: Config, seeds: int = DEFAULT_SEEDS) -> str:
    """lm_spikes_<config>, with _lr<lr> for a learning rate other than the config's,
    _loss_x<k> for a loss scale other than 1 and _seeds<n> for other than 6 seeds."""
    stem = f"lm_spikes_{config}"
    if cfg.lr != CONFIGS[config].lr:
        stem += f"_lr{cfg.lr:g}"
    stem += "" if cfg.loss_scale == 1 else f"_loss_x{cfg.loss_scale:g}"
    return stem + ("" if seeds == DEFAULT_SEEDS else f"_seeds{seeds}")


def write_page(
    args: argparse.Namespace,
    runs: dict[str, Run],
    missing: dict[str, str],
    text_info: str,
    argv: list[str],
    figure: bool = False,
) -> None:
    """lm_spikes_<config>.md with the settings run so far (rewritten after each, so
    that the rows already measured survive an interrupted run); at the end, also
    the figure and, with --npz, the curves."""
    cfg, seeds = args.cfg, list(range(args.seeds))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = page_stem(args.config, args.cfg, args.seeds)
    if figure and runs:
        plot(args.out / f"{stem}.png", runs, args.settings, cfg)
    summaries = {name: summarize(run, cfg) for name, run in runs.items()}
    page = markdown(
        args.config,
        summaries,
        missing,
        args.settings,
        cfg,
        seeds,
        text_info,
        argv,
        f"{stem}.png" if figure and runs else None,
    )
    (args.out / f"{stem}.md").write_text(page)
    if figure and args.npz:
        np.savez_compressed(
            args.out / f"{stem}.npz",
            **{
                f"{name}/{field}": getattr(run, field)
                for name, run in runs.items()
                for field in ("loss", "grad_norm", "clipped", "eval_steps", "eval_loss")
            },
        )


def main(argv: list[str] | None = None) -> dict[str, Run]:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    cfg, seeds, settings = args.cfg, list(range(args.seeds)), args.settings
    train_text, held_out, files = load_text()
    text_info = (
        f"{len(files)} top-level .py files of the Python {platform.python_version()} standard "
        f"library, {len(train_text):,} bytes to train on, {len(held_out):,} held out"
    )
    print(f"{machine()}; {versions()}")
    print(f"{text_info}; {len(args.names)} settings x {len(seeds)} seeds x {cfg.steps} steps.")
    model = build_model(cfg, jnp.asarray(train_text), jnp.asarray(held_out_windows(held_out, cfg)))

    runs: dict[str, Run] = {}
    missing: dict[str, str] = {}
    total = len(args.names) * cfg.steps
    # Progress bars only on a terminal: a log gets one line per setting.
    bar = sys.stderr.isatty()
    with tqdm(
        total=total, unit="step", desc="training", dynamic_ncols=True, disable=not bar
    ) as progress:
        for name in args.names:
            try:
                tx = settings[name].make(cfg)
            except (AttributeError, TypeError, ValueError) as error:
                # An API this clipjax does not have (feedback=, adagc, skip_on_spike).
                missing[name] = f"{type(error).__name__}: {error}"
                tqdm.write(f"unavailable {name}: {missing[name]}")
                progress.update(cfg.steps)
                continue
            runs[name] = train(
                name,
                tx,
                cfg,
                seeds,
                model,
                progress,
                needs_value=settings[name].needs_value,
                static_max_norm=settings[name].max_norm(cfg),
            )
            if not bar:
                final = np.asarray(runs[name].eval_loss[:, -1])
                print(f"{name}: final held-out {per_seed(final, '.3f')}", flush=True)
            write_page(args, runs, missing, text_info, argv)
    write_page(args, runs, missing, text_info, argv, figure=True)
    summaries = {name: summarize(run, cfg) for name, run in runs.items()}
    loss_rows, spike_rows = table_rows(summaries, list(missing), len(seeds))
    print()
    print_table(LOSS_HEADER, loss_rows)
    print()
    print_table(SPIKE_HEADER, spike_rows)
    print()
    print(table_notes())

    total_s = sum(r.seconds for r in runs.values())
    stem = page_stem(args.config, args.cfg, args.seeds)
    print(f"\nWrote {stem}.md and .png under {args.out} ({total_s:.0f} s).")
    return runs


if __name__ == "__main__":
    main()
