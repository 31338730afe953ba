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
    runners = {
        label: common.Runner(common.compile_step(label, group, shapes), params, grads)
        for label in group.configs
    }
    return common.interleave({k: r.run for k, r in runners.items()}, size.rounds, size.block_s)


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    shapes = common.transformer_shapes(**size.model)
    groups = common.groups(size.scopes) + common.new_groups()
    rows, vs_base, vs_global = [], {}, {}
    for group in groups:
        samples = measure(group, shapes, size)
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
                    f"{common.compile_step(label, group, shapes).compile_s:.1f}",
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
    return "\n".join(text), checks


if __name__ == "__main__":
    common.main(section, __doc__)
