"""Every public clipjax transform as the tests build it: one registry, read two ways.

Each entry of :data:`CASES` is a :class:`Case`: a factory taking ``**kwargs``
(``name=``, ``axis_name=``, ``leaf_norms=``) forwarded to the transform, its
metrics prefix, a field every state of it records, how it names its groups and
whether it takes ``axis_name=``. Two selections read the same entries:

* :data:`TRANSFORM_IDS`, :data:`OPTIMIZER_IDS` and the monitors (together :data:`ALL_IDS`): the
  contract, every public transform once per layout of its state
  (``tests/contract/test_contract.py``, ``test_compat.py``,
  ``test_serialization.py``, ``test_bad_input.py``);
* :data:`CLIPPER_IDS`: the clippers configured to act within a few steps of the
  small MLP of ``tests/model.py`` (warm-ups of 3 steps, thresholds it
  crosses), for the tests that train: flax, checkpoints, optax's wrappers, the
  update clip and the data-parallel runs. :data:`AXIS_IDS` are those of them
  that take ``axis_name=``, and ``ada_norm``.

An entry in both selections is one configuration: the contract checks the
clipper the training tests train with. The training tests build their optimizers
here too: :func:`all_clippers` (every training clipper in one compiled program,
:func:`fan_out`) and :func:`optimizer` (a clipper, then momentum SGD).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import optax

import clipjax

Factory = Callable[..., optax.GradientTransformation]


class Case(NamedTuple):
    """A transform configuration.

    Attributes:
      make: ``(**kwargs) -> transform``; kwargs (``name=``, ``axis_name=``,
        ``leaf_norms=``) go to the transform.
      algo: its metrics prefix.
      field: a metric field every state of it records.
      scope: ``"global"``, ``"per_layer"`` or ``"per_param"``: how it names groups.
      axis_name: whether the data-parallel tests give it ``axis_name=`` (the
        norm-based clippers).
    """

    make: Factory
    algo: str
    field: str
    scope: str = "global"
    axis_name: bool = True


def _case(
    factory: Factory,
    *args: Any,
    field: str,
    groups: str | None = None,
    axis_name: bool | None = None,
    algo: str | None = None,
    **config: Any,
) -> Case:
    """A :class:`Case` of ``factory(*args, **config)``.

    ``groups`` (its :attr:`Case.scope`) defaults to ``config["scope"]``, else the
    factory's default scope (``"unitwise"`` names a group per parameter, as
    ``"per_param"``); ``axis_name`` to whether the factory takes one; ``algo`` to
    the factory's name.
    """
    parameters = inspect.signature(factory).parameters
    if groups is None:
        groups = config.get("scope", parameters["scope"].default)
    return Case(
        functools.partial(factory, *args, **config),
        algo or factory.__name__,
        field,
        "per_param" if groups == "unitwise" else groups,
        "axis_name" in parameters if axis_name is None else axis_name,
    )


WARM = dict(warmup_steps=3, min_history=3)  # past their warm-up within a few steps

# The contract's and the training tests' (configured to act within a few steps).
_BOTH = {
    "clip_by_global_norm": _case(clipjax.clip_by_global_norm, 1.0, field="scale", groups="global"),
    "zclip": _case(clipjax.zclip, field="threshold", warmup_steps=3),
    "hist_clip": _case(clipjax.hist_clip, field="threshold", warmup_steps=3),
    "hist_clip_ema_per_layer": _case(
        clipjax.hist_clip,
        clipjax.ema_criterion(),
        field="mean",
        warmup_steps=3,
        scope="per_layer",
    ),
    # unitwise, one group per parameter: no axis_name in the data-parallel tests.
    "agc": _case(clipjax.agc, field="target", axis_name=False, clipping=0.05),
    "agc_per_layer": _case(clipjax.agc, field="weight_norm", clipping=0.05, scope="per_layer"),
    "clip_by_historical_norm": _case(clipjax.clip_by_historical_norm, 4, field="std"),
    "autoclip": _case(clipjax.autoclip, field="median", **WARM),
    "zscore_clip": _case(clipjax.zscore_clip, field="std", **WARM),
    "clip_by_value": _case(clipjax.clip_by_value, 0.05, field="clipped_fraction"),
    "clip_by_percentile": _case(clipjax.clip_by_percentile, 90.0, field="bound"),
}
# The training tests' only: other scopes and histories.
_TRAINING = {
    "zclip_per_layer": _case(clipjax.zclip, field="threshold", warmup_steps=3, scope="per_layer"),
    "clip_norm_growth_per_layer": _case(
        clipjax.clip_norm_growth, field="prev_norm", mul=1.2, scope="per_layer"
    ),
    "autoclip_window_per_layer": _case(
        clipjax.autoclip,
        field="quantile",
        scope="per_layer",
        **WARM,
        mode="percentile",
        percentile=80.0,
        window_size=4,
    ),
    "autoclip_ema": _case(
        clipjax.autoclip, field="quantile", mode="percentile", history="ema", ema_decay=0.9, **WARM
    ),
}
# The contract's only: the other clippers, norm types, scopes and histories.
_CONTRACT = {
    # SPECTRA clips the MLP's 2-D kernels by their singular values, its biases by norm.
    "spectra": _case(clipjax.spectra, 0.05, field="sigma_bound", groups="global", apply_to="all"),
    # Spectral gradient clipping: a group per matrix (and vector), named as the leaves.
    "spectral_clip": _case(
        clipjax.spectral_clip, field="sigma_max", groups="per_param", rule="ema", factor=1.05
    ),
    "clip_by_global_norm_inf": _case(
        clipjax.clip_by_global_norm, 1.0, field="grad_norm", groups="global", norm_type=float("inf")
    ),
    "zclip_per_param": _case(clipjax.zclip, field="z", warmup_steps=2, scope="per_param"),
    "adagc": _case(clipjax.adagc, field="threshold", warmup_steps=2),
    "adaclip": _case(clipjax.adaclip, 0.9, field="clipped_fraction"),
    "adaclip_global": _case(clipjax.adaclip, field="bound", scope="global", count_clipped=False),
    "ada_norm": _case(clipjax.ada_norm, field="target_norm"),
    "ada_norm_per_layer": _case(clipjax.ada_norm, field="mean", scope="per_layer"),
    "clip_norm_growth": _case(clipjax.clip_norm_growth, field="prev_norm"),
    "autoclip_window": _case(
        clipjax.autoclip,
        field="quantile",
        mode="percentile",
        window_size=4,
        warmup_steps=2,
        min_history=2,
    ),
    "autoclip_ema_per_param": _case(
        clipjax.autoclip, field="quantile", mode="percentile", history="ema", scope="per_param"
    ),
    "normalize_per_param": _case(
        clipjax.normalize_per_param, field="grad_norm", groups="per_param"
    ),
    "zscore_normalize": _case(clipjax.zscore_normalize, field="grad_norm", groups="per_param"),
}
# Whole optimizers (full-size moments in their states): the contract's; test_compat.py
# checks clippers only.
_OPTIMIZERS = {
    "spam": _case(
        clipjax.spam,
        1e-2,
        field="resets",
        groups="global",
        reset_interval=4,
        warmup_steps=2,
        clip_delay=1,
    ),
    "stable_spam": _case(clipjax.stable_spam, 1e-2, field="resets", reset_interval=4),
    "stable_spam_uncounted": _case(
        clipjax.stable_spam, 1e-2, field="resets", reset_interval=4, count_clipped=False
    ),
    # A clipper whose state holds a full-size EMA of the updates; AdamWClip; AXLearn's
    # skip-and-clip around adamw.
    "clip_norm_by_ema": _case(clipjax.clip_norm_by_ema, field="ema_norm"),
    "adamw_clip": _case(
        clipjax.adamw,
        1e-2,
        field="clipped_fraction",
        groups="per_param",
        algo="adamw_clip",
        clip_grad_adapt=1.0,
    ),
    "skip_and_clip": _case(
        clipjax.skip_and_clip_by_global_norm,
        clipjax.adamw(1e-2),
        field="count_exceeds_5x_mean",
        groups="global",
        drop_norm=clipjax.drop_norm_by_grad_norm_ema((5,)),
        max_norm=1.0,
        grad_norm_ema_decay=0.9,
    ),
}

# Neither clipper nor optimizer: the contract's, but not test_compat.py's (clippers
# only); its scores read NaN until its windows fill.
_MONITORS = {
    "stability_monitor": _case(
        clipjax.stability_monitor,
        field="spike_score",
        groups="global",
        window_size=3,
        rolling_window=5,
    ),
}

CASES: dict[str, Case] = {**_BOTH, **_TRAINING, **_CONTRACT, **_OPTIMIZERS, **_MONITORS}

TRANSFORM_IDS = sorted([*_BOTH, *_CONTRACT])
OPTIMIZER_IDS = sorted(_OPTIMIZERS)
ALL_IDS = sorted(TRANSFORM_IDS + OPTIMIZER_IDS + sorted(_MONITORS))
# Transforms whose metrics hold no gradient norm (spam reports its clip per element).
NORMLESS = {"spam"}

CLIPPER_IDS = sorted([*_BOTH, *_TRAINING])
# ada_norm rescales every group to a norm of its own statistics: the norm clipper
# whose per-device gradients drift furthest apart without axis_name.
AXIS_IDS = sorted([*(n for n in CLIPPER_IDS if CASES[n].axis_name), "ada_norm_per_layer"])


def fan_out(transforms: dict[str, optax.GradientTransformation]) -> optax.GradientTransformation:
    """Runs every transform on the same updates and returns the average of their outputs.

    A test harness: one compiled program exercises every clipper on the same
    gradients (compiling one program per clipper and per parallel mode would
    dominate the suite's time), and each clipper's output enters the updates.
    The state is ``{name: state}``.
    """
    names = sorted(transforms)

    def init_fn(params: Any) -> dict[str, Any]:
        return {n: transforms[n].init(params) for n in names}

    def update_fn(updates: Any, state: Any, params: Any = None, **extra: Any) -> Any:
        outs, new_state = [], {}
        for n in names:
            out, new_state[n] = transforms[n].update(updates, state[n], params)
            outs.append(out)
        return jax.tree.map(lambda *xs: sum(xs) / len(xs), *outs), new_state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def all_clippers(names: Any = None, **kwargs: Any) -> optax.GradientTransformation:
    """:func:`fan_out` over ``names`` (default :data:`CLIPPER_IDS`), each named after its case."""
    names = CLIPPER_IDS if names is None else names
    return fan_out({n: CASES[n].make(name=n, **kwargs) for n in names})


def optimizer(
    clipper: Case | optax.GradientTransformation, **kwargs: Any
) -> optax.GradientTransformation:
    """``chain(clipper, sgd with momentum)``: the optimizer the training tests use.

    Not adam: adam divides each element by its own magnitude, which turns the
    last-bit differences of a data-parallel gradient reduction in near-zero
    elements into visible differences of the updates; momentum SGD is linear,
    so the updates are as close as the gradients.
    """
    if isinstance(clipper, Case):
        clipper = clipper.make(**kwargs)
    return optax.chain(clipper, optax.sgd(0.05, momentum=0.9))


def clipjax_states(opt_state: Any) -> list[Any]:
    """The clipjax states inside an optax state, in tree order."""
    from clipjax import _metrics

    return [
        x
        for x in jax.tree_util.tree_leaves(opt_state, is_leaf=_metrics.is_clipjax_state)
        if _metrics.is_clipjax_state(x)
    ]
