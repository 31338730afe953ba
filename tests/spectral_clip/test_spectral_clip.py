"""spectral_clip against a float64 restatement of katcinskiy/spectral-clipping's clipping.py.

``Reference`` restates ``SpectralClipperConst``, ``SpectralClipperEMA`` and
``SpectralClipperQuantile`` (per named matrix: ``U min(S, tau) V^T`` by an exact
SVD; the EMA bias-corrected over its updates, ``tau = max_sv`` at a matrix's
first step; the quantile ``sorted(h)[int(q (len(h) - 1))]`` of the last
``window_size``, none at the first step), with clipjax's ``factor`` and
``feedback`` added as docs/defences.md states them. The transform runs in
float32: its updates are held to 2e-5 of each matrix's spectral norm.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import clipjax
from clipjax import _spectral_clip
from tests.paths import ROOT

BUDGET = 2e-5  # of a matrix's spectral norm: float32 SVD and reconstruction
STACKED = lambda name, shape: (-2, -1)  # stack: [layers, in, out]


class Reference:
    """clipping.py's three clippers in float64, one threshold per named matrix."""

    def __init__(
        self,
        rule: str,
        threshold: float | None = None,
        ema_coef: float = 0.9,
        q: float = 0.85,
        window_size: int = 100,
        factor: float = 1.0,
        feedback: str = "raw",
        bias_correction: bool = True,
        interpolate: bool = False,
    ) -> None:
        self.rule, self.threshold, self.coef, self.q = rule, threshold, ema_coef, q
        self.window, self.factor, self.feedback = window_size, factor, feedback
        self.bias_correction, self.interpolate = bias_correction, interpolate
        self.ema: dict[str, float] = {}
        self.steps: dict[str, int] = {}
        self.history: dict[str, list[float]] = {}

    def tau(self, name: str, max_sv: float) -> float | None:
        if self.rule == "constant":
            return self.threshold
        if self.rule == "ema":
            step = self.steps.get(name, 0)
            if step == 0:
                return max_sv
            debias = 1.0 - self.coef**step if self.bias_correction else 1.0
            return self.factor * max(self.ema[name] / debias, 0.0)
        history = self.history.get(name, [])
        if not history:
            return None
        if self.interpolate:
            return self.factor * float(np.quantile(history, self.q))
        return self.factor * sorted(history)[int(self.q * (len(history) - 1))]

    def observe(self, name: str, max_sv: float, tau: float | None) -> None:
        fired = tau is not None and max_sv > tau
        if self.rule == "ema":
            if self.feedback == "skip" and fired:
                return
            value = min(max_sv, tau) if self.feedback == "clipped" and fired else max_sv
            step = self.steps.get(name, 0)
            self.ema[name] = self.coef * self.ema.get(name, 0.0) + (1 - self.coef) * value
            self.steps[name] = step + 1
        elif self.rule == "quantile":
            history = self.history.setdefault(name, [])
            history.append(max_sv)
            del history[: max(len(history) - self.window, 0)]

    def clip(self, name: str, g: np.ndarray) -> tuple[np.ndarray, float, float | None]:
        g = g.astype(np.complex128 if np.iscomplexobj(g) else np.float64)
        u, s, vh = np.linalg.svd(g, full_matrices=False)
        max_sv = float(s[0])
        tau = self.tau(name, max_sv)
        out = g if tau is None else (u * np.minimum(s, tau)) @ vh
        self.observe(name, max_sv, tau)
        return out, max_sv, tau


def matrices_of(tree: dict) -> dict[str, np.ndarray]:
    """The reference's matrices of the test tree: ``w`` itself, ``b`` as ``[n, 1]``,
    each layer of ``stack`` its own."""
    out = {"w": np.asarray(tree["w"], np.float64), "b": np.asarray(tree["b"], np.float64)[:, None]}
    for i, layer in enumerate(np.asarray(tree["stack"], np.float64)):
        out[f"stack[{i}]"] = layer
    return out


def grads(steps: int, seed: int = 0) -> list[dict]:
    """A stream whose scale drifts, with x20 spikes at steps 7 and 15 and a lasting x3 from 20."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(steps):
        scale = (20.0 if t in (7, 15) else 1.0) * (3.0 if t >= 20 else 1.0) * (1 + 0.3 * np.sin(t))
        out.append(
            {
                "w": jnp.asarray(scale * rng.standard_normal((8, 5)), jnp.float32),
                "b": jnp.asarray(scale * rng.standard_normal(5), jnp.float32),
                "stack": jnp.asarray(scale * rng.standard_normal((3, 4, 6)), jnp.float32),
            }
        )
    return out


def run(tx: optax.GradientTransformation, stream: list[dict]) -> list[tuple[dict, dict]]:
    state = tx.init(stream[0])
    update = jax.jit(tx.update)
    out = []
    for g in stream:
        u, state = update(g, state)
        out.append((u, clipjax.metrics(state)))
    return out


def ours_as_matrices(u: dict) -> dict[str, np.ndarray]:
    return matrices_of(u)


def worst(tx: optax.GradientTransformation, ref: Reference, stream: list[dict]) -> float:
    """The largest difference of an update from the restatement's, over the matrix's norm."""
    out = 0.0
    for (u, _), g in zip(run(tx, stream), stream):
        for name, m in matrices_of(g).items():
            want, max_sv, _ = ref.clip(name, m)
            got = ours_as_matrices(u)[name]
            out = max(out, float(np.max(np.abs(got - want))) / max(max_sv, 1e-30))
    return out


CONFIGS = {
    "constant": (dict(threshold=2.0), dict(threshold=2.0)),
    "ema": (dict(rule="ema"), {}),
    "ema_coef": (dict(rule="ema", ema_coef=0.7), dict(ema_coef=0.7)),
    "ema_clipped": (dict(rule="ema", feedback="clipped"), dict(feedback="clipped", factor=1.5)),
    "ema_skip": (dict(rule="ema", feedback="skip", factor=1.2), dict(feedback="skip", factor=1.2)),
    "quantile": (dict(rule="quantile"), {}),
    "quantile_small": (
        dict(rule="quantile", quantile=0.5, window_size=6, factor=1.3),
        dict(q=0.5, window_size=6, factor=1.3),
    ),
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_updates_equal_the_restatement(config: str) -> None:
    ours, theirs = CONFIGS[config]
    rule = ours.get("rule", "constant")
    tx = clipjax.spectral_clip(**ours, matrices=STACKED)
    assert worst(tx, Reference(rule, **theirs), grads(30)) < BUDGET


@pytest.mark.parametrize(
    "config, wrong",
    [
        ("ema", dict(bias_correction=False)),
        ("quantile_small", dict(interpolate=True)),
        ("ema_clipped", dict(feedback="raw")),
        ("ema_skip", dict(feedback="clipped")),
    ],
)
def test_a_wrong_rule_is_outside_the_budget(config: str, wrong: dict) -> None:
    """The negative control: the restatement with one detail changed differs."""
    ours, theirs = CONFIGS[config]
    tx = clipjax.spectral_clip(**ours, matrices=STACKED)
    ref = Reference(ours.get("rule", "constant"), **{**theirs, **wrong})
    assert worst(tx, ref, grads(30)) > 100 * BUDGET


def test_metrics_are_the_restatement_s() -> None:
    stream = grads(25)
    ref = Reference("ema", factor=1.2, feedback="clipped")
    tx = clipjax.spectral_clip(rule="ema", factor=1.2, feedback="clipped", matrices=STACKED)
    clipped_any = False
    for (u, metrics), g in zip(run(tx, stream), stream):
        for name, m in matrices_of(g).items():
            _, max_sv, tau = ref.clip(name, m)
            key = f"spectral_clip/{name}"
            np.testing.assert_allclose(metrics[f"{key}/sigma_max"], max_sv, rtol=1e-5)
            np.testing.assert_allclose(metrics[f"{key}/threshold"], tau, rtol=1e-5)
            fired = max_sv > tau * (1 + 1e-5)
            assert bool(metrics[f"{key}/clipped"]) == fired or abs(max_sv - tau) < 1e-4 * tau
            clipped_any |= fired
            np.testing.assert_allclose(metrics[f"{key}/grad_norm"], np.linalg.norm(m), rtol=1e-5)
            got = ours_as_matrices(u)[name]
            np.testing.assert_allclose(
                metrics[f"{key}/scale"], np.linalg.norm(got) / np.linalg.norm(m), rtol=1e-5
            )
            debiased = ref.ema[name] / (1 - 0.9 ** ref.steps[name])
            np.testing.assert_allclose(metrics[f"{key}/mean"], debiased, rtol=1e-5)
    assert clipped_any


def test_groups_and_counters() -> None:
    stream = grads(22)
    tx = clipjax.spectral_clip(rule="ema", matrices=STACKED, name="sc")
    state = tx.init(stream[0])
    assert state.info.groups == ("b", "stack[0]", "stack[1]", "stack[2]", "w")
    (_, metrics) = run(tx, stream)[-1]
    assert int(metrics["sc/w/step"]) == 22 and int(metrics["sc/w/count"]) == 22
    assert 0 < int(metrics["sc/w/clipped_count"]) < 22


def test_matrices_below_the_threshold_pass_exactly() -> None:
    g = grads(1)[0]
    tx = clipjax.spectral_clip(1e6, matrices=STACKED)
    out, _ = tx.update(g, tx.init(g))
    for k in g:
        assert np.array_equal(np.asarray(out[k]), np.asarray(g[k])), k


def test_only_the_directions_above_the_threshold_change() -> None:
    rng = np.random.default_rng(3)
    u, _ = np.linalg.qr(rng.standard_normal((6, 4)))
    v, _ = np.linalg.qr(rng.standard_normal((5, 4)))
    s = np.array([9.0, 4.0, 1.5, 0.2])
    g = {"w": jnp.asarray((u * s) @ v.T, jnp.float32)}
    out, _ = clipjax.spectral_clip(2.0).update(g, clipjax.spectral_clip(2.0).init(g))
    got = np.linalg.svd(np.asarray(out["w"], np.float64), compute_uv=False)
    np.testing.assert_allclose(got[:4], [2.0, 2.0, 1.5, 0.2], atol=2e-5 * 9)


def test_a_vector_is_norm_clipped_and_apply_to_2d_leaves_it() -> None:
    g = {"b": jnp.asarray([3.0, 4.0]), "w": jnp.eye(2) * 5}
    out, _ = clipjax.spectral_clip(1.0).update(g, clipjax.spectral_clip(1.0).init(g))
    np.testing.assert_allclose(out["b"], [0.6, 0.8], rtol=1e-6)
    tx = clipjax.spectral_clip(1.0, apply_to="2d")
    out, state = tx.update(g, tx.init(g))
    assert np.array_equal(out["b"], g["b"]) and state.info.groups == ("w",)
    np.testing.assert_allclose(out["w"], np.eye(2), rtol=1e-6)


def test_stacked_vectors_and_fan_axes() -> None:
    """(fan_in_axes, ()) reads each index of the other axes as a vector; a conv kernel
    [h, w, in, out] read as one [h w in, out] matrix, as the reference's reshape."""
    rng = np.random.default_rng(1)
    vecs = jnp.asarray(rng.standard_normal((3, 7)) * [[1.0], [10.0], [0.1]], jnp.float32)
    kernel = jnp.asarray(rng.standard_normal((3, 3, 2, 4)) * 5, jnp.float32)
    tree = {"ln": vecs, "conv": kernel}
    layout = lambda name, shape: ((-1,), ()) if name == "ln" else ((0, 1, 2), 3)
    tx = clipjax.spectral_clip(1.0, matrices=layout)
    out, state = tx.update(tree, tx.init(tree))
    assert state.info.groups == ("conv", "ln[0]", "ln[1]", "ln[2]")
    norms = np.linalg.norm(np.asarray(out["ln"]), axis=1)
    np.testing.assert_allclose(norms, np.minimum(np.linalg.norm(vecs, axis=1), 1.0), rtol=1e-5)
    flat = np.asarray(out["conv"], np.float64).reshape(18, 4)
    want, _, _ = Reference("constant", threshold=1.0).clip("c", np.asarray(kernel).reshape(18, 4))
    np.testing.assert_allclose(flat, want, atol=BUDGET * np.linalg.norm(kernel))


def test_a_non_finite_matrix_passes_and_teaches_nothing() -> None:
    stream = grads(6)
    tx = clipjax.spectral_clip(rule="ema", matrices=STACKED)
    state = tx.init(stream[0])
    for g in stream[:5]:
        _, state = tx.update(g, state)
    bad = {**stream[5], "w": stream[5]["w"].at[0, 0].set(jnp.nan)}
    out, new = jax.jit(tx.update)(bad, state)
    assert np.array_equal(np.asarray(out["w"]), np.asarray(bad["w"]), equal_nan=True)
    metrics = clipjax.metrics(new)
    assert int(metrics["spectral_clip/w/nonfinite_count"]) == 1
    assert int(metrics["spectral_clip/w/count"]) == 5
    assert np.asarray(new.ema)[-1] == np.asarray(state.ema)[-1]
    assert np.isfinite(np.asarray(new.ema)).all()
    assert int(metrics["spectral_clip/b/count"]) == 6  # the other groups go on


def test_finite_elements_whose_norm_overflows_are_clipped() -> None:
    g = {"w": jnp.asarray([[3e19, 1e19], [-2e19, 3e19]], jnp.float32)}
    tx = clipjax.spectral_clip(1.0)
    out, state = tx.update(g, tx.init(g))
    top = np.linalg.svd(np.asarray(out["w"], np.float64), compute_uv=False)[0]
    assert np.isfinite(np.asarray(out["w"])).all() and top == pytest.approx(1.0, rel=1e-5)
    assert bool(clipjax.metrics(state)["spectral_clip/w/clipped"])


def test_complex_and_bfloat16_leaves() -> None:
    rng = np.random.default_rng(2)
    z = (rng.standard_normal((4, 3)) + 1j * rng.standard_normal((4, 3))) * 3
    tree = {"z": jnp.asarray(z, jnp.complex64), "h": jnp.asarray(z.real * 4, jnp.bfloat16)}
    out, _ = clipjax.spectral_clip(1.0).update(tree, clipjax.spectral_clip(1.0).init(tree))
    assert out["z"].dtype == jnp.complex64 and out["h"].dtype == jnp.bfloat16
    want, _, _ = Reference("constant", threshold=1.0).clip("z", z)
    np.testing.assert_allclose(np.asarray(out["z"]), want, atol=BUDGET * np.abs(z).sum())
    assert np.linalg.svd(np.asarray(out["h"], np.float64), compute_uv=False)[0] < 1.01


def test_lowrank_clamps_the_top_rank_of_a_randomized_svd() -> None:
    """rank=k: the reference's randomized SVD (k + 5 columns, power iterations): exact
    on a matrix of rank <= k + 5; on another, only the top k directions move."""
    rng = np.random.default_rng(4)
    low = (rng.standard_normal((30, 6)) * [8, 6, 4, 3, 2, 1.5]) @ rng.standard_normal((6, 20))
    g = {"w": jnp.asarray(low, jnp.float32)}
    tx = clipjax.spectral_clip(2.5, rank=3)
    out, _ = tx.update(g, tx.init(g))
    want, _, _ = Reference("constant", threshold=2.5).clip("w", low)
    s = np.linalg.svd(low, compute_uv=False)
    got = np.linalg.svd(np.asarray(out["w"], np.float64), compute_uv=False)
    # The top 3 clamped to 2.5, the others (above 2.5 too) kept.
    np.testing.assert_allclose(got[:6], np.sort(np.r_[s[3:6], [2.5] * 3])[::-1], rtol=1e-4)
    assert s[5] > 2.5 and not np.allclose(np.asarray(out["w"]), want, atol=1e-2)
    full = clipjax.spectral_clip(2.5, rank=20)
    out, _ = full.update(g, full.init(g))
    np.testing.assert_allclose(np.asarray(out["w"]), want, atol=BUDGET * s[0] * 10)


def test_ema_feedback_clipped_learns_a_lasting_rise_and_skip_does_not() -> None:
    """A x10 lasting rise: "clipped" (factor 1.5) reaches it in (1 - 0.9) (1.5 - 1) = 5% a
    step; "skip" never observes a clipped step and stays at the old level."""
    rng = np.random.default_rng(0)
    levels = np.where(np.arange(200) < 50, 1.0, 10.0) * np.exp(0.05 * rng.standard_normal(200))
    stream = [{"w": jnp.asarray([[x]], jnp.float32)} for x in levels]
    for feedback, after in (("clipped", 0.0), ("skip", 1.0)):
        tx = clipjax.spectral_clip(rule="ema", feedback=feedback)
        clipped = [bool(m["spectral_clip/w/clipped"]) for _, m in run(tx, stream)]
        assert np.mean(clipped[150:]) == after, feedback


def test_follows_a_run() -> None:
    """benchmarks/follow.py's grid (the SPEC's "following a run"): the EMA with feedback
    "clipped" and the quantile follow; the reference EMA does not (it clips the steps above
    its mean, more of them after a shift)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import follow

    for name, ok in (
        ("spectral_clip(rule='ema', feedback='clipped')", True),
        ("spectral_clip(rule='quantile')", True),
        ("spectral_clip(rule='ema')", False),
    ):
        cells = follow.evaluate(follow.SETTINGS[name], 3, base=1.0)
        assert all(c.follows() for c in cells.values()) == ok, name


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), r'rule="constant" needs threshold='),
        (dict(threshold=1.0, rule="ema"), "threshold is rule='constant''s"),
        (dict(threshold=-1.0), "threshold must be > 0"),
        (dict(rule="median"), "rule must be one of"),
        (dict(rule="quantile", feedback="skip"), "feedback must be one of"),
        (dict(rule="ema", feedback="clipped", factor=1.0), "factor must exceed 1"),
        (dict(rule="ema", ema_coef=1.0), r"ema_coef must be in \(0, 1\)"),
        (dict(rule="quantile", quantile=1.5), r"quantile must be in \[0, 1\]"),
        (dict(rule="quantile", window_size=0), "window_size must be an int >= 1"),
        (dict(threshold=1.0, rank=0), "rank must be an int >= 1"),
        (dict(threshold=1.0, matrices=3), "matrices must be a callable"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        clipjax.spectral_clip(**kwargs)


def test_a_leaf_of_three_dimensions_is_refused_until_told() -> None:
    g = {"layers": {"w": jnp.ones((2, 3, 4))}}
    with pytest.raises(ValueError, match=r"spectral_clip: leaf 'layers/w' of shape \(2, 3, 4\)"):
        clipjax.spectral_clip(1.0).init(g)
    with pytest.raises(ValueError, match="spectral_clip: matrices"):
        clipjax.spectral_clip(1.0, matrices=lambda n, s: (0, 0)).init(g)


def test_quantile_indices_are_the_reference_s() -> None:
    for q in (0.0, 0.3, 0.5, 0.85, 0.95, 1.0):
        got = _spectral_clip.quantile_indices(q, 100)
        assert [int(q * (n - 1)) for n in range(1, 101)] == list(got[1:])


def test_many_stacked_leaves_compile_and_run() -> None:
    """On two cores, jaxlib's batched SVDs run side by side waited for each other for ever
    (clipjax._xla.after): this tree hung on most runs before they were put in sequence."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, clipjax
        k = iter(jax.random.split(jax.random.PRNGKey(0), 16))
        n = lambda *s: jax.random.normal(next(k), s)
        tree = {"ln1": {"s": n(2, 64), "b": n(2, 64)}, "ln2": {"s": n(2, 64), "b": n(2, 64)},
                "qkv": n(2, 64, 192), "proj": n(2, 64, 64), "up": {"w": n(2, 64, 256),
                "b": n(2, 256)}, "down": {"w": n(2, 256, 64), "b": n(2, 64)}}
        layout = lambda name, shape: ((-2,), (-1,)) if len(shape) == 3 else ((-1,), ())
        for rule in ("ema", "quantile"):
            tx = clipjax.spectral_clip(rule=rule, matrices=layout)
            out = jax.jit(tx.update)(tree, tx.init(tree))
            jax.block_until_ready(out)
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
