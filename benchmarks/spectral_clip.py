"""What spectral gradient clipping costs an AdamW step, against AdamW and Muon's Newton-Schulz.

Jitted optimizer steps (update and apply_updates, params and state donated) on the
benchmarks' transformer-shaped tree (``benchmarks/common.py``): ``optax.chain(X,
optax.adamw)`` with X:

* nothing (``optax.adamw``);
* ``clipjax.spectral_clip`` with each rule (an exact SVD of every matrix and vector);
* ``clipjax.spectral_clip(rule="ema", rank=5)`` (the reference's randomized SVD);

and, for scale, adamw with Muon's orthogonalisation of its 2-D updates (optax's
``orthogonalize_via_newton_schulz``, 5 steps; ``benchmarks/spectra.py``'s row), the
other spectral method of the same step. Reported: CPU wall milliseconds a step
(median and quartiles over interleaved rounds) and their ratios. XLA's cost analysis
does not count the LAPACK SVD (a custom call), so bytes and flops are not compared.

    python benchmarks/spectral_clip.py [--quick] [--out FOLDER]

Writes ``benchmarks/SPECTRAL_CLIP.md``.
"""

from __future__ import annotations

import common
import optax
import spectra

import clipjax

MUON = "adamw + Muon Newton-Schulz (5 steps, float32)"
STEPS, ROUNDS = 2, 7
CONFIGS = {
    "adamw": lambda: optax.adamw(common.LR, weight_decay=spectra.WEIGHT_DECAY),
    "spectral_clip(1.0), adamw": lambda: optax.chain(
        clipjax.spectral_clip(1.0), optax.adamw(common.LR, weight_decay=spectra.WEIGHT_DECAY)
    ),
    'spectral_clip(rule="ema"), adamw': lambda: optax.chain(
        clipjax.spectral_clip(rule="ema"),
        optax.adamw(common.LR, weight_decay=spectra.WEIGHT_DECAY),
    ),
    'spectral_clip(rule="quantile"), adamw': lambda: optax.chain(
        clipjax.spectral_clip(rule="quantile"),
        optax.adamw(common.LR, weight_decay=spectra.WEIGHT_DECAY),
    ),
    'spectral_clip(rule="ema", rank=5), adamw': lambda: optax.chain(
        clipjax.spectral_clip(rule="ema", rank=5),
        optax.adamw(common.LR, weight_decay=spectra.WEIGHT_DECAY),
    ),
    MUON: spectra.CONFIGS[MUON],
}


def measure(quick: bool) -> str:
    sizes = common.sizes(quick)
    shapes = common.transformer_shapes(**sizes.model)
    _, runs = spectra.compiled_runs(CONFIGS, shapes)
    # An exact SVD step takes seconds on a CPU: a block of few steps times it, and the
    # rounds are fewer than the other benchmarks' (which time millisecond steps).
    steps = max(1, min(STEPS, common.block_steps(runs, sizes.block_s)))
    rounds = min(sizes.rounds, ROUNDS)
    wall, _ = common.interleave(runs, rounds, steps)
    rows = [
        [
            label,
            common.ms(wall[label]),
            f"{common.median(common.ratios(wall[label], wall['adamw'])):.2f}",
            f"{common.median(common.ratios(wall[label], wall[MUON])):.2f}",
        ]
        for label in CONFIGS
    ]
    head = ["step", "ms a step, median [quartiles]", "time × adamw", "time × Muon NS"]
    about = (
        f"Optimizer step (update and apply_updates, donated) on {common.describe(shapes)} "
        "(`benchmarks/common.py`'s transformer tree; spectral_clip decomposes every "
        "leaf: the 2-D kernels and embedding as matrices, the 1-D leaves as `[n, 1]` "
        f"matrices); {rounds} interleaved rounds of {steps} steps each. Time ratios "
        "are medians of the per-round ratios."
    )
    return about + "\n\n" + common.table(head, rows)


def main(argv: list[str] | None = None) -> None:
    common.cost_page_main(
        argv,
        __doc__,
        "spectral_clip.py",
        "What spectral gradient clipping costs an AdamW step",
        "## CPU step time",
        "SPECTRAL_CLIP.md",
        measure,
    )


if __name__ == "__main__":
    main()
