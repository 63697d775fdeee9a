"""Our Block AttnRes computes what Kimi K3 (moonshotai/Kimi-K3, the first public model with Attention Residuals) does.

`k3_logits` below is K3's AttnRes forward loop as its modeling code runs it, written here independently in plain torch
and run on our model's own modules and weights: embedding, each layer's attention and MLP sublayers with their input
norms, the depth projections and norms (K3's parameter names are ours), final norm and LM head. K3's loop:

- before each attention and each MLP, a softmax over depth mixes the completed blocks and the partial sum carried
  from the previous sublayers; layer 0's attention, with no completed block yet, reads the embedding as it is;
- a block closes at the decoder layers whose 0-based index is a multiple of `attn_res_block_size` (counted in decoder
  layers), after that layer's attention mix: the partial sum it read becomes a completed block;
- keys: the sources RMS-normalised without weight, times the norm weight, scored against the projection weight (the
  pseudo-query), in fp32, eps = the model's `rms_norm_eps`; values: the sources themselves;
- the output mix over the blocks and the last partial sum comes before the final norm.
"""

import pytest
import torch
from tiny import attnres_twin, family_params, random_ids, tiny_source_model

NUM_LAYERS = 6
# One layer per block, a size that divides the depth, one that does not (a partial last block), the whole depth
BLOCK_SIZES = (1, 2, 4, NUM_LAYERS)
# Llama: K3's layer layout (input norm, attention, post-attention norm, MLP). DeepSeek-V3: K3's kind of attention
# (multi-head latent attention) and MLP (a dense first layer, then routed and shared experts). Kimi Linear: K3's own
# family, Kimi Delta Attention layers (recurrent) between MLA layers without RoPE.
FAMILIES = ("llama", "deepseek_v3", "kimi_linear")
# Both run in float64, so that float32 rounding (up to ~3e-5 on these logits, in either computation) cannot hide a
# difference; what is left is the order of the sums (two-phase: folded queries, blocks scored once per layer), which
# this allows for, relative to the largest logit. Measured: 0.0 for every case.
TOLERANCE = 1e-12


def k3_depth_mix(blocks, partial_sum, proj_weight, norm_weight, eps, num_sources):
    """K3's mix of one sublayer: blocks and partial sum [B,T,d] each -> its input [B,T,d], in fp32 (float64 here)."""
    dtype = torch.promote_types(partial_sum.dtype, torch.float32)
    values = torch.stack([*blocks, partial_sum], dim=-2).to(dtype)  # [B,T,S,d]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps) * norm_weight.to(dtype)
    scores = keys @ proj_weight.to(dtype).squeeze(0)  # projection weight [1,d], as K3's Linear(d, 1)
    num_sources.append(values.shape[-2])
    return (scores.softmax(-1).unsqueeze(-2) @ values).squeeze(-2)


def k3_logits(model, input_ids, block_size):
    """-> logits [B,T,V] and the number of sources of each mix (A0, M0, A1, ..., output)."""
    decoder, eps, num_sources = model.model, model.config.text_config.rms_norm_eps, []
    length = input_ids.shape[1]
    embeddings = decoder.embed_tokens(input_ids)
    causal_mask = torch.full((length, length), float("-inf"), dtype=embeddings.dtype).triu(1)[None, None]
    attention_kwargs = dict(attention_mask=causal_mask)
    if decoder.rotary_emb is not None:  # Kimi Linear has no RoPE
        attention_kwargs["position_embeddings"] = decoder.rotary_emb(embeddings, torch.arange(length)[None])
    layer_types = getattr(model.config.text_config, "layer_types", None) or ["full_attention"] * len(decoder.layers)

    blocks, partial_sum = [], embeddings
    for layer_idx, layer in enumerate(decoder.layers):
        if blocks:
            attention_input = k3_depth_mix(
                blocks, partial_sum, layer.self_attention_res_proj.weight, layer.self_attention_res_norm.weight,
                eps, num_sources,
            )  # fmt: skip
        else:
            attention_input = partial_sum
            num_sources.append(1)
        if layer_idx % block_size == 0:
            blocks, partial_sum = blocks + [partial_sum], None
        attention_input = layer.input_layernorm(attention_input.to(embeddings.dtype))
        if layer_types[layer_idx] == "linear_attention":  # Kimi Delta Attention: no padding, no cache
            attention_output = layer.self_attn(hidden_states=attention_input, attention_mask=None)
        else:
            attention_output, _ = layer.self_attn(hidden_states=attention_input, **attention_kwargs)
        partial_sum = attention_output if partial_sum is None else partial_sum + attention_output
        mlp_input = k3_depth_mix(
            blocks, partial_sum, layer.mlp_res_proj.weight, layer.mlp_res_norm.weight, eps, num_sources
        )
        partial_sum = partial_sum + layer.mlp(layer.post_attention_layernorm(mlp_input.to(embeddings.dtype)))

    output = k3_depth_mix(
        blocks, partial_sum, decoder.output_attn_res_proj.weight, decoder.output_attn_res_norm.weight, eps, num_sources
    )
    return model.lm_head(decoder.norm(output.to(embeddings.dtype))), num_sources


def k3_twin(family: str, block_size: int, **attnres_settings):
    """Our model with K3's settings: `attnres_block_size` = K3's `attn_res_block_size`, no rescaling by the number of
    sources; trained-looking (random) pseudo-queries and norm weights."""
    source = tiny_source_model(family, num_layers=NUM_LAYERS, initializer_range=0.1)
    return attnres_twin(source, seed=4, attnres_block_size=block_size, **attnres_settings).double()


@pytest.mark.parametrize("implementation", ["two_phase", "naive"])
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("family", family_params(FAMILIES, fast=("llama", "deepseek_v3")))  # KDA: ~20 s a case
def test_block_attnres_equals_k3_loop(family, block_size, implementation):
    model = k3_twin(family, block_size, attnres_implementation=implementation)
    input_ids = random_ids(length=12)
    with torch.no_grad():
        logits = model(input_ids).logits
        expected, num_sources = k3_logits(model, input_ids, block_size)
    max_diff = (logits - expected).abs().max().item()
    print(f"{family} block size {block_size} {implementation}: max abs logit diff {max_diff:.2e}")
    assert max_diff <= TOLERANCE * max(1.0, expected.abs().max().item())
    # The same sources at every sublayer: K3's block size in decoder layers is our `attnres_block_size`
    assert num_sources == model.config.num_sources()
