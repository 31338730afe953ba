"""The start of a run at any gradient scale: recorded norms replayed through a clipper.

``tests/data/lm_spikes_gpu_norms.npz`` holds the raw global gradient norm and
the batch loss of every step of three unclipped runs (seeds 0-2, 2000 steps)
of the natural-spike language model of ``examples/lm_spikes.py --config gpu``,
recorded on one H200 (``tests/data/README.md`` says how). At initialisation
the norm is 12-16; it falls to about 0.5 within 20 steps and spikes to
15-28 at step 16 on every seed. Adam's second moment (b2 = 0.999) keeps that
mass for about a thousand steps and shrinks every later update: on the GPU
the runs that let it through stalled.

Each seed's stream is multiplied by k (a loss times k: k = 0.01, 0.1, 1, 10,
100) and replayed **open loop** (clipping does not change the later norms) as
a one-element gradient through the setting, followed by
``optax.scale_by_adam(b1=0.9, b2=0.999)`` in ``clipjax.chain``, which skips
adam on a step the setting holds (``optax.chain`` for the rows that say so;
inside ``skip_on_spike`` for the
skip rows, which also get the recorded loss times k as ``value``); ``v̂`` is
adam's bias-corrected second moment after each step. Adam alone does the same
thing at every k; a setting with an absolute number in its rule does not. The
reference is the same recursion, in float64, on the stream with every step
bounded by 2x the median of the 50 raw norms before it (for the first 50
steps, 2x the median of steps 50-99: an oracle no clipper can be, which knows
the level the run settles at), times k.

Per setting, k and seed:

* **sqrt(v̂) / reference**: the largest ratio from step 100 on: how much the
  start of the run still shrinks adam's updates;
* **relative to the level**: the same for ``sqrt(v̂)`` over the running median
  (50 steps) of the norm the optimizer receives, against the reference's
  (for a setting that rescales every step, which makes the first measure
  meaningless);
* **changed after step 100**: the share of steps from step 100 on whose norm
  the setting changed (clipped, scaled or skipped).

A setting is **the same at every scale** when, on every seed and every k, the
first ratio is at most 1.25 and the share changed is within 5 points of its
share at k = 1. AGC is not replayed (its bound is relative to the parameters'
norm, which the recording does not have); SPAM and Stable-SPAM are optimizers
with moments of their own and are not either.

Run: ``python benchmarks/replay.py [--update-docs] [settings ...]`` (the
former writes ``docs/generated/replay.md``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Any, NamedTuple

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
FROM_STEP = 100  # the ratios and the share changed are judged from this step on
SCALES = (0.01, 0.1, 1.0, 10.0, 100.0)
TARGET = 1.25
MAX_SHIFT = 0.05  # the share changed within 5 points of its share at k = 1
CHANGED = 1e-5  # a norm moved by more than float32 rounding


def recommended() -> str:
    """The README's recommended setting, from its one source."""
    with open(os.path.join(ROOT, "docs", "generated", "recommended.md")) as f:
        return re.search(r"`(clipjax\.[^`]+)`", f.read()).group(1)


def build(code: str) -> optax.GradientTransformation:
    return eval(code, {"clipjax": clipjax, "optax": optax})


# name -> (code of the clipper, or None for no clipping; wrapped in skip_on_spike).
# Every reference default and every feedback="clipped" setting, in clipjax.chain
# (which skips adam on the steps a clipper holds); OPTAX_CHAIN rows in optax.chain.
OPTAX_CHAIN = " through optax.chain"


def settings() -> dict[str, tuple[str | None, bool]]:
    rec = recommended()
    table: dict[str, tuple[str | None, bool]] = {
        "none": (None, False),
        "recommended": (rec, False),
        "skip_on_spike(recommended)": (rec, True),
        "recommended" + OPTAX_CHAIN: (rec, False),
        "skip_on_spike(adam)": (None, True),
    }
    for code in (
        "clip_by_global_norm(1.0)",
        "autoclip()",
        'autoclip(feedback="clipped")',
        "zscore_clip()",
        'zscore_clip(feedback="clipped")',
        "zclip()",
        'zclip(feedback="clipped")',
        'zclip(feedback="clipped", max_grad_norm=1.0)',
        'zclip(feedback="clipped", max_grad_norm=None, relative_ceiling=None)',
        'zclip(feedback="clipped", start="weight")',
        'zclip(feedback="clipped", start=None)',
        "hist_clip()",
        'hist_clip(feedback="clipped")',
        "adagc()",
        'adagc(feedback="clipped")',
        "adaclip()",
        "ada_norm()",
    ):
        table[code] = (f"clipjax.{code}", False)
    return table


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


def running_median(x: np.ndarray, window: int = WINDOW) -> np.ndarray:
    """The median of the last ``window`` values up to and including each step."""
    out = np.empty_like(x)
    for t in range(x.shape[-1]):
        out[..., t] = np.median(x[..., max(0, t - window + 1) : t + 1], axis=-1)
    return out


def _recorder() -> optax.GradientTransformation:
    """Passes the updates through and keeps the last one's value: what adam receives."""
    return optax.GradientTransformation(
        lambda params: jnp.zeros((1,), jnp.float32), lambda u, s, p=None: (u, u["w"])
    )


def replay(
    code: str | None, skip: bool, norms: np.ndarray, losses: np.ndarray, route: str = "clipjax"
) -> tuple:
    """``(sqrt(v̂), |received|)``, each ``[seeds, steps]``, of one setting, in
    ``clipjax.chain`` (``route="clipjax"``) or ``optax.chain``."""
    clipper = optax.identity() if code is None else build(code)
    chain = clipjax.chain if route == "clipjax" else optax.chain
    inner = chain(clipper, _recorder(), optax.scale_by_adam(b1=B1, b2=B2))
    tx = clipjax.skip_on_spike(inner) if skip else inner
    params = {"w": jnp.zeros((1,), jnp.float32)}

    def one(xs: jax.Array, values: jax.Array) -> tuple[jax.Array, jax.Array]:
        def step(state: Any, inputs: tuple) -> tuple:
            g, value = inputs
            extra = {"value": value} if skip else {}
            _, state = tx.update({"w": g[None]}, state, params, **extra)
            adam = optax.tree_utils.tree_get(state, "ScaleByAdamState")
            v_hat = adam.nu["w"][0] / (1 - B2 ** adam.count.astype(jnp.float32))
            received = jnp.abs((state.inner_state if skip else state)[1][0])
            # A step the clipper held reached no optimizer (clipjax.chain skipped it).
            held = None if code is None else clipjax.metrics(state).get("zclip/global/held")
            if held is not None and route == "clipjax":
                received = jnp.where(held > 0, 0.0, received)
            if skip:
                skipped = clipjax.metrics(state)["skip_on_spike/global/skipped"]
                received = jnp.where(skipped > 0, 0.0, received)
            return state, (jnp.sqrt(v_hat), received)

        return jax.lax.scan(step, tx.init(params), (xs, values))[1]

    run = jax.jit(jax.vmap(one))
    rms, received = run(jnp.asarray(norms, jnp.float32), jnp.asarray(losses, jnp.float32))
    return np.asarray(rms, np.float64), np.asarray(received, np.float64)


class Result(NamedTuple):
    """One setting at one scale, per seed."""

    worst: np.ndarray  # largest sqrt(v̂) / reference from FROM_STEP
    relative: np.ndarray  # the same, each over the running median of what adam receives
    changed: np.ndarray  # share of steps from FROM_STEP whose norm the setting changed


def measure(rms: np.ndarray, received: np.ndarray, norms: np.ndarray, reference: tuple) -> Result:
    ref_rms, ref_relative = reference
    ratio = rms[:, FROM_STEP:] / ref_rms[:, FROM_STEP:]
    level = np.maximum(running_median(received), np.finfo(np.float32).tiny)
    relative = (rms / level)[:, FROM_STEP:] / ref_relative[:, FROM_STEP:]
    moved = np.abs(received - norms) > CHANGED * norms
    return Result(ratio.max(axis=1), relative.max(axis=1), moved[:, FROM_STEP:].mean(axis=1))


def evaluate(
    names: list[str] | None = None, scales: tuple[float, ...] = SCALES
) -> dict[str, dict[float, Result]]:
    """``{setting: {k: Result}}``."""
    norms, losses = load()
    bounded = reference_bound(norms)
    ref_rms = adam_rms(bounded)
    reference = (ref_rms, ref_rms / running_median(bounded))
    table = settings()
    results: dict[str, dict[float, Result]] = {}
    for name in names or list(table):
        code, skip = table[name]
        results[name] = {}
        for k in scales:
            route = "optax" if name.endswith(OPTAX_CHAIN) else "clipjax"
            rms, received = replay(code, skip, k * norms, k * losses, route)
            # Divided by k: at every scale the reference is the k = 1 one, times k.
            results[name][k] = measure(rms / k, received / k, norms, reference)
    return results


def same_at_every_scale(by_scale: dict[float, Result]) -> bool:
    """At most TARGET on every seed and scale, the share changed within MAX_SHIFT of k = 1's."""
    base = by_scale[1.0].changed
    return all(
        (r.worst <= TARGET).all() and (np.abs(r.changed - base) <= MAX_SHIFT + 1e-9).all()
        for r in by_scale.values()
    )


def markdown(results: dict[str, dict[float, Result]]) -> str:
    per = lambda x, fmt: " / ".join(f"{v:{fmt}}" for v in x)
    rec = recommended()
    label = lambda name: name.replace("recommended", f"recommended: {rec}")
    scales = list(next(iter(results.values())))
    rule = "|---|" + "---:|" * len(scales)
    out = []
    relative = "relative to the level: sqrt(v̂) / running median received, over the reference's"
    # Each table's columns carry its measure, so that a figure quoted from the page
    # names one cell: "k = 1", "k = 1, relative", "k = 1, changed".
    for title, field, fmt, suffix in (
        ("sqrt(v̂) / reference from step 100, worst, per seed", "worst", ".2f", ""),
        (relative, "relative", ".2f", ", relative"),
        ("changed after step 100, per seed", "changed", ".0%", ", changed"),
    ):
        extra = " same at every scale |" if field == "worst" else ""
        k_cols = " | ".join(f"k = {k:g}{suffix}" for k in scales)
        head = f"| setting | {k_cols} |{extra}"
        out += [f"**{title}**", "", head, rule + ("---|" if extra else "")]
        for name, by_scale in results.items():
            cells = " | ".join(per(getattr(by_scale[k], field), fmt) for k in scales)
            verdict = f" {'yes' if same_at_every_scale(by_scale) else 'no'} |" if extra else ""
            out.append(f"| `{label(name)}` | {cells} |{verdict}")
        out.append("")
    return "\n".join(out)


def page(results: dict[str, dict[float, Result]]) -> str:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import common

    meta = common.header("python benchmarks/replay.py --update-docs", load=False)
    doc = "\n\n".join(__doc__.split("\n\n")[1:6]).strip()
    title = "# The start of a run at any gradient scale: recorded norms replayed"
    return common.page(title, meta, doc, markdown(results).rstrip("\n"))


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
