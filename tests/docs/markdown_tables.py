"""The tables of a Markdown page, as the docs tests read them."""

from __future__ import annotations

import re
from pathlib import Path


def tables(path: Path) -> list[tuple[int, list[str], list[tuple[int, list[str]]]]]:
    """Every Markdown table of a page: (line of its header, header cells, rows)."""
    lines = path.read_text().splitlines()
    found = []
    i = 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and re.match(r"^\|\s*:?-{3,}", lines[i + 1]):
            header = cells(lines[i])
            rows = []
            j = i + 2
            while j < len(lines) and lines[j].startswith("|"):
                rows.append((j + 1, cells(lines[j])))
                j += 1
            found.append((i + 1, header, rows))
            i = j
        else:
            i += 1
    return found


def cells(line: str) -> list[str]:
    """A table row's cells; a ``|`` inside a code span does not split."""
    out, cell, in_code = [], "", False
    for ch in line.strip().strip("|"):
        if ch == "`":
            in_code = not in_code
        if ch == "|" and not in_code:
            out.append(cell.strip())
            cell = ""
        else:
            cell += ch
    out.append(cell.strip())
    return out
