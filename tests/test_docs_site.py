"""Cheap checks of the documentation sources (``make docs`` builds the site).

Without Sphinx: every page a toctree names exists, every ``{include}`` target
exists, every public name has a docstring for the API reference, which
``docs/conf.py`` generates from ``clipjax.__all__``, no generated page names a
path outside the repository, and the flax ``value=loss`` recipes run.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

import clipjax

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(DOCS.glob("*.md"))
GENERATED = {"api"}  # written by docs/conf.py at build time
NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def fenced(text: str, directive: str) -> list[str]:
    """The bodies of ```{directive} ... ``` blocks, with their argument line."""
    return re.findall(r"```\{" + directive + r"\}([^\n]*)\n(.*?)```", text, re.DOTALL)


def test_toctree_entries_exist() -> None:
    index = (DOCS / "index.md").read_text()
    entries = [
        line.strip()
        for _, body in fenced(index, "toctree")
        for line in body.splitlines()
        if line.strip() and not line.strip().startswith(":")
    ]
    assert entries
    for entry in entries:
        if entry in GENERATED:
            continue
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


# Pages written by scripts (make demo, examples/lm_spikes.py, benchmarks/run.py)
# and the README they copy tables into.
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


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


def test_flax_value_loss_recipes_run_and_skip_the_spike() -> None:
    pytest.importorskip("flax", reason="needs flax")
    page = DOCS / "flax.md"
    blocks = python_blocks(page)
    assert len(blocks) == 2, "the NNX and the TrainState recipes"
    nnx_ns: dict = {}
    exec(compile(blocks[0], f"{page}:nnx", "exec"), nnx_ns)
    m = nnx_ns["metrics"]
    linen_ns: dict = {}
    exec(compile(blocks[1], f"{page}:linen", "exec"), linen_ns)
    m_linen = clipjax.metrics(linen_ns["state"].opt_state)
    for metrics in (m, m_linen):
        # The loss reached skip_on_spike: without value= this metric is NaN.
        assert bool(jnp.isfinite(metrics["skip_on_spike/global/value"]))
        assert int(metrics["skip_on_spike/global/skipped_count"]) == 1
    assert int(linen_ns["state"].step) == 12
