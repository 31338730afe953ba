"""clipjax next to smartclip's JAX backend: what runs, what fails, and how fast.

smartclip clips with ``smartclip.backends.jax.apply_grads(grads, params,
clipper)`` in Python, outside ``jit`` (it calls ``float()`` on every norm),
then an optax optimizer steps. Every smartclip clipper is run eagerly in every
scope past its warm-up (the first error is kept verbatim, with the smartclip
line that raised it), ``apply_grads`` is tried under ``jax.jit``, and the
paths that run are timed interleaved against clipjax's clipper of the same
algorithm and scope: the clipping alone (``apply_grads`` vs clipjax's jitted
``update``) and the whole step (``apply_grads`` + a jitted adam step vs
clipjax's jitted ``chain(clipper, adam)``).

    python benchmarks/smartclip_jax.py [--quick]
"""

from __future__ import annotations

import traceback
from typing import Any

import common
import jax
import smartclip
from smartclip.backends import jax as sc_jax

import clipjax

# smartclip class -> (clipjax factory, keyword arguments both take)
PAIRS: dict[str, tuple[Any, dict[str, Any]]] = {
    "AutoClip": (clipjax.autoclip, {"warmup_steps": common.WARM, "min_history": common.WARM}),
    "ZScoreClip": (clipjax.zscore_clip, {"warmup_steps": common.WARM, "min_history": common.WARM}),
    "AGC": (clipjax.agc, {"clipping": 0.01}),
}
STEPS = 2 * common.WARM + 2


def _error(err: BaseException) -> tuple[str, str]:
    """The error's first line, and the smartclip line that raised it."""
    where = ""
    for frame in traceback.extract_tb(err.__traceback__):
        if "smartclip" in frame.filename:
            path = frame.filename[frame.filename.index("smartclip") :]
            where = f"{path}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "`" + f"{type(err).__name__}: {err}".splitlines()[0] + "`", where


def probe(cls: str, scope: str, params: Any, grads: Any) -> list[Any]:
    clipper = getattr(smartclip, cls)(**PAIRS[cls][1], scope=scope)
    for i in range(STEPS):
        try:
            jax.block_until_ready(sc_jax.apply_grads(grads, params, clipper))
        except Exception as err:  # the measurement: what fails, where
            return [f"{cls}[{scope}]", i, *_error(err)]
    return [f"{cls}[{scope}]", STEPS, "runs", ""]


def time_pair(key: str, shapes: Any, size: common.Sizes) -> list[Any]:
    cls, scope = key[:-1].split("[")
    factory, kwargs = PAIRS[cls]
    params, grads = common.params_and_grads(shapes)
    clipper = getattr(smartclip, cls)(**kwargs, scope=scope)
    tx = factory(**kwargs, scope=scope)
    update = jax.jit(tx.update)
    adam = jax.jit(common.train_step(common.adam(), False))
    group = common.Group(key, {key: common.plus_adam(lambda: factory(**kwargs, scope=scope))})
    box = {"cj": tx.init(params), "p": params, "s": common.adam().init(params)}

    def sc_clip(steps: int) -> None:
        for _ in range(steps):
            out = sc_jax.apply_grads(grads, params, clipper)
        jax.block_until_ready(out)

    def cj_clip(steps: int) -> None:
        for _ in range(steps):
            out, box["cj"] = update(grads, box["cj"], params)
        jax.block_until_ready(out)

    def sc_step(steps: int) -> None:
        for _ in range(steps):
            clipped = sc_jax.apply_grads(grads, box["p"], clipper)
            box["p"], box["s"] = adam(box["p"], box["s"], clipped, 1.0)
        jax.block_until_ready(box["p"])

    cj_step = common.run_steps(key, group, shapes, params, grads)
    runs = {"sc clip": sc_clip, "cj clip": cj_clip, "sc step": sc_step, "cj step": cj_step}
    t = common.interleave(runs, size.rounds, common.block_steps(runs, size.block_s))[0]
    row = [common.describe(shapes), key]
    for what in ("clip", "step"):
        speedup = common.ratios(t[f"sc {what}"], t[f"cj {what}"])
        row += [common.ms(t[f"sc {what}"]), common.ms(t[f"cj {what}"])]
        row.append(common.spread(speedup, "{:.1f}"))
    return row, common.median(speedup)


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    shapes = common.transformer_shapes(**size.model)
    params, grads = common.params_and_grads(shapes)
    common.log("  smartclip: probes")
    probes = [probe(c, s, params, grads) for c in PAIRS for s in common.SCOPES]
    try:
        clipper = smartclip.AutoClip(scope="per_param")
        jax.jit(lambda g, p: sc_jax.apply_grads(g, p, clipper))(grads, params)
        probes.append(["AutoClip[per_param] under `jax.jit`", "", "runs", ""])
    except Exception as err:  # the measurement: what fails, where
        probes.append(["AutoClip[per_param] under `jax.jit`", "", *_error(err)])
    runs = {row[0] for row in probes if row[2] == "runs"}
    timed, speedups = [], {}
    trees = [shapes, common.stack_shapes(*size.stack)]
    for key in size.smartclip_pairs:
        for tree in trees if key.endswith("[per_param]") else trees[:1]:
            if key in runs:
                common.log(f"  smartclip: timing {key} on {common.describe(tree)}")
                row, speedups[(key, row[0])] = time_pair(key, tree, size)
                timed.append(row)
    text = [
        "## smartclip's JAX backend",
        "",
        f"Each smartclip clipper run eagerly for {STEPS} steps (`warmup_steps=min_history="
        f"{common.WARM}`) on the transformer-shaped tree ({common.describe(shapes)}); errors "
        "verbatim.",
        "",
        common.table(["smartclip path", "steps that ran", "result", "raised at"], probes),
        "",
        "Timings, interleaved: ms per step, median [IQR]; speed-up = smartclip / clipjax, "
        "median [IQR] of per-round ratios. *clip*: `apply_grads` vs clipjax's jitted `update`; "
        "*step*: `apply_grads` + a jitted adam step vs clipjax's jitted `chain(clipper, adam)`.",
        "",
        common.table(
            [
                *("tree", "path", "smartclip clip", "clipjax clip", "speed-up"),
                *("smartclip step", "clipjax step", "speed-up"),
            ],
            timed,
        ),
    ]
    bound = common.TARGETS["smartclip_speedup"]
    low = min(speedups, key=speedups.get)
    checks = [
        (
            f"clipjax ≥ {bound:.0f}× faster per training step than smartclip's JAX backend, "
            "wherever it runs",
            f"{speedups[low]:.1f}× ({low[0]} on {low[1]}) to {max(speedups.values()):.1f}×",
            speedups[low] >= bound,
        )
    ]
    return "\n".join(text), checks


if __name__ == "__main__":
    common.main(section, __doc__)
