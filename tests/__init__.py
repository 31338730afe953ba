"""clipjax's tests, a package: helpers are imported from it (``from tests import drive``).

One folder per clipper, holding that clipper's own tests (reference traces,
restatements, its fixes, bad input): ``zclip/``, ``autoclip/``, ``zscore_clip/``,
``hist_clip/``, ``adagc/``, ``agc/``, ``static/``, ``elementwise/``, ``percentile/``,
``spam/``, ``skip_on_spike/``, ``qk_clip/``, ``skip_and_clip/``, ``growth_clip/``,
``adamwclip/``, ``historical_clip/``. ``contract/`` runs every public transform through
the same checks and inside optax's and flax's machinery; ``adaptive/`` follows runs
(float64 restatements step by step, streaming statistics, recorded runs); ``docs/``
the guides; ``release/`` the examples, notebooks, benchmarks, wheel and version;
``parallel/`` and ``multiprocess/`` several devices and processes.

Helpers: ``registry`` (every public transform as the tests build it, one entry per
configuration, read by the contract and by the training tests), ``model`` (the
parameter trees, data and gradients the tests feed), ``trees`` (comparing two runs'
trees), ``drive`` (a transform run over a sequence of norms), ``references/`` (the
reference packages driven on a norm sequence), ``restate/`` (float64 NumPy
restatements of clipjax's rules), ``compiled_step``, ``skip_streams``, ``scripts``
(the examples, and code in a fresh interpreter), ``paths``; ``parallel/reference``
(what the 8-device tests compare with). ``conftest.py`` holds the shared fixtures;
``slow_marks.py`` the lists of slow tests.
"""
