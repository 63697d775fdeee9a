"""docs/quality.md's tables and plots, made from the quality study's JSON files (`python benchmarks/quality.py
--report`): the page's hand-written reading stays, and every block between `<!-- report: NAME -->` and
`<!-- /report -->` is replaced by what the files say now, so the figures on the page are always the committed ones.

Every comparison is paired (the same seed is a pair: same initial weights where the arms share them, same batches,
same held-out documents) and given as the mean difference with its 95% t-interval and the paired t-test's p-value.
"""

import json
import math
import re
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from attnres.compare import holm
from attnres.compare import paired_interval as interval

CONTROL = {
    "sweep": None,
    "table4": "prenorm",
    "long": "prenorm",
    "convert-tiny": "plain-cpt",
    "cpt-smollm2": "plain-cpt",
    "rates": None,
    "long12m": "prenorm",
}
# The paper's Table 4 (436M parameters, validation loss); our rule and ablation names (quality.ABLATIONS) as keys
PAPER_TABLE4 = {
    "prenorm": 1.766,
    "denseformer": 1.767,
    "mhc": 1.747,
    "full": 1.737,
    "block": 1.746,
    "full-projected-query": 1.731,
    "full-scalar-mixing": 1.749,
    "full-sigmoid": 1.741,
    "full-no-key-norm": 1.743,
    "full-window": 1.764,
    "block-multihead": 1.752,
    "block-no-key-norm": 1.750,
}
BLOCK = re.compile(r"(<!-- report: (?P<name>[\w-]+) -->\n).*?(<!-- /report -->)", re.DOTALL)


def load(results: Path, labels: dict[str, str]) -> list[dict[str, Any]]:
    """The results, each under the label its variant has now (`labels`, quality.RULES) where it has one: the committed
    runs of "rezero" and "denseformer" say "ReZero" and "DenseFormer", the names of the forms they trained when they
    ran, ReZero on PreNorm and DenseFormer per sublayer now."""
    runs = [json.loads(path.read_text()) for path in sorted(results.glob("*.json"))]
    return [run | {"label": labels.get(run["variant"], run["label"])} for run in runs]


# --------------------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------------------


def final_loss(run: dict) -> float:
    return run["curve"][-1][1]


def spread(values: list[float], digits: int = 4) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ± {statistics.stdev(values):.{digits}f}"


def paired_text(differences: list[float], digits: int = 4) -> str:
    """'-0.0521 [-0.1029, -0.0013], p = 0.047 (3 pairs)': the paired difference as every table and sentence gives it."""
    if not differences:
        return "–"
    mean, low, high, p = interval(differences)
    if math.isnan(low):
        return f"{mean:+.{digits}f} (1 pair: no interval)"
    return f"{mean:+.{digits}f} [{low:+.{digits}f}, {high:+.{digits}f}], p = {p:.2g} ({pairs(len(differences))})"


def pairs(count: int) -> str:
    return "1 pair" if count == 1 else f"{count} pairs"


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


def sizes_of(groups: dict) -> list[str]:
    """The sizes in `groups`, smallest model first."""
    params = defaultdict(list)
    for (size, _), group in groups.items():
        params[size] += [run["params"] for run in group.values()]
    return sorted(params, key=lambda size: min(params[size]))


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


def made_alike(run: dict, control: dict) -> bool:
    """Whether two runs were made on the same kind of CPU with the same kernels, so that their speeds compare: the
    machine sets the speed (one PreNorm run took 0.92 CPU s per step on one machine and 0.70 on another)."""
    return (run.get("cpu"), run.get("kernels")) == (control.get("cpu"), control.get("kernels"))


def cpu_cost(groups: dict, size: str, variant: str, control: str | None) -> str:
    """CPU seconds per training step (median over the run's steps, mean over seeds), and its ratio to the control's:
    the mean over seeds of the same-seed ratio, from the pairs made alike."""
    seconds = statistics.mean(run["cpu_s_per_step"] for run in groups[size, variant].values())
    if control is None or variant == control or (size, control) not in groups:
        return f"{seconds:.3f}"
    runs, controls = groups[size, variant], groups[size, control]
    ratios = [
        runs[seed]["cpu_s_per_step"] / controls[seed]["cpu_s_per_step"]
        for seed in sorted(runs)
        if seed in controls and made_alike(runs[seed], controls[seed])
    ]
    return f"{seconds:.3f} ({statistics.mean(ratios):.2f}x)" if ratios else f"{seconds:.3f}"


# --------------------------------------------------------------------------------------------------------------------
# The learning-rate sweep
# --------------------------------------------------------------------------------------------------------------------


def sweep_table(runs: list[dict]) -> str:
    groups = grouped(runs, "sweep")
    parts = []
    for size in sizes_of(groups):
        group = sorted((run for (s, _), seeds in groups.items() if s == size for run in seeds.values()),
                       key=lambda run: run["lr"])  # fmt: skip
        best = min(group, key=final_loss)
        rows = [
            [
                f"{run['lr']:g}" + (" (best: every arm's rate)" if run is best else ""),
                f"{run['params']:,}",
                f"{run['tokens']:,}",
                f"{run['curve'][len(run['curve']) // 2][1]:.4f}",
                f"{final_loss(run):.4f}",
                f"{run['cpu_s_per_step']:.3f}",
            ]
            for run in group
        ]
        header = ["learning rate", "parameters", "tokens", "held-out loss at half the run", "final held-out loss",
                  "CPU s per step"]  # fmt: skip
        parts += [f"**Size `{size}`** (PreNorm, seed {group[0]['seed']})\n", table(header, rows), ""]
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------------------------
# From scratch: Table 4 and the long runs
# --------------------------------------------------------------------------------------------------------------------


def holm_over_study(groups: dict, value) -> dict[tuple[str, str], float]:
    """Holm-adjusted p-values of every (size, rule) paired with PreNorm in more than one seed, over all of them."""
    differences = {
        (size, variant): paired(groups, size, variant, "prenorm", value)
        for size, variant in groups
        if variant != "prenorm"
    }
    tested = [key for key, values in differences.items() if len(values) > 1]
    return dict(zip(tested, holm([interval(differences[key])[3] for key in tested]), strict=True))


def scratch_table(runs: list[dict], study: str) -> str:
    """Each rule's final held-out loss, paired with PreNorm's by seed: raw p-values, and Holm's over every comparison
    of the study (both sizes)."""
    groups = grouped(runs, study)
    adjusted = holm_over_study(groups, final_loss)
    parts = []
    for size in sizes_of(groups):
        rows = []
        variants = [variant for s, variant in groups if s == size]
        for variant in sorted(variants, key=lambda v: (v != "prenorm", v)):
            group = groups[size, variant]
            first = next(iter(group.values()))
            row = [first["label"]]
            if study == "table4":
                row.append(f"{PAPER_TABLE4[variant]:.3f}" if variant in PAPER_TABLE4 else "–")
            row += [
                f"{first['params']:,}",
                str(len(group)),
                f"{first['tokens']:,}",
                f"{first['lr']:g}",
                spread([final_loss(run) for run in group.values()]),
                "–" if variant == "prenorm" else paired_text(paired(groups, size, variant, "prenorm", final_loss)),
                f"{adjusted[size, variant]:.2g}" if (size, variant) in adjusted else "–",
                cpu_cost(groups, size, variant, "prenorm"),
            ]
            rows.append(row)
        header = ["rule"] + (["paper, 436M (val. loss)"] if study == "table4" else []) + [
            "parameters", "seeds", "tokens per run", "learning rate", "final held-out loss (mean ± sd)",
            "Δ vs PreNorm, same seed: mean [95% CI], p", f"p, Holm over the study's {len(adjusted)}",
            "CPU s per step (vs PreNorm)",
        ]  # fmt: skip
        parts += [f"**Size `{size}`**\n", table(header, rows), "", gap_table(groups, size), ""]
    return "\n".join(parts).rstrip() + "\n"


def gap_table(groups: dict, size: str) -> str:
    """The paired gap to PreNorm at every held-out evaluation (mean, and the 95% interval's ends): does it shrink,
    hold or flip?"""
    columns, rows = None, []
    for variant in sorted(v for s, v in groups if s == size and v != "prenorm"):
        tokens, gaps = gap_curves(groups, size, variant, "prenorm")
        if not gaps:
            continue
        columns = tokens
        label = next(iter(groups[size, variant].values()))["label"]
        cells = []
        for i in range(len(tokens)):
            mean, low, high, _ = interval([seed_gaps[i] for seed_gaps in gaps])
            cells.append(f"{mean + 0.0:+.3f}" if math.isnan(low) else f"{mean + 0.0:+.3f} [{low:+.3f}, {high:+.3f}]")
        rows.append([f"{label} − PreNorm ({pairs(len(gaps))})"] + cells)
    if columns is None:
        return ""
    return table(["tokens seen"] + [short_count(t) for t in columns], rows)


def plot_gaps(runs: list[dict], study: str, path: Path) -> None:
    """Each rule's paired gap to PreNorm along training, per size: mean and 95% interval."""
    groups = grouped(runs, study)
    sizes = sizes_of(groups)
    figure = Figure(figsize=(6 * max(1, len(sizes)), 4.5))
    for axes, size in zip(figure.subplots(1, max(1, len(sizes)), squeeze=False)[0], sizes, strict=False):
        for index, variant in enumerate(sorted(v for s, v in groups if s == size and v != "prenorm")):
            tokens, gaps = gap_curves(groups, size, variant, "prenorm")
            if not gaps:
                continue
            intervals = [interval(list(column)) for column in zip(*gaps, strict=True)]
            label = f"{next(iter(groups[size, variant].values()))['label']} − PreNorm ({pairs(len(gaps))})"
            axes.plot(tokens, [i[0] for i in intervals], "o-", color=f"C{index + 1}", label=label, ms=3)
            if len(gaps) > 1:
                axes.fill_between(tokens, [i[1] for i in intervals], [i[2] for i in intervals],
                                  color=f"C{index + 1}", alpha=0.2)  # fmt: skip
        axes.axhline(0, color="C0", lw=1, label="PreNorm (same seed)")
        params = min(run["params"] for (s, _), group in groups.items() if s == size for run in group.values())
        axes.set_title(f"size {size} ({params / 1e6:.1f}M parameters)")
        axes.set_xlabel("training tokens (bytes)")
        axes.set_ylabel("held-out loss minus PreNorm's (nats/byte)")
        axes.legend(fontsize=8)
    figure.suptitle("Gap to PreNorm, paired by seed (line: mean; band: 95% t-interval)", fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


# --------------------------------------------------------------------------------------------------------------------
# The evidence protocol: each rule's own rate on validation, the long runs scored once on the test split
# --------------------------------------------------------------------------------------------------------------------


def rates_table(runs: list[dict]) -> str:
    """Each rule's learning-rate grid with its final validation loss; the chosen rate, and whether it lies at the
    grid's edge (the grid grows past an edge, a factor 2 at a time, up to the study's limit)."""
    rows = []
    groups = grouped_by_rule(runs, "rates")
    for size, rule in sorted(groups, key=lambda key: (key[0], key[1] != "prenorm", key[1])):
        group = groups[size, rule]
        best = min(group, key=final_loss)
        edge = best["lr"] in (group[0]["lr"], group[-1]["lr"])
        for run in group:
            chosen = " (chosen" + (", at the grid's edge)" if edge else ")") if run is best else ""
            rows.append([size, run["label"], f"{run['lr']:g}{chosen}", f"{run['tokens']:,}",
                         f"{run['curve'][len(run['curve']) // 2][1]:.4f}", f"{final_loss(run):.4f}"])  # fmt: skip
    header = ["size", "rule", "learning rate", "tokens", "validation loss at half the run", "final validation loss"]
    return table(header, rows) + "\n"


def grouped_by_rule(runs: list[dict], study: str) -> dict[tuple[str, str], list[dict]]:
    """(size, rule) -> its runs of `study`, by learning rate."""
    groups: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for run in runs:
        if run["study"] == study:
            groups[run["size"], run["rule"]].append(run)
    return {key: sorted(group, key=lambda run: run["lr"]) for key, group in groups.items()}


def test_loss(run: dict) -> float:
    return run["test_loss"]


def test_table(runs: list[dict], study: str) -> str:
    """Each rule's test loss (scored once, at the end), paired with PreNorm's by seed, with raw and Holm-adjusted
    p-values over the study's comparisons; the share of the held-out splits' text found in training."""
    groups = grouped(runs, study)
    parts = []
    for size in sizes_of(groups):
        variants = sorted((v for s, v in groups if s == size), key=lambda v: (v != "prenorm", v))
        differences = {v: paired(groups, size, v, "prenorm", test_loss) for v in variants if v != "prenorm"}
        tested = [v for v in variants if len(differences.get(v, [])) > 1]
        adjusted = dict(zip(tested, holm([interval(differences[v])[3] for v in tested]), strict=True))
        rows = []
        for variant in variants:
            group = groups[size, variant]
            first = next(iter(group.values()))
            rows.append([
                first["label"], str(len(group)), f"{first['tokens']:,}", f"{first['lr']:g}",
                spread([test_loss(run) for run in group.values()]),
                "–" if variant == "prenorm" else paired_text(differences[variant]),
                f"{adjusted[variant]:.2g}" if variant in adjusted else "–",
                cpu_cost(groups, size, variant, "prenorm"),
            ])  # fmt: skip
        header = ["rule", "seeds", "tokens per run", "learning rate (own, on validation)", "test loss (mean ± sd)",
                  "Δ vs PreNorm on test, same seed: mean [95% CI], p", "p, Holm over this table",
                  "CPU s per step (vs PreNorm)"]  # fmt: skip
        corpora = [run["corpus"] for group in groups.values() for run in group.values()]
        shared = [corpus["shared_with_train"] for corpus in corpora]
        (window_bytes,) = {corpus["hold_out"]["window_bytes"] for corpus in corpora}
        overlap = ", ".join(
            f"{split} {min(s[split] for s in shared):.1%} to {max(s[split] for s in shared):.1%}"
            for split in ("validation", "test")
        )
        parts += [
            f"**Size `{size}`**\n",
            table(header, rows),
            "",
            f"Held-out text found verbatim in training ({window_bytes}-byte windows, over the seeds): {overlap}.",
            "",
            gap_table(groups, size),
            "",
        ]
    return "\n".join(parts).rstrip() + "\n"


# --------------------------------------------------------------------------------------------------------------------
# Continued pretraining: the conversion study and SmolLM2
# --------------------------------------------------------------------------------------------------------------------


def cpt_table(runs: list[dict], study: str) -> str:
    groups = grouped(runs, study)
    control = CONTROL[study]
    variants = sorted({variant for _, variant in groups}, key=lambda v: (v != control, v != "converted-cpt", v))
    final_names = sorted({name for run in runs if run["study"] == study for name in run["final"]})
    rows = []
    for variant in variants:
        size = next(size for size, v in groups if v == variant)
        group = groups[size, variant]
        first = next(iter(group.values()))
        row = [
            first["label"],
            str(len(group)),
            f"{first['tokens']:,}",
            spread([run["curve"][0][1] for run in group.values()]),
            spread([final_loss(run) for run in group.values()]),
            "–" if variant == control else paired_text(paired(groups, size, variant, control, final_loss)),
        ]
        for name in final_names:
            final_deltas = paired(groups, size, variant, control, lambda run, name=name: run["final"][name])
            row += [
                spread([run["final"][name] for run in group.values()]),
                "–" if variant == control else paired_text(final_deltas),
            ]
        row.append(cpu_cost(groups, size, variant, control))
        rows.append(row)
    trained_on = "new domain (code)" if study == "convert-tiny" else "training domain (docs)"
    names = {"docs": "original domain (docs)", "unseen-code": "unseen code"}
    header = ["variant", "seeds", "tokens", f"held-out, {trained_on}: start", "final (mean ± sd)",
              "Δ vs plain CPT, same seed: mean [95% CI], p"]  # fmt: skip
    for name in final_names:
        header += [f"{names.get(name, name)}: final", "Δ vs plain CPT"]
    return table(header + ["CPU s per step (vs plain CPT)"], rows) + "\n"


def plot_cpt(runs: list[dict], study: str, title: str, path: Path) -> None:
    """Held-out loss (mean over seeds; band min to max) of every arm, and each arm's gap to plain CPT."""
    groups = grouped(runs, study)
    control = CONTROL[study]
    figure = Figure(figsize=(12, 4.5))
    curves_axes, gap_axes = figure.subplots(1, 2)
    variants = sorted({variant for _, variant in groups}, key=lambda v: (v != control, v))
    for index, variant in enumerate(variants):
        size = next(size for size, v in groups if v == variant)
        group = list(groups[size, variant].values())
        tokens = [point[0] for point in group[0]["curve"]]
        columns = list(zip(*[[loss for _, loss in run["curve"]] for run in group], strict=True))
        label = f"{group[0]['label']} ({len(group)} seeds)"
        curves_axes.plot(tokens, [statistics.mean(c) for c in columns], "o-", color=f"C{index}", label=label, ms=3)
        curves_axes.fill_between(tokens, [min(c) for c in columns], [max(c) for c in columns], color=f"C{index}",
                                 alpha=0.15)  # fmt: skip
        gap_tokens, gaps = gap_curves(groups, size, variant, control)
        if variant != control and gaps:
            gap_axes.plot(gap_tokens, [statistics.mean(c) for c in zip(*gaps, strict=True)], "o-", color=f"C{index}",
                          ms=3)  # fmt: skip
    gap_axes.axhline(0, color="C0", lw=1)
    curves_axes.set_ylabel("held-out loss (nats/token)")
    gap_axes.set_ylabel("minus plain CPT's, same seed (mean)")
    for axes in (curves_axes, gap_axes):
        axes.set_xlabel("training tokens")
    curves_axes.legend(fontsize=7)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def progress_table(runs: list[dict], expected: dict[str, int]) -> str:
    """Runs finished per study, how many of them ran with the pinned vector kernels, and on which CPUs those ran (a
    run reproduces on a CPU of the kind it ran on)."""
    done, cpus = defaultdict(int), defaultdict(Counter)
    for run in runs:
        done[run["study"]] += 1
        if run.get("kernels") is not None:
            cpus[run["study"]][run["cpu"]] += 1
    rows = [
        [
            study,
            f"{done[study]} of {count}",
            str(cpus[study].total()),
            ", ".join(f"{n} {cpu}" for cpu, n in cpus[study].most_common()),
        ]
        for study, count in expected.items()
    ]
    return table(["study", "runs finished", "of them with pinned kernels", "made on"], rows) + "\n"


def corpus_line(runs: list[dict]) -> str:
    """The corpora the results were made on, by content hash: one line per corpus and kind."""
    seen = {}
    for run in runs:
        corpus = run["corpus"]
        seen[corpus["name"], corpus["kind"], corpus["sha256"]] = corpus
    return "".join(
        f"- `{name}` {kind}: {c['documents']} files, {c['bytes']:,} bytes, content SHA-256 `{sha256[:16]}…`\n"
        for (name, kind, sha256), c in sorted(seen.items())
    )


# --------------------------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------------------------


def blocks(runs: list[dict], expected: dict[str, int], docs: Path) -> dict[str, str]:
    """The page's generated blocks by name; the plots are written into `docs` on the way."""
    found = {run["study"] for run in runs}
    made = {"progress": progress_table(runs, expected) + ("\n" + corpus_line(runs) if runs else "")}
    if "sweep" in found:
        made["sweep"] = sweep_table(runs)
    for study, title in (("table4", "Table 4 at our scale"), ("long", "5M bytes")):
        if study in found:
            picture = f"quality_{study}_gap.png"
            plot_gaps(runs, study, docs / picture)
            made[study] = scratch_table(runs, study) + f"\n![{title}: gap to PreNorm]({picture})\n"
    if "rates" in found:
        made["rates"] = rates_table(runs)
    if "long12m" in found:
        plot_gaps(runs, "long12m", docs / "quality_long12m_gap.png")
        made["long12m"] = test_table(runs, "long12m") + "\n![12M bytes: gap to PreNorm](quality_long12m_gap.png)\n"
    if "convert-tiny" in found:
        plot_cpt(runs, "convert-tiny", "Conversion study: small PreNorm model continued on code",
                 docs / "quality_convert_tiny.png")  # fmt: skip
        made["convert-tiny"] = cpt_table(runs, "convert-tiny") + "\n![conversion study](quality_convert_tiny.png)\n"
    if "cpt-smollm2" in found:
        plot_cpt(runs, "cpt-smollm2", "SmolLM2-135M-Instruct continued on the docs", docs / "quality_cpt_smollm2.png")
        made["cpt-smollm2"] = cpt_table(runs, "cpt-smollm2") + "\n![SmolLM2](quality_cpt_smollm2.png)\n"
    return made


def fill(page: str, made: dict[str, str]) -> str:
    """`page` with each generated block replaced; a study with no finished run yet says so."""
    return BLOCK.sub(lambda m: m[1] + made.get(m["name"], "No run of this study has finished yet.\n") + m[3], page)


def main(results: Path, docs: Path, expected: dict[str, int], labels: dict[str, str]) -> int:
    runs = load(results, labels)
    page_path = docs / "quality.md"
    page = page_path.read_text()
    page_path.write_text(fill(page, blocks(runs, expected, docs)))
    print(f"{page_path}: {len(runs)} runs from {results}")
    return 0
