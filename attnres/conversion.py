"""Convert a standard pretrained checkpoint into Block (or Full) AttnRes that computes exactly what the source computed.

AttnRes keeps the source checkpoint's parameter names and adds zero-initialised pseudo-queries with unit key norms.
With zero queries every sublayer reads the mean of its sources; `attnres_scale_by_num_sources=True` rescales that
mean back to the ordinary residual stream, so a converted model reproduces its source up to float rounding.
Conversion is therefore: wrap the source's text config (`attnres_config_for`), hand the source's own tensors to the
AttnRes model, no copy (`convert_to_attnres`), and prove the result (`attnres.verification`). `convert_checkpoint`
is `attnres convert`: all of that from a checkpoint on disk or the Hub to a self-contained folder.
"""

import copy
import itertools
import logging
import os
from pathlib import Path

import torch
from transformers import PreTrainedConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.utils import logging as hf_logging

from .auto import added_parameter_count, is_attnres_parameter
from .cards import conversion_record, describe_layout, model_card, origin_record, write_origin
from .configuration_attnres import AttnResConfig
from .errors import ConversionError
from .folders import check_output_dir, disk_space_for, output_lock, replace_fix, tensor_bytes, written_whole
from .modeling_attnres import AttnResForCausalLM
from .options import CONVERT_DTYPES
from .rules import ATTNRES_OPTIONS, RULES
from .sources import (
    TOKENIZER_FILES,
    has_tokenizer,
    load_source,
    load_source_config,
    load_source_tokenizer,
)
from .verification import VerificationReport, verify_conversion

logger = logging.getLogger(__name__)

DTYPES = {name: getattr(torch, name) for name in CONVERT_DTYPES}  # what a command line may ask weights to be


class VerificationError(ConversionError):
    """The converted model does not reproduce its source within the thresholds; nothing was written."""

    def __init__(self, report: VerificationReport):
        super().__init__(f"the converted model does not reproduce its source; nothing was written.\n{report.format()}")
        self.report = report


def attnres_config_for(
    source_config: PreTrainedConfig,
    mode: str = "block",
    block_size: int | None = None,
    exact_start: bool = True,
    options: dict | None = None,
) -> AttnResConfig:
    """The AttnRes config around `source_config`'s text model, set to reproduce the source exactly at init; with
    `exact_start=False`, set as the rule of `mode` initialises for training from scratch (any rule). `options`: the
    config's rule options by field name (`ATTNRES_OPTIONS`, `attnres_num_streams`).

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
    # A source's own code (--trust-remote-code) is no part of the converted model, which runs the source family's
    # transformers classes; left in, the AttnRes config would read it through and save it as its own auto_map
    text_config_dict.pop("auto_map", None)
    rule = RULES.get(mode)
    if exact_start and rule is not None and rule.converts is not None:
        raise ConversionError(
            f"--mode {mode} cannot start as the source computes: {rule.converts}. Train it from scratch "
            "(attnres train --convert --from-scratch), or convert to a rule that starts exact: "
            f"{', '.join(name for name, other in RULES.items() if other.converts is None)}"
        )
    options = options or {}
    for name, value in options.items():
        option = ATTNRES_OPTIONS.get(name)
        if exact_start and option is not None and option.converts is not None and value != option.default:
            raise ConversionError(
                f"{name}={value!r} cannot start as the source computes: {option.converts}. Train it from scratch "
                "(attnres train --convert --from-scratch), or convert without it"
            )
    try:
        return AttnResConfig(
            text_config=text_config_dict,
            attnres_mode=mode,
            attnres_block_size=block_size,
            attnres_scale_by_num_sources=exact_start,
            attnres_scale_init=1.0 if exact_start else None,  # ReZero and LayerScale start as the plain stream
            **options,
        )
    except ValueError as error:
        raise ConversionError(f"cannot convert a '{source_config.model_type}' checkpoint: {error}") from error


def convert_to_attnres(
    source: PreTrainedModel | str | os.PathLike,
    mode: str = "block",
    block_size: int | None = None,
    dtype: torch.dtype | None = None,
    gguf_file: str | None = None,
    trust_remote_code: bool = False,
    options: dict | None = None,
) -> AttnResForCausalLM:
    """Block (or Full) AttnRes holding the source's weights, with its AttnRes parameters at their init.

    Args:
        source: A loaded causal LM of a supported family (a Gemma3 multimodal model gives its text model), or a Hub
            id / folder to load one from (see `load_source`).
        mode: `"block"` or `"full"` (`AttnResConfig.attnres_mode`).
        block_size: Decoder layers per block in block mode; defaults to about 8 blocks.
        dtype: dtype of the converted weights; defaults to the source's.
        gguf_file: A GGUF file inside `source` (a folder or Hub repo) to load the weights from.
        trust_remote_code: Run the code that a `source` to load brings (the `auto_map` of its config.json); a source
            that needs it (a model type transformers does not know) is refused otherwise, and one of a model type
            transformers knows loads with transformers' class; see `attnres.sources.trust_remote_code_for`.
        options: The rule's options by config field (`attnres_query`, ..., `attnres_num_streams`); see
            `attnres_config_for`.

    The converted model holds the source's own tensors rather than copies (unless `dtype` casts them), which keeps
    peak memory at about one copy of the weights: do not keep training the source alongside it.
    """
    if not isinstance(source, PreTrainedModel):
        source_config = load_source_config(source, gguf_file, trust_remote_code)
        attnres_config_for(source_config, mode, block_size, options=options)  # fail early
        source = load_source(source, dtype, gguf_file, trust_remote_code)
    config = attnres_config_for(source.config, mode, block_size, options=options)
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
        key for key in sorted(loading_info["missing_keys"]) if not is_attnres_parameter(key)
    ]
    if unmatched:
        raise ConversionError(f"the source's weights do not match the AttnRes model: {unmatched[:10]}")
    model.generation_config = copy.deepcopy(source.generation_config)
    return model.eval()


# --------------------------------------------------------------------------------------------------------------------
# Converting a checkpoint on disk: the `attnres convert` pipeline
# --------------------------------------------------------------------------------------------------------------------


def load_source_and_tokenizer(
    source: str, gguf_file: str | None, dtype: torch.dtype, trust_remote_code: bool
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Step 1 of `convert_checkpoint`: the source model, and its tokenizer where it has one."""
    tokenizer = None
    if has_tokenizer(source, gguf_file):
        logger.info("[1/4] Loading the source model and tokenizer")
        tokenizer = load_source_tokenizer(source, gguf_file, trust_remote_code)
    else:
        logger.info(
            "[1/4] Loading the source model. It has no tokenizer (%s): the verification runs on random token ids "
            "instead of the sample text, and the converted folder has no tokenizer either; add the tokenizer files "
            "of the model it was made from to the source folder for both",
            ", ".join(TOKENIZER_FILES),
        )
    return load_source(source, dtype, gguf_file, trust_remote_code), tokenizer


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
    trust_remote_code: bool = False,
    options: dict | None = None,
) -> VerificationReport | None:
    """Convert a checkpoint on disk or on the Hub into a self-contained AttnRes folder, verified against its source.

    `output_dir` receives sharded safetensors, config.json with the full `auto_map`, the remote-code files, the
    tokenizer, generation_config.json and a model card. Everything is checked before anything is written: the output
    folder (never the source, nor inside it or around it, even with `overwrite`), the architecture (before any weights
    are loaded) and, unless `verify=False`, the verification thresholds; a `ConversionError` says what failed and
    `output_dir` is left as it was. The verification runs on `device`, where the source and the converted model then
    hold a copy of the weights each (on the CPU they share one). A source folder without a tokenizer converts too:
    verified on random token ids, and saved without a tokenizer. A source that needs code of its own (an `auto_map`
    in its config.json, for a model type transformers does not know) is refused with a `ConversionError` unless
    `trust_remote_code`.
    """
    source, output_dir = str(source), Path(output_dir)
    with output_lock(output_dir, ConversionError):  # two conversions into one folder would mix their files
        check_output_dir(output_dir, ConversionError, {"the source model": source}, replace_fix(overwrite))
        source_config = load_source_config(source, gguf_file, trust_remote_code)
        config = attnres_config_for(source_config, mode, block_size, options=options)
        logger.info("Source: %s", source + (f", {gguf_file}" if gguf_file else ""))
        logger.info(describe_layout(config))

        source_model, tokenizer = load_source_and_tokenizer(source, gguf_file, dtype, trust_remote_code)
        logger.info("[2/4] Converting")
        model = convert_to_attnres(source_model, mode, block_size, options=options)
        logger.info("AttnRes adds %s parameters", f"{added_parameter_count(model):,}")

        report = None
        if verify:
            logger.info("[3/4] Verifying against the source")
            report = verify_conversion(source_model.to(device), model.to(device), tokenizer)
            if not report.passed:
                raise VerificationError(report)
        del source_model  # its weights live on in the converted model; anything else it held (a vision tower) goes

        logger.info("[4/4] Writing %s", output_dir)
        origin = origin_record(source, gguf_file, conversion_record(model, report))
        needed_bytes = tensor_bytes(itertools.chain(model.parameters(), model.buffers()))
        with disk_space_for(output_dir, needed_bytes, ConversionError), written_whole(output_dir) as staging:
            model.save_pretrained(staging, max_shard_size=max_shard_size)
            if tokenizer is not None:
                tokenizer.save_pretrained(staging)
            write_origin(staging, origin)
            model_card(model.config, origin).save(staging / "README.md")
        return report
