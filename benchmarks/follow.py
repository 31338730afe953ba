"""Do the adaptive clippers follow a training run? A synthetic norm stream.

Each seed's stream of global gradient norms looks like a training run:

* steps 0-99: large early norms, decaying geometrically by x20 to the level 1;
* steps 100-299: level 1;
* steps 300-599: a lasting shift up to level 3;
* lognormal noise (sigma 0.2) on every step, and x10 spikes at 8 random
  steps after step 110 (at least 15 steps apart).

The stream is fed to each clipper (open loop: clipping does not change later
norms). Per setting, over seeds:

* ``clip 100-299`` / ``clip 300-349`` / ``clip 350-599``: the share of
  non-spike steps clipped in each phase (a clipper that follows the run clips
  few once the level has settled, and stops clipping soon after the shift);
* ``caught``: the share of spikes clipped, and ``passed``: the median of
  (norm after clipping) / (level at that step) over spikes (1 is a spike cut
  back to the level, 10 a spike let through).

``spam()`` and ``stable_spam()`` are optimizers: the gradient they clip is
read back from Adam's first moment, and counted as clipped when it is below
the input by more than float32 rounding of that read-back (1e-4).

Run: ``python benchmarks/follow.py [--seeds 5]``.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

STEPS = 600
SHIFT = 300


def stream(seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(STEPS)
    level = np.where(t < 100, 20.0 ** (1 - t / 100), 1.0)
    level = np.where(t >= SHIFT, 3.0, level)
    norms = level * np.exp(0.2 * rng.standard_normal(STEPS))
    spikes: list[int] = []
    while len(spikes) < 8:
        s = int(rng.integers(110, STEPS))
        if all(abs(s - o) >= 15 for o in spikes) and abs(s - SHIFT) >= 15:
            spikes.append(s)
    spikes.sort()
    norms[spikes] *= 10.0
    return norms, level, np.asarray(spikes)


SETTINGS = {
    # what main (2ace39c) gives for feedback="clipped"
    "before: autoclip(feedback='clipped')": lambda: clipjax.autoclip(
        feedback="clipped", warmup_steps=100, min_history=50
    ),
    "before: zscore_clip(feedback='clipped')": lambda: clipjax.zscore_clip(
        feedback="clipped", warmup_steps=100, min_history=50
    ),
    "hist_clip(feedback='clipped')": lambda: clipjax.hist_clip(feedback="clipped"),
    "zclip()": lambda: clipjax.zclip(),
    "zclip(max_grad_norm=None)": lambda: clipjax.zclip(max_grad_norm=None),
    "adagc(scope='global')": lambda: clipjax.adagc(scope="global"),
    # this branch
    "autoclip(feedback='clipped')": lambda: clipjax.autoclip(feedback="clipped"),
    "autoclip(feedback='clipped', history='window')": lambda: clipjax.autoclip(
        feedback="clipped", history="window"
    ),
    "zscore_clip(feedback='clipped')": lambda: clipjax.zscore_clip(feedback="clipped"),
    "hist_clip(feedback='clipped', warmup_steps=10)": lambda: clipjax.hist_clip(
        feedback="clipped", warmup_steps=10
    ),
    "hist_clip(feedback='clipped', warmup_steps=10, warmup_clip=None)": lambda: clipjax.hist_clip(
        feedback="clipped", warmup_steps=10, warmup_clip=None
    ),
    "zclip(max_grad_norm=None, warmup_steps=10)": lambda: clipjax.zclip(
        max_grad_norm=None, warmup_steps=10
    ),
    # Stable-SPAM's pieces (one element: AdaClip's bound is an EMA of |g|;
    # AdaGN rescales every step to a norm near 1, so it "clips" every step
    # above that and lifts those below).
    "adaclip(scope='global')": lambda: clipjax.adaclip(scope="global"),
    "ada_norm(scope='global')": lambda: clipjax.ada_norm(scope="global"),
}
# Optimizers: the gradient they clip is read back from Adam's first moment,
# g = (m_t - b1 m_{t-1}) / (1 - b1) (m_{t-1} = 0 on a reset step).
OPTIMIZERS = {
    "spam()": (lambda: clipjax.spam(1e-3), "spam"),
    "stable_spam()": (lambda: clipjax.stable_spam(1e-3), "stable_spam"),
}
B1 = 0.9


def run(tx, norms: np.ndarray) -> np.ndarray:
    """The norm after clipping, per step."""
    params = {"w": jnp.zeros((1,), jnp.float32)}
    state0 = tx.init(params)

    def step(state, g):
        out, state = tx.update({"w": g[None]}, state, params)
        return state, jnp.abs(out["w"][0])

    return np.asarray(
        jax.jit(lambda s: jax.lax.scan(step, state0, s)[1])(jnp.asarray(norms, jnp.float32))
    )


def run_optimizer(tx, algo: str, norms: np.ndarray) -> np.ndarray:
    """The gradient the optimizer's moments saw, per step, and whether it was changed."""
    params = {"w": jnp.zeros((1,), jnp.float32)}
    state0 = tx.init(params)

    def step(state, g):
        _, new = tx.update({"w": g[None]}, state, params)
        old_mu = optax.tree_utils.tree_get(state, "mu")["w"][0]
        mu = optax.tree_utils.tree_get(new, "mu")["w"][0]
        reset = clipjax.metrics(new)[f"{algo}/global/steps_since_reset"] == 0
        seen = (mu - B1 * jnp.where(reset, 0.0, old_mu)) / (1 - B1)
        return new, jnp.abs(seen)

    return np.asarray(
        jax.jit(lambda s: jax.lax.scan(step, state0, s)[1])(jnp.asarray(norms, jnp.float32))
    )


def _share(clipped: np.ndarray, plain: np.ndarray, a: int, b: int) -> float:
    """Share of the non-spike steps in ``[a, b)`` that were clipped."""
    return float(clipped[a:b][plain[a:b]].mean())


def row(name: str, seeds: int) -> str:
    rows = []
    for seed in range(seeds):
        norms, level, spikes = stream(seed)
        if name in OPTIMIZERS:
            make, algo = OPTIMIZERS[name]
            out = run_optimizer(make(), algo, norms)
            # float32 moments: the read-back gradient is exact to about 1e-5.
            clipped = out < norms.astype(np.float32) * (1 - 1e-4)
        else:
            out = run(SETTINGS[name](), norms)
            clipped = out < norms.astype(np.float32) * (1 - 1e-6)
        plain = np.ones(STEPS, bool)
        plain[spikes] = False
        rows.append(
            (
                _share(clipped, plain, 100, SHIFT),
                _share(clipped, plain, SHIFT, SHIFT + 50),
                _share(clipped, plain, SHIFT + 50, STEPS),
                clipped[spikes].mean(),
                np.median(out[spikes] / level[spikes]),
            )
        )
    m = np.mean(rows, axis=0)
    return f"| `{name}` | {m[0]:.1%} | {m[1]:.1%} | {m[2]:.1%} | {m[3]:.0%} | {m[4]:.2f} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    print("| setting | clip 100-299 | clip 300-349 | clip 350-599 | caught | passed |")
    print("|" + "---|" * 6)
    for name in [*SETTINGS, *OPTIMIZERS]:
        print(row(name, args.seeds))


if __name__ == "__main__":
    main()
