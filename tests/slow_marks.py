"""Which tests are slow: `make test` runs `-m "not slow"`, `make test-all` and CI
everything. tests/conftest.py applies the lists below at collection
(:func:`pytest_collection_modifyitems`), and fails when an entry matches nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# `make test` runs `-m "not slow"`: about 3 minutes on 2 cores, so that it
# takes at most 5 from a fresh clone, install included (issue 51); `make
# test-all` and .ci/run run everything. A file that is slow as a whole says so
# itself (`pytestmark = pytest.mark.slow`, with the reason); the single slow
# tests and parametrizations are listed here, in one place. Picked from the
# fast suite's `--durations=0`: a case that shares its compiled functions with
# another saves little (the compile moves to whichever case runs first).
#
# Single tests (node id prefixes, relative to tests/), and why.
SLOW_TESTS = {
    # Starts a subprocess with 8 CPU devices.
    (
        "contract/test_compat.py::test_tree_map_params_derives_sharding_on_8_devices"
    ): "8-device subprocess",
    # Accumulates over MultiSteps for many steps, compiled per clipper; the
    # contract tests keep MultiSteps (and every other wrapper) in the fast suite.
    (
        "contract/test_wrappers.py::"
        "test_multi_steps_clips_the_accumulated_gradient_once_per_real_step"
    ): ("long accumulation run"),
    # Full flax training runs saved and resumed; the orbax checkpointers' round
    # trips stay in the fast suite.
    (
        "contract/test_checkpoint.py::test_flax_serialization_resumes_bit_identically"
    ): "train, save, resume",
    (
        "contract/test_checkpoint.py::test_nnx_optimizer_orbax_resumes_bit_identically"
    ): "train, save, resume",
    # A linen TrainState training run per clipper; the nnx.Optimizer run and the
    # linen per-layer names test stay in the fast suite.
    (
        "contract/test_flax.py::test_linen_train_state_trains_with_every_clipper"
    ): "a training run per clipper",
    # Starts a subprocess with XLA:CPU kept off FMA instructions.
    (
        "skip_on_spike/test_fold.py::test_compiled_without_fma_skip_on_spike_is_optax_bit_for_bit"
    ): "subprocess",
    "contract/test_stacked.py::test_flax_linen_nn_scan_model": "a flax training run",
}


def _cases(test: str, ids: str, reason: str) -> dict[str, str]:
    """SLOW_TESTS entries for some parametrizations of one test (ids space-separated)."""
    return {f"{test}[{case}]": reason for case in ids.split()}


def _all_but(test: str, keep: str | tuple[str, ...], reason: str) -> dict[str, str]:
    """A SLOW_PATTERNS entry: every parametrization of one test but those named in
    ``keep`` (ids space-separated, or a tuple of ids), which stay in the fast suite.
    A kept id also keeps the ids it begins, followed by ``-`` (``zclip`` keeps
    ``zclip-complex``, not ``zclip_per_param``)."""
    ids = keep.split() if isinstance(keep, str) else keep
    kept = "|".join(re.escape(case) for case in ids)
    return {rf"{re.escape(test)}\[(?!(?:{kept})[\]-])": reason}


# Parametrized tests whose other cases stay in the fast suite.
SLOW_TESTS.update(
    {
        **_cases(
            "elementwise/test_elementwise.py::test_clip_by_percentile_exact_matches_numpy",
            "global-5.0 per_param-10.0 per_param-100.0 per_param-95.0",
            "a percentile per case",
        ),
        **_cases(
            "zclip/test_nonfinite.py::test_nonfinite_step_reports_spike_boundary",
            "inf-1.05-percentile inf-1.05-zscore inf-100.0-percentile nan-100.0-zscore "
            "nan-1.05-percentile nan-100.0-percentile",
            "compiled per case",
        ),
    }
)

# The torch references (zclip, drytorch, pytorch-optimizer, torch-optimi,
# adamwclip) are installed for `make test-all` only (.venv/.installed-references):
# every test that runs one is slow, so that `make test` leaves it out instead of
# skipping it. tests/zclip/test_zclip.py and tests/spam/test_stable_adamw.py are
# slow as files; smartclip (pure Python, no torch) stays in `make test`.
SLOW_TESTS.update(
    {
        test: "runs a torch reference (make test-all installs it)"
        for test in (
            "adamwclip/test_adamwclip.py::test_trace_equals_the_package",
            "adamwclip/test_adamwclip.py::"
            "test_a_later_warm_up_and_a_threshold_floor_equal_the_package",
            "adamwclip/test_adamwclip.py::"
            "test_fix_the_package_clips_its_first_steps_to_clip_grad_min",
            "elementwise/test_elementwise.py::test_normalisers_match_drytorch",
            "hist_clip/test_hist_clip.py::test_matches_drytorch_step_by_step",
            "hist_clip/test_hist_clip.py::test_per_param_is_param_hist_clipper",
            "hist_clip/test_hist_clip.py::test_no_warmup_clip_and_short_warmup",
            "hist_clip/test_hist_clip.py::test_ema_mean_clipping_fix",
            "spam/test_spam.py::test_spam_matches_pytorch_optimizer",
            "spam/test_spam.py::test_spam_metrics_say_what_the_step_did",
            "spam/test_spam.py::test_spam_nan_element_is_fixed_and_the_rest_matches",
            "spam/test_spam.py::test_spam_zero_second_moment_is_not_clipped_to_zero",
            "spam/test_spam.py::test_stable_spam_matches_pytorch_optimizer",
            "spam/test_spam.py::test_a_nan_step_around_skip_on_spike_is_the_reference_without_it",
            "spam/test_spam.py::test_stable_spam_nan_keeps_every_statistic_finite",
            "spam/test_spam.py::test_the_restatements_are_the_references_without_nan",
            "spam/test_spam.py::test_spam_weight_decay_maps_exactly_onto_the_reference",
        )
    }
)

# `make test` within 5 minutes (issue 51): whole tests that run long traces,
# training runs, sweeps, hypothesis examples, subprocesses, XLA cost analyses,
# or a property another fast test checks through another helper (the reason
# names what stays in the fast suite where it is not plain).
SLOW_TESTS.update(
    {
        "adagc/test_adagc.py::test_axis_name_replicas_use_averaged_group_norms": (
            "vmapped replicas; tests/adaptive keeps zclip's axis_name run"
        ),
        "adagc/test_adagc.py::test_callable_scope_matches_restatement": (
            "restatement step by step; the named scopes stay"
        ),
        "adagc/test_adagc.py::test_chain_with_adam_jit_and_scan": (
            "a scan of a chain; the registry's contract checks adagc jitted"
        ),
        (
            "adamwclip/test_adamwclip.py::"
            "test_skip_on_spike_folds_it_with_no_conditional_and_no_copy"
        ): "HLO of the donated step (test_fold keeps adamw's)",
        "adamwclip/test_adamwclip.py::test_update_if_skips_bit_identically_and_takes_as_update": (
            "the fold's update_if, run per optimizer (test_fold keeps adam's)"
        ),
        "adaptive/test_feedback.py::test_ema_percentile_judge_first_is_observe_first_shifted": (
            "two traces compared step by step"
        ),
        "adaptive/test_feedback.py::test_scopes_match_per_group_restatement": (
            "per-group restatement step by step; the global restatements stay"
        ),
        "adaptive/test_feedback.py::test_spike_moves_threshold_no_more_than_its_clip_value": (
            "restatement step by step; feedback_matches_restatement stays"
        ),
        "adaptive/test_follow.py::test_a_ceiling_is_judged_on_the_scaled_grid": (
            "a run per clipper; required_settings_follow_a_run stays"
        ),
        "adaptive/test_follow.py::test_a_relative_ceiling_is_judged_on_the_grid_itself": (
            "a run per grid point; required_settings_follow_a_run stays"
        ),
        "adaptive/test_follow.py::test_adagc_follows_a_rise_at_most_point_one_percent_a_step": (
            "a long run; adagc's restatements stay (tests/adagc)"
        ),
        "adaptive/test_follow.py::test_whole_history_autoclip_lets_spikes_through_after_a_drop": (
            "a long run"
        ),
        "adaptive/test_forgetting.py::test_judge_first_gate_defaults_to_ten": (
            "restatement step by step"
        ),
        "adaptive/test_forgetting.py::test_window_follows_a_noisy_shift_as_restated": (
            "restatement step by step; auto_window_matches_restatement stays"
        ),
        (
            "adaptive/test_forgetting.py::"
            "test_window_median_follows_a_noise_free_shift_in_half_a_window"
        ): "a run per shift",
        "adaptive/test_replay.py::test_an_absolute_ceiling_protects_at_one_scale_only": (
            "a run per scale"
        ),
        (
            "adaptive/test_replay.py::"
            "test_the_recommended_setting_holds_every_step_of_a_synthetic_start"
        ): "a long synthetic start; the recorded replay stays",
        "adaptive/test_replay.py::test_the_same_protection_at_every_scale": (
            "a sweep over scales; the recording's transient and reference bound stay"
        ),
        (
            "adaptive/test_replay.py::"
            "test_without_a_ceiling_the_transient_stays_in_adams_second_moment"
        ): "Adam over the recorded start, per setting; the recording's transient stays",
        "adaptive/test_stats.py::test_p2_textbook_tracks_true_median": "a long stream",
        "adaptive/test_stats.py::test_squantile_converges_on_stationary_streams": "long streams",
        "adaptive/test_stats.py::test_window_percentile_property": "hypothesis examples",
        "agc/test_agc.py::test_agc_axis_matches_optax": (
            "a large unitwise tree per axis; unitwise_equals_optax stays"
        ),
        "agc/test_agc.py::test_exclude_bias_bn": "compiled per scope",
        "agc/test_agc.py::test_unitwise_axis_name_gives_every_replica_the_same_scale": (
            "vmapped replicas; tests/adaptive keeps zclip's axis_name run"
        ),
        "autoclip/test_autoclip.py::test_nan_never_enters_the_statistics": (
            "three modes, two traces each; guard_nans=False's trace stays"
        ),
        "autoclip/test_geometric_quantile.py::test_converges_to_the_true_quantile": (
            "thousands of steps; the step-by-step restatement stays"
        ),
        "autoclip/test_geometric_quantile.py::test_follows_a_5x_downward_shift": (
            "thousands of steps"
        ),
        "autoclip/test_geometric_quantile.py::test_follows_a_slow_exponential_drift": (
            "thousands of steps"
        ),
        "contract/test_bad_input.py::test_tree_map_params_keeps_names_and_metrics": (
            "a chain mapped and compiled; tree_map_params_maps_params_shaped_parts_only stays"
        ),
        (
            "contract/test_checkpoint.py::"
            "test_flax_restore_of_a_global_state_into_another_model_is_allowed"
        ): "a restore and an update compiled",
        (
            "contract/test_checkpoint.py::"
            "test_orbax_restore_of_a_placed_state_does_not_recompile_the_step"
        ): "compiles the step twice; the resumed runs stay",
        (
            "contract/test_checkpoint.py::"
            "test_orbax_restore_of_another_models_state_fails_at_restore"
        ): "orbax save and restore; flax restores of another model's state stay",
        "contract/test_grouping.py::test_many_groups_compile_like_one": "compiles twice per scope",
        "contract/test_leaf_norms.py::test_nested_metrics_every_clipper_with_leaf_norms": (
            "every clipper in one program"
        ),
        "contract/test_serialization.py::test_flax_imported_before_or_after_clipjax": (
            "a subprocess per order"
        ),
        "contract/test_serialization.py::test_without_flax_clipjax_imports_and_works": (
            "a subprocess"
        ),
        "contract/test_stacked.py::test_flax_nnx_scan_model": (
            "a flax training run; the stacked slices and lax.scan chain stay"
        ),
        "contract/test_stacked.py::test_jit_and_eager_agree": (
            "eager and jitted runs; the stacked slices stay"
        ),
        (
            "contract/test_update_clipping.py::"
            "test_levanter_style_update_norm_clip_stops_an_update_spike"
        ): "a training run; after_the_optimizer stays",
        "contract/test_update_clipping.py::test_under_skip_on_spike_on_the_fold_route": (
            "a training run on the fold route; after_the_optimizer stays"
        ),
        (
            "contract/test_wrappers.py::"
            "test_apply_if_finite_drops_the_step_before_the_clipper_sees_it"
        ): "every clipper in one program",
        "contract/test_wrappers.py::test_masked_clips_only_the_selected_leaves": (
            "every clipper in one program"
        ),
        "docs/test_docs_claims.py::test_the_readme_example_prints_what_the_readme_shows": (
            "trains the README example; make test-all runs it with every README block"
        ),
        "docs/test_docs_code_blocks.py::test_page_code_blocks_run": (
            "runs every page's code blocks; the extraction checks stay"
        ),
        "docs/test_docs_nnx_metrics.py::test_a_split_optimizer_is_read_inside_jit": (
            "a flax nnx step"
        ),
        "docs/test_docs_nnx_metrics.py::test_every_nnx_form_gives_the_opt_state_metrics": (
            "a flax nnx step per form; the nnx optimizer run stays (contract/test_flax)"
        ),
        "elementwise/test_elementwise.py::test_clip_by_percentile_approx_and_auto": (
            "a percentile per scope; tests/percentile checks the approximation"
        ),
        "elementwise/test_elementwise.py::test_clip_by_percentile_inject_hyperparams": (
            "inject_hyperparams per transform (contract/test_inject keeps a few)"
        ),
        "elementwise/test_elementwise.py::test_clip_by_percentile_property": (
            "50 hypothesis examples; exact_matches_numpy stays"
        ),
        "growth_clip/test_growth_clip.py::test_ema_trace_equals_torchzero": (
            "a reference trace per scope; the per_param growth trace stays"
        ),
        "growth_clip/test_growth_clip.py::test_per_layer_and_global_traces_equal_torchzero": (
            "reference traces per scope; the per_param trace stays"
        ),
        (
            "hist_clip/test_hist_clip.py::"
            "test_warmup_clip_metrics_are_nested_and_generic_transforms_work"
        ): "a run per warm-up clip; the nested warm-up metrics tests stay",
        "historical_clip/test_historical_clip.py::test_per_param_and_per_layer_groups": (
            "a trace per scope; the global trace against Levanter stays"
        ),
        (
            "historical_clip/test_historical_clip.py::"
            "test_the_recipe_after_the_optimizer_equals_levanters_chain"
        ): "a training run; the Levanter trace stays",
        "percentile/test_percentile.py::test_approx_with_static_percentiles": (
            "a distribution per case; approx_within_documented_bound stays"
        ),
        "percentile/test_percentile.py::test_approx_within_bound_on_a_million_elements": (
            "a million elements; the smaller sizes stay"
        ),
        "qk_clip/test_contract.py::test_a_scanned_model_trained_in_a_scan_over_steps": (
            "a training run; the jitted run and a tree of logits stay"
        ),
        "qk_clip/test_contract.py::test_a_stacked_module_reads_layers_by_heads_from_a_tree": (
            "a flax module per layer; a tree of logits stays"
        ),
        "qk_clip/test_contract.py::test_multi_steps_with_a_tree_of_logits": (
            "MultiSteps compiled; MultiSteps with one logits array stays"
        ),
        "qk_clip/test_contract.py::test_update_under_vmap_takes_the_max_over_axis_name": (
            "vmapped replicas; the jitted run stays"
        ),
        "qk_clip/test_reference.py::test_flax_layout_within_the_budget": (
            "a flax attention per layout; the inferred layouts stay"
        ),
        (
            "skip_and_clip/test_skip_and_clip.py::"
            "test_scan_carry_single_trace_donation_and_wrappers"
        ): "a scan, a donated step and the wrappers compiled",
        (
            "skip_on_spike/test_fold.py::"
            "test_composes_with_inject_hyperparams_multisteps_and_low_precision_params"
        ): "three wrappers compiled; the contract's wrapper checks stay",
        "skip_on_spike/test_fold.py::test_skip_on_spike_is_the_same_as_around_optax": (
            "a run per inner optimizer; init_and_update_are_optax_bit_for_bit stays"
        ),
        (
            "skip_on_spike/test_skip_on_spike_steps.py::"
            "test_a_taken_step_costs_the_norm_and_one_round_trip_of_the_updates"
        ): "XLA cost analysis; test_fold keeps a taken step's cost",
        (
            "skip_on_spike/test_skip_on_spike_steps.py::"
            "test_a_wrapper_around_clipjax_adamw_is_the_conditional_around_optax"
        ): "a run per wrapper; the conditional around optax's runs stay",
        (
            "skip_on_spike/test_skip_on_spike_steps.py::"
            "test_a_wrapper_costs_what_the_conditional_around_optax_costs"
        ): "XLA cost analysis per wrapper; test_fold keeps a taken step's cost",
        "skip_on_spike/test_skip_on_spike_steps.py::test_nnx_optimizer_passes_the_loss_through": (
            "a flax nnx step"
        ),
        (
            "skip_on_spike/test_skip_on_spike_steps.py::"
            "test_orbax_checkpoint_continues_bit_identically"
        ): "orbax save and restore; contract/test_serialization keeps skip_on_spike's",
        "spam/test_spam_pieces.py::test_alone_it_copies_no_more_than_adamw": (
            "XLA cost analysis; the donated step's HLO stays"
        ),
        "spam/test_spam_pieces.py::test_inject_hyperparams": (
            "inject_hyperparams per transform (contract/test_inject keeps a few)"
        ),
        "spam/test_spam_pieces.py::test_update_if_skips_bit_identically_and_takes_as_update": (
            "the fold's update_if, run per optimizer (test_fold keeps adam's)"
        ),
        "zclip/test_scale_free.py::test_a_zero_norm_carries_no_scale": "a run per case",
        "zclip/test_scale_free.py::test_an_absolute_ceiling_is_not_the_same_run": (
            "two runs compared; a_loss_times_k_is_the_same_run stays"
        ),
        "zclip/test_scale_free.py::test_headroom_shows_a_ceiling_that_is_wrong_for_the_run": (
            "a run per clipper"
        ),
        "zclip/test_start.py::test_0_4s_time_weight_enlarges_it": "a long trace",
        "zclip/test_start.py::test_the_hold_costs_no_bytes_and_no_copy_in_clipjax_chain": (
            "XLA cost analysis; the held steps stay"
        ),
        "zclip/test_start.py::test_the_recommended_route_never_enlarges_adams_step": (
            "a long trace; the held steps stay"
        ),
        "zclip/test_start.py::test_what_optax_chain_gets": "a long trace; the held steps stay",
        "contract/test_stacked.py::test_leaf_norms_are_whole_leaf_norms": (
            "a stacked and an unstacked run; the stacked slices stay"
        ),
        "skip_on_spike/test_fold.py::test_lax_scan_traces_once_and_equals_the_loop": (
            "a scan compiled; test_skip_on_spike_steps keeps skip_on_spike's"
        ),
        "qk_clip/test_docs.py::test_the_block_prints_what_its_comment_says[the helper]": (
            "materialises the attention logits; tests/qk_clip/test_max_logits checks the helper"
        ),
    }
)

# Every contract test runs with and without jit (chex.variants). The fast
# suite keeps, for every public transform (the registry's first configuration
# of it), the jitted `state_is_stable_and_dtypes_kept` and `empty_tree`;
# eagerly, in low precision or twice in one chain, the global norm and zclip;
# bfloat16 stands for the low-precision dtypes.
_CLASS = r"contract/test_contract\.py::TestContractWithAndWithoutJit::"
_SCOPED = (
    "ada_norm_per_layer|adaclip_global|agc_per_layer|autoclip_ema_per_param|autoclip_window|"
    "clip_by_global_norm_inf|hist_clip_ema_per_layer|zclip_per_param|stable_spam_uncounted"
)
SLOW_PATTERNS = {
    rf"{_CLASS}test_(?:state_is_stable_and_dtypes_kept|empty_tree)_(?:{_SCOPED})__with_jit$": (
        "another configuration of a transform whose first one stays"
    ),
    rf"{_CLASS}test_(?!state_is_stable_and_dtypes_kept_(?:clip_by_global_norm|zclip)__)"
    r".*__without_jit$": "eager variant (the global norm and zclip stay eager)",
    rf"{_CLASS}test_low_precision_leaves_keep_dtype_"
    r"(?!(?:clip_by_global_norm|zclip)_bfloat16__).*__with_jit$": (
        "a low-precision variant compiled per transform (the global norm and zclip stay)"
    ),
    rf"{_CLASS}test_two_of_a_kind_get_distinct_names_"
    r"(?!(?:clip_by_global_norm|zclip)__).*__with_jit$": (
        "a chain of two compiled per transform (the global norm and zclip stay)"
    ),
}

# Parametrized tests that repeat one check per clipper, scope, route, dtype or
# setting: the cases named first stay in the fast suite (one or two
# representatives), the others run in `make test-all`, for the reason given.
# The cheap per-transform checks (the jitted contract above, bad input, flax
# bytes) keep every transform of the registry in the fast suite.
_REPRESENTATIVES: dict[str, tuple[str | tuple[str, ...], str]] = {
    "adagc/test_adagc.py::test_global_matches_restatement": ("clipped", "restatement step by step"),
    "adagc/test_adagc.py::test_per_layer_matches_restatement": (
        "clipped",
        "restatement step by step",
    ),
    "adagc/test_adagc.py::test_per_param_matches_restatement": (
        "clipped",
        "restatement step by step",
    ),
    "adaptive/test_feedback.py::test_axis_name_every_replica_sees_the_averaged_norm": (
        "zclip-None",
        "vmapped replicas per clipper",
    ),
    "adaptive/test_feedback.py::test_feedback_matches_restatement": (
        "zclip",
        "restatement step by step",
    ),
    "adaptive/test_feedback.py::test_inject_hyperparams_feedback": (
        ("zclip-clipped", "zscore_clip-skip"),
        "a run per feedback",
    ),
    "adaptive/test_follow.py::test_a_lasting_x2_rise": (
        ("zclip-clip_target", "zclip-clipped"),
        "a run per clipper",
    ),
    "adaptive/test_follow.py::test_required_settings_follow_a_run": (
        "recommended",
        "a run per setting",
    ),
    "adaptive/test_forgetting.py::test_auto_window_matches_restatement": (
        "64-clipped",
        "restatement step by step",
    ),
    "adaptive/test_forgetting.py::test_judge_first_threshold_is_inf_before_first_observation": (
        "zscore_clip-clipped",
        "a run per statistic and feedback",
    ),
    "adaptive/test_forgetting.py::test_observe_first_gate_keeps_smartclip_defaults": (
        "zscore_clip",
        "a run per clipper",
    ),
    (
        "adaptive/test_forgetting.py::"
        "test_the_ceiling_bounds_the_steps_before_the_first_observation"
    ): ("zscore_clip", "a run per statistic"),
    "adaptive/test_stats.py::test_groups_are_independent": ("ema window", "a statistic per case"),
    "adaptive/test_stats.py::test_state_structure_never_changes": (
        "float32-ema float32-window",
        "a statistic per case",
    ),
    "agc/test_agc.py::test_grouped_equals_float64_restatement": ("per_layer", "compiled per scope"),
    "agc/test_agc.py::test_unitwise_equals_optax": ("0.05", "a long run against optax"),
    "autoclip/test_autoclip.py::test_auto_mode_textbook_median_and_welford_std": (
        "spikes",
        "a trace per stream",
    ),
    "autoclip/test_autoclip.py::test_injected_defaults_are_not_taken_for_other_values": (
        "percentile",
        "a run per mode",
    ),
    "autoclip/test_autoclip.py::test_window_percentile_matches_smartclip": (
        "50-95.0-spikes",
        "reference trace",
    ),
    "autoclip/test_geometric_quantile.py::test_matches_restatement_step_by_step": (
        "0.2-95.0",
        "restatement step by step",
    ),
    "contract/test_bad_input.py::test_scope_callables_of_two_arguments_are_accepted": (
        "zclip",
        "compiled per clipper",
    ),
    "contract/test_careless_input.py::test_numpy_float64_gradients_are_cast_quietly": (
        "clip_by_global_norm zclip zscore_clip chain",
        "compiled per transform",
    ),
    "contract/test_compat.py::test_agc_accepts_what_optax_accepts": (
        "python_float masked",
        "agc against optax per leaf kind",
    ),
    "contract/test_compat.py::test_clip_by_value_accepts_what_optax_accepts": (
        "none python_float",
        "compiled per leaf kind",
    ),
    "contract/test_compat.py::test_every_clipper_runs_on_every_leaf_kind": (
        "zclip",
        "compiled per transform and leaf kind (zclip stays)",
    ),
    "contract/test_compat.py::test_inside_optax_masked_equals_optax": (
        "clip_by_global_norm",
        "compiled per transform",
    ),
    "contract/test_compile.py::test_a_folded_skip_zeroes_the_updates_once": (
        "skip_on_spike(adamw)",
        "compiled per inner optimizer",
    ),
    "contract/test_compile.py::test_distinct_fusions_do_not_grow_with_the_leaves": (
        "normalize_per_param",
        "compiled at two tree sizes per transform",
    ),
    "contract/test_compile.py::test_each_leaf_adds_about_as_much_hlo_as_optax": (
        ("zclip vs optax.clip_by_global_norm",),
        "compiled at two tree sizes per transform",
    ),
    "contract/test_compile.py::test_each_leaf_adds_no_more_to_the_trace_than_optax": (
        "clip_by_value agc",
        "traced at two tree sizes per transform",
    ),
    "contract/test_compile.py::test_tracing_once_per_leaf_signature_compiles_the_same_step": (
        "zscore_normalize",
        "compiled per leaf signature per transform",
    ),
    "contract/test_contract.py::test_metrics_found_in_every_wrapper": (
        "clip_by_global_norm",
        "7 wrappers compiled per transform",
    ),
    "contract/test_contract.py::test_no_host_transfer_inside_update": (
        "zclip skip_and_clip",
        "compiled per transform (zclip and skip_and_clip stay)",
    ),
    "contract/test_contract.py::test_scan_carry_and_single_trace": (
        "zclip skip_and_clip",
        "compiled per transform (zclip and skip_and_clip stay)",
    ),
    "contract/test_contract.py::test_state_can_be_donated": (
        "zclip skip_and_clip",
        "compiled per transform (zclip and skip_and_clip stay)",
    ),
    "contract/test_flax.py::test_nnx_optimizer_trains_with_every_clipper": (
        "clip_by_global_norm",
        "a training run per clipper",
    ),
    "contract/test_inject.py::test_injected_equals_the_factory_called_with_the_same_values": (
        "clip_by_global_norm zclip",
        "compiled per hyperparameter value",
    ),
    "contract/test_leaf_norms.py::test_leaf_norms_are_the_pre_clip_leaf_norms": (
        "zclip",
        "compiled per clipper",
    ),
    "contract/test_leaf_norms.py::test_leaf_norms_cost_no_second_pass": (
        "zclip_per_layer",
        "XLA cost analysis per clipper",
    ),
    "contract/test_leaks.py::test_no_tracer_leaks_under_inject_hyperparams": (
        "clip_by_global_norm zclip agc adamw",
        "compiled per transform",
    ),
    "contract/test_overflow.py::test_a_finite_spike_has_a_finite_norm_and_is_clipped": (
        "clip_by_global_norm zclip clip_by_value",
        "compiled per transform",
    ),
    "contract/test_overflow.py::test_a_global_clip_bounds_the_spike_by_its_threshold": (
        "clip_by_global_norm zclip",
        "a run per clipper",
    ),
    "contract/test_overflow.py::test_adam_after_it_keeps_moving": (
        "clip_by_global_norm skip_on_spike",
        "a run per transform",
    ),
    "contract/test_overflow.py::test_an_ordinary_step_compiles_without_full_size_copies": (
        "zclip",
        "XLA cost analysis per clipper",
    ),
    "contract/test_overflow.py::test_group_norms_equal_a_float64_restatement": (
        "True",
        "eager variant (the jitted cases stay)",
    ),
    "contract/test_overflow.py::test_the_wrappers_skip_it_as_non_finite_and_report_its_norm": (
        "skip_on_spike",
        "compiled per wrapper",
    ),
    "contract/test_properties.py::test_dtype_preserved_and_unclipped_leaves_untouched": (
        "bfloat16-zclip",
        "50 hypothesis examples",
    ),
    "contract/test_properties.py::test_scale_threshold_identity": (
        "zclip",
        "50 hypothesis examples",
    ),
    "contract/test_serialization.py::test_flax_bytes_round_trip": (
        "clip_by_global_norm zclip agc hist_clip skip_on_spike_fold",
        "a round trip per state class",
    ),
    "contract/test_serialization.py::test_flax_state_dict_round_trip": (
        "skip_on_spike_fold",
        "a round trip per state class (flax bytes keep every class)",
    ),
    "contract/test_serialization.py::test_orbax_round_trip": (
        "clip_by_global_norm skip_on_spike_fold",
        "a round trip per state class (flax bytes keep every class)",
    ),
    "contract/test_stacked.py::test_each_slice_is_the_unstacked_layer": (
        "per_layer-0-zclip",
        "stacked and unstacked compiled per transform",
    ),
    "contract/test_update_clipping.py::test_after_the_optimizer_it_clips_the_update": (
        "zclip",
        "a training run per clipper",
    ),
    (
        "contract/test_wrappers.py::"
        "test_inject_hyperparams_equals_the_clipper_built_with_those_values"
    ): ("clip_by_global_norm", "compiled per hyperparameter value"),
    "docs/test_docs_metrics_table.py::test_the_row_says_what_the_transform_reports": (
        "zclip",
        "a run per transform against its docs row",
    ),
    "elementwise/test_elementwise.py::test_dtype_kept_and_statistics_in_float32": (
        "normalize_per_param",
        "compiled per element-wise transform (normalize_per_param stays)",
    ),
    "elementwise/test_elementwise.py::test_float64_leaves": (
        "normalize_per_param",
        "compiled per element-wise transform (normalize_per_param stays)",
    ),
    "elementwise/test_elementwise.py::test_none_leaves_empty_trees_and_wrong_tree": (
        "normalize_per_param",
        "compiled per element-wise transform (normalize_per_param stays)",
    ),
    "elementwise/test_elementwise.py::test_normalisers_inject_eps": (
        "zscore_normalize",
        "compiled per normaliser",
    ),
    "elementwise/test_elementwise.py::test_normalisers_pass_nonfinite_leaves_unchanged": (
        "zscore_normalize",
        "compiled per normaliser",
    ),
    "growth_clip/test_growth_clip.py::test_inject_hyperparams": (
        "clip_norm_growth",
        "compiled per transform",
    ),
    "growth_clip/test_growth_clip.py::test_other_feedbacks_equal_their_restatement": (
        "skip",
        "restatement step by step (one feedback stays)",
    ),
    "growth_clip/test_growth_clip.py::test_per_param_trace_equals_torchzero": (
        "defaults",
        "a reference trace per setting",
    ),
    "historical_clip/test_historical_clip.py::test_other_feedbacks_equal_their_restatement": (
        "clipped",
        "restatement step by step (one feedback stays)",
    ),
    (
        "historical_clip/test_historical_clip.py::"
        "test_short_windows_take_levanters_default_min_history"
    ): ("2", "a trace per window"),
    "historical_clip/test_historical_clip.py::test_trace_equals_levanter": (
        "settings0-spiky",
        "a reference trace per setting and stream",
    ),
    "percentile/test_percentile.py::test_approx_within_documented_bound": ("1", "a size per case"),
    "percentile/test_percentile.py::test_radix_select_resolving_every_bit_is_exact": (
        "2048-3",
        "a size per case",
    ),
    "qk_clip/test_contract.py::test_after_the_optimizer_heads_under_tau_keep_its_updates": (
        "adamw",
        "a run per optimizer",
    ),
    "qk_clip/test_max_logits.py::test_a_mask_and_a_scale": ("4", "compiled per case"),
    "qk_clip/test_max_logits.py::test_equals_the_full_matrix": (
        "False-batch1-10-7-6-3-3 True-batch2-9-9-4-1-512",
        "compiled per shape",
    ),
    "qk_clip/test_reference.py::test_each_layout_inferred_or_given_within_the_budget": (
        ("gqa-inferred-flax", "mha-head_axis given-transposed"),
        "a run per layout",
    ),
    (
        "skip_and_clip/test_skip_and_clip.py::"
        "test_a_dropped_step_leaves_the_inner_state_and_the_params"
    ): ("fold", "a run per route"),
    "skip_and_clip/test_skip_and_clip.py::test_other_feedbacks_equal_their_restatement": (
        "clipped",
        "restatement step by step (one feedback stays)",
    ),
    "skip_and_clip/test_skip_and_clip.py::test_trace_equals_axlearn": (
        "stddev-1.0",
        "a reference trace per rule",
    ),
    "skip_on_spike/test_dtypes.py::test_the_conditional_route_copies_no_full_size_buffer": (
        "bf16-mu_f32",
        "XLA cost analysis per dtype",
    ),
    "skip_on_spike/test_dtypes.py::test_updates_and_state_keep_the_inner_optimizers_dtypes": (
        "fold_clipjax_adamw-bf16-bf16-mu_f32 cond_optax_adam-bf16-bf16-mu_none",
        "compiled per route and dtypes (bfloat16 on the fold and cond routes stays)",
    ),
    "skip_on_spike/test_fold.py::test_init_and_update_are_optax_bit_for_bit": (
        "adam-0 adamw-5",
        "compiled per hyperparameter set",
    ),
    "skip_on_spike/test_fold.py::test_the_donated_step_has_no_conditional_and_no_copy": (
        "adamw",
        "compiled per inner optimizer and route",
    ),
    "skip_on_spike/test_fold.py::test_update_if_skips_bit_identically_and_takes_as_update": (
        "adam-0 adamw-5",
        "compiled per hyperparameter set",
    ),
    (
        "skip_on_spike/test_skip_on_spike.py::"
        "test_a_skipped_step_leaves_the_inner_state_bit_identical"
    ): ("chain_zclip_adamw", "compiled per inner optimizer"),
    "skip_on_spike/test_skip_on_spike.py::test_a_skipped_step_reads_as_skipped_on_every_route": (
        "fold",
        "compiled per route",
    ),
    "skip_on_spike/test_skip_on_spike.py::test_decisions_match_the_float64_restatement": (
        "shift-value-3-clipped nan_grad-value-None-skip norm_spike-value-None-raw",
        "restatement step by step (one case per feedback stays)",
    ),
    "spam/test_spam.py::test_a_nan_element_stays_and_the_others_step_as_without_it": (
        "spam",
        "restatement step by step",
    ),
    "spam/test_spam_pieces.py::test_the_donated_step_has_no_conditional_and_no_copy": (
        "spam",
        "compiled per transform",
    ),
    "static/test_static.py::test_equals_optax_with_eps_zero": ("1.0", "compiled per bound"),
    "zclip/test_scale_free.py::test_a_loss_times_k_is_the_same_run": (
        "clipjax.chain-100.0",
        "a run per route and scale",
    ),
    "zclip/test_scale_free.py::test_settings_match_the_restatement": (
        ("default", "warmup_steps"),
        "restatement step by step",
    ),
    "zclip/test_start.py::test_held_steps_leave_the_optimizer_untouched": (
        "chain",
        "a run per route",
    ),
    "zscore_clip/test_zscore_clip.py::test_matches_smartclip": (
        "2.0-0.9-spikes 3.0-0.99-regime_shift",
        "a reference trace per setting and stream",
    ),
}
SLOW_PATTERNS.update(
    pattern
    for test, (keep, reason) in _REPRESENTATIVES.items()
    for pattern in _all_but(test, keep, reason).items()
)

# Activation-gradient clipping: the jitted exactness cases, the linen and NNX training
# steps and the AXLearn comparisons stay in the fast suite.
SLOW_TESTS.update(
    {
        (
            "activation/test_exactness.py::"
            "test_gradients_are_the_model_with_the_tokens_clipped_by_hand[eager-"
        ): "the jitted cases check the same",
        "activation/test_flax.py::test_the_linen_module_is_the_function": (
            "a flax model compiled three ways"
        ),
        "activation/test_flax.py::test_linen_nn_scan_stacks_the_carriers": "a flax nn.scan model",
        "activation/test_flax.py::test_nnx_module_is_the_function_and_scans_into_layers": (
            "flax NNX models, one of them an nnx.scan stack"
        ),
        (
            "activation/test_edges.py::"
            "test_clipjax_imports_without_flax_and_the_flax_factories_say_so"
        ): "subprocess; make test-min runs the whole fast suite without flax",
    }
)

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
