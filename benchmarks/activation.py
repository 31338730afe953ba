"""What activation-gradient clipping costs a training step.

The whole step (loss, gradient with respect to the parameters and the statistics
carriers, ``optax.adamw``'s update and apply, params and optimizer state donated,
the statistics returned as ``clipjax.activation_metrics``) of
``benchmarks/train_step.py``'s byte-level transformer (its parameters, sizes and
interleaved timing; scanned layers, so each carrier is ``[layers, size]``), with
``clipjax.clip_activation_gradient`` applied in every layer, against the same step
without it:

* ``zero_k4_block``: ``k=4, mode="zero"`` on each block's output (the residual
  stream after the block), one call a layer;
* ``zero_k4_sublayers``: the same after the attention's and after the MLP's
  residual add, two calls a layer (where AXLearn's monitored attention and
  feed-forward layers put it);
* ``clip_k4_block``: ``k=4, mode="clip"`` on each block's output;
* ``monitor_block``: ``k=0`` with AXLearn's percentiles (50, 99.9, 99.99, 99.999)
  on each block's output: a sort of the token norms a layer.

Per row: XLA's ``cost_analysis()`` bytes accessed of the compiled step over the
step without it (repeatable), and the step's CPU time over it (median over
rounds, each round both steps interleaved, alone). ``--sizes cpu,gpu`` also
compiles the GPU-sized model here for its bytes (not timed on a CPU).

    python benchmarks/activation.py                     # --sizes cpu
    python benchmarks/activation.py --sizes cpu,gpu
    python benchmarks/activation.py --sizes tiny --rounds 1 --out /tmp/a   # a smoke test

Writes ``benchmarks/ACTIVATION.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from typing import Any

import common
import jax
import jax.numpy as jnp
import optax
import train_step
from train_step import SIZES, Size

import clipjax

TARGET = 1.05  # issue 52: at most this times the step without it
AXLEARN_PERCENTILES = (50, 99.9, 99.99, 99.999)


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where the function goes and how it is called."""

    placement: str  # "block": each block's output; "sublayers": after attention and MLP
    k: int
    mode: str = "zero"
    percentiles: tuple[float, ...] = ()

    @property
    def sites(self) -> tuple[str, ...]:
        return ("block",) if self.placement == "block" else ("attn", "mlp")

    def code(self) -> str:
        extra = f", percentiles={self.percentiles}" if self.percentiles else ""
        return f'clip_activation_gradient(y, stats, k={self.k}, mode="{self.mode}"{extra})'


BASE = "none"
ROWS: dict[str, Setting | None] = {
    BASE: None,
    "zero_k4_block": Setting("block", 4),
    "zero_k4_sublayers": Setting("sublayers", 4),
    "clip_k4_block": Setting("block", 4, "clip"),
    "monitor_block": Setting("block", 0, percentiles=AXLEARN_PERCENTILES),
}


def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def loss_fn(
    params: dict[str, Any], stats: dict[str, Any], tokens: jax.Array, size: Size,
    setting: Setting | None,
) -> jax.Array:  # fmt: skip
    """``train_step.loss_fn``'s model (scanned layers) with the function at ``setting``'s
    sites, each given its row of the stacked carrier ``stats[site]``."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    h, dh, mm = size.heads, size.d // size.heads, size.matmul

    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(mm), w.astype(mm), preferred_element_type=jnp.float32)

    dense = lambda x, p: matmul(x, p["kernel"]) + p["bias"]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def clip(y: jax.Array, s: dict[str, Any], site: str) -> jax.Array:
        if setting is None or site not in setting.sites:
            return y
        return clipjax.clip_activation_gradient(
            y, s[site], k=setting.k, mode=setting.mode, percentiles=setting.percentiles
        )

    def block(x: jax.Array, layer: tuple[Any, Any]) -> tuple[jax.Array, None]:
        p, s = layer
        q, k, v = jnp.split(dense(layer_norm(x, p["ln1"]), p["attn"]["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh).astype(mm) for a in (q, k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        att = jax.nn.softmax(jnp.where(causal, scores / math.sqrt(dh), -1e30), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", att.astype(mm), v, preferred_element_type=jnp.float32)
        x = clip(x + dense(mixed.reshape(b, t, -1), p["attn"]["out"]), s, "attn")
        y = jax.nn.gelu(dense(layer_norm(x, p["ln2"]), p["mlp"]["fc1"]))
        x = clip(x + dense(y, p["mlp"]["fc2"]), s, "mlp")
        return clip(x, s, "block"), None

    x = params["embed"][inputs] + params["pos"][:t]
    x, _ = jax.lax.scan(block, x, (params["layers"], stats))
    out = matmul(layer_norm(x, params["ln_f"]), params["embed"].T)
    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean()


def carriers(setting: Setting | None, size: Size) -> dict[str, Any]:
    if setting is None:
        return {}
    make = lambda: clipjax.activation_stats_init(
        k=setting.k, percentiles=setting.percentiles, layers=size.layers
    )
    return {site: make() for site in setting.sites}


def compile_row(setting: Setting | None, size: Size) -> common.Compiled:
    """The whole step, compiled anew after ``jax.clear_caches()``."""
    jax.clear_caches()
    tx = optax.adamw(1e-3)
    params, tokens = train_step.model_shapes(size, "scanned")

    def step(params: Any, state: Any, stats: Any, tokens: jax.Array) -> Any:
        grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1))
        loss, (grads, stats_grads) = grad_fn(params, stats, tokens, size, setting)
        updates, state = tx.update(grads, state, params)
        metrics = clipjax.activation_metrics(stats_grads) if setting else {}
        return optax.apply_updates(params, updates), state, loss, metrics

    state = jax.eval_shape(tx.init, params)
    return common.compile_jit(step, params, state, carriers(setting, size), tokens, tx=tx)


def time_pair(
    base: common.Compiled, other: common.Compiled, setting: Setting, size: Size, rounds: int
) -> tuple[list[float], list[float]]:
    """Seconds a step of each (``train_step.basis()``: CPU on a CPU), interleaved over
    ``rounds`` rounds of ``size.steps`` steps."""
    params, tokens = train_step.inputs(size, "scanned")
    runs = {
        BASE: common.Runner(base.run, params, base.tx.init(params), {}, tokens).run,
        "other": common.Runner(
            other.run, params, other.tx.init(params), carriers(setting, size), tokens
        ).run,
    }
    times = train_step.seconds(*common.interleave(runs, rounds, size.steps, warm=2))
    return times[BASE], times["other"]


def section(size_name: str, rounds: int, timed: bool) -> tuple[str, dict[str, float]]:
    size = SIZES[size_name]
    measured = {}
    for name, setting in ROWS.items():
        measured[name] = compile_row(setting, size)
        common.log(f"  {size_name} {name}: compile {measured[name].wall_s:.1f} s, "
                   f"{measured[name].bytes} bytes")  # fmt: skip
    base = measured[BASE]
    figures: dict[str, float] = {}
    # Each row timed against `none` alone, interleaved, so that a shared machine's drift
    # within a round falls on the two steps it compares.
    times: dict[str, tuple[list[float], list[float]]] = {}
    for name, setting in ROWS.items():
        if timed and setting is not None:
            times[name] = time_pair(base, measured[name], setting, size, rounds)
    plain_times = [t for pair in times.values() for t in pair[0]]
    rows = []
    for name, setting in ROWS.items():
        m = measured[name]
        calls = "" if setting is None else f"{len(setting.sites) * size.layers}"
        code = "" if setting is None else f"`{setting.code()}`"
        ratio_bytes = "" if setting is None else f"{m.bytes / base.bytes:.4f}"
        cells = [f"`{name}`", code, calls, f"{m.bytes:d}", ratio_bytes]
        if setting is not None:
            figures[f"{size_name} {name} bytes"] = m.bytes / base.bytes
        if timed and setting is None:
            cells += [f"{common.median(plain_times) * 1e3:.3g}", "", ""]
        elif timed:
            plain, other = times[name]
            ratio = common.ratios(other, plain)
            figures[f"{size_name} {name} step"] = common.median(ratio)
            cells += [f"{common.median(other) * 1e3:.3g}", common.spread(ratio, "{:.3f}"),
                      f"{min(other) / min(plain):.3f}"]  # fmt: skip
        rows.append(cells)
    basis = train_step.basis()
    head = ["row", "call at each site", "calls a step", "bytes accessed", "bytes × none"]
    if timed:
        head += [f"step ms ({basis})", f"step × none ({basis})", f"fastest × none ({basis})"]
    about = (
        f"`--size {size_name}`: {size.layers} layers, d_model {size.d}, {size.heads} heads, "
        f"batch {size.batch} x {size.context} bytes ({size.batch * size.context} tokens a "
        f"call), {jnp.dtype(size.matmul).name} matmul inputs, scanned layers."
    )
    if not timed:
        about += " Bytes only: not timed on this machine."
    return f"## Size {size_name}\n\n{about}\n\n" + common.table(head, rows), figures


def main(argv: list[str] | None = None) -> dict[str, float]:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="cpu", help="comma-separated, from " + ", ".join(SIZES))
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: the size's)")
    parser.add_argument("--out", help="folder of the page (default benchmarks/)")
    args = parser.parse_args(argv)
    names = args.sizes.split(",")
    if set(names) - set(SIZES):
        raise SystemExit(f"unknown sizes {sorted(set(names) - set(SIZES))}")
    head = common.header(common.command("activation.py", argv), numpy=True)
    about = (
        "`benchmarks/train_step.py`'s model and sizes: one `jax.jit` of the loss, its "
        "gradient with respect to the parameters and the statistics carriers, "
        "`optax.adamw(1e-3)`'s update and apply (params and optimizer state donated) and "
        "`clipjax.activation_metrics` of the carriers' gradient, with the call at each site "
        "of every layer, against the same step without it (`none`). *bytes × none*: XLA's "
        "`cost_analysis()` bytes accessed over `none`'s (repeatable). *step × none*: median "
        f"[25th–75th percentile] over rounds of the step's {train_step.basis()} seconds over "
        "`none`'s in the same round, each row timed with `none` alone, interleaved (the "
        "size's rounds of its steps, or `--rounds`); *step ms*: the median; *fastest × "
        "none*: the fastest round's step over `none`'s fastest (the rounds least slowed by "
        f"other jobs on a shared machine). The issue's target: at most {TARGET}x the step "
        "without it."
    )
    path = common.page_path(args.out, "ACTIVATION.md")
    sections, figures = [], {}
    for name in names:
        rounds = args.rounds or SIZES[name].rounds
        text, found = section(name, rounds, timed=name != "gpu" or train_step.on_gpu())
        sections.append(text)
        figures.update(found)
        end = f"* **load average at end**: {common.load_average()}"
        intro = ["# What activation-gradient clipping costs a training step", "", *head, end]
        common.write(path, common.page(intro, about, *sections))
    for key, value in figures.items():
        common.log(f"  {key}: {value:.4f}x")
    return figures


if __name__ == "__main__":
    main()
