"""What the docs tests read: a Markdown page's tables and Python blocks, notebook cells."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from tests.paths import ROOT

NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def notebook_cells() -> Iterator[tuple[str, dict]]:
    """``(where, cell)`` of every notebook cell, ``where`` as ``notebooks/x.ipynb cell i``."""
    for path in NOTEBOOKS:
        for i, cell in enumerate(json.loads(path.read_text())["cells"]):
            yield f"{path.relative_to(ROOT)} cell {i}", cell


def python_blocks(page: Path) -> list[str]:
    """The bodies of a page's ```` ```python ```` fences."""
    return re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)


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
