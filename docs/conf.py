"""Sphinx configuration of the clipjax documentation (``make docs``).

Before Sphinx reads the sources, this file generates what is not committed:

* ``api.rst`` and ``api/*.rst``: the API reference, every name of
  ``clipjax.__all__`` on one of a few pages (clippers, wrappers, static
  transforms, metrics, states and types); a new public name lands on a page by
  its kind without editing the docs;
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
    "sphinx.ext.intersphinx",
    "sphinx_copybutton",
]

exclude_patterns = [
    "_build",
    "jupyter_execute",
    "generated/*",  # included by the guides, not pages of their own
    "generated/**",  # and the pages of other runs (generated/spectral/), cited by the guides
    "README.md",
    "api/.gitignore",
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

# -- Links to optax, jax, numpy, flax (intersphinx) ----------------------------
# Their inventories are fetched from the web, and a fetch that fails is a
# warning, which -W turns into an error: the build machine and CI have no
# internet access beyond the package index, and the packages do not ship their
# objects.inv. So the links are opt-in: CLIPJAX_INTERSPHINX=1 make docs on a
# machine with network access links optax, jax, numpy and flax names; without
# it, those names are shown unlinked (nitpick_ignore_regex below).
intersphinx_mapping = {}
if os.environ.get("CLIPJAX_INTERSPHINX") == "1":
    intersphinx_mapping = {
        "python": ("https://docs.python.org/3", None),
        "numpy": ("https://numpy.org/doc/stable", None),
        "jax": ("https://docs.jax.dev/en/latest", None),
        "optax": ("https://optax.readthedocs.io/en/latest", None),
        "flax": ("https://flax.readthedocs.io/en/latest", None),
    }
intersphinx_timeout = 30

# Nitpicky (-n) for clipjax's own names. Names from jax, optax, numpy, typing
# and private clipjax modules that intersphinx (off by default, above) does not
# resolve stay unlinked without a warning.
nitpick_ignore_regex = [
    (r"py:.*", r"(jax|jnp|jaxlib|optax|chex|numpy|np|typing|collections|types|flax)(\..*)?"),
    (r"py:.*", r"(clipjax\.)?_[a-z_]+\..*"),
    (r"py:.*", r"(Any|Callable|Sequence|Mapping|Iterable|NamedTuple|Literal|Optional|Union)"),
    (r"py:.*", r"(int|float|str|bool|dict|list|tuple|object|None|type|callable|function)"),
    (r"py:.*", r"(Array|ArrayLike|PyTree|Params|Updates|OptState|DTypeLike|KeyPath)"),
    (r"py:.*", r"optional"),
    # ActivationStats.layout's class: static, internal (its fields are documented there).
    (r"py:class", r"StatsLayout"),
]

# -- HTML ---------------------------------------------------------------------
html_theme = "sphinx_book_theme"
html_title = f"clipjax {release}"
html_theme_options = {
    # No repository, issue or edit buttons: there is no public repository yet.
    "show_toc_level": 2,
    # One search box (the sidebar's): no second one in the header.
    "navbar_persistent": [],
}
# Quotes stay as written: a setting in plain text (`autoclip(feedback="clipped")`
# in a generated page's list) must paste as code, not with curly quotes.
smartquotes = False

html_static_path = ["_static"]
html_css_files = ["clipjax.css"]  # wrap long code lines; hide the header search button

# Copy buttons copy the code only: no ">>> ", "... " or "$ " prompts, no output.
copybutton_prompt_text = r">>> |\.\.\. |\$ "
copybutton_prompt_is_regexp = True
copybutton_only_copy_prompt_lines = False


# The reference pages and the public names on each, in reading order. A public
# name not listed here lands on a page by its kind (_page_of), so a new name
# always appears.
API_PAGES = {
    "clippers": (
        "Clippers",
        "The adaptive clippers and AGC: each learns or computes its threshold "
        "from the gradients, and records its metrics in its state.",
        [
            ("Adaptive clippers", ["autoclip", "zscore_clip", "zclip", "hist_clip", "adagc"]),
            ("Adaptive gradient clipping", ["agc"]),
            ("Stable-SPAM's AdaClip and AdaGN", ["adaclip", "ada_norm"]),
            (
                "Growth-capped and historical clippers (torchzero, Levanter)",
                ["clip_norm_growth", "clip_norm_by_ema", "clip_by_historical_norm"],
            ),
            (
                "QK-Clip: attention weights after the optimizer",
                ["qk_clip", "QKHeads", "max_attention_logits"],
            ),
            (
                "Activation-gradient clipping: a function the model applies (AXLearn)",
                [
                    "clip_activation_gradient",
                    "activation_stats_init",
                    "activation_metrics",
                    "ActivationStats",
                    "linen_activation_clip",
                    "nnx_activation_clip",
                ],
            ),
            ("SPECTRA: spectral clipping of the update", ["spectra"]),
            (
                "hist_clip criteria and clip functions",
                [
                    "zstat_criterion",
                    "ema_criterion",
                    "Criterion",
                    "max_clipping",
                    "mean_clipping",
                    "reciprocal_clipping",
                ],
            ),
        ],
    ),
    "wrappers": (
        "Wrappers",
        "Transforms that wrap a whole optimizer.",
        [
            ("Skipping steps", ["skip_on_spike"]),
            (
                "AXLearn's skip-and-clip",
                [
                    "skip_and_clip_by_global_norm",
                    "drop_norm_by_grad_norm_ema",
                    "drop_norm_by_grad_norm_stddev",
                ],
            ),
            ("Optimizers that skip without a conditional", ["adam", "adamw", "chain"]),
            ("Spike-aware optimizers (SPAM, Stable-SPAM)", ["spam", "stable_spam"]),
            ("StableAdamW's update clipping", ["UpdateClippingState"]),
        ],
    ),
    "static": (
        "Static transforms",
        "Fixed-threshold clipping and normalisation, with the same metrics in state "
        "as the adaptive clippers.",
        [
            ("Norm clipping", ["clip_by_global_norm"]),
            ("Element-wise clipping", ["clip_by_value", "clip_by_percentile"]),
            ("Normalisation", ["normalize_per_param", "zscore_normalize"]),
        ],
    ),
    "metrics": (
        "Metrics and helpers",
        "Reading the metrics, and the functions the clippers are built from.",
        [
            ("Metrics", ["metrics", "GroupInfo"]),
            ("A stability score (OLMo-core's spike score)", ["stability_monitor"]),
            ("Norms, group names and scopes", ["global_norm", "path_name", "stacked"]),
            ("Percentiles", ["exact_percentile", "approx_percentile", "approx_relative_error"]),
        ],
    ),
    "states": (
        "States and types",
        "The transform types clipjax returns, and the state of each transform. "
        "States are NamedTuples of arrays with a fixed structure; read their metrics "
        "with :func:`clipjax.metrics`.",
        [("Transform types", ["ClipTransform", "SkippableTransform"]), ("States", [])],
    ),
}


def _page_of(name: str) -> tuple[str, int]:
    """The (page, section index) of a public name not listed in ``API_PAGES``."""
    obj = getattr(clipjax, name)
    if inspect.isclass(obj):
        return ("states", 1) if name.endswith("State") else ("metrics", 0)
    try:
        returns = str(inspect.signature(obj).return_annotation)
    except (TypeError, ValueError):
        returns = ""
    return ("clippers", 0) if "Transform" in returns else ("metrics", 1)


def _api_layout() -> dict[str, tuple[str, str, list[tuple[str, list[str]]]]]:
    """``API_PAGES`` completed with every public name it does not list."""
    layout = {
        page: (title, about, [(heading, list(names)) for heading, names in sections])
        for page, (title, about, sections) in API_PAGES.items()
    }
    listed = {name for _, _, sections in layout.values() for _, names in sections for name in names}
    for name in sorted(set(clipjax.__all__) - listed, key=str.lower):
        page, section = _page_of(name)
        layout[page][2][section][1].append(name)
    return layout


def _directive(name: str) -> list[str]:
    if inspect.isclass(getattr(clipjax, name)):
        return [f".. autoclass:: {name}", "   :members:", ""]
    if callable(getattr(clipjax, name)):
        return [f".. autofunction:: {name}", ""]
    return [f".. autodata:: {name}", ""]


def _api_sources() -> dict[str, str]:
    """reST sources of the API reference: ``api`` (the index) and ``api/<page>``."""
    layout = _api_layout()
    index = [
        "API reference",
        "=============",
        "",
        ".. currentmodule:: clipjax",
        "",
        "Every public name of ``clipjax`` (``clipjax.__all__``), generated from the",
        "docstrings. Every clipper returns a :class:`clipjax.ClipTransform`, an optax",
        "gradient transformation; its metrics are read with :func:`clipjax.metrics`.",
        "",
        ".. toctree::",
        "   :maxdepth: 1",
        "",
        *(f"   api/{page}" for page in layout),
        "",
    ]
    pages = {}
    for page, (title, about, sections) in layout.items():
        index += [
            title,
            "-" * len(title),
            "",
            about,
            "",
            ".. autosummary::",
            "   :nosignatures:",
            "",
        ]
        index += [f"   {name}" for _, names in sections for name in names]
        index.append("")
        lines = [title, "=" * len(title), "", ".. currentmodule:: clipjax", "", about, ""]
        for heading, names in sections:
            if not names:
                continue
            lines += [heading, "-" * len(heading), ""]
            for name in names:
                lines += _directive(name)
        pages[f"api/{page}.rst"] = "\n".join(lines)
    return {"api.rst": "\n".join(index), **pages}


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
    (DOCS / "api").mkdir(exist_ok=True)
    _write_if_changed(DOCS / "api" / ".gitignore", "# Generated by docs/conf.py.\n*\n")
    for relative, text in _api_sources().items():
        _write_if_changed(DOCS / relative, text)
    notebooks = DOCS / "notebooks"
    notebooks.mkdir(exist_ok=True)
    for source in sorted((ROOT / "notebooks").glob("*.ipynb")):
        target = notebooks / source.name
        if EXECUTED and (EXECUTED / source.name).exists():
            # Already executed by tests/release/test_notebooks.py in this run (CI): not again.
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
