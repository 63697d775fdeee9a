"""Where each layer looks: depth-attention maps, magnitude profiles and gradient profiles (paper §5.2, Fig. 5 and 8).

`analyze(...)` runs a model (and optionally its PreNorm source as a baseline) on real text and writes
`depth_weights.png`, `magnitudes.png`, `gradients.png` and `analysis.json` with every number behind them.
`depth_weight_entropy(...)` is the per-sublayer summary that training logs at evaluation steps.
"""

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel

from .configuration_attnres import AttnResConfig, layer_types_of
from .depth_mixing import DepthState
from .depth_rules import StreamCoefficients
from .errors import AnalysisError
from .families import FAMILIES
from .folders import check_output_dir, output_lock, replace_fix, written_whole
from .modeling_attnres import AttnResForCausalLM
from .verification import SAMPLE_TEXT

if TYPE_CHECKING:  # matplotlib is the `plots` extra: imported where a picture is drawn (training needs only entropies)
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure


# --------------------------------------------------------------------------------------------------------------------
# Numbers
# --------------------------------------------------------------------------------------------------------------------


def depth_weight_entropy(depth_weights: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Entropy (nats) of each sublayer's softmax over its sources, averaged over tokens -> [batch, sublayers + 1].

    `depth_weights` is the model's `output_depth_weights` output; a single source has entropy 0, k equal ones log k.
    """
    return torch.stack([-(w * w.clamp_min(1e-30).log()).sum(-1).mean(-1) for w in depth_weights], dim=-1)


def sublayer_names(num_layers: int, sublayers_per_layer: int = 2) -> list[str]:
    """A0, M0, A1, M1, ...: attention and MLP sublayers of each decoder layer, in order; B0, B1, ...: the residual
    branches of one-branch layers (attention and MLP in parallel, or one mixer), one per layer."""
    kinds = ("A", "M") if sublayers_per_layer == 2 else ("B",)
    return [f"{kind}{layer}" for layer in range(num_layers) for kind in kinds]


def config_sublayer_names(config: AttnResConfig) -> list[str]:
    """The model's sublayers (residual branches), as `sublayer_names` labels them."""
    return sublayer_names(config.num_hidden_layers, config.sublayers_per_layer())


def source_columns(config: AttnResConfig) -> list[str]:
    """Column labels of the depth-weight map: what a sublayer can attend to."""
    if config.attnres_mode == "full":
        return ["embedding"] + config_sublayer_names(config)
    num_blocks = sum(config.sublayer_starts_block(s) for s in range(config.num_sublayers()))
    return ["embedding"] + [f"block {n}" for n in range(1, num_blocks)] + ["partial sum"]


def depth_weight_map(config: AttnResConfig, depth_weights: tuple[torch.Tensor, ...]) -> list[list[float | None]]:
    """Rows: sublayers then the output aggregation; columns: `source_columns`; None where a source is not visible."""
    columns = source_columns(config)
    rows = []
    for sublayer, weights in enumerate(depth_weights):
        mean_weights = weights.float().mean(dim=tuple(range(weights.dim() - 1))).tolist()
        row = [None] * len(columns)
        if config.attnres_mode == "full":  # the embedding, then the latest outputs (all, unless a window drops some)
            num_latest = len(mean_weights) - 1
            row[0], row[sublayer + 1 - num_latest : sublayer + 1] = mean_weights[0], mean_weights[1:]
            rows.append(row)
            continue
        is_output = sublayer == len(depth_weights) - 1
        has_partial = is_output or not config.sublayer_starts_block(sublayer)
        completed = len(mean_weights) - has_partial
        row[:completed] = mean_weights[:completed]
        if has_partial:
            row[-1] = mean_weights[-1]
        rows.append(row)
    return rows


@dataclass
class SublayerProbe:
    """Hooks that record, per sublayer, the RMS of what it reads and of what it writes."""

    input_rms: list[float]
    output_rms: list[float]
    parameter_groups: list[list[nn.Parameter]]


def _rms(hidden_states: torch.Tensor) -> float:
    return float(hidden_states.detach().float().pow(2).mean(-1).sqrt().mean())


def layer_sublayers(family, text_config, layer: nn.Module, layer_type: str) -> list[tuple]:
    """A decoder layer's sublayers (residual branches), each as (the module that reads its input first, the modules
    whose outputs it adds, their output norms), for an AttnRes layer or a source family's own."""
    norms = family.norms(layer_type, lambda name: getattr(layer, name, None) is not None)
    mlp_layer = family.mlp_layers.get(layer_type)
    mlp_parts = [name for name in ((mlp_layer,) if mlp_layer else family.mlp) if getattr(layer, name, None) is not None]
    # Each token mixer (Falcon-H1's run in parallel, their outputs measured before their multipliers)
    attention = [
        (norms.attention_input_norm, mixer.module, norms.attention_output_norm) for mixer in family.mixers(layer_type)
    ]
    mlp = [(norms.mlp_input_norm, part, norms.mlp_output_norm) for part in mlp_parts]
    branches = [attention, mlp] if not family.has_one_branch(text_config) else [attention + mlp]
    sublayers = []
    for parts in branches:
        input_norm, body, _ = parts[0]
        # What the sublayer reads first: its input norm, or the body itself in families without one (OLMo-2)
        reader = getattr(layer, input_norm) if input_norm else getattr(layer, body)
        bodies = [getattr(layer, name) for _, name, _ in parts]
        writers = [
            getattr(layer, output_norm) if output_norm else getattr(layer, name) for _, name, output_norm in parts
        ]
        sublayers.append((reader, bodies, writers))
    return sublayers


def probe_sublayers(model: PreTrainedModel) -> tuple[SublayerProbe, list]:
    """Install the hooks on an AttnRes model or a plain model of a supported family; returns (probe, handles).

    A sublayer's output is the sum of what its parts write: in a one-branch layer (attention and MLP in parallel) the
    attention's and the MLP's outputs together."""
    text_config = model.config.text_config if isinstance(model.config, AttnResConfig) else model.config
    family = FAMILIES[text_config.model_type]
    layers = model.get_decoder().layers
    per_layer = 1 if family.has_one_branch(text_config) else 2
    num_sublayers = per_layer * len(layers)
    probe = SublayerProbe(input_rms=[0.0] * num_sublayers, output_rms=[0.0] * num_sublayers, parameter_groups=[])
    handles = []
    written: dict[int, list[torch.Tensor]] = {}

    def record_input(index: int):
        def hook(module, args, kwargs, output):
            # attention is called with hidden_states=..., the norms and MLPs positionally
            probe.input_rms[index] = _rms(args[0] if args else kwargs["hidden_states"])

        return hook

    def record_output(index: int, parts: int):
        def hook(module, args, kwargs, output):
            written.setdefault(index, []).append((output[0] if isinstance(output, tuple) else output).detach().float())
            if len(written[index]) == parts:  # all parts of the branch have written: their sum is its output
                probe.output_rms[index] = _rms(sum(written.pop(index)))

        return hook

    for layer_idx, (layer, layer_type) in enumerate(zip(layers, layer_types_of(text_config), strict=True)):
        for offset, (reader, bodies, writers) in enumerate(layer_sublayers(family, text_config, layer, layer_type)):
            index = per_layer * layer_idx + offset
            handles.append(reader.register_forward_hook(record_input(index), with_kwargs=True))
            for writer in writers:
                handles.append(writer.register_forward_hook(record_output(index, len(writers)), with_kwargs=True))
            modules = dict.fromkeys((reader, *bodies, *writers))  # each module once, in order
            probe.parameter_groups.append([p for module in modules for p in module.parameters()])
    return probe, handles


def profile_model(model: PreTrainedModel, input_ids: torch.Tensor) -> dict:
    """One forward and backward of the LM loss on `input_ids`: magnitudes, gradient norms, depth weights."""
    probe, handles = probe_sublayers(model)
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    is_attnres = isinstance(model.config, AttnResConfig)
    try:
        extra = {"output_depth_weights": True} if is_attnres else {}
        outputs = model(input_ids, labels=input_ids, **extra)
        outputs.loss.backward()
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    gradient_norms = [
        math.sqrt(sum(float(p.grad.float().pow(2).sum()) for p in group if p.grad is not None))
        for group in probe.parameter_groups
    ]
    model.zero_grad(set_to_none=True)
    profile = {
        "loss": float(outputs.loss.detach()),
        "input_rms": probe.input_rms,
        "output_rms": probe.output_rms,
        "gradient_norm": gradient_norms,
    }
    if is_attnres and outputs.depth_weights is not None:  # the recurrences weigh no sources
        profile["depth_weights"] = tuple(w.detach() for w in outputs.depth_weights)
    return profile


# --------------------------------------------------------------------------------------------------------------------
# The depth-mixing matrix M of any rule (paper §3, Table 1): row i holds how much of each source (the embedding, then
# each earlier sublayer's output) enters sublayer i's input before its norm, the last row the output's
# --------------------------------------------------------------------------------------------------------------------


def spread_over_outputs(config: AttnResConfig, row: int, weights: torch.Tensor) -> torch.Tensor:
    """One sublayer's weights over its sources [..., n] -> its row of M [..., 1 + 2L]: the embedding, then each
    sublayer's output (a block's weight on each of its outputs; 0 where a window or causality hides it)."""
    num_sublayers = config.num_sublayers()
    # Output j's source index: the embedding is source 0, each block start opens the next (sublayer 0 opens block 1)
    groups = [sum(config.sublayer_starts_block(s) for s in range(j + 1)) for j in range(row)]
    dropped = (groups[-1] if groups else 0) - (weights.shape[-1] - 1)  # the oldest blocks a window left out
    if config.attnres_scale_by_num_sources and config.attnres_mode in ("block", "full"):  # zero logits: the sum
        weights = weights * (weights.shape[-1] if config.attnres_score == "softmax" else 2)
    entries = weights.new_zeros(*weights.shape[:-1], 1 + num_sublayers)
    entries[..., 0] = weights[..., 0]
    for output, group in enumerate(groups):
        if group > dropped:
            entries[..., 1 + output] = weights[..., group - dropped]
    return entries


def recurrence_rows(coefficients: list[StreamCoefficients], output_read: torch.Tensor) -> torch.Tensor:
    """The recurrence unrolled: each stream as a weighted sum of the sources C [B,T,m,S] -> rows of M [B,T,R,S]"""
    batch_shape, num_streams = output_read.shape[:-1], output_read.shape[-1]
    streams = output_read.new_zeros(*batch_shape, num_streams, len(coefficients) + 1)
    streams[..., 0] = 1.0  # every stream starts as the embedding
    rows = []
    for sublayer, step in enumerate(coefficients):
        rows.append((step.read.unsqueeze(-2) @ streams).squeeze(-2))
        streams = step.carry @ streams
        streams[..., sublayer + 1] += step.write
    rows.append((output_read.unsqueeze(-2) @ streams).squeeze(-2))
    return torch.stack(rows, dim=-2)


def recurrence_coefficients(
    model: AttnResForCausalLM, run: Callable[[], Any]
) -> tuple[list[StreamCoefficients], StreamCoefficients]:
    """Each sublayer's coefficients of a recurrence (PreNorm, ReZero, LayerScale, Highway, mHC: the rule's
    `coefficients`), from the streams it read, and the output's read. The streams come from the layers' inputs; those
    the MLP reads, from the rule's write of its attention's output (as the layer adds it) to them. A one-branch layer
    reads its input stream once."""
    decoder = model.model
    rule, layers = decoder.rule, decoder.layers
    one_branch = model.config.sublayers_per_layer() == 1
    layer_streams, attention_outputs = [], []
    handles = [
        layer.register_forward_pre_hook(lambda m, args: layer_streams.append(args[0].detach())) for layer in layers
    ]
    mixer_outputs = []

    def record_mixer(layer, mixer, output):
        # The attention sublayer's output once each of its token mixers has run (Falcon-H1's in parallel: their sum)
        mixer_outputs.append(layer._mixer_output(mixer, output[0] if isinstance(output, tuple) else output))
        if len(mixer_outputs) == len(layer.mixers):
            attention_outputs.append(layer._sublayer_output(0, sum(mixer_outputs)).detach())
            mixer_outputs.clear()

    for layer in () if one_branch else layers:
        for mixer in layer.mixers:
            handles.append(
                getattr(layer, mixer.module).register_forward_hook(
                    lambda m, args, output, layer=layer, mixer=mixer: record_mixer(layer, mixer, output)
                )
            )
    handles.append(layers[-1].register_forward_hook(lambda m, args, output: layer_streams.append(output[0].detach())))
    try:
        run()
    finally:
        for handle in handles:
            handle.remove()
    if one_branch:
        streams = zip(layers, layer_streams[:-1], strict=True)
        steps = [rule.coefficients(stream, layer._head("branch")) for layer, stream in streams]
        output_head = tuple(getattr(decoder, f"output_attn_res_{part}") for part in rule.output_parts)
        return steps, rule.coefficients(layer_streams[-1], output_head)
    steps = []
    for layer, stream, attention_output in zip(layers, layer_streams[:-1], attention_outputs, strict=True):
        attention_head, mlp_head = layer._head("self_attention"), layer._head("mlp")
        depth = DepthState((), stream.new_zeros(0), stream)
        mlp_stream = rule.write(depth, attention_output, attention_head, norm=None).partial_sum
        steps += [rule.coefficients(stream, attention_head), rule.coefficients(mlp_stream, mlp_head)]
    output_head = tuple(getattr(decoder, f"output_attn_res_{part}") for part in rule.output_parts)
    return steps, rule.coefficients(layer_streams[-1], output_head)


@torch.no_grad()
def token_mixing_matrices(model: AttnResForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """Each token's depth-mixing matrix -> [B,T,R,S], R = 2L + 1 rows (A0, M0, ..., the output), S = 1 + 2L
    sources (the embedding, A0, M0, ...; in one-branch layers L + 1 of each, B0, B1, ...): the depth weights for
    AttnRes and DenseFormer, the products of the recurrence's coefficients for the others."""
    config, rule = model.config, model.model.rule
    if rule.no_mixing_matrix is not None:
        raise AnalysisError(f"analyze: {rule.no_mixing_matrix}: it has no depth-mixing matrix")
    input_ids = input_ids.to(model.device)

    def run():
        return model(input_ids, output_depth_weights=True)

    if rule.mixes_sources:  # their depth weights are their rows
        depth_weights = run().depth_weights
        rows = [spread_over_outputs(config, row, weights.float().cpu()) for row, weights in enumerate(depth_weights)]
        return torch.stack(rows, dim=-2)
    steps, output = recurrence_coefficients(model, run)
    steps = [StreamCoefficients(*(t.float().cpu() for t in step)) for step in steps]
    return recurrence_rows(steps, output.read.float().cpu())


def mixing_matrix(model: AttnResForCausalLM, input_ids: torch.Tensor) -> list[list[float | None]]:
    """M averaged over tokens: rows A0, M0, ..., the output; columns the embedding, A0, M0, ...; None where a row
    cannot see a source (a later sublayer's output)."""
    mean = token_mixing_matrices(model, input_ids).mean(dim=(0, 1))
    return [
        [value if column <= row else None for column, value in enumerate(values)]
        for row, values in enumerate(mean.tolist())
    ]


# --------------------------------------------------------------------------------------------------------------------
# Pictures
# --------------------------------------------------------------------------------------------------------------------


def _block_starts(config: AttnResConfig) -> list[int]:
    return [s for s in range(1, config.num_sublayers()) if config.sublayer_starts_block(s)]


def plot_depth_weights(report: dict, config: AttnResConfig, path: Path) -> None:
    from matplotlib.figure import Figure

    rows = report["sublayers"] + ["output"]
    matrix = torch.tensor([[math.nan if w is None else w for w in row] for row in report["depth_weights"]])
    columns = report["sources"]
    figure = Figure(figsize=(max(6.0, 0.45 * len(columns) + 3), max(5.0, 0.28 * len(rows) + 2)))
    axes = figure.subplots()
    image = axes.imshow(matrix.numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    figure.colorbar(image, ax=axes, label="depth-attention weight (mean over tokens)")
    axes.set_xticks(range(len(columns)), columns, rotation=60, ha="right", fontsize=8)
    kinds = {"A": "attention", "M": "MLP", "B": "branch"}
    labels = [f"{name} ({kinds[name[0]]})" for name in rows[:-1]]
    axes.set_yticks(range(len(rows)), labels + ["output aggregation"], fontsize=7)
    if config.attnres_mode == "block":
        for start in _block_starts(config):
            axes.axhline(start - 0.5, color="white", linewidth=1.2)
    axes.set_xlabel("source")
    axes.set_ylabel("sublayer (white lines: block boundaries)" if config.attnres_mode == "block" else "sublayer")
    layout = f"Block, {config.attnres_block_size} layers per block" if config.attnres_mode == "block" else "Full"
    # Zero pseudo-queries weigh every source alike: a converted model starts from uniform rows
    axes.set_title(f"Where each sublayer looks in depth ({layout})\nstart of training: uniform, 1 / number of sources")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_mixing_matrices(panels: dict[str, list[list[float | None]]], sublayers: list[str], path: Path) -> None:
    """Depth-mixing matrices side by side, one panel per model, on one colour scale centred at 0."""
    from matplotlib.figure import Figure

    matrices = {
        title: torch.tensor([[math.nan if w is None else w for w in row] for row in rows])
        for title, rows in panels.items()
    }
    largest = max(float(matrix.nan_to_num().abs().max()) for matrix in matrices.values()) or 1.0
    size = len(sublayers) + 1
    figure = Figure(figsize=(1.5 + len(matrices) * max(3.5, 0.3 * size), max(4.0, 0.25 * size + 2)))
    axes = figure.subplots(1, len(matrices), squeeze=False)[0]
    for panel, (title, matrix) in zip(axes, matrices.items(), strict=True):
        image = panel.imshow(matrix.numpy(), cmap="RdBu_r", vmin=-largest, vmax=largest, interpolation="nearest")
        panel.set_title(title, fontsize=9)
        step = max(1, size // 12)
        panel.set_xticks(range(0, size, step), (["emb"] + sublayers)[::step], rotation=60, fontsize=7)
        panel.set_yticks(range(0, size, step), (sublayers + ["out"])[::step], fontsize=7)
        panel.set_xlabel("source")
    axes[0].set_ylabel("reading sublayer")
    figure.colorbar(image, ax=list(axes), label="weight of the source in the input (mean over tokens)")
    figure.suptitle("Depth-mixing matrices M: how much of each source enters each sublayer's input")
    figure.savefig(path, dpi=120, format="png")  # `path` may be a staging name without the suffix


def _profile_axes(report: dict, config: AttnResConfig, title: str, ylabel: str) -> tuple["Figure", "Axes"]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=(10, 5))
    axes = figure.subplots()
    for start in _block_starts(config) if config.attnres_mode == "block" else []:
        axes.axvline(start - 0.5, color="grey", linestyle=":", linewidth=0.8)
    names = report["sublayers"]
    step = max(1, len(names) // 24)
    axes.set_xticks(range(0, len(names), step), names[::step], rotation=60, fontsize=8)
    axes.set_xlabel("sublayer (dotted lines: block boundaries)" if config.attnres_mode == "block" else "sublayer")
    axes.set_ylabel(ylabel)
    axes.set_yscale("log")
    axes.set_title(title)
    return figure, axes


def plot_magnitudes(report: dict, config: AttnResConfig, path: Path) -> None:
    figure, axes = _profile_axes(report, config, "Magnitudes through depth", "RMS over hidden units (mean over tokens)")
    x = range(len(report["sublayers"]))
    magnitudes = report["magnitudes"]
    axes.plot(x, magnitudes["attnres"]["output_rms"], "o-", color="C0", label="AttnRes: sublayer output")
    axes.plot(x, magnitudes["attnres"]["input_rms"], "s--", color="C0", alpha=0.6, label="AttnRes: depth-mixed input")
    if "baseline" in magnitudes:
        axes.plot(x, magnitudes["baseline"]["output_rms"], "o-", color="C1", label="baseline: sublayer output")
        axes.plot(
            x, magnitudes["baseline"]["input_rms"], "s--", color="C1", alpha=0.6, label="baseline: residual stream"
        )
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def plot_gradients(report: dict, config: AttnResConfig, path: Path) -> None:
    figure, axes = _profile_axes(report, config, "Gradient norm of the LM loss per sublayer", "gradient L2 norm")
    x = range(len(report["sublayers"]))
    axes.plot(x, report["gradients"]["attnres"], "o-", color="C0", label="AttnRes")
    if "baseline" in report["gradients"]:
        axes.plot(x, report["gradients"]["baseline"], "o-", color="C1", label="baseline (PreNorm)")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# --------------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------------


def analyze(
    model: AttnResForCausalLM,
    input_ids: torch.Tensor,
    output_dir: str | Path,
    baseline: PreTrainedModel | None = None,
    compare: dict[str, AttnResForCausalLM] | None = None,
) -> dict:
    """Profile `model` (and `baseline`, a plain model of the same family) on `input_ids` [batch, tokens]; write the
    pictures and `analysis.json` into `output_dir`, and return the report. `compare` (label -> model, any rule) adds
    those models' depth-mixing matrices beside this one's."""
    compare = compare or {}
    for label, other in {"analyze": model, **compare}.items():
        if not isinstance(other.config, AttnResConfig):
            raise AnalysisError(
                f"{label}: expected an AttnRes model, got {type(other).__name__}; pass a plain model as baseline"
            )
    config = model.config
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    input_ids = input_ids.to(model.device)
    profile = profile_model(model, input_ids)
    report = {
        "model": str(config.name_or_path),
        "mode": config.attnres_mode,
        "block_size": config.attnres_block_size if config.attnres_mode == "block" else None,
        "num_layers": config.num_hidden_layers,
        "tokens": int(input_ids.numel()),
        "sublayers": config_sublayer_names(config),
        "loss": {"attnres": profile["loss"]},
        "magnitudes": {"attnres": {"input_rms": profile["input_rms"], "output_rms": profile["output_rms"]}},
        "gradients": {"attnres": profile["gradient_norm"]},
    }
    if "depth_weights" in profile:  # the rules that weigh sources: their weights as they are, and how spread
        report |= {
            "sources": source_columns(config),
            "num_sources": config.num_sources(),
            "depth_weights": depth_weight_map(config, profile["depth_weights"]),
            "entropy": depth_weight_entropy(profile["depth_weights"]).mean(0).tolist(),
            "max_entropy": [math.log(n) for n in config.num_sources()],
        }
    mixing = {}
    for label, other in {"this model": model, **compare}.items():
        if other.config.num_hidden_layers != config.num_hidden_layers:
            raise AnalysisError(
                f"--compare {label}: it has {other.config.num_hidden_layers} layers, the model "
                f"{config.num_hidden_layers}; compare models of one depth"
            )
        if other.model.rule.no_mixing_matrix is None:  # else no weighted sum of the sources to draw
            mixing[f"{label}: {other.config.attnres_mode}"] = mixing_matrix(other, input_ids)
    report["mixing_matrices"] = mixing
    if baseline is not None:
        baseline_profile = profile_model(baseline, input_ids.to(baseline.device))
        report["loss"]["baseline"] = baseline_profile["loss"]
        report["magnitudes"]["baseline"] = {
            "input_rms": baseline_profile["input_rms"],
            "output_rms": baseline_profile["output_rms"],
        }
        report["gradients"]["baseline"] = baseline_profile["gradient_norm"]
    if "depth_weights" in report:
        plot_depth_weights(report, config, output_dir / "depth_weights.png")
    if mixing:
        plot_mixing_matrices(mixing, report["sublayers"], output_dir / "mixing_matrices.png")
    plot_magnitudes(report, config, output_dir / "magnitudes.png")
    plot_gradients(report, config, output_dir / "gradients.png")
    (output_dir / "analysis.json").write_text(json.dumps(report, indent=1))
    return report


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres analyze`
# --------------------------------------------------------------------------------------------------------------------


def read_text(args: argparse.Namespace) -> str:
    """The text to analyse: a file, the first rows of a dataset (streamed), or the built-in sample."""
    if args.text is not None:
        return args.text.read_text(encoding="utf-8")
    if args.dataset is None:
        return SAMPLE_TEXT
    import datasets

    rows = datasets.load_dataset(args.dataset, args.dataset_config, split=args.split, streaming=True)
    pieces, length = [], 0
    for row in rows:
        if args.text_field not in row:
            raise AnalysisError(f"--text-field: the dataset has no column {args.text_field!r}; it has {sorted(row)}")
        pieces.append(row[args.text_field])
        length += len(row[args.text_field])
        if length > 16 * args.tokens:  # comfortably more characters than tokens needed
            break
    return "\n\n".join(pieces)


def run_analyze(args: argparse.Namespace) -> int:
    from .sources import check_tokenizer, load_source, load_source_tokenizer, resolve_source

    source, gguf_file = None, None
    if args.baseline is not None:
        source, gguf_file = resolve_source(args.baseline, args.baseline_gguf_file)
    check_tokenizer(args.model)  # its tokenizer encodes the text for both models: the baseline needs none
    inputs = {"the model": args.model, "the baseline": source, "the text": args.text, "the dataset": args.dataset}
    inputs |= {f"--compare model {n}": folder for n, folder in enumerate(args.compare or (), start=1)}
    with output_lock(args.output, AnalysisError):  # two analyses into one folder would mix their files
        check_output_dir(args.output, AnalysisError, inputs, replace_fix(args.overwrite))
        # An AttnRes model loads with the installed classes, never its folder's copy of them; --trust-remote-code is
        # for a baseline (or a wrong model) that brings code of its own
        model = load_source(args.model, trust_remote_code=args.trust_remote_code).to(args.device)
        tokenizer = load_source_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
        input_ids = tokenizer(read_text(args), return_tensors="pt").input_ids[:, : args.tokens]
        baseline = None
        if source is not None:
            baseline = load_source(source, gguf_file=gguf_file, trust_remote_code=args.trust_remote_code)
            baseline = baseline.to(args.device)
        compare = {
            str(folder): load_source(folder, trust_remote_code=args.trust_remote_code).to(args.device)
            for folder in args.compare or ()
        }
        for label, other in compare.items():  # they read the model's tokens
            if other.config.get_text_config().vocab_size != model.config.get_text_config().vocab_size:
                raise AnalysisError(
                    f"--compare {label}: its vocabulary is not the model's; compare models of one tokenizer"
                )
        with written_whole(args.output) as staging:  # --overwrite: the earlier analysis goes whole, none of it stays
            report = analyze(model, input_ids, staging, baseline=baseline, compare=compare)
    written = [name for name in ("depth_weights.png", "mixing_matrices.png") if (args.output / name).exists()]
    if "entropy" in report:
        mean_entropy = sum(report["entropy"]) / len(report["entropy"])
        print(f"Analysed {report['tokens']} tokens (mean depth-weight entropy {mean_entropy:.3f} nats); wrote")
    else:
        print(f"Analysed {report['tokens']} tokens ({report['mode']} weighs no sources: no depth weights); wrote")
    print(f"{', '.join(written + ['magnitudes.png', 'gradients.png'])} and analysis.json to {args.output}")
    return 0
