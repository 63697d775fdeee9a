"""docs/quality.md's tables and plots, made from the quality study's JSON files (`python benchmarks/quality.py
--report`): the page's hand-written reading stays, and every block between `<!-- report: NAME -->` and
`<!-- /report -->` is replaced by what the files say now, so the figures on the page are always the committed ones.
"""

import json
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

SCRATCH_VARIANTS = {"prenorm": "PreNorm", "block": "Block AttnRes", "full": "Full AttnRes"}
CONTROL = {"scratch": "prenorm", "convert-tiny": "plain-cpt", "cpt-smollm2": "plain-cpt"}
BLOCK = re.compile(r"(<!-- report: (?P<name>[\w-]+) -->\n).*?(<!-- /report -->)", re.DOTALL)


def load(results: Path) -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(results.glob("*.json"))]


def spread(values: list[float], digits: int = 4) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def signed_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:+.4f}"
    return f"{statistics.mean(values):+.4f} ± {statistics.stdev(values):.4f}"


def seeds(count: int) -> str:
    return f"{count} seed" + ("s" if count != 1 else "")


def short_count(count: int) -> str:
    return f"{count / 1e6:.2f}M" if count >= 10**6 else f"{count / 1e3:.0f}k" if count >= 10**4 else f"{count:,}"


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def grouped(runs: list[dict], study: str) -> dict[tuple[str, str], dict[int, dict]]:
    """(size, variant) -> seed -> run, for one study."""
    groups: dict[tuple[str, str], dict[int, dict]] = defaultdict(dict)
    for run in runs:
        if run["study"] == study:
            groups[run["size"], run["variant"]][run["seed"]] = run
    return groups


def size_params(groups: dict, size: str) -> int:
    return min(run["params"] for (label, _), group in groups.items() if label == size for run in group.values())


def final_loss(run: dict) -> float:
    return run["curve"][-1][1]


def paired(groups: dict, size: str, variant: str, control: str, value) -> list[float]:
    """`value(run) - value(control run)` for every seed that both have."""
    runs, controls = groups.get((size, variant), {}), groups.get((size, control), {})
    return [value(runs[seed]) - value(controls[seed]) for seed in sorted(runs) if seed in controls]


def gap_curves(groups: dict, size: str, variant: str, control: str) -> tuple[list[int], list[list[float]]]:
    """Token counts and, per seed that both have, the variant's held-out loss minus the control's at each of them."""
    runs, controls = groups.get((size, variant), {}), groups.get((size, control), {})
    seeds = [seed for seed in sorted(runs) if seed in controls]
    if not seeds:
        return [], []
    tokens = [point[0] for point in controls[seeds[0]]["curve"]]
    gaps = []
    for seed in seeds:
        control_losses = dict(map(tuple, controls[seed]["curve"]))
        gaps.append([loss - control_losses[t] for t, loss in runs[seed]["curve"]])
    return tokens, gaps


# --------------------------------------------------------------------------------------------------------------------
# From scratch
# --------------------------------------------------------------------------------------------------------------------


def scratch_tables(runs: list[dict]) -> str:
    groups = grouped(runs, "scratch")
    sizes = sorted({size for size, _ in groups}, key=lambda size: size_params(groups, size))
    parts = []
    for size in sizes:
        rows = []
        for variant, label in SCRATCH_VARIANTS.items():
            group = groups.get((size, variant), {})
            if not group:
                continue
            first = next(iter(group.values()))
            deltas = paired(groups, size, variant, "prenorm", final_loss)
            rows.append(
                [
                    label,
                    f"{first['params']:,}",
                    str(len(group)),
                    f"{first['tokens']:,}",
                    spread([final_loss(run) for run in group.values()]),
                    "–" if variant == "prenorm" else signed_spread(deltas),
                    "–" if variant == "prenorm" else f"{sum(d < 0 for d in deltas)}/{len(deltas)}",
                    f"{statistics.mean(run['wall_s'] for run in group.values()):,.0f}",
                ]
            )
        header = [
            "variant", "parameters", "seeds", "tokens per run", "final held-out loss (mean ± sd)",
            "Δ vs PreNorm, same seed (mean ± sd)", "seeds below PreNorm", "training s per run",
        ]  # fmt: skip
        parts += [f"**Size `{size}`**\n", table(header, rows), ""]
        parts += [gap_table(groups, size), ""]
    return "\n".join(parts).rstrip() + "\n"


def gap_table(groups: dict, size: str) -> str:
    """The paired gap to PreNorm (mean over seeds) at every held-out evaluation: does it shrink, hold or flip?"""
    columns, rows = None, []
    for variant in ("block", "full"):
        tokens, gaps = gap_curves(groups, size, variant, "prenorm")
        if not gaps:
            continue
        columns = tokens
        means = [statistics.mean(seed_gaps[i] for seed_gaps in gaps) for i in range(len(tokens))]
        rows.append(
            [f"{SCRATCH_VARIANTS[variant]} − PreNorm ({seeds(len(gaps))})"] + [f"{m + 0.0:+.3f}" for m in means]
        )
    if columns is None:
        return ""
    header = ["tokens seen"] + [short_count(t) for t in columns]
    return table(header, rows)


def plot_scratch(runs: list[dict], path: Path) -> None:
    groups = grouped(runs, "scratch")
    sizes = sorted({size for size, _ in groups}, key=lambda size: size_params(groups, size))
    figure = Figure(figsize=(6 * max(1, len(sizes)), 4.5))
    for axes, size in zip(figure.subplots(1, max(1, len(sizes)), squeeze=False)[0], sizes, strict=False):
        for index, variant in enumerate(("block", "full")):
            tokens, gaps = gap_curves(groups, size, variant, "prenorm")
            if not gaps:
                continue
            columns = list(zip(*gaps, strict=True))
            label = f"{SCRATCH_VARIANTS[variant]} − PreNorm ({seeds(len(gaps))})"
            axes.plot(tokens, [statistics.mean(c) for c in columns], "o-", color=f"C{index + 1}", label=label, ms=3)
            axes.fill_between(
                tokens, [min(c) for c in columns], [max(c) for c in columns], color=f"C{index + 1}", alpha=0.2
            )
        axes.axhline(0, color="C0", lw=1, label="PreNorm (same seed)")
        axes.set_title(f"size {size} ({size_params(groups, size) / 1e6:.1f}M parameters)")
        axes.set_xlabel("training tokens (bytes)")
        axes.set_ylabel("held-out loss minus PreNorm's (nats/byte)")
        axes.legend(fontsize=8)
    figure.suptitle("From scratch: gap to PreNorm (line: mean; band: min to max over seeds)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------------------------------
# Continued pretraining: the conversion study and SmolLM2
# --------------------------------------------------------------------------------------------------------------------


def cpt_table(runs: list[dict], study: str) -> str:
    groups = grouped(runs, study)
    variants = sorted({variant for _, variant in groups}, key=lambda v: (v != CONTROL[study], v != "converted-cpt", v))
    final_names = sorted({name for run in runs if run["study"] == study for name in run["final"]})
    rows = []
    for variant in variants:
        size = next(size for size, v in groups if v == variant)
        group = groups[size, variant]
        first = next(iter(group.values()))
        deltas = paired(groups, size, variant, CONTROL[study], final_loss)
        row = [
            first["label"],
            str(len(group)),
            f"{first['tokens']:,}",
            spread([run["curve"][0][1] for run in group.values()]),
            spread([final_loss(run) for run in group.values()]),
            "–"
            if variant == CONTROL[study]
            else f"{signed_spread(deltas)} ({sum(d < 0 for d in deltas)}/{len(deltas)} below)",
        ]
        if study == "convert-tiny":  # the original domain before continued pretraining: the parents' final loss
            parents = {run["id"]: run for run in runs}
            row.append(
                spread([final_loss(parents[run["parent"]]) for run in group.values() if run["parent"] in parents])
            )
        for name in final_names:
            values = [run["final"][name] for run in group.values()]
            final_deltas = paired(groups, size, variant, CONTROL[study], lambda run, name=name: run["final"][name])
            row += [spread(values), "–" if variant == CONTROL[study] else signed_spread(final_deltas)]
        row.append(f"{statistics.mean(run['wall_s'] for run in group.values()):,.0f}")
        rows.append(row)
    trained_on = "new domain (code)" if study == "convert-tiny" else "training domain (docs)"
    names = {"docs": "original domain (docs)", "unseen-code": "unseen code"}
    header = [
        "variant",
        "seeds",
        "tokens",
        f"held-out, {trained_on}: start",
        "final (mean ± sd)",
        "Δ vs plain CPT, same seed",
    ]
    if study == "convert-tiny":
        header.append("original domain (docs): before CPT")
    for name in final_names:
        header += [f"{names.get(name, name)}: final", "Δ vs plain CPT"]
    return table(header + ["training s per run"], rows) + "\n"


def plot_cpt(runs: list[dict], study: str, title: str, path: Path) -> None:
    """Held-out loss (mean over seeds; band min to max) of every arm, and each arm's gap to plain CPT."""
    groups = grouped(runs, study)
    figure = Figure(figsize=(12, 4.5))
    curves_axes, gap_axes = figure.subplots(1, 2)
    variants = sorted({variant for _, variant in groups}, key=lambda v: (v != CONTROL[study], v))
    for index, variant in enumerate(variants):
        size = next(size for size, v in groups if v == variant)
        group = list(groups[size, variant].values())
        tokens = [point[0] for point in group[0]["curve"]]
        columns = list(zip(*[[loss for _, loss in run["curve"]] for run in group], strict=True))
        label = f"{group[0]['label']} ({seeds(len(group))})"
        curves_axes.plot(tokens, [statistics.mean(c) for c in columns], "o-", color=f"C{index}", label=label, ms=3)
        curves_axes.fill_between(
            tokens, [min(c) for c in columns], [max(c) for c in columns], color=f"C{index}", alpha=0.15
        )
        gap_tokens, gaps = gap_curves(groups, size, variant, CONTROL[study])
        if variant != CONTROL[study] and gaps:
            gap_columns = list(zip(*gaps, strict=True))
            gap_axes.plot(gap_tokens, [statistics.mean(c) for c in gap_columns], "o-", color=f"C{index}", ms=3)
            gap_axes.fill_between(
                gap_tokens, [min(c) for c in gap_columns], [max(c) for c in gap_columns], color=f"C{index}", alpha=0.15
            )
    gap_axes.axhline(0, color="C0", lw=1)
    curves_axes.set_ylabel("held-out loss (nats/token)")
    gap_axes.set_ylabel("minus plain CPT's, same seed")
    for axes in (curves_axes, gap_axes):
        axes.set_xlabel("training tokens")
    curves_axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def progress_table(runs: list[dict], expected: dict[str, int]) -> str:
    done = defaultdict(int)
    for run in runs:
        done[run["study"]] += 1
    rows = [[study, f"{done[study]} of {count}"] for study, count in expected.items()]
    return table(["study", "runs finished"], rows) + "\n"


# --------------------------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------------------------


def blocks(runs: list[dict], expected: dict[str, int], docs: Path) -> dict[str, str]:
    """The page's generated blocks by name; the plots are written into `docs` on the way."""
    found = {run["study"] for run in runs}
    made = {"progress": progress_table(runs, expected)}
    if "scratch" in found:
        plot_scratch(runs, docs / "quality_scratch_gap.png")
        made["scratch"] = scratch_tables(runs) + "\n![gap to PreNorm](quality_scratch_gap.png)\n"
    if "convert-tiny" in found:
        plot_cpt(
            runs,
            "convert-tiny",
            "Conversion study: small PreNorm model continued on code",
            docs / "quality_convert_tiny.png",
        )
        made["convert-tiny"] = cpt_table(runs, "convert-tiny") + "\n![conversion study](quality_convert_tiny.png)\n"
    if "cpt-smollm2" in found:
        plot_cpt(runs, "cpt-smollm2", "SmolLM2-135M-Instruct continued on the docs", docs / "quality_cpt_smollm2.png")
        made["cpt-smollm2"] = cpt_table(runs, "cpt-smollm2") + "\n![SmolLM2](quality_cpt_smollm2.png)\n"
    return made


def fill(page: str, made: dict[str, str]) -> str:
    """`page` with each generated block replaced; a study with no finished run yet says so."""
    return BLOCK.sub(lambda m: m[1] + made.get(m["name"], "No run of this study has finished yet.\n") + m[3], page)


def main(results: Path, docs: Path, expected: dict[str, int]) -> int:
    runs = load(results)
    page_path = docs / "quality.md"
    page = page_path.read_text()
    page_path.write_text(fill(page, blocks(runs, expected, docs)))
    print(f"{page_path}: {len(runs)} runs from {results}")
    return 0
