"""The defaults tables of README.md and docs/*.md, and the guides' ``feedback`` table, against
the signatures.

A defaults table has a column whose header contains "defaults" and names one public factory
as a code span in its first column. In a defaults cell, `` `name=value` `` claims a default
(a literal, or a function's name), a bare `` `name` `` names a parameter and `` `"choice"` ``
another value; a default that stands for something else (``None``, ``"default"``) is followed
by a parenthesised note carrying every number and literal of the ``default ...`` clause of
its docstring's Args entry. Text in parentheses makes no claim, except ``factory()``: followed
by that factory's `` `name=value` `` defaults. The ``feedback`` table's "default of" column
lists the clippers whose ``feedback`` defaults to that row's value.
"""

from __future__ import annotations

import ast
import inspect
import re

import pytest

import clipjax
from tests.docs.markdown_tables import tables
from tests.paths import ROOT

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

CODE = re.compile(r"`([^`]+)`")
# Numbers and literals of a docstring's "default ..." clause: ``x`` and
# :func:`x` literals, then bare numbers outside them.
RST_LITERAL = re.compile(r"``(.+?)``|:\w+:`~?([^`]+)`")
NUMBER = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])")


def segments(cell: str) -> list[tuple[str, str]]:
    """A cell as ("code", span) at the top level and ("note", text) for each
    parenthesised part, in order; code spans are opaque to parentheses."""
    out: list[tuple[str, str]] = []
    depth, note, i = 0, "", 0
    while i < len(cell):
        ch = cell[i]
        if ch == "`":
            end = cell.index("`", i + 1)
            if depth:
                note += cell[i : end + 1]
            else:
                out.append(("code", cell[i + 1 : end]))
            i = end + 1
            continue
        if ch == "(":
            depth += 1
            if depth == 1:
                i += 1
                continue
        elif ch == ")":
            depth -= 1
            if depth == 0:
                out.append(("note", note))
                note = ""
                i += 1
                continue
        if depth:
            note += ch
        i += 1
    return out


def args_entries(factory) -> dict[str, str]:
    """The docstring's Args section: parameter name -> its entry, one line."""
    doc = inspect.getdoc(factory) or ""
    match = re.search(r"^Args:\n(.*?)(?:\n\S|\Z)", doc, re.S | re.M)
    entries: dict[str, str] = {}
    if match:
        name = None
        for line in match.group(1).splitlines():
            head = re.match(r"^  (\*{0,2}\w+): ?(.*)$", line)
            if head:
                name = head.group(1).lstrip("*")
                entries[name] = head.group(2)
            elif name:
                entries[name] += " " + line.strip()
    return entries


def tokens(text: str, *, rst: bool) -> set[str]:
    """Literals (without ``clipjax.`` or a trailing ``()``) and numbers of a text."""
    if rst:
        literals = [a or b for a, b in RST_LITERAL.findall(text)]
        rest = RST_LITERAL.sub(" ", text)
    else:
        literals = CODE.findall(text)
        rest = CODE.sub(" ", text)
    found = {lit.removeprefix("clipjax.").removesuffix("()") for lit in literals}
    return found | set(NUMBER.findall(rest))


def default_clause(entry: str) -> str:
    """What the docstring says a default stands for: the text from "default" to
    the end of its sentence, or the whole entry where values are marked
    "(default)" (one per mode, e.g. autoclip's ``history``)."""
    if "(default)" in entry:
        return entry
    match = re.search(r"\bdefault\b(.*?)(?:\.(?:\s|$)|$)", entry)
    return match.group(1) if match else ""


def sentinel(default) -> bool:
    """A default that stands for something else: None or a keyword string."""
    return default is None or default == "default"


def same_default(text: str, default) -> bool:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return getattr(default, "__name__", None) == text.removeprefix("clipjax.")
    return (
        type(value) in (int, float, str, bool, type(None))
        and value == default
        and (isinstance(value, bool) == isinstance(default, bool))
    )


def check_defaults_cell(factory_name: str, cell: str) -> list[str]:
    """The disagreements of one defaults cell with the factory's signature."""
    factory = getattr(clipjax, factory_name, None)
    if factory is None:
        return [f"`{factory_name}` is not a public name of clipjax"]
    params = inspect.signature(factory).parameters
    entries = args_entries(factory)
    signature = f"clipjax.{factory_name}{inspect.signature(factory)}"
    problems = []
    parts = segments(cell)
    for k, (kind, text) in enumerate(parts):
        if kind == "note":
            problems += nested_defaults(text)
            continue
        claim = re.fullmatch(r"(\w+)=(.+)", text)
        name = claim.group(1) if claim else text
        if not claim and not re.fullmatch(r"\w+", text):
            continue  # a quoted alternative: `"percentile"`
        if name not in params:
            problems.append(f"`{text}`: {factory_name} has no parameter {name!r} ({signature})")
            continue
        if not claim:
            continue
        default = params[name].default
        if default is inspect.Parameter.empty:
            problems.append(f"`{text}`: {name} is required in {signature}")
        elif not same_default(claim.group(2), default):
            problems.append(f"`{text}`: the signature has {name}={default!r}")
        elif sentinel(default):
            note = parts[k + 1][1] if k + 1 < len(parts) and parts[k + 1][0] == "note" else None
            if note is None:
                problems.append(
                    f"`{text}` does not say what {default!r} means; the docstring: "
                    f"{name}: {entries.get(name, '(no Args entry)')}"
                )
                continue
            missing = tokens(default_clause(entries.get(name, "")), rst=True) - tokens(
                note, rst=False
            )
            if missing:
                problems.append(
                    f"`{text}` ({note}) leaves out {sorted(missing)} of the docstring's "
                    f"{name}: {entries[name]}"
                )
    return problems


def nested_defaults(note: str) -> list[str]:
    """In a note, `` `factory()`: `name=value`, ... `` claims the defaults of
    another public factory (hist_clip's criteria): check those too."""
    problems, factory = [], None
    for span in CODE.findall(note):
        call = re.fullmatch(r"(\w+)\(\)", span)
        claim = re.fullmatch(r"(\w+)=(.+)", span)
        if call:
            factory = getattr(clipjax, call.group(1), None)
        elif claim and callable(factory):
            params = inspect.signature(factory).parameters
            name = claim.group(1)
            if name not in params or not same_default(claim.group(2), params[name].default):
                found = params[name].default if name in params else "no such parameter"
                problems.append(
                    f"`{span}` after `{factory.__name__}()`: the signature has {found!r}"
                )
    return problems


def defaults_cells() -> list[tuple[str, str, str]]:
    """(where, factory, cell) of every defaults column in the pages."""
    found = []
    for page in PAGES:
        for _, header, rows in tables(page):
            columns = [i for i, h in enumerate(header) if "defaults" in h.lower()]
            for line, row in rows:
                for i in columns:
                    names = CODE.findall(row[0])
                    if len(names) == 1 and i < len(row):
                        where = f"{page.relative_to(ROOT)}:{line} (column {header[i]!r})"
                        found.append((where, names[0], row[i]))
    return found


CELLS = defaults_cells()


def test_there_are_defaults_tables() -> None:
    factories = {name for _, name, _ in CELLS}
    assert {"autoclip", "zscore_clip", "zclip", "hist_clip", "skip_on_spike"} <= factories


@pytest.mark.parametrize(("where", "factory", "cell"), CELLS, ids=[c[0] for c in CELLS])
def test_defaults_cell_matches_the_signature(where: str, factory: str, cell: str) -> None:
    problems = check_defaults_cell(factory, cell)
    assert not problems, f"{where}, row `{factory}`:\n  " + "\n  ".join(problems)


def feedback_rows() -> list[tuple[str, str, str]]:
    """(where, feedback value, clipper) of each "default of" cell."""
    found = []
    for page in PAGES:
        for _, header, rows in tables(page):
            if header[0] != "`feedback`" or "default of" not in header:
                continue
            column = header.index("default of")
            for line, row in rows:
                value = ast.literal_eval(CODE.findall(row[0])[0])
                for kind, text in segments(row[column]):
                    if kind == "code":
                        found.append((f"{page.relative_to(ROOT)}:{line}", value, text))
    return found


def test_feedback_table_names_each_default() -> None:
    rows = feedback_rows()
    assert rows, "the guides' feedback table is gone"
    listed = {clipper for _, _, clipper in rows}
    problems = []
    for where, value, clipper in rows:
        default = inspect.signature(getattr(clipjax, clipper)).parameters["feedback"].default
        if default != value:
            problems.append(
                f"{where}: lists `{clipper}` as a default of {value!r}; its default is {default!r}"
            )
    for name in ("autoclip", "zscore_clip", "zclip", "hist_clip", "adagc"):
        if name not in listed:
            problems.append(f"the feedback table does not list {name}'s default")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("cell", "message"),
    [
        ("`window_size=1024`", "the signature has window_size=None"),
        ("`warmup_steps=None`", "does not say what None means"),
        ('`warmup_steps=None` (100 under `"observe_first"`)', "leaves out ['10']"),
        ("`min_historyy=50`", "has no parameter 'min_historyy'"),
        ("`eps=1e-7`", "the signature has eps=1e-08"),
        ("`history=None` (`zstat_criterion()`: `alpha=0.9`)", "after `zstat_criterion()`"),
        ('`mode="auto"` or `"percentile"`, `eps=1e-8`, '
         '`warmup_steps=None` (100 under `"observe_first"`, 10 otherwise)', None),
    ],
)  # fmt: skip
def test_the_checker_reports_a_wrong_cell_and_accepts_a_right_one(cell: str, message) -> None:
    problems = check_defaults_cell("autoclip", cell)
    if message is None:
        assert problems == []
    else:
        assert any(message in p for p in problems), problems
