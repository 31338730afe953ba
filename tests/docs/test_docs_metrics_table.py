"""docs/metrics_logging.md's "Who reports what" table says which fields each transform reports:
after one update with its defaults (and each setting of :data:`ALSO`), the common fields
marked "yes" are reported, those marked "no" are not, the others are named in the row's last
cell; every public transform with metrics has a row."""

from __future__ import annotations

import re

import jax.numpy as jnp
import optax
import pytest

import clipjax
from tests.paths import ROOT

PAGE = ROOT / "docs" / "metrics_logging.md"
COMMON = ("threshold", "scale", "clipped", "count", "clipped_count")
ALWAYS = ("grad_norm", "step", "nonfinite_count")
PARAMS = {"w": jnp.ones((3, 2)), "b": jnp.ones(2)}
BUILD = {
    "clip_by_global_norm": lambda: clipjax.clip_by_global_norm(1.0),
    "clip_by_value": lambda: clipjax.clip_by_value(1.0),
    "clip_by_percentile": lambda: clipjax.clip_by_percentile(90),
    "skip_on_spike": lambda: clipjax.skip_on_spike(optax.identity()),
    "skip_and_clip_by_global_norm": lambda: clipjax.skip_and_clip_by_global_norm(
        optax.identity(), max_norm=1.0
    ),
    "spam": lambda: clipjax.spam(1e-3),
    "spectra": lambda: clipjax.spectra(1.0),
    "spectral_clip": lambda: clipjax.spectral_clip(rule="ema"),
    "stable_spam": lambda: clipjax.stable_spam(1e-3),
    "adamw(clip_grad_adapt=k)": lambda: clipjax.adamw(1e-3, clip_grad_adapt=3.0),
}
# Rows whose fields depend on an argument: each setting's fields are in the row too.
ALSO = {
    "spectral_clip": [lambda: clipjax.spectral_clip(rule="quantile")],
    "zclip": [
        lambda: clipjax.zclip(feedback="clipped"),
        lambda: clipjax.zclip(feedback="clipped", start="weight"),
    ],
    "skip_and_clip_by_global_norm": [
        lambda: clipjax.skip_and_clip_by_global_norm(
            optax.identity(),
            drop_norm=clipjax.drop_norm_by_grad_norm_ema(),
            grad_norm_ema_decay=0.99,
        ),
        lambda: clipjax.skip_and_clip_by_global_norm(
            optax.identity(),
            drop_norm=clipjax.drop_norm_by_grad_norm_stddev(min_count=1),
            max_norm=1.0,
            grad_norm_ema_decay=0.99,
        ),
    ],
}


def rows() -> dict[str, list[str]]:
    text = PAGE.read_text()
    table = text.split("<!-- metrics-table:start -->")[1].split("<!-- metrics-table:end -->")[0]
    out = {}
    for line in table.strip().splitlines()[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        # "`adamw(clip_grad_adapt=k)` (`adam` too; ...)": the first code span names it.
        out[re.match(r"`([^`]+)`", cells[0]).group(1)] = cells[1:]
    return out


def reported(name: str, build=None) -> set[str]:
    tx = (build or BUILD.get(name) or getattr(clipjax, name))()
    state = tx.init(PARAMS)
    _, state = tx.update({"w": jnp.full((3, 2), 2.0), "b": jnp.ones(2)}, state, PARAMS)
    return {key.rsplit("/", 1)[1] for key in clipjax.metrics(state)}


@pytest.mark.parametrize("name", sorted(rows()))
def test_the_row_says_what_the_transform_reports(name: str) -> None:
    cells = rows()[name]
    for build in [None, *ALSO.get(name, [])]:
        fields = reported(name, build)
        for column, cell in zip(COMMON, cells):
            said = cell.split()[0]
            assert said in ("yes", "no"), (name, column, cell)
            assert (column in fields) == (said == "yes"), f"{name}: {column} is {said!r} here"
        own = set(re.findall(r"`(\w+)`", cells[len(COMMON)]))
        missing = fields - set(COMMON) - set(ALWAYS) - own
        assert not missing, f"{name} reports {sorted(missing)}, not named in its row"
        if name != "spam":
            assert set(ALWAYS) <= fields, (name, sorted(fields))


def test_every_transform_with_metrics_has_a_row() -> None:
    listed = set(rows())
    factories = {
        name
        for name in clipjax.__all__
        if name[0].islower() and callable(getattr(clipjax, name))
        and name not in {"metrics", "global_norm", "path_name", "stacked", "chain", "adam",
                         "adamw", "approx_percentile", "approx_relative_error",
                         "exact_percentile", "max_clipping", "mean_clipping",
                         "reciprocal_clipping", "zstat_criterion", "ema_criterion",
                         "drop_norm_by_grad_norm_ema", "drop_norm_by_grad_norm_stddev",
                         "max_attention_logits", "qk_clip", "clip_activation_gradient",
                         "activation_stats_init", "activation_metrics", "linen_activation_clip",
                         "nnx_activation_clip"}
    }  # fmt: skip
    assert factories <= listed, sorted(factories - listed)
