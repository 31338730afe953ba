"""clipjax.qk_clip against the float64 restatement of QK-Clip, itself checked against the
public implementations' formulas (Megatron-LM, MaxText), on MHA, GQA, MQA and MLA shapes.

Error budget (float32): every weight ``params + updates`` lands within
``BUDGET * (|params| + |updates| + |want|)`` of the float64 rule, element by element
(``BUDGET = 2**-22``, two float32 ulps of that sum: the sum, the factor, the product, the
subtraction and ``apply_updates`` each round once; the largest error measured is a quarter
of it). Deliberately wrong rules land at least ``CONTROL_MARGIN`` times over it. The updates
of heads under ``tau`` are the optimizer's, bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from tests.restate import qk_clip as R

TAU = 100.0
BUDGET = 2.0**-22  # about 2 float32 ulps; measured at most 6e-8
# Each negative control must miss the budget by this factor at least.
CONTROL_MARGIN = 10.0


def logits_for(heads: int, seed: int = 0) -> np.ndarray:
    """Max logits with heads below, at, just over and far over ``TAU``."""
    pattern = np.array([30.0, 99.0, 250.0, TAU, 400.5, 100.001, 1000.0, 150.0])
    rng = np.random.default_rng(seed)
    return np.resize(pattern, heads) * (
        1 + 0.01 * rng.random(heads) * (np.resize(pattern, heads) > TAU)
    )


def random_tree(shapes: dict[str, Any], seed: int, scale: float = 1.0) -> Any:
    rng = np.random.default_rng(seed)
    build = lambda node: (
        {k: build(v) for k, v in node.items()} if isinstance(node, dict)
        else jnp.asarray(rng.standard_normal(node), jnp.float32) * scale
    )  # fmt: skip
    return build(shapes)


def at(tree: Any, path: tuple) -> Any:
    for key in path:
        tree = tree[key]
    return tree


def pairs_of(new: Any, params: Any, updates: Any, wants: list[tuple[tuple, Any]]) -> list:
    """``(got, want, params, updates)`` at each ``(path, want)``."""
    return [(at(new, p), want, at(params, p), at(updates, p)) for p, want in wants]


def step(tx: optax.GradientTransformation, params: Any, updates: Any, max_logits: Any) -> tuple:
    """``(new params (float32, as apply_updates makes them), clipped updates, state)``."""
    state = tx.init(params)
    out, state = jax.jit(tx.update)(updates, state, params, max_logits=max_logits)
    return optax.apply_updates(params, out), out, state


def error_ratio(got: Any, want: Any, params: Any, updates: Any) -> float:
    got, want = np.asarray(got, R.F64), np.asarray(want, R.F64)
    p, u = np.asarray(params, R.F64), np.asarray(updates, R.F64)
    return float(np.max(np.abs(got - want) / (np.abs(p) + np.abs(u) + np.abs(want) + 1e-30)))


def within_budget(pairs: list[tuple[Any, Any, Any, Any]]) -> float:
    return max(error_ratio(*pair) for pair in pairs)


def f64_sum(params: Any, updates: Any) -> Any:
    return jax.tree.map(lambda p, u: np.asarray(p, R.F64) + np.asarray(u, R.F64), params, updates)


@pytest.mark.parametrize(("heads", "groups"), [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_the_rule_is_megatrons_linear_qkv_formula(heads: int, groups: int) -> None:
    head_dim, hidden = 4, 5
    per_group = heads // groups
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((groups * (per_group + 2) * head_dim, hidden))
    s = logits_for(heads)
    theirs = R.megatron_qkv(weight, s, TAU, groups=groups, head_dim=head_dim)
    blocks = weight.reshape(groups, per_group + 2, head_dim, hidden)
    q = blocks[:, :per_group].reshape(heads, head_dim, hidden)
    k = blocks[:, per_group]
    q, k, _ = R.rule(q, k, s, TAU)
    ours = blocks.copy()
    ours[:, :per_group] = q.reshape(groups, per_group, head_dim, hidden)
    ours[:, per_group] = k
    np.testing.assert_array_equal(ours.reshape(weight.shape), theirs)


def test_the_rule_is_megatrons_and_maxtexts_mla_formulas() -> None:
    heads, nope, rope, v, rank = 4, 3, 2, 5, 6
    rng = np.random.default_rng(2)
    s = logits_for(heads)
    wq_b = rng.standard_normal((rank, heads, nope + rope))
    wkv_b = rng.standard_normal((rank, heads, nope + v))
    q, k, rope_q = R.rule(
        wq_b[..., :nope].transpose(1, 0, 2),
        wkv_b[..., :nope].transpose(1, 0, 2),
        s,
        TAU,
        rope_q=wq_b[..., nope:].transpose(1, 0, 2),
    )
    ours_q = np.concatenate([q, rope_q], axis=-1).transpose(1, 0, 2)
    ours_kv = np.concatenate([k.transpose(1, 0, 2), wkv_b[..., nope:]], axis=-1)
    mx_q, mx_kv = R.maxtext_mla(wq_b, wkv_b, s[None], TAU, nope=nope)
    # MaxText divides by S + 1e-6: a relative 1e-8 at S >= 100.
    np.testing.assert_allclose(ours_q, mx_q, rtol=1e-7)
    np.testing.assert_allclose(ours_kv, mx_kv, rtol=1e-7)
    # Megatron's [heads * (nope + rope), hidden] layout of the same weights.
    q_proj = wq_b.transpose(1, 2, 0).reshape(heads * (nope + rope), rank)
    kv_up = wkv_b.transpose(1, 2, 0).reshape(heads * (nope + v), rank)
    mg_q, mg_kv = R.megatron_mla(q_proj, kv_up, s, TAU, nope=nope)
    np.testing.assert_array_equal(mg_q, ours_q.transpose(1, 2, 0).reshape(q_proj.shape))
    np.testing.assert_array_equal(mg_kv, ours_kv.transpose(1, 2, 0).reshape(kv_up.shape))


def mha_case(heads: int = 8, groups: int = 8, d: int = 12, head_dim: int = 4, alpha=0.5):
    """flax's layout: kernels [d, heads, head_dim], biases [heads, head_dim]."""
    shapes = {
        "attn": {
            "query": {"kernel": (d, heads, head_dim), "bias": (heads, head_dim)},
            "key": {"kernel": (d, groups, head_dim), "bias": (groups, head_dim)},
            "value": {"kernel": (d, groups, head_dim)},
        },
        "mlp": (d, d),
    }
    params, updates = random_tree(shapes, 3), random_tree(shapes, 4, 0.01)
    kv = None if groups == heads else groups
    tx = clipjax.qk_clip(optax.identity(), TAU, kv_heads=kv, alpha=alpha)
    s = logits_for(heads)
    new, out, state = step(tx, params, updates, jnp.asarray(s, jnp.float32)[None])
    w = f64_sum(params, updates)["attn"]
    flip = lambda x: x.transpose(1, 0, 2)
    q_k, k_k, _ = R.rule(flip(w["query"]["kernel"]), flip(w["key"]["kernel"]), s, TAU, alpha=alpha)
    q_b, k_b, _ = R.rule(w["query"]["bias"], w["key"]["bias"], s, TAU, alpha=alpha)
    wants = [(("attn", "query", "kernel"), flip(q_k)), (("attn", "query", "bias"), q_b),
             (("attn", "key", "kernel"), flip(k_k)), (("attn", "key", "bias"), k_b)]  # fmt: skip
    return params, updates, out, state, s, pairs_of(new, params, updates, wants)


@pytest.mark.parametrize(("heads", "groups"), [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_flax_layout_within_the_budget(heads: int, groups: int) -> None:
    *_, state, s, pairs = mha_case(heads, groups)
    assert within_budget(pairs) <= BUDGET
    m = clipjax.metrics(state)
    assert int(m["qk_clip/attn/clipped_heads"]) == int(np.sum(s > TAU))
    np.testing.assert_allclose(float(m["qk_clip/attn/max_logit"]), s.max(), rtol=1e-6)
    gamma = R.group_factors(s, TAU, groups)
    np.testing.assert_allclose(float(m["qk_clip/attn/factor"]), gamma.min(), rtol=1e-6)


@pytest.mark.parametrize(("heads", "groups"), [(8, 8), (8, 4)], ids=["mha", "gqa"])
def test_heads_under_tau_get_the_optimizers_updates_bit_for_bit(heads: int, groups: int) -> None:
    _, updates, out, _, s, _ = mha_case(heads, groups)
    gamma = np.repeat(R.group_factors(s, TAU, groups), heads // groups)
    kept = gamma == 1.0
    assert kept.any() and (~kept).any()
    for leaf in ("kernel", "bias"):
        got = np.asarray(out["attn"]["query"][leaf])
        given = np.asarray(updates["attn"]["query"][leaf])
        np.testing.assert_array_equal(got[..., kept, :], given[..., kept, :])
        assert not np.array_equal(got[..., ~kept, :], given[..., ~kept, :])
    kept_kv = R.group_factors(s, TAU, groups) == 1.0
    got, given = (
        np.asarray(out["attn"]["key"]["kernel"]),
        np.asarray(updates["attn"]["key"]["kernel"]),
    )
    np.testing.assert_array_equal(got[:, kept_kv], given[:, kept_kv])
    # Leaves no pattern names are passed through.
    assert out["mlp"] is updates["mlp"] or np.array_equal(out["mlp"], updates["mlp"])
    np.testing.assert_array_equal(
        out["attn"]["value"]["kernel"], updates["attn"]["value"]["kernel"]
    )


def test_alpha_splits_the_factor() -> None:
    for alpha in (0.0, 0.3, 1.0):
        *_, pairs = mha_case(alpha=alpha)
        assert within_budget(pairs) <= BUDGET, alpha


def run_case(shapes: Any, seed: int, tx: Any, s: np.ndarray, scale: float = 1.0) -> tuple:
    """``(new params, clipped updates, state, params, updates, float64 params + updates)``
    after one step on random weights (``seed``) and updates (``seed + 1``, times ``scale``)."""
    params, updates = random_tree(shapes, seed), random_tree(shapes, seed + 1, scale)
    new, out, state = step(tx, params, updates, jnp.asarray(s, jnp.float32))
    return new, out, state, params, updates, f64_sum(params, updates)


def test_flattened_gqa_layout_within_the_budget() -> None:
    d, heads, groups, head_dim = 16, 8, 2, 4
    shapes = {"blocks": {"wq": (d, heads * head_dim), "wk": (d, groups * head_dim)}}
    tx = clipjax.qk_clip(optax.identity(), TAU, query="wq", key="wk", head_axis=-1, kv_heads=groups)
    s = logits_for(heads, 1)
    new, _, _, params, updates, w = run_case(shapes, 5, tx, s)
    q = w["blocks"]["wq"].reshape(d, heads, head_dim).transpose(1, 0, 2)
    k = w["blocks"]["wk"].reshape(d, groups, head_dim).transpose(1, 0, 2)
    q, k, _ = R.rule(q, k, s, TAU)
    flat = lambda x: x.transpose(1, 0, 2).reshape(d, -1)
    wants = [(("blocks", "wq"), flat(q)), (("blocks", "wk"), flat(k))]
    assert within_budget(pairs_of(new, params, updates, wants)) <= BUDGET


# One layer's [heads, d, head_dim] from each layout of n heads, and back (d = 13: each leaf
# splits into its heads along one of its last two axes only, so the head axis is inferred).
LAYOUTS = {
    "flax": (-2, lambda n: (13, n, 4), lambda x, n: x.transpose(1, 0, 2),
             lambda x: x.transpose(1, 0, 2)),
    "flattened": (-1, lambda n: (13, n * 4), lambda x, n: x.reshape(13, n, 4).transpose(1, 0, 2),
                  lambda x: x.transpose(1, 0, 2).reshape(13, -1)),
    "transposed": (-2, lambda n: (n * 4, 13), lambda x, n: x.reshape(n, 4, 13).transpose(0, 2, 1),
                   lambda x: x.transpose(0, 2, 1).reshape(-1, 13)),
}  # fmt: skip


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("given", [False, True], ids=["inferred", "head_axis given"])
@pytest.mark.parametrize(("heads", "groups"), [(8, 8), (8, 2), (6, 1)], ids=["mha", "gqa", "mqa"])
def test_each_layout_inferred_or_given_within_the_budget(
    layout: str, given: bool, heads: int, groups: int
) -> None:
    axis, shape, to_heads, back = LAYOUTS[layout]
    kv = None if groups == heads else groups
    tx = clipjax.qk_clip(
        optax.identity(), TAU, query="wq", key="wk", head_axis=axis if given else None, kv_heads=kv
    )
    s = logits_for(heads, 4)
    shapes = {"attn": {"wq": shape(heads), "wk": shape(groups)}}
    new, _, _, params, updates, w = run_case(shapes, 15, tx, s, 0.01)
    q, k, _ = R.rule(to_heads(w["attn"]["wq"], heads), to_heads(w["attn"]["wk"], groups), s, TAU)
    wants = [(("attn", "wq"), back(q)), (("attn", "wk"), back(k))]
    assert within_budget(pairs_of(new, params, updates, wants)) <= BUDGET


MEGATRON = dict(heads=8, groups=2, head_dim=4, hidden=6)


def megatron_fused(tau: float = TAU) -> list:
    """clipjax on Megatron's fused linear_qkv against the restatement with ``tau``."""
    h, g, hd, hidden = (MEGATRON[k] for k in ("heads", "groups", "head_dim", "hidden"))
    per_group = h // g
    shapes = {"linear_qkv": {"weight": (g * (per_group + 2) * hd, hidden)}}
    query = clipjax.QKHeads("linear_qkv", axis=0, count=g, dims=(0, per_group * hd))
    key = clipjax.QKHeads(
        "linear_qkv", axis=0, count=g, dims=(per_group * hd, (per_group + 1) * hd)
    )
    tx = clipjax.qk_clip(optax.identity(), TAU, query=query, key=key, kv_heads=g)
    s = logits_for(h, 2)
    new, _, _, params, updates, w = run_case(shapes, 7, tx, s, 0.01)
    want = R.megatron_qkv(w["linear_qkv"]["weight"], s, tau, groups=g, head_dim=hd)
    return pairs_of(new, params, updates, [(("linear_qkv", "weight"), want)])


def test_megatrons_fused_qkv_layout_within_the_budget() -> None:
    assert within_budget(megatron_fused()) <= BUDGET


def mla_case(layout: str) -> tuple[list, Any, Any, Any, np.ndarray]:
    heads, nope, rope, v, rank = 4, 6, 2, 5, 8
    if layout == "maxtext":
        names, axis = ("wq_b", "wkv_b"), -1
        shapes = {"mla": {"wq_b": {"kernel": (rank, heads, nope + rope)},
                          "wkv_b": {"kernel": (rank, heads, nope + v)}}}  # fmt: skip
    else:
        names, axis = ("linear_q_proj", "linear_kv_up_proj"), 0
        shapes = {"mla": {"linear_q_proj": {"weight": (heads * (nope + rope), rank)},
                          "linear_kv_up_proj": {"weight": (heads * (nope + v), rank)}}}  # fmt: skip
    heads_of = lambda name, dims: clipjax.QKHeads(
        name, dims=dims, **({"axis": 0} if axis == 0 else {})
    )
    q, k = heads_of(names[0], (0, nope)), heads_of(names[1], (0, nope))
    rq = heads_of(names[0], (nope, nope + rope))
    tx = clipjax.qk_clip(optax.identity(), TAU, query=q, key=k, rotary_query=rq)
    s = logits_for(heads, 3)
    new, _, _, params, updates, w = run_case(shapes, 9, tx, s, 0.01)
    paths = [("mla", n, next(iter(shapes["mla"][n]))) for n in names]
    restate = R.maxtext_mla if layout == "maxtext" else R.megatron_mla
    want = restate(*(at(w, p) for p in paths), s, TAU, nope=nope)
    return pairs_of(new, params, updates, list(zip(paths, want))), new, params, updates, s


@pytest.mark.parametrize("layout", ["maxtext", "megatron"])
def test_mla_layouts_within_the_budget(layout: str) -> None:
    pairs, *_ = mla_case(layout)
    assert within_budget(pairs) <= BUDGET


def stacked_pairs(shapes: Any, seed: int, tx: Any, s: np.ndarray, path: Any) -> tuple:
    """The budget's pairs of every layer ``k`` of the leaves at ``path(name, k)``."""
    new, out, state, params, updates, w = run_case(shapes, seed, tx, s)
    wants = []
    for k in range(len(s)):
        flip = lambda n, k=k: at(w, path(n, k)).transpose(1, 0, 2)
        q, kk, _ = R.rule(flip("query"), flip("key"), s[k], TAU)
        wants += [(path("query", k), q.transpose(1, 0, 2)), (path("key", k), kk.transpose(1, 0, 2))]
    return pairs_of(new, params, updates, wants), out, state, updates


def test_stacked_layers_within_the_budget() -> None:
    layers, d, heads, head_dim = 3, 8, 4, 2
    kernel = {"kernel": (layers, d, heads, head_dim)}
    tx = clipjax.qk_clip(optax.identity(), TAU, scope=clipjax.stacked(layers="layers"))
    s = np.stack([logits_for(heads, seed) for seed in range(layers)])
    s[1] = 10.0  # a layer with no head over tau
    pairs, out, state, updates = stacked_pairs(
        {"layers": {"attn": {"query": kernel, "key": kernel}}}, 11, tx, s,
        lambda n, k: ("layers", "attn", n, "kernel", k),
    )  # fmt: skip
    assert state.info.groups == tuple(f"layers/{k}/attn" for k in range(layers))
    assert within_budget(pairs) <= BUDGET
    query = lambda tree: tree["layers"]["attn"]["query"]["kernel"][1]
    np.testing.assert_array_equal(query(out), query(updates))
    m = clipjax.metrics(state)
    assert not bool(m["qk_clip/layers/1/attn/clipped"])
    assert int(m["qk_clip/layers/0/attn/clipped_heads"]) == int(np.sum(s[0] > TAU))


def test_a_layer_axis_after_the_head_axis() -> None:
    """MaxText's param_scan_axis=1: kernels [d, layers, heads, head_dim]."""
    layers, d, heads, head_dim = 2, 4, 4, 3
    shapes = {
        "layers": {"query": (d, layers, heads, head_dim), "key": (d, layers, heads, head_dim)}
    }
    tx = clipjax.qk_clip(optax.identity(), TAU, scope=clipjax.stacked(layers="layers", axis=1))
    s = np.stack([logits_for(heads, seed) for seed in range(layers)])
    pairs, *_ = stacked_pairs(shapes, 13, tx, s, lambda n, k: ("layers", n, (slice(None), k)))
    assert within_budget(pairs) <= BUDGET


def test_bfloat16_weights_keep_their_dtype() -> None:
    params = {"attn": {n: jnp.ones((4, 2, 3), jnp.bfloat16) for n in ("query", "key")}}
    tx = clipjax.qk_clip(optax.identity(), TAU)
    out, _ = tx.update(params, tx.init(params), params, max_logits=jnp.array([400.0, 50.0]))
    assert out["attn"]["query"].dtype == jnp.bfloat16
    new = optax.apply_updates(params, out)
    np.testing.assert_allclose(np.asarray(new["attn"]["query"][0, :, 0], np.float32), [1.0, 2.0])


def test_negative_controls_miss_the_budget() -> None:
    """Four wrong rules, each compared with clipjax exactly as the right one is."""
    # 1. the whole factor on both query and key (no square root).
    params, updates, _, _, s, pairs = mha_case()
    w = f64_sum(params, updates)["attn"]
    heads_first = (w["query"]["kernel"].transpose(1, 0, 2), w["key"]["kernel"].transpose(1, 0, 2))
    q, _, _ = R.rule(*heads_first, s, TAU, alpha=1.0)
    _, k, _ = R.rule(*heads_first, s, TAU, alpha=0.0)
    controls = {
        "gamma on both": [
            (pairs[0][0], q.transpose(1, 0, 2), *pairs[0][2:]),
            (pairs[2][0], k.transpose(1, 0, 2), *pairs[2][2:]),
        ]
    }
    # 2. GQA: each query head by its own factor, the key by its group's (not the group's on all).
    params, updates, _, _, s, pairs = mha_case(8, 2)
    own = np.minimum(1.0, TAU / s) ** 0.5
    q = f64_sum(params, updates)["attn"]["query"]["kernel"] * own[None, :, None]
    controls["gqa per-head query"] = [(pairs[0][0], q, *pairs[0][2:])]
    # 3. MLA: the rotary query by sqrt(gamma), like the head-specific part.
    mla_pairs, _, params, updates, s = mla_case("maxtext")
    wq = f64_sum(params, updates)["mla"]["wq_b"]["kernel"] * np.sqrt(
        np.minimum(1.0, TAU / s)[:, None]
    )
    controls["mla rotary by sqrt"] = [(mla_pairs[0][0], wq, *mla_pairs[0][2:])]
    # 4. tau off by one part in 10^4.
    controls["tau + 1e-4"] = megatron_fused(TAU * (1 + 1e-4))
    for name, control in controls.items():
        assert within_budget(control) > CONTROL_MARGIN * BUDGET, name
