"""First, do no harm: what a start rule does to the optimizer's step.

A spike defence must protect the start of a run (the recorded start of the GPU
language model falls from a norm of 12-16 to 0.5 within 20 steps, with a
spike at step 16: ``docs/generated/replay.md``) without enlarging adam's step
where there is nothing to protect. Weighing the first steps down leaves adam's
second moment short of the later gradients (with weights ``w_s``, the step
grows by about ``sqrt(t / (t - sum(1 - w_s**2)))``); a step that the optimizer
skips, its state untouched, leaves no deficit.

**Stationary stream** (open loop, no start transient): 300 steps of
gradients with random Gaussian directions in 1,000 dimensions and lognormal
norms (median 1, sigma 0.2), three seeds. Each setting runs in front of
``optax.adam(1e-3)`` (in ``clipjax.chain`` or ``optax.chain``, as its row
says); the **step ratio** is the RMS of what it outputs over that of adam
alone on the same stream, at the same step. A setting that holds the first
``h`` steps (``clipjax.chain`` skips adam on them) starts adam ``h`` steps
later: its step ratio compares adam's first steps with adam alone's later
ones (adam's own first steps are larger), so the **optimizer-step ratio**
also compares its ``n``-th adam step with adam alone's ``n``-th on the steps
it took (the same for a setting that holds nothing). Targets: at
most 1.05 at every step, 0.97-1.03 on average over steps 10-299.

**Replay** (``benchmarks/replay.py``): the recorded norms of the three GPU
runs through the setting and adam's second moment, at a loss times 0.01 ...
100; the worst sqrt(v̂) from step 100 over the reference's, per seed (target
1.25 on every seed at every k).

Run: ``python benchmarks/start.py [--update-docs]`` (the former writes
``docs/generated/start.md``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import clipjax  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "generated", "start.md")
STEPS, DIM, SIGMA, SEEDS, LR = 300, 1000, 0.2, (0, 1, 2), 1e-3
MAX_RATIO, MEAN_RANGE, MEAN_FROM = 1.05, (0.97, 1.03), 10

# name -> (clipper code, route). The route is the chain it runs in.
CANDIDATES: dict[str, tuple[str, str]] = {
    "0.4: time weight": ('clipjax.zclip(feedback="clipped", start="weight")', "optax"),
    "no start rule": ('clipjax.zclip(feedback="clipped", start=None)', "optax"),
    "hold, in clipjax.chain": ('clipjax.zclip(feedback="clipped")', "clipjax"),
    "hold, in optax.chain": ('clipjax.zclip(feedback="clipped")', "optax"),
    "hold, in skip_on_spike(clipjax.chain)": ('clipjax.zclip(feedback="clipped")', "skip"),
}
REPLAY_ROWS = {
    "0.4: time weight": 'zclip(feedback="clipped", start="weight")',
    "no start rule": 'zclip(feedback="clipped", start=None)',
    "hold, in clipjax.chain": "recommended",
    "hold, in optax.chain": "recommended through optax.chain",
    "hold, in skip_on_spike(clipjax.chain)": "skip_on_spike(recommended)",
}


def stream(seed: int, steps: int = STEPS, dim: int = DIM, sigma: float = SIGMA) -> np.ndarray:
    """``[steps, dim]`` gradients: random directions, lognormal norms around 1."""
    rng = np.random.default_rng(seed)
    directions = rng.normal(size=(steps, dim))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    norms = np.exp(sigma * rng.normal(size=steps))
    return (directions * norms[:, None]).astype(np.float32)


def build(code: str, route: str) -> optax.GradientTransformation:
    clipper = eval(code, {"clipjax": clipjax, "optax": optax})
    if route == "optax":
        return optax.chain(clipper, optax.adam(LR))
    tx = clipjax.chain(clipper, clipjax.adam(LR))
    return clipjax.skip_on_spike(tx) if route == "skip" else tx


def outputs(tx: optax.GradientTransformation, grads: np.ndarray) -> np.ndarray:
    """What ``tx`` outputs at each step of ``grads`` (open loop), ``[steps, dim]``."""
    params = {"w": jnp.zeros(grads.shape[1], jnp.float32)}

    def step(state: Any, g: jax.Array) -> tuple[Any, jax.Array]:
        updates, state = tx.update({"w": g}, state, params)
        return state, updates["w"]

    return np.asarray(jax.jit(lambda xs: jax.lax.scan(step, tx.init(params), xs)[1])(grads))


def rms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.asarray(x, np.float64) ** 2, axis=-1))


class Boost(NamedTuple):
    """One setting on the stationary stream, per seed."""

    step_max: np.ndarray  # largest step ratio
    step_mean: np.ndarray  # mean step ratio over steps MEAN_FROM..
    opt_max: np.ndarray  # largest optimizer-step ratio
    opt_mean: np.ndarray  # its mean over the optimizer's steps MEAN_FROM..
    held: np.ndarray  # steps that reached no optimizer


def boost(code: str, route: str, seeds: tuple[int, ...] = SEEDS) -> Boost:
    fields: list[list[float]] = [[], [], [], [], []]
    for seed in seeds:
        grads = stream(seed)
        alone = rms(outputs(optax.adam(LR), grads))
        ours = rms(outputs(build(code, route), grads))
        ratio = ours / alone
        taken = ours > 0
        # adam alone on the steps this setting took: its n-th step against ours.
        again = rms(outputs(optax.adam(LR), grads[taken]))
        opt = ours[taken] / again
        for field, value in zip(
            fields,
            (
                ratio.max(),
                ratio[MEAN_FROM:].mean(),
                opt.max(),
                opt[MEAN_FROM:].mean(),
                float((~taken).sum()),
            ),
        ):
            field.append(float(value))
    return Boost(*(np.array(f) for f in fields))


def meets(b: Boost, which: str) -> bool:
    top, mean = (b.step_max, b.step_mean) if which == "step" else (b.opt_max, b.opt_mean)
    lo, hi = MEAN_RANGE
    return bool((top <= MAX_RATIO).all() and ((mean >= lo) & (mean <= hi)).all())


def markdown(boosts: dict[str, Boost], replays: dict[str, Any]) -> str:
    import replay

    per = lambda x, fmt: " / ".join(f"{v:{fmt}}" for v in x)
    out = [
        "**Stationary stream, per seed (0 / 1 / 2)**",
        "",
        "| candidate | setting | chain | held steps | step ratio, max "
        "| step ratio, mean 10-299 | optimizer-step ratio, max | optimizer-step ratio, mean "
        "| meets the target |",
        "|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, b in boosts.items():
        code, route = CANDIDATES[name]
        chain = {"optax": "optax.chain", "clipjax": "clipjax.chain", "skip": "skip_on_spike"}
        verdict = "yes" if meets(b, "optimizer") else "no"
        if meets(b, "optimizer") and not meets(b, "step"):
            verdict = "yes, a run delayed by the held steps"
        out.append(
            f"| {name} | `{code}` | {chain[route]} | {per(b.held, '.0f')} "
            f"| {per(b.step_max, '.2f')} | {per(b.step_mean, '.3f')} "
            f"| {per(b.opt_max, '.2f')} | {per(b.opt_mean, '.3f')} | {verdict} |"
        )
    out += [
        "",
        "Rule: meets the target when the optimizer-step ratio is at most "
        f"{MAX_RATIO} at every step and its mean over steps {MEAN_FROM}-299 lies in "
        f"{MEAN_RANGE[0]}-{MEAN_RANGE[1]}, "
        "on every seed.",
        "",
    ]
    if replays:
        scales = replay.SCALES
        cols = " | ".join(f"k = {k:g}" for k in scales)
        out += [
            "**Replay: sqrt(v̂) / reference from step 100, worst, per seed**",
            "",
            f"| candidate | {cols} | meets the target |",
            "|---|" + "---:|" * len(scales) + "---|",
        ]
        for name, by_scale in replays.items():
            cells = " | ".join(per(by_scale[k].worst, ".2f") for k in scales)
            ok = "yes" if replay.same_at_every_scale(by_scale) else "no"
            out.append(f"| {name} | {cells} | {ok} |")
        out += [
            "",
            f"Rule: at most {replay.TARGET} on every seed at every k, and the share of steps "
            f"changed after step 100 within {replay.MAX_SHIFT:.0%} of its share at k = 1.",
            "",
        ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update-docs", action="store_true", help=f"write {PAGE}")
    parser.add_argument("--no-replay", action="store_true", help="the stationary stream only")
    args = parser.parse_args()
    import replay

    boosts = {name: boost(code, route) for name, (code, route) in CANDIDATES.items()}
    replays = {}
    if not args.no_replay:
        results = replay.evaluate(list(dict.fromkeys(REPLAY_ROWS.values())))
        replays = {name: results[row] for name, row in REPLAY_ROWS.items()}
    table = markdown(boosts, replays)
    if args.update_docs:
        import common

        meta = common.header("python benchmarks/start.py --update-docs", load=False)
        doc = "\n\n".join(__doc__.split("\n\n")[1:4]).strip()
        title = "# First, do no harm: start rules against the optimizer's step"
        text = common.page(title, meta, doc, table.rstrip("\n"))
        with open(PAGE, "w") as f:
            f.write(text)
        print(text)
    else:
        print(table)


if __name__ == "__main__":
    main()
