"""Upload a converted or trained model folder to the Hugging Face Hub (or the endpoint in HF_ENDPOINT) in one commit,
with a model card that states the source model, what was done to it, the block layout, the verification figures and
the evaluation summary.

`push_model` (`attnres push`) takes a folder written by `attnres convert`, `attnres train` or `save_pretrained`. Its
card is made from the folder's config and origin record (`attnres_origin.json`, written by convert and train), or,
for a folder without one, from its config, keeping the folder's own README after it; then an `attnres eval` summary
found in the folder, if any. The card is built in memory: the folder on disk is left as it is. `push_folder` is the
upload itself.
"""

import argparse
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from huggingface_hub import HfApi, ModelCard, get_token
from huggingface_hub import constants as hub_constants
from transformers import PreTrainedConfig

from .cards import model_card, origin_record, read_origin
from .errors import HubUploadError
from .folders import CHECKPOINTS_FOLDER
from .sources import hub_reachable, load_source_config

try:  # huggingface_hub's HTTP client, whose network errors are not OSErrors: httpx2 from huggingface_hub 2 on
    from httpx2 import HTTPError as HubClientError
except ImportError:  # huggingface_hub 1
    from httpx import HTTPError as HubClientError

# Where a folder may hold an `attnres eval` summary: the demo's folder, or a model folder that it was copied into
# (`attnres eval --output` never lies inside the model it evaluates)
EVALUATION_SUMMARIES = ("summary.md", "eval/summary.md")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")


@contextmanager
def folder_with_readme(folder: Path, readme: str | None) -> Iterator[Path]:
    """`folder` itself, or with `readme` as its README.md: a temporary folder of links to its files beside that
    README, so that the upload reads the model's files where they are and the folder stays as it is."""
    if readme is None:
        yield folder
        return
    with tempfile.TemporaryDirectory() as staging:
        staging = Path(staging)
        for file in folder.rglob("*"):
            if file.is_file():
                link = staging / file.relative_to(folder)
                link.parent.mkdir(parents=True, exist_ok=True)
                link.symlink_to(file.resolve())
        (staging / "README.md").unlink(missing_ok=True)
        (staging / "README.md").write_text(readme, encoding="utf-8")
        yield staging


def check_can_upload(repo_id: str) -> None:
    """Refuse an upload to `repo_id` before any work (a conversion, a run, a card) when it cannot succeed: in offline
    mode, without a token (huggingface_hub's lookup: HF_TOKEN or the saved login), or with the Hub out of reach."""
    if hub_constants.is_offline_mode():
        raise HubUploadError(
            f"uploading to {repo_id} needs the network, which offline mode (--offline or HF_HUB_OFFLINE=1) forbids: "
            "turn it off, or leave out the upload"
        )
    if get_token() is None:
        raise HubUploadError(
            f"uploading to {repo_id} needs a Hugging Face token, and none is set: run `huggingface-cli login`, or "
            "set HF_TOKEN"
        )
    if not hub_reachable():
        raise HubUploadError(
            f"uploading to {repo_id} needs the Hub, and {hub_constants.ENDPOINT} cannot be reached: check the network "
            "(or HF_ENDPOINT), or leave out the upload and run `attnres push` later"
        )


def push_folder(
    folder: str | Path,
    repo_id: str,
    commit_message: str,
    ignore_patterns: list[str] | None = None,
    private: bool = False,
    readme: str | None = None,
) -> str:
    """Create the model repo `repo_id` if needed and upload `folder` to it in one commit (`HfApi.upload_folder`);
    returns the commit URL.

    `readme`, when given, is uploaded as README.md in place of the folder's own. huggingface_hub reads the endpoint
    (HF_ENDPOINT) and the token (HF_TOKEN or the saved login) itself.
    """
    folder = Path(folder)
    api = HfApi()
    try:
        # private=None leaves the visibility to the Hub (an organisation may make new repos private by default)
        api.create_repo(repo_id, exist_ok=True, private=private or None)
        with folder_with_readme(folder, readme) as upload:
            commit = api.upload_folder(
                repo_id=repo_id, folder_path=upload, commit_message=commit_message, ignore_patterns=ignore_patterns
            )
    # The network (the client's errors), authentication and permissions (HfHubHTTPError, an OSError), no token or
    # offline mode (OSErrors too): each leaves the local folder usable
    except (OSError, HubClientError) as error:
        raise HubUploadError(f"{folder} is saved, but uploading it to {repo_id} failed: {error}") from error
    return commit.commit_url


# --------------------------------------------------------------------------------------------------------------------
# The model card of a pushed folder
# --------------------------------------------------------------------------------------------------------------------


def load_model_folder_config(folder: Path, trust_remote_code: bool = False) -> PreTrainedConfig:
    """The config of a loadable model folder (AttnRes or plain); a clear error for anything else, and a
    `SourceError` for a folder that needs code of its own, unless `trust_remote_code`."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder")
    if not (folder / "config.json").is_file() or not any(any(folder.glob(p)) for p in WEIGHT_PATTERNS):
        raise FileNotFoundError(
            f"{folder} is not a model folder: it needs config.json and the weights, as `attnres convert`, "
            "`attnres train` or `save_pretrained` write them"
        )
    return load_source_config(folder, trust_remote_code=trust_remote_code)


def evaluation_summary(folder: Path) -> str | None:
    """The `attnres eval` summary in `folder` (or its `eval/` subfolder), if any, without its title: it
    goes under a heading of the card (or report) it joins."""
    found = next((folder / name for name in EVALUATION_SUMMARIES if (folder / name).is_file()), None)
    if found is None:
        return None
    summary = found.read_text(encoding="utf-8").strip()
    return summary.partition("\n")[2].strip() if summary.startswith("# ") else summary


def model_card_for_push(folder: Path, config: PreTrainedConfig) -> str:
    """README.md to upload: the card of the folder's origin record (or, without one, of its config followed by the
    folder's own README), plus the evaluation summary."""
    origin = read_origin(folder)
    if origin is not None:
        text = str(model_card(config, origin))
    else:
        existing = ModelCard.load(folder / "README.md") if (folder / "README.md").is_file() else None
        unrecorded = origin_record(str(folder))
        card_data = existing.data if existing is not None and existing.data.to_dict() else None
        text = str(model_card(config, unrecorded, card_data))
        if existing is not None and existing.text.strip():
            text = f"{text.rstrip()}\n\n{existing.text.strip()}\n"
    text = text.rstrip() + "\n"
    summary = evaluation_summary(folder)
    return text if summary is None else f"{text}\n## Evaluation\n\n{summary}\n"


def push_model(model_dir: str | Path, repo_id: str, private: bool = False, trust_remote_code: bool = False) -> str:
    """Upload a converted or trained model folder to the Hub model repo `repo_id`; returns the commit URL.

    Training checkpoints (optimizer states) stay behind; README.md is the card of `model_card_for_push`, made from the
    folder's config: a folder that needs code of its own (an `auto_map` that is not AttnRes's, for a model type
    transformers does not know) needs `trust_remote_code` for that.
    """
    folder = Path(model_dir)
    config = load_model_folder_config(folder, trust_remote_code)
    check_can_upload(repo_id)
    readme = model_card_for_push(folder, config)
    ignore = [f"{CHECKPOINTS_FOLDER}/*"]
    return push_folder(folder, repo_id, "Upload AttnRes model with attnres push", ignore, private, readme)


# --------------------------------------------------------------------------------------------------------------------
# Command line: `attnres push`
# --------------------------------------------------------------------------------------------------------------------


def run_push(args: argparse.Namespace) -> int:
    url = push_model(args.model_dir, args.repo_id, args.private, args.trust_remote_code)
    print(f"Uploaded {args.model_dir}: {url}")
    return 0
