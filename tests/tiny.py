"""What tests share: tiny randomly initialised source models of every supported family, their AttnRes twins, a
tokenizer for them and their token ids, and the `attnres` command run in-process."""

import string
import sysconfig
from contextlib import redirect_stderr, redirect_stdout
from io import StringIO
from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, Gemma3Config, PreTrainedTokenizerFast

import attnres
from attnres.auto import is_attnres_parameter
from attnres.families import FAMILIES, RECURRENT_LAYER_TYPES
from attnres_cli.command import main

VOCAB = 96
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
# Multi-head latent attention (DeepSeek-V3, Kimi Linear)
TINY_MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,  # MLA keys have one head per query head
)
# Granite's embedding, residual, attention and logits multipliers (Granite, GraniteMoeHybrid)
GRANITE_SCALARS = dict(
    embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.05, logits_scaling=8.0
)
NEMOTRON_MAMBA2 = dict(mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=16, n_groups=1, chunk_size=16)
NEMOTRON_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
TINY_MAMBA2 = dict(mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16)
# Each supported family's settings beside COMMON (tests/test_architecture.py checks that none is missing)
FAMILY_OVERRIDES = {
    "llama": dict(tie_word_embeddings=True),
    "mistral": dict(sliding_window=6),
    "qwen2": dict(),
    "qwen3": dict(),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "ministral": dict(sliding_window=6, layer_types=None),  # alternating sliding and full layers, set below
    # Llama-4 attention scaling from position 8 on, so that generation reaches it
    "ministral3": dict(
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=1e6,
            factor=32.0,
            original_max_position_embeddings=8,
            beta_fast=32.0,
            beta_slow=1.0,
            mscale=1.0,
            mscale_all_dim=1.0,
            llama_4_scaling_beta=0.1,
        ),
    ),
    "smollm3": dict(no_rope_layer_interval=2, use_sliding_window=True, sliding_window=6),  # every 2nd layer: no RoPE
    # Half the head dimension rotated; residual dropout, which only training sees
    "phi3": dict(rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5), resid_pdrop=0.1),
    "granite": dict(
        **GRANITE_SCALARS,
        tie_word_embeddings=True,
    ),
    "glm4": dict(),  # rotates half the head dimension by default
    # Output norms and no input norms; sliding layers in OLMo-3 and EXAONE-4
    "olmo2": dict(),
    "olmo3": dict(sliding_window=6),
    "exaone4": dict(sliding_window=6, sliding_window_pattern=2),
    # Attention sinks, sliding layers, an MoE that returns (output, router scores); YaRN scaled to the tiny context
    "gpt_oss": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        rope_parameters=dict(
            rope_type="yarn",
            rope_theta=150000.0,
            factor=32.0,
            original_max_position_embeddings=8,
            beta_fast=32.0,
            beta_slow=1.0,
            truncate=False,
        ),
    ),
    # Multi-head latent attention; layer 0 dense, then 4 routed experts and a shared one
    "deepseek_v3": dict(
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        n_shared_experts=1,
        head_dim=8,
        **TINY_MLA,
    ),
    "gemma2": dict(
        sliding_window=6,
        layer_types=None,
        query_pre_attn_scalar=16,
        attn_logit_softcapping=5.0,  # reached by the scaled-up tiny weights
        final_logit_softcapping=3.0,
        tie_word_embeddings=True,
    ),
    "gemma3_text": dict(
        sliding_window=6,
        layer_types=None,
        query_pre_attn_scalar=16,
        final_logit_softcapping=30.0,
        tie_word_embeddings=True,
    ),
    # Hybrids: recurrent layers (gated DeltaNet, short convolution, Kimi Delta Attention) alternate with attention
    # layers, set below; an MoE every second layer (Qwen3-Next), after a dense first layer (LFM2-MoE, Kimi Linear)
    "qwen3_next": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        decoder_sparse_step=2,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
    ),
    "lfm2": dict(),
    "lfm2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, num_dense_layers=1),
    "kimi_linear": dict(
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        first_k_dense_replace=1,
        linear_attn_config=dict(num_heads=4, head_dim=16, short_conv_kernel_size=4),
        **TINY_MLA,
    ),
    "olmo_hybrid": dict(  # RoPE, which the layers take where the config sets a theta; NoPE in test_families.py
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16
    ),
    # Mamba-2 and attention in parallel in every layer; its muP multipliers away from 1, so that a misplaced one shows
    "falcon_h1": dict(
        **TINY_MAMBA2,
        mamba_d_ssm=128,
        embedding_multiplier=2.0,
        lm_head_multiplier=0.5,
        mlp_multipliers=[0.8, 1.2],
        key_multiplier=0.7,
        attention_in_multiplier=1.3,
        attention_out_multiplier=0.6,
        ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.05],
        ssm_in_multiplier=1.2,
        ssm_out_multiplier=0.7,
    ),
    # Mamba-2 layers (Bamba, GraniteMoeHybrid) and Mamba layers (Jamba) at the even indices, attention at the odd
    "bamba": dict(attn_layer_indices=[1, 3, 5, 7, 9], **TINY_MAMBA2),
    "granitemoehybrid": dict(
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=32,
        **GRANITE_SCALARS,
        position_embedding_type="rope",
        **TINY_MAMBA2,
    ),
    "jamba": dict(
        attn_layer_period=2,
        attn_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=16,
    ),
    # One-branch layers: attention and MLP in parallel, LayerNorms with biases, partial rotary
    "gpt_neox": dict(
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5), use_parallel_residual=True
    ),
    "phi": dict(  # Phi-2's settings: a norm shared by attention and MLP, residual dropout, a biased LM head
        rope_parameters=dict(rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5), resid_pdrop=0.1
    ),
    # GPT-J: interleaved rotary on half the head dimension, from a table of positions as long as the sample text
    "gptj": dict(rotary_dim=8, max_position_embeddings=1024),
    "codegen": dict(rotary_dim=8, max_position_embeddings=1024),
    "cohere": dict(logit_scale=0.5),  # a LayerNorm without bias shared by attention and MLP, tied and scaled logits
    "cohere2": dict(logit_scale=0.5, sliding_window=6, layer_types=None),  # RoPE on the sliding layers only
    # Falcon's new decoder architecture: grouped keys and values, `ln_attn` and `ln_mlp` in parallel; its old one in
    # test_families.py
    "falcon": dict(new_decoder_architecture=True, num_kv_heads=2, parallel_attn=True, alibi=False),
    # One mixer per layer: Mamba-2, attention, routed + shared experts, MLP, in turn (`layers_block_type`, set below)
    "nemotron_h": dict(
        **NEMOTRON_MAMBA2, **NEMOTRON_MOE, moe_shared_expert_intermediate_size=32, layers_block_type=None
    ),
}
# Layer types in turn from layer 0 on, where a family has more than two
LAYER_TYPE_CYCLES = {"nemotron_h": ("linear_attention", "full_attention", "moe", "mlp")}
ALTERNATING_LAYER_TYPES = ("gemma2", "gemma3_text", "ministral", "cohere2")
# The hybrids' recurrent layer type, which alternates with full attention from layer 0 on
HYBRID_LAYER_TYPES = {
    "qwen3_next": "linear_attention",
    "lfm2": "conv",
    "lfm2_moe": "conv",
    "kimi_linear": "linear_attention",
    "granitemoehybrid": "linear_attention",
    "olmo_hybrid": "linear_attention",
}
# `attnres train` options for a tiny model on a tiny corpus: a few seconds per run on one CPU core
TINY_RUN = dict(
    seq_len=32,
    batch_size=4,
    max_steps=4,
    lr=3e-3,
    attnres_lr=1e-2,
    warmup_steps=0,
    eval_size=0.1,
    max_eval_sequences=8,
    log_every=1,
    eval_every=100,
    save_every=100,
)

# The model's code, which save_pretrained copies beside the weights (remote code)
MODEL_CODE = (
    "configuration_attnres.py",
    "modeling_attnres.py",
    "depth_mixing.py",
    "depth_mix_backends.py",
    "depth_rules.py",
    "families.py",
    "rules.py",
)


def recurrent_layer_types(family: str, layer_types) -> list[str]:
    """The layer types of `layer_types` whose layers hold a recurrent token mixer (Falcon-H1's "hybrid": one beside
    their attention)."""
    mixers = FAMILIES[family].mixers
    return [kind for kind in layer_types if any(mixer.mask in RECURRENT_LAYER_TYPES for mixer in mixers(kind))]


def hybrid_families() -> list[str]:
    """The supported families whose tiny models have recurrent token mixers."""
    return [
        family
        for family in attnres.SUPPORTED_FAMILIES
        if recurrent_layer_types(family, getattr(tiny_source_config(family), "layer_types", None) or ())
    ]


def random_ids(batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    """Token ids of the tiny vocabulary, past its special tokens, the same for the same arguments."""
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def stdlib_text_ids(module: str, count: int, seq_len: int) -> torch.Tensor:
    """[count, seq_len]: the source of a standard-library module as the tiny tokenizer reads it (text that a few
    training steps can learn from, and that another module's text tests on)."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / f"{module}.py").read_text()
    return torch.tensor(tiny_tokenizer()(text)["input_ids"][: count * seq_len]).view(count, seq_len)


# Settings of COMMON that a family's config refuses (Falcon derives its head dimension; its key-value heads are
# `num_kv_heads`)
COMMON_REFUSED = {"falcon": ("head_dim", "num_key_value_heads")}


def tiny_source_config(family: str, num_layers: int = 5, **overrides):
    common = {key: value for key, value in COMMON.items() if key not in COMMON_REFUSED.get(family, ())}
    kwargs = {**common, **FAMILY_OVERRIDES[family], "num_hidden_layers": num_layers, **overrides}
    if family in ALTERNATING_LAYER_TYPES:  # alternate sliding and full attention layers
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    if family in LAYER_TYPE_CYCLES:
        cycle = LAYER_TYPE_CYCLES[family]
        kwargs["layers_block_type"] = [cycle[i % len(cycle)] for i in range(num_layers)]
    if family in HYBRID_LAYER_TYPES:
        recurrent = HYBRID_LAYER_TYPES[family]
        kwargs["layer_types"] = [recurrent if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    return AutoConfig.for_model(family, **kwargs)


def tiny_source_model(family: str, num_layers: int = 5, seed: int = 0, **overrides):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_source_config(family, num_layers, **overrides)).eval()


def tiny_gemma3_multimodal():
    """A Gemma3ForConditionalGeneration: the tiny Gemma3 text model plus a one-layer vision tower.

    Its image tokens get ids of their own, beyond the tokenizer's, so that text never contains them. No final logit
    softcapping, as in the Hub's Gemma3 configs: Gemma3ForConditionalGeneration (transformers 5.24) would ignore it.
    """
    config = Gemma3Config(
        text_config=tiny_source_config("gemma3_text", vocab_size=VOCAB + 3, final_logit_softcapping=None).to_dict(),
        vision_config=dict(
            hidden_size=32,
            intermediate_size=37,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ),
        mm_tokens_per_image=4,
        boi_token_index=VOCAB,
        eoi_token_index=VOCAB + 1,
        image_token_index=VOCAB + 2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def attnres_twin(source, seed: int | None = None, **attnres_settings) -> attnres.AttnResForCausalLM:
    """An AttnRes model holding the source's weights; with `seed`, random non-zero queries and key gains."""
    config = attnres.AttnResConfig(text_config=source.config.to_dict(), **attnres_settings)
    model = attnres.AttnResForCausalLM(config).eval()
    # The source's text model and LM head, as conversion takes them (GPT-NeoX and GPT-J keep their layers under
    # `gpt_neox.` and `transformer.`, where the AttnRes model keeps them under `model.`)
    state = {f"model.{name}": tensor for name, tensor in source.get_decoder().state_dict().items()}
    state |= {f"lm_head.{name}": tensor for name, tensor in source.get_output_embeddings().state_dict().items()}
    result = model.load_state_dict(state, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    assert all(is_attnres_parameter(key) for key in result.missing_keys), result.missing_keys
    if seed is not None:
        randomize_depth_parameters(model, seed)
    return model


def randomize_depth_parameters(model, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_res_proj" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.5)
            elif "_res_norm" in name:
                parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer over the tiny models' 96 token ids, built here rather than downloaded."""
    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2: the tiny configs' pad, bos and eos
    characters = list(" \n" + string.ascii_letters + string.digits + string.punctuation)[: VOCAB - len(specials)]
    vocab = {token: token_id for token_id, token in enumerate(specials + characters)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def run_cli(*argv) -> tuple[int, str, str]:
    """`attnres ARGV...` in this process (fast) -> its exit status, what it printed on stdout, and on stderr."""
    stdout, stderr = StringIO(), StringIO()
    with redirect_stdout(stdout), redirect_stderr(stderr):
        exit_code = main([str(arg) for arg in argv])
    return exit_code, stdout.getvalue(), stderr.getvalue()


# The families the fast tier (`pytest -m "not slow"`) tries: a plain one, a mixture of experts, and one with (1 + w)
# norms, output norms and sliding layers. The others run in the full suite (CI), marked slow.
FAST_FAMILIES = ("llama", "qwen3_moe", "gemma3_text")


def family_params(families, fast=FAST_FAMILIES) -> list:
    """`families` as parameters, those beyond `fast` marked slow."""
    return [family if family in fast else pytest.param(family, marks=pytest.mark.slow) for family in families]
