"""Does a spike defence follow a run? The open-loop grid of "following a run".

A spike defence must stop spikes without turning into a static clip. Each
stream is a sequence of global gradient norms (open loop: clipping does not
change later norms):

* lognormal noise ``sigma`` in {0.05, 0.1, 0.2} on every step;
* a base level until step 300, then a **lasting** level ``k`` times it, with
  ``k`` in {0.25, 2, 4, 10};
* isolated x10 spikes: 4 between steps 100 and 290, and 4 from 180 steps
  after the shift on (at least 15 steps apart).

The base level is 1, or 0.05 for a setting with an absolute ceiling
(``max_grad_norm``, reported by a ``headroom`` metric): a ceiling is a static
clip the user chose, so such a setting is judged on the grid scaled to stay
below it (levels 0.0125 to 0.5 under a ceiling of 1). A relative ceiling has
no scale and is judged on the grid itself.

Per setting and cell (sigma, k), over seeds, the table gives:

* ``clip before``: the share of non-spike steps from step 100 to the shift
  that were clipped (or skipped);
* ``clip after``: the same from 120 steps after the shift to the end;
* ``threshold / level``: the median threshold (the norm above which a step
  is clipped or skipped) over the median raw norm of the same steps, before
  the shift and after it; the table gives the cell where the two differ most;
* ``worst spike``: the largest (norm reaching the optimizer) / (level of its
  step) over the spikes; a skipped spike counts 0.

A setting **follows a run** when, in every cell and seed, ``clip after`` is at
most 5 percentage points above ``clip before`` (a setting that clips many
steps by design follows when it keeps doing so at the new level),
``threshold / level`` after the shift is within x1.5 of what it was before
(where the setting reports a threshold), and ``worst spike`` is at most 2.

``spam()`` and ``stable_spam()`` are optimizers: the gradient they clip is
read back from Adam's first moment, and counted as clipped when it is below
the input by more than float32 rounding of that read-back (1e-4).

Run: ``python benchmarks/follow.py [--seeds 3] [--update-docs]`` (the latter
writes ``docs/generated/follow.md``).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 700
SHIFT = 300
SIGMAS = (0.05, 0.1, 0.2)
LEVELS = (0.25, 2.0, 4.0, 10.0)
SPIKE = 10.0
BEFORE = (100, SHIFT)  # the non-spike steps judged before the shift
AFTER = SHIFT + 120  # ... and from here on
SPIKES_AFTER = SHIFT + 180
MAX_MORE_CLIPPED = 0.05  # clip after <= clip before + 5 percentage points
MAX_DRIFT = 1.5  # threshold / level after within x1.5 of before
MAX_PASSED = 2.0
CEILING_BASE = 0.05  # the base level of the grid for a setting with a ceiling


def stream(
    seed: int, sigma: float, level: float, base: float = 1.0
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(norms, level per step, spike steps)`` of one cell of the grid."""
    rng = np.random.default_rng([seed, int(sigma * 1000), int(level * 100)])
    t = np.arange(STEPS)
    levels = base * np.where(t < SHIFT, 1.0, level)
    norms = levels * np.exp(sigma * rng.standard_normal(STEPS))
    spikes: list[int] = []
    for lo, hi in ((BEFORE[0], SHIFT - 10), (SPIKES_AFTER, STEPS)):
        chosen: list[int] = []
        while len(chosen) < 4:
            s = int(rng.integers(lo, hi))
            if all(abs(s - o) >= 15 for o in chosen):
                chosen.append(s)
        spikes += chosen
    spikes.sort()
    norms[spikes] *= SPIKE
    return norms, levels, np.asarray(spikes)


def has_ceiling(tx: optax.GradientTransformation) -> bool:
    """Whether a setting bounds every step by an absolute ceiling (a ``headroom``
    metric; a relative ceiling has none and is judged on the grid itself)."""
    state = tx.init({"w": jnp.zeros((1,), jnp.float32)})
    return any(k.endswith("/headroom") for k in clipjax.metrics(state))


# The settings of the grid: the references' defaults, feedback="clipped",
# adagc and skip_on_spike. ``REQUIRED`` must follow a run.
SETTINGS: dict[str, Callable[[], optax.GradientTransformation]] = {
    "autoclip()": lambda: clipjax.autoclip(),
    "zscore_clip()": lambda: clipjax.zscore_clip(),
    "zclip()": lambda: clipjax.zclip(),
    "zclip(max_grad_norm=None, warmup_steps=10)": lambda: clipjax.zclip(
        max_grad_norm=None, warmup_steps=10
    ),
    "hist_clip()": lambda: clipjax.hist_clip(),
    "hist_clip(feedback='clip_target')": lambda: clipjax.hist_clip(feedback="clip_target"),
    "adagc(scope='global')": lambda: clipjax.adagc(scope="global"),
    "autoclip(feedback='clipped')": lambda: clipjax.autoclip(feedback="clipped"),
    "zscore_clip(feedback='clipped')": lambda: clipjax.zscore_clip(feedback="clipped"),
    "zclip(feedback='clipped')": lambda: clipjax.zclip(feedback="clipped"),
    "zclip(feedback='clipped', max_grad_norm=1.0)": lambda: clipjax.zclip(
        feedback="clipped", max_grad_norm=1.0
    ),
    "zclip(feedback='clipped', max_grad_norm=None, relative_ceiling=None)": lambda: clipjax.zclip(
        feedback="clipped", max_grad_norm=None, relative_ceiling=None
    ),
    "zclip(mode='percentile', feedback='clipped')": lambda: clipjax.zclip(
        mode="percentile", feedback="clipped"
    ),
    "hist_clip(feedback='clipped')": lambda: clipjax.hist_clip(feedback="clipped"),
    "skip_on_spike(optimizer)": lambda: clipjax.skip_on_spike(optax.identity()),
    # Clips about half the steps by design, at any level.
    "autoclip(mode='percentile', percentile=50, window_size=100, feedback='clipped')": lambda: (
        clipjax.autoclip(mode="percentile", percentile=50, window_size=100, feedback="clipped")
    ),
    # Spectral gradient clipping on the one-element "matrix" of the stream: its top
    # singular value is the norm (the reference's EMA and quantile rules, and the EMA
    # with feedback="clipped", whose factor defaults to 1.5).
    "spectral_clip(rule='ema')": lambda: clipjax.spectral_clip(rule="ema"),
    "spectral_clip(rule='ema', feedback='clipped')": lambda: clipjax.spectral_clip(
        rule="ema", feedback="clipped"
    ),
    "spectral_clip(rule='quantile')": lambda: clipjax.spectral_clip(rule="quantile"),
    # A static clip: below the level after a rise, it clips every step.
    "clip_by_global_norm(1.0)": lambda: clipjax.clip_by_global_norm(1.0),
    # Stable-SPAM's pieces (one element: AdaClip's bound is an EMA of |g|;
    # AdaGN rescales every step to a norm near its EMA, so it "clips" every
    # step above that and lifts those below).
    "adaclip(scope='global')": lambda: clipjax.adaclip(scope="global"),
    "ada_norm(scope='global')": lambda: clipjax.ada_norm(scope="global"),
}
# Optimizers: the gradient they clip is read back from Adam's first moment,
# g = (m_t - b1 m_{t-1}) / (1 - b1) (m_{t-1} = 0 on a reset step).
OPTIMIZERS = {
    "spam()": (lambda: clipjax.spam(1e-3), "spam"),
    "stable_spam()": (lambda: clipjax.stable_spam(1e-3), "stable_spam"),
}
B1 = 0.9


def recommended() -> str:
    """The README's recommended setting, from its one source."""
    path = os.path.join(ROOT, "docs", "generated", "recommended.md")
    with open(path) as f:
        return re.search(r"`(clipjax\.[^`]+)`", f.read()).group(1)


SETTINGS["recommended"] = lambda: eval(recommended(), {"clipjax": clipjax, "optax": optax})
REQUIRED = (
    "recommended",
    "autoclip(feedback='clipped')",
    "zscore_clip(feedback='clipped')",
    "zclip(feedback='clipped')",
    "hist_clip(feedback='clipped')",
    "skip_on_spike(optimizer)",
)


@dataclasses.dataclass
class Cell:
    """One setting on one cell of the grid, per seed."""

    clipped_before: np.ndarray
    clipped_after: np.ndarray
    worst_spike: np.ndarray
    ratio_before: np.ndarray  # median threshold / median raw norm (NaN: no threshold)
    ratio_after: np.ndarray

    def drift(self) -> np.ndarray:
        """How far threshold / level moved with the shift (a factor >= 1; NaN: no threshold)."""
        r = self.ratio_after / self.ratio_before
        return np.maximum(r, 1 / r)

    def follows(self) -> bool:
        drift = self.drift()
        return bool(
            (self.clipped_after <= self.clipped_before + MAX_MORE_CLIPPED).all()
            and ((drift <= MAX_DRIFT) | np.isnan(drift)).all()
            and (self.worst_spike <= MAX_PASSED).all()
        )


def _threshold(metrics: dict[str, jax.Array]) -> jax.Array:
    """This step's threshold: the first clipjax clipper's, or skip_on_spike's; NaN if none."""
    for key, value in metrics.items():
        if key.endswith(("/threshold", "/grad_threshold")):
            return jnp.asarray(value, jnp.float32).reshape(-1)[0]
    return jnp.asarray(jnp.nan, jnp.float32)


def run(
    tx: optax.GradientTransformation, norms: np.ndarray, algo: str | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(norm reaching the optimizer, threshold)``, each ``[streams, steps]``.

    With ``algo``, ``tx`` is an optimizer named ``algo`` in the metrics: the
    gradient its moments saw is read back from Adam's first moment.
    """
    params = {"w": jnp.zeros((1,), jnp.float32)}

    def one(xs: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(state, g):
            out, new = tx.update({"w": g[None]}, state, params)
            threshold = _threshold(clipjax.metrics(new))
            if algo is None:
                return new, (jnp.abs(out["w"][0]), threshold)
            old_mu = optax.tree_utils.tree_get(state, "mu")["w"][0]
            mu = optax.tree_utils.tree_get(new, "mu")["w"][0]
            reset = clipjax.metrics(new)[f"{algo}/global/steps_since_reset"] == 0
            passed = jnp.abs((mu - B1 * jnp.where(reset, 0.0, old_mu)) / (1 - B1))
            return new, (passed, threshold)

        return jax.lax.scan(step, tx.init(params), xs)[1]

    out, threshold = jax.jit(jax.vmap(one))(jnp.asarray(norms, jnp.float32))
    return np.asarray(out), np.asarray(threshold)


def evaluate(
    make: Callable[[], optax.GradientTransformation],
    seeds: int = 3,
    sigmas: tuple[float, ...] = SIGMAS,
    levels: tuple[float, ...] = LEVELS,
    algo: str | None = None,
    base: float | None = None,
) -> dict[tuple[float, float], Cell]:
    """Every cell of the grid for one setting (all streams in one compiled scan);
    ``algo`` names an optimizer whose clipped gradient is read back (see :func:`run`).
    ``base`` is the level before the shift: None means :data:`CEILING_BASE` for a
    setting with a ceiling, 1 otherwise."""
    if base is None:
        base = CEILING_BASE if algo is None and has_ceiling(make()) else 1.0
    keys = [(s, k) for s in sigmas for k in levels]
    streams = [stream(seed, s, k, base) for s, k in keys for seed in range(seeds)]
    norms = np.stack([x[0] for x in streams])
    out, thresholds = run(make(), norms, algo)
    out = out.reshape(len(keys), seeds, STEPS)
    thresholds = thresholds.reshape(len(keys), seeds, STEPS)
    # float32 moments: the read-back gradient is exact to about 1e-5.
    rounding = 1e-5 if algo is None else 1e-4
    t = np.arange(STEPS)
    cells = {}
    for i, key in enumerate(keys):
        before, after, worst, ratio_before, ratio_after = [], [], [], [], []
        for j in range(seeds):
            x, levels_, spikes = streams[i * seeds + j]
            clipped = out[i, j] < x.astype(np.float32) * (1 - rounding)
            plain = np.ones(STEPS, bool)
            plain[spikes] = False
            early = plain & (t >= BEFORE[0]) & (t < BEFORE[1])
            late = plain & (t >= AFTER)
            before.append(clipped[early].mean())
            after.append(clipped[late].mean())
            worst.append((out[i, j][spikes] / levels_[spikes]).max())
            for steps, ratios in ((early, ratio_before), (late, ratio_after)):
                ratios.append(np.median(thresholds[i, j][steps]) / np.median(x[steps]))
        cells[key] = Cell(*map(np.array, (before, after, worst, ratio_before, ratio_after)))
    return cells


def _worst(cells: dict[tuple[float, float], Cell], value: Callable[[Cell], float]) -> tuple:
    key = max(cells, key=lambda k: np.nan_to_num(value(cells[k]), nan=-np.inf))
    return value(cells[key]), key


def table(seeds: int, names: list[str] | None = None) -> str:
    """The markdown table: per setting, its worst cell and whether it follows a run."""
    lines = [
        "| setting | grid | clip before → after (worst cell) | threshold / level, "
        "before → after (worst cell) | worst spike / level | cells that follow | follows |",
        "|---|---|---|---|---|---|---|",
    ]
    where = lambda key: f"σ {key[0]}, ×{key[1]:g}"
    for name in names or [*SETTINGS, *OPTIMIZERS]:
        if name in OPTIMIZERS:
            make, algo = OPTIMIZERS[name]
            cells, base = evaluate(make, seeds, algo=algo), 1.0
        else:
            base = CEILING_BASE if has_ceiling(SETTINGS[name]()) else 1.0
            cells = evaluate(SETTINGS[name], seeds, base=base)
        _, more_key = _worst(cells, lambda c: (c.clipped_after - c.clipped_before).max())
        c = cells[more_key]
        j = int(np.argmax(c.clipped_after - c.clipped_before))
        clip = f"{c.clipped_before[j]:.1%} → {c.clipped_after[j]:.1%} ({where(more_key)})"
        drift, drift_key = _worst(cells, lambda c: np.nanmax(c.drift(), initial=np.nan))
        if np.isnan(drift):
            ratio = "no threshold"
        else:
            c = cells[drift_key]
            j = int(np.nanargmax(c.drift()))
            ratio = (
                f"{c.ratio_before[j]:.2f} → {c.ratio_after[j]:.2f} (×{drift:.2f}; "
                f"{where(drift_key)})"
            )
        spike, spike_key = _worst(cells, lambda c: c.worst_spike.max())
        good = sum(c.follows() for c in cells.values())
        label = f"recommended: {recommended()}" if name == "recommended" else name
        lines.append(
            f"| `{label}` | {'scaled (0.05)' if base != 1 else 'level 1'} | {clip} | {ratio} "
            f"| {spike:.2f} ({where(spike_key)}) | {good}/{len(cells)} "
            f"| {'yes' if good == len(cells) else 'no'} |"
        )
        print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


PAGE = os.path.join(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "generated", "follow.md"
)


def page(seeds: int) -> str:
    """The generated page: what was run, where, and the table."""
    import common

    # No wall-clock figure here: the machine's load does not qualify anything.
    meta = common.header(f"python benchmarks/follow.py --seeds {seeds} --update-docs", load=False)
    doc = "\n\n".join(__doc__.split("\n\n")[1:8]).strip()
    return common.page("# Following a run: the open-loop grid", meta, doc, table(seeds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--update-docs", action="store_true", help=f"write {PAGE}")
    parser.add_argument("settings", nargs="*", help="setting names (default: all)")
    args = parser.parse_args()
    if args.update_docs:
        text = page(args.seeds)
        with open(PAGE, "w") as f:
            f.write(text)
    else:
        text = table(args.seeds, args.settings or None)
    print(text)


if __name__ == "__main__":
    main()
