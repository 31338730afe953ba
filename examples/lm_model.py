"""The language model of ``examples/lm_spikes.py``: its data, the model, its training loop.

A byte-level transformer (plain JAX: pre-LayerNorm blocks, learned positions,
no QK norm) learns to predict the Python standard library's
own sources -- the ``*.py`` files directly under
``sysconfig.get_paths()["stdlib"]``, sorted by name; every tenth file is held
out (``load_text``) -- with ``optax.adamw`` at a learning rate high enough
that, unclipped, the gradient norm spikes by itself. ``Config`` holds the
model's size, the run's length and adamw's hyperparameters; ``CONFIGS`` the
three configurations of ``--config`` (the comments above ``Config`` and
``CONFIGS`` say how each was chosen).

``build_model`` compiles the model's loss and gradient once for all settings;
``train`` trains every seed at once under ``jax.vmap`` (a seed sets the initial
weights and the batches) with one optax transform, in one small jitted update
that also reads, from ``clipjax.metrics(opt_state)``, whether the clipper
clipped this step, and returns the per-step curves and held-out losses as a
``Run``.
"""

from __future__ import annotations

import math
import sysconfig
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

if TYPE_CHECKING:
    from tqdm.auto import tqdm

# How this configuration was chosen (H200, 3 seeds, 2000 steps; the commands
# are examples/lm_spikes.py's options; numbers: final held-out loss per seed):
# * A narrower model (d_model 128, 4 heads) never spiked: adamw b2=0.95 at lr
#   3e-3 / 1e-2 / 3e-2 ended at 1.25 / 1.32 / 1.59 with smooth curves; b2=0.999
#   at 3e-3..2e-2 did not spike either, and at lr >= 3e-2 (b2 0.99 or 0.999)
#   every run stays on the ~2.6 plateau of a model that has only learnt byte
#   n-gram statistics, clipped or not (static 0.1-1, zclip, adagc: 2.52-2.70):
#   a learning rate too high for any clipper to matter.
# * The default below, `--set d_model=256 --set n_heads=8 --lr 1e-2 --set b2=0.999`
#   (now the defaults): unclipped, the gradient norm spikes to 15-27 in the first
#   100 steps (median ~0.7) and again to 10-35x its running median later on.
#   With b2 = 0.999 a spike inflates adam's second moment, which then shrinks
#   every update for ~1000 steps: 2 of 3 seeds stall on the ~2.5 plateau of a
#   model that has only learnt byte n-gram statistics, lose 0.27-0.32 nats
#   (20-step mean) at later spikes, and end at 1.92 / 2.12 (the third seed
#   leaves the plateau by step 400: 1.44). The same runs at lr 3e-3 end at
#   1.20 / 1.18 / 1.18, and clip_by_global_norm(1.0) from the first step brings
#   lr 1e-2 back to 1.31 / 1.24 / 1.27 with no gradient spike above 2x. So the
#   spikes are gradient spikes that become set-backs and stalls, not one-step
#   jumps of the batch loss (the largest is x1.14). The early spikes count: a
#   clipper that waits 100 steps before it acts (autoclip, zscore_clip with
#   warmup_steps=100) let them through on 2 of 3 seeds in our runs.


@dataclass(frozen=True)
class Config:
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 8
    context: int = 128
    batch: int = 32
    steps: int = 2000
    eval_every: int = 100
    eval_windows: int = 256  # held-out windows of `context` bytes scored at every eval
    lr: float = 1e-2  # peak learning rate: unclipped runs spike (above)
    low_lr_factor: float = 0.3  # the "low_lr" setting trains at lr * low_lr_factor
    warmup: int = 100  # linear warm-up, then constant (decay "constant") or cosine to 0
    decay: str = "constant"
    b1: float = 0.9
    b2: float = 0.999
    weight_decay: float = 0.1
    eps: float = 1e-8
    static_sweep: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0)  # clip_by_global_norm max_norms
    # The loss is multiplied by this (so is every gradient): adam alone does the
    # same run at any value (its eps aside), a rule with an absolute number does not.
    loss_scale: float = 1.0


# --config gpu: the configuration above (one GPU, about five minutes for the table).
# --config cpu: a model small enough for two CPU cores (2 layers, d_model 64,
# context 32, batch 16, 300 steps) whose unclipped adamw blows up by itself
# some 100 steps after its warm-up. How it was chosen (3 seeds; per seed: largest loss
# jump over the median of the 50 batch losses before it, final held-out loss):
# * b2 0.999, weight decay 0.1, eps 1e-8, 5 warm-up steps (the former CPU
#   configuration): lr 1e-1 ends on the ~3.0 plateau, largest jump x1.2-1.3 on
#   every seed and every setting: no spike.
# * b2 0.9999, eps 1e-12, no weight decay, 5 warm-up steps: lr 3e-2, 1e-1 and
#   3e-1 never jump more than x1.3 (gradient spikes up to 100x pass without a
#   loss jump); lr 0.5 and 1.0 diverge from the first steps (losses of 80-700,
#   every seed), with every clipper: a learning rate no clipper can help.
# * The same with a 50-step warm-up to lr 0.4: the model first learns, then,
#   as the warm-up ends, unclipped adamw jumps x19.4 / x9.6 / x14.7 (steps
#   70-101) and diverges on 3 of 3 seeds (held-out 46 / 34 / 75 at 300 steps);
#   half the learning rate trains (x1.2; 3.10 / 3.16 / 3.17). Every adaptive
#   clipper follows that rise and diverges too; static clips at <= 1 do not.
# * The same at lr 0.3 (below): the model trains for ~100 steps at the peak
#   learning rate, then unclipped adamw jumps x21.6 / x13.8 / x36.0 (steps 176,
#   147, 225; batch losses of 78-161) and ends at held-out 42.6 / 31.2 / 110.2:
#   diverged on 3 of 3 seeds. Half the learning rate (0.15) trains on every
#   seed (largest jump x1.2 / x1.3 / x1.1; 3.17 / 3.10 / 3.07), and
#   optax.clip_by_global_norm(1) keeps lr 0.3 from diverging on every seed
#   (x1.4 / x1.6 / x1.2; 3.18 / 3.20 / 3.31), zclip(feedback="clipped") and
#   hist_clip(feedback="clipped") on 2 of 3: a blow-up that clipping can stop.
# --config cpu_long: the GPU configuration's optimizer (adamw b2 0.999, weight decay 0.1,
# a 100-step warm-up) on a model two CPU cores train for 1000 steps in about 100 s a
# setting (6 seeds): 2 layers, d_model 64, context 64, batch 16, lr 1.5e-2. It was
# searched for a model that stalls as the GPU one does (adamw alone 1.5-1.6x the best
# static clip there) and does not: on 2 cores no configuration of this size did (6 seeds;
# final held-out loss, adamw alone / best static clip of 0.25, 0.5, 1):
# * lr 1e-2, 600 steps: 2.22 / 2.16 (1.03x); lr 1.5e-2, 1000 steps: 2.19 / 2.06 (1.06x,
#   worse on 5 of 6 seeds, 4-11% each), kept here;
# * lr 2e-2, 600 steps: 2.40 / 2.32 with the static clip itself stuck on 2 seeds;
#   lr 2e-2 with b2 0.9995: 2.40 / 2.33, both bimodal (seeds at 2.2 or at 2.55);
# * lr 3e-2, 600 steps: adamw alone 2.43 beat every static clip (2.58-2.59).
# Unclipped, its initial gradient norm is about 3 and settles near 0.45 (the GPU model:
# 12-16 and 0.5): a transient about four times smaller relative to the level, which
# adam's second moment forgets in a few hundred steps; the stall of the GPU model needs
# a transient a small model does not have.
# --config cpu_cosine: the schedule most recipes use, on a model two CPU cores train in
# under a minute a setting (6 seeds): 2 layers, d_model 64, context 64, batch 16, adamw
# (b2 0.999, weight decay 0.1) with a 30-step linear warm-up and a cosine decay to 0 at
# step 300. Its learning rate (3e-3) is the best for adamw alone of 1e-3, 3e-3, 1e-2 and
# 3e-2 (3 seeds, final held-out loss 2.43 / 2.38 / 2.70 / 2.80); 3x and 10x it are in
# docs/generated/lr_table.md. At 1e-1 0.4's recommended setting ended worse than adamw
# alone on 2 of 3 seeds (SPEC 9.8).
CONFIGS = {
    "gpu": Config(),
    "cpu_cosine": Config(
        d_model=64,
        n_layers=2,
        n_heads=2,
        context=64,
        batch=16,
        steps=300,
        eval_every=50,
        eval_windows=64,
        lr=3e-3,
        warmup=30,
        decay="cosine",
    ),
    "cpu_long": Config(
        d_model=64,
        n_layers=2,
        n_heads=2,
        context=64,
        batch=16,
        steps=1000,
        eval_every=100,
        lr=1.5e-2,
    ),
    "cpu": Config(
        d_model=64,
        n_layers=2,
        n_heads=2,
        context=32,
        batch=16,
        steps=300,
        eval_every=50,
        eval_windows=64,
        lr=0.3,
        low_lr_factor=0.5,
        warmup=50,
        b2=0.9999,
        eps=1e-12,
        weight_decay=0.0,
    ),
}


def clipjax_metrics(opt_state: Any) -> dict[str, Any]:
    """``clipjax.metrics``; ``{}`` without a warning for the baselines (no clipjax state)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return clipjax.metrics(opt_state)


# ----------------------------------------------------------------------------- data


def load_text() -> tuple[np.ndarray, np.ndarray, list[str]]:
    """The bytes of the stdlib's top-level .py files: (train, held-out, file names)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"), key=lambda p: p.name)
    train, held_out = [], []
    for i, path in enumerate(files):
        (held_out if i % 10 == 9 else train).append(path.read_bytes())
    as_array = lambda parts: np.frombuffer(b"\n".join(parts), dtype=np.uint8)
    return as_array(train), as_array(held_out), [p.name for p in files]


def held_out_windows(held_out: np.ndarray, cfg: Config) -> np.ndarray:
    """`eval_windows` evenly spaced windows of context + 1 bytes."""
    starts = np.linspace(0, len(held_out) - cfg.context - 2, cfg.eval_windows).astype(np.int64)
    return np.stack([held_out[s : s + cfg.context + 1] for s in starts]).astype(np.int32)


def sample_batch(text: jax.Array, key: jax.Array, cfg: Config) -> jax.Array:
    starts = jax.random.randint(key, (cfg.batch,), 0, text.shape[0] - cfg.context - 1)
    take = lambda s: jax.lax.dynamic_slice(text, (s,), (cfg.context + 1,))
    return jax.vmap(take)(starts).astype(jnp.int32)


# ----------------------------------------------------------------------------- model


def init_params(key: jax.Array, cfg: Config) -> dict[str, Any]:
    d, n = cfg.d_model, cfg.n_layers
    keys = iter(jax.random.split(key, 8))
    normal = lambda shape, std=0.02: std * jax.random.normal(next(keys), shape)
    out_std = 0.02 / math.sqrt(2 * n)
    return {
        "embed": normal((256, d)),
        "pos": normal((cfg.context, d)),
        "layers": {  # stacked along a leading axis of n_layers, run by lax.scan
            "ln1": {"scale": jnp.ones((n, d)), "bias": jnp.zeros((n, d))},
            "qkv": normal((n, d, 3 * d)),
            "proj": normal((n, d, d), out_std),
            "ln2": {"scale": jnp.ones((n, d)), "bias": jnp.zeros((n, d))},
            "up": {"w": normal((n, d, 4 * d)), "b": jnp.zeros((n, 4 * d))},
            "down": {"w": normal((n, 4 * d, d), out_std), "b": jnp.zeros((n, d))},
        },
        "ln_f": {"scale": jnp.ones(d), "bias": jnp.zeros(d)},
        "head": normal((d, 256)),
    }


def layer_norm(x: jax.Array, p: dict[str, jax.Array]) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]


def forward(params: dict[str, Any], tokens: jax.Array, cfg: Config) -> jax.Array:
    """Logits [batch, time, 256] of a causal pre-LN transformer."""
    b, t = tokens.shape
    h, dh = cfg.n_heads, cfg.d_model // cfg.n_heads
    x = params["embed"][tokens] + params["pos"][:t]
    mask = jnp.tril(jnp.ones((t, t), bool))

    def block(x: jax.Array, p: dict[str, Any]) -> tuple[jax.Array, None]:
        q, k, v = jnp.split(layer_norm(x, p["ln1"]) @ p["qkv"], 3, axis=-1)
        q, k, v = (a.reshape(b, t, h, dh) for a in (q, k, v))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(dh)
        att = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, t, -1) @ p["proj"]
        y = jax.nn.gelu(layer_norm(x, p["ln2"]) @ p["up"]["w"] + p["up"]["b"])
        return x + y @ p["down"]["w"] + p["down"]["b"], None

    x, _ = jax.lax.scan(block, x, params["layers"])
    return layer_norm(x, params["ln_f"]) @ params["head"]


def lm_loss(params: dict[str, Any], window: jax.Array, cfg: Config) -> jax.Array:
    """Mean next-byte cross-entropy (nats) of windows [batch, context + 1]."""
    logits = forward(params, window[:, :-1], cfg)
    return optax.softmax_cross_entropy_with_integer_labels(logits, window[:, 1:]).mean()


# ----------------------------------------------------------------------------- training


class Run(NamedTuple):
    """One setting, all seeds: arrays with a leading seeds axis."""

    loss: np.ndarray  # [seeds, steps] batch loss before the update
    grad_norm: np.ndarray  # [seeds, steps] global norm of the raw gradient
    clipped: np.ndarray  # [seeds, steps] the clipper scaled some gradient down
    capped: np.ndarray | None  # [seeds, steps] a ceiling was the bound (None: no ceiling)
    eval_steps: np.ndarray  # [evals]
    eval_loss: np.ndarray  # [seeds, evals] held-out loss
    metrics: dict[str, np.ndarray]  # clipjax.metrics of the final state, [seeds, ...]
    seconds: float  # wall time, compilation included


class Model(NamedTuple):
    """The jitted functions that do not depend on the setting: compiled once per run
    of the script. Each maps over the seeds (leading axis) with ``jax.vmap``."""

    init: Callable  # seeds -> params
    grad: Callable  # (params, seeds, step) -> (batch loss, gradients)
    eval: Callable  # params -> held-out loss


def build_model(cfg: Config, text: jax.Array, windows: jax.Array) -> Model:
    def init(seed: jax.Array) -> Any:
        return init_params(jax.random.fold_in(jax.random.key(seed), 0), cfg)

    def grad(params: Any, seed: jax.Array, step: jax.Array) -> tuple[jax.Array, Any]:
        # The batch of a step depends on the seed and the step only: every
        # setting sees the same batches.
        data_key = jax.random.fold_in(jax.random.key(seed), 1)
        window = sample_batch(text, jax.random.fold_in(data_key, step), cfg)
        loss, grads = jax.value_and_grad(lambda p: cfg.loss_scale * lm_loss(p, window, cfg))(params)
        return loss / cfg.loss_scale, grads

    return Model(
        init=jax.jit(jax.vmap(init)),
        grad=jax.jit(jax.vmap(grad, in_axes=(0, 0, None))),
        eval=jax.jit(jax.vmap(lambda params: lm_loss(params, windows, cfg))),
    )


def train(
    name: str,
    tx: optax.GradientTransformation,
    cfg: Config,
    seeds: list[int],
    model: Model,
    progress: tqdm,
    *,
    needs_value: bool = False,
    static_max_norm: float | None = None,
) -> Run:
    """Trains every seed at once with the optimizer ``tx``; one call of model.grad
    and one of the setting's jitted update per step (the model is compiled once
    for all settings, the update -- small -- once per setting).

    Args:
      name: the setting's name, shown on the progress bar.
      tx: the whole optimizer (clipper and adamw).
      cfg: the model and the run.
      seeds: one run per seed, all at once under ``jax.vmap``.
      model: the jitted model of ``build_model``.
      progress: advanced by ``cfg.eval_every`` steps at each held-out evaluation.
      needs_value: ``tx.update`` takes the batch loss as ``value=`` (skip_on_spike).
      static_max_norm: for optax's clip_by_global_norm, which keeps no metrics: a
        step counts as clipped when the global norm exceeds it.

    Returns:
      The per-step curves, held-out losses and final metrics of every seed.
    """

    def update(params: Any, opt_state: Any, grads: Any, loss: jax.Array) -> tuple:
        # skip_on_spike watches the loss the gradients come from (scaled).
        extra = {"value": cfg.loss_scale * loss} if needs_value else {}
        updates, opt_state = tx.update(grads, opt_state, params, **extra)
        params = optax.apply_updates(params, updates)
        grad_norm = optax.global_norm(grads)
        # The clipper's decisions of this step, read from the optimizer state.
        metrics = clipjax_metrics(opt_state)
        skipped = metrics.get("skip_on_spike/global/skipped", jnp.zeros((), bool)) > 0
        if static_max_norm is not None:
            clipped = grad_norm > static_max_norm
        else:
            flags = [
                jnp.any(value > 0)
                for key, value in metrics.items()
                if key.endswith("/clipped") and not key.startswith("skip_on_spike/")
            ]
            clipped = jnp.any(jnp.stack(flags)) if flags else jnp.zeros((), bool)
        # A skipped step leaves the inner state (and its metrics) as they were.
        clipped = clipped & ~skipped
        ceilings = [jnp.any(v > 0) for k, v in metrics.items() if k.endswith("/capped")]
        capped = (jnp.any(jnp.stack(ceilings)) if ceilings else jnp.zeros((), bool)) & ~skipped
        record = [loss, grad_norm, clipped.astype(loss.dtype), capped.astype(loss.dtype)]
        return params, opt_state, jnp.stack(record)

    # Buffer donation saves a copy of the parameters and the state on
    # accelerators; the CPU backend would only warn that it cannot.
    donate = (0, 1) if jax.default_backend() != "cpu" else ()
    update_all = jax.jit(jax.vmap(update), donate_argnums=donate)

    start_time = time.perf_counter()
    seed_array = jnp.asarray(seeds, jnp.uint32)
    params = model.init(seed_array)
    opt_state = jax.jit(jax.vmap(tx.init))(params)
    evals = [model.eval(params)]
    records = []
    for step in range(cfg.steps):
        loss, grads = model.grad(params, seed_array, step)
        params, opt_state, record = update_all(params, opt_state, grads, loss)
        records.append(record)
        if (step + 1) % cfg.eval_every == 0:
            evals.append(model.eval(params))
            progress.set_postfix_str(f"{name}: held-out {np.nanmean(np.asarray(evals[-1])):.3f}")
            progress.update(cfg.eval_every)
    loss, grad_norm, clipped, capped = np.moveaxis(np.stack(jax.device_get(records), axis=-1), 1, 0)
    metrics = {k: np.asarray(v) for k, v in clipjax_metrics(opt_state).items()}
    has_ceiling = any(k.endswith("/capped") for k in metrics)
    seconds = time.perf_counter() - start_time
    return Run(
        loss=loss,
        grad_norm=grad_norm,
        clipped=clipped > 0,
        capped=capped > 0 if has_ceiling else None,
        eval_steps=np.arange(0, cfg.steps + 1, cfg.eval_every),
        eval_loss=np.stack(jax.device_get(evals), axis=1),
        metrics=metrics,
        seconds=seconds,
    )
