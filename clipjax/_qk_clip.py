"""qk_clip: QK-Clip (MuonClip), the query and key weights of a head rescaled after each step.

Kimi K2's rule (Kimi Team, 2025, Section 2.1 and Algorithm 1): after the
optimizer step, every attention head ``h`` whose largest pre-softmax logit
``S_h`` exceeds ``tau`` has its query and key weights scaled by
``gamma_h**alpha`` and ``gamma_h**(1 - alpha)``, ``gamma_h = tau / S_h``;
under MLA the rotary query takes the whole ``gamma_h``. docs/qk_clip.md lists
the Megatron-LM and MaxText code this restates (checked in
``tests/restate/qk_clip.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from clipjax import _checks, _grouping, _kit, _metrics, _xla
from clipjax._grouping import Stacked
from clipjax._kit import ClipTransform
from clipjax._metrics import GroupInfo

Array = jax.Array
ALGO = "qk_clip"
KINDS = ("query", "key", "rotary_query")
# Leading keys of the trees flax hands out: linen's variable collections.
_PARAMS_ROOT, _LOGITS_ROOT = "params", "intermediates"
# The name flax users sow the max logits under (MaxText's too).
_LOGITS_KEY = "max_logits"


@dataclasses.dataclass(frozen=True)
class QKHeads:
    """Where a query or key projection's heads lie in the leaves a pattern names.

    In ``span`` of ``axis``, the leaf holds ``count`` heads in equal,
    contiguous blocks; ``dims`` keeps a range of each head's dimensions (in
    its block, or along the next axis). Layouts: :doc:`/qk_clip`.

    Attributes:
      pattern: ``/``-separated regular expressions, each matching one whole
        key of a leaf's path, consecutively (``"attn/q_proj"``); the keys
        before the match name the attention module.
      axis: the head axis of one layer's leaf (None: ``qk_clip``'s ``head_axis``).
      span: ``(start, stop)`` along ``axis`` (a fused ``qkv`` kernel's third).
      dims: ``(start, stop)`` of each head's dimensions.
      count: the heads in ``span`` (None: the query heads, ``kv_heads`` for a key);
        a query part may hold ``kv_heads`` blocks, each a group's query heads.

    Examples:
      >>> import optax, clipjax
      >>> d = 64  # a fused [d_model, 3 * d] kernel: q, k, v thirds of 4 heads each
      >>> query = clipjax.QKHeads("qkv", axis=-1, span=(0, d))
      >>> key = clipjax.QKHeads("qkv", axis=-1, span=(d, 2 * d))
      >>> tx = clipjax.qk_clip(optax.contrib.muon(1e-2), 100.0, query=query, key=key)
    """

    pattern: str
    axis: int | None = None
    span: tuple[int, int] | None = None
    dims: tuple[int, int] | None = None
    count: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.pattern, str) or not self.pattern.strip("/"):
            raise ValueError(f"QKHeads: pattern must be a non-empty str, got {self.pattern!r}")
        for part in self.pattern.split("/"):
            try:
                re.compile(part)
            except re.error as error:
                raise ValueError(f"QKHeads: bad pattern {self.pattern!r}: {error}") from None
        if self.axis is not None:
            _check_axis("QKHeads: axis", self.axis)
        for label, value in (("span", self.span), ("dims", self.dims)):
            if value is None:
                continue
            if isinstance(value, list):  # kept hashable: the layouts are cached by it
                value = tuple(value)
                object.__setattr__(self, label, value)
            ok = isinstance(value, tuple) and len(value) == 2
            ok = ok and all(
                isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in value
            )
            if not ok or not 0 <= value[0] < value[1]:
                raise ValueError(
                    f"QKHeads: {label} must be (start, stop) with 0 <= start < stop, got {value!r}"
                )
        if self.count is not None:
            _checks.integer("QKHeads count", self.count, minimum=1)

    def match(self, keys: tuple[str, ...]) -> int | None:
        """Where the pattern first matches ``keys``, or None."""
        parts = self.pattern.strip("/").split("/")
        for start in range(len(keys) - len(parts) + 1):
            if all(re.fullmatch(p, k) for p, k in zip(parts, keys[start:])):
                return start
        return None


HeadsSpec = str | QKHeads | Sequence[str | QKHeads]


class QKClipState(NamedTuple):
    """State of :func:`qk_clip`: the optimizer's state and the metrics of its attention modules.

    One group per attention module (per layer of a stacked module), named by
    the path before the query pattern's match (``layers/3/attn``).

    Attributes:
      inner_state: the wrapped optimizer's state.
      metrics: per group ``max_logit`` (the largest of its heads' max logits),
        ``clipped`` (a head was rescaled), ``clipped_heads`` (how many query
        heads exceeded ``tau``), ``factor`` (the smallest ``gamma``, 1 when
        none), and the counters ``step``, ``clipped_count``, ``nonfinite_count``.
      info: static names (algorithm, prefix, groups, leaves).

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> params = {"attn": {"query": jnp.ones((8, 2, 4)), "key": jnp.ones((8, 2, 4))}}
      >>> state = clipjax.qk_clip(optax.sgd(0.1)).init(params)
      >>> isinstance(state, clipjax.QKClipState), state.info.groups
      (True, ('attn',))
    """

    inner_state: Any
    metrics: dict[str, Array]
    info: GroupInfo


def _check_axis(name: str, value: Any) -> None:
    _checks.static_number(name, value)
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")


def _specs(value: Any, label: str) -> tuple[QKHeads, ...]:
    if value is None:
        return ()
    single = isinstance(value, (str, QKHeads)) or not isinstance(value, Sequence)
    items = [value] if single else list(cast(Sequence[Any], value))
    out = []
    for item in items:
        if isinstance(item, str):
            item = QKHeads(item)
        if not isinstance(item, QKHeads):
            raise ValueError(
                f"qk_clip: {label} must be a path pattern (str), a clipjax.QKHeads or a "
                f"sequence of them, got {value!r}"
            )
        out.append(item)
    if not out and label != "rotary_query":
        raise ValueError(f"qk_clip: {label} needs at least one pattern")
    return tuple(out)


def _natural(name: str) -> list[tuple[int, str]]:
    """Sort key: ``layers_2`` before ``layers_10``."""
    return [(int(t), "") if t.isdigit() else (-1, t) for t in re.split(r"(\d+)", name)]


# ----------------------------------------------------------------------- the static plan


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """A leaf some part covers: where its heads are and which groups it serves."""

    index: int  # position in the params' leaves
    name: str
    shape: tuple[int, ...]
    parts: tuple[tuple[str, QKHeads], ...]  # (kind, where)
    layer_axis: int | None  # in the whole leaf, for a stacked one
    rows: tuple[int, ...]  # its groups: one, or one per layer


@dataclasses.dataclass(frozen=True)
class _Plan:
    groups: tuple[str, ...]
    modules: tuple[tuple[str, tuple[int, ...], bool], ...]  # (module path, rows, stacked)
    leaves: tuple[_Leaf, ...]


@functools.lru_cache(maxsize=64)
def _plan(
    keys: tuple[tuple[str, ...], ...],
    shapes: tuple[tuple[int, ...], ...],
    inserts: tuple[int | None, ...],
    layer_axis: int,
    specs: tuple[tuple[QKHeads, ...], ...],
) -> _Plan:
    """The groups of a params tree and the leaves each part covers (static, cached)."""
    matched: dict[int, tuple[list[tuple[str, QKHeads]], tuple[str, ...]]] = {}
    hits = {spec: 0 for kind_specs in specs for spec in kind_specs}
    for i, path in enumerate(keys):
        for kind, kind_specs in zip(KINDS, specs):
            for spec in kind_specs:
                at = spec.match(path)
                if at is None:
                    continue
                hits[spec] += 1
                parts, module = matched.setdefault(i, ([], path[:at]))
                if module != path[:at]:
                    raise ValueError(
                        f"qk_clip: leaf {'/'.join(path)} is matched at two depths "
                        f"({'/'.join(module) or 'root'} and {'/'.join(path[:at]) or 'root'}); "
                        "give patterns that name the same attention module"
                    )
                parts.append((kind, spec))
    unmatched = [spec.pattern for spec, n in hits.items() if n == 0]
    if unmatched:
        raise ValueError(
            f"qk_clip: no parameter matches the pattern(s) {unmatched}; the leaves are "
            f"{[_grouping.path_name(k) for k in keys[:8]]}{' ...' * (len(keys) > 8)}"
        )
    modules: dict[str, tuple[list[str], int | None]] = {}
    leaf_groups: dict[int, list[str]] = {}
    kinds_of: dict[str, set[str]] = {}
    for i, (parts, module) in matched.items():
        path, shape, insert = keys[i], shapes[i], inserts[i]
        label = "/".join(module)
        if insert is None:
            names, layers = ["/".join(module) or "root"], None
        else:
            # A layer key below the module (a callable ``layers`` puts the index before the
            # leaf's own key): the index ends the module's name.
            insert = min(insert, len(module))
            if not -len(shape) <= layer_axis < len(shape):
                raise ValueError(
                    f"qk_clip: stacked leaf {'/'.join(path)} of shape {shape} has no layer "
                    f"axis {layer_axis}"
                )
            layers = shape[layer_axis % len(shape)]
            names = ["/".join((*module[:insert], str(k), *module[insert:])) for k in range(layers)]
        seen = modules.setdefault(label, (names, layers))
        if seen[1] != layers:
            raise ValueError(
                f"qk_clip: attention module {label or 'root'} mixes stacked and unstacked "
                f"leaves, or stacks of other sizes ({seen[1]} and {layers} layers; leaf "
                f"{'/'.join(path)})"
            )
        leaf_groups[i] = names
        for name in names:
            kinds_of.setdefault(name, set()).update(kind for kind, _ in parts)
    for name, kinds in kinds_of.items():
        for needed in ("query", "key"):
            if needed not in kinds:
                raise ValueError(
                    f"qk_clip: attention module {name} has no {needed} leaf (its leaves match "
                    f"{sorted(kinds)} only); check the {needed}= pattern"
                )
    groups = tuple(sorted(kinds_of, key=_natural))
    row = {name: r for r, name in enumerate(groups)}
    leaves = tuple(
        _Leaf(
            index=i,
            name="/".join(keys[i]),
            shape=shapes[i],
            parts=tuple(parts),
            layer_axis=None if inserts[i] is None else layer_axis % len(shapes[i]),
            rows=tuple(row[name] for name in leaf_groups[i]),
        )
        for i, (parts, _) in sorted(matched.items())
    )
    module_rows = tuple(
        (label, tuple(row[n] for n in names), layers is not None)
        for label, (names, layers) in modules.items()
    )
    return _Plan(groups, module_rows, leaves)


def _plan_of(params: Any, scope: Stacked | None, specs: Any) -> tuple[_Plan, list[Any], Any]:
    leaves, paths, treedef = _grouping.leaves_with_names(params)
    keys = tuple(tuple(_grouping.path_name((k,)) for k in path) for path in paths)
    shapes = tuple(tuple(np.shape(x)) for x in leaves)
    inserts = tuple(
        None
        if scope is None
        else scope.insert_at(path, jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)))
        for path, x in zip(paths, leaves)
    )
    axis = 0 if scope is None else scope.axis
    return _plan(keys, shapes, inserts, axis, specs), leaves, treedef


def _layout(
    leaf: _Leaf,
    shape: tuple[int, ...],
    axis: int,
    kind: str,
    spec: QKHeads,
    heads: int,
    kv_heads: int,
) -> tuple[Any, ...] | str:
    """A part's layout along ``axis`` of one layer's leaf, or why the heads do not lie there."""
    start, stop = spec.span or (0, shape[axis])
    count = spec.count or (kv_heads if kind == "key" else heads)
    allowed = {kv_heads} if kind == "key" else {heads, kv_heads}
    where = f"qk_clip: {kind} leaf {leaf.name} (one layer: {shape}, head axis {axis})"
    if stop > shape[axis]:
        return f"{where}: span {spec.span} exceeds the axis of {shape[axis]}"
    if count not in allowed:
        return f"{where}: count {count} must be one of {sorted(allowed)}"
    if (stop - start) % count:
        return (
            f"{where}: {stop - start} entries do not split into {count} heads (the max "
            f"logits have {heads} query heads, kv_heads={kv_heads})"
        )
    block = (stop - start) // count
    along_next = spec.dims is not None and block == 1
    if along_next and axis + 1 >= len(shape):
        return f"{where}: dims {spec.dims} need an axis after the head axis"
    limit = shape[axis + 1] if along_next else block
    if spec.dims is not None and spec.dims[1] > limit:
        return f"{where}: dims {spec.dims} exceed each head's {limit} dimensions"
    return (kind, start, stop, count, block, along_next, spec.dims)


def _inferred_axis(
    leaf: _Leaf, shape: tuple[int, ...], kind: str, spec: QKHeads, heads: int, kv_heads: int
) -> int:
    """The head axis of a part given none: the one of the last two axes its heads split;
    where both do, -2 only if it holds exactly the heads, else refused (no silent guess)."""
    ndim = len(shape)
    readings = {
        a: _layout(leaf, shape, a, kind, spec, heads, kv_heads)
        for a in (ndim - 2, ndim - 1)
        if a >= 0
    }
    fits = [a for a, layout in readings.items() if not isinstance(layout, str)]
    if len(fits) == 1:
        return fits[0]
    if not fits:
        raise ValueError(str(readings[ndim - 2 if ndim > 1 else ndim - 1]))
    count = cast(tuple[Any, ...], readings[ndim - 2])[3]
    start, stop = spec.span or (0, shape[ndim - 2])
    if stop - start == count or (count == 1 and spec.span is None and spec.dims is None):
        return ndim - 2  # flax's [..., heads, head_dim]; or one head, the whole leaf either way
    raise ValueError(
        f"qk_clip: {kind} leaf {leaf.name} (one layer: {shape}) splits into {count} heads "
        f"along axis -2 ({shape[-2]} entries) and along axis -1 ({shape[-1]}): give "
        f"head_axis= (-1 for [d_model, heads * head_dim] kernels, -2 for [heads * head_dim, "
        f"d_model]) or QKHeads(axis=...) for this leaf"
    )


@functools.lru_cache(maxsize=256)
def _source(
    leaf: _Leaf, head_axis: int | None, heads: int, kv_heads: int
) -> tuple[np.ndarray, tuple[int, ...]]:
    """The factor (index into query, key, rotary query, 1) each entry of the leaf's
    head axis (and the next, for ``dims``) takes; and those axes."""
    shape = list(leaf.shape)
    if leaf.layer_axis is not None:
        del shape[leaf.layer_axis]
    ndim, one_layer = len(shape), tuple(shape)
    axes = {
        spec.axis
        if spec.axis is not None
        else head_axis
        if head_axis is not None
        else _inferred_axis(leaf, one_layer, kind, spec, heads, kv_heads)
        for kind, spec in leaf.parts
    }
    normal = {a % ndim if -ndim <= a < ndim else None for a in axes}
    if None in normal or len(normal) != 1:
        raise ValueError(
            f"qk_clip: leaf {leaf.name} (one layer: {one_layer}) has no single head axis "
            f"{sorted(axes)}"
        )
    axis = cast(int, normal.pop())
    per_group = heads // kv_heads
    layouts = []
    for kind, spec in leaf.parts:
        layout = _layout(leaf, one_layer, axis, kind, spec, heads, kv_heads)
        if isinstance(layout, str):
            raise ValueError(layout)
        layouts.append(layout)
    two_d = any(layout[5] for layout in layouts)
    source = np.full((shape[axis], shape[axis + 1]) if two_d else (shape[axis],), -1, np.int32)
    for kind, start, stop, count, block, along_next, dims in layouts:
        rel = np.arange(shape[axis]) - start
        inside = (rel >= 0) & (rel < stop - start)
        head = np.where(inside, rel // block, 0)
        group = head if count == kv_heads else head // per_group
        value = KINDS.index(kind) * kv_heads + group
        covered = inside.copy()
        if dims is not None and not along_next:
            covered &= (rel % block >= dims[0]) & (rel % block < dims[1])
        if two_d:
            value = np.broadcast_to(value[:, None], source.shape)
            columns = np.arange(shape[axis + 1])
            in_dims = (
                (columns >= dims[0]) & (columns < dims[1]) if along_next and dims else columns >= 0
            )
            covered = covered[:, None] & in_dims[None, :]
        if np.any(covered & (source >= 0)):
            raise ValueError(f"qk_clip: two parts cover the same entries of leaf {leaf.name}")
        source = np.where(covered, value, source)
    source = np.where(source < 0, 3 * kv_heads, source).astype(np.int32)
    full = [
        a if leaf.layer_axis is None or a < leaf.layer_axis else a + 1 for a in (axis, axis + 1)
    ]
    return source, tuple(full[: source.ndim])


# ----------------------------------------------------------------------- the max logits


def _logit_keys(path: Any) -> tuple[str, ...]:
    keys = tuple(
        _grouping.path_name((k,))
        for k in path
        if not (isinstance(k, jax.tree_util.GetAttrKey) and k.name == "value")
    )
    return keys[1:] if keys[:1] == (_LOGITS_ROOT,) else keys


def _gathered(max_logits: Any, plan: _Plan, who: str) -> Array:
    """``max_logits`` as ``[groups, heads]``: an array as it is, a tree by module path."""
    groups = len(plan.groups)
    if jax.tree_util.treedef_is_leaf(jax.tree.structure(max_logits)):
        x = _metrics.unwrap(max_logits)
        x = jnp.asarray(x)
        if x.ndim == 1 and groups == 1:
            x = x[None]
        if x.ndim != 2 or x.shape[0] != groups:
            shown = ", ".join(plan.groups[:4]) + (", ..." * (groups > 4))
            raise ValueError(
                f"{who}: max_logits must be [groups, heads] with a row per attention module "
                f"in state.info.groups order ({groups}: {shown}), or a tree of them by module "
                f"path; got shape {x.shape}"
            )
        return x
    found = [
        (_logit_keys(path), _metrics.unwrap(leaf))
        for path, leaf in jax.tree_util.tree_flatten_with_path(max_logits)[0]
    ]
    # Where the tree names its leaves max_logits (flax's sown values), the other values a
    # module sowed (attention weights, ...) are not logits.
    named = any(_LOGITS_KEY in keys for keys, _ in found)
    rows: list[Any] = [None] * groups
    for label, module_rows, stacked in plan.modules:
        module = tuple(label.split("/")) if label else ()
        if module[:1] == (_PARAMS_ROOT,):
            module = module[1:]
        values = [
            jnp.asarray(x)
            for keys, x in found
            if keys[: len(module)] == module and (not named or _LOGITS_KEY in keys[len(module) :])
        ]
        if not values:
            raise ValueError(
                f"{who}: max_logits holds nothing under {label or 'the root'}, the attention "
                f"module of groups {[plan.groups[r] for r in module_rows[:3]]}; its leaves are "
                f"{['/'.join(k) for k, _ in found[:6]]}"
            )
        reduced = []
        for x in values:
            if stacked:
                if x.ndim < 2 or x.shape[0] != len(module_rows):
                    raise ValueError(
                        f"{who}: max_logits of the stacked module {label} must be [layers "
                        f"({len(module_rows)}), ..., heads], got shape {x.shape}"
                    )
                reduced.append(jnp.max(x, axis=tuple(range(1, x.ndim - 1))))
            else:
                reduced.append(jnp.max(x, axis=tuple(range(x.ndim - 1))) if x.ndim > 1 else x)
        value = functools.reduce(jnp.maximum, reduced)
        for k, r in enumerate(module_rows):
            rows[r] = value[k] if stacked else value
    heads = {jnp.shape(r)[-1] for r in rows}
    if len(heads) != 1:
        raise ValueError(
            f"{who}: the modules' max logits have different head counts {sorted(heads)}"
        )
    return jnp.stack(rows)


# ----------------------------------------------------------------------- the transform


def _initial_metrics(groups: int, dtype: Any) -> dict[str, Array]:
    integers = ("clipped_heads", "step", "clipped_count", "nonfinite_count")
    return _kit.new_metrics(groups, dtype, ("max_logit", "clipped", "factor"), integers, factor=1)


def _rescaled(update: Array, param: Array, factor: Array) -> Array:
    """``factor * (param + update) - param`` where ``factor < 1``; ``update`` itself elsewhere."""
    dtype = jnp.promote_types(jnp.promote_types(update.dtype, param.dtype), factor.dtype)
    weight = param.astype(dtype) + update.astype(dtype)
    new = (factor.astype(dtype) * weight - param.astype(dtype)).astype(update.dtype)
    return jnp.where(factor < 1, new, update)


def _checked(
    tau: Any, alpha: Any, head_axis: Any, kv_heads: Any, scope: Any, axis_name: Any
) -> None:
    _checks.positive("tau", tau)
    _checks.check("alpha", alpha, lambda x: 0 <= x <= 1, "in [0, 1]")
    if head_axis is not None:
        _check_axis("head_axis", head_axis)
    if kv_heads is not None:
        _checks.integer("kv_heads", kv_heads, minimum=1)
    if scope is not None and not isinstance(scope, Stacked):
        raise ValueError(
            f"qk_clip: scope must be None or clipjax.stacked(...) (the layer key and axis of "
            f"stacked leaves), got {scope!r}"
        )
    if axis_name is not None and not isinstance(axis_name, (str, tuple)):
        raise ValueError(f"axis_name must be a str (or a tuple of str), got {axis_name!r}")


def _check_optimizer(optimizer: Any) -> None:
    if callable(getattr(optimizer, "init", None)) and callable(getattr(optimizer, "update", None)):
        return
    hint = ""
    if isinstance(optimizer, (int, float, np.number)) and not isinstance(optimizer, bool):
        hint = (
            f" (tau={optimizer!r} first, as in 0.4? qk_clip now wraps the optimizer whose new "
            "weights it rescales, clipjax.qk_clip(optax.contrib.muon(...), tau=100.0), instead "
            "of being chained after it, where nothing stopped it from landing before it)"
        )
    raise ValueError(
        "qk_clip: optimizer must be an optax GradientTransformation, the optimizer whose "
        f"step it rescales, got {optimizer!r}{hint}"
    )


def qk_clip(
    optimizer: optax.GradientTransformation,
    tau: float = 100.0,
    *,
    query: HeadsSpec = "query",
    key: HeadsSpec = "key",
    rotary_query: HeadsSpec | None = None,
    head_axis: int | None = None,
    kv_heads: int | None = None,
    alpha: float = 0.5,
    scope: Stacked | None = None,
    axis_name: str | None = None,
    name: str | None = None,
) -> ClipTransform:
    """QK-Clip (MuonClip): ``optimizer``'s step, then the query and key weights of heads
    whose logits exceed ``tau`` rescaled.

    It runs ``optimizer``, then, given each query head's largest pre-softmax
    logit ``S_h`` (``update(..., max_logits=...)``), returns updates such that
    ``params + updates`` is the optimizer's new weights with, for every head
    over ``tau``::

        gamma = tau / S_h;   W_q[h] *= gamma**alpha;   W_k[h] *= gamma**(1 - alpha)
        MLA: W_q_rope[h] *= gamma   (the shared rotary key untouched)

    Under GQA/MQA a shared key head takes the smallest factor of its query
    heads, as Megatron-LM does. ``tau`` and ``alpha`` may be injected with
    ``optax.inject_hyperparams``; the other arguments are static.

    Static arguments: ``optimizer``, ``head_axis`` and ``kv_heads``; every other number may be
    injected.

    Args:
      optimizer: the optimizer whose new weights are rescaled (e.g.
        ``optax.contrib.muon(lr)``); it gets the gradients and the extra args.
      tau: the logit bound (K2: 100).
      query: the query weights: path patterns or :class:`clipjax.QKHeads`
        (default ``"query"``, flax's ``MultiHeadAttention``).
      key: the key weights (default ``"key"``).
      rotary_query: MLA's per-head rotary query weights, scaled by ``gamma``.
      head_axis: the head axis of each matched leaf (of one layer): -2 for
        ``[features, heads, head_dim]``, -1 for ``[features, heads * head_dim]``.
        Default: inferred where unambiguous, else a ``ValueError``.
      kv_heads: key heads under GQA/MQA (default: as many as query heads).
      alpha: the query's share of the factor (Megatron's ``qk_clip_alpha``).
      scope: ``clipjax.stacked(layers=..., axis=...)`` for layer-stacked leaves:
        each layer is a group; its max logits ``[layers, heads]``.
      axis_name: under ``shard_map``/``pmap``, take the max logits' max over it.
      name: metrics prefix (default ``qk_clip``).

    Returns:
      A :class:`~clipjax.ClipTransform` whose ``update(grads, state, params,
      *, max_logits)`` needs the params and ``max_logits``: ``[groups, heads]``,
      a tree of ``[..., heads]`` maxima under each module's path (flax
      intermediates), or a function of the new weights that returns either.
      Its state is a :class:`QKClipState`.

    Examples:
      >>> import jax.numpy as jnp, optax, clipjax
      >>> params = {"attn": {"query": jnp.ones((4, 2, 3)), "key": jnp.ones((4, 2, 3))}}
      >>> tx = clipjax.qk_clip(optax.sgd(0.0), tau=100.0)
      >>> state = tx.init(params)
      >>> updates, state = tx.update(params, state, params, max_logits=jnp.array([400.0, 50.0]))
      >>> new = optax.apply_updates(params, updates)
      >>> new["attn"]["query"][0, :, 0].tolist(), new["attn"]["key"][0, :, 0].tolist()
      ([0.5, 1.0], [0.5, 1.0])
      >>> float(clipjax.metrics(state)["qk_clip/attn/factor"])
      0.25

    References:
      Kimi Team, `Kimi K2: Open Agentic Intelligence
      <https://arxiv.org/abs/2507.20534>`_, 2025 (MuonClip, Algorithm 1);
      Megatron-LM ``clip_qk``; MaxText ``qk_clip_utils.py`` (module docstring).
    """
    _check_optimizer(optimizer)
    _checked(tau, alpha, head_axis, kv_heads, scope, axis_name)
    _checks.name(name)
    specs = (_specs(query, "query"), _specs(key, "key"), _specs(rotary_query, "rotary_query"))
    axis_of_heads = None if head_axis is None else int(head_axis)
    inner = optax.with_extra_args_support(optimizer)
    who = name or ALGO

    def init_fn(params: Any) -> QKClipState:
        inner_state = inner.init(params)
        if _kit.is_placeholder(params):
            info = _metrics.PlaceholderInfo(ALGO, name)
            return QKClipState(inner_state, _initial_metrics(0, jnp.float32), info)
        plan, leaves, _ = _plan_of(params, scope, specs)
        grouping = _grouping.make_grouping(params, "global")
        info = GroupInfo(ALGO, name, plan.groups, grouping.leaf_names, grouping.leaf_shapes)
        dtype = _grouping.norm_dtype(leaves)
        metrics = _xla.own_buffers(_initial_metrics(len(plan.groups), dtype))
        return QKClipState(inner_state, metrics, info)

    def update_fn(
        updates: Any,
        state: QKClipState,
        params: Any = None,
        *,
        max_logits: Any = None,
        **extra_args: Any,
    ) -> tuple[Any, QKClipState]:
        _checks.check_state(state, QKClipState, who)
        if params is None:
            raise ValueError(
                f"{who}: update needs params (tx.update(grads, state, params, "
                "max_logits=...)): the rescaled weights are params + the optimizer's updates"
            )
        if max_logits is None:
            raise ValueError(
                f"{who}: update needs max_logits=, the step's largest attention logit of each "
                "head ([groups, heads], or flax intermediates; see clipjax.max_attention_logits)"
            )
        plan, param_leaves, _ = _plan_of(params, scope, specs)
        grouping = _grouping.make_grouping(updates, "global")
        grouping.check_matches(state.info.leaves, state.info.shapes, who)
        if plan.groups != state.info.groups:
            raise ValueError(
                f"{who}: the state was built for the attention modules {state.info.groups[:4]}, "
                f"these params have {plan.groups[:4]}; was the state restored from another model?"
            )
        updates, inner_state = inner.update(updates, state.inner_state, params, **extra_args)
        if callable(max_logits):
            max_logits = max_logits(optax.apply_updates(params, updates))
        leaves, _, treedef = _grouping.leaves_with_names(updates)
        _grouping.check_inexact(leaves, grouping, who)
        dtype = state.metrics["factor"].dtype
        logits = _gathered(max_logits, plan, who).astype(dtype)
        if axis_name is not None:
            logits = jax.lax.pmax(logits, axis_name)
        heads = logits.shape[-1]
        groups_kv = heads if kv_heads is None else kv_heads
        if heads % groups_kv:
            raise ValueError(f"{who}: {heads} query heads do not split into kv_heads={groups_kv}")

        finite = jnp.isfinite(logits)
        over = finite & (logits > tau)
        gamma_head = jnp.where(over, tau / jnp.where(over, logits, 1), 1).astype(dtype)
        # A shared key head bounds every query head that reads it (Megatron-LM's group max).
        gamma = jnp.min(gamma_head.reshape(len(plan.groups), groups_kv, -1), axis=-1)
        ones = jnp.ones((len(plan.groups), 1), dtype)
        table = jnp.concatenate([gamma**alpha, gamma ** (1 - alpha), gamma, ones], axis=-1)
        table = _xla.computed_once(table)

        new_leaves = list(leaves)
        for leaf in plan.leaves:
            source, axes = _source(leaf, axis_of_heads, heads, groups_kv)
            factor = table[np.asarray(leaf.rows)][:, source]  # [rows, *source axes]
            ndim = len(leaf.shape)
            if leaf.layer_axis is None:
                factor, axes = factor[0], axes
            else:
                axes = (leaf.layer_axis, *axes)
            order = [int(i) for i in np.argsort(axes)]
            factor = jnp.transpose(factor, order)
            shape = [1] * ndim
            for a in (axes[i] for i in order):
                shape[a] = leaf.shape[a]
            i = leaf.index
            new_leaves[i] = _rescaled(leaves[i], param_leaves[i], factor.reshape(shape))

        clipped_heads = jnp.sum(over, axis=-1)
        metrics = _kit.step_metrics(
            state.metrics,
            clipped=clipped_heads > 0,
            finite=jnp.all(finite, axis=-1),
            max_logit=jnp.max(logits, axis=-1),
            clipped_heads=clipped_heads,
            factor=jnp.min(gamma, axis=-1),
        )
        new_state = QKClipState(inner_state, metrics, state.info)
        return jax.tree_util.tree_unflatten(treedef, new_leaves), new_state

    return ClipTransform(init_fn, update_fn)  # pyright: ignore[reportArgumentType]
