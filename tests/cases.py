"""Every clipjax clipper, configured to act within a few steps, and a tiny model.

Shared by the data-parallel tests (this package) and the flax, checkpoint and
optax-wrapper tests. ``CLIPPERS`` maps a case name to a factory taking
``**kwargs`` (``axis_name=``, ``name=``) forwarded to the clipper; clippers
still being written (``autoclip``, ``zscore_clip``) join when clipjax has them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

Factory = Callable[..., optax.GradientTransformation]


class Case(NamedTuple):
    """A clipper configuration.

    Attributes:
      make: ``(**kwargs) -> transform``; kwargs (``axis_name=``, ``name=``) go
        to the clipper.
      algo: its metrics prefix.
      scope: ``"global"``, ``"per_layer"`` or ``"per_param"``: how it names groups.
      axis_name: whether it accepts ``axis_name=`` (the norm-based clippers).
    """

    make: Factory
    algo: str
    scope: str = "global"
    axis_name: bool = True


CLIPPERS: dict[str, Case] = {
    "clip_by_global_norm": Case(
        lambda **kw: clipjax.clip_by_global_norm(1.0, **kw), "clip_by_global_norm", axis_name=False
    ),
    "zclip": Case(lambda **kw: clipjax.zclip(warmup_steps=3, **kw), "zclip"),
    "zclip_per_layer": Case(
        lambda **kw: clipjax.zclip(warmup_steps=3, scope="per_layer", **kw), "zclip", "per_layer"
    ),
    "hist_clip": Case(lambda **kw: clipjax.hist_clip(warmup_steps=3, **kw), "hist_clip"),
    "hist_clip_ema_per_layer": Case(
        lambda **kw: clipjax.hist_clip(
            clipjax.ema_criterion(), warmup_steps=3, scope="per_layer", **kw
        ),
        "hist_clip",
        "per_layer",
    ),
    # unitwise: one group per parameter, no axis_name.
    "agc": Case(lambda **kw: clipjax.agc(clipping=0.05, **kw), "agc", "per_param", False),
    "agc_per_layer": Case(
        lambda **kw: clipjax.agc(clipping=0.05, scope="per_layer", **kw), "agc", "per_layer"
    ),
    "clip_norm_growth_per_layer": Case(
        lambda **kw: clipjax.clip_norm_growth(mul=1.2, scope="per_layer", **kw),
        "clip_norm_growth",
        "per_layer",
    ),
    "clip_by_historical_norm": Case(
        lambda **kw: clipjax.clip_by_historical_norm(4, **kw), "clip_by_historical_norm"
    ),
}

_OPTIONAL: dict[str, Case] = {
    "autoclip": Case(
        lambda **kw: clipjax.autoclip(warmup_steps=3, min_history=3, **kw), "autoclip"
    ),
    "autoclip_window_per_layer": Case(
        lambda **kw: clipjax.autoclip(
            mode="percentile",
            percentile=80.0,
            window_size=4,
            warmup_steps=3,
            min_history=3,
            scope="per_layer",
            **kw,
        ),
        "autoclip",
        "per_layer",
    ),
    "autoclip_ema": Case(
        lambda **kw: clipjax.autoclip(
            mode="percentile", history="ema", ema_decay=0.9, warmup_steps=3, min_history=3, **kw
        ),
        "autoclip",
    ),
    "zscore_clip": Case(
        lambda **kw: clipjax.zscore_clip(warmup_steps=3, min_history=3, **kw), "zscore_clip"
    ),
    "clip_by_value": Case(
        lambda **kw: clipjax.clip_by_value(0.05, **kw), "clip_by_value", axis_name=False
    ),
    "clip_by_percentile": Case(
        lambda **kw: clipjax.clip_by_percentile(90.0, **kw),
        "clip_by_percentile",
        "per_param",
        False,
    ),
}
CLIPPERS.update({k: v for k, v in _OPTIONAL.items() if hasattr(clipjax, v.algo)})

IDS = sorted(CLIPPERS)
AXIS_IDS = sorted(k for k, v in CLIPPERS.items() if v.axis_name)

# A two-layer MLP whose dimensions divide by 8, so that FSDP can shard every leaf.
IN, HIDDEN, OUT = 8, 16, 8
BATCH = 32
SPIKES = {5: 30.0}  # step -> factor on the targets: a gradient spike


def mlp_params(seed: int = 0) -> dict[str, Any]:
    """``{"params": {"Dense_0": {kernel, bias}, "Dense_1": {kernel, bias}}}``."""
    k0, k1 = jax.random.split(jax.random.PRNGKey(seed))
    return {
        "params": {
            "Dense_0": {
                "kernel": jax.random.normal(k0, (IN, HIDDEN)) / np.sqrt(IN),
                "bias": jnp.full((HIDDEN,), 0.1, jnp.float32),
            },
            "Dense_1": {
                "kernel": jax.random.normal(k1, (HIDDEN, OUT)) / np.sqrt(HIDDEN),
                "bias": jnp.zeros((OUT,)),
            },
        }
    }


def mlp_apply(params: Any, x: jax.Array) -> jax.Array:
    p = params["params"]
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]


def loss_fn(params: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    return jnp.mean((mlp_apply(params, x) - y) ** 2)


def batches(
    steps: int, seed: int = 0, spikes: dict[int, float] | None = SPIKES
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``steps`` regression batches ``(x [BATCH, IN], y [BATCH, OUT])``, with ``spikes``."""
    spikes = spikes or {}
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(IN, OUT)).astype(np.float32)
    for step in range(steps):
        x = rng.normal(size=(BATCH, IN)).astype(np.float32)
        y = np.sin(x @ w) * np.float32(spikes.get(step, 1.0))
        yield x, y.astype(np.float32)


def optimizer(
    clipper: Case | optax.GradientTransformation, **kwargs: Any
) -> optax.GradientTransformation:
    """``chain(clipper, sgd with momentum)``: the optimizer the ecosystem tests train with.

    Not adam: adam divides each element by its own magnitude, which turns the
    last-bit differences of a data-parallel gradient reduction in near-zero
    elements into visible differences of the updates; momentum SGD is linear,
    so the updates are as close as the gradients.
    """
    if isinstance(clipper, Case):
        clipper = clipper.make(**kwargs)
    return optax.chain(clipper, optax.sgd(0.05, momentum=0.9))


def clipjax_states(opt_state: Any) -> list[Any]:
    """The clipjax states inside an optax state, in tree order."""
    from clipjax import _metrics

    return [
        x
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_metrics.is_clipjax_state)
        if _metrics.is_clipjax_state(x)
    ]


def fan_out(transforms: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """Runs every transform on the same updates and returns the average of their outputs.

    A test harness: one compiled program exercises every clipper on the same
    gradients (compiling one program per clipper and per parallel mode would
    dominate the suite's time), and each clipper's output enters the updates.
    The state is ``{name: state}``.
    """
    names = sorted(transforms)

    def init_fn(params: Any) -> dict[str, Any]:
        return {n: transforms[n].init(params) for n in names}

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        outs, new_state = [], {}
        for n in names:
            out, new_state[n] = transforms[n].update(updates, state[n], params)
            outs.append(out)
        return jax.tree.map(lambda *xs: sum(xs) / len(xs), *outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def all_clippers(names: Any = None, **kwargs: Any) -> optax.GradientTransformation:
    """:func:`fan_out` over ``names`` (default all), each named after its case."""
    names = IDS if names is None else names
    return fan_out({n: CLIPPERS[n].make(name=n, **kwargs) for n in names})


def train_step(tx: optax.GradientTransformation, constrain: Callable[[Any], Any] | None = None):
    """``(params, opt_state, batch) -> (params, opt_state, updates)`` for one step.

    ``constrain`` is applied to the gradients (e.g. a sharding constraint).
    """

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, Any]:
        grads = jax.grad(loss_fn)(params, batch)
        if constrain is not None:
            grads = constrain(grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, updates

    return step


# Tolerances against a single-device run. The data-parallel gradient is the
# same sum in another order, so norms agree to about 1e-7 relative, and
# updates, parameters and first-order statistics to RTOL. Second moments and
# z-scores of nearly equal norms (a variance over the first few steps,
# z = (g - mean) / std) amplify that rounding by up to the norm/std ratio:
# those fields get SECOND_MOMENT_RTOL (measured: at most 2.2e-6).
RTOL = 1e-6
SECOND_MOMENT_RTOL = 1e-5
SECOND_MOMENTS = frozenset({"var", "m2", "std", "z", "spread"})


STEPS = 8
DEVICES = 8


@functools.cache
def single_device_run(steps: int = STEPS) -> list[tuple[Any, Any, Any]]:
    """``[(params, opt_state, updates)]`` after each step of :func:`all_clippers` on one device.

    The reference for every data-parallel mode: the full batch, one device.
    """
    tx = optimizer(all_clippers())
    params = mlp_params()
    state = tx.init(params)
    step = jax.jit(train_step(tx))
    out = []
    for batch in batches(steps):
        params, state, updates = step(params, state, batch)
        out.append(jax.device_get((params, state, updates)))
    return out


# Device d's gradient is c_d * u_t: its group norms are |c_d| * ||u_t||, their
# average over the devices mean(|c|) * ||u_t||.
COEFFS = np.array([1.0, -2.0, 0.5, 3.0, -1.0, 2.0, 0.25, 1.5], np.float32)


@functools.cache
def unaveraged_stream() -> list[tuple[Any, np.ndarray]]:
    """``[(u_t, c_t)]``: a gradient direction per step and the 8 device coefficients."""
    params = mlp_params()
    treedef = jax.tree.structure(params)
    out = []
    for t in range(STEPS):
        keys = jax.random.split(jax.random.PRNGKey(100 + t), treedef.num_leaves)
        leaves = [
            0.3 * jax.random.normal(k, p.shape) for k, p in zip(keys, jax.tree.leaves(params))
        ]
        c = np.roll(COEFFS, t) * np.float32(20.0 if t == 5 else 1.0)
        out.append((jax.tree.unflatten(treedef, leaves), c))
    return out


def scaled_by_device(tree: Any, c: np.ndarray, d: int) -> Any:
    """``tree * c[d] / mean(|c|)``: device d's output when the reference is ``tree``."""
    factor = c[d] / np.mean(np.abs(c))
    return jax.tree.map(lambda x: x * factor, tree)


def per_device(u: Any, c: np.ndarray) -> Any:
    """``[8, ...]`` leaves: device d's gradient ``c[d] * u``."""
    return jax.tree.map(lambda x: jnp.asarray(c).reshape((DEVICES,) + (1,) * x.ndim) * x, u)


@functools.cache
def averaged_norm_reference() -> list[tuple[Any, Any]]:
    """One device fed ``mean(|c|) * u``: ``[(updates, state)]`` per step."""
    tx = all_clippers(AXIS_IDS)
    params = mlp_params()
    update = jax.jit(tx.update)
    state = tx.init(params)
    out = []
    for u, c in unaveraged_stream():
        mean_abs = np.mean(np.abs(c))
        updates, state = update(jax.tree.map(lambda x, m=mean_abs: m * x, u), state, params)
        out.append(jax.device_get((updates, state)))
    return out


def _last_key(path: tuple[Any, ...]) -> str:
    key = path[-1] if path else None
    return str(getattr(key, "name", getattr(key, "key", key)))


def assert_trees_close(actual: Any, expected: Any, rtol: float = RTOL, what: str = "") -> None:
    """Same structure; bool/int leaves equal; float leaves within ``rtol`` of each other.

    Relative to the leaf's largest magnitude, so that an element that is the
    difference of two large numbers does not set the bar. Leaves named in
    ``SECOND_MOMENTS`` get ``max(rtol, SECOND_MOMENT_RTOL)``.
    """
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    for (key_path, b), a in zip(
        jax.tree_util.tree_leaves_with_path(expected), jax.tree.leaves(actual)
    ):
        path = jax.tree_util.keystr(key_path)
        tol = max(rtol, SECOND_MOMENT_RTOL) if _last_key(key_path) in SECOND_MOMENTS else rtol
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype, f"{what}{path}: {a.shape} vs {b.shape}"
        if not np.issubdtype(b.dtype, np.floating):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}{path}")
            continue
        np.testing.assert_array_equal(np.isfinite(a), np.isfinite(b), err_msg=f"{what}{path}")
        finite = np.isfinite(b)
        if _last_key(key_path) == "m2":
            # A sum of squared differences of near-equal norms: an error of ε·|x|
            # in an observation moves m2 by about 2ε·|x|·sqrt(m2), far above
            # ε·m2 when the norms barely move; its square root (the spread of
            # the observations, what a rule reads) has the usual relative error.
            a, b = np.sqrt(np.maximum(a, 0)), np.sqrt(np.maximum(b, 0))
        bound = tol * max(float(np.max(np.abs(b[finite]), initial=0.0)), 1e-30)
        if _last_key(key_path) == "z":
            # A z-score near 0 has an absolute float32 error of about ulp(g)/std.
            bound = max(bound, 1e-5)
        error = float(np.max(np.abs(a[finite] - b[finite]), initial=0.0))
        assert error <= bound, f"{what}{path}: max |difference| {error:.3g} > {bound:.3g}"


def assert_trees_equal(actual: Any, expected: Any, what: str = "") -> None:
    """Same structure and bit-identical leaves."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected), what
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)
