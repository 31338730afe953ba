"""The guides as a reader meets them, checked without building the site: one title per page
and notebook and no skipped heading level (includes expanded); no private JAX API; a short
README that links the glossary's terms; links that name a file and a heading; plain words,
and no sentence said twice on a page."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

from tests.docs.markdown_tables import NOTEBOOKS, notebook_cells
from tests.paths import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
GUIDES = sorted(DOCS.glob("*.md"))
README_BYTES = 12_500

FENCE = re.compile(r"^\s*(```|~~~)")
INCLUDE = re.compile(r"^```\{include\}[ \t]*(\S+)[ \t]*\n((?:[ \t]*:[\w-]+:.*\n)*)```[ \t]*$", re.M)
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def expand(page: Path, offset: int = 0) -> str:
    """The page's text with each ``{include}`` replaced by the included text,
    cut by ``:start-line:``/``:end-line:`` and ``:start-after:``/``:end-before:``,
    its headings moved down by ``:heading-offset:``, as MyST renders it."""

    def included(match: re.Match) -> str:
        target = (page.parent / match.group(1)).resolve()
        options = {
            key: value.strip().strip('"')  # a quoted value: one that starts with '#'
            for key, value in re.findall(r":([\w-]+):[ \t]*(.*)", match.group(2))
        }
        text = expand(target, int(options.get("heading-offset", 0)))
        if "start-line" in options or "end-line" in options:
            lines = text.splitlines()
            start, end = int(options.get("start-line", 0)), options.get("end-line")
            text = "\n".join(lines[start : int(end) if end else None])
        if "start-after" in options:
            text = text.split(options["start-after"], 1)[1]
        if "end-before" in options:
            text = text.split(options["end-before"], 1)[0]
        return text

    text = INCLUDE.sub(included, page.read_text())
    if offset:
        text = "\n".join(
            "#" * offset + line if kind == "heading" else line for kind, line in lines_of(text)
        )
    return text


def lines_of(text: str):
    """(kind, line) with kind "code" inside fenced blocks (code cells included),
    "heading" for a Markdown heading, "text" otherwise."""
    in_code = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_code = not in_code
            yield "code", line
        elif in_code:
            yield "code", line
        elif HEADING.match(line):
            yield "heading", line
        else:
            yield "text", line


def headings(text: str) -> list[tuple[int, str]]:
    matches = [HEADING.match(line) for kind, line in lines_of(text) if kind == "heading"]
    return [(len(m.group(1)), m.group(2)) for m in matches]


def heading_problems(found: list[tuple[int, str]]) -> list[str]:
    problems = []
    titles = [title for level, title in found if level == 1]
    if len(titles) != 1:
        problems.append(f"{len(titles)} level-1 headings (one title per page): {titles}")
    if found and found[0][0] != 1:
        problems.append(f"the first heading is not the title: {found[0]}")
    for (before, _), (level, title) in itertools.pairwise(found):
        if level > before + 1:
            problems.append(f"'{title}' is level {level} after a level {before}")
    return problems


def notebook_markdown(path: Path) -> str:
    cells = json.loads(path.read_text())["cells"]
    return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")


@pytest.mark.parametrize("page", [*GUIDES, *NOTEBOOKS], ids=lambda p: p.name)
def test_every_page_has_one_title_and_no_skipped_level(page: Path) -> None:
    """Every guide (its includes expanded) and notebook."""
    text = notebook_markdown(page) if page.suffix == ".ipynb" else expand(page)
    problems = heading_problems(headings(text))
    assert not problems, f"{page.name}, with its includes:\n" + "\n".join(problems)


def test_the_heading_checker_catches_a_second_title_and_a_skip() -> None:
    assert heading_problems([(1, "a"), (2, "b"), (1, "c")])
    assert heading_problems([(1, "a"), (3, "b")])
    assert not heading_problems([(1, "a"), (2, "b"), (3, "c"), (2, "d")])


PRIVATE = re.compile(r"\._cache_size\b|\bjax\._src\b|\.jitted_fn\b|\._clear_cache\b")


def all_sources() -> list[tuple[str, str]]:
    pages = [README, *GUIDES, *sorted((DOCS / "generated").glob("*.md"))]
    out = [(str(p.relative_to(ROOT)), p.read_text()) for p in pages]
    return out + [(where, "".join(cell["source"])) for where, cell in notebook_cells()]


def test_no_private_jax_api_in_the_docs() -> None:
    found = [
        f"{where}: {line.strip()}"
        for where, text in all_sources()
        for line in text.splitlines()
        if PRIVATE.search(line)
    ]
    assert not found, (
        "the docs use JAX's private API (count traces with a Python side effect, or "
        "leave the check to a test):\n" + "\n".join(found)
    )


def test_the_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_BYTES, (
        f"README.md is {size:,} bytes (at most {README_BYTES:,}): it gets a new user from "
        "install to the recommended setting, metrics and a checkpoint; the rest goes in docs/"
    )


def slug(title: str) -> str:
    """The anchor MyST (``myst_heading_anchors``) and GitHub give a heading."""
    text = re.sub(r"[^\w\- ]", "", title.replace("`", "").strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    return {slug(title) for _, title in headings(expand(page))}


# The words that stay, with a fixed meaning: the README links each to its entry.
TERMS = ("boundary", "ceiling", "clip target", "feedback", "capped", "warm-up", "route")
GLOSSARY_TERMS = {term: term.replace(" ", "-") for term in TERMS}


def prose(text: str) -> str:
    """Text outside code blocks and code spans, marked spans and links' targets."""
    kept = "\n".join(line for kind, line in lines_of(text) if kind != "code")
    kept = re.sub(r"<!--.*?-->", " ", kept)
    kept = re.sub(r"\]\([^)]*\)", "]", kept)
    return re.sub(r"`[^`\n]*`", " ", kept)


def test_the_glossary_defines_the_terms_the_readme_links_where_it_uses_them() -> None:
    missing = sorted(set(GLOSSARY_TERMS.values()) - anchors(DOCS / "glossary.md"))
    assert not missing, f"docs/glossary.md has no entry {missing}"
    text = README.read_text()
    words = prose(text).lower()
    problems = [
        f"README.md uses '{term}' without a link to docs/glossary.md#{anchor}"
        for term, anchor in GLOSSARY_TERMS.items()
        if re.search(rf"(?<![\w-]){re.escape(term)}(?![\w-])", words)
        and f"](docs/glossary.md#{anchor})" not in text
    ]
    assert not problems, "\n".join(problems)


LINK = re.compile(r"\]\(((?:docs/)?([\w-]+)\.md)#([^)\s]+)\)")


# The project's shorthand, which a newcomer does not know: say what it means.
JARGON = re.compile(
    r"\bfollows? a (?:training )?run\b|\bjudge[sd]? first\b|\bjudge-first\b"
    r"|\bseed threshold\b|\bfold route\b",
    re.I,
)
# docs/migrating.md is kept by whoever keeps the migration table.
PLAIN_PAGES = [README, *(p for p in GUIDES if p.name != "migrating.md")]


@pytest.mark.parametrize("page", PLAIN_PAGES, ids=lambda p: p.name)
def test_pages_use_plain_words(page: Path) -> None:
    found = [
        f"{page.name}:{n}: {line.strip()}"
        for n, line in enumerate(prose(page.read_text()).splitlines(), 1)
        if JARGON.search(line)
    ]
    assert not found, "internal jargon; say what it means (docs/glossary.md):\n" + "\n".join(found)


def sentences(text: str) -> list[str]:
    """The sentences of the prose: paragraphs and list items (not code, tables or
    headings) split after a full stop."""
    chunks, chunk = [], []
    for kind, line in lines_of(text):
        item = re.match(r"\s*(?:[*-]|\d+\.)\s", line)
        if kind != "text" or not line.strip() or line.lstrip().startswith("|") or item:
            chunks.append(" ".join(chunk))
            chunk = [line[item.end() :]] if kind == "text" and item else []
        else:
            chunk.append(line.strip())
    chunks.append(" ".join(chunk))
    return [
        sentence.strip()
        for chunk in chunks
        for sentence in re.split(r"(?<=[.!?])\s+", re.sub(r"\s+", " ", chunk))
    ]


@pytest.mark.parametrize("page", GUIDES, ids=lambda p: p.name)
def test_no_sentence_is_said_twice_on_a_page(page: Path) -> None:
    seen: set[str] = set()
    repeated = []
    # A generated page's "Model: ..." line is its provenance (the model, optimizer,
    # seeds and loss scale it ran): pages of one model at several scales share it.
    text = "\n".join(line for line in expand(page).splitlines() if not line.startswith("Model: "))
    for sentence in sentences(text):
        if len(sentence.split()) < 8 or not sentence.endswith((".", "!", "?")):
            continue  # short, or a line of a page's provenance (versions, machine)
        if sentence.startswith("Data: "):
            continue  # the data two generated pages measured on, in their provenance
        if sentence in seen:
            repeated.append(sentence)
        seen.add(sentence)
    assert not repeated, f"{page.name} says twice:\n" + "\n".join(repeated)


RELATIVE_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")


def source_of(page: Path, target: str) -> Path:
    """The file a link names, or what the docs build makes it from: docs/api.rst from
    docs/conf.py, docs/api/*.rst from clipjax's names, docs/notebooks/ from notebooks/."""
    path = (page.parent / target).resolve()
    docs = (ROOT / "docs").resolve()
    if path.parent == docs and path.name == "api.rst":
        return docs / "conf.py"
    if path.parent == docs / "api" and path.suffix == ".rst":
        return ROOT / "clipjax" / "__init__.py"
    if path.parent == docs / "notebooks":
        return ROOT / "notebooks" / path.name
    return path


@pytest.mark.parametrize("page", [README, *GUIDES], ids=lambda p: p.name)
def test_links_name_a_file_and_a_heading(page: Path) -> None:
    """Links are relative to their page (docs/x.md: ../examples/y.py); anchors name a heading."""
    text = page.read_text()
    outside_code = "\n".join(line for kind, line in lines_of(text) if kind != "code")
    missing = [t for t in RELATIVE_LINK.findall(outside_code) if not source_of(page, t).exists()]
    assert not missing, f"{page.name} links files that do not exist from its folder: {missing}"
    problems = []
    for target, name, anchor in LINK.findall(text):
        path = (ROOT / target) if target.startswith("docs/") else (page.parent / target)
        if not path.exists():
            problems.append(f"{target} does not exist")
        elif anchor not in anchors(path):
            problems.append(f"{target}#{anchor}: no such heading in {name}.md")
    assert not problems, f"{page.name}:\n" + "\n".join(problems)
