"""Memory traffic of each configuration: XLA's "bytes accessed" of one jitted step.

Extra bytes over the group's floor (adam alone, or the inner optimizer of a
wrapper), in units of the gradients' bytes, from
``jax.jit(step).lower(...).compile().cost_analysis()``: repeatable, no timing.
A norm clipper that reads the gradients once and fuses its scalar multiply
into adam costs 1.0; AGC also reads the parameters, 2.0.

    python benchmarks/traffic.py [--quick]
"""

from __future__ import annotations

import re

import common
import jax

AGC = "clipjax.agc[unitwise] + adam"


def extra(group: common.Group, shapes: object) -> dict[str, float]:
    """``{label: extra bytes over the floor / gradient bytes}`` for every config but the floor."""
    grad_bytes = common.tree_bytes(shapes)
    floor = common.compile_step(group.floor, group, shapes).bytes
    return {
        label: (common.compile_step(label, group, shapes).bytes - floor) / grad_bytes
        for label in group.configs
        if label != group.floor
    }


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    shapes = common.transformer_shapes(**size.model)
    groups = common.groups(size.scopes) + common.new_groups()
    rows, figures = [], {}
    for group in groups:
        common.log(f"  traffic: {group.title}")
        for label, x in extra(group, shapes).items():
            if label not in figures:
                figures[label] = x
                rows.append([label, group.floor, f"{x:.3f}"])
    grad_bytes = common.tree_bytes(shapes)
    floor = common.compile_step(common.ADAM, groups[0], shapes).bytes
    text = [
        "## Memory traffic",
        "",
        f'Extra "bytes accessed" (`compiled.cost_analysis()`) of one jitted step (update + '
        f"apply_updates, params and state donated) over the floor's, in gradient bytes, on a "
        f"transformer-shaped tree of {common.describe(shapes)}; the floor ({common.ADAM}) "
        f"accesses {floor / grad_bytes:.2f} gradient bytes. One read of the "
        "gradients is 1.0; AGC also reads the parameters (2.0).",
        "",
        common.table(["configuration", "floor", "extra traffic"], rows),
    ]
    bound = common.TARGETS["traffic"]
    gn, optax_gn = figures["clipjax.clip_by_global_norm + adam"], figures[common.OPTAX_GN]
    norm = {
        k: v
        for k, v in figures.items()
        if re.match(r"clipjax\.(?!agc|skip_on_spike)", k) and ("[per_" not in k or "adagc" in k)
    }
    adagc = " (and adagc[per_param])"
    worst = max(norm, key=norm.get)
    checks = [
        (
            f"`clipjax.clip_by_global_norm` + adam: extra traffic ≤ {bound}",
            f"{gn:.3f} (optax's {optax_gn:.3f})",
            gn <= bound,
        ),
        (
            f"every global-scope clipjax norm clipper{adagc} + adam: extra traffic ≤ {bound}",
            f"worst {worst} {norm[worst]:.3f}",
            norm[worst] <= bound,
        ),
    ]
    skip = [g for g in groups if g.title.startswith("skip_on_spike")]
    counts = {label: common.copies(label, g, shapes) for g in skip for label in g.configs}
    text += [
        "",
        "### Full-size copies in the compiled step",
        "",
        "`copy` ops in the compiled step with params and optimizer state donated and the "
        "gradients made inside the step, as the backward pass makes them "
        "(`jax.jit(step, donate_argnums=(0, 1)).lower(...).compile().as_text()`), whose shape "
        "is a parameter's, hence a full-size optimizer-state, parameter or gradient buffer "
        "(copies fused into a loop not counted; "
        f"{len(jax.tree.leaves(shapes))} leaves).",
        "",
        common.table(["configuration", "full-size copies"], list(counts.items())),
    ]
    tb, cb = common.TARGETS["skip_traffic"], common.TARGETS["skip_copies"]
    for g in skip:
        label = f"clipjax.{g.title}"
        checks += [
            (
                f"`{label}`: extra traffic over {g.floor} ≤ {tb}",
                f"{figures[label]:.3f}",
                figures[label] <= tb,
            ),
            (
                f"`{label}`: full-size copies in the donated step ≤ {cb}",
                f"{counts[label]} ({g.floor}: {counts[g.floor]})",
                counts[label] <= cb,
            ),
        ]
    hb = common.TARGETS["hist_traffic"]
    hist = {
        k: v for k, v in figures.items() if re.match(r"clipjax\.hist_clip\[(global|per_param)\]", k)
    }
    worst = max(hist, key=hist.get)
    checks.append(
        (
            f"hist_clip (default and per_param) + adam: extra traffic ≤ {hb}",
            f"worst {worst} {hist[worst]:.3f}",
            hist[worst] <= hb,
        )
    )
    ab, agc, optax_agc = common.TARGETS["agc_traffic"], figures[AGC], figures[common.OPTAX_AGC]
    checks.append(
        (
            f"`clipjax.agc[unitwise]` + adam: extra traffic ≤ optax.adaptive_grad_clip's + {ab}",
            f"{agc:.3f} (optax's {optax_agc:.3f}: +{agc - optax_agc:.3f})",
            agc <= optax_agc + ab,
        )
    )
    return "\n".join(text), checks


if __name__ == "__main__":
    common.main(section, __doc__)
