"""Sphinx configuration of the clipjax documentation (``make docs``).

Before Sphinx reads the sources, this file generates what is not committed:

* ``api.rst``: the API reference, one entry per name in ``clipjax.__all__``
  (so a new public name appears without editing the docs), grouped into
  transforms, other functions and classes;
* ``notebooks/*.ipynb``: copies of the repository's notebooks, which myst-nb
  executes during the build (they are committed without outputs), or copies
  already executed by the tests when ``CLIPJAX_EXECUTED_NOTEBOOKS`` names them;
* ``generated/*.md``: placeholders for the tables that ``make demo`` and
  ``examples/lm_spikes.py`` write, when those have not been generated.
"""

from __future__ import annotations

import inspect
import os
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent

# The checkout's clipjax, here and in the notebook kernels myst-nb starts.
sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p
)
os.environ.pop("MPLBACKEND", None)  # the kernel's inline backend: figures become outputs

import clipjax  # noqa: E402

project = "clipjax"
author = "The clipjax Authors"
copyright = "The clipjax Authors"
release = clipjax.__version__
version = release

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "sphinx.ext.mathjax",
    "sphinx.ext.viewcode",
]

exclude_patterns = [
    "_build",
    "jupyter_execute",
    "generated/*",  # included by the guides, not pages of their own
    "ecosystem.md",  # included section by section (see data_parallel.md, ...)
    "README.md",
]
suppress_warnings = [
    "myst.header",  # included sections start at ### under a page's # title
]

# -- Notebooks (myst-nb) ------------------------------------------------------
# "force" executes both notebooks on every build (about 30 s each on a CPU);
# NB_EXECUTION_MODE=cache reuses outputs while the notebook's code is unchanged.
nb_execution_mode = os.environ.get("NB_EXECUTION_MODE", "force")
# CLIPJAX_EXECUTED_NOTEBOOKS=folder: take the notebooks from there, already
# executed (`CLIPJAX_NOTEBOOK_OUT=folder make test` writes them), and do not run
# them again; .ci/run does this to save running them twice.
_executed = os.environ.get("CLIPJAX_EXECUTED_NOTEBOOKS")
EXECUTED = (ROOT / _executed) if _executed else None
nb_execution_excludepatterns: list[str] = []
nb_execution_timeout = 600
nb_execution_raise_on_error = True  # a failing cell fails the build
nb_execution_in_temp = True  # files the notebooks write go to a temporary folder
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_merge_streams = True
myst_enable_extensions = ["colon_fence", "dollarmath"]
myst_heading_anchors = 3

# -- API reference ------------------------------------------------------------
autosummary_generate = False  # api.rst documents every name on one page
autodoc_member_order = "bysource"
autodoc_preserve_defaults = True  # defaults as written: zstat_criterion(), not an object repr
autodoc_typehints = "signature"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_ivar = True  # NamedTuple "Attributes:" as fields, not duplicate attributes
napoleon_use_rtype = False

# Nitpicky (-n) for clipjax's own names. Without network access there is no
# intersphinx: names from jax, optax, numpy, typing and private clipjax modules
# in signatures are not linked.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|jaxlib|optax|chex|numpy|np|typing|collections|types|flax)(\..*)?"),
    (r"py:.*", r"(clipjax\.)?_[a-z_]+\..*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|NamedTuple|Literal|Optional|Union)"),
    (r"py:.*", r"(int|float|str|bool|dict|list|tuple|object|None|type|callable|function)"),
    (r"py:.*", r"(Array|ArrayLike|PyTree|Params|Updates|OptState|DTypeLike|KeyPath)"),
    (r"py:.*", r"optional"),
]

# -- HTML ---------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"clipjax {release}"
html_theme_options = {
    "repository_url": "https://github.com/clipjax/clipjax",
    "repository_branch": "main",
    "path_to_docs": "docs",
    "use_repository_button": True,
    "show_toc_level": 2,
}


def _api_page() -> str:
    """The reST source of the API reference: every name of ``clipjax.__all__``."""
    transforms, functions, classes, other = [], [], [], []
    for name in sorted(clipjax.__all__, key=str.lower):
        obj = getattr(clipjax, name)
        if inspect.isclass(obj):
            classes.append(name)
        elif callable(obj):
            try:
                returns = str(inspect.signature(obj).return_annotation)
            except (TypeError, ValueError):
                returns = ""
            (transforms if "Transform" in returns else functions).append(name)
        else:
            other.append(name)
    lines = [
        "API reference",
        "=============",
        "",
        ".. currentmodule:: clipjax",
        "",
        "Every public name of ``clipjax`` (``clipjax.__all__``), generated from the",
        "docstrings. Each transform returns an ``optax.GradientTransformation``; its",
        "metrics are read with :func:`clipjax.metrics`.",
        "",
    ]
    sections = [
        ("Transforms", "Factories of optax gradient transformations.", transforms, "autofunction"),
        ("Functions", "Metrics, norms, criteria and helpers.", functions, "autofunction"),
        ("Classes", "State and configuration types.", classes, "autoclass"),
        ("Other names", "", other, "autodata"),
    ]
    for title, about, names, directive in sections:
        if not names:
            continue
        lines += [title, "-" * len(title), "", about, ""]
        lines += [".. autosummary::", "   :nosignatures:", ""]
        lines += [f"   {name}" for name in names]
        lines.append("")
        for name in names:
            lines.append(f".. {directive}:: {name}")
            if directive == "autoclass":
                lines.append("   :members:")
            lines.append("")
    return "\n".join(lines)


def _write_if_changed(path: Path, text: str) -> None:
    # Unchanged text keeps the file's mtime, so Sphinx does not re-read it.
    if not path.exists() or path.read_text() != text:
        path.write_text(text)


PLACEHOLDERS = {
    "demo_table.md": (
        "*The effectiveness table is generated: run `make demo` "
        "(`python examples/demo.py`) to produce it.*\n"
    ),
    **{
        f"lm_spikes_{config}.md": (
            "*The language-model spike table is generated: run "
            f"`python examples/lm_spikes.py --config {config}` to produce it.*\n"
        )
        for config in ("cpu", "gpu")
    },
}


def _generate_sources() -> None:
    _write_if_changed(DOCS / "api.rst", _api_page())
    notebooks = DOCS / "notebooks"
    notebooks.mkdir(exist_ok=True)
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        target = notebooks / source.name
        if EXECUTED and (EXECUTED / source.name).exists():
            # Already executed by tests/test_notebooks.py in this run (CI): not again.
            source = EXECUTED / source.name
            nb_execution_excludepatterns.append(f"notebooks/{source.name}")
        if not target.exists() or target.read_bytes() != source.read_bytes():
            shutil.copy2(source, target)
    generated = DOCS / "generated"
    generated.mkdir(exist_ok=True)
    for name, text in PLACEHOLDERS.items():
        if not (generated / name).exists():
            (generated / name).write_text(text)


_generate_sources()


def _skip_namedtuple_fields(app, what, name, obj, skip, options):
    # NamedTuple fields are documented by the class's "Attributes:" section;
    # their own docstring is only "Alias for field number N".
    doc = getattr(obj, "__doc__", None) or ""
    if doc.startswith("Alias for field number"):
        return True
    return None


def _link_public_alias(app, env, node, contnode):
    # Annotations name a class where it is defined (clipjax._metrics.GroupInfo):
    # link them to the public name the API reference documents (clipjax.GroupInfo).
    match = re.fullmatch(r"(?:clipjax\.)?_\w+\.(\w+)", node.get("reftarget", ""))
    if node.get("refdomain") != "py" or not match or match.group(1) not in clipjax.__all__:
        return None
    target = f"clipjax.{match.group(1)}"
    return env.get_domain("py").resolve_xref(
        env, node["refdoc"], app.builder, node["reftype"], target, node, contnode
    )


def setup(app):
    app.connect("autodoc-skip-member", _skip_namedtuple_fields)
    app.connect("missing-reference", _link_public_alias)
