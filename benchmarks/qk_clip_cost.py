"""What QK-Clip costs a training step: the max-logit helper in the forward pass, and the transform.

The whole step of ``benchmarks/train_step.py``'s byte-level transformer (its
model, sizes and interleaved timing; fused ``qkv`` kernels, causal attention),
in its two layouts (``unscanned``: a list of layers; ``scanned``: stacked
layers under ``jax.lax.scan``, the max logits a scan output ``[layers,
heads]`` and ``qk_clip``'s ``scope=clipjax.stacked(layers="layers")``). Per
optimizer (``optax.adamw`` and ``optax.contrib.muon``), three configurations:

* ``<opt>``: the loss and gradient, the optimizer alone;
* ``<opt> + logits``: the same with ``clipjax.max_attention_logits`` in every
  layer's attention (returned as the loss's aux), the optimizer alone: the
  helper's cost in the forward pass;
* ``<opt> + qk_clip``: the same loss, ``clipjax.qk_clip(<opt>, ...)``
  given those logits: the transform's cost (target: at most 1.02x ``<opt> + logits``).

The helper's forward-pass cost is also measured on the forward alone (the loss,
no gradient), with and without it. Writes ``benchmarks/QK_CLIP_COST.md``.

    python benchmarks/qk_clip_cost.py                  # --size cpu, both layouts
    python benchmarks/qk_clip_cost.py --size tiny --rounds 1 --out /tmp/q   # a smoke test
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable

import common
import jax
import jax.numpy as jnp
import optax
import train_step
from train_step import SIZES, Size

import clipjax

TARGET = 1.02  # the transform's whole step over the optimizer's, both given the logits
OPTIMIZERS = {"adamw": "optax.adamw(1e-3)", "muon": "optax.contrib.muon(1e-3)"}


def configurations(size: Size, layout: str) -> dict[str, tuple[Callable, bool, bool]]:
    """label -> (make of the transform, whether the loss computes the max logits, whether
    the transform takes them)."""
    d = size.d
    scope = clipjax.stacked(layers="layers") if layout == "scanned" else None
    qk_clip = lambda optimizer: clipjax.qk_clip(
        optimizer,
        100.0,
        query=clipjax.QKHeads("attn/qkv", axis=-1, span=(0, d)),
        key=clipjax.QKHeads("attn/qkv", axis=-1, span=(d, 2 * d)),
        scope=scope,
    )
    out: dict[str, tuple[Callable, bool, bool]] = {}
    for name, code in OPTIMIZERS.items():
        make = lambda code=code: eval(code, {"optax": optax})
        out[name] = (make, False, False)
        out[f"{name} + logits"] = (make, True, False)
        out[f"{name} + qk_clip"] = (lambda make=make: qk_clip(make()), True, True)
    return out


def forward_times(size: Size, layout: str, rounds: int) -> dict[str, list[float]]:
    """CPU (wall on a GPU) seconds a forward pass, with and without the helper, interleaved."""
    params, tokens = train_step.inputs(size, layout)

    def forward(logits: bool) -> Callable[[int], None]:
        loss = jax.jit(lambda p, x: train_step.loss_fn(p, x, size, layout, logits))

        def run(steps: int) -> None:
            for _ in range(steps):
                out = loss(params, tokens)
            jax.block_until_ready(out)

        return run

    runs = {"forward": forward(False), "forward + logits": forward(True)}
    return train_step.seconds(
        *common.interleave(runs, rounds, size.steps, warm=1, order=common.alternated)
    )


def section(layout: str, size: Size, rounds: int) -> tuple[str, dict[str, float]]:
    measured = {
        label: train_step.compile_step(make, size, layout, logits=logits, clip=clip)
        for label, (make, logits, clip) in configurations(size, layout).items()
    }
    for label, m in measured.items():
        common.log(f"  {layout} {label}: compile {m.wall_s:.1f} s")
    # Step seconds on train_step.basis(), of every pair a configuration was timed in.
    times: dict[str, list[float]] = {label: [] for label in measured}
    figures: dict[str, float] = {}
    rows = []
    for name in OPTIMIZERS:
        # The optimizer, + logits (the helper's cost) and + qk_clip (the transform's), each
        # over the one before it: each ratio is timed on its pair alone, interleaved, so that
        # a shared machine's drift within a round falls on the two configurations it compares.
        labels = [name, f"{name} + logits", f"{name} + qk_clip"]
        ratios: list[list[float] | None] = [None]
        for reference, other in itertools.pairwise(labels):
            pair = {"reference": measured[reference], "other": measured[other]}
            got = train_step.seconds(*train_step.time_steps(pair, size, layout, rounds))
            times[reference] += got["reference"]
            times[other] += got["other"]
            ratios.append(common.ratios(got["other"], got["reference"]))
        figures[f"{layout} {name} helper"] = common.median(ratios[1])
        figures[f"{layout} {name} transform"] = common.median(ratios[2])
        for label, reference, ratio in zip(labels, [None, *labels], ratios):
            m, verdict = measured[label], ""
            if label.endswith("qk_clip"):
                ok = common.median(ratio) <= TARGET
                verdict = f"≤ {TARGET:.2f}: {'met' if ok else '**missed**'}"
            rows.append(
                [
                    f"`{label}`",
                    f"{common.median(times[label]) * 1e3:.3g}",
                    "" if ratio is None else common.spread(ratio, "{:.3f}"),
                    f"`{reference}`" if reference else "",
                    "" if ratio is None else f"{m.bytes / measured[reference].bytes:.4f}",
                    verdict,
                    f"{m.cpu_s:.2f}",
                    f"{m.bytes:d}",
                ]
            )
    forward = forward_times(size, layout, rounds)
    fwd = common.ratios(forward["forward + logits"], forward["forward"])
    figures[f"{layout} forward helper"] = common.median(fwd)
    rows.append(
        [
            "`forward + logits`",
            f"{common.median(forward['forward + logits']) * 1e3:.3g}",
            common.spread(fwd, "{:.3f}"),
            f"`forward` ({common.median(forward['forward']) * 1e3:.3g} ms)",
            "",
            "",
            "",
            "",
        ]
    )
    basis = train_step.basis()
    header = ["configuration", f"step ms ({basis})", f"× reference ({basis})", "reference",
              "bytes × reference", "target", "compile s (CPU)", "bytes accessed"]  # fmt: skip
    text = f"## {layout.capitalize()} layers\n\n" + common.table(header, rows)
    return text, figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    args = train_step.options(__doc__, size="cpu").parse_args(argv)
    size = SIZES[args.size]
    rounds = args.rounds or size.rounds
    head = common.header(common.command("qk_clip_cost.py", argv), numpy=True)
    size_text = (
        f"`--size {args.size}`: {size.layers} layers, d_model {size.d}, {size.heads} heads, "
        f"batch {size.batch} x {size.context} bytes, {jnp.dtype(size.matmul).name} matmul inputs"
    )
    intro = [
        "# What QK-Clip costs a training step",
        "",
        *head,
        "",
        f"`benchmarks/train_step.py`'s model ({size_text}). *step ms*: median over the "
        f"rounds (each ratio: {rounds} rounds of {size.steps} steps of the two "
        "configurations it compares, alone and interleaved) of one `jax.jit` of loss, "
        "gradient, `update` and `apply_updates` (params and optimizer state donated). "
        "*× reference*: median [25th–75th percentile] over rounds of the step time over the "
        "reference's in the same round. *bytes × reference*: XLA's `cost_analysis()` bytes "
        "accessed of the compiled step over the reference's (repeatable). `+ logits`: "
        "`clipjax.max_attention_logits(q, k, causal=True)` "
        "in every layer, the optimizer alone; `+ qk_clip`: the same logits given to "
        "`clipjax.qk_clip` chained after the optimizer. `forward + logits`: the loss alone "
        "(no gradient), with the helper over without it.",
    ]
    path = common.page_path(args.out, "QK_CLIP_COST.md")
    sections, figures = [], {}
    for layout in args.layouts.split(","):
        text, found = section(layout, size, rounds)
        sections.append(text)
        figures.update(found)
        common.write(path, common.page(intro, *sections))
    for key, value in figures.items():
        common.log(f"  {key}: {value:.3f}x")
    return figures


if __name__ == "__main__":
    main()
