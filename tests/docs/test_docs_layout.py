"""The built docs site at 1280 px in headless Chromium: no table or code block scrolls sideways,
no header or row name breaks inside a word, no image is wider than the text, no curly quote
in code. Reads ``build/docs/html`` (or ``CLIPJAX_DOCS_HTML``; ``make docs-check`` after
``make docs``) with ``playwright`` and the system's Chromium (or ``CLIPJAX_CHROMIUM``);
skips, saying which, where one is missing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from tests.paths import ROOT

pytestmark = pytest.mark.slow

SITE = ROOT / os.environ.get("CLIPJAX_DOCS_HTML", "build/docs/html")  # relative to the root
WIDTH, HEIGHT = 1280, 900
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]  # fmt: skip
# Pages of Sphinx's own, not ours.
SKIP = {"genindex.html", "search.html", "py-modindex.html"}

# Each problem on a page as [what, size, room, text].
MEASURE = """
() => {
  const article = document.querySelector('.bd-article') || document.body;
  const width = Math.round(article.getBoundingClientRect().width);
  const text = (el) => el.textContent.trim().replace(/\\s+/g, ' ').slice(0, 80);
  const scrolls = (el) => el.scrollWidth > el.clientWidth + 1;
  const out = [];
  for (const table of article.querySelectorAll('table')) {
    for (let box = table; box && box !== article; box = box.parentElement) {
      const overflow = getComputedStyle(box).overflowX;
      if (scrolls(box) && (overflow === 'auto' || overflow === 'scroll')) {
        out.push(['table scrolls sideways', box.scrollWidth, box.clientWidth, text(table)]);
        break;
      }
    }
    const w = Math.round(table.getBoundingClientRect().width);
    if (w > width + 1) out.push(['table wider than the article', w, width, text(table)]);
  }
  for (const pre of article.querySelectorAll('pre')) {
    if (scrolls(pre)) {
      out.push(['code block scrolls sideways', pre.scrollWidth, pre.clientWidth, text(pre)]);
    }
  }
  for (const img of article.querySelectorAll('img')) {
    const w = Math.round(img.getBoundingClientRect().width);
    if (w > width + 1) out.push(['image wider than the article', w, width, img.src]);
  }
  // A header or a row's name (first column) split inside a word: "recommend / ed".
  // Words are split at spaces, hyphens and slashes; one longer than 20
  // characters (a whole call in a benchmark table) may break where it must.
  for (const cell of article.querySelectorAll('table th, table td:first-child')) {
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      for (const match of node.textContent.matchAll(/[^\\s\\-\\/]{2,20}(?![^\\s\\-\\/])/g)) {
        if (match.index > 0 && !/[\\s\\-\\/]/.test(node.textContent[match.index - 1])) continue;
        const range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const lines = new Set([...range.getClientRects()].map((r) => Math.round(r.top)));
        if (lines.size > 1) {
          out.push(['word split across lines', 0, 0, match[0] + ' in: ' + text(cell)]);
        }
      }
    }
  }
  for (const code of article.querySelectorAll('code, pre')) {
    if (/[\\u2018\\u2019\\u201c\\u201d]/.test(code.textContent)) {
      out.push(['curly quotes in code', 0, 0, text(code)]);
    }
  }
  return out;
}
"""


def chromium() -> str:
    path = os.environ.get("CLIPJAX_CHROMIUM") or next(
        (p for p in map(shutil.which, ("chromium", "chromium-browser")) if p), None
    )
    if not path:
        pytest.skip(
            "no Chromium on this machine (apt-get install chromium, or set CLIPJAX_CHROMIUM)"
        )
    return path


def pages() -> list[Path]:
    if not (SITE / "index.html").exists():
        return []
    return sorted(
        p
        for p in SITE.rglob("*.html")
        if p.name not in SKIP and not {"_modules", "_sources", "_static"} & set(p.parts)
    )


@pytest.fixture(scope="module")
def browser_page():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="needs the playwright package (pip install playwright)"
    )
    executable = chromium()
    if not pages():
        pytest.skip(f"the docs site is not built in {SITE} (make docs)")
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
        yield page
        browser.close()


def test_the_site_fits_1280_px(browser_page) -> None:
    problems = []
    for html in pages():
        browser_page.goto(html.as_uri(), wait_until="load")
        name = html.relative_to(SITE).as_posix()
        for what, size, room, text in browser_page.evaluate(MEASURE):
            sizes = f" ({size} px in {room})" if size else ""
            problems.append(f"{name}: {what}{sizes}: {text}")
    assert not problems, f"at {WIDTH} px:\n" + "\n".join(problems)
