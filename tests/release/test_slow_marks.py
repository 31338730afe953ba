"""tests/slow_marks.py marks the long runs slow from lists of test ids: an id that no
longer names a test (a moved or renamed test) stops the session instead of silently
leaving that test in the fast suite."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import slow_marks


class Item:
    def __init__(self, tests: Path, relative: str, name: str) -> None:
        self.path = tests / relative
        self.nodeid = f"tests/{relative}::{name}"
        self.markers: list[str] = []

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker.name)


def config(keyword: str = "", args: tuple[str, ...] = ("tests",)) -> SimpleNamespace:
    return SimpleNamespace(getoption=lambda name: keyword, args=list(args))


@pytest.fixture
def tests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A tests/ folder holding ``test_x.py`` and ``sub/test_y.py``, none of the real lists."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "test_x.py").touch()
    (tmp_path / "sub" / "test_y.py").touch()
    monkeypatch.setattr(slow_marks, "_TESTS_DIR", tmp_path)
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {})
    monkeypatch.setattr(slow_marks, "SLOW_PATTERNS", {})
    return tmp_path


def test_a_listed_test_is_marked_slow(tests: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {"sub/test_y.py::test_long": "why"})
    monkeypatch.setattr(slow_marks, "SLOW_PATTERNS", {r"test_x\.py::test_.*_eager$": "why"})
    items = [
        Item(tests, "sub/test_y.py", "test_long[a]"),
        Item(tests, "sub/test_y.py", "test_short"),
        Item(tests, "test_x.py", "test_one_eager"),
        Item(tests, "test_x.py", "test_one_jit"),
    ]
    slow_marks.pytest_collection_modifyitems(config(), items)
    assert [i.markers for i in items] == [["slow"], [], ["slow"], []]


def test_a_stale_entry_stops_the_session(tests: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {"test_x.py::test_renamed": "why"})
    items = [Item(tests, "test_x.py", "test_long")]
    with pytest.raises(pytest.UsageError, match=r"test_x\.py::test_renamed"):
        slow_marks.pytest_collection_modifyitems(config(), items)
    # A session that selects some tests only cannot tell a stale entry from an unselected one.
    slow_marks.pytest_collection_modifyitems(config(keyword="long"), items)
    slow_marks.pytest_collection_modifyitems(config(args=("tests/test_x.py::test_long",)), items)
    # An entry for an existing file this session did not collect is not checked.
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {"sub/test_y.py::test_gone": "why"})
    slow_marks.pytest_collection_modifyitems(config(), items)
    # An entry naming a file that does not exist (moved into a subfolder, renamed)
    # stops every session, whatever it selects.
    items = [Item(tests, "sub/test_y.py", "test_long")]
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {"test_y.py::test_long": "why"})
    for session in (config(), config(keyword="long")):
        with pytest.raises(pytest.UsageError, match=r"test_y\.py::test_long"):
            slow_marks.pytest_collection_modifyitems(session, items)
    monkeypatch.setattr(slow_marks, "SLOW_TESTS", {})
    monkeypatch.setattr(slow_marks, "SLOW_PATTERNS", {r"test_y\.py::test_long": "why"})
    with pytest.raises(pytest.UsageError, match=r"test_y\\\.py::test_long"):
        slow_marks.pytest_collection_modifyitems(config(keyword="long"), items)
    assert items[0].markers == []
