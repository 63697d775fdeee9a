"""The package's reaches into transformers' private parts (the model files keep their own, at their top)."""

import inspect
import os

import transformers
from transformers import PreTrainedModel
from transformers.utils import CONFIG_NAME, cached_file
from transformers.utils.hub import cached_files

from . import require


def saved_config_file(source: str | os.PathLike) -> str | None:
    """The path of a folder's or Hub repo's config.json (downloaded if need be), or None where it has none or, offline,
    the cache lacks it; other failures (a repo that does not exist) raise as in transformers' own loaders."""
    flag = "_raise_exceptions_for_missing_entries"
    require(flag in inspect.signature(cached_files).parameters, transformers, f"cached_files({flag}=...)")
    return cached_file(str(source), CONFIG_NAME, _raise_exceptions_for_missing_entries=False)


def attention_implementation(model: PreTrainedModel) -> str:
    """The attention backend a model runs ("eager", "sdpa", ...): transformers sets it and has no public reader."""
    present = isinstance(getattr(type(model.config), "_attn_implementation", None), property)
    require(present, transformers, "PreTrainedConfig._attn_implementation")
    return model.config._attn_implementation
