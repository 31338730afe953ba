"""What SPECTRA costs an AdamW step, against AdamW alone and Muon's Newton-Schulz.

Jitted optimizer steps (update and apply_updates, params and state donated) on the
benchmarks' transformer-shaped tree (``benchmarks/common.py``), the paper's chain
``scale_by_adam -> X -> add_decayed_weights -> scale_by_learning_rate`` with X:

* nothing (``optax.adamw``'s arithmetic);
* ``clipjax.spectra`` (10 coupled Newton-Schulz steps, bfloat16: the paper's default);
* ``clipjax.spectra(dtype=float32)`` (the paper's ``use_float32=True``);
* Muon's orthogonalisation of the same leaves: optax's
  ``orthogonalize_via_newton_schulz`` (5 quintic steps, float32), what
  ``optax.contrib.muon`` runs on each matrix.

Every X acts on the 2-D leaves only. Reported: CPU wall milliseconds a step
(median and quartiles over interleaved rounds), and XLA's ``cost_analysis()``
bytes accessed and flops, each over AdamW's and over Muon's.

    python benchmarks/spectra.py [--quick] [--out FOLDER]

Writes ``benchmarks/SPECTRA.md``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import common
import jax
import jax.numpy as jnp
import optax
from optax.contrib import _muon  # orthogonalize_via_newton_schulz: not re-exported by contrib

import clipjax

WEIGHT_DECAY = 0.1
C = 1.0  # the paper's default clip_c
MUON_COEFFS = jnp.asarray((3.4445, -4.7750, 2.0315))  # optax's and Keller Jordan's default


def muon_newton_schulz() -> optax.GradientTransformation:
    """Each 2-D leaf orthogonalised by optax's Muon Newton-Schulz (5 steps), others as they are."""

    def update_fn(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        ortho = lambda u: (
            _muon.orthogonalize_via_newton_schulz(u, MUON_COEFFS, 5) if u.ndim == 2 else u
        )
        return jax.tree.map(ortho, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def chain(middle: Callable[[], Any] | None) -> Callable[[], optax.GradientTransformation]:
    """The paper's AdamW chain with ``middle`` between the direction and the decay."""

    def make() -> optax.GradientTransformation:
        inner = [] if middle is None else [middle()]
        return optax.chain(
            optax.scale_by_adam(),
            *inner,
            optax.add_decayed_weights(WEIGHT_DECAY),
            optax.scale_by_learning_rate(common.LR),
        )

    return make


CONFIGS = {
    "adamw": chain(None),
    "adamw + spectra (bfloat16)": chain(lambda: clipjax.spectra(C)),
    "adamw + spectra (float32)": chain(lambda: clipjax.spectra(C, dtype=jnp.float32)),
    "adamw + Muon Newton-Schulz (5 steps, float32)": chain(muon_newton_schulz),
}


def cost_of(compiled: common.Compiled) -> tuple[float, float]:
    cost = compiled.run.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return float(cost["bytes accessed"]), float(cost.get("flops", float("nan")))


def compiled_runs(
    configs: dict[str, Callable[[], optax.GradientTransformation]], shapes: Any
) -> tuple[dict[str, common.Compiled], dict[str, Callable[[int], None]]]:
    """Each configuration's jitted optimizer step on ``shapes``, and a function that runs
    it ``steps`` times on the same gradients (params and state carried along)."""
    params, grads = common.params_and_grads(shapes)
    compiled, runs = {}, {}
    for label, make in configs.items():
        common.log(f"  compiling {label}")
        tx = make()
        compiled[label] = common.compile_jit(
            common.train_step(tx, False), *common.step_args(tx, shapes)
        )
        held = {"params": jax.tree.map(jnp.copy, params), "state": tx.init(params)}

        def run(steps: int, run=compiled[label].run, held=held) -> None:
            p, s = held["params"], held["state"]
            for _ in range(steps):
                p, s = run(p, s, grads, jnp.float32(0.0))
            jax.block_until_ready(p)
            held["params"], held["state"] = p, s

        runs[label] = run
    return compiled, runs


def measure(quick: bool) -> str:
    sizes = common.sizes(quick)
    shapes = common.transformer_shapes(**sizes.model)
    compiled, runs = compiled_runs(CONFIGS, shapes)
    costs = {label: cost_of(c) for label, c in compiled.items()}
    steps = max(1, min(20, common.block_steps(runs, sizes.block_s)))
    wall, _ = common.interleave(runs, sizes.rounds, steps)
    base, muon = "adamw", "adamw + Muon Newton-Schulz (5 steps, float32)"
    rows = []
    for label in CONFIGS:
        rows.append(
            [
                label,
                common.ms(wall[label]),
                f"{common.median(common.ratios(wall[label], wall[base])):.2f}",
                f"{common.median(common.ratios(wall[label], wall[muon])):.2f}",
                f"{costs[label][0] / costs[base][0]:.3f}",
                f"{costs[label][0] / costs[muon][0]:.3f}",
                f"{costs[label][1] / 1e9:.3g}",
                f"{costs[label][1] / costs[muon][1]:.2f}",
            ]
        )
    head = [
        "step",
        "ms a step, median [quartiles]",
        "time × adamw",
        "time × Muon NS",
        "bytes × adamw",
        "bytes × Muon NS",
        "GFLOP (XLA)",
        "flops × Muon NS",
    ]
    about = (
        f"Optimizer step (update and apply_updates, donated) on {common.describe(shapes)} "
        f"(`benchmarks/common.py`'s transformer tree; its 2-D leaves are the embedding, "
        f"qkv, out, fc1 and fc2 kernels); {sizes.rounds} interleaved rounds of {steps} "
        "steps each. Time ratios are medians of the per-round ratios. Bytes and flops: "
        "XLA's `cost_analysis()` of the compiled step (both iterations unrolled, every "
        "step counted)."
    )
    return about + "\n\n" + common.table(head, rows)


def main(argv: list[str] | None = None) -> None:
    common.cost_page_main(
        argv,
        __doc__,
        "spectra.py",
        "What SPECTRA costs an AdamW step",
        "## CPU step time, bytes and flops",
        "SPECTRA.md",
        measure,
    )


if __name__ == "__main__":
    main()
