"""A source's architecture at a smaller scale, for a study from random weights (`attnres train --convert
--from-scratch --layers N --hidden-size D`, `attnres compare --from-scratch --layers N --hidden-size D`): the source's
text config with fewer layers or a narrower width, changed consistently, or refused in one line where it cannot be.

Fewer layers: the first N entries of every per-layer list (`layer_types`, ...), and the indices below N of every list
of layer indices; what a config derives from its layer count (periods and offsets of a layer pattern, the first dense
layers) follows it. A narrower width: every attention head kept (and every key-value head), each head hidden_size /
heads wide, an even width for the rotary embedding; the MLP widths (intermediate sizes) scaled in proportion to the
hidden size, to the nearest integer. Widths that do not follow the hidden size over the heads (MLA's ranks and head
widths, state-space and linear-attention heads, GPT-J's rotary width) are not guessed: such a family shrinks in
layers only.
"""

from fractions import Fraction

from huggingface_hub.errors import StrictDataclassError
from transformers import PretrainedConfig

from .errors import OptionError

# Lists with one entry per decoder layer (a string for Nemotron-H's older pattern): their first N entries are kept
PER_LAYER_LISTS = ("layer_types", "layers_block_type", "no_rope_layers", "mlp_layer_types", "hybrid_override_pattern")
# Lists of layer indices: those below N are kept
LAYER_INDEX_LISTS = ("mlp_only_layers", "full_attn_idxs", "attn_layer_indices")
# The MLP widths, scaled in proportion to the hidden size
MLP_WIDTHS = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "shared_intermediate_size",
    "moe_shared_expert_intermediate_size",
    "ffn_hidden_size",
    "n_inner",
)
# Widths that are not the hidden size over the heads, which a narrower width would have to choose anew
OTHER_WIDTHS = (
    "q_lora_rank",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
    "mamba_n_heads",
    "mamba_d_head",
    "mamba_num_heads",
    "mamba_head_dim",
    "linear_key_head_dim",
    "linear_value_head_dim",
    "linear_num_key_heads",
    "linear_num_value_heads",
    "linear_head_dim",
    "linear_num_heads",
    "rotary_dim",
)


def shrunk_config(source_config: PretrainedConfig, layers: int | None, hidden_size: int | None) -> PretrainedConfig:
    """The text config of `source_config` with `layers` decoder layers and a hidden size of `hidden_size` (None:
    the source's), built anew by its config class, which checks it; OptionError naming what to pass where the source
    cannot shrink so."""
    text_config = source_config.get_text_config(decoder=True)
    if layers is None and hidden_size is None:
        return text_config
    fields = text_config.to_dict()
    if layers is not None:
        fewer_layers(fields, text_config, layers)
    if hidden_size is not None:
        narrower(fields, text_config, hidden_size)
    try:
        return type(text_config).from_dict(fields)
    except (ValueError, StrictDataclassError) as error:
        reason = " ".join(str(error.__cause__ or error).split())  # one line
        asked = " ".join(f"--{flag} {value}" for flag, value in (("layers", layers), ("hidden-size", hidden_size))
                         if value is not None)  # fmt: skip
        raise OptionError(
            f"{asked}: the source's config class ({text_config.model_type}) refuses the shrunk architecture: "
            f"{reason.rstrip('.')}; choose other sizes"
        ) from None


def field_name(config: PretrainedConfig, name: str) -> str:
    """The name under which `config` stores the standard field `name` (GPT-J: `n_layer` for `num_hidden_layers`)."""
    return type(config).attribute_map.get(name, name)


def fewer_layers(fields: dict, config: PretrainedConfig, layers: int) -> None:
    """Cut `fields`, the source config's, to its first `layers` decoder layers."""
    source_layers = config.num_hidden_layers
    if not 1 <= layers <= source_layers:
        raise OptionError(f"--layers {layers}: the source has {source_layers} layers; pass 1 to {source_layers}")
    for name, value in fields.items():
        if name in PER_LAYER_LISTS and value is not None:
            fields[name] = value[:layers]
        elif name in LAYER_INDEX_LISTS and value is not None:
            fields[name] = [index for index in value if index < layers]
        elif isinstance(value, list) and len(value) == source_layers and source_layers > 1:
            raise OptionError(
                f"--layers {layers}: the source's config ({config.model_type}) holds {name}, a list of one entry per "
                "layer that the shrink does not know how to cut; train the source's depth (drop --layers)"
            )
    fields[field_name(config, "num_hidden_layers")] = layers


def rotary_shares(fields: dict) -> list[Fraction]:
    """The shares of each head's width that the rotary embedding rotates, by its parameters (one set, or one per
    layer type)."""
    rope = fields.get("rope_parameters") or {}
    sets = [rope] if not all(isinstance(value, dict) for value in rope.values()) else list(rope.values())
    return [Fraction(str(parameters.get("partial_rotary_factor", 1.0))) for parameters in sets] or [Fraction(1)]


def head_width_unit(shares: list[Fraction]) -> int:
    """The narrowest head width whose rotated part is an even width (the rotary embedding turns pairs) for each of
    `shares`: the head widths that work are its multiples."""
    width = 2
    while any(width * share % 2 for share in shares):
        width += 2
    return width


def narrower(fields: dict, config: PretrainedConfig, hidden_size: int) -> None:
    """Narrow `fields`, the source config's, to `hidden_size`: the heads kept, each hidden_size / heads wide, the MLP
    widths in proportion."""
    source_size, heads = config.hidden_size, config.num_attention_heads
    unscaled = [name for name in OTHER_WIDTHS if fields.get(name) is not None]
    if unscaled:
        raise OptionError(
            f"--hidden-size {hidden_size}: the source's config ({config.model_type}) sets widths of its own "
            f"({', '.join(unscaled)}) that do not follow the hidden size; shrink it in --layers only"
        )
    if not 1 <= hidden_size <= source_size:
        raise OptionError(f"--hidden-size {hidden_size}: the source's is {source_size}; pass at most {source_size}")
    unit = head_width_unit(rotary_shares(fields))
    step = heads * unit
    if hidden_size % step:
        below, above = hidden_size // step * step, (hidden_size // step + 1) * step
        choices = " or ".join(str(size) for size in (below, above) if 0 < size <= source_size) or "none"
        raise OptionError(
            f"--hidden-size {hidden_size}: the source's {heads} attention heads are kept, each hidden_size / {heads} "
            f"wide, a multiple of {unit} (an even width for the rotary embedding); pass a multiple of {step}: "
            f"{choices}"
        )
    fields[field_name(config, "hidden_size")] = hidden_size
    if "head_dim" in fields:
        fields["head_dim"] = hidden_size // heads
    for name in MLP_WIDTHS:
        if fields.get(name) is not None:
            fields[name] = max(1, round(fields[name] * hidden_size / source_size))


def parameter_count(config: PretrainedConfig, trust_remote_code: bool = False) -> int:
    """The parameters of `config`'s causal LM (shared ones counted once), built without memory (on the meta
    device)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return sum(parameter.numel() for parameter in model.parameters())
