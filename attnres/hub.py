"""Uploading a model folder to the Hugging Face Hub (or any endpoint set with HF_ENDPOINT)."""

from pathlib import Path

from huggingface_hub import HfApi


class HubUploadError(RuntimeError):
    """The upload failed; the local folder is complete and usable either way."""


def push_folder(folder: str | Path, repo_id: str, commit_message: str, ignore_patterns: list[str] | None = None) -> str:
    """Create the model repo `repo_id` if needed and upload `folder` to it; returns the commit URL.

    huggingface_hub reads the endpoint (HF_ENDPOINT) and the token (HF_TOKEN or the saved login) itself.
    """
    api = HfApi()
    try:
        api.create_repo(repo_id, exist_ok=True)
        commit = api.upload_folder(
            repo_id=repo_id, folder_path=folder, commit_message=commit_message, ignore_patterns=ignore_patterns
        )
    except Exception as error:  # network, authentication, permissions: all leave the local folder usable
        raise HubUploadError(f"{folder} is saved, but uploading it to {repo_id} failed: {error}") from error
    return commit.commit_url
