"""smartclip's JAX backend next to clipjax: what runs, what fails, and how fast.

smartclip clips a gradient tree with
``smartclip.backends.jax.apply_grads(grads, params, clipper)``, in Python,
outside ``jit`` (it calls ``float()`` on every norm), and hands the result to
an optax optimizer. This module

* runs every smartclip clipper (``AutoClip``, ``ZScoreClip``, ``AGC``) in
  every scope for a few steps past its warm-up and records the first error
  verbatim (with the smartclip line that raised it);
* tries ``apply_grads`` under ``jax.jit`` and records what happens;
* where a path runs, times it interleaved against clipjax's clipper of the
  same algorithm and scope: the clipping alone (smartclip's ``apply_grads``
  vs clipjax's jitted ``update``) and the whole training step (``apply_grads``
  + jitted adam vs clipjax's jitted ``chain(clipper, adam)``).

    PYTHONPATH=. .venv/bin/python benchmarks/smartclip_jax.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import jax
import optax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import common

SC_SCOPES = ("global", "per_layer", "per_param")
# smartclip class -> (clipjax factory name, keyword arguments shared by both)
PAIRS: dict[str, tuple[str, dict[str, Any]]] = {
    "AutoClip": (
        "autoclip",
        {"mode": "auto", "warmup_steps": common.WARM, "min_history": common.WARM},
    ),
    "ZScoreClip": ("zscore_clip", {"warmup_steps": common.WARM, "min_history": common.WARM}),
    "AGC": ("agc", {"clipping": 0.01}),
}


def _sc() -> tuple[Any, Any]:
    import smartclip
    from smartclip.backends import jax as sc_jax

    return smartclip, sc_jax


def make_sc(cls: str, scope: str, warmup: int | None = None) -> Any:
    smartclip, _ = _sc()
    _, kwargs = PAIRS[cls]
    kwargs = dict(kwargs, scope=scope)
    if warmup is not None and "warmup_steps" in kwargs:
        kwargs["warmup_steps"] = warmup
    return getattr(smartclip, cls)(**kwargs)


def make_cj(cls: str, scope: str) -> optax.GradientTransformation | None:
    name, kwargs = PAIRS[cls]
    factory, _ = common.clipjax_factory(name)
    if factory is None:
        return None
    return factory(**dict(kwargs, scope=scope))


def _where(err: BaseException) -> str:
    frames = traceback.extract_tb(err.__traceback__)
    for frame in reversed(frames):
        if "smartclip" in frame.filename:
            path = frame.filename[frame.filename.index("smartclip") :]
            return f"{path}:{frame.lineno} `{(frame.line or '').strip()}`"
    return ""


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}".splitlines()[0]


def probe(cls: str, scope: str, params: Any, grads: Any, steps: int) -> dict[str, Any]:
    """Runs ``steps`` eager steps; records how far it got and the first error."""
    _, sc_jax = _sc()
    clipper = make_sc(cls, scope)
    for i in range(steps):
        try:
            out = sc_jax.apply_grads(grads, params, clipper)
            jax.block_until_ready(out)
        except Exception as err:
            return {"ok_steps": i, "error": _error(err), "where": _where(err)}
    return {"ok_steps": steps, "error": None, "where": ""}


def jit_probe(params: Any, grads: Any) -> dict[str, Any]:
    """``apply_grads`` under ``jax.jit``."""
    _, sc_jax = _sc()
    clipper = make_sc("AutoClip", "per_param")
    try:
        jax.block_until_ready(
            jax.jit(lambda g, p: sc_jax.apply_grads(g, p, clipper))(grads, params)
        )
    except Exception as err:
        return {"error": _error(err), "where": _where(err)}
    return {"error": None, "where": ""}


_ADAM = optax.adam(common.LR)
# One jitted adam step shared by every smartclip run (compiled once per tree).
_ADAM_STEP = jax.jit(common.train_step(_ADAM), donate_argnums=(0, 1))


def _sc_clip(
    cls: str, scope: str, params: Any, grads: Any, warmup: int | None
) -> Callable[[int], None]:
    _, sc_jax = _sc()
    clipper = make_sc(cls, scope, warmup)

    def run(steps: int) -> None:
        for _ in range(steps):
            out = sc_jax.apply_grads(grads, params, clipper)
        jax.block_until_ready(out)

    return run


def _sc_step(
    cls: str, scope: str, params: Any, grads: Any, warmup: int | None
) -> Callable[[int], None]:
    """smartclip's training step: eager ``apply_grads``, then a jitted adam step."""
    _, sc_jax = _sc()
    clipper = make_sc(cls, scope, warmup)
    adam = _ADAM
    box = {"p": jax.tree.map(lambda x: x.copy(), params)}
    box["s"] = adam.init(box["p"])
    step = _ADAM_STEP

    def run(steps: int) -> None:
        for _ in range(steps):
            clipped = sc_jax.apply_grads(grads, box["p"], clipper)
            box["p"], box["s"] = step(box["p"], box["s"], clipped)
        jax.block_until_ready(box["p"])

    return run


def _cj_clip(tx: optax.GradientTransformation, params: Any, grads: Any) -> Callable[[int], None]:
    box = {"s": tx.init(params)}
    update = jax.jit(lambda g, s, p: tx.update(g, s, p))

    def run(steps: int) -> None:
        for _ in range(steps):
            out, box["s"] = update(grads, box["s"], params)
        jax.block_until_ready(out)

    return run


def _time_pair(
    cls: str,
    scope: str,
    params: Any,
    grads: Any,
    warmup: int | None,
    rounds: int,
    adam: common.Runner,
) -> dict[str, Any] | None:
    tx = make_cj(cls, scope)
    if tx is None:
        return None
    runs = {
        "smartclip clip": _sc_clip(cls, scope, params, grads, warmup),
        "clipjax clip": _cj_clip(tx, params, grads),
        "smartclip step": _sc_step(cls, scope, params, grads, warmup),
        "clipjax step": common.Runner(common.with_adam(tx), params, grads).run,
        "adam step": adam.run,
    }
    samples = common.interleave(runs, rounds=rounds, target_s=0.1, warmup=2 * common.WARM + 2)
    med = {k: common.median(v) for k, v in samples.items()}
    return {
        "clip": {
            "smartclip_s": med["smartclip clip"],
            "clipjax_s": med["clipjax clip"],
            "speedup": common.ratio_stats(samples["smartclip clip"], samples["clipjax clip"]),
        },
        "step": {
            "smartclip_s": med["smartclip step"],
            "clipjax_s": med["clipjax step"],
            "adam_s": med["adam step"],
            "speedup": common.ratio_stats(samples["smartclip step"], samples["clipjax step"]),
        },
    }


def measure(quick: bool = False) -> dict[str, Any]:
    rounds = 5 if quick else 9
    models = {"transformer": common.transformer_shapes()}
    if not quick:
        # Many small leaves: where smartclip's per-leaf Python work dominates.
        models["stack"] = common.stack_shapes(200, 2e5)
    out: dict[str, Any] = {"models": {}, "rounds": rounds}
    for model, shapes in models.items():
        params, grads = common.params_and_grads(shapes)
        res: dict[str, Any] = {
            "params": common.num_params(shapes),
            "leaves": common.num_leaves(shapes),
            "probes": {},
            "timings": {},
        }
        out["models"][model] = res
        if model == "transformer":
            for cls in PAIRS:
                for scope in SC_SCOPES:
                    common.log(f"  smartclip: probe {cls}[{scope}]")
                    res["probes"][f"{cls}[{scope}]"] = probe(
                        cls, scope, params, grads, 2 * common.WARM + 2
                    )
            out["jit"] = jit_probe(params, grads)
            probes = res["probes"]
        else:
            probes = {
                k: v
                for k, v in out["models"]["transformer"]["probes"].items()
                if k.endswith("[per_param]")
            }
        if quick:
            probes = {k: v for k, v in probes.items() if k.endswith("[per_param]")}
        adam = common.Runner(common.with_adam(None), params, grads)
        for key, pr in probes.items():
            cls, scope = key[:-1].split("[")
            warmup, label = None, key
            if pr["error"] is not None:
                if pr["ok_steps"] == 0:
                    continue
                # It runs until its gate opens: time that path, gate kept shut.
                warmup, label = 10**9, f"{key} (warm-up only)"
            common.log(f"  smartclip: timing {label} on {model}")
            timing = _time_pair(cls, scope, params, grads, warmup, rounds, adam)
            if timing is not None:
                res["timings"][label] = timing
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    print(json.dumps(measure(args.quick), indent=1, default=str))
    common.log(f"{time.perf_counter() - t0:.0f} s")


if __name__ == "__main__":
    main()
