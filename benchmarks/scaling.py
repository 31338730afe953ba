"""How compile time, step time and state grow with the number of leaves.

Stacks of identical dense layers (kernel + bias per layer, so ``per_layer``
has half as many groups as ``per_param``) of a fixed parameter count. ``zclip``
stands for every adaptive clipper (they share the engine). Compile time is
``jax.jit(step).lower(...).compile()``'s wall time, one measurement.

    python benchmarks/scaling.py [--quick]
"""

from __future__ import annotations

import common
import jax
import steptime

import clipjax

ZCLIP_PP = "clipjax.zclip[per_param] + adam"


def section(quick: bool) -> tuple[str, list[tuple[str, str, bool]]]:
    size = common.sizes(quick)
    configs = {
        **common.REFS,
        "clipjax.clip_by_global_norm + adam": common.plus_adam(
            lambda: clipjax.clip_by_global_norm(1.0)
        ),
    }
    for s in size.scopes:
        zclip = lambda s=s: clipjax.zclip(warmup_steps=common.WARM, scope=s)
        configs[f"clipjax.zclip[{s}] + adam"] = common.plus_adam(zclip)
    group = common.Group("scaling", configs)
    rows, compile_s = [], {}
    for n in size.leaf_counts:
        shapes = common.stack_shapes(n, size.leaf_params)
        common.log(f"  scaling: {common.describe(shapes)}")
        samples = steptime.measure(group, shapes, size)
        floor = common.compile_step(group.floor, group, shapes).bytes
        adam_state = common.tree_bytes(jax.eval_shape(common.adam().init, shapes))
        leaves = len(jax.tree.leaves(shapes))
        for label, s in samples.items():
            step = common.compile_step(label, group, shapes)
            state = common.tree_bytes(jax.eval_shape(step.tx.init, shapes)) - adam_state
            compile_s[label] = step.wall_s
            rows.append(
                [
                    leaves,
                    label,
                    f"{step.wall_s:.2f}",
                    common.ms(s),
                    common.spread(common.ratios(s, samples[group.base])),
                    f"{(step.bytes - floor) / common.tree_bytes(shapes):.2f}",
                    state,
                ]
            )
    header = ["leaves", "configuration", "compile s", "step ms", "× optax", "extra traffic"]
    text = [
        "## Scaling with the number of leaves",
        "",
        f"Stacks of identical dense layers of about {size.leaf_params:.0e} parameters; `zclip` "
        "stands for every adaptive clipper. Compile: trace + lower + compile of the whole step, "
        "seconds, one measurement. Step ms: median [IQR] of interleaved rounds; × optax: ratio "
        "to optax clip_by_global_norm + adam, same rounds. Extra traffic: bytes accessed over "
        "adam alone's, in gradient bytes. State B: the optimizer state's bytes beyond adam's.",
        "",
        common.table([*header, "state B"], rows),
    ]
    bound = common.TARGETS["compile_ratio"]
    ratio = compile_s[ZCLIP_PP] / compile_s[common.OPTAX_GN]
    target = f"compile time with {leaves} leaves: zclip per_param + adam ≤ {bound}× optax's"
    measured = f"{compile_s[ZCLIP_PP]:.1f} s vs {compile_s[common.OPTAX_GN]:.1f} s: {ratio:.2f}×"
    return "\n".join(text), [(target, measured, ratio <= bound)]


if __name__ == "__main__":
    common.main(section, __doc__)
