"""Shared pieces of the benchmark suite.

* the registry of clippers (every clipjax clipper and scope, next to what a
  user would use instead: optax's ``clip_by_global_norm`` and
  ``adaptive_grad_clip``);
* model builders (parameter and gradient trees of a chosen size and leaf count);
* the jitted training step, compile timing and interleaved step timing (A B A B
  ..., medians and inter-quartile ranges of per-round ratios);
* the machine / versions / command header of a results file.

Nothing here asserts a time: wall-clock figures are reported, never checked.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import clipjax  # noqa: E402

SCOPES = ("global", "per_layer", "per_param")
LR = 1e-3

# ---------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Clipper:
    """One clipper configuration of the registry.

    Attributes:
      algo: the short name (``zclip``, ``autoclip[percentile]``, ``optax.clip_by_global_norm``).
      scope: ``global``, ``per_layer``, ``per_param`` or ``unitwise``.
      make: builds a fresh transform.
      owner: ``clipjax`` or ``optax``.
      kind: ``norm`` (floor 1.0 gradient bytes) or ``agc`` (floor 2.0: it reads params).
      source: where the factory came from (``clipjax``, or a private module while
        the factory is not yet exported).
    """

    algo: str
    scope: str
    make: Callable[[], optax.GradientTransformation]
    owner: str = "clipjax"
    kind: str = "norm"
    source: str = "clipjax"

    @property
    def name(self) -> str:
        return f"{self.algo}[{self.scope}]" if self.scope else self.algo

    @property
    def floor(self) -> float:
        return 2.0 if self.kind == "agc" else 1.0


# Short warm-ups, so that the timed steps run the clippers' steady state
# (the compiled program is the same either way: warm-up is a select on
# [groups]-sized arrays).
WARM = 5

# name in clipjax -> (private module that defines it, keyword arguments per variant)
_ADAPTIVE: dict[str, list[tuple[str, dict[str, Any]]]] = {
    "zclip": [("zclip", {"warmup_steps": WARM})],
    "hist_clip": [("hist_clip", {"warmup_steps": WARM})],
    "autoclip": [
        ("autoclip", {"warmup_steps": WARM, "min_history": WARM}),
        (
            "autoclip[percentile]",
            {"mode": "percentile", "history": "window", "warmup_steps": WARM, "min_history": WARM},
        ),
    ],
    "zscore_clip": [("zscore_clip", {"warmup_steps": WARM, "min_history": WARM})],
}
_PRIVATE = {"autoclip": "clipjax._autoclip", "zscore_clip": "clipjax._zscore_clip"}


def clipjax_factory(name: str) -> tuple[Callable[..., Any] | None, str]:
    """``(factory, source)``: the public ``clipjax.name`` when exported.

    While a clipper is being finished it may live only in its private module;
    it is then taken from there and its rows say so. ``(None, reason)`` when
    neither exists.
    """
    if hasattr(clipjax, name):
        return getattr(clipjax, name), "clipjax"
    module = _PRIVATE.get(name)
    if module is not None:
        try:
            mod = importlib.import_module(module)
            if hasattr(mod, name):
                return getattr(mod, name), module
        except Exception as err:  # a module mid-edit must not stop the suite
            return None, f"{module}: {type(err).__name__}: {err}"
    return None, f"clipjax has no {name}"


def registry(scopes: Sequence[str] = SCOPES, refs: bool = True) -> tuple[list[Clipper], list[str]]:
    """Every clipper x scope, plus the optax references; and notes on any left out."""
    out: list[Clipper] = []
    notes: list[str] = []
    if refs:
        out.append(
            Clipper(
                "optax.clip_by_global_norm",
                "global",
                lambda: optax.clip_by_global_norm(1.0),
                owner="optax",
            )
        )
        out.append(
            Clipper(
                "optax.adaptive_grad_clip",
                "unitwise",
                lambda: optax.adaptive_grad_clip(0.01),
                owner="optax",
                kind="agc",
            )
        )
    out.append(Clipper("clip_by_global_norm", "global", lambda: clipjax.clip_by_global_norm(1.0)))
    for name, variants in _ADAPTIVE.items():
        factory, source = clipjax_factory(name)
        if factory is None:
            notes.append(f"{name}: not benchmarked ({source})")
            continue
        if source != "clipjax":
            notes.append(f"{name}: taken from `{source}` (not yet exported from clipjax)")
        for label, kwargs in variants:
            for scope in scopes:
                out.append(
                    Clipper(
                        label,
                        scope,
                        _bind(factory, dict(kwargs, scope=scope)),
                        source=source,
                    )
                )
    for scope in ("unitwise", *scopes):
        out.append(
            Clipper(
                "agc", scope, _bind(clipjax.agc, {"clipping": 0.01, "scope": scope}), kind="agc"
            )
        )
    return out, notes


def _bind(factory: Callable[..., Any], kwargs: dict[str, Any]) -> Callable[[], Any]:
    return lambda: factory(**kwargs)


def find(clippers: Sequence[Clipper], algo: str, scope: str) -> Clipper | None:
    for c in clippers:
        if c.algo == algo and c.scope == scope:
            return c
    return None


# ---------------------------------------------------------------------------
# Models
# ---------------------------------------------------------------------------


def _normal(key: Any, shape: tuple[int, ...], scale: float, dtype: Any) -> jax.Array:
    return (scale * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def transformer_shapes(
    blocks: int = 4, d: int = 256, vocab: int = 8192, mlp: int = 4
) -> dict[str, Any]:
    """Leaf shapes of a flax-like decoder: embedding, ``blocks`` x 12 leaves, final norm."""
    block = {
        "ln1": {"scale": (d,), "bias": (d,)},
        "attn": {
            "qkv": {"kernel": (d, 3 * d), "bias": (3 * d,)},
            "out": {"kernel": (d, d), "bias": (d,)},
        },
        "ln2": {"scale": (d,), "bias": (d,)},
        "mlp": {
            "fc1": {"kernel": (d, mlp * d), "bias": (mlp * d,)},
            "fc2": {"kernel": (mlp * d, d), "bias": (d,)},
        },
    }
    shapes: dict[str, Any] = {"embed": {"embedding": (vocab, d)}}
    for i in range(blocks):
        shapes[f"block_{i}"] = block
    shapes["ln_f"] = {"scale": (d,), "bias": (d,)}
    return {"params": shapes}


def stack_shapes(n_leaves: int, total: float) -> dict[str, Any]:
    """``n_leaves // 2`` identical dense layers (kernel + bias) of about ``total`` parameters.

    Deep stacks of identical layers are what most large models are; identical
    shapes also let XLA reuse one compiled kernel per shape, which is what
    compile time depends on (see the scaling section).
    """
    layers = max(1, n_leaves // 2)
    d = max(1, round((-1 + math.sqrt(1 + 4 * total / layers)) / 2))
    return {"params": {f"layer_{i}": {"kernel": (d, d), "bias": (d,)} for i in range(layers)}}


def _is_shape(x: Any) -> bool:
    return isinstance(x, tuple) and all(isinstance(d, int) for d in x)


def make_tree(shapes: Any, seed: int, scale: float, dtype: Any = jnp.float32) -> Any:
    """Random normal arrays of the given shapes (``scale`` times a standard normal)."""
    leaves, treedef = jax.tree.flatten(shapes, is_leaf=_is_shape)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
    arrays = [_normal(k, s, scale, dtype) for k, s in zip(keys, leaves)]
    return jax.tree.unflatten(treedef, arrays)


def params_and_grads(shapes: Any, dtype: Any = jnp.float32) -> tuple[Any, Any]:
    return make_tree(shapes, 0, 0.02, dtype), make_tree(shapes, 1, 1e-3, dtype)


def num_params(tree: Any) -> int:
    return sum(
        int(np.prod(x if _is_shape(x) else np.shape(x)))
        for x in jax.tree.leaves(tree, is_leaf=_is_shape)
    )


def num_leaves(tree: Any) -> int:
    return len(jax.tree.leaves(tree, is_leaf=_is_shape))


def tree_bytes(tree: Any) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype"))


def state_bytes(make: Callable[[], optax.GradientTransformation], shapes: Any) -> int:
    """Bytes of a transform's state for a tree of ``shapes`` (no arrays allocated)."""
    spec = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes, is_leaf=_is_shape)
    state = jax.eval_shape(make().init, spec)
    return sum(
        int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
        for x in jax.tree.leaves(state)
        if hasattr(x, "shape")
    )


def memory_available() -> int:
    """Bytes free for arrays on the default device (host memory on CPU)."""
    dev = jax.devices()[0]
    if dev.platform != "cpu":
        try:
            stats = dev.memory_stats() or {}
            limit = stats.get("bytes_limit", 0)
            return int(limit - stats.get("bytes_in_use", 0))
        except Exception:
            return 8 << 30
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


# ---------------------------------------------------------------------------
# Steps, compile and timing
# ---------------------------------------------------------------------------


def with_adam(tx: optax.GradientTransformation | None) -> optax.GradientTransformation:
    adam = optax.adam(LR)
    return adam if tx is None else optax.chain(tx, adam)


def train_step(tx: optax.GradientTransformation) -> Callable[..., Any]:
    """``(params, opt_state, grads) -> (params, opt_state)``: update and apply."""

    def step(params: Any, state: Any, grads: Any) -> Any:
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return step


def cost(compiled: Any) -> dict[str, float]:
    out = compiled.cost_analysis()
    if isinstance(out, list):
        out = out[0]
    return dict(out or {})


class Runner:
    """One configuration, compiled with donated params and state, ready to step.

    Attributes:
      trace_s: seconds to trace and lower; compile_s: seconds in XLA's compile.
    """

    def __init__(self, tx: optax.GradientTransformation, params: Any, grads: Any) -> None:
        self.tx = tx
        self.grads = grads
        self.params = jax.tree.map(jnp.copy, params)
        state = tx.init(self.params)
        self.aliased = aliased_leaves(state)
        # Donation needs one buffer per leaf: copy what init shares between fields.
        self.state = jax.tree.map(jnp.copy, state) if self.aliased else state
        t0 = time.perf_counter()
        lowered = jax.jit(train_step(tx), donate_argnums=(0, 1)).lower(
            self.params, self.state, grads
        )
        t1 = time.perf_counter()
        self.compiled = lowered.compile()
        t2 = time.perf_counter()
        self.trace_s, self.compile_s = t1 - t0, t2 - t1
        self.cost = cost(self.compiled)
        self.kernels, self.distinct_kernels = kernel_counts(self.compiled)

    @property
    def total_compile_s(self) -> float:
        return self.trace_s + self.compile_s

    def run(self, steps: int) -> None:
        p, s = self.params, self.state
        for _ in range(steps):
            p, s = self.compiled(p, s, self.grads)
        jax.block_until_ready((p, s))
        self.params, self.state = p, s

    def delete(self) -> None:
        for x in jax.tree.leaves((self.params, self.state)):
            if hasattr(x, "delete"):
                x.delete()


def kernel_counts(compiled: Any) -> tuple[int, int]:
    """(fused computations, distinct ones) in the optimized HLO of ``compiled``.

    XLA compiles one machine-code kernel per *distinct* fused computation
    (names and metadata aside) and reuses it for identical ones, so the
    distinct count is what compile time grows with.
    """
    try:
        text = compiled.as_text()
    except Exception:
        return -1, -1
    bodies: dict[str, int] = {}
    for comp in re.split(r"\n(?=\S)", text):
        lines = comp.split("\n")
        if not lines[0].startswith("%") or ("fused" not in lines[0] and "wrapped" not in lines[0]):
            continue
        body = "\n".join(lines[1:])
        body = re.sub(r", metadata=\{[^}]*\}", "", body)
        body = re.sub(r"%[\w.\-]+", "%v", body)
        bodies[body] = bodies.get(body, 0) + 1
    return sum(bodies.values()), len(bodies)


def aliased_leaves(tree: Any) -> list[tuple[str, str]]:
    """Pairs of paths in ``tree`` that hold the very same array object.

    A state with such pairs cannot be donated as returned by ``init``
    ("Attempt to donate the same buffer twice").
    """
    seen: dict[int, str] = {}
    pairs = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        name = jax.tree_util.keystr(path)
        if id(x) in seen:
            pairs.append((seen[id(x)], name))
        else:
            seen[id(x)] = name
    return pairs


def interleave(
    runs: dict[str, Callable[[int], None]],
    rounds: int,
    target_s: float = 0.05,
    warmup: int = 2 * WARM + 2,
    max_steps: int = 256,
) -> dict[str, list[float]]:
    """Per-step seconds of each run, one sample per round, runs interleaved.

    Every round runs each configuration once, for a block of ``steps`` steps
    (chosen so that a block takes about ``target_s``), in an order that
    rotates and reverses from round to round (A B C, C B A, B C A, ...), so
    that slow drifts of the machine fall on all configurations alike.
    """
    labels = list(runs)
    for fn in runs.values():
        fn(warmup)
    probe = {}
    for label in labels:
        t0 = time.perf_counter()
        runs[label](1)
        probe[label] = time.perf_counter() - t0
    steps = max(1, min(max_steps, int(target_s / max(min(probe.values()), 1e-6))))
    samples: dict[str, list[float]] = {label: [] for label in labels}
    for r in range(rounds):
        k = r % len(labels)
        order = labels[k:] + labels[:k]
        if r % 2:
            order = order[::-1]
        for label in order:
            t0 = time.perf_counter()
            runs[label](steps)
            samples[label].append((time.perf_counter() - t0) / steps)
    return samples


def quantiles(xs: Sequence[float]) -> tuple[float, float, float]:
    """(25th percentile, median, 75th percentile)."""
    a = np.asarray(xs, np.float64)
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return float(q1), float(med), float(q3)


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Median and IQR of the per-round ratios ``num[r] / den[r]``."""
    ratios = [a / b for a, b in zip(num, den)]
    q1, med, q3 = quantiles(ratios)
    return {"median": med, "q1": q1, "q3": q3, "n": len(ratios)}


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs))


# ---------------------------------------------------------------------------
# Header and formatting
# ---------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _git() -> str:
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "clipjax"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        if not rev:
            return "unknown"
        return rev + (" + uncommitted changes in clipjax/" if dirty else "")
    except Exception:
        return "unknown"


def machine_info() -> dict[str, str]:
    dev = jax.devices()[0]
    mem = "unknown"
    try:
        with open("/proc/meminfo") as f:
            total_kb = int(f.readline().split()[1])
        mem = f"{total_kb / 2**20:.1f} GiB"
    except (OSError, ValueError, IndexError):
        pass
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": f"{dev.device_kind} ({jax.default_backend()}, {jax.device_count()} device(s))",
        "cpu": f"{_cpu_model()}, {os.cpu_count()} logical cores",
        "memory": mem,
        "platform": platform.platform(),
        "load average at start (1, 5, 15 min)": load,
    }


def versions() -> dict[str, str]:
    return {
        "python": platform.python_version(),
        "clipjax": f"{clipjax.__version__} (git {_git()})",
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "optax": _version("optax"),
        "flax": _version("flax"),
        "numpy": np.__version__,
        "smartclip": _version("smartclip"),
        "matplotlib": _version("matplotlib"),
    }


def fmt_ms(seconds: float) -> str:
    ms = 1e3 * seconds
    if ms >= 100:
        return f"{ms:.0f}"
    if ms >= 10:
        return f"{ms:.1f}"
    return f"{ms:.2f}"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def fmt_count(n: float) -> str:
    if n >= 1e6:
        return f"{n / 1e6:.3g}M"
    if n >= 1e3:
        return f"{n / 1e3:.3g}k"
    return str(int(n))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(c) for c in row) + " |")
    return "\n".join(lines)


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)
