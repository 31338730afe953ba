"""What a user pays per training step: the whole step of a byte-level transformer LM.

One jitted function computes the loss and its gradient, runs the optimizer's
``update`` and ``apply_updates``, with params and optimizer state donated:
the step a user compiles and runs. The model is a GPT-style causal
transformer over bytes in plain JAX, in two layouts:

* ``unscanned``: each layer its own 12 leaves (``params["layers"][k]``);
* ``scanned``: the same layers stacked along a leading axis
  (``params["layers"]``) and run under ``jax.lax.scan``; the clippers' layer
  and tensor scopes are ``clipjax.stacked(...)``, so their groups are the
  unscanned model's.

Every row is a clipjax transform in front of or around an optimizer, each
against its optax counterpart; the counterparts are rows of their own. Per
configuration: step time, timed interleaved (in each round every
configuration runs the same number of steps, in an order that rotates and
reverses; the step ms is the median over rounds, the ratio the median over
rounds of the ratio to the counterpart's time in the same round), the
compile time of the whole step (trace + lower + compile after
``jax.clear_caches()``), XLA's ``cost_analysis()`` bytes accessed and the
full-size ``copy`` ops in the compiled HLO.

    python benchmarks/train_step.py                  # --size gpu on a GPU, else --size cpu
    python benchmarks/train_step.py --size gpu --out "$OUT" --budget 140
    python benchmarks/train_step.py --rows recommended,spam --layouts scanned --rounds 3

Writes ``benchmarks/TRAIN_STEP.md`` on a CPU and ``benchmarks/TRAIN_STEP_GPU.md``
on a GPU (``--out DIR`` puts it in DIR). The page is rewritten after each
layout, so a run stopped by a time limit leaves the layouts it finished.
``--size cpu`` (every row, both layouts, each step compiled twice) took 19
minutes on 2 cores shared with others' runs (load average 3 to 8); ``--size
gpu`` measures a few rows by default (``GPU_ROWS``), sized for
``benchmarks/device.sh``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import common
import follow
import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

LAYOUTS = ("unscanned", "scanned")
# The step-time targets over the counterpart (issue 38), and the compile target.
GLOBAL = 1.01  # the recommended setting, skip_on_spike around it, every global clipper
WIDER = 1.05  # AGC, per-layer and per-tensor scopes, the SPAM family
COMPILE = 1.10


@dataclasses.dataclass(frozen=True)
class Size:
    """The model, the matmul precision and the timing of one ``--size``."""

    layers: int
    d: int
    heads: int
    context: int
    batch: int
    matmul: Any  # dtype of the matmul inputs (accumulated in float32)
    rounds: int
    steps: int  # steps each configuration runs in a round
    compiles: int  # compiles of each configuration (best of), in alternating order
    rows: dict[str, tuple[str, ...]]  # the default rows of each layout (counterparts added)


ALL = "all"
# On a GPU the unscanned 24-layer step compiled in 25-42 s per configuration (one H200,
# 2026-11-26): there the default rows are few, the unscanned layout (the compile-heavy one)
# first, and device.sh passes --budget so that a run that is slower still writes its page.
GPU_ROWS = {
    "unscanned": ("recommended", "skip_recommended"),
    "scanned": (
        "recommended",
        "skip_recommended",
        "optax_adamw",
        "stable_spam",
        "zclip_per_layer",
        "agc",
    ),
}
# --size cpu has 8 layers (100 leaves in the unscanned layout), not 24: XLA:CPU's compile
# of the unscanned step grows faster than the layer count (on 2 cores about 5 s at 8
# layers, 18 s at 16 and 45 s at 24 for the loss and gradient alone), and the page compiles
# some fifty steps.
SIZES = {
    "cpu": Size(8, 64, 4, 32, 8, jnp.float32, 11, 8, 2, {"unscanned": (ALL,), "scanned": (ALL,)}),
    "gpu": Size(24, 512, 8, 512, 16, jnp.bfloat16, 7, 10, 1, GPU_ROWS),
    # The smoke test's model (tests/release/test_benchmarks.py): seconds, figures mean nothing.
    "tiny": Size(2, 16, 2, 8, 2, jnp.float32, 1, 2, 1, {"unscanned": (ALL,), "scanned": (ALL,)}),
}


# ----------------------------------------------------------------------------- model


def init_params(key: jax.Array, size: Size, layout: str) -> dict[str, Any]:
    """Embedding (tied to the output), positions, ``size.layers`` pre-LN blocks, final norm."""
    d, n = size.d, size.layers
    keys = iter(jax.random.split(key, 2 + 4 * n))
    normal = lambda *shape: 0.02 * jax.random.normal(next(keys), shape)
    dense = lambda n_in, n_out: {"kernel": normal(n_in, n_out), "bias": jnp.zeros(n_out)}
    norm = lambda: {"scale": jnp.ones(d), "bias": jnp.zeros(d)}

    def block() -> dict[str, Any]:
        attn = {"qkv": dense(d, 3 * d), "out": dense(d, d)}
        mlp = {"fc1": dense(d, 4 * d), "fc2": dense(4 * d, d)}
        return {"ln1": norm(), "attn": attn, "ln2": norm(), "mlp": mlp}

    blocks = [block() for _ in range(n)]
    layers = jax.tree.map(lambda *x: jnp.stack(x), *blocks) if layout == "scanned" else blocks
    embed, pos = normal(256, d), normal(size.context, d)
    return {"embed": embed, "pos": pos, "layers": layers, "ln_f": norm()}


def _norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def loss_fn(
    params: dict[str, Any], tokens: jax.Array, size: Size, layout: str, logits: bool = False
) -> tuple[jax.Array, jax.Array | None]:
    """Mean next-byte cross-entropy of ``tokens`` [batch, context + 1]; and where ``logits``,
    ``clipjax.max_attention_logits`` of each layer (``[layers, heads]``), else None."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    b, t = inputs.shape
    h, dh = size.heads, size.d // size.heads
    mm = size.matmul

    def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
        return jnp.matmul(x.astype(mm), w.astype(mm), preferred_element_type=jnp.float32)

    dense = lambda x, p: matmul(x, p["kernel"]) + p["bias"]
    causal = jnp.tril(jnp.ones((t, t), bool))

    def block(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, jax.Array | None]:
        q, k, v = jnp.split(dense(_norm(x, p["ln1"]), p["attn"]["qkv"]), 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh).astype(mm) for a in (q, k, v))
        s = clipjax.max_attention_logits(q, k, causal=True) if logits else None
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        att = jax.nn.softmax(jnp.where(causal, scores / math.sqrt(dh), -1e30), axis=-1)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", att.astype(mm), v, preferred_element_type=jnp.float32)
        x = x + dense(mixed.reshape(b, t, -1), p["attn"]["out"])
        y = jax.nn.gelu(dense(_norm(x, p["ln2"]), p["mlp"]["fc1"]))
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
    out = matmul(_norm(x, params["ln_f"]), params["embed"].T)
    return optax.softmax_cross_entropy_with_integer_labels(out, targets).mean(), maxima


# ----------------------------------------------------------------------------- rows


@dataclasses.dataclass(frozen=True)
class Row:
    """A configuration: the code that builds it, its counterpart and its step-time target.

    ``code`` is evaluated with ``clipjax`` and ``optax`` in scope, after
    ``{per_layer}`` and ``{per_param}`` are replaced by the layout's scope
    (``clipjax.stacked(...)`` in the scanned layout). ``value``: the step
    passes the loss, ``update(..., value=loss)``. ``needs``: what it computes
    beyond its counterpart, printed when it misses a target.
    """

    code: str
    base: str | None = None
    target: float = GLOBAL
    value: bool = False
    needs: str = ""


BASELINE = "optax_clip"
_SCALAR = "scalar work on the norm: "
_EMA = _SCALAR + "its EMA mean and variance, the warm-up and the metrics"


def rows() -> dict[str, Row]:
    """Every row, counterparts first; the recommended setting read from its one source."""
    rec = follow.recommended()
    adamw = "optax.adamw(1e-3)"
    plus = lambda clipper: f"optax.chain({clipper}, {adamw})"
    return {
        BASELINE: Row(plus("optax.clip_by_global_norm(1.0)")),
        "optax_adamw": Row(adamw),
        "optax_agc": Row(plus("optax.adaptive_grad_clip(0.01)")),
        "optax_clip_value": Row(plus("optax.clip(1.0)")),
        "recommended": Row(
            f"clipjax.chain({rec}, clipjax.adamw(1e-3))",
            BASELINE,
            needs=_EMA + " (the recommended setting), and adamw's skip of a held step folded "
            "into its loops as selects",
        ),
        "recommended_optax_chain": Row(
            plus(rec), BASELINE, needs=_EMA + " (the recommended clipper in optax.chain)"
        ),
        "skip_recommended": Row(
            f"clipjax.skip_on_spike(clipjax.chain({rec}, clipjax.adamw(1e-3)))",
            BASELINE,
            value=True,
            needs="the recommended clipper, the skip test on the loss and the gradient norm "
            "(their histories), and the skip folded into adam's loops as selects",
        ),
        "clip_by_global_norm": Row(
            plus("clipjax.clip_by_global_norm(1.0)"),
            BASELINE,
            needs="nothing a leaf: the same sum of squares, and the scale in one multiply",
        ),
        "zclip": Row(plus("clipjax.zclip()"), BASELINE, needs=_EMA),
        "zscore_clip": Row(plus("clipjax.zscore_clip()"), BASELINE, needs=_EMA),
        "autoclip": Row(
            plus("clipjax.autoclip()"),
            BASELINE,
            needs=_SCALAR + "the P² median estimator of the norm history (a loop over its "
            "markers and sorts of them)",
        ),
        "hist_clip": Row(
            plus("clipjax.hist_clip()"),
            BASELINE,
            needs=_SCALAR + "the statistics of the warm-up sample and the warm-up clip nested "
            "in the state",
        ),
        "adagc_global": Row(
            plus('clipjax.adagc(scope="global")'),
            BASELINE,
            needs=_SCALAR + "its EMA and the metrics",
        ),
        "adagc": Row(
            plus("clipjax.adagc(scope={per_param})"),
            BASELINE,
            WIDER,
            needs="a norm a tensor (the same sum a leaf), the EMA of each and the metrics of "
            "the `[groups]` arrays; each leaf scaled by its own scalar",
        ),
        "zclip_per_layer": Row(
            plus("clipjax.zclip(scope={per_layer})"),
            BASELINE,
            WIDER,
            needs="a norm a layer group (the same sum a leaf, then a segment sum), the EMA "
            "statistics and metrics of the `[groups]` arrays; each leaf scaled by its group's "
            "scalar",
        ),
        "agc": Row(
            plus("clipjax.agc(0.01)"),
            "optax_agc",
            WIDER,
            needs="the metrics: each leaf's norms and clipped fraction from the unit norms, "
            "one reduction over each stack of same-size leaves",
        ),
        "spam": Row(
            "clipjax.spam(1e-3, weight_decay=1e-4)",
            "optax_adamw",
            WIDER,
            needs="the spike test (`g**2 > threshold * v`) and the periodic reset in both "
            "moment loops, and two counts a leaf for the metrics",
        ),
        "stable_spam": Row(
            "clipjax.stable_spam(1e-3, weight_decay=1e-4, scope={per_param})",
            "optax_adamw",
            WIDER,
            needs="AdaClip's max a tensor, its clipped count and squares, then AdaGN's norm "
            "of the clipped gradient: three reductions a leaf, each waiting for the one "
            "before, where adamw has none; and the moment reset",
        ),
        "stable_adamw": Row(
            "clipjax.adamw(1e-3, update_clipping=True)",
            "optax_adamw",
            WIDER,
            needs="one sum a leaf after the moments (the RMS of `g**2 / max(v_hat, eps**2)`) "
            "and each leaf's divisor in the update's loop",
        ),
        "clip_by_value": Row(
            plus("clipjax.clip_by_value(1.0)"),
            "optax_clip_value",
            needs="one two-output reduce a leaf (the norm and the clipped count, for the "
            "metrics), where `optax.clip` reduces nothing",
        ),
        # Per-tensor transforms that take no stacked scope: in the scanned layout a
        # tensor is a whole stacked leaf.
        "clip_by_percentile": Row(
            plus("clipjax.clip_by_percentile(99.0)"),
            BASELINE,
            WIDER,
            needs="an order statistic a tensor: a sort of each (or the radix histogram's "
            "passes for large ones)",
        ),
        "normalize_per_param": Row(
            plus("clipjax.normalize_per_param()"),
            BASELINE,
            WIDER,
            needs="a norm a tensor (the same sum a leaf), each leaf scaled by its own scalar",
        ),
        "zscore_normalize": Row(
            plus("clipjax.zscore_normalize()"),
            BASELINE,
            WIDER,
            needs="two two-output reduces a leaf (the corrected two-pass mean and deviation), "
            "where the counterpart has one sum",
        ),
        "adaclip": Row(
            plus("clipjax.adaclip(scope={per_param})"),
            BASELINE,
            WIDER,
            needs="the max of each tensor, then a two-output reduce (the clipped count and "
            "the squares): two reductions a leaf, the second waiting for the first",
        ),
        "ada_norm": Row(
            plus("clipjax.ada_norm(scope={per_param})"),
            BASELINE,
            WIDER,
            needs="a norm a tensor, the EMAs of it and of its square and the metrics of the "
            "`[groups]` arrays; each leaf scaled by its own scalar",
        ),
        # docs/defences.md: AXLearn, torchzero, AdamWClip, Levanter.
        "skip_and_clip": Row(
            "clipjax.skip_and_clip_by_global_norm(clipjax.adamw(1e-3), "
            "drop_norm=clipjax.drop_norm_by_grad_norm_stddev(), max_norm=1.0, "
            "grad_norm_ema_decay=0.99)",
            BASELINE,
            needs="the EMAs of the global norm and the drop test, the clip's multiply and the "
            "skip folded into adam's loops as selects",
        ),
        "clip_norm_growth": Row(
            plus('clipjax.clip_norm_growth(scope="global")'),
            BASELINE,
            needs=_SCALAR + "the previous norm and the metrics",
        ),
        "clip_norm_growth_per_param": Row(
            plus("clipjax.clip_norm_growth(scope={per_param})"),
            BASELINE,
            WIDER,
            needs="a norm a tensor, its previous norm and the metrics of the `[groups]` arrays; "
            "each leaf scaled by its own scalar",
        ),
        "clip_norm_by_ema": Row(
            plus("clipjax.clip_norm_by_ema(scope={per_param})"),
            BASELINE,
            WIDER,
            needs="a float32 EMA of the updates (one more read and write of a parameter-size "
            "buffer) and its norm a tensor, then the cap's multiply of it",
        ),
        "adamw_clip": Row(
            "clipjax.adamw(1e-3, clip_grad_adapt=3.0)",
            "optax_adamw",
            WIDER,
            needs="the threshold from v and the clamp in adam's loops, and one two-output "
            "reduce a leaf (the norm and the clipped count, for the metrics) that the "
            "moments' loop waits for",
        ),
        "clip_by_historical_norm": Row(
            plus("clipjax.clip_by_historical_norm()"),
            BASELINE,
            needs=_SCALAR + "the mean and std of its 128-norm window and the metrics",
        ),
        # docs/defences.md, issue 52: the stability score (target 1.005) and the spectral
        # transforms (no target: their cost is reported against the optimizer alone).
        "stability_monitor": Row(
            f"optax.chain(clipjax.stability_monitor(), {adamw})",
            "optax_adamw",
            1.005,
            value=True,
            needs="the global norm's sum of squares a leaf, and the two 128-value windows",
        ),
        "spectra": Row(
            "optax.chain(optax.scale_by_adam(), clipjax.spectra(1.0, matrices={matrices}), "
            "optax.add_decayed_weights(1e-4), optax.scale_by_learning_rate(1e-3))",
            "optax_adamw",
            math.inf,
            needs="10 coupled Newton-Schulz steps on the Gram matrix of each matrix's short side",
        ),
        "spectral_clip": Row(
            plus('clipjax.spectral_clip(rule="ema", matrices={vectors})'),
            BASELINE,
            math.inf,
            needs="an exact SVD of every matrix and vector, one after another",
        ),
    }


def code(row: Row, layout: str) -> str:
    """The row's code as it runs in ``layout``."""
    text = row.code
    for scope in ("per_layer", "per_param"):
        shown = f'clipjax.stacked("{scope}")' if layout == "scanned" else f'"{scope}"'
        text = text.replace("{" + scope + "}", shown)
    # What a matrix is for the spectral transforms: each layer's slice of a stacked leaf;
    # a stacked vector is left ({matrices}) or read as one vector a layer ({vectors}).
    stacked = layout == "scanned"
    text = text.replace(
        "{matrices}",
        "lambda name, shape: (-2, -1) if len(shape) == 3 else None"
        if stacked
        else "lambda name, shape: (0, 1)",
    )
    text = text.replace(
        "{vectors}",
        "lambda name, shape: (-2, -1) if len(shape) == 3 else ((-1,), ())"
        if stacked
        else "lambda name, shape: (0, 1)",
    )
    return text


def build(row: Row, layout: str) -> optax.GradientTransformation:
    return eval(code(row, layout), {"clipjax": clipjax, "optax": optax})


def selected(names: Sequence[str], table: dict[str, Row]) -> list[str]:
    """``names`` (or every row, for ``all``) in their order, each after its counterpart."""
    if ALL in names:
        names = list(table)
    unknown = set(names) - set(table)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; choose from {', '.join(table)}")
    out: list[str] = []
    for name in names:
        base = table[name].base
        out += [n for n in (base, name) if n is not None and n not in out]
    return out


# ----------------------------------------------------------------------------- measuring


def model_shapes(size: Size, layout: str) -> tuple[Any, Any]:
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), size, layout))
    tokens = jax.ShapeDtypeStruct((size.batch, size.context + 1), jnp.int32)
    return params, tokens


def compile_step(
    make: Callable[[], optax.GradientTransformation],
    size: Size,
    layout: str,
    *,
    value: bool = False,
    logits: bool = False,
    clip: bool = False,
) -> common.Compiled:
    """The whole step of ``make()`` in ``layout``, compiled anew after ``jax.clear_caches()``.

    ``value``: the step passes the loss, ``update(..., value=loss)``; ``logits``: the
    loss computes the max attention logits of each layer (an output of the step, as a user
    logs them); ``clip``: the step passes them, ``update(..., max_logits=...)``.
    """
    jax.clear_caches()
    tx = make()
    params, tokens = model_shapes(size, layout)

    def step(params: Any, state: Any, tokens: jax.Array) -> Any:
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        (loss, maxima), grads = grad_fn(params, tokens, size, layout, logits)
        extra = {"value": loss} if value else {}
        if clip:
            extra["max_logits"] = maxima
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state, (loss, maxima)

    return common.compile_jit(step, params, jax.eval_shape(tx.init, params), tokens, tx=tx)


def compile_all(
    chosen: list[str], table: dict[str, Row], layout: str, size: Size, deadline: float | None
) -> tuple[dict[str, common.Compiled], list[str]]:
    """Each configuration compiled ``size.compiles`` times, forward then backward through
    ``chosen``, its best wall and CPU seconds kept; and those left out by the ``deadline``
    (a ``time.perf_counter()`` after which nothing more is compiled)."""

    def compile_row(label: str) -> common.Compiled:
        row = table[label]
        m = compile_step(lambda: build(row, layout), size, layout, value=row.value)
        common.log(f"  {label}: compile {m.wall_s:.1f} s, {m.bytes} bytes, {m.copies} copies")
        return m

    compiles = {label: lambda label=label: compile_row(label) for label in chosen}
    measured = common.best_of(compiles, size.compiles, deadline)
    return measured, [label for label in chosen if label not in measured]


def compile_model(size: Size, layout: str) -> tuple[float, float]:
    """(wall, CPU) seconds to compile the loss and its gradient alone.

    Measured first in each layout: on a GPU this compile also autotunes the
    matmuls, whose results the configurations' compiles then reuse alike.
    """
    jax.clear_caches()
    grad = jax.value_and_grad(lambda p, x: loss_fn(p, x, size, layout)[0])
    m = common.compile_jit(grad, *model_shapes(size, layout), donate=())
    return m.wall_s, m.cpu_s


def inputs(size: Size, layout: str) -> tuple[dict[str, Any], jax.Array]:
    """The params and a batch of tokens the steps are timed on."""
    key = jax.random.key(0)
    tokens = jax.random.randint(jax.random.fold_in(key, 1), (size.batch, size.context + 1), 0, 256)
    return init_params(key, size, layout), tokens


def time_steps(
    measured: dict[str, common.Compiled], size: Size, layout: str, rounds: int
) -> tuple[common.Times, common.Times]:
    """Wall and CPU seconds a step of each configuration, one a round: ``rounds``
    interleaved rounds of ``size.steps`` steps (after 2 of each)."""
    params, tokens = inputs(size, layout)
    # Each configuration its own buffers (they are donated).
    runs = {
        label: common.Runner(m.run, params, m.tx.init(params), tokens).run
        for label, m in measured.items()
    }
    return common.interleave(runs, rounds, size.steps, warm=2)


# ----------------------------------------------------------------------------- the page


@dataclasses.dataclass
class Layout:
    """The measurements of one layout, as the page shows them."""

    name: str
    leaves: int
    parameters: int
    model_s: tuple[float, float]
    measured: dict[str, common.Compiled]
    wall: common.Times  # step seconds, one a round
    cpu: common.Times
    left_out: list[str]


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def basis() -> str:
    """The seconds the ratios are taken on: wall on a GPU, the process's CPU seconds on a
    CPU (on a shared machine others' load inflates wall times unevenly)."""
    return "wall" if on_gpu() else "CPU"


def seconds(wall: Any, cpu: Any) -> Any:
    """Of the two, the figure on ``basis()``."""
    return wall if on_gpu() else cpu


def step_ratios(layout: Layout, name: str, base: str) -> list[float]:
    """Per round, ``name``'s step seconds over ``base``'s (on ``basis()``)."""
    times = seconds(layout.wall, layout.cpu)
    return common.ratios(times[name], times[base])


def verdicts(layout: Layout, table: dict[str, Row]) -> dict[str, tuple[float, float, bool, bool]]:
    """Per clipjax row: (step ratio, compile ratio, step target met, compile target met)."""
    out = {}
    for name, m in layout.measured.items():
        base = table[name].base
        if base is None or base not in layout.measured:
            continue
        b = layout.measured[base]
        step = common.median(step_ratios(layout, name, base))
        comp = seconds(m.wall_s, m.cpu_s) / seconds(b.wall_s, b.cpu_s)
        out[name] = (step, comp, step <= table[name].target, comp <= COMPILE)
    return out


def layout_section(layout: Layout, table: dict[str, Row]) -> str:
    judged = verdicts(layout, table)
    bold = lambda text, ok: text if ok else f"**{text}**"
    lines = []
    for name, m in layout.measured.items():
        row = table[name]
        step, comp, step_ok, comp_ok = judged.get(name, (None, None, True, True))
        lines.append(
            [
                f"`{name}`",
                f"`{code(row, layout.name)}`",
                f"`{row.base}`" if row.base else "",
                f"{common.median(layout.wall[name]) * 1e3:.3g}",
                *([] if on_gpu() else [f"{common.median(layout.cpu[name]) * 1e3:.3g}"]),
                ""
                if step is None
                else bold(common.spread(step_ratios(layout, name, row.base), "{:.3f}"), step_ok),
                ""
                if row.base is None
                else "none (reported)"
                if math.isinf(row.target)
                else f"≤ {row.target:g}",
                f"{m.wall_s:.2f}",
                f"{m.cpu_s:.2f}",
                "" if comp is None else bold(f"{comp:.2f}", comp_ok),
                f"{m.bytes:d}",
                f"{m.copies:d}",
            ]
        )
    header = [
        "row",
        "configuration",
        "counterpart",
        "step ms" if on_gpu() else "step ms (wall)",
        *([] if on_gpu() else ["step ms (CPU)"]),
        f"× counterpart ({basis()})",
        "target",
        "compile s (wall)",
        "compile s (CPU)",
        f"compile × counterpart ({basis()})",
        "bytes accessed",
        "full-size copies",
    ]
    text = [
        f"## {layout.name.capitalize()} layers",
        "",
        f"{layout.parameters / 1e6:.3g}M parameters in {layout.leaves} leaves. The loss and its "
        f"gradient alone compile in {layout.model_s[0]:.2f} s wall, {layout.model_s[1]:.2f} s "
        "CPU (the layout's first compile, which on a GPU also autotunes the matmuls).",
        "",
        common.table(header, lines),
    ]
    if layout.left_out:
        text += ["", f"Left out (time budget): {', '.join(f'`{n}`' for n in layout.left_out)}."]
    missed = [n for n, (_, _, s, c) in judged.items() if not (s and c)]
    if missed:
        text += ["", "What the rows that miss a target compute beyond their counterpart:", ""]
        text += [f"* `{n}`: {table[n].needs}." for n in missed]
    return "\n".join(text)


def page(
    head: list[str], size_name: str, layouts: list[Layout], table: dict[str, Row], rounds: int
) -> str:
    size = SIZES[size_name]
    head = [*head, f"* **load average at end**: {common.load_average()}"]
    mm = jnp.dtype(size.matmul).name
    intro = [
        "# What a user pays per training step",
        "",
        *head,
        "",
        f"The whole training step of a GPT-style byte-level language model in plain JAX "
        f"(`--size {size_name}`: {size.layers} pre-LN layers, d_model {size.d}, {size.heads} "
        f"heads, batch {size.batch} x {size.context} bytes, embedding tied to the output, "
        f"{mm} matmul inputs accumulated in float32, float32 parameters): one `jax.jit` of "
        "loss, gradient, `update` and `optax.apply_updates`, params and optimizer state "
        "donated. *Unscanned*: each layer has its own 12 leaves; *scanned*: the layers are "
        "stacked along a leading axis and run under `jax.lax.scan`, and the clippers' "
        '`"per_layer"` / `"per_param"` scopes are `clipjax.stacked(...)`. AGC is unitwise '
        "with optax's axis rule in both layouts (in the scanned one a unit spans the layer "
        "axis, as optax's does); `clip_by_percentile`, `normalize_per_param` and "
        "`zscore_normalize` take no stacked scope, and a tensor of theirs is a whole stacked "
        "leaf.",
        "",
        f"*step ms*: median over {rounds} interleaved rounds of {size.steps} steps (every "
        "configuration of the layout runs in each round, in an order that rotates and "
        "reverses)"
        + ("" if on_gpu() else ", in wall and in the process's CPU milliseconds a step")
        + ". *× counterpart*: median [25th–75th percentile] over rounds of the step "
        "time over the counterpart's in the same round. *compile s*: trace + lower + "
        "compile of the whole step after `jax.clear_caches()`, "
        + (
            "once per configuration, in the table's order"
            if size.compiles == 1
            else f"best of {size.compiles} (the configurations compiled in turn, in the "
            "table's order then in reverse)"
        )
        + ", in wall seconds and in the process's CPU seconds (all threads). Both ratios "
        f"are on {basis()} seconds ("
        + (
            "the machine is a GPU host of its own; a step's work is on the GPU, and a "
            "compile there waits on the autotuning of kernels, which CPU seconds miss)"
            if on_gpu()
            else "the machine is shared, and others' load inflates wall times unevenly "
            "between configurations)"
        )
        + ". *bytes accessed*: XLA's `cost_analysis()` of the compiled step (repeatable). "
        "*full-size copies*: `copy` ops in the compiled HLO whose shape is a parameter's "
        "(`benchmarks/common.py` `full_size_copies`). Bold: a missed target.",
        "",
        f"Targets: step time ≤ {GLOBAL:.2f}× the counterpart for the recommended setting, "
        f"`skip_on_spike` around `clipjax.chain(..., clipjax.adamw)` and every global clipper "
        f"(and `clip_by_value`); ≤ {WIDER:.2f}× for AGC, per-layer and per-tensor scopes and "
        f"the SPAM family; compile ≤ {COMPILE:.2f}× the counterpart's, on CPU and GPU.",
    ]
    body = [layout_section(layout, table) for layout in layouts]
    if not on_gpu():
        body.append(
            "## GPU\n\nEvery figure on this page is measured on the CPU above. "
            "`bash benchmarks/device.sh` runs this benchmark at `--size gpu` on a GPU "
            "(`TRAIN_STEP_GPU.md`)."
        )
    return common.page(intro, *body)


def options(doc: str, size: str | None = None) -> argparse.ArgumentParser:
    """The command line of this script and of qk_clip_cost.py: the model's ``--size``
    (default ``size``, else the machine's), ``--layouts``, ``--rounds`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    default = size or "gpu on a GPU, else cpu"
    parser.add_argument("--size", choices=list(SIZES), default=size, help=f"default: {default}")
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="in the order measured")
    parser.add_argument("--rounds", type=int, help="interleaved rounds (default: the size's)")
    parser.add_argument("--out", help="folder of the page (default benchmarks/)")
    return parser


def main(argv: list[str] | None = None) -> list[Layout]:
    argv = sys.argv[1:] if argv is None else argv
    table = rows()
    parser = options(__doc__)
    parser.add_argument(
        "--rows",
        help=f"comma-separated rows, or all (default: the size's); from {', '.join(table)}",
    )
    parser.add_argument(
        "--budget",
        type=float,
        help="seconds after which no further configuration is compiled (the page lists it)",
    )
    args = parser.parse_args(argv)
    size_name = args.size or ("gpu" if on_gpu() else "cpu")
    size = SIZES[size_name]
    rounds = args.rounds or size.rounds
    names = args.layouts.split(",")
    if set(names) - set(LAYOUTS):
        parser.error(f"unknown layouts {names}; choose from {', '.join(LAYOUTS)}")
    path = common.page_path(args.out, "TRAIN_STEP_GPU.md" if on_gpu() else "TRAIN_STEP.md")
    head = common.header(common.command("train_step.py", argv), numpy=True)
    start, done = time.perf_counter(), []
    for name in names:
        chosen = selected(args.rows.split(",") if args.rows else size.rows[name], table)
        shapes = model_shapes(size, name)[0]
        leaves = jax.tree.leaves(shapes)
        common.log(f"== {name}: {len(leaves)} leaves, {len(chosen)} configurations")
        model_s = compile_model(size, name)
        common.log(f"  loss and gradient alone: {model_s[0]:.1f} s")
        deadline = None if args.budget is None else start + args.budget
        measured, left_out = compile_all(chosen, table, name, size, deadline)
        # A row is timed only beside its counterpart.
        for label in list(measured):
            base = table[label].base
            if base is not None and base not in measured:
                left_out.append(label)
                del measured[label]
        wall, cpu = time_steps(measured, size, name, rounds)
        for label, times in wall.items():
            common.log(f"  {label}: {common.median(times) * 1e3:.3g} ms")
        parameters = sum(int(np.prod(x.shape)) for x in leaves)
        done.append(Layout(name, len(leaves), parameters, model_s, measured, wall, cpu, left_out))
        text = page(head, size_name, done, table, rounds)
        common.write(path, text, f" ({time.perf_counter() - start:.0f} s)")
        for label, (step, comp, step_ok, comp_ok) in verdicts(done[-1], table).items():
            common.log(
                f"  {'met   ' if step_ok and comp_ok else 'MISSED'} {name} {label}: step "
                f"{step:.3f}x (≤ {table[label].target}), compile {comp:.2f}x (≤ {COMPILE})"
            )
    return done


if __name__ == "__main__":
    main()
