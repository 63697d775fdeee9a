"""The source families AttnRes supports, and those it refuses by name: data only, which modeling_attnres.py acts on
and configuration_attnres.py checks a config against.

Standard library only: the `attnres` command reads `SUPPORTED_FAMILIES` from this file without loading torch, and
it travels with saved models as remote code, imported by configuration_attnres.py.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

# The oldest transformers the model files run on: before 5.20 it has no `SubConfigSpec`, which the config is built
# on. From it on, saved models generate the same tokens as on the newest (tests/test_remote_code_versions.py).
OLDEST_TRANSFORMERS = "5.20.0"


@dataclass(frozen=True)
class Family:
    """How to build one source family's modules and run the residual branches of its decoder layer: data, which
    modeling_attnres.py acts on.

    Every family is PreNorm in the sense AttnRes needs: each residual branch reads the residual stream (through its
    input norms, if it has them) and adds its output to it once. A layer has two such sublayers, attention then MLP, or
    in the one-branch layout (`one_branch`) one: attention and MLP in parallel on the same input, or the layer's one
    mixer. Where families differ, a field below names the difference.
    """

    module_name: str  # transformers.models.<module_name>.modeling_<module_name>
    class_prefix: str  # e.g. "Qwen3Moe" for Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm, ...
    # None: the sublayer reads the stream itself (OLMo-2/3, EXAONE-4 normalise only outputs); it then needs
    # `attnres_scale_by_num_sources` to read the plain sum rather than the mean at zero queries.
    attention_input_norm: str | tuple[str, ...] | None = "input_layernorm"
    attention_output_norm: str | None = None  # Gemma2/3's sandwich norms normalise the sublayer outputs too
    mlp_input_norm: str | tuple[str, ...] | None = "post_attention_layernorm"
    mlp_output_norm: str | None = None
    # Phi-3: the (attention, MLP) dropout modules applied to the sublayer outputs before the residual add
    output_dropouts: tuple[str, str] | None = None
    scaled_embedding: bool = False  # Gemma2/3 multiply the token embedding by sqrt(hidden_size)
    rope_per_layer_type: bool = False  # Gemma3, OLMo-3: separate RoPE parameters for sliding and full attention layers
    num_experts_key: str | None = None  # MoE families with a load-balancing loss: the config field of the experts count
    mlp_returns_tuple: bool = False  # GPT-OSS: the MLP returns (output, router scores)
    # Granite's scalars, as config fields: the embedding is multiplied by one, each sublayer output by another before
    # the residual add, and the logits are divided by a third
    embedding_multiplier_key: str | None = None
    # Falcon-H1 multiplies only the embedding it looks up from token ids, not `inputs_embeds` given to the model
    embedding_multiplier_on_ids_only: bool = False
    residual_multiplier_key: str | None = None
    logits_divisor_key: str | None = None
    # Gemma2: sdpa cannot softcap the attention logits. Its own models declare so from transformers 5.21 on; on 5.20
    # they ran sdpa without the softcapping, which a saved model must not do there either.
    supports_sdpa: bool = True
    # Hybrids: the attribute of the token mixer by layer type (`layer_types`), where it is not `self_attn`. The mixers
    # of the recurrent layer types (RECURRENT_LAYER_TYPES) take the cache and a 2D padding mask and return their output
    # alone; attention takes RoPE and returns (output, weights).
    token_mixers: dict[str, str] = field(default_factory=dict)
    # The decoder layer class by layer type, where a family has one per type (Jamba: "AttentionDecoderLayer", ...)
    decoder_layers: dict[str, str] = field(default_factory=dict)
    layer_type_argument: bool = False  # Bamba: the decoder layer takes its type as `layer_type`
    # The MLP sublayer: the sum of these modules' outputs, those the layer has (GraniteMoeHybrid: routed experts plus
    # a shared MLP, the experts absent where the config has none)
    mlp: tuple[str, ...] = ("mlp",)
    final_norm: str = "norm"  # LFM2: embedding_norm
    norm_eps_key: str = "rms_norm_eps"  # LFM2: norm_eps
    rotary_embedding: bool = True  # Kimi Linear, Jamba: their attention layers have no RoPE
    # GraniteMoeHybrid: RoPE only where this config field has this value (Granite 4.0 checkpoints have none)
    rope_switch: tuple[str, str] | None = None
    # OLMo-Hybrid: RoPE only where the config's `rope_parameters` give a `rope_theta` (its released checkpoints set
    # none: no position embedding at all)
    rope_needs_theta: bool = False
    # The oldest transformers whose modules of the family these files can call: the hybrids' recurrent mixers take the
    # cache as `cache` from 5.24 on (before, each named it its own way); GPT-J and CodeGen have a RotaryEmbedding module
    # from 5.24 on (before, their attention made its own sinusoids); Falcon's attention takes no `alibi` from 5.25 on
    oldest_transformers: str = OLDEST_TRANSFORMERS

    # Module names where the family's differ from Llama's: the AttnRes model builds its own embedding, layer list,
    # final norm and LM head, under the source checkpoint's names (GPT-NeoX: embed_in, GPT-J: wte and h, ...)
    embedding: str = "embed_tokens"
    embedding_padding_idx: bool = True  # False: the embedding has no padding row (whose gradient it would zero)
    layers: str = "layers"
    decoder_layer: str = "DecoderLayer"  # the decoder layer class's suffix (GPT-NeoX: GPTNeoXLayer, GPT-J: GPTJBlock)
    attention: str = "self_attn"  # the attention module of a layer (GPT-NeoX: attention, GPT-J: attn)
    # The final norm's class suffix; None: torch's LayerNorm (with bias), which GPT-NeoX, Phi, GPT-J and Falcon use
    final_norm_class: str | None = "RMSNorm"
    lm_head_bias: bool = False  # Phi-1/2, GPT-J, CodeGen: the LM head has a bias
    # Cohere: logit_scale, Falcon-H1: lm_head_multiplier, as config fields: the logits are multiplied by it
    logits_multiplier_key: str | None = None
    # The config field of the dropout on the token embedding (Phi: embd_pdrop), applied in training as the source does
    embedding_dropout_key: str | None = None
    # How the attention module takes the cache, where not as the installed transformers names it (GPT-NeoX, Falcon:
    # `layer_past`)
    attention_cache_argument: str | None = None

    # The one-branch layout: each decoder layer has ONE residual branch, which reads the stream once (through its
    # norms) and adds its output once: attention and MLP in parallel on the same input (GPT-NeoX's parallel residual,
    # Phi-1/2, GPT-J, CodeGen, Cohere, Falcon), or one mixer per layer (Nemotron-H). The depth mix then replaces what
    # the branch reads. True: every layer; a config field: the layers are one-branch where it is true (GPT-NeoX:
    # `use_parallel_residual`, Falcon: `parallel_attn`), and sequential (two sublayers) otherwise.
    one_branch: bool | str = False
    # Nemotron-H: the layer types whose layer holds only an MLP (or MoE), by its attribute, called with the hidden
    # states alone
    mlp_layers: dict[str, str] = field(default_factory=dict)
    # OLMo-Hybrid: the norms by layer type (NORM_FIELDS), where a type's differ from the fields above (its attention
    # layers normalise only their outputs, its DeltaNet layers their inputs: `post_attention_layernorm` is either)
    norms_by_layer_type: dict[str, dict] = field(default_factory=dict)
    # Falcon-H1: the layer types whose first sublayer runs several token mixers in parallel on its one normed input,
    # their outputs summed in this order (each with its own mask, cache state and multipliers, see `Mixer`)
    parallel_mixers: dict[str, tuple["Mixer", ...]] = field(default_factory=dict)
    # Buffers the source's model computes from its config and registers on a module of each layer, unsaved
    # (Falcon-H1's `mamba.mup_vector`): the attribute path -> the function of the family's modeling module that
    # computes it from the text config
    computed_buffers: dict[str, str] = field(default_factory=dict)

    def has_one_branch(self, text_config) -> bool:
        """Whether the decoder layers of `text_config` each have one residual branch (see `one_branch`)."""
        if isinstance(self.one_branch, str):
            return bool(getattr(text_config, self.one_branch))
        return self.one_branch

    def mixers(self, layer_type: str) -> tuple["Mixer", ...]:
        """The token mixers of a layer of `layer_type`: its parallel mixers, else its one (the attention, or the
        recurrent mixer its type names), none in a layer that holds only an MLP (Nemotron-H's)."""
        if layer_type in self.mlp_layers:
            return ()
        if layer_type in self.parallel_mixers:
            return self.parallel_mixers[layer_type]
        return (Mixer(self.token_mixers.get(layer_type, self.attention), layer_type),)

    def norms(self, layer_type: str, has: Callable[[str], bool] = lambda name: True) -> "Norms":
        """The norms of a layer of `layer_type`, by the names the source's layer has (`has`): a field naming several
        modules takes the first the layer has (Falcon: `ln_attn` in its decoder with two norms, else
        `input_layernorm`)."""
        names = {key: getattr(self, key) for key in NORM_FIELDS} | self.norms_by_layer_type.get(layer_type, {})

        def present(name: str | tuple[str, ...] | None) -> str | None:
            candidates = (name,) if isinstance(name, str) else name or ()
            return next((candidate for candidate in candidates if has(candidate)), None)

        return Norms(**{key: present(name) for key, name in names.items()})


class Mixer(NamedTuple):
    """A token mixer of a layer: its attribute, and the layer type whose mask and call it takes (a recurrent type of
    RECURRENT_LAYER_TYPES: the 2D padding mask, the cache, no RoPE; else the attention mask of that type, RoPE).
    Falcon-H1's multipliers, as config fields: its input is multiplied by one, its output by the other."""

    module: str
    mask: str
    input_multiplier_key: str | None = None
    output_multiplier_key: str | None = None


NORM_FIELDS = ("attention_input_norm", "attention_output_norm", "mlp_input_norm", "mlp_output_norm")


class Norms(NamedTuple):
    """The norms around a layer's two sublayers, by attribute name (None: none there)."""

    attention_input_norm: str | None
    attention_output_norm: str | None
    mlp_input_norm: str | None
    mlp_output_norm: str | None


# Sandwich-norm layers: input and output norms around both sublayers (Gemma2, Gemma3)
SANDWICH_NORMS = dict(
    attention_output_norm="post_attention_layernorm",
    mlp_input_norm="pre_feedforward_layernorm",
    mlp_output_norm="post_feedforward_layernorm",
)
# Output norms only, no input norm (OLMo-2, OLMo-3, EXAONE-4)
OUTPUT_NORMS_ONLY = dict(
    attention_input_norm=None,
    attention_output_norm="post_attention_layernorm",
    mlp_input_norm=None,
    mlp_output_norm="post_feedforward_layernorm",
)
HYBRIDS_TRANSFORMERS = "5.24.0"
ROTARY_MODULE_TRANSFORMERS = "5.24.0"  # GPT-J's and CodeGen's RotaryEmbedding
FALCON_TRANSFORMERS = "5.25.0"  # FalconAttention without the `alibi` argument
# LFM2's names: `conv` layers, the operator and feed-forward norms, and a final norm named for the embedding
LFM2_LAYOUT = dict(
    attention_input_norm="operator_norm",
    mlp_input_norm="ffn_norm",
    token_mixers={"conv": "conv"},
    mlp=("feed_forward",),
    final_norm="embedding_norm",
    norm_eps_key="norm_eps",
    oldest_transformers=HYBRIDS_TRANSFORMERS,
)
# Bamba's and Jamba's names: `mamba` layers, a pre-feed-forward norm and a final layer norm
MAMBA_LAYOUT = dict(
    mlp_input_norm="pre_ff_layernorm",
    token_mixers={"linear_attention": "mamba"},
    mlp=("feed_forward",),
    final_norm="final_layernorm",
    oldest_transformers=HYBRIDS_TRANSFORMERS,
)
LAYER_NORM_FINAL = dict(final_norm_class=None)  # torch's LayerNorm as the final norm (GPT-NeoX, Phi, GPT-J, Falcon)
# GPT-J's and CodeGen's names: `wte`, blocks `h` of one input norm `ln_1`, attention `attn`, a final `ln_f`; a
# biased LM head
GPTJ_LAYOUT = dict(
    embedding="wte", embedding_padding_idx=False, layers="h", decoder_layer="Block", attention="attn",
    attention_input_norm="ln_1", mlp_input_norm="ln_1", embedding_dropout_key="embd_pdrop", final_norm="ln_f",
    **LAYER_NORM_FINAL, norm_eps_key="layer_norm_epsilon", lm_head_bias=True, one_branch=True,
    oldest_transformers=ROTARY_MODULE_TRANSFORMERS,
)  # fmt: skip
COHERE_LAYOUT = dict(
    mlp_input_norm="input_layernorm",
    final_norm_class="LayerNorm",
    norm_eps_key="layer_norm_eps",
    logits_multiplier_key="logit_scale",
    one_branch=True,
)

# The source families whose decoder layers AttnRes rewires, by the `model_type` of their text config: the one
# declaration of them. The configuration checks a config against its keys (without torch); the model builds and runs
# the family's modules from its rows.
FAMILIES = {
    "llama": Family("llama", "Llama"),
    "mistral": Family("mistral", "Mistral"),
    "qwen2": Family("qwen2", "Qwen2"),
    "qwen3": Family("qwen3", "Qwen3"),
    "qwen3_moe": Family("qwen3_moe", "Qwen3Moe", num_experts_key="num_experts"),
    "mixtral": Family("mixtral", "Mixtral", num_experts_key="num_local_experts"),
    "gemma3_text": Family("gemma3", "Gemma3", **SANDWICH_NORMS, scaled_embedding=True, rope_per_layer_type=True),
    "ministral": Family("ministral", "Ministral"),
    "ministral3": Family("ministral3", "Ministral3"),
    "smollm3": Family("smollm3", "SmolLM3"),
    "phi3": Family("phi3", "Phi3", output_dropouts=("resid_attn_dropout", "resid_mlp_dropout")),
    "granite": Family(
        "granite",
        "Granite",
        embedding_multiplier_key="embedding_multiplier",
        residual_multiplier_key="residual_multiplier",
        logits_divisor_key="logits_scaling",
    ),
    "glm4": Family(
        "glm4", "Glm4", attention_output_norm="post_self_attn_layernorm", mlp_output_norm="post_mlp_layernorm"
    ),
    "gemma2": Family("gemma2", "Gemma2", **SANDWICH_NORMS, scaled_embedding=True, supports_sdpa=False),
    "olmo2": Family("olmo2", "Olmo2", **OUTPUT_NORMS_ONLY),
    "olmo3": Family("olmo3", "Olmo3", **OUTPUT_NORMS_ONLY, rope_per_layer_type=True),
    "exaone4": Family("exaone4", "Exaone4", **OUTPUT_NORMS_ONLY),
    "gpt_oss": Family("gpt_oss", "GptOss", num_experts_key="num_local_experts", mlp_returns_tuple=True),  # eager: sinks
    "deepseek_v3": Family("deepseek_v3", "DeepseekV3"),  # MLA, dense first layers then routed + shared experts
    # Hybrids: gated DeltaNet / short-convolution / Kimi Delta Attention layers between attention layers
    "qwen3_next": Family(
        "qwen3_next",
        "Qwen3Next",
        num_experts_key="num_experts",
        token_mixers={"linear_attention": "linear_attn"},
        oldest_transformers=HYBRIDS_TRANSFORMERS,
    ),
    "lfm2": Family("lfm2", "Lfm2", **LFM2_LAYOUT),
    "lfm2_moe": Family("lfm2_moe", "Lfm2Moe", **LFM2_LAYOUT),
    "kimi_linear": Family(  # MLA without RoPE
        "kimi_linear", "KimiLinear", rotary_embedding=False, oldest_transformers=HYBRIDS_TRANSFORMERS
    ),
    # Mamba-2 layers between attention layers
    "bamba": Family("bamba", "Bamba", **MAMBA_LAYOUT, layer_type_argument=True),
    "granitemoehybrid": Family(
        "granitemoehybrid",
        "GraniteMoeHybrid",
        num_experts_key="num_local_experts",
        token_mixers={"linear_attention": "mamba"},
        mlp=("block_sparse_moe", "shared_mlp"),
        embedding_multiplier_key="embedding_multiplier",
        residual_multiplier_key="residual_multiplier",
        logits_divisor_key="logits_scaling",
        rope_switch=("position_embedding_type", "rope"),
        oldest_transformers=HYBRIDS_TRANSFORMERS,
    ),
    # Mamba-2 and attention in parallel in every layer (its one layer type, "hybrid"), then an MLP; muP multipliers on
    # the embedding looked up from ids, each mixer's input and output, the MLP and the logits
    "falcon_h1": Family(
        "falcon_h1",
        "FalconH1",
        **MAMBA_LAYOUT,
        parallel_mixers={
            "hybrid": (
                Mixer("mamba", "linear_attention", output_multiplier_key="ssm_out_multiplier"),
                Mixer("self_attn", "full_attention", "attention_in_multiplier", "attention_out_multiplier"),
            )
        },
        computed_buffers={"mamba.mup_vector": "compute_mup_vector"},
        embedding_multiplier_key="embedding_multiplier",
        embedding_multiplier_on_ids_only=True,
        logits_multiplier_key="lm_head_multiplier",
    ),
    # Gated-DeltaNet layers, normed on their inputs as Llama's, between attention layers normed only on their outputs
    # as OLMo-2's; a layer class per type; RoPE (on the attention layers) only where the config sets a theta
    "olmo_hybrid": Family(
        "olmo_hybrid",
        "OlmoHybrid",
        token_mixers={"linear_attention": "linear_attn"},
        decoder_layers={"full_attention": "AttentionDecoderLayer", "linear_attention": "LinearAttentionDecoderLayer"},
        norms_by_layer_type={"full_attention": OUTPUT_NORMS_ONLY},
        rope_needs_theta=True,
        oldest_transformers=HYBRIDS_TRANSFORMERS,
    ),
    # Mamba layers between attention layers without RoPE, a layer class per type, MoE every other layer
    "jamba": Family(
        "jamba",
        "Jamba",
        **MAMBA_LAYOUT,
        num_experts_key="num_experts",
        decoder_layers={"full_attention": "AttentionDecoderLayer", "linear_attention": "MambaDecoderLayer"},
        rotary_embedding=False,
    ),
    # One-branch layers: attention and MLP in parallel on the same input, their outputs joined in one residual add
    "gpt_neox": Family(  # Pythia; `use_parallel_residual=False` runs sequentially, as two sublayers
        "gpt_neox",
        "GPTNeoX",
        embedding="embed_in",
        embedding_padding_idx=False,
        decoder_layer="Layer",
        attention="attention",
        attention_cache_argument="layer_past",
        output_dropouts=("post_attention_dropout", "post_mlp_dropout"),
        embedding_dropout_key="hidden_dropout",
        final_norm="final_layer_norm",
        **LAYER_NORM_FINAL,
        norm_eps_key="layer_norm_eps",
        one_branch="use_parallel_residual",
    ),
    "phi": Family(  # Phi-1, Phi-1.5, Phi-2: one input norm for both, a biased LM head
        "phi",
        "Phi",
        mlp_input_norm="input_layernorm",
        output_dropouts=("resid_dropout", "resid_dropout"),
        embedding_dropout_key="embd_pdrop",
        final_norm="final_layernorm",
        **LAYER_NORM_FINAL,
        norm_eps_key="layer_norm_eps",
        lm_head_bias=True,
        one_branch=True,
    ),
    "gptj": Family("gptj", "GPTJ", **GPTJ_LAYOUT),
    "codegen": Family("codegen", "CodeGen", **GPTJ_LAYOUT),
    # Cohere's LayerNorm without bias, one for both; the logits multiplied by logit_scale; Cohere2: sliding layers
    "cohere": Family("cohere", "Cohere", **COHERE_LAYOUT),
    "cohere2": Family("cohere2", "Cohere2", **COHERE_LAYOUT),
    # Falcon: one branch where `parallel_attn` (its old decoder with one norm; its new decoder architecture with two,
    # `ln_attn` and `ln_mlp`, or one), two sequential sublayers otherwise
    "falcon": Family(
        "falcon",
        "Falcon",
        one_branch="parallel_attn",
        embedding="word_embeddings",
        embedding_padding_idx=False,
        layers="h",
        final_norm="ln_f",
        **LAYER_NORM_FINAL,
        attention="self_attention",
        attention_cache_argument="layer_past",
        norm_eps_key="layer_norm_epsilon",
        attention_input_norm=("ln_attn", "input_layernorm"),
        mlp_input_norm=("ln_mlp", "post_attention_layernorm", "input_layernorm"),
        oldest_transformers=FALCON_TRANSFORMERS,
    ),  # fmt: skip
    # One mixer per layer, by its type: Mamba-2, attention without RoPE, MLP or MoE, each on the layer's one norm
    "nemotron_h": Family(
        "nemotron_h",
        "NemotronH",
        embedding="embeddings",
        embedding_padding_idx=False,
        decoder_layer="Block",
        attention="mixer",
        token_mixers={"linear_attention": "mixer"},
        mlp_layers={"mlp": "mixer", "moe": "mixer"},
        attention_input_norm="norm",
        mlp_input_norm="norm",
        final_norm="norm_f",
        norm_eps_key="layer_norm_epsilon",
        rotary_embedding=False,
        one_branch=True,
        oldest_transformers=HYBRIDS_TRANSFORMERS,
    ),
}
SUPPORTED_FAMILIES = tuple(FAMILIES)
# Layer types (`layer_types`) whose token mixer is recurrent (linear attention, short convolution, state space): it
# keeps its state in the cache and reads a 2D padding mask
RECURRENT_LAYER_TYPES = ("linear_attention", "conv")

# Architectures that cannot convert exactly, refused by name (`model_type`) with what they have and why. AttnRes needs
# PreNorm residual branches (two sequential sublayers per layer, or one branch), each reading the residual stream
# (through its own input norms, or raw) and adding its output to it: a depth mixture then replaces exactly what each
# branch read (paper §3).
POST_NORM = (
    "a post-norm architecture; AttnRes needs PreNorm sublayers. It normalises after the residual add, so no sublayer "
    "reads the residual stream that a depth mixture would replace"
)
ALIBI = (
    "Falcon with ALiBi (Falcon-RW): its model adds the position bias to the attention mask it builds, which AttnRes's "
    "masks (the family's own mask functions) do not carry; RoPE Falcon (alibi=False) converts"
)
ENCODER = "an encoder or encoder-decoder: AttnRes wraps causal decoders (and converts their text model)"
REFUSED_FAMILIES = {
    **dict.fromkeys(("bert", "roberta", "xlm-roberta", "electra", "albert", "distilbert"), POST_NORM),
    **dict.fromkeys(("mamba", "mamba2"), "a state-space model without attention sublayers"),
    **dict.fromkeys(("t5", "bart", "mbart", "whisper"), ENCODER),
}
