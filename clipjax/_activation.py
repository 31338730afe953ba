"""Activation-gradient clipping: AXLearn's per-token gradient monitor, a function a model applies.

AXLearn (apple/axlearn, ``axlearn/common/gradient_monitor.py``) puts a
``jax.custom_vjp`` identity at a layer's output. In the backward pass it takes
the output gradient ``g = dL/dy`` (``[..., features]``: every position before
the last axis is a token), computes each token's L2 norm over the features in
float32, and zeroes the gradients of the ``k`` tokens whose norms are largest
(``top_k_clip_fn``), or only measures percentiles of the norms
(``compute_grad_percentile_no_clip_fn``). A backward pass has no layer context
to log into, so the statistics leave it as the "gradient" of a carrier the
forward pass received: ``jax.grad`` with respect to the carrier hands them
back with the parameter gradients (no callback; jit- and ``lax.scan``-safe).

docs/defences.md ("Activation-gradient clipping") says what it assumes and
lists the differences from AXLearn.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from clipjax import _checks
from clipjax._grouping import path_name
from clipjax._metrics import host, unwrap

Array = jax.Array
ALGO = "activation_grad"
# The linen collection and the NNX variable tag that hold the carriers.
COLLECTION = "activation_stats"
MODES = ("zero", "clip")
Mode = Literal["zero", "clip"]


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StatsLayout:
    """What a carrier's ``values`` hold: a pytree node with no leaves (static).

    Attributes:
      k: the tokens whose gradients are zeroed or scaled down (0: monitor only).
      percentiles: the percentiles of the token norms it reports (0-100 scale).
    """

    k: int
    percentiles: tuple[float, ...] = ()

    @property
    def top(self) -> int:
        """How many of the largest norms it holds: ``k``, at least the largest."""
        return max(self.k, 1)

    @property
    def fields(self) -> tuple[str, ...]:
        """The name of each entry of ``values``, in order."""
        top = ("top_norm", *(f"top_norm_{i}" for i in range(2, self.top + 1)))
        quantiles = tuple(f"p{_label(p)}" for p in self.percentiles)
        return (*top, "threshold", "clipped_tokens", "nonfinite_tokens", *quantiles)

    @property
    def reported(self) -> tuple[tuple[int, str], ...]:
        """``(index, name)`` of the entries a reader reports: all but the threshold and
        the clipped count of a monitor (``k=0``), which clips nothing."""
        skip = {"threshold", "clipped_tokens"} if self.k == 0 else set()
        return tuple((i, f) for i, f in enumerate(self.fields) if f not in skip)


def _label(p: float) -> str:
    """``50``, ``99.9``: a percentile as it reads in a metric name."""
    return np.format_float_positional(p, trim="-")


class ActivationStats(NamedTuple):
    """The carrier of one call's statistics (one layer's; ``[layers]`` of them when stacked).

    :func:`activation_stats_init` makes it (``values`` all zero);
    :func:`clip_activation_gradient` ignores its values in the forward pass and
    returns the backward pass's statistics as its gradient, so ``jax.grad``
    with respect to it gives an ``ActivationStats`` whose ``values`` are the
    statistics, read with :func:`activation_metrics` or :func:`clipjax.metrics`.

    Attributes:
      values: ``float32[..., size]``; as a gradient, in the order of
        ``layout.fields``: the largest finite token norms (``top_norm``,
        ``top_norm_2``, ... ``top_norm_k``), ``threshold``,
        ``clipped_tokens``, ``nonfinite_tokens`` and the percentiles
        (``p50``, ``p99.9``, ...).
      layout: static: ``k`` and the percentiles, so that the fields are named
        inside ``jit`` too.

    Examples:
      >>> import clipjax
      >>> stats = clipjax.activation_stats_init(k=2, percentiles=(50, 99.9))
      >>> stats.values.shape
      (7,)
      >>> stats.layout.fields  # doctest: +NORMALIZE_WHITESPACE
      ('top_norm', 'top_norm_2', 'threshold', 'clipped_tokens', 'nonfinite_tokens',
       'p50', 'p99.9')
    """

    values: Array
    layout: StatsLayout


def _layout(k: Any, percentiles: Any) -> StatsLayout:
    """The layout of ``k`` and ``percentiles``, checked."""
    _checks.integer("k", k, minimum=0)
    if percentiles is None:
        percentiles = ()
    if isinstance(percentiles, (str, bytes)) or not isinstance(percentiles, Sequence):
        raise ValueError(
            f"percentiles must be None or a sequence of numbers in [0, 100], got {percentiles!r}"
        )
    checked = []
    for p in percentiles:
        _checks.static_number("percentiles", p)
        _checks.check("percentiles", p, lambda x: 0 <= x <= 100, "in [0, 100]")
        checked.append(float(p))
    labels = [_label(p) for p in checked]
    if len(set(labels)) != len(labels):
        raise ValueError(f"percentiles must be distinct, got {percentiles!r}")
    return StatsLayout(int(k), tuple(checked))


def activation_stats_init(
    *, k: int = 4, percentiles: Sequence[float] | None = None, layers: int | None = None
) -> ActivationStats:
    """The statistics carrier of one :func:`clip_activation_gradient` call site (all zeros).

    Give each call site its own carrier, made with the call's ``k`` and
    ``percentiles``; ``jax.grad`` sums the gradients of a carrier used twice.

    Args:
      k: the call's ``k``.
      percentiles: the call's ``percentiles``.
      layers: for a stack of layers run under ``lax.scan``, the number of
        layers: ``values`` is then ``[layers, size]`` and the scan hands each
        layer its row (None: one call, ``[size]``).

    Returns:
      An :class:`ActivationStats` with ``float32`` zeros.

    Examples:
      >>> import clipjax
      >>> clipjax.activation_stats_init(k=4, layers=3).values.shape
      (3, 7)
    """
    layout = _layout(k, percentiles)
    shape = (len(layout.fields),)
    if layers is not None:
        _checks.integer("layers", layers, minimum=1)
        shape = (layers, *shape)
    return ActivationStats(jnp.zeros(shape, jnp.float32), layout)


def _check_stats(stats: Any, layout: StatsLayout) -> None:
    call = f"k={layout.k}, percentiles={layout.percentiles or None}"
    if not isinstance(stats, ActivationStats):
        what = f"an array of shape {jnp.shape(stats)}" if hasattr(stats, "shape") else repr(stats)
        raise TypeError(
            "clip_activation_gradient: stats must be the carrier "
            f"clipjax.activation_stats_init({call}) makes (a clipjax.ActivationStats, "
            f"or a linen/NNX module's variable holding one), got {what}"
        )
    if stats.layout != layout:
        made = f"k={stats.layout.k}, percentiles={stats.layout.percentiles or None}"
        raise ValueError(
            f"clip_activation_gradient: stats was made by activation_stats_init({made}), "
            f"but the call has {call}: make it with the call's k and percentiles"
        )
    size = len(layout.fields)
    shape, dtype = jnp.shape(stats.values), jnp.result_type(stats.values)
    if shape != (size,):
        stacked = (
            f"; a carrier made with layers={shape[0]} goes through lax.scan, which hands "
            "each layer its row"
            if len(shape) == 2 and shape[1] == size
            else ""
        )
        raise ValueError(
            f"clip_activation_gradient: stats.values must have shape ({size},) (this call's "
            f"carrier), got {shape}{stacked}"
        )
    if dtype != jnp.float32:
        raise ValueError(f"clip_activation_gradient: stats.values must be float32, got {dtype}")


def clip_activation_gradient(
    y: Array,
    stats: ActivationStats,
    *,
    k: int = 4,
    mode: Mode = "zero",
    percentiles: Sequence[float] | None = None,
) -> Array:
    """``y`` unchanged; in the backward pass, the largest token gradients clipped.

    AXLearn's ``GradientMonitorAndClipLayer`` as a function. The forward pass
    is the identity. The backward pass receives ``g = dL/dy``, whose positions
    before the last axis are tokens (``[batch, tokens, features]``: ``batch *
    tokens`` of them), and:

    1. computes each token's norm ``n_i = ||g_i||`` over the last axis in
       float32 (float64 for float64 activations);
    2. with ``mode="zero"`` (AXLearn's ``top_k_clip_fn``, ``method="topk"``)
       zeroes every token whose norm is at least the ``k``-th largest
       ``n_(k)``: on a tie at ``n_(k)`` more than ``k`` tokens; with
       ``mode="clip"`` scales every token whose norm exceeds the ``(k+1)``-th
       largest ``n_(k+1)`` down to that norm (ties change nothing); with
       ``k=0`` passes ``g`` on untouched (a monitor, like AXLearn's
       ``compute_grad_percentile_no_clip_fn``);
    3. returns the statistics as the gradient of ``stats``.

    A token whose norm is not finite (a NaN or Inf in its gradient, or a
    float32 sum of squares that overflows) is zeroed (with ``k >= 1``) and
    counted in ``nonfinite_tokens``; the norms, the threshold and the
    percentiles are those of the finite tokens, so it corrupts none of them.

    Args:
      y: the activation, ``[..., features]``, floating point.
      stats: the call site's :class:`ActivationStats` (from
        :func:`activation_stats_init` with the same ``k`` and ``percentiles``).
      k: tokens clipped per call, ``0 <= k <`` the number of tokens.
      mode: ``"zero"`` (AXLearn's) or ``"clip"``.
      percentiles: percentiles of the finite token norms to report (NumPy's
        linear method); AXLearn's monitor uses ``(50, 99.9, 99.99, 99.999)``.

    Returns:
      ``y``. The gradient of ``stats`` holds, in ``stats.layout.fields``' order:
      the largest ``k`` finite norms (at least the largest), ``threshold``
      (``n_(k)`` with ``mode="zero"``: tokens at or above it were zeroed;
      ``n_(k+1)`` with ``mode="clip"``: tokens above it were scaled to it),
      ``clipped_tokens`` (tokens whose gradient it zeroed or scaled down; one
      that was zero already is not counted), ``nonfinite_tokens``
      and the percentiles; a norm that does not exist (fewer finite tokens)
      reads 0.

    Raises:
      ValueError: ``k`` is not below the number of tokens (when traced), or
        ``stats`` does not fit the call (its ``k``, its percentiles, its shape).
      TypeError: ``stats`` is not an :class:`ActivationStats`.

    Examples:
      >>> import jax, jax.numpy as jnp, clipjax
      >>> x = jnp.ones((2, 3, 4))  # [batch, tokens, features]
      >>> w = jnp.eye(4)
      >>> def loss(w, stats):
      ...     y = clipjax.clip_activation_gradient(x @ w, stats, k=1)
      ...     return jnp.sum(y * jnp.arange(6.0).reshape(2, 3, 1))  # dL/dy: token t's row is t
      >>> grads, stats_grads = jax.grad(loss, argnums=(0, 1))(w, clipjax.activation_stats_init(k=1))
      >>> float(grads[0, 0])  # 0 + 1 + 2 + 3 + 4: the last token (5) zeroed
      10.0
      >>> m = clipjax.activation_metrics(stats_grads, name="out")
      >>> float(m["activation_grad/out/top_norm"]), int(m["activation_grad/out/clipped_tokens"])
      (10.0, 1)

    References:
      AXLearn, ``axlearn/common/gradient_monitor.py`` (apple/axlearn).
    """
    layout = _layout(k, percentiles)
    _checks.choice("mode", mode, MODES)
    _check_stats(stats, layout)
    shape, dtype = jnp.shape(y), jnp.result_type(y)
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"clip_activation_gradient: y must be floating point, got {dtype}")
    if len(shape) < 1:
        raise ValueError("clip_activation_gradient: y must be [..., features], got a scalar")
    tokens = math.prod(shape[:-1])
    if layout.k >= tokens:
        raise ValueError(
            f"clip_activation_gradient: k={layout.k} must be less than the number of tokens, "
            f"{tokens} (y of shape {shape}: every position before the last axis is a token)"
        )
    return _identity(y, stats.values, layout, mode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _identity(y: Array, values: Array, layout: StatsLayout, mode: str) -> Array:
    del values, layout, mode
    return y


def _identity_fwd(y: Array, values: Array, layout: StatsLayout, mode: str) -> tuple[Array, None]:
    del values, layout, mode
    return y, None


def _identity_bwd(layout: StatsLayout, mode: str, _: None, g: Array) -> tuple[Array, Array]:
    return clip_tokens(g, layout, mode)


_identity.defvjp(_identity_fwd, _identity_bwd)


def clip_tokens(g: Array, layout: StatsLayout, mode: str) -> tuple[Array, Array]:
    """The backward pass: ``(g with its largest tokens clipped, the statistics)``."""
    dtype = jnp.promote_types(g.dtype, jnp.float32)  # float32, or float64 for float64
    norms = jnp.sqrt(jnp.sum(jnp.square(g.astype(dtype)), axis=-1))
    flat = norms.reshape(-1)
    finite = jnp.isfinite(flat)
    # -1 ranks a non-finite token below every norm: it never takes a top-k place.
    ranked = jnp.where(finite, flat, -1.0)
    k = layout.k
    if k == 0:
        top = jnp.max(ranked, keepdims=True)
        threshold, changed, out = jnp.zeros((), dtype), jnp.zeros((), bool), g
    else:
        largest = jax.lax.top_k(ranked, k + 1 if mode == "clip" else k)[0]
        top = largest[:k]
        # A missing norm (fewer finite tokens than asked for) reads 0: every finite token
        # is then among the largest, zeroed, or scaled down to nothing.
        threshold = jnp.maximum(largest[-1], 0.0)
        if mode == "zero":
            # AXLearn's method="topk": every token at or above the k-th largest norm.
            clipped = finite & (flat >= threshold)
            keep = (finite & ~clipped).reshape(norms.shape)[..., None]
            out = jnp.where(keep, g, jnp.zeros((), g.dtype))
        else:
            clipped = finite & (flat > threshold)
            scale = jnp.where(clipped, threshold / jnp.where(clipped, flat, 1.0), 1.0)
            scaled = (g.astype(dtype) * scale.reshape(norms.shape)[..., None]).astype(g.dtype)
            out = jnp.where(finite.reshape(norms.shape)[..., None], scaled, jnp.zeros((), g.dtype))
        # A token whose gradient is zero already is not counted: zeroing it changes nothing.
        changed = clipped & (flat > 0)
    counts = jnp.stack([jnp.sum(changed), jnp.sum(~finite)]).astype(dtype)
    stats = [jnp.maximum(top, 0.0), threshold[None], counts]
    if layout.percentiles:
        stats.append(finite_percentiles(flat, finite, layout.percentiles))
    return out, jnp.concatenate(stats).astype(jnp.float32)


def finite_percentiles(norms: Array, finite: Array, percentiles: tuple[float, ...]) -> Array:
    """NumPy's ``percentile(norms[finite], percentiles)`` (linear method); 0 where none is finite.

    The position of percentile ``q`` among the ``count`` finite norms is
    ``q/100 * (count - 1)``; it is taken as ``q/100 * (n - 1)`` (float64, here)
    less ``q/100 * (n - count)`` (float32, on the device), so that it is exact
    when every token is finite and float32 rounding of a figure the size of the
    non-finite count is all it loses otherwise.
    """
    n = norms.shape[0]
    count = jnp.sum(finite)
    ordered = jnp.sort(jnp.where(finite, norms, jnp.inf))
    dtype = norms.dtype
    q = np.asarray(percentiles, np.float64) / 100.0
    base = q * (n - 1)
    whole = np.floor(base)
    offset = jnp.asarray(base - whole, dtype) - jnp.asarray(q, dtype) * (n - count).astype(dtype)
    step = jnp.floor(offset)
    lower = jnp.clip(jnp.asarray(whole, jnp.int32) + step.astype(jnp.int32), 0, n - 1)
    upper = jnp.minimum(lower + 1, jnp.maximum(count - 1, 0))
    fraction = offset - step
    a, b = ordered[lower], ordered[upper]
    # numpy's _lerp, which interpolates from the nearer end.
    value = jnp.where(fraction >= 0.5, b - (b - a) * (1 - fraction), a + (b - a) * fraction)
    return jnp.where(count > 0, value, 0.0)


# ------------------------------------------------------------------ reading the statistics


def _is_carrier(x: Any) -> bool:
    return isinstance(x, ActivationStats)


def _where(path: tuple[Any, ...], name: str | None) -> str:
    """A carrier's label: ``name`` and its path in the tree (NNX's trailing ``value`` left out)."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    parts = [part for part in (name, path_name(path) if path else None) if part]
    return "/".join(parts) or path_name(())


def report(tree: Any, out: dict[str, Any], name: str | None = None) -> bool:
    """Writes the statistics of every carrier in ``tree`` into ``out``; whether there was one."""
    found = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_is_carrier)[0]
    carriers = [(path, node) for path, node in found if _is_carrier(node)]
    for path, carrier in carriers:
        values = host(carrier.values)
        label = _where(tuple(path), name)
        for index, field in carrier.layout.reported:
            out[f"{ALGO}/{label}/{field}"] = values[..., index]
    return bool(carriers)


def activation_metrics(stats_grads: Any, *, name: str | None = None) -> dict[str, Any]:
    """The statistics of :func:`clip_activation_gradient` as a flat dict of metrics.

    ``clipjax.metrics`` reads the same carriers, with the same names, wherever
    they are in the tree it is given.

    Args:
      stats_grads: the gradient of one carrier, or any tree holding some: a
        dict of them, linen's ``grads["activation_stats"]``, an NNX
        ``nnx.State`` of gradients.
      name: a prefix for the labels (a lone carrier's label is ``name``,
        else ``root``).

    Returns:
      ``{"activation_grad/{label}/{field}": array}``, the label being the
      carrier's path in ``stats_grads`` (after ``name``), the fields those of
      its layout (``top_norm``, ``top_norm_2``, ..., ``threshold``,
      ``clipped_tokens``, ``nonfinite_tokens``, ``p50``, ...; a monitor,
      ``k=0``, has no ``threshold`` and ``clipped_tokens``). Scalars, or
      ``[layers]`` arrays for a stacked carrier; NumPy arrays outside ``jit``.

    Raises:
      ValueError: ``stats_grads`` holds no :class:`ActivationStats` (the
        gradient was taken with respect to the parameters only?).

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> stats = {"block_0": clipjax.activation_stats_init(k=0, percentiles=(50,))}
      >>> for key in sorted(clipjax.activation_metrics(stats)):
      ...     print(key)
      activation_grad/block_0/nonfinite_tokens
      activation_grad/block_0/p50
      activation_grad/block_0/top_norm
    """
    _checks.name(name)
    out: dict[str, Any] = {}
    if not report(stats_grads, out, name):
        raise ValueError(
            "activation_metrics: no clipjax.ActivationStats in stats_grads "
            f"({type(stats_grads).__name__}); pass the gradient with respect to the carriers: "
            "jax.grad(loss, argnums=(0, 1))(params, stats)[1], linen's "
            'grads["activation_stats"], or NNX gradients taken with '
            'nnx.DiffState(0, nnx.Any(nnx.Param, "activation_stats"))'
        )
    return out


# ------------------------------------------------------------------------------- flax


def linen_activation_clip(
    *,
    k: int = 4,
    mode: Mode = "zero",
    percentiles: Sequence[float] | None = None,
    collection: str = COLLECTION,
    name: str | None = None,
) -> Any:
    """A flax linen module that applies :func:`clip_activation_gradient` to its input.

    Its carrier is the variable ``stats`` in the collection ``collection``:
    ``model.init`` creates it, and the gradient of ``loss(variables)`` with
    respect to the whole variables dict holds the statistics under
    ``grads[collection]``. Applied without that collection it still clips,
    and reports nothing. Under ``nn.scan`` give the
    collection a layer axis, ``variable_axes={"params": 0, collection: 0}``.

    Args:
      k, mode, percentiles: as :func:`clip_activation_gradient`.
      collection: the variable collection of the carrier.
      name: the module's name (None: linen's, ``ActivationGradientClip_0``, ...).

    Returns:
      A linen ``nn.Module`` (flax imported now, not with clipjax), called as
      ``y = module(y)``; in a compact block,
      ``y = clipjax.linen_activation_clip(k=4)(y)``. docs/defences.md has
      a whole training step.

    Raises:
      ImportError: flax is not installed.
    """
    layout = _layout(k, percentiles)
    _checks.choice("mode", mode, MODES)
    if not isinstance(collection, str) or not collection:
        raise ValueError(f"collection must be a non-empty str, got {collection!r}")
    return _linen_class()(
        k=layout.k, mode=mode, percentiles=layout.percentiles, collection=collection, name=name
    )


@functools.cache
def _linen_class() -> type:
    import flax.linen as nn

    class ActivationGradientClip(nn.Module):
        """clipjax.clip_activation_gradient, its carrier a variable (see linen_activation_clip)."""

        k: int = 4
        mode: Mode = "zero"
        percentiles: tuple[float, ...] = ()
        collection: str = COLLECTION

        @nn.compact
        def __call__(self, y: Array) -> Array:
            init = functools.partial(activation_stats_init, k=self.k, percentiles=self.percentiles)
            if self.is_initializing() or self.has_variable(self.collection, "stats"):
                stats = self.variable(self.collection, "stats", init).value
            else:
                stats = init()
            return clip_activation_gradient(
                y, stats, k=self.k, mode=self.mode, percentiles=self.percentiles
            )

    return ActivationGradientClip


def nnx_activation_clip(
    *,
    k: int = 4,
    mode: Mode = "zero",
    percentiles: Sequence[float] | None = None,
    tag: str = COLLECTION,
) -> Any:
    """A flax NNX module that applies :func:`clip_activation_gradient` to its input.

    Its carrier is its attribute ``stats``, a variable (not an ``nnx.Param``,
    so optimizers leave it alone) tagged ``tag``. Take the gradient with respect
    to it too, ``nnx.grad(loss, argnums=nnx.DiffState(0, nnx.Any(nnx.Param,
    "activation_stats")))``; the statistics are the gradient's variables
    tagged ``tag``. Under ``nnx.scan`` over a stack made with ``nnx.vmap``
    each layer has its row.

    Args:
      k, mode, percentiles: as :func:`clip_activation_gradient`.
      tag: the variable's tag, a filter that selects it (``"activation_stats"``).

    Returns:
      An ``nnx.Module`` (flax imported now, not with clipjax): in a block's
      ``__init__``, ``self.clip = clipjax.nnx_activation_clip(k=4)``; in its
      ``__call__``, ``y = self.clip(y)``. docs/defences.md has a whole
      training step.

    Raises:
      ImportError: flax is not installed.
    """
    layout = _layout(k, percentiles)
    _checks.choice("mode", mode, MODES)
    if not isinstance(tag, str) or not tag:
        raise ValueError(f"tag must be a non-empty str, got {tag!r}")
    return _nnx_class()(k=layout.k, mode=mode, percentiles=layout.percentiles, tag=tag)


@functools.cache
def _nnx_class() -> type:
    from flax import nnx

    class ActivationStatsVariable(nnx.Variable):
        """An NNX variable holding a clipjax.ActivationStats carrier."""

    class ActivationGradientClip(nnx.Module):
        """clipjax.clip_activation_gradient, its carrier a variable (see nnx_activation_clip)."""

        def __init__(self, *, k: int, mode: Mode, percentiles: tuple[float, ...], tag: str):
            self.k, self.percentiles = k, percentiles
            self.mode: Mode = mode
            init = activation_stats_init(k=k, percentiles=percentiles)
            self.stats = ActivationStatsVariable(init, tag=tag)

        def __call__(self, y: Array) -> Array:
            stats = unwrap(self.stats)
            return clip_activation_gradient(
                y, stats, k=self.k, mode=self.mode, percentiles=self.percentiles
            )

    return ActivationGradientClip
