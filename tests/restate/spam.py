"""Float64 NumPy restatements of clipjax's ``spam`` and ``stable_spam``.

They state clipjax's rule element by element in float64: the references'
(:mod:`tests.references.spam`) arithmetic with optax's decoupled weight decay,
``p - lr * (update + weight_decay * p)``, and clipjax's fixes. A NaN or infinite
gradient element leaves its parameter where it is and its moments as they were;
Stable-SPAM's AdaClip maximum and AdaGN norm are taken over the finite elements (a
non-finite one counts as 0), so every other element updates as in the same step with
that element 0."""

from __future__ import annotations

import numpy as np


def _warmup_factor(since: int, warmup_steps: int) -> float:
    """pytorch-optimizer's ``1 - CosineDecay(0.99, W).get_death_rate(c)``."""
    if since >= warmup_steps:
        return 1.0
    return 1.0 - 0.99 * (1.0 + np.cos(np.pi * (since + 1) / (warmup_steps + 1))) / 2.0


def restate_spam(
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    *,
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-6,
    weight_decay: float = 0.0,
    threshold: float = 5000,
    reset_interval: int = 500,
    warmup_steps: int = 50,
    clip_delay: int = 20,
) -> list[dict[str, np.ndarray]]:
    """clipjax's ``spam`` in float64: the parameters after each step."""
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    m = {k: np.zeros_like(v) for k, v in p.items()}
    v = {k: np.zeros_like(x) for k, x in p.items()}
    out = []
    for t, step in enumerate(grads, start=1):
        since = t % reset_interval
        reset = since == 0
        warm = _warmup_factor(since, warmup_steps) if t >= max(reset_interval, 2) else 1.0
        clip_on = threshold != 0 and t >= clip_delay and since >= clip_delay
        scale = np.sqrt(1 - b2**t) / (1 - b1**t)
        for k in p:
            g = np.asarray(step[k], np.float64)
            if reset:
                m[k], v[k] = np.zeros_like(m[k]), np.zeros_like(v[k])
            finite = np.isfinite(g)
            g = np.where(finite, g, 0.0)
            limit = threshold * v[k]
            spike = clip_on & (g * g > limit) & (v[k] > 0) & finite
            clipped = np.where(spike, np.sign(g) * np.sqrt(limit), g)
            m[k] = np.where(finite, b1 * m[k] + (1 - b1) * clipped, m[k])
            v[k] = np.where(finite, b2 * v[k] + (1 - b2) * clipped * clipped, v[k])
            update = warm * scale * m[k] / (np.sqrt(v[k]) + eps)
            p[k] = np.where(finite, p[k] - learning_rate * (update + weight_decay * p[k]), p[k])
        out.append({k: x.copy() for k, x in p.items()})
    return out


def restate_stable_spam(
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    *,
    learning_rate: float,
    b1: float = 0.9,
    b2: float = 0.999,
    gamma1: float = 0.7,
    gamma2: float = 0.9,
    theta: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    reset_interval: int = 1000,
) -> list[dict[str, np.ndarray]]:
    """clipjax's ``stable_spam`` (``scope="per_param"``) in float64: the parameters after each step.

    Per tensor: AdaClip (the EMA of the largest finite ``|g|``, bias corrected
    by the steps seen; elements above the bound scaled by ``bound / max``),
    AdaGN (the gradient rescaled to ``mean / (sqrt(mean_square) + eps)`` of
    EMAs of the finite elements' norm, counted over nonzero norms), then Adam
    whose moments reset every ``reset_interval`` steps, its bias correction
    restarting there, and the decoupled weight decay.
    """
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    zeros = {k: np.zeros_like(v) for k, v in p.items()}
    m, v = dict(zeros), dict(zeros)
    max_ema = dict.fromkeys(p, 0.0)
    norm_ema, square_ema = dict.fromkeys(p, 0.0), dict.fromkeys(p, 0.0)
    observed = dict.fromkeys(p, 0)
    out = []
    for t, step in enumerate(grads, start=1):
        since = t % reset_interval
        bc_step = since + 1 if t >= reset_interval else t
        for k in p:
            g = np.asarray(step[k], np.float64)
            finite = np.isfinite(g)
            gz = np.where(finite, g, 0.0)
            # AdaClip.
            largest = np.abs(gz).max() if gz.size else 0.0
            max_ema[k] = theta * max_ema[k] + (1 - theta) * largest
            bound = max_ema[k] / (1 - theta**t)
            if largest > bound:
                gz = np.where(np.abs(gz) > bound, gz * (bound / largest), gz)
            # AdaGN.
            norm = np.sqrt(np.sum(gz * gz))
            if norm > 0:
                observed[k] += 1
                norm_ema[k] = gamma1 * norm_ema[k] + (1 - gamma1) * norm
                square_ema[k] = gamma2 * square_ema[k] + (1 - gamma2) * norm * norm
            n = max(observed[k], 1)
            mean = norm_ema[k] / (1 - gamma1**n)
            mean_square = square_ema[k] / (1 - gamma2**n)
            if norm > 0:
                gz = gz * (mean / (np.sqrt(mean_square) + eps)) / norm
            # Adam with moment resets.
            if since == 0:
                m[k], v[k] = np.zeros_like(m[k]), np.zeros_like(v[k])
            m[k] = np.where(finite, b1 * m[k] + (1 - b1) * gz, m[k])
            v[k] = np.where(finite, b2 * v[k] + (1 - b2) * gz * gz, v[k])
            m_hat = m[k] / (1 - b1**bc_step)
            v_hat = v[k] / (1 - b2**bc_step)
            update = m_hat / (np.sqrt(v_hat) + eps)
            p[k] = np.where(finite, p[k] - learning_rate * (update + weight_decay * p[k]), p[k])
        out.append({k: x.copy() for k, x in p.items()})
    return out
