"""clipjax's tests, a package: helpers are imported from it (``from tests import drive``).

One folder per clipper (``zclip/``, ``autoclip/``, ``zscore_clip/``, ``hist_clip/``,
``adagc/``, ``agc/``, ``static/``, ``elementwise/``, ``percentile/``, ``spam/``,
``skip_on_spike/``); ``contract/`` checks every public transform against the same
contract and inside optax's and flax's machinery; ``adaptive/`` follows runs (float64
restatements step by step, streaming statistics, recorded runs); ``docs/`` the guides;
``release/`` the examples, notebooks, benchmarks, wheel and version; ``parallel/`` and
``multiprocess/`` several devices and processes.

Helpers: ``references/`` (the reference packages driven on a norm sequence),
``restate/`` (float64 NumPy restatements of clipjax's rules), ``drive``,
``transforms`` and ``cases`` (every public transform / clipper as the cross-cutting
tests build it), ``compiled_step``, ``skip_streams``, ``scripts`` (the examples, run or
imported), ``paths``. ``conftest.py``
holds the shared fixtures and the lists of slow tests.
"""
