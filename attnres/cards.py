"""What a model folder says about itself: `attnres_origin.json`, the record of where the model came from and what was
done to it (converted, verified, trained), and the model card (README.md) made from that record and the config.

`attnres convert` and `attnres train` write both; `attnres push` makes the card again for the folder it uploads.
"""

import json
import re
from pathlib import Path
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from transformers import PreTrainedConfig

from . import __version__
from .auto import added_parameter_count
from .configuration_attnres import AttnResConfig
from .modeling_attnres import AttnResForCausalLM
from .rules import ATTNRES_MODES, RULES
from .sources import DEFAULT_MODEL_GGUF_FILE, DEFAULT_MODEL_NAME, DEFAULT_MODEL_PACKAGE
from .verification import VerificationReport

ORIGIN_FILE = "attnres_origin.json"
HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
PAPER = "Attention Residuals (Kimi Team, [arXiv 2603.15031](https://arxiv.org/abs/2603.15031))"


# --------------------------------------------------------------------------------------------------------------------
# The origin record
# --------------------------------------------------------------------------------------------------------------------


def read_origin(folder: Path) -> dict[str, Any] | None:
    """The origin record of a model folder that `attnres convert` or `attnres train` wrote; None for other folders.

    Keys: `source` (the original model's name: a Hub id or the name its files give, never a path of this machine),
    `source_file` (its GGUF file, if any), `conversion` (None for a model that was not converted, else `mode`,
    `block_size`, `dtype`, `attnres_version`, parameter counts and `verification`, the figures of
    `VerificationReport.to_dict` or None when not verified) and `training` (one entry per `attnres train` run).
    """
    file = folder / ORIGIN_FILE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else None


def write_origin(folder: Path, origin: dict[str, Any]) -> None:
    (folder / ORIGIN_FILE).write_text(json.dumps(origin, indent=2) + "\n", encoding="utf-8")


def origin_record(
    source: str, gguf_file: str | None = None, conversion: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The origin record of a model made from `source` (a Hub id or a folder, with its GGUF file if any), before any
    training run: `conversion` is its `conversion_record`, None for a model that was not converted."""
    return {
        "source": source_name(source, gguf_file),
        "source_file": gguf_file,
        "conversion": conversion,
        "training": [],
    }


def source_name(source: str, gguf_file: str | None = None) -> str:
    """What a model card calls a source: a Hub id as given; for local files, the original model's name as far as
    they tell (the embedded model's Hub id, a GGUF file's metadata, an origin record, a Hub cache folder), else the
    folder's own name. Never a path of this machine."""
    folder = Path(source)
    if not folder.is_dir():
        return source
    if gguf_file is not None:
        if gguf_file == DEFAULT_MODEL_GGUF_FILE and folder.name == DEFAULT_MODEL_PACKAGE:
            return DEFAULT_MODEL_NAME
        return gguf_model_name(folder / gguf_file)
    origin = read_origin(folder)
    if origin is not None:
        return origin["source"]
    hub_cache_folder = re.search(r"models--([^/]+)--([^/]+)/snapshots/", folder.resolve().as_posix() + "/")
    return "/".join(hub_cache_folder.groups()) if hub_cache_folder else folder.resolve().name


def gguf_model_name(gguf_path: Path) -> str:
    """The Hub repo a GGUF file says it was made from, else its organization and model name, else the file's name."""
    from gguf import GGUFReader  # needed to load a GGUF file at all; imported only for one

    fields = GGUFReader(gguf_path).fields

    def field(key: str) -> str | None:
        return str(fields[key].contents()) if key in fields else None

    if repository := field("general.source.huggingface.repository"):
        return repository
    if name := field("general.name"):
        organization = field("general.organization")
        return f"{organization}/{name}" if organization else name
    return gguf_path.stem


def conversion_record(
    model: AttnResForCausalLM, report: VerificationReport | None, converted_by: str = "attnres convert"
) -> dict[str, Any]:
    """The `conversion` entry of a converted model's origin record (see `read_origin`)."""
    num_added = added_parameter_count(model)
    # The depth layout without its prefix: the rule, and what of it a rule has (a block size only for Block AttnRes)
    layout = {name.removeprefix("attnres_"): value for name, value in model.config.depth_layout().items()}
    return {
        "converted_by": converted_by,
        "attnres_version": __version__,
        **layout,
        "dtype": str(model.dtype).removeprefix("torch."),
        "added_parameters": num_added,
        "source_parameters": model.num_parameters() - num_added,
        "verification": report.to_dict() if report is not None else None,
    }


# --------------------------------------------------------------------------------------------------------------------
# The model card
# --------------------------------------------------------------------------------------------------------------------


def describe_layout(config: AttnResConfig) -> str:
    """The depth-mixing rule; for AttnRes, which decoder layers open each block, how many sources the output
    aggregation attends over, and the ablation options set."""
    layout = rule_layout(config)
    ablations = ", ".join(f"{name}={getattr(config, name)!r}" for name in config.ablated_options())
    return f"{layout} Ablations of the paper's Table 4: {ablations}." if ablations else layout


def rule_layout(config: AttnResConfig) -> str:
    """The rule's part of `describe_layout`."""
    num_layers = config.text_config.num_hidden_layers
    num_output_sources = config.num_sources()[-1]
    if config.attnres_mode not in ATTNRES_MODES:
        rule = RULES[config.attnres_mode]
        # Its options (mHC's streams, Highway's gate): the same rule holds other parameters under each
        settings = ", ".join(f"{name}={getattr(config, name)!r}" for name in rule.options)
        label = f"{rule.label} with {settings}" if settings else rule.label
        return f"{label}, over {num_layers} decoder layers (not AttnRes)."
    if config.attnres_mode == "full":
        window = config.attnres_window
        outputs = "every sublayer output" if window is None else f"the {window} latest sublayer outputs"
        return (
            f"Full AttnRes: each of the {config.num_sublayers()} sublayer outputs is a source of its own; the output "
            f"aggregation attends over {num_output_sources} sources (the embedding and {outputs})."
        )
    block_starts = [layer for layer in range(num_layers) if config.sublayer_starts_block(2 * layer)]
    return (
        f"Block AttnRes, {config.attnres_block_size} decoder layer(s) per block: {len(block_starts)} blocks, opening "
        f"at decoder layers {', '.join(map(str, block_starts))}; the output aggregation attends over "
        f"{num_output_sources} sources (the embedding and {len(block_starts)} block sums)."
    )


def model_card(config: PreTrainedConfig, origin: dict[str, Any], card_data: ModelCardData | None = None) -> ModelCard:
    """README.md of a model folder from its config and origin record (`read_origin`): what the
    source was and what was done to it, the block layout, the verification figures, the training runs, and usage."""
    is_attnres = config.model_type == "attnres"
    source, conversion, runs = origin["source"], origin.get("conversion"), origin.get("training", [])
    name = source.rstrip("/").rpartition("/")[2]
    title = f"{name} with Attention Residuals" if is_attnres else f"{name}, continued pretraining" if runs else name
    card_data = card_data or ModelCardData(
        library_name="transformers",
        pipeline_tag="text-generation",
        tags=["attnres", "attention-residuals"] if is_attnres else ["attnres"],
        base_model=source if HUB_ID.fullmatch(source) else None,
    )
    body = [f"# {title}", what_was_done(config, origin)]
    if is_attnres:
        body.append(f"## Layout\n\n{layout_section(config, conversion)}")
    if conversion is not None:
        body.append(f"## Verification\n\n{verification_section(conversion, bool(runs))}")
    if runs:
        body.append("## Training\n\n" + "\n".join(f"- {training_run_text(run)}" for run in runs))
    body.append(USAGE if is_attnres else PLAIN_USAGE)
    return ModelCard(f"---\n{card_data.to_yaml()}\n---\n\n" + "\n\n".join(body) + "\n")


def what_was_done(config: PreTrainedConfig, origin: dict[str, Any]) -> str:
    """The card's opening sentence: converted from X (and trained for N tokens on D), or what else the model is."""
    conversion, runs = origin.get("conversion"), origin.get("training", [])
    source = f"`{origin['source']}`"
    if origin.get("source_file"):
        source += f" (GGUF file `{origin['source_file']}`, dequantised)"
    trained = " and ".join(f"{run['tokens']:,} tokens on {run['dataset']}" for run in runs)
    if conversion is not None:
        version = conversion["attnres_version"]
        text = f"Converted from {source} into {PAPER} by `{conversion['converted_by']}` (attnres {version})"
        if runs:
            return f"{text}, then trained for {trained} with `attnres train`."
        return (
            f"{text}. Its pseudo-queries start at zero and every mixed input is rescaled by its number of sources "
            "(`attnres_scale_by_num_sources=True`), so as converted it computes what the source computed, ready for "
            "continued pretraining."
        )
    is_attnres = config.model_type == "attnres"
    kind = f"an {PAPER} model" if is_attnres else f"a plain `{config.model_type}` model, without AttnRes"
    return source + (f", trained for {trained} with `attnres train`" if runs else "") + f": {kind}."


def layout_section(config: AttnResConfig, conversion: dict[str, Any] | None) -> str:
    text = describe_layout(config)
    if conversion is not None and conversion.get("added_parameters"):
        added, source = conversion["added_parameters"], conversion["source_parameters"]
        text += f"\n\nAttnRes adds {added:,} parameters ({added / source:.4%} of the source's {source:,})."
    return text


def verification_section(conversion: dict[str, Any], trained: bool) -> str:
    if conversion["verification"] is None:
        if conversion["converted_by"] == "attnres convert":
            return "The conversion was not verified (`--no-verify`)."
        return f"Converted on the fly by `{conversion['converted_by']}`, which does not verify the conversion."
    report = VerificationReport.from_dict(conversion["verification"])
    when = "Before training, run" if trained else "Run"
    inputs = "the same fixed sample text (`attnres.verification.SAMPLE_TEXT`)"
    if report.random_token_ids:
        inputs = f"the same {report.num_tokens} fixed random token ids (the source had no tokenizer to encode text)"
    return f"{when} on {inputs}, source and converted model gave:\n\n{report.to_markdown()}"


def training_run_text(run: dict[str, Any]) -> str:
    text = f"`attnres train --train {run['train']}` on {run['dataset']}: {run['tokens']:,} tokens"
    text += f" in {run['steps']} optimizer steps"
    if run.get("held_out_loss"):
        (first_step, first_loss), (last_step, last_loss) = run["held_out_loss"][0], run["held_out_loss"][-1]
        text += f"; held-out loss {first_loss:.4f} at step {first_step}, {last_loss:.4f} at step {last_step}"
    return text + "."


USAGE = """## Usage

The model code is stored with the weights, so only `transformers` is needed:

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this folder or repo>", trust_remote_code=True)
tokenizer = AutoTokenizer.from_pretrained("<this folder or repo>", trust_remote_code=True)
```

With the `attnres` package installed, `import attnres` registers its classes with the Auto classes: the two lines
above then load the model without `trust_remote_code`, and run the installed code rather than the copy stored here."""

PLAIN_USAGE = """## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")
tokenizer = AutoTokenizer.from_pretrained("<this folder or repo>")
```"""
