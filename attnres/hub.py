"""Upload a converted or trained model folder to the Hugging Face Hub (or the endpoint in HF_ENDPOINT) in one commit,
with a model card that states the source model, the block layout, the verification figures and the evaluation summary.

`push_model` (`attnres push`) takes a folder written by `attnres convert`, `attnres train` or `save_pretrained`. Its
card is the one `attnres convert` wrote, or else one made from what the folder holds (config, training run, the
conversion card of the model the run started from), followed by the summary `attnres eval` left in the folder, if
any. The card is built in memory: the folder on disk is left as it is. `push_folder` is the upload itself.
"""

import argparse
import json
from pathlib import Path

from huggingface_hub import CommitOperationAdd, HfApi, ModelCard, ModelCardData
from huggingface_hub.utils import DEFAULT_IGNORE_PATTERNS, filter_repo_objects
from transformers import AutoConfig, PreTrainedConfig

from .conversion import DEFAULT_SOURCE, describe_layout

# Where `attnres eval --output-dir` may have left its summary inside a model folder
EVALUATION_SUMMARIES = ("summary.md", "eval/summary.md")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
# Sections of the card that `attnres convert` writes, which a pushed card must have
CONVERSION_SECTIONS = ("Layout", "Verification")


class HubUploadError(RuntimeError):
    """The upload failed; the local folder is complete and usable either way."""


def push_folder(
    folder: str | Path,
    repo_id: str,
    commit_message: str,
    ignore_patterns: list[str] | None = None,
    private: bool = False,
    readme: str | None = None,
) -> str:
    """Create the model repo `repo_id` if needed and upload `folder` to it in one commit; returns the commit URL.

    `readme`, when given, is uploaded as README.md in place of the folder's own. huggingface_hub reads the endpoint
    (HF_ENDPOINT) and the token (HF_TOKEN or the saved login) itself.
    """
    folder = Path(folder)
    files = {path.relative_to(folder).as_posix(): path for path in sorted(folder.rglob("*")) if path.is_file()}
    kept = filter_repo_objects(files, ignore_patterns=[*(ignore_patterns or []), *DEFAULT_IGNORE_PATTERNS])
    operations = [
        CommitOperationAdd(path_in_repo=name, path_or_fileobj=files[name])
        for name in kept
        if readme is None or name != "README.md"
    ]
    if readme is not None:
        operations.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=readme.encode()))
    api = HfApi()
    try:
        # private=None leaves the visibility to the Hub (an organisation may make new repos private by default)
        api.create_repo(repo_id, exist_ok=True, private=private or None)
        commit = api.create_commit(repo_id, operations, commit_message=commit_message)
    except Exception as error:  # network, authentication, permissions: all leave the local folder usable
        raise HubUploadError(f"{folder} is saved, but uploading it to {repo_id} failed: {error}") from error
    return commit.commit_url


# --------------------------------------------------------------------------------------------------------------------
# The model card of a pushed folder
# --------------------------------------------------------------------------------------------------------------------


def load_model_folder_config(folder: Path) -> PreTrainedConfig:
    """The config of a loadable model folder (AttnRes or plain); a clear error for anything else."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if not (folder / "config.json").is_file() or not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{folder} is not a model folder: it needs config.json and the weights, as `attnres convert`, "
            "`attnres train` or `save_pretrained` write them"
        )
    return AutoConfig.from_pretrained(folder)


def split_sections(markdown: str) -> tuple[str, dict[str, str]]:
    """(the text before the first `## ` heading, {heading: its text}) of a card's markdown body."""
    intro, *sections = ("\n" + markdown).split("\n## ")
    return intro.strip(), {title.strip(): body.strip() for title, _, body in (s.partition("\n") for s in sections)}


def conversion_card(folder: Path) -> ModelCard | None:
    """The card `attnres convert` wrote into `folder`, if it holds one."""
    readme = folder / "README.md"
    if not readme.is_file():
        return None
    card = ModelCard.load(readme)
    return card if set(CONVERSION_SECTIONS) <= split_sections(card.text)[1].keys() else None


def read_training_run(folder: Path) -> tuple[dict, list[dict]]:
    """(training_config.json, metrics.jsonl records) of an `attnres train` folder; empty for any other folder."""
    from .training import METRICS_FILE  # imported here: training imports this module

    config_file, metrics_file = folder / "training_config.json", folder / METRICS_FILE
    training_config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    metrics = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    return training_config, metrics


def training_section(training_config: dict, metrics: list[dict]) -> str:
    dataset = training_config.get("dataset") or "the standard-library corpus"
    steps = metrics[-1]["step"] if metrics else 0
    text = f"Continued pretraining with `attnres train --train {training_config.get('train', 'all')}` on {dataset}"
    text += f" for {steps} optimizer steps."
    held_out = [(record["step"], record["eval_loss"]) for record in metrics if "eval_loss" in record]
    if len(held_out) > 1:
        (first_step, first_loss), (last_step, last_loss) = held_out[0], held_out[-1]
        text += f" Held-out loss: {first_loss:.4f} at step {first_step}, {last_loss:.4f} at step {last_step}."
    return text + " Every logged figure is in `metrics.jsonl`."


def generated_model_card(folder: Path, config: PreTrainedConfig, existing: ModelCard | None) -> ModelCard:
    """A card for a folder without a conversion card (a trained export, a `save_pretrained` folder), from what the
    folder says: its config, its training run, and the conversion card of the model that run started from."""
    training_config, metrics = read_training_run(folder)
    start = training_config.get("model") or (DEFAULT_SOURCE if training_config else None)
    converted = conversion_card(Path(start)) if start and Path(start).is_dir() else None
    name_or_path = config.get_text_config(decoder=True).name_or_path
    source = f"`{name_or_path}`" if name_or_path else "not recorded"
    verification = "No verification figures were found: this model was not converted by `attnres convert`."
    conversion_sections = {}
    if converted is not None:  # the source as the conversion card names it, and its figures
        intro, conversion_sections = split_sections(converted.text)
        source = intro.partition("Converted from ")[2].partition(" by `attnres convert`")[0] or source
        verification = f"Figures of the conversion this model started from (`{start}`):\n\n"
        verification += conversion_sections["Verification"]
    elif training_config.get("convert"):
        verification = "Converted on the fly by `attnres train --convert`, which does not verify the conversion."
    is_attnres = config.model_type == "attnres"
    layout = describe_layout(config) if is_attnres else f"A plain `{config.model_type}` model, without AttnRes."
    body = [
        f"# {folder.resolve().name}" + (" with Attention Residuals" if is_attnres else ""),
        f"Source model: {source}.",
        f"## Layout\n\n{layout}",
        f"## Verification\n\n{verification}",
    ]
    if training_config:
        body.append(f"## Training\n\n{training_section(training_config, metrics)}")
    if "Usage" in conversion_sections:
        body.append(f"## Usage\n\n{conversion_sections['Usage']}")
    if existing is not None and existing.text.strip():  # the folder's own README, kept after what was added
        body.append(existing.text.strip())
    data = next((card.data for card in (existing, converted) if card is not None and card.data.to_dict()), None)
    data = data or ModelCardData(library_name="transformers", pipeline_tag="text-generation", tags=["attnres"])
    return ModelCard(f"---\n{data.to_yaml()}\n---\n\n" + "\n\n".join(body) + "\n")


def evaluation_summary(folder: Path) -> str | None:
    """The summary that `attnres eval` wrote into `folder` (or its `eval/` subfolder), if any, without its title: it
    goes under a heading of the card (or report) it joins."""
    found = next((folder / name for name in EVALUATION_SUMMARIES if (folder / name).is_file()), None)
    if found is None:
        return None
    summary = found.read_text(encoding="utf-8").strip()
    return summary.partition("\n")[2].strip() if summary.startswith("# ") else summary


def model_card_for_push(folder: Path, config: PreTrainedConfig) -> str:
    """README.md to upload: the conversion card (or one made from what the folder says), plus the evaluation summary."""
    card = conversion_card(folder)
    if card is None:
        existing = ModelCard.load(folder / "README.md") if (folder / "README.md").is_file() else None
        card = generated_model_card(folder, config, existing)
    text = str(card).rstrip() + "\n"
    summary = evaluation_summary(folder)
    return text if summary is None else f"{text}\n## Evaluation\n\n{summary}\n"


def push_model(model_dir: str | Path, repo_id: str, private: bool = False) -> str:
    """Upload a converted or trained model folder to the Hub model repo `repo_id`; returns the commit URL.

    Training checkpoints (optimizer states) stay behind; README.md is the card of `model_card_for_push`.
    """
    from .training import CHECKPOINTS_FOLDER  # imported here: training imports this module

    folder = Path(model_dir)
    readme = model_card_for_push(folder, load_model_folder_config(folder))
    ignore = [f"{CHECKPOINTS_FOLDER}/*"]
    return push_folder(folder, repo_id, "Upload AttnRes model with attnres push", ignore, private, readme)


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres push`
# --------------------------------------------------------------------------------------------------------------------


def add_push_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", type=Path, help="a folder written by `attnres convert` or `attnres train`")
    parser.add_argument("repo_id", help="the Hub model repo to upload to (created if needed), e.g. me/smollm2-attnres")
    parser.add_argument("--private", action="store_true", help="create the repo as private")


def run_push(args: argparse.Namespace) -> int:
    print(f"Uploaded {args.model_dir}: {push_model(args.model_dir, args.repo_id, args.private)}")
    return 0
