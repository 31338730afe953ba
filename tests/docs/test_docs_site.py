"""Checks of the documentation sources without Sphinx: toctree entries and includes exist,
public names have the docstrings the generated API reference shows, written pages name no
path outside the repository, the flax ``value=loss`` recipes run, and the signatures say
what they take."""

from __future__ import annotations

import ast
import inspect
import re
import typing
from pathlib import Path

import jax.numpy as jnp
import optax
import pytest

import clipjax
from tests.docs.markdown_tables import python_blocks
from tests.paths import ROOT

# Slow, `make test` skips it.
pytestmark = pytest.mark.slow

DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
GENERATED = {"api"}  # written by docs/conf.py at build time
NOTEBOOKS = ROOT / "notebooks"


def fenced(text: str, directive: str) -> list[str]:
    """The bodies of ```{directive} ... ``` blocks, with their argument line."""
    return re.findall(r"```\{" + directive + r"\}([^\n]*)\n(.*?)```", text, re.DOTALL)


def test_toctree_entries_exist() -> None:
    toctrees = fenced((DOCS / "index.md").read_text(), "toctree")
    entries = [line.strip() for _, body in toctrees for line in body.splitlines()]
    entries = [e for e in entries if e and not e.startswith(":") and e not in GENERATED]
    assert entries
    for entry in entries:
        if entry.startswith("notebooks/"):
            assert (NOTEBOOKS / f"{entry.split('/', 1)[1]}.ipynb").exists(), entry
        else:
            assert (DOCS / f"{entry}.md").exists(), entry


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_included_files_exist(page: Path) -> None:
    for argument, _ in fenced(page.read_text(), "include"):
        target = argument.strip()
        assert (page.parent / target).exists(), f"{page.name}: {target}"


@pytest.mark.parametrize("name", sorted(clipjax.__all__))
def test_public_names_have_a_docstring(name: str) -> None:
    doc = inspect.getdoc(getattr(clipjax, name))
    assert doc and doc.strip().splitlines()[0].strip(), f"clipjax.{name} has no docstring summary"


# Pages written by scripts and the README they copy tables into.
WRITTEN_PAGES = sorted(
    [*(DOCS / "generated").glob("*.md"), ROOT / "benchmarks" / "RESULTS.md", ROOT / "README.md"]
)
# An absolute path on the machine that ran a script: /tmp/..., /root/..., a home
# folder (~/...), C:\... Not preceded by a word, URL or relative-path character,
# so https://host/home/... and docs/tmp/... are not matched.
OUTSIDE_PATH = re.compile(
    r"(?<![\w.:/~-])(?:/(?:tmp|root|home|work|Users|mnt|opt|var|private|scratch|srv)\b"
    r"|~/|[A-Za-z]:\\)"
)


def test_the_outside_path_pattern() -> None:
    for text in ("--out /tmp/q", "`/root/out/lm`", "(/home/me/x)", "~/runs", r"C:\\runs"):
        assert OUTSIDE_PATH.search(text), text
    for text in ("lm_out/run", "https://example.org/home/x", "docs/tmp/x", "a/b", "1/2"):
        assert not OUTSIDE_PATH.search(text), text


@pytest.mark.parametrize("page", WRITTEN_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_written_pages_name_no_path_outside_the_repository(page: Path) -> None:
    if not page.exists():
        pytest.skip(f"{page.name} is not generated in this checkout")
    found = [
        f"line {n}: {line.strip()}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if OUTSIDE_PATH.search(line)
    ]
    assert not found, f"{page.relative_to(ROOT)} names paths outside the repository: {found}"


def test_flax_value_loss_recipes_run_and_skip_the_spike() -> None:
    pytest.importorskip("flax", reason="needs flax")
    page = DOCS / "flax.md"
    blocks = [b for b in python_blocks(page) if "value=loss" in b]
    assert len(blocks) == 2, "the NNX and the TrainState recipes"
    nnx_ns: dict = {}
    linen_ns: dict = {}
    exec(compile(blocks[0], f"{page}:nnx", "exec"), nnx_ns)
    exec(compile(blocks[1], f"{page}:linen", "exec"), linen_ns)
    for metrics in (nnx_ns["metrics"], clipjax.metrics(linen_ns["state"].opt_state)):
        # The loss reached skip_on_spike: without value= this metric is NaN.
        assert bool(jnp.isfinite(metrics["skip_on_spike/global/value"]))
        assert int(metrics["skip_on_spike/global/skipped_count"]) == 1
    assert int(linen_ns["state"].step) == 12


def api_pages() -> dict:
    """``API_PAGES`` of docs/conf.py, read without running the conf (it writes files)."""
    tree = ast.parse((DOCS / "conf.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "API_PAGES":
            return ast.literal_eval(node.value)
    raise AssertionError("docs/conf.py defines no API_PAGES")


def test_api_pages_list_public_names_once() -> None:
    listed = [
        name for _, _, sections in api_pages().values() for _, names in sections for name in names
    ]
    assert len(listed) == len(set(listed)), "a name on two reference pages"
    assert set(listed) <= set(clipjax.__all__), set(listed) - set(clipjax.__all__)
    assert {"clippers", "wrappers", "static", "metrics", "states"} <= set(api_pages())


TRANSFORM_FACTORIES = sorted(
    name
    for name in clipjax.__all__
    if not inspect.isclass(getattr(clipjax, name))
    and "ClipTransform" in str(inspect.signature(getattr(clipjax, name)).return_annotation)
)


def test_clip_transform_is_what_the_clippers_return() -> None:
    assert len(TRANSFORM_FACTORIES) >= 10
    for name in TRANSFORM_FACTORIES:
        factory = getattr(clipjax, name)
        required = [
            p
            for p in inspect.signature(factory).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind is not p.VAR_KEYWORD
        ]
        given = {"percentile": 90.0, "optimizer": optax.sgd(1.0)}  # qk_clip wraps an optimizer
        args = [given.get(p.name, 1.0) for p in required]
        tx = factory(*args)
        assert isinstance(tx, clipjax.ClipTransform), name
        assert isinstance(tx, optax.GradientTransformationExtraArgs), name


@pytest.mark.parametrize(
    ("name", "argument", "choices"),
    [
        ("autoclip", "mode", {"auto", "percentile"}),
        ("autoclip", "history", {"all", "window", "ema", "geometric"}),
        ("autoclip", "feedback", {"observe_first", "raw", "clipped", "skip"}),
        ("zscore_clip", "feedback", {"observe_first", "raw", "clipped", "skip"}),
        ("zclip", "mode", {"zscore", "percentile"}),
        ("zclip", "clip_option", {"adaptive_scaling", "mean"}),
        ("zclip", "feedback", {"raw", "clipped", "clip_target", "skip"}),
        ("hist_clip", "feedback", {"raw", "clipped", "clip_target", "skip"}),
        ("adagc", "feedback", {"raw", "clipped", "skip"}),
        ("clip_by_percentile", "method", {"auto", "exact", "approx"}),
        ("zclip", "scope", {"global", "per_param", "per_layer"}),
        ("agc", "scope", {"unitwise", "global", "per_param", "per_layer"}),
    ],
)
def test_string_choices_are_literal_types(name: str, argument: str, choices: set[str]) -> None:
    hint = typing.get_type_hints(getattr(clipjax, name))[argument]
    literals = [hint] if typing.get_origin(hint) is typing.Literal else typing.get_args(hint)
    found = {
        v for h in literals if typing.get_origin(h) is typing.Literal for v in typing.get_args(h)
    }
    assert found == choices
    # The default is one of the choices, or None where the type allows it (the
    # choice then depends on another argument, e.g. autoclip's history on its mode).
    default = inspect.signature(getattr(clipjax, name)).parameters[argument].default
    assert default in choices or (default is None and type(None) in typing.get_args(hint))
