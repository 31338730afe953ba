"""Which tests are slow: `make test` runs `-m "not slow"`, `make test-all` and CI
everything. tests/conftest.py applies the lists below at collection
(:func:`pytest_collection_modifyitems`), and fails when an entry matches nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# `make test` runs `-m "not slow"` (a few minutes on 2 cores); `make test-all`
# and .ci/run run everything. A file that is slow as a whole says so itself
# (`pytestmark = pytest.mark.slow`, with the reason); the single slow tests and
# parametrizations are listed here, in one place. Measured one file at a time
# with `--durations`.
#
# Single tests (node id prefixes, relative to tests/), and why.
SLOW_TESTS = {
    # Starts a subprocess with 8 CPU devices.
    (
        "contract/test_compat.py::test_tree_map_params_derives_sharding_on_8_devices"
    ): "8-device subprocess",
    # Seven wrappers, each compiled twice (update and metrics), per clipper:
    # the heaviest clippers run here; the fast suite keeps the others
    # (global, per_param, per_layer, agc, adagc, the element-wise clippers)
    # and every wrapper.
    **{
        (
            f"contract/test_contract.py::test_metrics_found_in_every_wrapper[{name}]"
        ): "7 wrappers compiled"
        for name in (
            "autoclip",
            "autoclip_ema_per_param",
            "autoclip_window",
            "clip_by_percentile",
            "hist_clip",
            "hist_clip_ema_per_layer",
            "zscore_clip",
        )
    },
    # Accumulates over MultiSteps for many steps, compiled per clipper; the
    # contract tests keep MultiSteps (and every other wrapper) in the fast suite.
    (
        "contract/test_wrappers.py::"
        "test_multi_steps_clips_the_accumulated_gradient_once_per_real_step"
    ): ("long accumulation run"),
    # inject_hyperparams against the clipper rebuilt per value: the history
    # clippers compile the longest; the others stay in the fast suite.
    **{
        "contract/test_wrappers.py::"
        "test_inject_hyperparams_equals_the_clipper_built_with_those_values"
        f"[{name}]": "compiles per hyperparameter value"
        for name in ("autoclip", "autoclip_window")
    },
    # Hypothesis examples through autoclip's sorted history, one compile per
    # example shape; the other clippers' properties stay in the fast suite.
    (
        "contract/test_properties.py::"
        "test_dtype_preserved_and_unclipped_leaves_untouched[float32-autoclip]"
    ): ("50 hypothesis examples"),
    (
        "contract/test_properties.py::test_scale_threshold_identity[autoclip]"
    ): "50 hypothesis examples",
    (
        "contract/test_properties.py::test_scale_threshold_identity[autoclip_window]"
    ): "50 hypothesis examples",
    # Full flax training runs saved and resumed; the orbax standard
    # checkpointer round trip stays in the fast suite.
    (
        "contract/test_checkpoint.py::test_flax_serialization_resumes_bit_identically"
    ): "train, save, resume",
    (
        "contract/test_checkpoint.py::test_nnx_optimizer_orbax_resumes_bit_identically"
    ): "train, save, resume",
    # A linen TrainState training run per clipper; the nnx.Optimizer run per
    # clipper and the linen per-layer names test stay in the fast suite.
    (
        "contract/test_flax.py::test_linen_train_state_trains_with_every_clipper"
    ): "a training run per clipper",
}


def _cases(test: str, ids: str, reason: str) -> dict[str, str]:
    """SLOW_TESTS entries for some parametrizations of one test (ids space-separated)."""
    return {f"{test}[{case}]": reason for case in ids.split()}


# Parametrized tests whose other cases stay in the fast suite: every clipper
# and wrapper keeps at least one case there (`make test` measured 9 min on 2
# idle cores before these moved; `--durations=0` picked them). A case that
# shares its compiled functions with another saves little: the compile moves
# to whichever case runs first.
SLOW_TESTS.update(
    {
        # Every page's code blocks (102 s for all on 2 loaded cores): the pages
        # that train models; the fast suite keeps the other pages (about 50 s).
        # getting_started's cells also run in the docs build (myst-nb).
        **_cases(
            "docs/test_docs_code_blocks.py::test_page_code_blocks_run",
            "docs/qk_clip.md docs/flax.md docs/getting_started.md",
            "trains models (10-30 s a page)",
        ),
        **_cases(
            "contract/test_contract.py::test_metrics_found_in_every_wrapper",
            "zscore_normalize agc_per_layer agc zclip_per_param clip_by_value "
            "clip_by_global_norm_inf",
            "7 wrappers compiled",
        ),
        **_cases(
            "contract/test_bad_input.py::test_tree_map_params_keeps_names_and_metrics",
            "agc_unitwise autoclip_per_layer adagc clip_by_percentile hist_clip_nested "
            "zscore_normalize",
            "a chain mapped and compiled per kind",
        ),
        **_cases(
            "contract/test_flax.py::test_nnx_optimizer_trains_with_every_clipper",
            "hist_clip_ema_per_layer clip_by_percentile autoclip_window_per_layer agc_per_layer "
            "zscore_clip zclip_per_layer autoclip_ema clip_by_value",
            "a training run per clipper",
        ),
        **_cases(
            "contract/test_leaf_norms.py::test_leaf_norms_cost_no_second_pass",
            "autoclip_window_per_layer hist_clip_ema_per_layer adagc autoclip hist_clip "
            "clip_by_percentile agc_per_layer autoclip_ema zclip zscore_clip clip_by_value",
            "XLA cost analysis per clipper",
        ),
        **_cases(
            "contract/test_leaf_norms.py::test_leaf_norms_are_the_pre_clip_leaf_norms",
            "adagc autoclip_window_per_layer clip_by_percentile hist_clip_ema_per_layer "
            "autoclip agc_per_layer autoclip_ema zscore_clip clip_by_value",
            "compiled per clipper",
        ),
        **_cases(
            (
                "contract/test_wrappers.py::"
                "test_inject_hyperparams_equals_the_clipper_built_with_those_values"
            ),
            "hist_clip zscore_normalize autoclip_ema zscore_clip clip_by_value "
            "clip_by_percentile agc_per_layer normalize_per_param",
            "compiles per hyperparameter value",
        ),
        # Reference traces (torch and smartclip): each keeps two cases here.
        **_cases(
            "zclip/test_zclip.py::test_matches_zclip_step_by_step",
            "default-constant default-regime_shift "
            "clip_option=mean,max_grad_norm=5.0-regime_shift "
            "clip_option=mean,max_grad_norm=5.0-spikes "
            "clip_option=mean,max_grad_norm=5.0-constant "
            "skip_update_on_spike=True,max_grad_norm=None-spikes "
            "skip_update_on_spike=True,max_grad_norm=None-constant "
            "max_grad_norm=None-spikes max_grad_norm=None-constant "
            "mode=percentile,max_grad_norm=None-spikes mode=percentile,max_grad_norm=None-constant "
            "alpha=0.9,z_thresh=2.0,clip_factor=0.7,warmup_steps=5,max_grad_norm=None-regime_shift "
            "alpha=0.9,z_thresh=2.0,clip_factor=0.7,warmup_steps=5,max_grad_norm=None-constant",
            "reference trace",
        ),
        **_cases(
            "hist_clip/test_hist_clip.py::test_matches_drytorch_step_by_step",
            "zstat-max-constant ema-max-spikes ema-max-regime_shift zstat-max-regime_shift "
            "zstat-reciprocal-spikes ema-max-constant ema-reciprocal-constant "
            "zstat-mean-regime_shift ema-reciprocal-spikes zstat-mean-constant "
            "zstat-reciprocal-constant",
            "reference trace",
        ),
        **_cases(
            "autoclip/test_autoclip.py::test_window_percentile_matches_smartclip",
            "50-95.0-constant 1024-99.0-constant 1024-99.0-regime_shift 50-95.0-regime_shift "
            "7-50.0-constant 1-100.0-spikes 1-100.0-regime_shift 7-50.0-regime_shift",
            "reference trace",
        ),
        # float64 restatements: the fast suite keeps one case per behaviour.
        **_cases(
            "adaptive/test_feedback.py::test_scopes_match_per_group_restatement",
            "feedback-per_layer defaults-per_param feedback-per_param",
            "per-group restatement, many groups",
        ),
        **_cases(
            "skip_on_spike/test_skip_on_spike.py::test_decisions_match_the_float64_restatement",
            "shift-novalue-3-raw shift-value-3-skip nan_grad-novalue-None-skip "
            "shift-value-3-raw norm_spike-value-None-skip shift-novalue-3-skip "
            "nan_loss-value-None-skip clean-value-None-skip clean-value-None-raw "
            "nan_grad-novalue-None-raw nan_grad-value-None-raw both-value-None-raw "
            "burst-novalue-None-raw loss_spike-value-None-raw norm_spike-novalue-None-raw "
            "norm_spike-novalue-None-skip",
            "restatement step by step",
        ),
        **_cases(
            "adaptive/test_forgetting.py::test_auto_window_matches_restatement",
            "2-skip 16-skip 16-raw 2-clipped 16-clipped 2-observe_first 2-raw 16-observe_first",
            "restatement step by step",
        ),
        **_cases(
            "adaptive/test_forgetting.py::test_judge_first_gate_defaults_to_ten",
            "skip-autoclip raw-autoclip raw-zscore_clip skip-zscore_clip",
            "restatement step by step",
        ),
        **_cases(
            "autoclip/test_geometric_quantile.py::test_converges_to_the_true_quantile",
            "abs_normal-0.2 uniform-0.2 uniform-0.05 abs_normal-0.05 pareto-0.05 lognormal-0.2",
            "thousands of steps",
        ),
        # Per-clipper contract checks: the scoped variants of a clipper that
        # the fast suite runs at another scope.
        **{
            f"contract/test_contract.py::{test}[{case}]": "a scoped variant, compiled"
            for test in (
                "test_no_host_transfer_inside_update",
                "test_state_can_be_donated",
                "test_scan_carry_and_single_trace",
            )
            for case in (
                "hist_clip_ema_per_layer",
                "autoclip_window",
                "clip_by_global_norm_inf",
                "autoclip_ema_per_param",
                "agc_per_layer",
                "normalize_per_param",
                "zclip_per_param",
            )
        },
        **_cases(
            "adaptive/test_feedback.py::test_feedback_matches_restatement",
            "autoclip_geometric hist_ema zclip_cap zclip_mean zclip_percentile",
            "restatement step by step (a variant of a clipper kept here)",
        ),
        **_cases(
            "adaptive/test_feedback.py::test_spike_moves_threshold_no_more_than_its_clip_value",
            "hist_zstat zscore_clip",
            "restatement step by step",
        ),
        **_cases(
            (
                "adaptive/test_forgetting.py::"
                "test_judge_first_threshold_is_inf_before_first_observation"
            ),
            "autoclip_all-raw autoclip_all-skip autoclip_ema-raw autoclip_ema-skip "
            "autoclip_geometric-raw autoclip_geometric-skip autoclip_percentile-raw "
            "autoclip_percentile-skip autoclip_window-raw autoclip_window-skip "
            "zscore_clip-raw zscore_clip-skip",
            "one case per statistic kept (clipped)",
        ),
        **_cases(
            "elementwise/test_elementwise.py::test_clip_by_percentile_exact_matches_numpy",
            "global-5.0 per_param-10.0 per_param-100.0 per_param-95.0",
            "a percentile per case",
        ),
        **_cases(
            "adaptive/test_stats.py::test_state_structure_never_changes",
            "float64-ema float64-p2 float64-p2_smartclip float64-squantile float64-welford "
            "float64-window",
            "float64 variant of a float32 case",
        ),
        **_cases(
            "contract/test_bad_input.py::test_scope_callables_of_two_arguments_are_accepted",
            "adagc agc clip_by_percentile clip_by_value hist_clip zscore_clip",
            "compiled per clipper",
        ),
        **_cases(
            "zclip/test_nonfinite.py::test_nonfinite_step_reports_spike_boundary",
            "inf-1.05-percentile inf-1.05-zscore inf-100.0-percentile nan-100.0-zscore "
            "nan-1.05-percentile nan-100.0-percentile",
            "compiled per case",
        ),
        **{
            f"contract/test_compat.py::test_every_clipper_runs_on_every_leaf_kind[{name}-": (
                "a scoped variant, compiled per leaf kind"
            )
            for name in (
                "agc_per_layer",
                "autoclip_ema_per_param",
                "autoclip_window",
                "clip_by_global_norm_inf",
                "hist_clip_ema_per_layer",
                "normalize_per_param",
                "zclip_per_param",
            )
        },
        # Starts a subprocess with XLA:CPU kept off FMA instructions.
        (
            "skip_on_spike/test_fold.py::"
            "test_compiled_without_fma_skip_on_spike_is_optax_bit_for_bit"
        ): ("subprocess"),
        **_cases("agc/test_agc.py::test_agc_axis_matches_optax", "None", "a large unitwise tree"),
        **_cases(
            "agc/test_agc.py::test_unitwise_equals_optax", "0.001", "a long run against optax"
        ),
        **_cases(
            ("contract/test_grouping.py::test_many_groups_compile_like_one"),
            "per_param",
            "compiles twice",
        ),
    }
)

# SPAM / Stable-SPAM (tests/spam/ keeps their references and the fold in
# the fast suite): the scoped variants of adaclip and ada_norm, and
# stable_spam's chain of both, whose members the fast suite checks one by one.
SLOW_TESTS.update(
    {
        **{
            f"contract/test_contract.py::{test}[{case}]": "a scoped variant, compiled"
            for test in (
                "test_no_host_transfer_inside_update",
                "test_state_can_be_donated",
                "test_scan_carry_and_single_trace",
                "test_metrics_found_in_every_wrapper",
            )
            for case in ("adaclip_global", "ada_norm_per_layer")
        },
        **{
            f"contract/test_compat.py::test_every_clipper_runs_on_every_leaf_kind[{name}-": (
                "a scoped variant, compiled per leaf kind"
            )
            for name in ("adaclip_global", "ada_norm_per_layer")
        },
        "contract/test_contract.py::test_metrics_found_in_every_wrapper[stable_spam]": (
            "7 wrappers compiled, a chain of adaclip, ada_norm and Adam"
        ),
    }
)

# `make test` within 5 minutes from a fresh clone on 2 cores: the costliest
# cases of tests whose other cases stay in the fast suite, each clipper family
# keeping at least one (`--durations=0` of the fast suite picked them: about 80
# test-seconds of 620).
SLOW_TESTS.update(
    {
        **_cases(
            "contract/test_contract.py::test_metrics_found_in_every_wrapper",
            "stable_spam_uncounted spam adaclip",
            "7 wrappers compiled (ada_norm stays for the SPAM family)",
        ),
        **_cases(
            "contract/test_update_clipping.py::test_after_the_optimizer_it_clips_the_update",
            "agc clip_by_percentile autoclip",
            "a training run per clipper (agc_per_layer, clip_by_value, autoclip_ema stay)",
        ),
        **_cases(
            "contract/test_stacked.py::test_each_slice_is_the_unstacked_layer",
            "per_param-1-hist_clip per_param-1-hist_clip_ema per_param-1-adagc "
            "per_param-1-autoclip_window per_param-1-autoclip_ema per_param-1-zscore_clip "
            "per_param-1-agc_exclude_bias",
            "the per_layer case and per_param zclip and agc stay",
        ),
        **_cases(
            "contract/test_serialization.py::test_orbax_round_trip",
            "skip_on_spike_chain skip_on_spike_select skip_on_spike_cond hist_clip_ema_per_layer "
            "zclip_per_param clip_by_percentile autoclip_ema_per_param autoclip_window "
            "agc_per_layer ada_norm_per_layer zscore_normalize clip_by_global_norm_inf",
            "a round trip per state class stays (flax bytes keep every case)",
        ),
        **_cases(
            "spam/test_spam_pieces.py::test_update_if_skips_bit_identically_and_takes_as_update",
            "stable_spam",
            "spam stays; stable_spam's members are checked one by one",
        ),
        **_cases(
            "adaptive/test_feedback.py::test_scopes_match_per_group_restatement",
            "boundary-per_param",
            "the per_layer cases stay",
        ),
        "contract/test_stacked.py::test_flax_linen_nn_scan_model": (
            "a flax training run; the nnx scan model stays"
        ),
        **_cases(
            "skip_on_spike/test_dtypes.py::test_updates_and_state_keep_the_inner_optimizers_dtypes",
            " ".join(
                f"{route}-{dtypes}-mu_f32"
                for route in ("fold_clipjax_adamw", "cond_optax_adam", "cond_chain_zclip_adam")
                for dtypes in ("f32-f32", "f32-bf16", "bf16-f32")
            ),
            "mu_dtype float32 stays with bfloat16 params and gradients, on every route",
        ),
        **_cases(
            "contract/test_inject.py::test_injected_equals_the_factory_called_with_the_same_values",
            "hist_clip_zstat autoclip_percentile zclip_percentile",
            "a second mode of a clipper whose default mode stays",
        ),
        "contract/test_serialization.py::test_flax_imported_before_or_after_clipjax[before]": (
            "a subprocess; flax imported after clipjax stays"
        ),
    }
)

# Every contract test runs with and without jit (chex.variants). The fast
# suite keeps both for `state_is_stable_and_dtypes_kept` (every norm-based
# clipper and one of each other family, eagerly) and the jitted variant of the
# others; bfloat16 stands for the low-precision dtypes.
SLOW_PATTERNS = {
    # float16 as well as bfloat16: bfloat16 stays for every clipper.
    r"contract/test_contract\.py::TestContractWithAndWithoutJit::test_low_precision_leaves_keep_dtype_"
    r"(?!clip_by_global_norm_float16|zclip_float16|agc_float16).*_float16__with_jit$": (
        "float16 variant"
    ),
    r"contract/test_contract\.py::TestContractWithAndWithoutJit::"
    r"test_(?!state_is_stable_and_dtypes_kept_).*__without_jit$": "eager variant",
    # Eagerly, op by op, the SPAM family, the normalisers and the element-wise
    # clippers take seconds each: adaclip_global, ada_norm's, clip_by_value and
    # every norm-based clipper stay eager in the fast suite.
    r"contract/test_contract\.py::TestContractWithAndWithoutJit::test_state_is_stable_and_dtypes_kept_"
    r"(spam|stable_spam|stable_spam_uncounted|adaclip|ada_norm|zscore_normalize|agc|"
    r"clip_by_percentile)__without_jit$": "eager variant of an element-wise transform",
}

_TESTS_DIR = Path(__file__).parent


def _whole_files(config: pytest.Config) -> bool:
    """Whether this session collects whole files (no ``-k``, no ``file::test`` ids):
    then every entry above that names a collected file must match one of its tests."""
    return not config.getoption("keyword") and not any("::" in a for a in config.args)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Marks the long runs listed above ``slow``; fails when an entry names a file that
    does not exist, or a test that no longer exists (a moved or renamed test would
    otherwise silently lose its mark)."""
    matched: set[str] = set()
    files: set[str] = set()
    for item in items:
        try:
            relative = item.path.relative_to(_TESTS_DIR).as_posix()
        except ValueError:  # doctests under clipjax/
            continue
        files.add(relative)
        node = relative + "::" + item.nodeid.split("::", 1)[-1] if "::" in item.nodeid else relative
        hits = [prefix for prefix in SLOW_TESTS if node.startswith(prefix)]
        hits += [pattern for pattern in SLOW_PATTERNS if re.match(pattern, node)]
        if hits:
            item.add_marker(pytest.mark.slow)
            matched.update(hits)
    named = {entry: entry.split("::")[0] for entry in SLOW_TESTS}
    named.update({pattern: _pattern_file(pattern) for pattern in SLOW_PATTERNS})
    stale = [e for e, file in named.items() if not (_TESTS_DIR / file).is_file()]
    if _whole_files(config):
        stale += [e for e, file in named.items() if file in files and e not in matched]
    if stale:
        raise pytest.UsageError(
            "tests/slow_marks.py marks tests slow that no collected test matches (moved, renamed "
            "or removed? update the list): " + ", ".join(stale)
        )


def _pattern_file(pattern: str) -> str:
    """The file a SLOW_PATTERNS regex names (``contract/test_contract\\.py::...``)."""
    return pattern.split("::")[0].replace("\\.", ".")
