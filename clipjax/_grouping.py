"""How leaves become groups, and how groups become norms and scaled leaves.

Static Python over the tree structure (cached per structure) plus the two
kernels that touch gradient memory: :func:`group_norms` (one read of every
leaf) and :func:`apply_scales` (one scalar multiply per leaf).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

KeyPath = tuple[Any, ...]
ScopeFn = Callable[[KeyPath, Any], str]


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A scope that gives each slice of a layer-stacked leaf its own groups.

    Made by :func:`clipjax.stacked`; see there.

    Attributes:
      scope: the scope applied to each slice as if it were a leaf of its own:
        ``"per_param"``, ``"per_layer"`` or a callable ``(path, leaf) -> str``.
      layers: which leaves are stacked: the name of a key in their path (the
        layer index is inserted after it) or a callable ``(path, leaf) ->
        bool`` (the index is inserted before the leaf's own key).
      axis: the layer axis of a stacked leaf.
    """

    scope: Any
    layers: str | Callable[[KeyPath, Any], bool]
    axis: int = 0

    def insert_at(self, path: KeyPath, leaf: Any) -> int | None:
        """Where the layer index goes in ``path``, or None for a leaf that is not stacked."""
        if callable(self.layers):
            return len(path) - 1 if self.layers(path, leaf) else None
        for position, key in enumerate(path):
            if _key_name(key) == self.layers:
                return position + 1
        return None


# A scope: one of the named groupings, a function from a leaf's (key path,
# leaf) to its group name, or one of these applied to each slice of stacked
# leaves.
Scope = Literal["global", "per_param", "per_layer"] | ScopeFn | Stacked
# agc also groups by output unit.
AGCScope = Literal["unitwise", "global", "per_param", "per_layer"] | ScopeFn | Stacked

SCOPES = ("global", "per_param", "per_layer")


def validate_scope(scope: Any, allowed: Sequence[str] = SCOPES) -> None:
    """Raises (naming ``scope``) unless it is allowed or a callable of ``(path, leaf)``."""
    if isinstance(scope, Stacked):
        if scope.scope == "global" or isinstance(scope.scope, Stacked):
            raise ValueError(
                f"clipjax.stacked: scope must be 'per_param', 'per_layer' or a callable, "
                f"got {scope.scope!r}"
            )
        validate_scope(scope.scope, ("per_param", "per_layer"))
        return
    if callable(scope):
        try:
            signature = inspect.signature(scope)
        except (TypeError, ValueError):
            return
        try:
            signature.bind(("params", "w"), None)
        except TypeError:
            raise TypeError(
                f"scope must be a str or a callable (path, leaf) -> str taking two "
                f"positional arguments, the leaf's key path and the leaf; got "
                f"{getattr(scope, '__name__', scope)!r} with signature {signature}"
            ) from None
        return
    if scope not in allowed:
        raise ValueError(f"scope must be one of {tuple(allowed)} or a callable, got {scope!r}")


def _key_name(key: Any) -> str:
    if isinstance(key, jax.tree_util.DictKey):
        return str(key.key)
    if isinstance(key, jax.tree_util.GetAttrKey):
        return str(key.name)
    if isinstance(key, jax.tree_util.SequenceKey):
        return str(key.idx)
    if isinstance(key, jax.tree_util.FlattenedIndexKey):
        return str(key.key)
    return str(key)


def _strip_wrappers(path: KeyPath) -> KeyPath:
    """Drops the trailing ``.value`` that NNX Variable wrappers add to a path."""
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        return path[:-1]
    return path


def path_name(path: KeyPath) -> str:
    """``params/Dense_0/kernel`` for a key path; ``root`` for the empty path.

    Examples:
      >>> import jax, clipjax
      >>> [(path, _)] = jax.tree_util.tree_flatten_with_path({"params": {"w": 1.0}})[0]
      >>> clipjax.path_name(path)
      'params/w'
    """
    return "/".join(_key_name(k) for k in path) or "root"


@dataclasses.dataclass(frozen=True)
class Grouping:
    """The static description of how the leaves of a tree form groups.

    Attributes:
      names: the group names, in order of first appearance.
      leaf_groups: for each leaf of ``jax.tree.leaves(tree)``, its group index.
      leaf_names: the path name of each leaf (wrappers stripped).
      leaf_shapes: the shape of each leaf, used to check that ``update`` sees
        the tree that ``init`` saw.
      leaf_stacks: empty unless the scope is :class:`Stacked`; then for each
        leaf None, or for a stacked leaf its layer axis and the group of each
        slice (its ``leaf_groups`` entry is the first slice's group).
    """

    names: tuple[str, ...]
    leaf_groups: tuple[int, ...]
    leaf_names: tuple[str, ...]
    leaf_shapes: tuple[tuple[int, ...], ...]
    leaf_stacks: tuple[tuple[int, tuple[int, ...]] | None, ...] = ()

    @property
    def num_groups(self) -> int:
        return len(self.names)

    @functools.cached_property
    def members(self) -> tuple[tuple[int, ...], ...]:
        """For each group, the indices of its leaves."""
        out: list[list[int]] = [[] for _ in self.names]
        for leaf, group in enumerate(self.leaf_groups):
            stack = self.leaf_stacks[leaf] if self.leaf_stacks else None
            for g in dict.fromkeys((group,) if stack is None else stack[1]):
                out[g].append(leaf)
        return tuple(tuple(m) for m in out)

    def check_matches(
        self,
        names: Sequence[str],
        shapes: Sequence[tuple[int, ...]],
        who: str,
        what: str = "update",
    ) -> None:
        """Raises a ``ValueError`` naming the first leaf where two trees differ.

        ``names`` and ``shapes`` describe the tree ``init`` saw; ``self`` the
        tree passed to ``what``.
        """
        if tuple(names) == self.leaf_names and tuple(shapes) == self.leaf_shapes:
            return
        detail = f"init saw {len(names)} leaves, {what} got {len(self.leaf_names)}"
        for i in range(max(len(names), len(self.leaf_names))):
            old = (names[i], shapes[i]) if i < len(names) else ("(none)", None)
            new = (
                (self.leaf_names[i], self.leaf_shapes[i])
                if i < len(self.leaf_names)
                else ("(none)", None)
            )
            if old != new:
                if old[0] == new[0]:
                    detail = f"leaf {old[0]}: shape {old[1]} at init vs {new[1]} in {what}"
                else:
                    detail = f"leaf {i}: {old[0]} {old[1]} at init vs {new[0]} {new[1]} in {what}"
                break
        raise ValueError(
            f"{who}: the tree passed to {what} does not match the tree passed to init "
            f"(first difference: {detail})."
        )


def _as_array(leaf: Any) -> Any:
    # Python scalars are gradients too (optax accepts them); a Python int is
    # read as a float, like optax's clippers do through their arithmetic.
    if isinstance(leaf, (bool, int, float, complex)):
        return jnp.asarray(float(leaf) if isinstance(leaf, int) else leaf)
    if isinstance(leaf, (np.ndarray, np.generic)):
        # A NumPy leaf becomes a jax array quietly, as optax's arithmetic makes it:
        # float64 is float32 unless jax_enable_x64 is set.
        return jnp.asarray(leaf)
    return leaf


def leaves_with_names(tree: Any) -> tuple[list[Any], list[KeyPath], Any]:
    """Flattens ``tree`` (``None`` and masked nodes vanish) into leaves and paths.

    Python scalars become arrays.
    """
    with_path, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = [_as_array(leaf) for _, leaf in with_path]
    paths = [_strip_wrappers(tuple(path)) for path, _ in with_path]
    return leaves, paths, treedef


def check_inexact(leaves: Sequence[Any], grouping: Grouping, who: str) -> None:
    """Raises a ``ValueError`` naming the first leaf that is not a float or complex array."""
    for leaf, name in zip(leaves, grouping.leaf_names):
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.inexact):
            raise ValueError(
                f"{who}: gradient leaf {name} has dtype {dtype}; integer and boolean "
                "gradients are not supported (cast them to a float dtype, or leave "
                "them out of the tree with optax.masked)."
            )


def _label(scope: Scope, path: KeyPath, leaf: Any) -> str:
    if callable(scope):
        label = scope(path, leaf)
        if not isinstance(label, str):
            raise TypeError(
                f"scope callable must return a str, got {type(label).__name__} "
                f"for leaf {path_name(path)}"
            )
        return label
    if scope == "global":
        return "global"
    if scope == "per_param":
        return path_name(path)
    if scope == "per_layer":
        return path_name(path[:-1])
    raise ValueError(f"unknown scope {scope!r}")


def _stacked_labels(
    scope: Stacked, paths: Sequence[KeyPath], leaves: Sequence[Any]
) -> tuple[list[list[str]], list[tuple[int, int] | None]]:
    """Each leaf's labels (one per slice for a stacked leaf) and its (axis, slices)."""
    labels: list[list[str]] = []
    stacks: list[tuple[int, int] | None] = []
    for path, leaf in zip(paths, leaves):
        position = scope.insert_at(path, leaf)
        if position is None:
            labels.append([_label(scope.scope, path, leaf)])
            stacks.append(None)
            continue
        shape = np.shape(leaf)
        if not -len(shape) <= scope.axis < len(shape):
            raise ValueError(
                f"clipjax.stacked: leaf {path_name(path)} of shape {shape} has no layer "
                f"axis {scope.axis}"
            )
        axis = scope.axis % len(shape)
        view = jax.ShapeDtypeStruct(shape[:axis] + shape[axis + 1 :], jnp.result_type(leaf))
        labels.append(
            [
                _label(
                    scope.scope,
                    (*path[:position], jax.tree_util.SequenceKey(k), *path[position:]),
                    view,
                )
                for k in range(shape[axis])
            ]
        )
        stacks.append((axis, shape[axis]))
    return labels, stacks


def make_grouping(tree: Any, scope: Scope) -> Grouping:
    """Groups the leaves of ``tree`` by ``scope``."""
    leaves, paths, _ = leaves_with_names(tree)
    if isinstance(scope, Stacked):
        slice_labels, stacks = _stacked_labels(scope, paths, leaves)
        index: dict[str, int] = {}
        for labels_of_leaf in slice_labels:
            for label in labels_of_leaf:
                index.setdefault(label, len(index))
        return Grouping(
            names=tuple(index),
            leaf_groups=tuple(index[ls[0]] if ls else 0 for ls in slice_labels),
            leaf_names=tuple(path_name(p) for p in paths),
            leaf_shapes=tuple(tuple(np.shape(x)) for x in leaves),
            leaf_stacks=tuple(
                None if stack is None else (stack[0], tuple(index[label] for label in ls))
                for stack, ls in zip(stacks, slice_labels)
            ),
        )
    labels = [_label(scope, p, x) for p, x in zip(paths, leaves)]
    if scope == "global":
        names: tuple[str, ...] = ("global",)
        index = {"global": 0}
    else:
        index = {}
        for label in labels:
            index.setdefault(label, len(index))
        names = tuple(index)
    return Grouping(
        names=names,
        leaf_groups=tuple(index[label] for label in labels),
        leaf_names=tuple(path_name(p) for p in paths),
        leaf_shapes=tuple(tuple(np.shape(x)) for x in leaves),
    )


def norm_dtype(leaves: Sequence[Any]) -> jnp.dtype:
    """float32, or float64 when a leaf is float64: norms are never in low precision."""
    for x in leaves:
        if jnp.asarray(x).dtype in (jnp.float64, jnp.complex128):
            return jnp.dtype(jnp.float64)
    return jnp.dtype(jnp.float32)


def abs_squared(x: jax.Array, dtype: Any) -> jax.Array:
    """``|x|**2`` element-wise in ``dtype`` (float32 or float64), complex included."""
    if jnp.iscomplexobj(x):
        return jnp.real(x).astype(dtype) ** 2 + jnp.imag(x).astype(dtype) ** 2
    magnitude = x.astype(dtype)
    return magnitude * magnitude


def _power_sum(
    x: jax.Array, p: float, dtype: jnp.dtype, keep_axis: int | None = None, exponent: int = 0
) -> jax.Array:
    # keep_axis: a stacked leaf's layer axis, summed over the others (one value per slice).
    # exponent: the sum of |x * 2**-exponent|**p (exact: a power of two), see overflow_exponent.
    axes = None if keep_axis is None else tuple(a for a in range(jnp.ndim(x)) if a != keep_axis)
    unit = jnp.asarray(2.0**-exponent, dtype)
    if jnp.iscomplexobj(x):
        real, imag = jnp.real(x).astype(dtype), jnp.imag(x).astype(dtype)
        if exponent:
            real, imag = real * unit, imag * unit
        sq = real * real + imag * imag
        magnitude = None
    else:
        magnitude = x.astype(dtype) * unit if exponent else x.astype(dtype)
        sq = magnitude * magnitude
    if p == 2.0:
        return jnp.sum(sq, axis=axes)
    absx = jnp.sqrt(sq) if magnitude is None else jnp.abs(magnitude)
    if math.isinf(p):
        return jnp.max(absx, axis=axes, initial=0.0)
    if p == 1.0:
        return jnp.sum(absx, axis=axes)
    return jnp.sum(absx**p, axis=axes)


def leaf_power_sums(
    leaves: Sequence[jax.Array],
    ord: float = 2.0,
    grouping: Grouping | None = None,
    exponent: int = 0,
) -> list[jax.Array]:
    """Each leaf's sum of ``|x|**ord`` (its max for ``inf``): ``[layers]`` for a
    stacked leaf; of ``|x * 2**-exponent|**ord`` given ``exponent``.
    """
    dtype = norm_dtype(leaves)
    stacks = stacks_of(grouping, len(leaves))
    return [
        _power_sum(x, ord, dtype, None if st is None else st[0], exponent)
        for x, st in zip(leaves, stacks)
    ]


def overflow_exponent(ord: float, dtype: Any) -> int | None:
    """``e`` such that the sum of ``|x * 2**-e|**ord`` is finite for every finite
    ``x`` whose ``ord``-norm is finite in ``dtype``; None where no such sum
    overflows before its norm does (``ord <= 1`` or ``inf``).
    """
    if math.isinf(ord) or ord <= 1.0:
        return None
    top = jnp.finfo(dtype).maxexp
    return math.ceil(top - (top - 1) / ord)


def rescued(norms: Any, recompute: Callable[[], Any]) -> Any:
    """``norms`` with each infinite entry replaced by ``recompute()``'s, run
    under a ``lax.cond`` only on a step where one is infinite.
    """
    parts = jax.tree.leaves(norms)
    if not any(jnp.size(x) for x in parts):
        return norms
    overflow = jax.tree.map(jnp.isinf, norms)
    anywhere = functools.reduce(jnp.logical_or, [jnp.any(o) for o in jax.tree.leaves(overflow)])
    return jax.lax.cond(
        anywhere, lambda: jax.tree.map(jnp.where, overflow, recompute(), norms), lambda: norms
    )


def leaf_norms(leaves: Sequence[jax.Array], squares: Sequence[jax.Array]) -> jax.Array:
    """``[leaves]`` L2 norms from each leaf's sum of squares (a stacked leaf's
    per-slice sums added up), finite whenever the leaf's elements and norm are."""
    dtype = norm_dtype(leaves)
    totals = [jnp.sum(s) if jnp.ndim(s) else s for s in squares]
    norms = jnp.sqrt(jnp.stack(totals)) if totals else jnp.zeros((0,), dtype)
    e = overflow_exponent(2.0, dtype)
    assert e is not None

    def recompute() -> jax.Array:
        return jnp.sqrt(jnp.stack(leaf_power_sums(leaves, 2.0, None, e))) * 2.0**e

    return rescued(norms, recompute)


def vector_norm(values: jax.Array) -> jax.Array:
    """The L2 norm of a small vector (``[groups]``), finite for finite values: where
    the sum of squares overflows, it is taken over the values divided by the largest."""
    plain = jnp.sqrt(jnp.sum(values * values))
    largest = jnp.max(jnp.abs(values), initial=0.0)
    unit = jnp.where((largest > 0) & jnp.isfinite(largest), largest, 1.0)
    return jnp.where(jnp.isinf(plain), unit * jnp.sqrt(jnp.sum((values / unit) ** 2)), plain)


def stacks_of(grouping: Grouping | None, n: int) -> Sequence[tuple[int, tuple[int, ...]] | None]:
    if grouping is None or not grouping.leaf_stacks:
        return (None,) * n
    return grouping.leaf_stacks


def layer_views(leaves: Sequence[Any], grouping: Grouping) -> list[Any]:
    """The leaves, a stacked one as the shape and dtype of one layer's slice."""
    stacks = stacks_of(grouping, len(leaves))
    return [
        x
        if st is None
        else jax.ShapeDtypeStruct(
            tuple(d for a, d in enumerate(np.shape(x)) if a != st[0]), jnp.result_type(x)
        )
        for x, st in zip(leaves, stacks)
    ]


def _stacked_sums(
    partial: Sequence[jax.Array], grouping: Grouping, ord: float, dtype: Any
) -> jax.Array:
    """The ``[groups]`` sums (maxima for ``inf``) of per-leaf and per-slice values."""
    values, ids = [], []
    for p, group, stack in zip(partial, grouping.leaf_groups, grouping.leaf_stacks):
        slices = (group,) if stack is None else stack[1]
        values.append(jnp.broadcast_to(jnp.asarray(p, dtype), (len(slices),)))
        ids.extend(slices)
    flat = jnp.concatenate(values)
    segments = np.asarray(ids, np.int32)
    if math.isinf(ord):
        # Empty groups (-inf from segment_max) have norm 0, like the other paths.
        out = jax.ops.segment_max(flat, segments, num_segments=grouping.num_groups)
        return jnp.maximum(out, jnp.zeros((), dtype))
    return jax.ops.segment_sum(flat, segments, num_segments=grouping.num_groups)


def group_norms(
    leaves: Sequence[jax.Array],
    grouping: Grouping,
    ord: float = 2.0,
    partial: Sequence[jax.Array] | None = None,
) -> jax.Array:
    """The ``ord``-norm of each group, shape ``[groups]``, in one pass.

    Each leaf is read once, cast to float32 (float64 for float64 leaves).
    Empty groups have norm 0. ``partial`` (from :func:`leaf_power_sums`) shares
    that pass with a caller that also wants per-leaf norms. A group whose sum
    overflowed is recomputed from leaves scaled by a power of two
    (:func:`overflow_exponent`, :func:`rescued`).
    """
    dtype = norm_dtype(leaves)
    if not leaves:
        return jnp.zeros((grouping.num_groups,), dtype)
    if partial is None:
        partial = leaf_power_sums(leaves, ord, grouping)
    norms = _roots(partial, grouping, ord, dtype)
    e = overflow_exponent(ord, dtype)
    if e is None:
        return norms
    return rescued(
        norms,
        lambda: _roots(leaf_power_sums(leaves, ord, grouping, e), grouping, ord, dtype) * 2.0**e,
    )


def group_and_leaf_norms(
    leaves: Sequence[jax.Array], grouping: Grouping, ord: float, partial: Sequence[jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """:func:`group_norms` and :func:`leaf_norms` (L2) together, from ``partial`` (the
    leaves' ``ord`` power sums), with one recompute where either overflowed."""
    dtype = norm_dtype(leaves)
    if not leaves:
        return jnp.zeros((grouping.num_groups,), dtype), jnp.zeros((0,), dtype)

    def both(exponent: int | None, leaf_exponent: int) -> tuple[jax.Array, jax.Array]:
        sums = partial if not exponent else leaf_power_sums(leaves, ord, grouping, exponent)
        squares = sums if ord == 2.0 else leaf_power_sums(leaves, 2.0, None, leaf_exponent)
        totals = [jnp.sum(s) if jnp.ndim(s) else s for s in squares]
        return (
            _roots(sums, grouping, ord, dtype) * 2.0 ** (exponent or 0),
            jnp.sqrt(jnp.stack(totals)) * 2.0**leaf_exponent,
        )

    e, e2 = overflow_exponent(ord, dtype), overflow_exponent(2.0, dtype)
    assert e2 is not None
    return rescued(both(None, 0), lambda: both(e, e2))


def _roots(partial: Sequence[jax.Array], grouping: Grouping, ord: float, dtype: Any) -> jax.Array:
    """The ``[groups]`` norms from the leaves' power sums."""
    num_groups = grouping.num_groups
    if grouping.leaf_stacks:
        sums = _stacked_sums(partial, grouping, ord, dtype)
        if math.isinf(ord):
            return sums
    elif math.isinf(ord):
        per_group = [
            functools.reduce(jnp.maximum, [partial[i] for i in m]) if m else jnp.zeros((), dtype)
            for m in grouping.members
        ]
        return jnp.stack(per_group)
    elif num_groups == 1:
        total = jnp.sum(jnp.stack(partial)) if len(partial) > 1 else partial[0]
        sums = total[None]
    elif num_groups == len(partial) and grouping.leaf_groups == tuple(range(num_groups)):
        sums = jnp.stack(partial)
    else:
        sums = jax.ops.segment_sum(
            jnp.stack(partial), np.asarray(grouping.leaf_groups), num_segments=num_groups
        )
    if ord == 2.0:
        return jnp.sqrt(sums)
    if ord == 1.0:
        return sums
    return sums ** (1.0 / ord)


def apply_scales(
    leaves: Sequence[jax.Array],
    grouping: Grouping,
    scale: jax.Array,
    index: Sequence[jax.Array] = (),
) -> list[jax.Array]:
    """Multiplies every leaf by its group's scalar scale, keeping its dtype.

    ``index`` (from :func:`leaf_index`, carried in the state) reads each
    leaf's scale at a runtime offset, so that the fusions of leaves of one
    shape are identical and compiled once. A stacked leaf (:class:`Stacked`)
    is multiplied by the ``[layers]`` vector of its slices' scales.
    """
    scales = leaf_scales(grouping, scale, index)
    return [x * s.astype(x.dtype) for x, s in zip(leaves, scales)]


def _along(values: jax.Array, axis: int, ndim: int) -> jax.Array:
    """A ``[layers]`` vector shaped to broadcast along a leaf's layer axis."""
    return values.reshape(tuple(-1 if a == axis else 1 for a in range(ndim)))


def leaf_scales(
    grouping: Grouping, scale: jax.Array, index: Sequence[jax.Array] = ()
) -> list[jax.Array]:
    """The per-leaf view of a ``[groups]`` vector: each leaf's group's entry,
    read at a runtime offset with ``index`` (see :func:`apply_scales`).
    """
    if grouping.num_groups == 1:
        return [scale[0]] * len(grouping.leaf_groups)
    stacks = stacks_of(grouping, len(grouping.leaf_groups))
    if index:
        return [
            jax.lax.dynamic_index_in_dim(scale, i, keepdims=False)
            if st is None
            else _along(jnp.take(scale, i), st[0], len(shape))
            for i, st, shape in zip(index, stacks, grouping.leaf_shapes)
        ]
    return [
        scale[g] if st is None else _along(scale[np.asarray(st[1])], st[0], len(shape))
        for g, st, shape in zip(grouping.leaf_groups, stacks, grouping.leaf_shapes)
    ]


def stacked(
    scope: Literal["per_param", "per_layer"] | ScopeFn = "per_layer",
    layers: str | Callable[[KeyPath, Any], bool] = "layers",
    axis: int = 0,
) -> Stacked:
    """A scope that splits layer-stacked leaves into one group per layer.

    Slice ``k`` of a stacked leaf is grouped by ``scope`` as a leaf at the
    path with ``k`` inserted (slice 3 of ``params/layers/attn/kernel`` is
    ``params/layers/3/attn/kernel``), so every group norm, statistic and
    metric equals the unstacked model's. Other leaves are grouped as they
    are. For every norm-based clipper with a ``scope``.

    Args:
      scope: how each slice (and each unstacked leaf) is grouped:
        ``"per_layer"``, ``"per_param"`` or a callable ``(path, leaf) -> str``
        (given the slice's path and shape).
      layers: the key under which leaves are stacked (the index goes after
        it), or a callable ``(path, leaf) -> bool`` that says which leaves are
        (the index goes before the leaf's own key).
      axis: the layer axis of the stacked leaves (flax's ``nn.scan`` puts it
        at 0, MaxText's ``param_scan_axis`` at 1).

    Returns:
      A scope to pass as ``scope=`` to a clipper.

    Examples:
      >>> import jax.numpy as jnp, clipjax
      >>> params = {"layers": {"mlp": {"kernel": jnp.ones((4, 3, 2))}}, "head": jnp.ones(2)}
      >>> tx = clipjax.zclip(scope=clipjax.stacked("per_layer"))
      >>> state = tx.init(params)
      >>> state.info.groups
      ('root', 'layers/0/mlp', 'layers/1/mlp', 'layers/2/mlp', 'layers/3/mlp')
      >>> _, state = tx.update(params, state)
      >>> float(clipjax.metrics(state)["zclip/layers/2/mlp/grad_norm"])  # sqrt(3 * 2)
      2.449...
    """
    if not isinstance(layers, str) and not callable(layers):
        raise ValueError(f"layers must be a key name (str) or a callable, got {layers!r}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise ValueError(f"axis must be an int, got {axis!r}")
    scope_ = Stacked(scope, layers, int(axis))
    validate_scope(scope_)
    return scope_
