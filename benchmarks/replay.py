"""Protecting a run from its first step: recorded gradient norms replayed through a clipper.

``tests/data/lm_spikes_gpu_norms.npz`` holds the raw global gradient norm and
the batch loss of every step of three unclipped runs (seeds 0-2, 2000 steps)
of the natural-spike language model of ``examples/lm_spikes.py --config gpu``,
recorded on one H200 (``tests/data/README.md`` says how). At initialisation
the norm is 12-16; it falls to about 0.5 within 20 steps and spikes to
15-28 at step 16 on every seed. Adam's second moment (b2 = 0.999) keeps that
mass for about a thousand steps and shrinks every later update: on the GPU
the runs that let it through stalled.

Each seed's stream is replayed **open loop** (clipping does not change the
later norms) as a one-element gradient through the setting, followed by
``optax.scale_by_adam(b1=0.9, b2=0.999)`` (inside ``skip_on_spike`` for the
skip rows, which also get the recorded loss as ``value``); ``v̂`` is adam's
bias-corrected second moment read from its state after each step. The
reference is the same recursion, in float64, on the stream with every step
bounded by 2x the median of the 50 raw norms before it (for the first 50
steps, which have no such history, 2x the median of steps 50-99: an oracle
no clipper can be, which knows the level the run settles at).

The table gives, per seed, the largest ``sqrt(v̂) / sqrt(v̂ reference)`` from
step 100 on: how much the start of the run still shrinks adam's updates,
relative to a clipper that caught every early spike at twice the level. The
share of steps clipped in the first 100 is read from ``clipjax.metrics`` (a
skip counts as clipped). A setting **protects the run from its first step**
when the ratio is at most 1.25 on every seed.

AGC is not replayed (its bound is relative to the parameters' norm, which the
recording does not have); SPAM and Stable-SPAM are optimizers with moments of
their own and are not either.

Run: ``python benchmarks/replay.py [--update-docs] [settings ...]`` (the
former writes ``docs/generated/replay.md``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(ROOT, "tests", "data", "lm_spikes_gpu_norms.npz")
PAGE = os.path.join(ROOT, "docs", "generated", "replay.md")
B1, B2 = 0.9, 0.999
WINDOW = 50  # the reference bounds a step by BOUND x the median of this many norms before it
BOUND = 2.0
FROM_STEP = 100  # the ratio is judged from this step on
EARLY = 100  # "clipped early": the share of the first EARLY steps clipped
TARGET = 1.25


def recommended() -> str:
    """The README's recommended setting, from its one source."""
    with open(os.path.join(ROOT, "docs", "generated", "recommended.md")) as f:
        return re.search(r"`(clipjax\.[^`]+)`", f.read()).group(1)


def build(code: str) -> optax.GradientTransformation:
    return eval(code, {"clipjax": clipjax, "optax": optax})


# name -> (code of the clipper, or None for no clipping; wrapped in skip_on_spike)
def settings() -> dict[str, tuple[str | None, bool]]:
    rec = recommended()
    return {
        "none": (None, False),
        "recommended": (rec, False),
        "skip_on_spike(recommended)": (rec, True),
        "skip_on_spike(adam)": (None, True),
        "clip_by_global_norm(1.0)": ("clipjax.clip_by_global_norm(1.0)", False),
        "autoclip()": ("clipjax.autoclip()", False),
        'autoclip(feedback="clipped")': ('clipjax.autoclip(feedback="clipped")', False),
        "zscore_clip()": ("clipjax.zscore_clip()", False),
        'zscore_clip(feedback="clipped")': ('clipjax.zscore_clip(feedback="clipped")', False),
        "zclip()": ("clipjax.zclip()", False),
        'zclip(feedback="clipped")': ('clipjax.zclip(feedback="clipped")', False),
        'zclip(feedback="clipped", max_grad_norm=None)': (
            'clipjax.zclip(feedback="clipped", max_grad_norm=None)',
            False,
        ),
        "hist_clip()": ("clipjax.hist_clip()", False),
        'hist_clip(feedback="clipped")': ('clipjax.hist_clip(feedback="clipped")', False),
        "adagc()": ("clipjax.adagc()", False),
        'adagc(feedback="clipped")': ('clipjax.adagc(feedback="clipped")', False),
        "adaclip()": ("clipjax.adaclip()", False),
        "ada_norm()": ("clipjax.ada_norm()", False),
    }


def load() -> tuple[np.ndarray, np.ndarray]:
    """``(norms, losses)`` of the unclipped runs, ``[seeds, steps]`` float64."""
    data = np.load(DATA)
    return data["none/grad_norm"].astype(np.float64), data["none/loss"].astype(np.float64)


def reference_bound(norms: np.ndarray) -> np.ndarray:
    """Each step bounded by BOUND x the median of the WINDOW raw norms before it."""
    out = norms.copy()
    for t in range(norms.shape[-1]):
        before = norms[..., t - WINDOW : t] if t >= WINDOW else norms[..., WINDOW : 2 * WINDOW]
        out[..., t] = np.minimum(norms[..., t], BOUND * np.median(before, axis=-1))
    return out


def adam_rms(norms: np.ndarray) -> np.ndarray:
    """sqrt(v̂) of adam's second moment on a stream of one-element gradients, float64."""
    v = np.zeros(norms.shape[:-1])
    out = np.empty_like(norms)
    for t in range(norms.shape[-1]):
        v = B2 * v + (1 - B2) * norms[..., t] ** 2
        out[..., t] = np.sqrt(v / (1 - B2 ** (t + 1)))
    return out


def replay(code: str | None, skip: bool, norms: np.ndarray, losses: np.ndarray) -> tuple:
    """``(sqrt(v̂), clipped)``, each ``[seeds, steps]``, of one setting."""
    clipper = optax.identity() if code is None else build(code)
    inner = optax.chain(clipper, optax.scale_by_adam(b1=B1, b2=B2))
    tx = clipjax.skip_on_spike(inner) if skip else inner
    params = {"w": jnp.zeros((1,), jnp.float32)}

    def one(xs: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(state, inputs):
            g, value = inputs
            extra = {"value": value} if skip else {}
            _, state = tx.update({"w": g[None]}, state, params, **extra)
            adam = optax.tree_utils.tree_get(state, "ScaleByAdamState")
            v_hat = adam.nu["w"][0] / (1 - B2 ** adam.count.astype(jnp.float32))
            m = clipjax.metrics(state) if code is not None or skip else {}
            flags = [jnp.any(v) for k, v in m.items() if k.endswith(("/clipped", "/skipped"))]
            clipped = jnp.any(jnp.stack(flags)) if flags else jnp.zeros((), bool)
            return state, (jnp.sqrt(v_hat), clipped)

        return jax.lax.scan(step, tx.init(params), (xs, values))[1]

    run = jax.jit(jax.vmap(one))
    rms, clipped = run(jnp.asarray(norms, jnp.float32), jnp.asarray(losses, jnp.float32))
    return np.asarray(rms, np.float64), np.asarray(clipped)


class Result:
    """One setting's figures, per seed."""

    def __init__(self, rms: np.ndarray, reference: np.ndarray, clipped: np.ndarray) -> None:
        ratio = rms[:, FROM_STEP:] / reference[:, FROM_STEP:]
        self.worst = ratio.max(axis=1)
        self.mean = ratio.mean(axis=1)
        self.clipped_early = clipped[:, :EARLY].mean(axis=1)
        self.clipped = clipped.mean(axis=1)

    def protects(self) -> bool:
        return bool((self.worst <= TARGET).all())


def evaluate(names: list[str] | None = None) -> dict[str, Result]:
    norms, losses = load()
    reference = adam_rms(reference_bound(norms))
    table = settings()
    results = {}
    for name in names or list(table):
        code, skip = table[name]
        rms, clipped = replay(code, skip, norms, losses)
        results[name] = Result(rms, reference, clipped)
    return results


def markdown(results: dict[str, Result]) -> str:
    per = lambda x, fmt: " / ".join(f"{v:{fmt}}" for v in x)
    lines = [
        "| setting | sqrt(v̂) / reference from step 100, worst (per seed) | mean (per seed) "
        "| clipped, first 100 steps | clipped, all steps | protects |",
        "|---|---:|---:|---:|---:|---|",
    ]
    rec = recommended()
    for name, r in results.items():
        label = name.replace("recommended", f"recommended: {rec}")
        lines.append(
            f"| `{label}` | {per(r.worst, '.2f')} | {per(r.mean, '.2f')} "
            f"| {per(r.clipped_early, '.0%')} | {per(r.clipped, '.0%')} "
            f"| {'yes' if r.protects() else 'no'} |"
        )
    return "\n".join(lines)


def page(results: dict[str, Result]) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    meta = [
        line
        for line in common.header("python benchmarks/replay.py --update-docs")
        if "load average" not in line
    ]
    doc = __doc__.split("\n\n")
    return "\n".join(
        [
            "# Protecting a run from its first step: recorded norms replayed",
            "",
            *meta,
            "",
            "\n\n".join(doc[1:5]).strip(),
            "",
            markdown(results),
            "",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-docs", action="store_true", help=f"write {PAGE}")
    parser.add_argument("settings", nargs="*", help="setting names (default: all)")
    args = parser.parse_args()
    results = evaluate(args.settings or None)
    text = page(results) if args.update_docs else markdown(results)
    if args.update_docs:
        with open(PAGE, "w") as f:
            f.write(text)
    print(text)


if __name__ == "__main__":
    main()
