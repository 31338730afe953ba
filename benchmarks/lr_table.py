"""A learning-rate table: is the recommended setting ever worse than no clipping?

A spike defence is a safety device: where it does not help, it must not hurt.
Each language model of ``examples/lm_spikes.py`` that two CPU
cores can train is run at its tuned learning rate and at 3x and 10x it
(``TUNED``: ``cpu_cosine``, adamw with a warm-up and a cosine decay, its best
of 1e-3 ... 3e-2 for adamw alone; ``cpu``, the blow-up model, at half its
configured rate, where adamw alone trains; ``cpu_long``, at its configured
rate), 6 seeds, once per setting: adamw alone, the recommended setting and
the static clips of a sweep (``optax.clip_by_global_norm`` at 0.25, 0.5, 1);
``--rows`` adds others (``zclip_fb_weight``: 0.4's recommended setting).

Per model and learning rate, each seed's final held-out loss (a diverged run
counts as ln 256), and two paired comparisons: against adamw alone (the
optimizer alone, the do-no-harm test) and against the best static clip of the
sweep. **Decision rule**, printed with every table: a setting is *worse* or
*better* than its reference where the 95% bootstrap interval (over seeds) of
the mean per-seed log ratio of final losses excludes 0, else a *tie*; a seed
is *worse beyond noise* where its loss exceeds the reference's by more than
the noise of that model and rate: twice the standard deviation over seeds of
the per-seed log ratio between the two best static clips of the sweep (two
settings that differ by a factor of two in one number), at least 1%.

Run: ``python benchmarks/lr_table.py [--models cpu_cosine,cpu] [--factors 1,3,10]
[--seeds 6] [--update-docs]``; the per-model pages go to ``--out`` (default a
temporary folder), the table to ``docs/generated/lr_table.md`` with
``--update-docs``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import lm_spikes  # noqa: E402

PAGE = os.path.join(ROOT, "docs", "generated", "lr_table.md")
# The tuned (or configured) peak learning rate of each model.
TUNED = {"cpu_cosine": 3e-3, "cpu": 0.15, "cpu_long": 1.5e-2}
FACTORS = (1.0, 3.0, 10.0)
SWEEP = (0.25, 0.5, 1.0)
ROWS = ("none", "recommended")
MIN_NOISE = 0.01


def run(model: str, factor: float, seeds: int, out: str, rows: tuple[str, ...]) -> dict:
    """``{setting: [seeds] final held-out loss}`` of one model at one learning rate."""
    argv = [
        "--config", model, "--lr", f"{TUNED[model] * factor:g}", "--seeds", str(seeds),
        "--only", ",".join(rows), "--static-sweep", ",".join(f"{v:g}" for v in SWEEP),
        "--out", out,
    ]  # fmt: skip
    runs = lm_spikes.main(argv)
    return {name: np.asarray(r.eval_loss[:, -1], np.float64) for name, r in runs.items()}


def collect(model: str, factor: float, out: str) -> dict | None:
    """The same from the page ``examples/lm_spikes.py`` wrote in ``out`` (its loss
    table's per-seed column), or None where it is missing."""
    cfg = lm_spikes.replace(lm_spikes.CONFIGS[model], lr=float(f"{TUNED[model] * factor:g}"))
    path = os.path.join(out, lm_spikes.page_stem(model, cfg) + ".md")
    if not os.path.exists(path):
        return None
    finals = {}
    with open(path) as f:
        for line in f:
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) == len(lm_spikes.LOSS_HEADER) and "/" in cells[3]:
                finals[cells[0]] = np.array([float(v) for v in cells[3].split("/")])
    return finals or None


def capped(x: np.ndarray) -> np.ndarray:
    """Final losses, a diverged run's as ln 256 (as lm_spikes' paired comparison)."""
    return np.where(np.isfinite(x), np.minimum(x, lm_spikes.DIVERGED_LOSS), lm_spikes.DIVERGED_LOSS)


def noise(finals: dict[str, np.ndarray]) -> float:
    """Twice the standard deviation over seeds of the log ratio of the two best static
    clips' final losses, at least MIN_NOISE."""
    statics = sorted(
        (n for n in finals if n.startswith("static_")), key=lambda n: capped(finals[n]).mean()
    )
    if len(statics) < 2:
        return MIN_NOISE
    d = np.log(capped(finals[statics[1]]) / capped(finals[statics[0]]))
    return max(MIN_NOISE, float(np.expm1(2 * np.std(d))))


def verdicts(final: np.ndarray, reference: np.ndarray, tolerance: float) -> str:
    verdict, mean, low, high, _ = lm_spikes.paired(final, reference)
    beyond = int(np.sum(capped(final) > (1 + tolerance) * capped(reference)))
    pct = lambda x: f"{np.expm1(x):+.1%}"
    return f"{verdict}: {pct(mean)} [{pct(low)}, {pct(high)}]; {beyond}/{len(final)} beyond noise"


def table(results: dict[tuple[str, float], dict[str, np.ndarray]]) -> str:
    per = lambda x: " / ".join("div." if v > lm_spikes.DIVERGED_LOSS else f"{v:.2f}" for v in x)
    out = [
        "| model | lr | noise | setting | final held-out loss per seed | vs adamw alone "
        "| vs best static |",
        "|---|---|---:|---|---|---|---|",
    ]
    for (model, factor), finals in results.items():
        statics = {n: f for n, f in finals.items() if n.startswith("static_")}
        best = min(statics, key=lambda n: capped(statics[n]).mean())
        lr = f"{TUNED[model] * factor:g} ({factor:g}x)"
        tolerance = noise(finals)
        for name in (*ROWS, best):
            if name not in finals:
                continue
            f = finals[name]
            label = f"{name} (best static)" if name == best else name
            vs_none = "-" if name == "none" else verdicts(f, finals["none"], tolerance)
            vs_best = "-" if name == best else verdicts(f, finals[best], tolerance)
            out.append(
                f"| {model} | {lr} | {tolerance:.1%} | {label} | {per(f)} | {vs_none} | {vs_best} |"
            )
    out += [
        "",
        "Rule: *worse* / *better* where the 95% bootstrap interval over seeds of the mean "
        "per-seed log ratio of final held-out losses excludes 0, else *tie* (a diverged run "
        "counts as ln 256); a seed is *beyond noise* where its loss exceeds the reference's "
        "by more than the row's *noise*: twice the standard deviation over seeds of the "
        f"per-seed log ratio of the two best static clips, at least {MIN_NOISE:.0%}. "
        "`div.`: diverged (final held-out loss above ln 256 or a "
        "loss not finite). Settings: `none` adamw alone; `recommended` "
        '`clipjax.chain(clipjax.zclip(feedback="clipped"), clipjax.adamw(...))`; '
        '`zclip_fb_weight` 0.4\'s `zclip(feedback="clipped", start="weight")` in '
        "`optax.chain`; `static_<m>` `optax.clip_by_global_norm(m)`, the best of "
        + ", ".join(f"{v:g}" for v in SWEEP)
        + " by mean shown.",
    ]
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="cpu_cosine,cpu")
    parser.add_argument("--factors", default=",".join(f"{f:g}" for f in FACTORS))
    parser.add_argument("--seeds", type=int, default=6)
    parser.add_argument("--rows", default=",".join(ROWS), help="settings besides the sweep")
    parser.add_argument("--out", default=None, help="folder of the per-model pages")
    parser.add_argument("--update-docs", action="store_true", help=f"write {PAGE}")
    parser.add_argument(
        "--collect",
        action="store_true",
        help="train nothing: read the per-model pages already in --out (of earlier runs)",
    )
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="lr_table_")
    rows = tuple(r for r in args.rows.split(",") if r)
    results = {}
    for model in args.models.split(","):
        for factor in (float(f) for f in args.factors.split(",")):
            if args.collect:
                found = collect(model, factor, out)
                if found is None:
                    print(f"no page for {model} at {factor:g}x in {out}", file=sys.stderr)
                    continue
                results[(model, factor)] = found
            else:
                results[(model, factor)] = run(model, factor, args.seeds, out, rows)
            text = table(results)
            print(text, flush=True)
            if args.update_docs:  # after each model and rate, so that a long run leaves a page
                write_page(text)


def write_page(text: str) -> None:
    import common

    argv = sys.argv[1:]
    # --collect rebuilds the page of the runs this command made: the same page.
    kept = [
        a
        for i, a in enumerate(argv)
        if a not in ("--out", "--collect") and (i == 0 or argv[i - 1] != "--out")
    ]
    meta = common.header(" ".join(["python benchmarks/lr_table.py", *kept]), load=False)
    doc = "\n\n".join(__doc__.split("\n\n")[1:3]).strip()
    title = "# The recommended setting at 1x, 3x and 10x the learning rate"
    common.write(PAGE, common.page(title, meta, doc, text))


if __name__ == "__main__":
    main()
