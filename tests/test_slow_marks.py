"""tests/conftest.py marks the long runs slow from lists of test ids: an id that no
longer names a test (a renamed test) stops the session instead of silently leaving
that test in the fast suite."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest

TESTS = Path(conftest.__file__).parent


class Item:
    def __init__(self, relative: str, name: str) -> None:
        self.path = TESTS / relative
        self.nodeid = f"tests/{relative}::{name}"
        self.markers: list[str] = []

    def add_marker(self, marker: pytest.MarkDecorator) -> None:
        self.markers.append(marker.name)


def config(keyword: str = "", args: tuple[str, ...] = ("tests",)) -> SimpleNamespace:
    return SimpleNamespace(getoption=lambda name: keyword, args=list(args))


def test_a_listed_test_is_marked_slow(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "SLOW_TESTS", {"test_x.py::test_long": "why"})
    items = [Item("test_x.py", "test_long[a]"), Item("test_x.py", "test_short")]
    conftest.pytest_collection_modifyitems(config(), items)
    assert [i.markers for i in items] == [["slow"], []]


def test_a_stale_entry_stops_the_session(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "SLOW_TESTS", {"test_x.py::test_renamed": "why"})
    items = [Item("test_x.py", "test_long")]
    with pytest.raises(pytest.UsageError, match=r"test_x\.py::test_renamed"):
        conftest.pytest_collection_modifyitems(config(), items)
    # A session that selects some tests only cannot tell a stale entry from an unselected one.
    conftest.pytest_collection_modifyitems(config(keyword="long"), items)
    conftest.pytest_collection_modifyitems(config(args=("tests/test_x.py::test_long",)), items)
    # An entry for a file this session did not collect is not checked.
    monkeypatch.setattr(conftest, "SLOW_TESTS", {"test_y.py::test_gone": "why"})
    conftest.pytest_collection_modifyitems(config(), items)
