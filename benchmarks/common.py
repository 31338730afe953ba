"""What every benchmark shares: sizes, targets, configurations, compiling, timing, pages.

Every constant a benchmark depends on (model shapes, rounds, leaf counts,
targets) is defined here, once; ``sizes(quick)`` picks the full or the
``--quick`` set. Every script compiles and times its steps here
(``compile_jit``: wall and CPU seconds, bytes accessed, full-size copies;
``best_of``; ``interleave``: wall and CPU seconds a step over rounds in an
order that rotates or alternates; ``spread``: medians and quartiles) and puts
its page together here (``header``, ``command``, ``table``, ``page``,
``write``): a script keeps its own configurations and tables. Nothing here
asserts a time: wall-clock figures are reported, and a verdict is only ever
computed from a measurement and a constant of ``TARGETS``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from importlib.metadata import version
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import clipjax  # noqa: E402

LR = 1e-3
# Short warm-ups, so that the timed steps run the clippers' steady state.
WARM = 5
SCOPES = ("global", "per_layer", "per_param")

# Bounds the report checks the measurements against (the project's cost targets).
TARGETS = {
    # extra "bytes accessed" over adam alone, in gradient bytes, of a norm clipper + adam
    "traffic": 1.2,
    # step time of a clipjax clipper + adam over optax's counterpart + adam (median ratio)
    "step_ratio": 1.0,
    # step time of per_layer / per_param over the same clipper's global scope
    "scope_ratio": 1.10,
    # compile time of zclip per_param + adam over optax clip_by_global_norm + adam, most leaves
    "compile_ratio": 2.0,
    # per-step speed-up of clipjax over smartclip's JAX backend (whole training step)
    "smartclip_speedup": 20.0,
    # largest relative error of clip_by_percentile(method="approx")'s bound: 2^-17 (its
    # docstring), plus the float32 rounding of the exact percentile (a few ulps)
    "percentile_error": 2.0**-17 + 2.0**-21,
    # skip_on_spike(inner): step time over the inner transform alone (median ratio), extra
    # bytes accessed over it in gradient bytes, full-size copies in the compiled donated step
    "skip_ratio": 1.25,
    "skip_traffic": 1.1,
    "skip_copies": 0,
    # hist_clip (default and per_param) + adam: extra bytes over adam in gradient bytes, and
    # step time over zclip's of the same scope, same run (median ratio)
    "hist_traffic": 1.2,
    "hist_vs_zclip": 1.05,
    # agc unitwise + adam: extra bytes over optax.adaptive_grad_clip + adam, gradient bytes
    "agc_traffic": 0.02,
    # clipjax.adamw(update_clipping=True) (StableAdamW): step time over clipjax.adamw's, same
    # rounds (median ratio); its copies and skip_on_spike around it are the skip_* targets
    "stable_ratio": 1.1,
}


@dataclasses.dataclass(frozen=True)
class Sizes:
    model: dict[str, int]  # transformer_shapes(**model)
    scopes: tuple[str, ...]
    rounds: int  # interleaved rounds of step timing
    block_s: float  # seconds a timed block of steps lasts
    leaf_counts: tuple[int, ...]  # scaling sweep
    leaf_params: float  # parameters of every scaling tree
    stack: tuple[int, float]  # (leaves, parameters) of smartclip's many-small-leaves tree
    smartclip_pairs: tuple[str, ...]
    percentile_sizes: tuple[int, ...]
    error_max_n: int  # largest size whose percentile errors are measured (each sorts n floats)
    reps: int  # timed calls per percentile measurement


FULL = Sizes(
    model={"blocks": 4, "d": 256, "vocab": 8192},  # 5.26M parameters, 51 leaves
    scopes=SCOPES,
    rounds=15,
    block_s=0.1,
    leaf_counts=(10, 100, 1000),
    leaf_params=1e6,
    stack=(200, 2e5),
    smartclip_pairs=("AutoClip[per_layer]", "AutoClip[per_param]", "ZScoreClip[per_param]"),
    percentile_sizes=(10**4, 10**5, 10**6, 10**7),
    error_max_n=10**6,
    reps=7,
)
QUICK = Sizes(
    model={"blocks": 1, "d": 128, "vocab": 2048},
    scopes=("global", "per_param"),
    rounds=3,
    block_s=0.02,
    leaf_counts=(10, 40),
    leaf_params=1e5,
    stack=(40, 4e4),
    smartclip_pairs=("AutoClip[per_param]",),
    percentile_sizes=(10**4, 10**5),
    error_max_n=10**5,
    reps=3,
)


def sizes(quick: bool) -> Sizes:
    return QUICK if quick else FULL


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


def adam() -> optax.GradientTransformation:
    return optax.adam(LR)


def plus_adam(clipper: Callable[[], optax.GradientTransformation]) -> Callable[[], Any]:
    return lambda: optax.chain(clipper(), adam())


ADAM = "adam"
ADAMW_FOLD = "adamw (clipjax.adamw)"
STABLE_ADAMW = "clipjax.adamw(update_clipping=True)"
OPTAX_GN = "optax.clip_by_global_norm + adam"
OPTAX_AGC = "optax.adaptive_grad_clip + adam"
REFS = {ADAM: adam, OPTAX_GN: plus_adam(lambda: optax.clip_by_global_norm(1.0))}
ADAPTIVE = {
    "zclip": lambda scope: clipjax.zclip(warmup_steps=WARM, scope=scope),
    "hist_clip": lambda scope: clipjax.hist_clip(warmup_steps=WARM, scope=scope),
    "autoclip": lambda scope: clipjax.autoclip(warmup_steps=WARM, min_history=WARM, scope=scope),
    "autoclip[percentile]": lambda scope: clipjax.autoclip(
        mode="percentile", history="window", warmup_steps=WARM, min_history=WARM, scope=scope
    ),
    "zscore_clip": lambda scope: clipjax.zscore_clip(
        warmup_steps=WARM, min_history=WARM, scope=scope
    ),
}


@dataclasses.dataclass(frozen=True)
class Group:
    """Configurations timed together: ``label -> make`` of the whole optimizer.

    Extra traffic is counted over ``floor``'s, step times divided by ``base``'s;
    ``value``: the step passes the loss, ``update(..., value=loss)``.
    """

    title: str
    configs: dict[str, Callable[[], optax.GradientTransformation]]
    floor: str = ADAM
    base: str = OPTAX_GN
    value: bool = False


def groups(scopes: Sequence[str]) -> list[Group]:
    """The configurations that run on the current API.

    hist_clip's group also holds zclip in the same scopes: its step time is
    compared with zclip's in the same rounds.
    """
    gn = {"clipjax.clip_by_global_norm + adam": plus_adam(lambda: clipjax.clip_by_global_norm(1.0))}
    out = [Group("clip_by_global_norm", {**REFS, **gn})]
    mine = {
        algo: {f"clipjax.{algo}[{s}] + adam": plus_adam(lambda s=s, m=make: m(s)) for s in scopes}
        for algo, make in ADAPTIVE.items()
    }
    for algo in ADAPTIVE:
        extra = mine["zclip"] if algo == "hist_clip" else {}
        out.append(Group(algo, {**REFS, **mine[algo], **extra}))
    agc = {ADAM: adam, OPTAX_AGC: plus_adam(lambda: optax.adaptive_grad_clip(0.01))}
    for s in ("unitwise", *scopes):
        agc[f"clipjax.agc[{s}] + adam"] = plus_adam(lambda s=s: clipjax.agc(0.01, scope=s))
    return [*out, Group("agc", agc, base=OPTAX_AGC)]


def new_groups() -> list[Group]:
    """adagc, and skip_on_spike against its inner optimizer and optax.apply_if_finite."""
    adagc = plus_adam(lambda: clipjax.adagc(warmup_steps=WARM, scope="per_param"))
    out = [Group("adagc", {**REFS, "clipjax.adagc[per_param] + adam": adagc})]
    zclip_adam = lambda: optax.chain(clipjax.zclip(warmup_steps=WARM), adam())
    for inner, make in ((ADAM, adam), ("chain(zclip, adam)", zclip_adam)):
        configs = {
            inner: make,
            f"optax.apply_if_finite({inner}, 10)": lambda m=make: optax.apply_if_finite(m(), 10),
            f"clipjax.skip_on_spike({inner})": lambda m=make: clipjax.skip_on_spike(m()),
        }
        out.append(Group(f"skip_on_spike({inner})", configs, inner, inner, value=True))
    # clipjax.adam / clipjax.chain: optax's, bit for bit, with the skip folded into the
    # moments (update_if) instead of a lax.cond.
    fold_adam = lambda: clipjax.adam(LR)
    fold_chain = lambda: clipjax.chain(clipjax.zclip(warmup_steps=WARM), clipjax.adam(LR))
    inner = "clipjax.adam"
    configs = {
        ADAM: adam,
        inner: fold_adam,
        f"clipjax.skip_on_spike({inner})": lambda: clipjax.skip_on_spike(fold_adam()),
    }
    out.append(Group(f"skip_on_spike({inner})", configs, inner, inner, value=True))
    inner = "clipjax.chain(zclip, clipjax.adam)"
    configs = {
        inner: fold_chain,
        f"clipjax.skip_on_spike({inner})": lambda: clipjax.skip_on_spike(fold_chain()),
    }
    out.append(Group(f"skip_on_spike({inner})", configs, inner, inner, value=True))
    # StableAdamW's update clipping on clipjax.adamw: over clipjax.adamw (optax's AdamW),
    # and skip_on_spike around it on the fold route.
    stable = lambda: clipjax.adamw(LR, update_clipping=True)
    configs = {
        ADAMW_FOLD: lambda: clipjax.adamw(LR),
        STABLE_ADAMW: stable,
        f"clipjax.skip_on_spike({STABLE_ADAMW})": lambda: clipjax.skip_on_spike(stable()),
    }
    out.append(
        Group(f"skip_on_spike({STABLE_ADAMW})", configs, STABLE_ADAMW, STABLE_ADAMW, value=True)
    )
    return [*out, *spam_groups()]


def spam_groups() -> list[Group]:
    """SPAM and Stable-SPAM against clipjax.adamw (same weight decay, 0).

    Labels without the ``clipjax.`` prefix: they are optimizers and chains of
    two clippers, not the single norm clippers that traffic.py's targets check.
    """
    adamw = "clipjax.adamw"
    fold_adamw = lambda: clipjax.adamw(LR, weight_decay=0.0)
    chained = lambda clipper: lambda: clipjax.chain(clipper(), fold_adamw())
    configs = {
        adamw: fold_adamw,
        "spam": lambda: clipjax.spam(LR),
        "spam(count_clipped=False)": lambda: clipjax.spam(LR, count_clipped=False),
        "stable_spam": lambda: clipjax.stable_spam(LR),
        "adaclip + adamw": chained(clipjax.adaclip),
        "adaclip(count_clipped=False) + adamw": chained(
            lambda: clipjax.adaclip(count_clipped=False)
        ),
        "ada_norm + adamw": chained(clipjax.ada_norm),
        "skip_on_spike(spam)": lambda: clipjax.skip_on_spike(clipjax.spam(LR)),
    }
    return [Group("spam", configs, adamw, adamw, value=True)]


# ---------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------


def transformer_shapes(blocks: int, d: int, vocab: int) -> dict[str, Any]:
    """A flax-like decoder's parameters: embedding, ``blocks`` x 12 leaves, final norm."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    dense = lambda n, m: {"kernel": f32(n, m), "bias": f32(m)}
    norm = {"scale": f32(d), "bias": f32(d)}
    attn, mlp = {"qkv": dense(d, 3 * d), "out": dense(d, d)}, {"fc1": dense(d, 4 * d)}
    block = {"ln1": norm, "attn": attn, "ln2": norm, "mlp": {**mlp, "fc2": dense(4 * d, d)}}
    blocks_ = {f"block_{i}": block for i in range(blocks)}
    return {"params": {"embed": {"embedding": f32(vocab, d)}, **blocks_, "ln_f": norm}}


def stack_shapes(n_leaves: int, total: float) -> dict[str, Any]:
    """``n_leaves // 2`` identical dense layers (kernel + bias) of about ``total`` parameters."""
    layers = max(1, n_leaves // 2)
    d = max(1, round((-1 + (1 + 4 * total / layers) ** 0.5) / 2))
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    return {"params": {f"layer_{i}": {"kernel": f32(d, d), "bias": f32(d)} for i in range(layers)}}


def params_and_grads(shapes: Any) -> tuple[Any, Any]:
    """Random normal arrays of the ``shapes`` (a tree of ``jax.ShapeDtypeStruct``)."""
    leaves, treedef = jax.tree.flatten(shapes)
    keys = jax.random.split(jax.random.PRNGKey(0), 2 * len(leaves))
    draw = lambda ks, scale: [scale * jax.random.normal(k, x.shape) for k, x in zip(ks, leaves)]
    return treedef.unflatten(draw(keys[::2], 0.02)), treedef.unflatten(draw(keys[1::2], 1e-3))


def tree_bytes(tree: Any) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def describe(shapes: Any) -> str:
    leaves = jax.tree.leaves(shapes)
    n = sum(int(np.prod(x.shape)) for x in leaves)
    return f"{n / 1e6:.3g}M float32 parameters in {len(leaves)} leaves"


# ---------------------------------------------------------------------------
# Compiling
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Compiled:
    """A step compiled from abstract arguments, params first, and the seconds that took."""

    run: Any  # the executable
    params: Any  # the shapes of its params (its first argument)
    lower_s: float  # trace + lower, wall seconds
    compile_s: float  # XLA's compile, wall seconds
    wall_s: float  # trace + lower + compile, wall seconds
    cpu_s: float  # the same, CPU seconds of the process (all threads)
    tx: Any = None  # the transform whose step it is (for its ``init``)

    @functools.cached_property
    def bytes(self) -> int:
        """XLA's ``cost_analysis()`` "bytes accessed" (repeatable)."""
        cost = self.run.cost_analysis()
        return int((cost[0] if isinstance(cost, list) else cost)["bytes accessed"])

    @functools.cached_property
    def copies(self) -> int:
        """Its full-size copies (:func:`full_size_copies`)."""
        return full_size_copies(self.run.as_text(), self.params)


def compile_jit(fn: Callable, *args: Any, donate: tuple = (0, 1), tx: Any = None) -> Compiled:
    """``jax.jit(fn)`` traced, lowered and compiled for ``args`` (arrays or
    ``jax.ShapeDtypeStruct``, params first), timed; ``donate``: the arguments donated
    (params and optimizer state); ``tx``: the transform whose step ``fn`` is."""
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jax.jit(fn, donate_argnums=donate).trace(*args).lower()
    t1 = time.perf_counter()
    compiled = lowered.compile()
    t2 = time.perf_counter()
    return Compiled(compiled, args[0], t1 - t0, t2 - t1, t2 - t0, time.process_time() - c0, tx)


def best_of(
    compiles: dict[str, Callable[[], Compiled]], reps: int, deadline: float | None = None
) -> dict[str, Compiled]:
    """Each of ``compiles`` run ``reps`` times, forward then backward through them, the
    best of each figure kept (with the first executable); none started after ``deadline``
    (a ``time.perf_counter()``), and none repeated that did not run the first time."""
    best: dict[str, Compiled] = {}
    for r in range(reps):
        for label in alternated(list(compiles), r):
            late = deadline is not None and time.perf_counter() > deadline
            if not (late or (r and label not in best)):
                got = compiles[label]()
                kept = best.setdefault(label, got)
                for field in ("lower_s", "compile_s", "wall_s", "cpu_s"):
                    setattr(kept, field, min(getattr(kept, field), getattr(got, field)))
    return best


def train_step(tx: optax.GradientTransformation, value: bool) -> Callable:
    """``(params, state, grads, loss) -> (params, state)``: update and apply."""

    def step(params: Any, state: Any, grads: Any, loss: Any) -> Any:
        extra = {"value": loss} if value else {}
        updates, state = tx.update(grads, state, params, **extra)
        return optax.apply_updates(params, updates), state

    return step


def step_args(tx: optax.GradientTransformation, shapes: Any) -> tuple[Any, ...]:
    """``(params, state, grads, loss)`` of :func:`train_step`, abstract."""
    return shapes, jax.eval_shape(tx.init, shapes), shapes, jax.ShapeDtypeStruct((), jnp.float32)


_COMPILED: dict[tuple[str, str], Compiled] = {}


def compile_step(label: str, group: Group, shapes: Any) -> Compiled:
    """The step of ``group.configs[label]`` on ``shapes``, compiled once per process."""
    key = (label, repr(shapes))
    if key not in _COMPILED:
        tx = group.configs[label]()
        step = train_step(tx, group.value)
        _COMPILED[key] = compile_jit(step, *step_args(tx, shapes), tx=tx)
    return _COMPILED[key]


_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*\(", re.M)
_FUSION_BODY = re.compile(r"\sfusion\(.*?calls=%?([\w.\-]+)")
_COPY = re.compile(
    r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*\(?[a-z0-9]+\[(?P<dims>[\d,]*)\][^\n]*?"
    r"\s(?:copy|copy-start)\(",
    re.M,
)


def full_size_copies(hlo: str, shapes: Any) -> int:
    """The ``copy`` (and ``copy-start``) ops in ``hlo`` whose shape is a leaf shape of ``shapes``.

    ``hlo``: a compiled module's text (``compiled.as_text()``); ``shapes``: the params
    (arrays or ``jax.ShapeDtypeStruct``), whose leaf shapes are the full-size shapes of the
    optimizer state too. Copies inside fusion bodies (layout changes fused into a loop)
    are not counted: only those that run as an op of their own and write a buffer, in the
    entry computation or in the branches and loop bodies it calls. Scalars are not counted.
    """
    full = {tuple(x.shape) for x in jax.tree.leaves(shapes) if len(x.shape) > 0}
    fused = set(_FUSION_BODY.findall(hlo))
    count, body = 0, ""
    for block in re.split(r"\n(?=\S)", hlo):
        head = _COMPUTATION.match(block)
        body = head.group(1) if head else body
        if head is None or body in fused:
            continue
        for m in _COPY.finditer(block):
            dims = tuple(int(d) for d in m.group("dims").split(",") if d)
            count += dims in full
    return count


def copies(label: str, group: Group, shapes: Any) -> int:
    """Full-size copies in the compiled, donated step of ``group.configs[label]``.

    The gradients are made inside the step (scaled by the loss), as the backward
    pass makes them in training: temporaries, not an input kept across steps. A
    conditional that passes the updates through copies an input that no output
    can alias; it need not copy a temporary. (The timed step reuses one gradient
    input, so it cannot be compiled this way.)
    """
    tx = group.configs[label]()
    inner = train_step(tx, group.value)

    def step(params: Any, state: Any, grads: Any, loss: Any) -> Any:
        return inner(params, state, jax.tree.map(lambda g: g * loss, grads), loss)

    return compile_jit(step, *step_args(tx, shapes)).copies


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


class Runner:
    """A compiled step ``(params, state, *inputs) -> (params, state, ...)`` with params and
    optimizer state of its own, donated from step to step: ``run(steps)`` is timed."""

    def __init__(self, step: Any, params: Any, state: Any, *inputs: Any) -> None:
        self.step, self.inputs = step, inputs
        # init may put one array under two fields; donation needs distinct buffers.
        self.params, self.state = jax.tree.map(jnp.copy, (params, state))

    def run(self, steps: int) -> None:
        p, s = self.params, self.state
        for _ in range(steps):
            p, s, *_ = self.step(p, s, *self.inputs)
        self.params, self.state = jax.block_until_ready((p, s))


def run_steps(label: str, group: Group, shapes: Any, params: Any, grads: Any) -> Callable:
    """``steps -> None``: that many steps of ``group.configs[label]`` on a copy of
    ``params``, each given ``grads``."""
    step = compile_step(label, group, shapes)
    return Runner(step.run, params, step.tx.init(params), grads, jnp.float32(1.0)).run


def rotated(labels: list[str], r: int) -> list[str]:
    """Round ``r``'s order: rotated by ``r`` and reversed every other round, so that slow
    drifts of a shared machine fall on every configuration alike."""
    order = labels[r % len(labels) :] + labels[: r % len(labels)]
    return order[::-1] if r % 2 else order


def alternated(labels: list[str], r: int) -> list[str]:
    """Round ``r``'s order: forward, then backward."""
    return labels[::-1] if r % 2 else labels


Times = dict[str, list[float]]


def interleave(
    runs: dict[str, Callable[[int], None]],
    rounds: int,
    steps: int,
    warm: int = 0,
    order: Callable[[list[str], int], list[str]] = rotated,
) -> tuple[Times, Times]:
    """Wall and CPU seconds a step of each run, one sample a round: after ``warm`` steps of
    each, every round runs each one ``steps`` steps, in ``order``."""
    if warm:
        for fn in runs.values():
            fn(warm)
    wall: Times = {label: [] for label in runs}
    cpu: Times = {label: [] for label in runs}
    for r in range(rounds):
        for label in order(list(runs), r):
            c0, t0 = time.process_time(), time.perf_counter()
            runs[label](steps)
            wall[label].append((time.perf_counter() - t0) / steps)
            cpu[label].append((time.process_time() - c0) / steps)
    return wall, cpu


def block_steps(runs: dict[str, Callable[[int], None]], block_s: float) -> int:
    """Steps in a timed block of about ``block_s`` seconds of the fastest run, each run
    warmed up past the clippers' warm-up first."""
    for fn in runs.values():
        fn(2 * WARM + 2)
    probe = []
    for fn in runs.values():
        t0 = time.perf_counter()
        fn(1)
        probe.append(time.perf_counter() - t0)
    return max(1, min(256, int(block_s / max(min(probe), 1e-6))))


def spread(xs: Sequence[float], fmt: str = "{:.2f}") -> str:
    """``median [25th–75th percentile]``."""
    q1, med, q3 = np.percentile(np.asarray(xs, np.float64), [25, 50, 75])
    return f"{fmt.format(med)} [{fmt.format(q1)}–{fmt.format(q3)}]"


def ratios(num: Sequence[float], den: Sequence[float]) -> list[float]:
    return [a / b for a, b in zip(num, den)]


def median(xs: Sequence[float]) -> float:
    return float(np.median(xs))


def ms(seconds: Sequence[float]) -> str:
    return spread([1e3 * s for s in seconds], "{:.3g}")


# ---------------------------------------------------------------------------
# Pages
# ---------------------------------------------------------------------------


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _cpu_model() -> str:
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor()


def _git() -> str:
    # A copy of the tree without its history (benchmarks/device.sh runs on an exported
    # commit) names its commit in CLIPJAX_COMMIT.
    if os.environ.get("CLIPJAX_COMMIT"):
        return os.environ["CLIPJAX_COMMIT"]
    run = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout
    try:
        rev, dirty = run("rev-parse", "--short", "HEAD").strip(), run("status", "-s", "clipjax")
    except OSError:  # no git where the tree was copied to
        return "unknown"
    return (rev or "unknown") + (" + uncommitted changes in clipjax/" if dirty else "")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def header(command: str, *, load: bool = True, numpy: bool = False) -> list[str]:
    """A page's header: command, date, device, machine, the load average at the start
    (``load``: it qualifies the wall-clock figures of a shared machine) and versions
    (``numpy``'s too)."""
    dev = jax.devices()[0]
    gpu = dev.platform == "gpu"
    return [
        f"* **command**: `{command}`",
        f"* **date**: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC",
        f"* **device**: {dev.device_kind} (jax platform `{dev.platform}`, "
        f"{jax.device_count()} device(s))" + ("" if gpu else "; no GPU used"),
        f"* **machine**: {_cpu_model()}, {os.cpu_count()} logical cores, {platform.system()}",
        *([f"* **load average at start**: {load_average()}"] if load else []),
        f"* **versions**: python {platform.python_version()}, jax {jax.__version__}, "
        f"jaxlib {version('jaxlib')}, optax {version('optax')}, "
        f"clipjax {clipjax.__version__} (commit {_git()})"
        + (f", numpy {np.__version__}" if numpy else ""),
    ]


def command(script: str, argv: Sequence[str], out: bool = False) -> str:
    """``python benchmarks/<script> <argv>``, as run from the repository root, with no
    machine path: ``--out`` left out (where the page goes does not change it), or with
    ``out`` its path relative to the root (its base name outside the root)."""
    shown, argv = [], list(argv)
    while argv:
        arg = argv.pop(0)
        if arg == "--out" and argv:
            path = argv.pop(0)
            if out:
                rel = os.path.relpath(os.path.abspath(path), ROOT)
                shown += ["--out", os.path.basename(path) if rel.startswith("..") else rel]
        elif not arg.startswith("--out=") or out:
            shown.append(arg)
    return " ".join([f"python benchmarks/{script}", *shown])


def page(*blocks: str | list[str]) -> str:
    """A page's text: its blocks (each a text, or a list of lines) between blank lines."""
    return "\n\n".join(b if isinstance(b, str) else "\n".join(b) for b in blocks) + "\n"


def cost_page_main(
    argv: list[str] | None, doc: str, script: str, title: str, heading: str, name: str,
    measure: Callable[[bool], str],
) -> None:  # fmt: skip
    """The ``main`` of a one-section cost page: ``--quick`` and ``--out``, the header,
    ``measure(quick)`` under ``heading``, printed and written to ``name``."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller tree, fewer rounds")
    parser.add_argument("--out", help="folder of the page (default benchmarks/)")
    args = parser.parse_args(argv)
    head = header(command(script, argv))
    text = page([f"# {title}", "", *head], heading, measure(args.quick))
    print(text)
    write(page_path(args.out, name), text)


def page_path(folder: str | None, name: str) -> str:
    """The path of the page ``name`` in ``folder`` (made if missing), else in benchmarks/."""
    folder = folder or os.path.join(ROOT, "benchmarks")
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, name)


def write(path: str, text: str, note: str = "") -> None:
    """Writes the page ``text`` to ``path`` and says so on stderr."""
    with open(path, "w") as f:
        f.write(text)
    log(f"wrote {path}{note}")


def log(*args: Any) -> None:
    print(*args, file=sys.stderr, flush=True)


def main(section: Callable[[bool], tuple[str, list]], doc: str) -> None:
    """A benchmark script's command line: prints its section."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes, fewer rounds")
    args = parser.parse_args()
    print(section(args.quick)[0])
