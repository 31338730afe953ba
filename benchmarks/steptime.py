"""Step time of each configuration, interleaved with its group's optax baselines.

The whole training step is jitted (gradients as inputs, ``update`` +
``apply_updates``, params and optimizer state donated). Each group (a clipper
in every scope, with adam alone and optax's counterpart) is timed interleaved:
every round runs each configuration once for a block of steps, in an order
that rotates and reverses. Times are medians [inter-quartile range] over
rounds; ratios are medians [IQR] of the per-round ratios.

    python benchmarks/steptime.py [--quick]
"""

from __future__ import annotations

import re

import common


def measure(group: common.Group, shapes: object, size: common.Sizes) -> dict[str, list[float]]:
    """Per-step seconds, one sample per round, for every configuration of ``group``."""
    common.log(f"  steptime: {group.title}")
    params, grads = common.params_and_grads(shapes)
    runs = {label: common.run_steps(label, group, shapes, params, grads) for label in group.configs}
    return common.interleave(runs, size.rounds, common.block_steps(runs, size.block_s))[0]


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    shapes = common.transformer_shapes(**size.model)
    groups = common.groups(size.scopes) + common.new_groups()
    rows, vs_base, vs_global, by_group = [], {}, {}, {}
    for group in groups:
        samples = by_group[group.title] = measure(group, shapes, size)
        for i, (label, s) in enumerate(samples.items()):
            base = common.ratios(s, samples[group.base])
            glob = re.sub(r"\[per_\w+\]", "[global]", label)
            scope = common.ratios(s, samples[glob]) if glob in samples and glob != label else None
            if label != group.base:
                vs_base[label] = base
            if scope:
                vs_global[label] = scope
            rows.append(
                [
                    f"{group.title} (base: {group.base})" if i == 0 else "",
                    label,
                    common.ms(s),
                    "" if label == group.base else common.spread(base),
                    common.spread(scope) if scope else "",
                    f"{common.compile_step(label, group, shapes).wall_s:.1f}",
                ]
            )
    header = ["group", "configuration", "step ms", "× base", "× global scope", "compile s"]
    text = [
        "## Step time",
        "",
        f"One jitted training step on the transformer-shaped tree ({common.describe(shapes)}), "
        f"each group interleaved ({size.rounds} rounds); ms and ratios are medians "
        "[inter-quartile range], ratios of the same round. Compile: trace + lower + compile, "
        "seconds, one measurement.",
        "",
        common.table(header, rows),
    ]
    hist = by_group["hist_clip"]
    vs_zclip = {
        s: common.ratios(hist[f"clipjax.hist_clip[{s}] + adam"], hist[f"clipjax.zclip[{s}] + adam"])
        for s in ("global", "per_param")
        if f"clipjax.hist_clip[{s}] + adam" in hist
    }
    text += [
        "",
        "hist_clip over zclip of the same scope, per-round ratios of the hist_clip group's "
        "rounds (global is hist_clip's default scope):",
        "",
        common.table(
            ["scope", "hist_clip ms", "zclip ms", "× zclip"],
            [
                [
                    s,
                    common.ms(hist[f"clipjax.hist_clip[{s}] + adam"]),
                    common.ms(hist[f"clipjax.zclip[{s}] + adam"]),
                    common.spread(r),
                ]
                for s, r in vs_zclip.items()
            ],
        ),
    ]
    bound, scope_bound = common.TARGETS["step_ratio"], common.TARGETS["scope_ratio"]

    def check(target: str, figures: dict[str, list[float]], keep: str, limit: float) -> tuple:
        picked = {k: common.median(v) for k, v in figures.items() if re.search(keep, k)}
        name = max(picked, key=picked.get)
        return target, f"worst: {name} {common.spread(figures[name])}", picked[name] <= limit

    gn, agc = "optax clip_by_global_norm + adam", "optax.adaptive_grad_clip + adam"
    checks = [
        check(
            f"clipjax global-scope clippers + adam: step time ≤ {bound}× {gn}",
            vs_base,
            r"^clipjax\.(?!agc).*(\[global\]|clip_by_global_norm)",
            bound,
        ),
        check(
            f"clipjax.agc[unitwise] + adam: step time ≤ {bound}× {agc}", vs_base, "unitwise", bound
        ),
        check(
            f"per_layer / per_param: step time ≤ {scope_bound}× the same clipper's global scope",
            vs_global,
            ".",
            scope_bound,
        ),
    ]
    sb = common.TARGETS["skip_ratio"]
    for group in groups:
        if group.title.startswith("skip_on_spike"):
            checks.append(
                check(
                    f"`clipjax.{group.title}`: step time ≤ {sb}× {group.base} (same rounds)",
                    vs_base,
                    re.escape(f"clipjax.{group.title}"),
                    sb,
                )
            )
    st = common.TARGETS["stable_ratio"]
    stable = by_group[f"skip_on_spike({common.STABLE_ADAMW})"]
    over_adamw = common.ratios(stable[common.STABLE_ADAMW], stable[common.ADAMW_FOLD])
    checks.append(
        (
            f"`{common.STABLE_ADAMW}`: step time ≤ {st}× clipjax.adamw's (same rounds)",
            common.spread(over_adamw),
            common.median(over_adamw) <= st,
        )
    )
    hb = common.TARGETS["hist_vs_zclip"]
    worst = max(vs_zclip, key=lambda s: common.median(vs_zclip[s]))
    checks.append(
        (
            f"hist_clip (default and per_param) + adam: step time ≤ {hb}× zclip's, same scope "
            "and rounds",
            f"worst: {worst} {common.spread(vs_zclip[worst])}",
            common.median(vs_zclip[worst]) <= hb,
        )
    )
    return "\n".join(text), checks


if __name__ == "__main__":
    common.main(section, __doc__)
