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
* ``<opt> + qk_clip``: the same loss, ``optax.chain(<opt>, clipjax.qk_clip(...))``
  given those logits: the transform's cost (target: at most 1.02x ``<opt> + logits``).

The helper's forward-pass cost is also measured on the forward alone (the loss,
no gradient), with and without it. Writes ``benchmarks/QK_CLIP_COST.md``.

    python benchmarks/qk_clip_cost.py                  # --size cpu, both layouts
    python benchmarks/qk_clip_cost.py --size tiny --rounds 1 --out /tmp/q   # a smoke test
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time
from typing import Any

import common
import jax
import jax.numpy as jnp
import optax
import train_step
from train_step import SIZES, Measured, Size, init_params

import clipjax

TARGET = 1.02  # the transform's whole step over the optimizer's, both given the logits
OPTIMIZERS = {"adamw": "optax.adamw(1e-3)", "muon": "optax.contrib.muon(1e-3)"}


def loss_fn(
    params: dict[str, Any], tokens: jax.Array, size: Size, layout: str, logits: bool
) -> tuple[jax.Array, jax.Array | None]:
    """train_step.loss_fn, with ``clipjax.max_attention_logits`` of each layer where ``logits``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    h, dh = size.heads, size.d // size.heads
    mm = size.matmul

    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(mm), w.astype(mm), preferred_element_type=jnp.float32)

    dense = lambda x, p: matmul(x, p["kernel"]) + p["bias"]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def block(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, jax.Array | None]:
        q, k, v = jnp.split(dense(train_step._norm(x, p["ln1"]), p["attn"]["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh).astype(mm) for a in (q, k, v))
        s = clipjax.max_attention_logits(q, k, causal=True) if logits else None
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        att = jax.nn.softmax(jnp.where(causal, scores / math.sqrt(dh), -1e30), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", att.astype(mm), v, preferred_element_type=jnp.float32)
        x = x + dense(mixed.reshape(b, t, -1), p["attn"]["out"])
        y = jax.nn.gelu(dense(train_step._norm(x, p["ln2"]), p["mlp"]["fc1"]))
        return x + dense(y, p["mlp"]["fc2"]), s

    x = params["embed"][inputs] + params["pos"][:t]
    if layout == "scanned":
        x, maxima = jax.lax.scan(block, x, params["layers"])
    else:
        found = []
        for p in params["layers"]:
            x, s = block(x, p)
            found.append(s)
        maxima = jnp.stack(found) if logits else None
    out = matmul(train_step._norm(x, params["ln_f"]), params["embed"].T)
    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean(), maxima


def configurations(size: Size, layout: str) -> dict[str, tuple[Any, bool, bool]]:
    """label -> (transform, whether the loss computes the max logits, whether the
    transform takes them)."""
    d = size.d
    scope = clipjax.stacked(layers="layers") if layout == "scanned" else None
    qk_clip = lambda: clipjax.qk_clip(
        100.0,
        query=clipjax.QKHeads("attn/qkv", axis=-1, span=(0, d)),
        key=clipjax.QKHeads("attn/qkv", axis=-1, span=(d, 2 * d)),
        scope=scope,
    )
    out: dict[str, tuple[Any, bool, bool]] = {}
    for name, code in OPTIMIZERS.items():
        make = lambda code=code: eval(code, {"optax": optax})
        out[name] = (make(), False, False)
        out[f"{name} + logits"] = (make(), True, False)
        out[f"{name} + qk_clip"] = (optax.chain(make(), qk_clip()), True, True)
    return out


def compile_one(tx: Any, logits: bool, clip: bool, size: Size, layout: str) -> Measured:
    jax.clear_caches()
    params, tokens = train_step.model_shapes(size, layout)

    def step(params: Any, state: Any, tokens: jax.Array) -> Any:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, maxima), grads = grad_fn(params, tokens, size, layout, logits)
        extra = {"max_logits": maxima} if clip else {}
        updates, state = tx.update(grads, state, params, **extra)
        # The max logits are an output (a user logs them): computed in every `+ logits` step.
        return optax.apply_updates(params, updates), state, (loss, maxima)

    state = jax.eval_shape(tx.init, params)
    c0, t0 = time.process_time(), time.perf_counter()
    compiled = jax.jit(step, donate_argnums=(0, 1)).trace(params, state, tokens).lower().compile()
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    return Measured(compiled, tx, wall, cpu, int(cost["bytes accessed"]), 0)


def forward_times(size: Size, layout: str, rounds: int) -> dict[str, list[float]]:
    """CPU (wall on a GPU) seconds a forward pass, with and without the helper, interleaved."""
    key = jax.random.key(0)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (size.batch, size.context + 1), 0, 256)
    params = init_params(key, size, layout)
    runs = {
        label: jax.jit(lambda p, x, logits=logits: loss_fn(p, x, size, layout, logits))
        for label, logits in (("forward", False), ("forward + logits", True))
    }
    for run in runs.values():
        jax.block_until_ready(run(params, tokens))
    clock = time.perf_counter if train_step.on_gpu() else time.process_time
    times: dict[str, list[float]] = {label: [] for label in runs}
    for r in range(rounds):
        for label in list(runs)[:: -1 if r % 2 else 1]:
            t0 = clock()
            for _ in range(size.steps):
                out = runs[label](params, tokens)
            jax.block_until_ready(out)
            times[label].append((clock() - t0) / size.steps)
    return times


def pair_ratios(
    reference: Measured, other: Measured, size: Size, layout: str, rounds: int, seconds: Any
) -> list[float]:
    """Per round, ``other``'s step seconds over ``reference``'s, the two timed alone."""
    pair = {
        "reference": dataclasses.replace(reference, step_s=[], step_cpu_s=[]),
        "other": dataclasses.replace(other, step_s=[], step_cpu_s=[]),
    }
    train_step.time_steps(pair, size, layout, rounds)
    reference.step_s += pair["reference"].step_s
    reference.step_cpu_s += pair["reference"].step_cpu_s
    other.step_s += pair["other"].step_s
    other.step_cpu_s += pair["other"].step_cpu_s
    return common.ratios(seconds(pair["other"]), seconds(pair["reference"]))


def section(layout: str, size: Size, rounds: int) -> tuple[str, dict[str, float]]:
    measured = {
        label: compile_one(tx, logits, clip, size, layout)
        for label, (tx, logits, clip) in configurations(size, layout).items()
    }
    for label, m in measured.items():
        common.log(f"  {layout} {label}: compile {m.wall_s:.1f} s")
    seconds = lambda m: m.step_s if train_step.on_gpu() else m.step_cpu_s
    figures: dict[str, float] = {}
    rows = []
    for name in OPTIMIZERS:
        base, with_logits, with_clip = (
            measured[name],
            measured[f"{name} + logits"],
            measured[f"{name} + qk_clip"],
        )
        # Each ratio is timed on its pair alone, interleaved: a shared machine's drift
        # within a round then falls on the two configurations it compares.
        helper = pair_ratios(base, with_logits, size, layout, rounds, seconds)
        transform = pair_ratios(with_logits, with_clip, size, layout, rounds, seconds)
        reference_bytes = {f"{name} + logits": base.bytes, f"{name} + qk_clip": with_logits.bytes}
        figures[f"{layout} {name} helper"] = common.median(helper)
        figures[f"{layout} {name} transform"] = common.median(transform)
        for label, m, ratio, of in (
            (name, base, None, ""),
            (f"{name} + logits", with_logits, helper, f"`{name}`"),
            (f"{name} + qk_clip", with_clip, transform, f"`{name} + logits`"),
        ):
            verdict = ""
            if label.endswith("qk_clip"):
                ok = common.median(ratio) <= TARGET
                verdict = f"≤ {TARGET:.2f}: {'met' if ok else '**missed**'}"
            rows.append(
                [
                    f"`{label}`",
                    f"{common.median(seconds(m)) * 1e3:.3g}",
                    "" if ratio is None else common.spread(ratio, "{:.3f}"),
                    of,
                    "" if ratio is None else f"{m.bytes / reference_bytes[label]:.4f}",
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
    basis = "wall" if train_step.on_gpu() else "CPU"
    header = ["configuration", f"step ms ({basis})", f"× reference ({basis})", "reference",
              "bytes × reference", "target", "compile s (CPU)", "bytes accessed"]  # fmt: skip
    text = f"## {layout.capitalize()} layers\n\n" + common.table(header, rows)
    return text, figures


def without_out(argv: list[str]) -> list[str]:
    """The arguments without ``--out DIR`` / ``--out=DIR`` (a path of the machine that ran it)."""
    shown, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--out":
            skip = True
        elif not arg.startswith("--out="):
            shown.append(arg)
    return shown


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=list(SIZES), default="cpu")
    parser.add_argument("--layouts", default=",".join(train_step.LAYOUTS))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: the size's)")
    parser.add_argument("--out", help="folder of the page (default benchmarks/)")
    args = parser.parse_args(argv)
    size = SIZES[args.size]
    rounds = args.rounds or size.rounds
    shown = " ".join(["python benchmarks/qk_clip_cost.py", *without_out(argv)])
    head = train_step.header(shown)
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
    folder = args.out or os.path.join(common.ROOT, "benchmarks")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "QK_CLIP_COST.md")
    sections, figures = [], {}
    for layout in args.layouts.split(","):
        text, found = section(layout, size, rounds)
        sections.append(text)
        figures.update(found)
        with open(path, "w") as f:
            f.write("\n\n".join(["\n".join(intro), *sections]) + "\n")
        common.log(f"wrote {path}")
    for key, value in figures.items():
        common.log(f"  {key}: {value:.3f}x")
    return figures


if __name__ == "__main__":
    main()
