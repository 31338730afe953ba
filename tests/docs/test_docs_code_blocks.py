"""Every code block of the README and the docs runs, and docs/defences.md's print what
the page implies.

A page's blocks (```` ```python ```` fences and myst-nb ``{code-cell}`` cells) run in page
order in one namespace, as a reader would paste them, from :data:`READER` (the imports,
``params``, ``grads``, ``loss``, ``loss_fn(params, batch)``), each page in its own
temporary folder with ``os.environ`` restored. A block that cannot run here carries
``<!-- no-run: reason -->`` on the line before its fence; :data:`NOT_RUN` counts them per
page, :data:`STAND_IN` defines on one process what later blocks need from one, and the
test prints the reasons of the blocks it did not run.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import jax
import pytest

from tests.docs.markdown_tables import python_blocks
from tests.paths import ROOT

# Packages a page may show that make test-min's environment does not install.
OPTIONAL = {"flax", "orbax", "tensorboardX", "matplotlib", "tqdm"}

FENCE = re.compile(r"^```(?:python|\{code-cell\} ipython3)[^\n]*\n(.*?)^```", re.S | re.M)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->\s*$", re.S)

READER = """
import jax
import jax.numpy as jnp
import numpy as np
import optax

import clipjax

_keys = iter(jax.random.split(jax.random.PRNGKey(0), 8))
params = {
    "params": {
        "Dense_0": {"kernel": jax.random.normal(next(_keys), (4, 8)), "bias": jnp.zeros(8)},
        "Dense_1": {"kernel": jax.random.normal(next(_keys), (8, 2)), "bias": jnp.zeros(2)},
    }
}
batch = (jax.random.normal(next(_keys), (16, 4)), jax.random.normal(next(_keys), (16, 2)))


def loss_fn(params, batch):
    x, y = batch
    p = params["params"]
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return jnp.mean((h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"] - y) ** 2)


loss, grads = jax.value_and_grad(loss_fn)(params, batch)
"""

NOT_RUN = {"docs/multi_host.md": 1}
STAND_IN = {
    "docs/multi_host.md": """
import os
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()), ("data",))
replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))
tx = optax.chain(clipjax.zclip(), optax.adamw(1e-3))
opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
path = os.path.abspath("checkpoint")  # orbax takes absolute paths
""",
}


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    source: str
    no_run: str | None  # the marker's reason, None when the block runs


def pages() -> list[Path]:
    found = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    found += sorted((ROOT / "docs" / "generated").glob("*.md"))
    return [p for p in found if blocks(p)]


def blocks(page: Path) -> list[Block]:
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n")
        marker = NO_RUN.search(before.rsplit("\n", 1)[-1])
        # myst-nb cell options (":tags: [...]") are not Python.
        source = "\n".join(
            line for line in match.group(1).splitlines() if not re.match(r"^:\w[\w-]*:", line)
        )
        found.append(
            Block(
                page=str(page.relative_to(ROOT)),
                line=text.count("\n", 0, match.start()) + 1,
                source=source,
                no_run=marker.group(1) if marker else None,
            )
        )
    return found


PAGES = pages()


def run_page(page: Path) -> list[Block]:
    """Runs the page's blocks in order; returns those marked not to run."""
    namespace: dict = {"__name__": "__main__"}
    exec(compile(READER, "<reader's training loop>", "exec"), namespace)
    skipped = []
    for block in blocks(page):
        if block.no_run is not None:
            skipped.append(block)
            if block.page in STAND_IN:
                stand_in = compile(STAND_IN[block.page], f"<stand-in for {block.page}>", "exec")
                exec(stand_in, namespace)
            continue
        where = f"{block.page}:{block.line}"
        try:
            exec(compile(block.source, where, "exec"), namespace)
        except ModuleNotFoundError as error:  # make test-min: no flax, orbax, tensorboardX
            if error.name not in OPTIONAL:
                raise
            pytest.skip(f"{where} needs {error.name}, not installed in this environment")
        except AttributeError as error:
            if "shard_map" not in str(error) or hasattr(jax, "shard_map"):
                raise
            pytest.skip(f"{where} needs jax.shard_map (jax {jax.__version__} has none)")
        except Exception as error:
            raise AssertionError(
                f"the block at {where} raised {type(error).__name__}: {error}"
            ) from error
    return skipped


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_code_blocks_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    monkeypatch.chdir(tmp_path)
    environ = dict(os.environ)
    try:
        skipped = run_page(page)
    finally:
        os.environ.clear()
        os.environ.update(environ)
    with capsys.disabled():
        for block in skipped:
            print(f"\nnot run: {block.page}:{block.line}: {block.no_run}")


def test_blocks_that_do_not_run_are_listed_with_a_reason() -> None:
    marked = [b for page in PAGES for b in blocks(page) if b.no_run is not None]
    counts: dict[str, int] = {}
    for block in marked:
        counts[block.page] = counts.get(block.page, 0) + 1
        # A reason a reader can check: more than a word or two.
        assert len(block.no_run.split()) >= 3, f"{block.page}:{block.line}: {block.no_run!r}"
    assert counts == NOT_RUN, counts


def test_the_extraction_finds_every_fence() -> None:
    """A fence the pattern misses (```py, indented, a typo) would go untested."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        opened = len(re.findall(r"^```(?:python|py|\{code-cell\})", text, re.M))
        assert opened == len(blocks(page)), page


def defences_block(index: int) -> str:
    """What docs/defences.md's block ``index`` prints."""
    page = ROOT / "docs" / "defences.md"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(python_blocks(page)[index], str(page), "exec"), {})
    return out.getvalue().strip()


def test_the_defences_page_has_a_block_for_each_defence() -> None:
    names = ["skip_and_clip_by_global_norm", "clip_norm_growth", "clip_grad_adapt",
             "clip_by_historical_norm", "stability_monitor", "spectra", "spectral_clip",
             "clip_activation_gradient", "linen_activation_clip",
             "nnx_activation_clip"]  # fmt: skip
    found = python_blocks(ROOT / "docs" / "defences.md")
    assert len(found) == 10
    assert all(any(n in b for b in found) for n in names)


def test_the_defences_blocks_print_what_the_page_implies() -> None:
    # skip_and_clip counts each threshold.
    assert defences_block(0) == str([f"count_exceeds_{k}x_stddev" for k in (100, 20, 40)])
    # Growth is capped at 1.5 times the last norm, that of the 3-vector of 1.2s: 1.2 sqrt(3).
    assert float(defences_block(1)) == pytest.approx(1.8 * 3**0.5, rel=1e-5)
    assert float(defences_block(2)) == 0.25  # adamwclip clips the spiking element, one of four
    assert defences_block(3) == "inf"  # the Levanter chain has no threshold before 64 norms
    # The stability score: the one spike (step 250), 1 of the last 100 steps.
    assert defences_block(4).split() == ["1", "0.01"]
    # SPECTRA: c after the warm-up, Adam's direction clipped; 4, 1, 0.5 at c = 1.
    assert defences_block(5).splitlines() == ["1.0 True", "[0.97  0.707 0.447]"]
    # spectral_clip: the spike's direction clamped at tau, the others as they were.
    assert defences_block(6) == "True True True"


def test_the_activation_blocks_print_what_the_page_implies() -> None:
    found = python_blocks(ROOT / "docs" / "defences.md")
    index = lambda name: next(i for i, block in enumerate(found) if name in block)
    # The 4 largest token gradients zeroed; the far-off token's norm stands out of the median.
    assert defences_block(index("clip_activation_gradient(")).split() == ["4", "True"]
    pytest.importorskip("flax", reason="the flax blocks need flax")
    assert defences_block(index("linen_activation_clip")) == "4"
    assert defences_block(index("nnx_activation_clip")) == "4"
