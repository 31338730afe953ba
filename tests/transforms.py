"""Every public transform, as the cross-cutting tests build it: a factory, its
metrics prefix and a field every state of it records; a params tree and the
gradients of a step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

Factory = Callable[[], optax.GradientTransformation]

# name -> (factory, metric prefix, a field every state of it records)
TRANSFORMS: dict[str, tuple[Factory, str, str]] = {
    "clip_by_global_norm": (
        lambda: clipjax.clip_by_global_norm(1.0),
        "clip_by_global_norm",
        "scale",
    ),
    "clip_by_global_norm_inf": (
        lambda: clipjax.clip_by_global_norm(1.0, norm_type=float("inf")),
        "clip_by_global_norm",
        "grad_norm",
    ),
    "zclip": (lambda: clipjax.zclip(warmup_steps=2), "zclip", "threshold"),
    "zclip_per_param": (lambda: clipjax.zclip(warmup_steps=2, scope="per_param"), "zclip", "z"),
    "hist_clip": (lambda: clipjax.hist_clip(warmup_steps=2), "hist_clip", "threshold"),
    "hist_clip_ema_per_layer": (
        lambda: clipjax.hist_clip(clipjax.ema_criterion(), warmup_steps=2, scope="per_layer"),
        "hist_clip",
        "mean",
    ),
    "agc": (lambda: clipjax.agc(), "agc", "target"),
    "agc_per_layer": (lambda: clipjax.agc(scope="per_layer"), "agc", "weight_norm"),
    "adagc": (lambda: clipjax.adagc(warmup_steps=2), "adagc", "threshold"),
    "adaclip": (lambda: clipjax.adaclip(0.9), "adaclip", "clipped_fraction"),
    "adaclip_global": (
        lambda: clipjax.adaclip(scope="global", count_clipped=False),
        "adaclip",
        "bound",
    ),
    "ada_norm": (lambda: clipjax.ada_norm(), "ada_norm", "target_norm"),
    "ada_norm_per_layer": (lambda: clipjax.ada_norm(scope="per_layer"), "ada_norm", "mean"),
    "clip_norm_growth": (lambda: clipjax.clip_norm_growth(), "clip_norm_growth", "prev_norm"),
    "clip_by_historical_norm": (
        lambda: clipjax.clip_by_historical_norm(4),
        "clip_by_historical_norm",
        "std",
    ),
}
# Whole optimizers (full-size moments in their states): the contract here, not
# the clipper-only checks of test_compat.py.
OPTIMIZERS: dict[str, tuple[Factory, str, str]] = {
    "spam": (
        lambda: clipjax.spam(1e-2, reset_interval=4, warmup_steps=2, clip_delay=1),
        "spam",
        "resets",
    ),
    "stable_spam": (lambda: clipjax.stable_spam(1e-2, reset_interval=4), "stable_spam", "resets"),
    "stable_spam_uncounted": (
        lambda: clipjax.stable_spam(1e-2, reset_interval=4, count_clipped=False),
        "stable_spam",
        "resets",
    ),
    # A clipper whose state holds a full-size EMA of the updates; AdamWClip; AXLearn's
    # skip-and-clip around adamw.
    "clip_norm_by_ema": (lambda: clipjax.clip_norm_by_ema(), "clip_norm_by_ema", "ema_norm"),
    "adamw_clip": (
        lambda: clipjax.adamw(1e-2, clip_grad_adapt=1.0),
        "adamw_clip",
        "clipped_fraction",
    ),
    "skip_and_clip": (
        lambda: clipjax.skip_and_clip_by_global_norm(
            clipjax.adamw(1e-2),
            drop_norm=clipjax.drop_norm_by_grad_norm_ema((5,)),
            max_norm=1.0,
            grad_norm_ema_decay=0.9,
        ),
        "skip_and_clip_by_global_norm",
        "count_exceeds_5x_mean",
    ),
}
# Transforms whose metrics hold no gradient norm (spam reports its clip per element).
NORMLESS = {"spam"}

OPTIONAL = {
    "autoclip": (lambda: clipjax.autoclip(warmup_steps=2, min_history=2), "autoclip", "median"),
    "autoclip_window": (
        lambda: clipjax.autoclip(mode="percentile", window_size=4, warmup_steps=2, min_history=2),
        "autoclip",
        "quantile",
    ),
    "autoclip_ema_per_param": (
        lambda: clipjax.autoclip(mode="percentile", history="ema", scope="per_param"),
        "autoclip",
        "quantile",
    ),
    "zscore_clip": (
        lambda: clipjax.zscore_clip(warmup_steps=2, min_history=2),
        "zscore_clip",
        "std",
    ),
    "clip_by_value": (lambda: clipjax.clip_by_value(0.1), "clip_by_value", "clipped_fraction"),
    "clip_by_percentile": (
        lambda: clipjax.clip_by_percentile(90.0),
        "clip_by_percentile",
        "bound",
    ),
    "normalize_per_param": (
        lambda: clipjax.normalize_per_param(),
        "normalize_per_param",
        "grad_norm",
    ),
    "zscore_normalize": (lambda: clipjax.zscore_normalize(), "zscore_normalize", "grad_norm"),
}
for _key, _value in OPTIONAL.items():
    if hasattr(clipjax, _value[1]):
        TRANSFORMS[_key] = _value

IDS = sorted(TRANSFORMS)
# What this file checks: the clippers and the optimizers.
ALL = {**TRANSFORMS, **OPTIMIZERS}
ALL_IDS = sorted(ALL)


def make_params(dtype: Any = jnp.float32) -> Any:
    key = jax.random.PRNGKey(0)
    k1, k2, k3 = jax.random.split(key, 3)
    return {
        "params": {
            "Dense_0": {
                "kernel": jax.random.normal(k1, (6, 5), dtype),
                "bias": jnp.zeros((5,), dtype),
            },
            "Dense_1": {"kernel": jax.random.normal(k2, (5, 3), dtype), "bias": None},
            "scale": jax.random.normal(k3, (3,), dtype),
        }
    }


def grads_at(params: Any, step: int) -> Any:
    factor = 1.0 + 0.1 * np.sin(step) + (30.0 if step == 6 else 0.0)
    return jax.tree.map(lambda p: (p * factor + 0.01).astype(p.dtype), params)
