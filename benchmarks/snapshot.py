"""A behaviour snapshot of every public clipjax transform, to prove that a refactor changes nothing.

Each configuration (177, and 6 training steps: every public transform and wrapper, every
clipper's ``feedback``, the scopes, ``leaf_norms``, the ceilings, the
histories, modes and criteria, the optimizers' clips, the wrappers; see
``--list``) is built from the public API only (``clipjax.*`` and the test
registry ``tests.registry.CASES``), initialised on a small fixed float32 params
tree and run for 50 steps of ``jax.jit(tx.update)(grads, state, params)`` on a
deterministic gradient stream (``numpy.random.default_rng(SEED)``) that holds
spikes (x1000, of the whole tree and of one leaf, one of them inside the
warm-ups), a NaN element, an Inf element, an all-zero step, a finite element of
3e19 (its square overflows float32) and a lasting rise of the norms. Recorded:

* at every step, a hash (sha256 of dtype, shape and bytes, 12 hex digits; NaN
  made canonical, since XLA does not define a NaN's sign or payload) of every
  leaf of the updates, of every entry of ``clipjax.metrics(state)`` and of
  every leaf of the state, keyed by ``jax.tree_util.keystr`` of its path (the
  state's fields and keys, never its class names: a state class renamed keeps
  its paths); per (configuration, kind) one digest over the steps, and per
  leaf its dtype and shape and its 50 hashes, so that a comparison names the
  leaf and the first step that differ, and the paths missing or added;
* the compiled step (``jax.jit(tx.update).lower(grads, state, params)
  .compile()``): its HLO instruction count, its ``copy``/``copy-start``
  instructions and ``cost_analysis()``'s "bytes accessed";
* the warnings the configuration raises (build, init, compile, steps), its
  transform's ``route`` where it has one, the public clipjax classes it is an
  instance of, and the error a configuration meant to be refused raises;
* for a handful of representative optimizers (ids ``train/...``), the whole
  training step of a small MLP (loss, ``jax.grad``, ``update``,
  ``optax.apply_updates``, jitted with params and state donated): the same
  three HLO figures, and the params, metrics and state of 10 steps.

The functions of the public API that are not transforms (``global_norm``,
``exact_percentile``, ``approx_percentile``, ``max_attention_logits``) run as
configurations ``fn/...`` whose updates are their results on each step's
gradients; ``path_name`` and ``approx_relative_error`` are recorded as values.

Before and after a refactor (run from the repository root; the script imports
the clipjax and the tests/ next to it, so a copy inside another checkout
snapshots that checkout)::

    git archive BASE | tar -x -C /tmp/base    # or: git worktree add /tmp/base BASE
    cp benchmarks/snapshot.py /tmp/base/benchmarks/
    (cd /tmp/base && /work/main/.venv/bin/python benchmarks/snapshot.py --out /tmp/a.json)
    .venv/bin/python benchmarks/snapshot.py --out /tmp/b.json
    .venv/bin/python benchmarks/snapshot.py --compare /tmp/a.json /tmp/b.json

``--compare`` prints each configuration "same" or its first differing leaves
(with the first differing step) and HLO figures, and exits 1 if anything
differs (``--ignore-hlo``: values only). ``--only SUBSTR`` restricts the
configurations (also in ``--compare``), ``--list`` lists them. The file is
JSON with sorted keys and no timestamps: two runs of one checkout on one
machine give the same bytes. The HLO figures depend on the jax version and the
backend: compare snapshots taken with the same ones (``meta`` records them).
A full run takes about 2 minutes of CPU (compiling each configuration's step
dominates), 4 to 6 minutes of wall time on a loaded 2-core machine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import clipjax  # noqa: E402
from tests import registry  # noqa: E402

FORMAT = 1
SEED = 20240917
STEPS = 50
WARM = 5  # warm-ups short enough that most of the 50 steps are judged
# The gradient stream's events (step indices, 0-based).
TREE_SPIKES = (3, 12, 27, 31)  # the whole tree x1000 (step 3: inside the warm-ups)
LEAF_SPIKE = 18  # one leaf x1000
NAN_STEP = 21  # one NaN element
INF_STEP = 24  # one Inf element
ZERO_STEP = 34  # every element 0
OVERFLOW_STEP = 43  # one finite element of 3e19: its square overflows float32
RISE_STEP = 38  # from here on the norms are 4x: a lasting rise
SPIKE = 1000.0
# The loss passed as value= (skip_on_spike): a spike and a NaN.
VALUE_SPIKE, VALUE_NAN = 15, 40
TRAIN_STEPS = 10
TRAIN_SPIKE = 6  # the inputs of this training step x1000
HASH_CHARS = 12
KINDS = ("updates", "metrics", "state")
PUBLIC_CLASSES = ("ClipTransform", "SkipOnSpikeTransform", "SkippableTransform")


# --- the params trees -------------------------------------------------------------------

TREES: dict[str, dict[str, Any]] = {
    # The tree every configuration but qk_clip's runs on.
    "base": {"w": (8, 4), "b": (4,), "nested": {"t": (3, 5, 2), "s": (1,)}},
    # qk_clip's: query and key [d_model, heads, head_dim] of 2 heads; a GQA one of 4
    # query heads over 2 key heads; a layer-stacked one of 3 layers; a fused qkv kernel.
    "qk": {"attn": {"query": (4, 2, 3), "key": (4, 2, 3), "value": (4, 2, 3)}, "out": (6, 4)},
    "qk_gqa": {"attn": {"query": (4, 4, 3), "key": (4, 2, 3)}, "out": (6, 4)},
    "qk_stacked": {"layers": {"attn": {"query": (3, 4, 2, 3), "key": (3, 4, 2, 3)}}, "out": (6,)},
    "qk_fused": {"attn": {"qkv": (4, 18)}, "out": (6,)},
}
# The max logits [groups, heads] qk_clip gets, per tree.
LOGITS_SHAPE = {"qk": (1, 2), "qk_gqa": (1, 4), "qk_stacked": (3, 2), "qk_fused": (1, 2)}
QK_TAU = 50.0


def _shapes(tree: str) -> tuple[list[tuple[int, ...]], Any]:
    """The leaf shapes of ``tree`` and its structure."""
    return jax.tree.flatten(TREES[tree], is_leaf=lambda x: isinstance(x, tuple))


@functools.cache
def tree_params(tree: str) -> Any:
    """The fixed params of ``tree`` (float32)."""
    rng = np.random.default_rng(SEED + 2)
    shapes, treedef = _shapes(tree)
    leaves = [jnp.asarray(rng.normal(0.0, 0.5, s).astype(np.float32)) for s in shapes]
    return jax.tree.unflatten(treedef, leaves)


def _scale(step: int) -> float:
    return 0.1 * (1.0 + 0.3 * np.sin(step / 4.0)) * (4.0 if step >= RISE_STEP else 1.0)


@functools.cache
def grad_stream(tree: str) -> tuple[Any, ...]:
    """``STEPS`` gradient trees of ``tree``: noise with the module docstring's events."""
    rng = np.random.default_rng(SEED)
    shapes, treedef = _shapes(tree)
    last, middle = len(shapes) - 1, len(shapes) // 2
    steps = []
    for step in range(STEPS):
        leaves = [(rng.standard_normal(s) * _scale(step)).astype(np.float32) for s in shapes]
        if step in TREE_SPIKES:
            leaves = [x * np.float32(SPIKE) for x in leaves]
        if step == LEAF_SPIKE:
            leaves[middle] *= np.float32(SPIKE)
        if step == NAN_STEP:
            leaves[last].reshape(-1)[min(5, leaves[last].size - 1)] = np.nan
        if step == INF_STEP:
            leaves[middle].reshape(-1)[0] = np.inf
        if step == ZERO_STEP:
            leaves = [np.zeros_like(x) for x in leaves]
        if step == OVERFLOW_STEP:
            leaves[0].reshape(-1)[0] = np.float32(3e19)
        steps.append(jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves]))
    return tuple(steps)


@functools.cache
def extra_stream(name: str, tree: str) -> tuple[Any, ...]:
    """The per-step extra argument ``name``: ``value`` (a loss) or ``max_logits``."""
    rng = np.random.default_rng(SEED + 1)
    if name == "value":
        values = 1.0 / (1.0 + 0.05 * np.arange(STEPS)) + 0.02 * rng.standard_normal(STEPS)
        values[VALUE_SPIKE] *= 50.0
        values[VALUE_NAN] = np.nan
        return tuple(jnp.asarray(np.float32(v)) for v in values)
    if name == "max_logits":
        shape = LOGITS_SHAPE[tree]
        # Mostly under tau, over it on about a quarter of the heads and steps.
        logits = rng.uniform(5.0, 1.4 * QK_TAU, (STEPS, *shape)).astype(np.float32)
        logits[NAN_STEP, 0, 0] = np.nan
        return tuple(jnp.asarray(x) for x in logits)
    raise ValueError(f"unknown extra argument {name!r}")


# --- the configurations ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Config:
    """One configuration: a stable id and a builder of its transform.

    Attributes:
      id: the stable id (what ``--only`` matches and the snapshot is keyed by).
      build: ``() -> optax.GradientTransformation``.
      tree: the params tree it runs on (a key of ``TREES``).
      extra: the per-step keyword arguments of ``update`` (``value``, ``max_logits``).
      refused: the build or the first update is expected to raise (the error is recorded).
    """

    id: str
    build: Callable[[], Any]
    tree: str = "base"
    extra: tuple[str, ...] = ()
    refused: bool = False


P = functools.partial


def _wrap(outer: Callable[..., Any], *inner: Callable[[], Any], **kwargs: Any) -> Any:
    """``outer(*(b() for b in inner), **kwargs)``: a builder of a wrapper or chain."""
    return outer(*(b() for b in inner), **kwargs)


def _function(fn: Callable[[Any], Any]) -> optax.GradientTransformation:
    """A public function as a stateless transform: its updates are ``fn(grads)``."""

    def init(params: Any) -> Any:
        del params
        return ()

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params
        return {"out": fn(updates)}, state

    return optax.GradientTransformation(init, update)


def _is_stacked(path: Any, leaf: Any) -> bool:
    """The base tree's layer-stacked leaf: ``nested/t`` [3, 5, 2], 3 layers."""
    del path
    return len(leaf.shape) == 3


STACKED = {
    "stacked(per_layer)": P(clipjax.stacked, "per_layer", layers=_is_stacked),
    "stacked(per_param)": P(clipjax.stacked, "per_param", layers=_is_stacked),
}


def _scope(label: str) -> Any:
    return STACKED[label]() if label in STACKED else label


def _with_scope(factory: Callable[..., Any], scope: str, **kwargs: Any) -> Any:
    return factory(scope=_scope(scope), **kwargs)


def _fmt(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, float) and value == float("inf"):
        return "inf"
    return repr(value)


def _cid(name: str, **kwargs: Any) -> str:
    """``name(k=v, ...)`` in the order given; ``name`` alone without kwargs."""
    if not kwargs:
        return name
    return f"{name}({', '.join(f'{k}={_fmt(v)}' for k, v in kwargs.items())})"


# Each norm clipper: its factory, the arguments that make it act within 50 steps, its
# feedback values (default first) and the scopes it runs with here besides its default
# (those of tests.registry.CASES not repeated). Its base configuration (default feedback
# and scope) is left out where a registry entry is the same.
FEEDBACKS = {
    "target": ("clip_target", "raw", "clipped", "skip"),
    "hist": ("raw", "clipped", "clip_target", "skip"),
    "observe": ("observe_first", "raw", "clipped", "skip"),
    "spike_raw": ("raw", "clipped", "skip"),
    "spike_clipped": ("clipped", "raw", "skip"),
}
LAYERS = "stacked(per_layer)"
CLIPPERS: dict[str, tuple[Callable[..., Any], dict[str, Any], tuple[str, ...], tuple[str, ...]]] = {
    "zclip": (
        clipjax.zclip,
        {"warmup_steps": WARM},
        FEEDBACKS["target"],
        (LAYERS, "stacked(per_param)"),
    ),
    "hist_clip": (
        clipjax.hist_clip,
        {"warmup_steps": WARM},
        FEEDBACKS["hist"],
        ("per_layer", LAYERS),
    ),
    "autoclip": (
        clipjax.autoclip,
        {"warmup_steps": WARM, "min_history": WARM},
        FEEDBACKS["observe"],
        ("per_layer", LAYERS),
    ),
    "zscore_clip": (
        clipjax.zscore_clip,
        {"warmup_steps": WARM, "min_history": WARM},
        FEEDBACKS["observe"],
        ("per_layer", LAYERS),
    ),
    "clip_by_historical_norm": (
        clipjax.clip_by_historical_norm,
        {"rolling_interval_length": 16, "min_history": WARM},
        FEEDBACKS["spike_raw"],
        ("per_layer", LAYERS),
    ),
    "clip_norm_growth": (
        clipjax.clip_norm_growth,
        {},
        FEEDBACKS["spike_clipped"],
        ("global", LAYERS),
    ),
    "adagc": (
        clipjax.adagc,
        {"warmup_steps": WARM},
        FEEDBACKS["spike_clipped"],
        ("global", LAYERS),
    ),
    "clip_norm_by_ema": (clipjax.clip_norm_by_ema, {}, (), ("global",)),
    "agc": (
        clipjax.agc,
        {"clipping": 0.05},
        (),
        ("global", LAYERS, "stacked(per_param)"),
    ),
    "ada_norm": (clipjax.ada_norm, {}, (), ("global",)),
    "adaclip": (clipjax.adaclip, {}, (), ("per_layer", LAYERS)),
}
# Base configurations the registry holds as they are (registry/<name>).
IN_REGISTRY = ("clip_norm_growth", "clip_norm_by_ema", "agc", "ada_norm")
# leaf_norms=True, for these (a scope besides the default where given).
LEAF_NORMS: dict[str, dict[str, Any]] = {
    "zclip": {},
    "zclip(scope=per_layer)": {"scope": "per_layer"},
    "hist_clip(scope=per_param)": {"scope": "per_param"},
    "autoclip": {},
    "agc": {},
}


def _clipper_configs() -> list[Config]:
    out = []
    for name, (factory, base, feedbacks, scopes) in CLIPPERS.items():
        if name not in IN_REGISTRY:
            out.append(Config(name, P(factory, **base)))
        for feedback in feedbacks[1:]:
            out.append(Config(_cid(name, feedback=feedback), P(factory, **base, feedback=feedback)))
        for scope in scopes:
            out.append(Config(_cid(name, scope=scope), P(_with_scope, factory, scope, **base)))
    for label, kwargs in LEAF_NORMS.items():
        name = label.split("(")[0]
        factory, base = CLIPPERS[name][:2]
        out.append(
            Config(
                _cid(name, **kwargs, leaf_norms=True), P(factory, **base, **kwargs, leaf_norms=True)
            )
        )
    # The element-wise clippers (their defaults are registry entries): other scopes,
    # leaf_norms, and stacked scopes, which they refuse.
    value, percentile = P(clipjax.clip_by_value, 0.05), P(clipjax.clip_by_percentile, 90.0)
    out += [
        Config("clip_by_value(scope=per_layer)", P(value, scope="per_layer")),
        Config("clip_by_value(leaf_norms=True)", P(value, leaf_norms=True)),
        Config(
            "clip_by_value(scope=stacked(per_layer))",
            P(_with_scope, clipjax.clip_by_value, LAYERS, max_abs=0.05),
            refused=True,
        ),
        Config("clip_by_percentile(scope=per_layer)", P(percentile, scope="per_layer")),
        Config("clip_by_percentile(leaf_norms=True)", P(percentile, leaf_norms=True)),
        Config(
            "clip_by_percentile(scope=stacked(per_layer))",
            P(_with_scope, clipjax.clip_by_percentile, LAYERS, percentile=90.0),
            refused=True,
        ),
    ]
    return out


def _option_configs() -> list[Config]:
    """Ceilings, start rules, modes, histories, criteria and the other options."""
    z = P(clipjax.zclip, warmup_steps=WARM)
    a = P(clipjax.autoclip, warmup_steps=WARM, min_history=WARM)
    zs = P(clipjax.zscore_clip, warmup_steps=WARM, min_history=WARM)
    h = P(clipjax.hist_clip, warmup_steps=WARM)
    out = [
        # zclip: ceilings and start rules.
        Config("zclip(max_grad_norm=None)", P(z, max_grad_norm=None)),
        Config("zclip(max_grad_norm=2.0)", P(z, max_grad_norm=2.0)),
        Config("zclip(relative_ceiling=2.0)", P(z, relative_ceiling=2.0)),
        Config(
            "zclip(feedback=clipped, relative_ceiling=None)",
            P(z, feedback="clipped", relative_ceiling=None),
        ),
        Config(
            "zclip(feedback=clipped, ceiling_window=10)",
            P(z, feedback="clipped", ceiling_window=10),
        ),
        Config("zclip(start=hold)", P(z, start="hold")),
        Config("zclip(start=weight)", P(z, start="weight")),
        Config("zclip(feedback=clipped, start=None)", P(z, feedback="clipped", start=None)),
        Config("zclip(feedback=clipped, start=weight)", P(z, feedback="clipped", start="weight")),
        # zclip: modes and clip options.
        Config("zclip(mode=percentile)", P(z, mode="percentile")),
        Config("zclip(clip_option=mean)", P(z, clip_option="mean")),
        Config("zclip(skip_update_on_spike=True)", P(z, skip_update_on_spike=True)),
        # autoclip: modes, histories, ceilings.
        Config("autoclip(history=window, window_size=16)", P(a, history="window", window_size=16)),
        Config("autoclip(mode=percentile, history=ema)", P(a, mode="percentile", history="ema")),
        Config(
            "autoclip(mode=percentile, history=geometric)",
            P(a, mode="percentile", history="geometric"),
        ),
        Config(
            "autoclip(mode=percentile, history=geometric, quantile_lr=0.5, feedback=clipped)",
            P(a, mode="percentile", history="geometric", quantile_lr=0.5, feedback="clipped"),
        ),
        Config("autoclip(guard_nans=False)", P(a, guard_nans=False)),
        Config("autoclip(max_grad_norm=5.0)", P(a, max_grad_norm=5.0)),
        Config(
            "autoclip(feedback=clipped, max_grad_norm=None)",
            P(a, feedback="clipped", max_grad_norm=None),
        ),
        # zscore_clip.
        Config("zscore_clip(ema_decay=0.9)", P(zs, ema_decay=0.9)),
        # hist_clip: criteria, warm-up clips, ceilings.
        Config(
            "hist_clip(zstat_criterion(clip_fn=max_clipping))",
            P(_wrap, h, P(clipjax.zstat_criterion, clip_fn=clipjax.max_clipping)),
        ),
        Config(
            "hist_clip(zstat_criterion(clip_fn=mean_clipping))",
            P(_wrap, h, P(clipjax.zstat_criterion, clip_fn=clipjax.mean_clipping)),
        ),
        Config(
            "hist_clip(ema_criterion(clip_fn=mean_clipping))",
            P(_wrap, h, P(clipjax.ema_criterion, clip_fn=clipjax.mean_clipping)),
        ),
        Config(
            "hist_clip(ema_criterion(clip_fn=reciprocal_clipping, r_thresh=1.2))",
            P(
                _wrap,
                h,
                P(clipjax.ema_criterion, r_thresh=1.2, clip_fn=clipjax.reciprocal_clipping),
            ),
        ),
        Config(
            "hist_clip(ema_criterion(), feedback=clipped)",
            P(_wrap, h, clipjax.ema_criterion, feedback="clipped"),
        ),
        Config("hist_clip(warmup_clip=None)", P(h, warmup_clip=None)),
        Config(
            "hist_clip(warmup_clip=clip_by_value(0.05))",
            _hist_clip_warmup_clip_by_value,
        ),
        Config(
            "hist_clip(warmup_clip=optax.clip_by_global_norm(0.5))",
            P(h, warmup_clip=optax.clip_by_global_norm(0.5)),
        ),
        Config("hist_clip(max_grad_norm=5.0)", P(h, max_grad_norm=5.0)),
        # The other clippers' options.
        Config(
            "clip_norm_growth(add=0.1, mul=None)", P(clipjax.clip_norm_growth, add=0.1, mul=None)
        ),
        Config(
            "adagc(relative_threshold=1.5, absolute_threshold=0.5)",
            P(clipjax.adagc, 1.5, warmup_steps=WARM, absolute_threshold=0.5),
        ),
        Config(
            "clip_norm_by_ema(max_ema_growth=None)",
            P(clipjax.clip_norm_by_ema, max_ema_growth=None),
        ),
        Config("agc(axis=0)", P(clipjax.agc, 0.05, axis=0)),
        Config(
            "clip_by_global_norm(norm_type=1.0)", P(clipjax.clip_by_global_norm, 1.0, norm_type=1.0)
        ),
        Config(
            "clip_by_global_norm(leaf_norms=True)",
            P(clipjax.clip_by_global_norm, 1.0, leaf_norms=True),
        ),
        Config(
            "clip_by_percentile(method=exact)", P(clipjax.clip_by_percentile, 90.0, method="exact")
        ),
        Config(
            "clip_by_percentile(method=approx)",
            P(clipjax.clip_by_percentile, 90.0, method="approx"),
        ),
        # Named: the metrics prefix.
        Config("zclip(name=clip)", P(z, name="clip")),
        # inject_hyperparams around a clipper and an optimizer (their numbers injectable).
        Config(
            "optax.inject_hyperparams(zclip)(z_thresh=2.0)",
            P(
                optax.inject_hyperparams(clipjax.zclip, static_args=("warmup_steps",)),
                z_thresh=2.0,
                warmup_steps=WARM,
            ),
        ),
    ]
    return out


def _matrices(params: Any) -> Any:
    """A weight-decay mask: the leaves of two or more dimensions."""
    return jax.tree.map(lambda x: x.ndim > 1, params)


def _optimizer_configs() -> list[Config]:
    """adam/adamw with their clips, spam, stable_spam."""
    lr = 1e-2
    spam = P(clipjax.spam, lr, reset_interval=8, warmup_steps=3, clip_delay=2)
    return [
        Config("adam", P(clipjax.adam, lr)),
        Config("adam(update_clipping=True)", P(clipjax.adam, lr, update_clipping=True)),
        Config(
            "adam(clip_grad_adapt=2.0, clip_grad_min=1e-3, clip_grad_warm_up=5)",
            P(clipjax.adam, lr, clip_grad_adapt=2.0, clip_grad_min=1e-3, clip_grad_warm_up=5),
        ),
        Config("adamw", P(clipjax.adamw, lr)),
        Config("adamw(update_clipping=True)", P(clipjax.adamw, lr, update_clipping=True)),
        Config(
            "adamw(clip_grad_adapt=1.0, clip_grad_warm_up=5)",
            P(clipjax.adamw, lr, clip_grad_adapt=1.0, clip_grad_warm_up=5),
        ),
        Config(
            "adamw(nesterov=True, update_clipping=True)",
            P(clipjax.adamw, lr, nesterov=True, update_clipping=True),
        ),
        Config("adamw(mu_dtype=bfloat16)", P(clipjax.adamw, lr, mu_dtype=jnp.bfloat16)),
        Config(
            "adamw(learning_rate=linear_schedule)",
            P(clipjax.adamw, optax.linear_schedule(lr, lr / 10, STEPS)),
        ),
        Config(
            "adamw(weight_decay=0.1, mask=matrices, eps_root=1e-8)",
            P(clipjax.adamw, lr, weight_decay=0.1, mask=_matrices, eps_root=1e-8),
        ),
        Config("spam(count_clipped=False)", P(spam, count_clipped=False)),
        Config(
            "spam(weight_decay=0.01, mask=matrices)", P(spam, weight_decay=0.01, mask=_matrices)
        ),
        Config(
            "stable_spam(scope=global)",
            P(clipjax.stable_spam, lr, reset_interval=8, scope="global"),
        ),
        Config(
            "stable_spam(scope=per_layer)",
            P(clipjax.stable_spam, lr, reset_interval=8, scope="per_layer"),
        ),
    ]


def _skip_and_clip(
    inner: Callable[[], Any], rule: Callable[[], Any] | None = None, **kwargs: Any
) -> Any:
    """``skip_and_clip_by_global_norm(inner(), drop_norm=rule() if rule, **kwargs)``."""
    if rule is not None:
        kwargs["drop_norm"] = rule()
    return clipjax.skip_and_clip_by_global_norm(inner(), **kwargs)


def _wrapper_configs() -> list[Config]:
    """chain, skip_on_spike, skip_and_clip_by_global_norm, optax.chain."""
    lr = 1e-2
    adam, adamw = P(clipjax.adam, lr), P(clipjax.adamw, lr)
    zclip = P(clipjax.zclip, warmup_steps=WARM)
    zclipped = P(zclip, feedback="clipped")
    chain = P(_wrap, clipjax.chain)
    skip = P(_wrap, clipjax.skip_on_spike, window_size=16, min_history=WARM)
    spam = P(clipjax.spam, lr, reset_interval=8, warmup_steps=3, clip_delay=2)
    sac = _skip_and_clip
    ema_rule = dict(rule=P(clipjax.drop_norm_by_grad_norm_ema, (5,)), grad_norm_ema_decay=0.9)
    return [
        Config("chain(zclip(feedback=clipped), adamw)", P(chain, zclipped, adamw)),
        Config(
            "chain(clip_by_global_norm(1.0), adam)",
            P(chain, P(clipjax.clip_by_global_norm, 1.0), adam),
        ),
        Config(
            "chain(zclip(start=hold), optax.adam)",
            P(chain, P(zclip, start="hold"), P(optax.adam, lr)),
        ),
        Config(
            "chain(zclip(feedback=clipped, start=weight), adam)",
            P(chain, P(zclipped, start="weight"), adam),
        ),
        Config(
            "chain(zclip(feedback=clipped), chain(adaclip, adamw))",
            P(chain, zclipped, P(chain, clipjax.adaclip, adamw)),
        ),
        Config("chain(agc, adamw)", P(chain, P(clipjax.agc, 0.05), adamw)),
        Config(
            "optax.chain(zclip(feedback=clipped), optax.adam)",
            P(_wrap, optax.chain, zclipped, P(optax.adam, lr)),
        ),
        # skip_on_spike around a clipper, a clipjax chain, optax.adam (its lax.cond route),
        # clipjax's optimizers; its feedbacks, loss and forced steps.
        Config("skip_on_spike(zclip)", P(skip, zclip)),
        Config(
            "skip_on_spike(chain(zclip(feedback=clipped), adam))", P(skip, P(chain, zclipped, adam))
        ),
        Config(
            "skip_on_spike(chain(zclip(feedback=clipped), adam), value)",
            P(skip, P(chain, zclipped, adam)),
            extra=("value",),
        ),
        Config("skip_on_spike(optax.adam)", P(skip, P(optax.adam, lr))),
        Config(
            "skip_on_spike(adamw(update_clipping=True))", P(skip, P(adamw, update_clipping=True))
        ),
        Config("skip_on_spike(spam)", P(skip, spam)),
        Config("skip_on_spike(adam, feedback=raw)", P(skip, adam, feedback="raw")),
        Config(
            "skip_on_spike(adam, feedback=skip, max_consecutive_skips=2)",
            P(skip, adam, feedback="skip", max_consecutive_skips=2),
        ),
        Config("skip_on_spike(adamw) defaults", P(_wrap, clipjax.skip_on_spike, adamw)),
        # AXLearn's skip-and-clip: rules, numbers, feedbacks, inner routes.
        Config(
            "skip_and_clip(adamw, ema rule, max_norm=1.0, feedback=clipped)",
            P(sac, adamw, max_norm=1.0, feedback="clipped", **ema_rule),
        ),
        Config(
            "skip_and_clip(adamw, ema rule, max_norm=1.0, feedback=raw)",
            P(sac, adamw, max_norm=1.0, feedback="raw", **ema_rule),
        ),
        Config(
            "skip_and_clip(adamw, stddev rule)",
            P(
                sac,
                adamw,
                rule=P(clipjax.drop_norm_by_grad_norm_stddev, min_count=5, multipliers=(3, 6)),
                grad_norm_ema_decay=0.9,
            ),
        ),
        Config("skip_and_clip(adamw, max_norm=1.0)", P(sac, adamw, max_norm=1.0)),
        Config(
            "skip_and_clip(optax.adam, drop_norm=5.0)", P(sac, P(optax.adam, lr), drop_norm=5.0)
        ),
        Config(
            "skip_and_clip(chain(zclip, adam), max_norm=1.0)",
            P(sac, P(chain, zclip, adam), max_norm=1.0, **ema_rule),
        ),
        Config("skip_and_clip(zclip, drop_norm=5.0)", P(sac, zclip, drop_norm=5.0)),
        Config(
            "skip_and_clip(adamw) refused without drop_norm and max_norm",
            P(sac, adamw),
            refused=True,
        ),
    ]


def _hist_clip_warmup_clip_by_value() -> Any:
    return clipjax.hist_clip(warmup_steps=WARM, warmup_clip=clipjax.clip_by_value(0.05))


def _qk_clip_stacked() -> Any:
    """qk_clip on a layer-stacked tree: one group per layer, max logits [layers, heads]."""
    return clipjax.qk_clip(optax.sgd(0.1), tau=QK_TAU, scope=clipjax.stacked())


def _qk_clip_fused() -> Any:
    """qk_clip on a fused [4, 3 * 6] qkv kernel: q, k, v thirds of 2 heads of 3 dimensions."""
    return clipjax.qk_clip(
        optax.sgd(0.1),
        tau=QK_TAU,
        query=clipjax.QKHeads("qkv", axis=-1, span=(0, 6)),
        key=clipjax.QKHeads("qkv", axis=-1, span=(6, 12)),
    )


def _qk_configs() -> list[Config]:
    """qk_clip wraps an optimizer; its update takes max_logits [groups, heads] per step."""
    sgd = P(optax.sgd, 0.1)
    qk = P(_wrap, clipjax.qk_clip, tau=QK_TAU)
    extra = ("max_logits",)
    return [
        Config("qk_clip(optax.sgd)", P(qk, sgd), tree="qk", extra=extra),
        Config(
            "qk_clip(adam, alpha=0.25)",
            P(qk, P(clipjax.adam, 1e-2), alpha=0.25),
            tree="qk",
            extra=extra,
        ),
        Config(
            "qk_clip(optax.sgd, kv_heads=2)", P(qk, sgd, kv_heads=2), tree="qk_gqa", extra=extra
        ),
        Config(
            "qk_clip(optax.sgd, scope=stacked)",
            _qk_clip_stacked,
            tree="qk_stacked",
            extra=extra,
        ),
        Config(
            "qk_clip(optax.sgd, QKHeads fused qkv)",
            _qk_clip_fused,
            tree="qk_fused",
            extra=extra,
        ),
    ]


def _fn_configs() -> list[Config]:
    """The public functions that are not transforms, on each step's gradients."""
    t = lambda g: g["nested"]["t"]  # [3, 5, 2]: 3 positions, 5 heads of 2 dimensions
    return [
        Config("fn/global_norm", P(_function, clipjax.global_norm)),
        Config(
            "fn/global_norm(norm_type=inf)", P(_function, P(_global_norm, norm_type=float("inf")))
        ),
        Config(
            "fn/exact_percentile(leaves, 90)",
            P(_function, P(_percentile, clipjax.exact_percentile, 90.0)),
        ),
        Config(
            "fn/approx_percentile(leaves, 90)",
            P(_function, P(_percentile, clipjax.approx_percentile, 90.0)),
        ),
        Config(
            "fn/max_attention_logits(t, t, causal=True, chunk_size=2)",
            P(
                _function,
                lambda g: clipjax.max_attention_logits(t(g), t(g), causal=True, chunk_size=2),
            ),
        ),
    ]


def _global_norm(tree: Any, norm_type: float) -> Any:
    return clipjax.global_norm(tree, norm_type)


def _percentile(fn: Callable[..., Any], percentile: float, tree: Any) -> Any:
    return fn(jax.tree.leaves(tree), percentile)


def _registry_configs() -> list[Config]:
    """Every entry of the test registry (every public transform once per state layout)."""
    return [
        Config(f"registry/{name}", registry.CASES[name].make) for name in sorted(registry.CASES)
    ]


@functools.cache
def configs() -> tuple[Config, ...]:
    """Every configuration, ids unique."""
    out = [
        *_registry_configs(),
        *_clipper_configs(),
        *_option_configs(),
        *_optimizer_configs(),
        *_wrapper_configs(),
        *_qk_configs(),
        *_fn_configs(),
    ]
    ids = [c.id for c in out]
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    if duplicates:
        raise AssertionError(f"duplicate configuration ids: {duplicates}")
    return tuple(out)


# The whole training step of a small MLP, for these configurations (ids above).
TRAIN_IDS = (
    "chain(clip_by_global_norm(1.0), adam)",
    "chain(zclip(feedback=clipped), adamw)",
    "skip_on_spike(chain(zclip(feedback=clipped), adam), value)",
    "skip_on_spike(optax.adam)",
    "registry/skip_and_clip",
    "registry/spam",
)


# --- recording ---------------------------------------------------------------------------


def leaf_hash(x: Any) -> tuple[str, str]:
    """``(meta, hash)`` of a leaf: ``"float32[8, 4]"`` and 12 hex digits of sha256 over
    the meta and the bytes, NaN canonical; a non-array leaf by its ``repr``."""
    if isinstance(x, (jax.Array, np.ndarray, np.generic)):
        a = np.asarray(x)
        if jnp.issubdtype(a.dtype, jnp.inexact):
            a = np.where(np.isnan(a), np.array(np.nan, a.dtype), a)
        meta = f"{a.dtype.name}{list(a.shape)}"
        data = meta.encode() + np.ascontiguousarray(a).tobytes()
    else:
        meta = f"repr:{type(x).__name__}"
        data = (meta + repr(x)).encode()
    return meta, hashlib.sha256(data).hexdigest()[:HASH_CHARS]


def _flat(tree: Any) -> dict[str, Any]:
    """``keystr(path) -> leaf`` (None leaves kept as such)."""
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None)[0]
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


class Recorder:
    """Per kind, per leaf: its meta and one hash per step."""

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.steps = 0
        self.kinds: dict[str, dict[str, dict[str, Any]]] = {k: {} for k in kinds}

    def add(self, **flats: dict[str, Any]) -> None:
        for kind, flat in flats.items():
            leaves = self.kinds[kind]
            for path, leaf in flat.items():
                meta, digest = leaf_hash(leaf)
                entry = leaves.setdefault(path, {"meta": meta, "steps": ["-"] * self.steps})
                if entry["meta"] != meta:
                    entry["meta"] = f"{entry['meta']}|{meta}"
                entry["steps"].append(digest)
        self.steps += 1
        for leaves in self.kinds.values():
            for entry in leaves.values():
                entry["steps"] += ["-"] * (self.steps - len(entry["steps"]))

    def result(self) -> dict[str, Any]:
        out = {}
        for kind, leaves in self.kinds.items():
            packed = {
                p: {"meta": e["meta"], "steps": " ".join(e["steps"])} for p, e in leaves.items()
            }
            blob = json.dumps(packed, sort_keys=True).encode()
            out[kind] = {"digest": hashlib.sha256(blob).hexdigest()[:16], "leaves": packed}
        return out


_OPCODE = re.compile(r"\s([a-z][a-z0-9_\-]*)\(")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?\S+ = (.*)$")


def hlo_figures(compiled: Any) -> dict[str, Any]:
    """Instructions (lines ``name = ...`` inside the computations), ``copy`` and
    ``copy-start`` instructions, and ``cost_analysis()``'s "bytes accessed"."""
    instructions = copies = 0
    inside = False
    for line in compiled.as_text().splitlines():
        stripped = line.strip()
        if not inside:
            inside = stripped.endswith("{") and (line.startswith("%") or line.startswith("ENTRY"))
            continue
        if stripped == "}":
            inside = False
            continue
        match = _INSTRUCTION.match(line)
        if match:
            instructions += 1
            opcode = _OPCODE.search(" " + match.group(1))
            if opcode and opcode.group(1) in ("copy", "copy-start"):
                copies += 1
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else None
    accessed = None if not analysis else analysis.get("bytes accessed")
    return {
        "instructions": instructions,
        "copies": copies,
        "bytes_accessed": None if accessed is None else float(accessed),
    }


def _warning_lines(caught: list[warnings.WarningMessage]) -> list[str]:
    lines = {f"{w.category.__name__}: {str(w.message).splitlines()[0]}" for w in caught}
    return sorted(lines)


def _static(tx: Any) -> dict[str, Any]:
    classes = [n for n in PUBLIC_CLASSES if isinstance(tx, getattr(clipjax, n))]
    return {"route": getattr(tx, "route", None), "classes": classes}


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_config(config: Config) -> dict[str, Any]:
    """Builds ``config``, compiles its update and runs it for ``STEPS`` steps."""
    record: dict[str, Any] = {"error": None, "static": None, "hlo": None, "kinds": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tx = config.build()
            record["static"] = _static(tx)
            params = tree_params(config.tree)
            grads = grad_stream(config.tree)
            extras = {name: extra_stream(name, config.tree) for name in config.extra}
            state = tx.init(params)
            jitted = jax.jit(tx.update)
            first = {name: values[0] for name, values in extras.items()}
            compiled = jitted.lower(grads[0], state, params, **first).compile()
            record["hlo"] = hlo_figures(compiled)
            recorder = Recorder(KINDS)
            retraced = False
            for step in range(STEPS):
                kwargs = {name: values[step] for name, values in extras.items()}
                try:
                    updates, state = compiled(grads[step], state, params, **kwargs)
                except (TypeError, ValueError):
                    # The state's types changed between steps: jit traces again.
                    retraced = True
                    updates, state = jitted(grads[step], state, params, **kwargs)
                updates, host_state = jax.device_get((updates, state))
                recorder.add(
                    updates=_flat(updates),
                    metrics=dict(clipjax.metrics(state)),
                    state=_flat(host_state),
                )
            record["static"]["retraced"] = retraced
            record["kinds"] = recorder.result()
        except Exception as exc:  # recorded: a refusal, or a break a comparison reports
            record["error"] = _error(exc)
    record["warnings"] = _warning_lines(caught)
    return record


# --- the whole training step -------------------------------------------------------------

MLP = {"l1": {"kernel": (8, 16), "bias": (16,)}, "l2": {"kernel": (16, 4), "bias": (4,)}}


def _mlp_params() -> Any:
    rng = np.random.default_rng(SEED + 3)
    shapes, treedef = jax.tree.flatten(MLP, is_leaf=lambda x: isinstance(x, tuple))
    return jax.tree.unflatten(
        treedef, [jnp.asarray(rng.normal(0.0, 0.3, s).astype(np.float32)) for s in shapes]
    )


@functools.cache
def _train_data() -> tuple[Any, ...]:
    rng = np.random.default_rng(SEED + 4)
    data = []
    for step in range(TRAIN_STEPS):
        x = rng.standard_normal((16, 8)).astype(np.float32)
        y = rng.standard_normal((16, 4)).astype(np.float32)
        if step == TRAIN_SPIKE:
            x *= np.float32(SPIKE)
        data.append((jnp.asarray(x), jnp.asarray(y)))
    return tuple(data)


def _loss(params: Any, x: Any, y: Any) -> Any:
    hidden = jnp.tanh(x @ params["l1"]["kernel"] + params["l1"]["bias"])
    out = hidden @ params["l2"]["kernel"] + params["l2"]["bias"]
    return jnp.mean((out - y) ** 2)


def run_train_step(config: Config) -> dict[str, Any]:
    """The jitted training step of ``config`` (params and state donated): HLO figures
    and ``TRAIN_STEPS`` steps of params, metrics (with the loss) and state."""
    record: dict[str, Any] = {"error": None, "static": None, "hlo": None, "kinds": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            tx = config.build()
            record["static"] = _static(tx)
            with_value = "value" in config.extra

            def step(params: Any, state: Any, x: Any, y: Any) -> Any:
                loss, grads = jax.value_and_grad(_loss)(params, x, y)
                extra = {"value": loss} if with_value else {}
                updates, state = tx.update(grads, state, params, **extra)
                return optax.apply_updates(params, updates), state, loss

            params = _mlp_params()
            state = tx.init(params)
            data = _train_data()
            compiled = jax.jit(step, donate_argnums=(0, 1)).lower(params, state, *data[0]).compile()
            record["hlo"] = hlo_figures(compiled)
            recorder = Recorder(("params", "metrics", "state"))
            for x, y in data:
                params, state, loss = compiled(params, state, x, y)
                host_params, host_state, loss = jax.device_get((params, state, loss))
                metrics = {**clipjax.metrics(state), "loss": loss}
                recorder.add(params=_flat(host_params), metrics=metrics, state=_flat(host_state))
            record["kinds"] = recorder.result()
        except Exception as exc:
            record["error"] = _error(exc)
    # Donation warnings depend on the backend, not on clipjax.
    record["warnings"] = [w for w in _warning_lines(caught) if "donated" not in w]
    return record


def _values() -> dict[str, Any]:
    """Public functions of static arguments."""
    paths = jax.tree_util.tree_flatten_with_path(tree_params("base"))[0]
    return {
        "path_name": [clipjax.path_name(path) for path, _ in paths],
        "approx_relative_error()": repr(clipjax.approx_relative_error()),
        "approx_relative_error(2048, 1)": repr(clipjax.approx_relative_error(2048, 1)),
    }


def _meta() -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    return {
        "format": FORMAT,
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(git("status", "--porcelain", "--", "clipjax", "tests")),
        "versions": {
            "python": platform.python_version(),
            "jax": jax.__version__,
            "jaxlib": importlib.metadata.version("jaxlib"),
            "optax": optax.__version__,
            "numpy": np.__version__,
            "clipjax": clipjax.__version__,
        },
        "backend": jax.default_backend(),
        "steps": STEPS,
        "seed": SEED,
    }


def snapshot(only: str | None) -> dict[str, Any]:
    """Every configuration (those whose id holds ``only``), run and recorded."""
    chosen = [c for c in configs() if only is None or only in c.id]
    by_id = {c.id: c for c in configs()}
    trains = [by_id[i] for i in TRAIN_IDS if only is None or only in f"train/{i}"]
    out: dict[str, Any] = {"meta": _meta(), "values": _values(), "configs": {}}
    total = len(chosen) + len(trains)
    for n, (label, config, run) in enumerate(
        [(c.id, c, run_config) for c in chosen]
        + [(f"train/{c.id}", c, run_train_step) for c in trains]
    ):
        t0 = time.perf_counter()
        record = run(config)
        out["configs"][label] = record
        status = "ok"
        if record["error"]:
            status = f"{'refused as expected' if config.refused else 'ERROR'}: {record['error']}"
        elif config.refused:
            status = "ERROR: expected a refusal, ran"
        print(f"[{n + 1}/{total}] {label}: {status} ({time.perf_counter() - t0:.1f} s)", flush=True)
    return out


# --- comparing ---------------------------------------------------------------------------

MAX_LINES = 8  # differing leaves shown per kind


def _first_difference(a: str, b: str) -> tuple[int | None, int]:
    """The first step whose hashes differ (None: none) and how many differ."""
    sa, sb = a.split(), b.split()
    differing = [i for i in range(max(len(sa), len(sb))) if sa[i : i + 1] != sb[i : i + 1]]
    return (differing[0] if differing else None), len(differing)


def _presence(x: Any) -> str:
    return "absent" if x is None else "present"


def _diff_kind(kind: str, a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[str]:
    if a is None or b is None:
        return [] if a == b else [f"{kind}: {_presence(a)} -> {_presence(b)}"]
    if a["digest"] == b["digest"]:
        return []
    la, lb = a["leaves"], b["leaves"]
    lines = [f"{kind} {p}: missing (only in A)" for p in sorted(set(la) - set(lb))]
    lines += [f"{kind} {p}: added (only in B)" for p in sorted(set(lb) - set(la))]
    found = []
    for path in sorted(set(la) & set(lb)):
        ea, eb = la[path], lb[path]
        step, count = _first_difference(ea["steps"], eb["steps"])
        if step is None and ea["meta"] == eb["meta"]:
            continue
        meta = "" if ea["meta"] == eb["meta"] else f", {ea['meta']} -> {eb['meta']}"
        where = "no step" if step is None else f"step {step}"
        found.append(
            (
                step if step is not None else -1,
                path,
                f"{kind} {path}: first differs at {where} ({count} of {STEPS} steps{meta})",
            )
        )
    # The earliest divergence first: the likely cause of the later ones.
    lines += [line for _, _, line in sorted(found)]
    if len(lines) > MAX_LINES:
        lines = [*lines[:MAX_LINES], f"{kind}: ... and {len(lines) - MAX_LINES} more leaves"]
    return lines


def diff_config(a: dict[str, Any], b: dict[str, Any], ignore_hlo: bool) -> list[str]:
    lines = []
    for field in ("error", "static", "warnings"):
        if a.get(field) != b.get(field):
            lines.append(f"{field}: {a.get(field)!r} -> {b.get(field)!r}")
    if not ignore_hlo and a.get("hlo") != b.get("hlo"):
        ha, hb = a.get("hlo") or {}, b.get("hlo") or {}
        for key in sorted(set(ha) | set(hb)):
            if ha.get(key) != hb.get(key):
                lines.append(f"hlo {key}: {ha.get(key)} -> {hb.get(key)}")
    ka, kb = a.get("kinds") or {}, b.get("kinds") or {}
    for kind in sorted(set(ka) | set(kb)):
        lines += _diff_kind(kind, ka.get(kind), kb.get(kind))
    return lines


def compare(path_a: str, path_b: str, only: str | None, ignore_hlo: bool) -> int:
    with open(path_a) as f:
        a = json.load(f)
    with open(path_b) as f:
        b = json.load(f)
    for key in sorted(set(a["meta"]) | set(b["meta"])):
        if a["meta"].get(key) != b["meta"].get(key):
            print(f"meta {key}: {a['meta'].get(key)} -> {b['meta'].get(key)}")
    if a["meta"].get("steps") != b["meta"].get("steps") or a["meta"].get("seed") != b["meta"].get(
        "seed"
    ):
        print("the snapshots ran different streams: their hashes cannot agree")
    differing = 0
    for key in sorted(set(a["values"]) | set(b["values"])):
        if a["values"].get(key) != b["values"].get(key):
            differing += 1
            print(f"value {key}: {a['values'].get(key)!r} -> {b['values'].get(key)!r}")
    ca, cb = a["configs"], b["configs"]
    ids = sorted(i for i in set(ca) | set(cb) if only is None or only in i)
    for cid in ids:
        if cid not in cb:
            lines = ["missing (only in A)"]
        elif cid not in ca:
            lines = ["added (only in B)"]
        else:
            lines = diff_config(ca[cid], cb[cid], ignore_hlo)
        if lines:
            differing += 1
            print(f"{cid}: DIFFERS")
            for line in lines:
                print(f"    {line}")
        else:
            print(f"{cid}: same")
    print(
        f"{len(ids)} configurations compared, {differing} differ"
        + (" (HLO figures ignored)" if ignore_hlo else "")
    )
    return 1 if differing else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--out", metavar="FILE.json", help="write a snapshot")
    mode.add_argument(
        "--compare", nargs=2, metavar=("A.json", "B.json"), help="compare two snapshots"
    )
    mode.add_argument("--list", action="store_true", help="list the configuration ids")
    parser.add_argument(
        "--only", metavar="SUBSTR", help="only the configurations whose id holds SUBSTR"
    )
    parser.add_argument(
        "--ignore-hlo", action="store_true", help="--compare: values only, not the HLO figures"
    )
    args = parser.parse_args(argv)
    if args.compare:
        return compare(*args.compare, args.only, args.ignore_hlo)
    if args.list:
        ids = [c.id for c in configs()] + [f"train/{i}" for i in TRAIN_IDS]
        for cid in ids:
            if args.only is None or args.only in cid:
                print(cid)
        return 0
    t0, c0 = time.perf_counter(), time.process_time()
    print(f"clipjax {clipjax.__version__} from {os.path.dirname(clipjax.__file__)}", flush=True)
    data = snapshot(args.only)
    with open(args.out, "w") as f:
        json.dump(data, f, sort_keys=True, indent=1)
        f.write("\n")
    refused = {c.id: c.refused for c in configs()}
    errors = [
        cid
        for cid, record in data["configs"].items()
        if bool(record["error"]) != refused[cid.removeprefix("train/")]
    ]
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    print(
        f"{len(data['configs'])} configurations written to {args.out} in {seconds:.0f} s"
        f" ({cpu:.0f} s of CPU)"
    )
    if errors:
        print(f"unexpected errors or missing refusals: {errors}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
