"""Cheap checks of the documentation sources (``make docs`` builds the site).

Without Sphinx: every page a toctree names exists, every ``{include}`` target
exists, and every public name has a docstring for the API reference, which
``docs/conf.py`` generates from ``clipjax.__all__``.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import clipjax

DOCS = Path(__file__).resolve().parents[1] / "docs"
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
