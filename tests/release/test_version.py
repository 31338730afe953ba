"""One version: the package, its metadata, the CHANGELOG and the generated pages agree.

``clipjax.__version__`` is the source; ``pyproject.toml`` reads it
(``version = { attr = "clipjax.__version__" }``), so a build's metadata
carries it; the installed distribution must say the same (an editable
install made before a version change keeps the old metadata until it is
reinstalled); the CHANGELOG's newest release heading is that version (an
``## Unreleased`` section above it holds the work on main since); and every
generated page (``docs/generated/*.md``, ``benchmarks/*.md``) whose header
states a clipjax version states this one. A page generated before the
release says the previous version until its script runs again: that check is
an expected failure naming the script, never a silent skip.
"""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

import clipjax
from tests.paths import ROOT

VERSION = re.compile(r"\bclipjax (\d+\.\d+\.\d+)\b")
HEADING = re.compile(r"^## (\d+\.\d+\.\d+)\b(.*)$", re.M)
# A page states its versions in its header: the first lines before the tables.
HEADER_LINES = 30
SCRIPT_DIRS = ("benchmarks", "examples")


def changelog_versions() -> list[tuple[str, str]]:
    """``(version, rest of the heading)`` of every release heading, newest first."""
    return HEADING.findall((ROOT / "CHANGELOG.md").read_text())


def generated_pages() -> list[Path]:
    pages = sorted((ROOT / "docs" / "generated").glob("*.md")) + sorted(
        (ROOT / "benchmarks").glob("*.md")
    )
    return [p for p in pages if page_versions(p)]


def page_versions(page: Path) -> list[str]:
    header = "\n".join(page.read_text().splitlines()[:HEADER_LINES])
    return VERSION.findall(header)


def generator(page: Path) -> str:
    """The script that writes ``page``: the one its header's command runs, else the one
    under benchmarks/ or examples/ that names it."""
    header = "\n".join(page.read_text().splitlines()[:HEADER_LINES])
    command = re.search(r"python ((?:benchmarks|examples)/\w+\.py)", header)
    if command:
        return command.group(1)
    # lm_spikes_<config>.md is named after its --config.
    names = (page.name, re.sub(r"_(cpu|gpu)\.md$", "_<config>.md", page.name))
    for folder in SCRIPT_DIRS:
        for script in sorted((ROOT / folder).glob("*.py")):
            if any(name in script.read_text() for name in names):
                return str(script.relative_to(ROOT))
    raise AssertionError(f"no script under {SCRIPT_DIRS} names {page.relative_to(ROOT)}")


def test_version_is_the_release() -> None:
    assert re.fullmatch(r"\d+\.\d+\.\d+", clipjax.__version__), clipjax.__version__
    assert clipjax.__version__ == "0.4.0"


def test_pyproject_reads_the_package_version() -> None:
    """The build takes its version from ``clipjax.__version__``, the one place it is written
    (read as text: the oldest setuptools an environment may have predates the build's)."""
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in config["project"], "pyproject.toml states a version of its own"
    assert "version" in config["project"]["dynamic"]
    assert config["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "clipjax.__version__"}


def test_installed_metadata_says_the_package_version() -> None:
    installed = importlib.metadata.version("clipjax")
    assert installed == clipjax.__version__, (
        f"the installed clipjax metadata says {installed}, the package {clipjax.__version__}: "
        "an install made before the version changed; reinstall it (pip install -e .)"
    )


def test_changelog_newest_heading_is_the_version_with_its_date() -> None:
    versions = changelog_versions()
    assert versions, "CHANGELOG.md has no '## X.Y.Z' release heading"
    newest, rest = versions[0]
    assert newest == clipjax.__version__
    assert re.fullmatch(r" \(\d{4}-\d{2}-\d{2}\)", rest), f"dated heading, got {rest!r}"
    text = (ROOT / "CHANGELOG.md").read_text()
    # Work on main since the release sits under one "## Unreleased" heading, above it.
    above = text.split(f"## {newest}")[0]
    assert above.count("Unreleased") <= 1 and (
        "Unreleased" not in above or "\n## Unreleased\n" in above
    ), "at most one '## Unreleased' section, above the newest release"
    # The release section says how to move from the previous one.
    section = text.split(f"## {newest}")[1].split("\n## ")[0]
    previous = versions[1][0].rsplit(".", 1)[0]
    assert f"### Migrating from {previous}" in section


def test_generated_pages_are_found() -> None:
    names = {p.name for p in generated_pages()}
    assert {"COMPILE.md", "RESULTS.md", "follow.md"} <= names, names


@pytest.mark.parametrize(
    "page", generated_pages(), ids=lambda p: str(p.relative_to(ROOT)).replace("/", "_")
)
def test_generated_page_states_this_version(page: Path) -> None:
    stated = set(page_versions(page))
    if stated == {clipjax.__version__}:
        return
    script = generator(page)
    previous = changelog_versions()[1][0]
    assert stated <= {previous, clipjax.__version__}, (
        f"{page.relative_to(ROOT)} states clipjax {sorted(stated)}; this is "
        f"{clipjax.__version__} (run {script})"
    )
    reason = (
        f"{page.relative_to(ROOT)} says clipjax {previous}: regenerated by {script} "
        "in the same release"
    )
    print(reason)
    pytest.xfail(reason)
