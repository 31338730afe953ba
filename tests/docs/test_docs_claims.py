"""Figures, recommendations, code and quoted errors in the prose agree with their sources.

* A figure quoted from a generated page sits in a marked span,
  ``<!-- from: PAGE; ROW; COLUMN -->FIGURE<!-- end -->``: the cell under ``COLUMN`` of the
  row with a cell ``ROW`` on ``PAGE`` (``PAGE#anchor``: in that section) reads ``FIGURE``
  (its first number; ``+`` before, ``x``/``×`` after allowed). Any other measured figure in
  the prose of README.md, CHANGELOG.md and docs/*.md is an error.
* Every page, notebook and docstring that recommends a setting names the one that
  ``docs/generated/recommended.md`` names.
* Code is pasteable (no curly quote); an error message a guide quotes (``*"..."*``) is raised.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import jax.numpy as jnp
import pytest

import clipjax
from tests.docs.markdown_tables import NOTEBOOKS, notebook_cells, tables
from tests.paths import ROOT

DOCS = ROOT / "docs"
PROSE = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted(DOCS.glob("*.md"))]

SPAN = re.compile(r"<!-- from: (.+?); (.+?); (.+?) -->(.*?)<!-- end -->")
# A measured figure in prose: 1.19x, x1.82, 1.8×, 12%, "two extra passes", "+5 gradient reads".
FIGURE = re.compile(
    r"\d\.\d+ ?[x×](?!\w)|(?<!\w)[x×] ?\d+\.\d+|\d+(?:\.\d+)? ?%|extra pass|\d ?gradient reads"
    r"|no more than the optimizer"
)
RECOMMENDING = re.compile(
    r"recommend|configuration to copy|a default for spike|the setting that follows", re.I
)
CURLY = re.compile("[\u2018\u2019\u201c\u201d]")


def section_lines(page: Path, anchor: str) -> range:
    """The lines (1-based) of the section of ``page`` whose heading's anchor is ``anchor``."""
    lines = page.read_text().splitlines()
    start = end = None
    for number, line in enumerate(lines, 1):
        heading = re.match(r"^(#+)\s+(.*)$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading.group(2).lower()).strip().replace(" ", "-")
        if start is None and slug == anchor:
            start, level = number, len(heading.group(1))
        elif start is not None and len(heading.group(1)) <= level:
            end = number
            break
    if start is None:
        raise AssertionError(f"{page.name} has no heading #{anchor}")
    return range(start, (end or len(lines) + 1))


def table_cells(page: Path, row: str, column: str, anchor: str | None = None) -> list[str]:
    """The cells under ``column`` of every table row of ``page`` (of its section
    ``#anchor`` where given) with a cell ``row``."""
    found = []
    within = section_lines(page, anchor) if anchor else None
    for line, header, rows in tables(page):
        if within is not None and line not in within:
            continue
        header = [h.strip("`") for h in header]
        for _, cells in rows:
            cells = [c.strip("`") for c in cells]
            if row in cells and column in header:
                found.append(cells[header.index(column)])
    return found


def first_number(text: str) -> str | None:
    match = re.search(r"-?\d+(?:\.\d+)?(?:e[+-]?\d+)?", text)
    return match.group(0) if match else None


def check_span(source: str, row: str, column: str, quoted: str) -> str | None:
    """Why a marked span disagrees with its source, or None."""
    path, _, anchor = source.partition("#")
    page = ROOT / path
    if not page.exists():
        return f"{source} does not exist"
    cells = table_cells(page, row, column, anchor or None)
    if not cells:
        return f"{source} has no table row {row!r} with a column {column!r}"
    values = {first_number(c) for c in cells}
    if len(values) != 1:
        return f"{source}: row {row!r}, column {column!r} is ambiguous: {cells}"
    value = values.pop()
    said = quoted.strip().lstrip("+").rstrip("x×").strip()
    if said != value:
        return f"the prose says {quoted!r}; {source}, row {row!r}, column {column!r} reads {value}"
    return None


def prose_lines(page: Path):
    """(line number, text) outside code blocks and copied tables, marked spans removed."""
    in_code = copied = False
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
        elif "demo-table:" in line:  # the table demo.py copies in (and its caption)
            copied = "demo-table:start" in line
        elif not (in_code or copied):
            yield n, SPAN.sub("", line)


@pytest.mark.parametrize("page", PROSE, ids=lambda p: str(p.relative_to(ROOT)))
def test_figures_in_prose_are_marked_and_match_their_source(page: Path) -> None:
    name = page.relative_to(ROOT)
    problems = [
        f"{name}:{n}: {why}"
        for n, line in enumerate(page.read_text().splitlines(), 1)
        for source, row, column, quoted in SPAN.findall(line)
        if (why := check_span(source, row, column, quoted))
    ]
    assert not problems, "\n".join(problems)
    found = [f"{name}:{n}: {line.strip()}" for n, line in prose_lines(page) if FIGURE.search(line)]
    assert not found, (
        "measured figures in prose must be marked spans quoting a generated page "
        "(<!-- from: PAGE; ROW; COLUMN -->figure<!-- end -->) or a citation of it:\n"
        + "\n".join(found)
    )


def test_the_span_checker_catches_a_wrong_figure() -> None:
    page, row = "benchmarks/RESULTS.md", "clipjax.skip_on_spike(clipjax.adam)"
    wrong = check_span(page, row, "× base", "999x")
    assert wrong is not None and "reads " in wrong
    value = wrong.rsplit("reads ", 1)[1]  # the page's figure, whatever the last run measured
    assert check_span(page, row, "× base", f"{value}x") is None
    assert "no table row" in check_span(page, "no such row", "× base", "1")
    assert FIGURE.search("costs about two extra passes over the updates")
    assert FIGURE.search("1.82x adam's step") and not FIGURE.search("about 5 minutes")


def canonical(text: str) -> str:
    return re.sub(r"\s+", "", text).removeprefix("clipjax.")


def recommended() -> str:
    page = DOCS / "generated" / "recommended.md"
    match = re.search(r"^`(clipjax\.\w+\(.*\))`$", page.read_text(), re.M)
    assert match, f"{page.relative_to(ROOT)} names no setting as `clipjax.name(...)`"
    return canonical(match.group(1))


CLIPPERS = ("autoclip", "zscore_clip", "zclip", "hist_clip", "adagc", "agc", "skip_on_spike")
CALL = re.compile(r"(?<![\w.])(?:clipjax\.)?(" + "|".join(CLIPPERS) + r")\(([^()]*)\)")


def paragraphs(text: str) -> list[str]:
    """Blank-line paragraphs; each table row is a paragraph of its own."""
    out = []
    for block in re.split(r"\n\s*\n", text):
        if block.lstrip().startswith("|"):
            out += block.splitlines()
        else:  # list items apart
            out += re.split(r"\n(?=\s*[*-] )", block)
    return out


def recommendation_sites() -> list[tuple[str, str]]:
    sites = []
    for page in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        sites += [(str(page.relative_to(ROOT)), p) for p in paragraphs(page.read_text())]
    for where, cell in notebook_cells():
        sites += [(where, p) for p in paragraphs("".join(cell["source"]))]
    return sites


# A paragraph may name an earlier release's recommended setting as such (the
# GPU table of 0.3, the migration notes): "0.3's recommended setting".
EARLIER = re.compile(r"\b0\.\d+'s recommended setting")


def disagreeing(where: str, paragraph: str, setting: str) -> str | None:
    if not RECOMMENDING.search(paragraph) or EARLIER.search(re.sub(r"\s+", " ", paragraph)):
        return None
    calls = [canonical(m.group(0)) for m in CALL.finditer(paragraph)]
    if calls and setting not in calls:
        return f"{where}: recommends {calls}, not {setting}:\n    {paragraph.strip()[:300]}"
    return None


def test_every_page_and_notebook_recommends_the_one_setting() -> None:
    setting = recommended()
    problems = [d for w, p in recommendation_sites() if (d := disagreeing(w, p, setting))]
    assert not problems, "\n".join(problems)


def test_the_recommendation_checker_catches_another_setting() -> None:
    other = 'We recommend `zclip(feedback="clipped", max_grad_norm=1.0)`.'
    assert disagreeing("x", other, recommended()), "the check lets another setting through"
    earlier = other.replace("We recommend", "0.3's recommended setting,")
    assert not disagreeing("x", earlier, recommended())
    setting = canonical("zclip(max_grad_norm=None, warmup_steps=10)")
    assert disagreeing("x", "`zclip()`: a default for spike protection", setting)
    assert disagreeing("x", "We recommend `autoclip(feedback='clipped')`.", setting)
    assert not disagreeing(
        "x", "Recommended: `clipjax.zclip(max_grad_norm=None, warmup_steps=10)`", setting
    )
    assert not disagreeing("x", "autoclip(feedback='clipped') is another choice.", setting)


@pytest.mark.parametrize(
    "page", ["README.md", "docs/index.md", "docs/getting_started.md", "docs/choosing.md"]
)
def test_the_guides_show_the_recommended_setting(page: str) -> None:
    setting = recommended()
    text = (ROOT / page).read_text()
    assert setting in canonical(text), f"{page} does not show the recommended {setting}"


def test_the_readme_first_example_uses_the_recommended_setting() -> None:
    first = re.search(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert first and recommended() in canonical(first.group(1))


@pytest.mark.parametrize("name", sorted(clipjax.__all__))
def test_docstrings_recommend_the_one_setting(name: str) -> None:
    doc, setting = inspect.getdoc(getattr(clipjax, name)) or "", recommended()
    problems = [d for p in paragraphs(doc) if (d := disagreeing(f"clipjax.{name}", p, setting))]
    assert not problems, "\n".join(problems)


def code_of(text: str) -> list[str]:
    blocks = re.findall(r"^\s*```[^\n]*\n(.*?)^\s*```", text, re.S | re.M)
    rest = re.sub(r"^\s*```[^\n]*\n.*?^\s*```", "", text, flags=re.S | re.M)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def code_sources() -> list[tuple[str, str]]:
    out = []
    for page in [*PROSE, *sorted((DOCS / "generated").glob("*.md"))]:
        out += [(str(page.relative_to(ROOT)), c) for c in code_of(page.read_text())]
    for where, cell in notebook_cells():
        source = "".join(cell["source"])
        out += [(where, c) for c in ([source] if cell["cell_type"] == "code" else code_of(source))]
    return out


def test_code_has_straight_quotes() -> None:
    found = [f"{where}: {code[:120]!r}" for where, code in code_sources() if CURLY.search(code)]
    assert not found, "curly quotes in code (they do not paste):\n" + "\n".join(found)


def test_the_readme_example_prints_what_the_readme_shows(capsys: pytest.CaptureFixture) -> None:
    """The output block after the README's first example is its output (``...``: lines left out)."""
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^```python\n(.*?)^```\n\n```\n(.*?)^```", text, re.S | re.M)
    assert match, "the README's first example is followed by its output"
    code, shown = match.groups()
    exec(compile(code, "README.md example", "exec"), {})
    printed = capsys.readouterr().out.strip().splitlines()
    head, _, tail = shown.strip().partition("...")
    head_lines, tail_lines = head.strip().splitlines(), tail.strip().splitlines()
    if not _:  # no "...": the whole output
        head_lines, tail_lines = [], head_lines
    assert len(head_lines) + len(tail_lines) <= len(printed) and (
        printed[: len(head_lines)] == head_lines
        and printed[len(printed) - len(tail_lines) :] == tail_lines
    ), "README.md's example output is not what it prints; it prints:\n" + "\n".join(printed)


BUILD_NOTES = re.compile(
    r"as of commit|in this revision|do not edit by hand|Linux-\d|/tmp/|/root/|this session",
    re.I,
)


def test_pages_carry_no_build_notes() -> None:
    pages = [*PROSE, *sorted((DOCS / "generated").glob("*.md")), *NOTEBOOKS]
    pages += sorted((ROOT / "benchmarks").glob("*.md"))
    found = [
        f"{page.relative_to(ROOT)}:{n}: {line.strip()[:160]}"
        for page in pages
        for n, line in enumerate(page.read_text().splitlines(), 1)
        if BUILD_NOTES.search(line)
    ]
    assert not found, (
        "pages state the command, machine, versions and date; not notes on how a run was "
        "obtained, kernel builds or temporary paths:\n" + "\n".join(found)
    )


def test_make_help_and_readme_give_one_duration_for_make_test() -> None:
    readme = re.search(r"`make test` takes about (\d+) minutes", (ROOT / "README.md").read_text())
    makefile = re.search(r"make test .*~(\d+) min", (ROOT / "Makefile").read_text())
    assert readme and makefile, "the README or the Makefile's help lost its figure"
    assert readme.group(1) == makefile.group(1), (readme.group(0), makefile.group(0))


def test_the_quoted_checkpointing_errors_are_raised() -> None:
    serialization = pytest.importorskip("flax.serialization")
    two = {"l1": {"w": jnp.ones(2)}, "l2": {"w": jnp.ones(2)}}
    three = {**two, "l3": {"w": jnp.ones(2)}}
    tx = clipjax.zclip(scope="per_layer")
    data = serialization.to_bytes(tx.init(two))
    messages = []
    for action in (lambda: serialization.from_bytes(tx.init(three), data),
                   lambda: tx.update(three, tx.init(two))):  # fmt: skip
        with pytest.raises(Exception) as info:
            action()
        messages.append(" ".join(str(info.value).split()))
    text = (DOCS / "checkpointing.md").read_text()
    found = [" ".join(q.split()) for q in re.findall(r'\*"(.+?)"\*', text, re.S)]
    assert len(found) >= 2, found
    for quote in found:
        assert any(quote in m for m in messages), f"{quote!r} is not raised: {messages}"
