"""Inference engines that serve transformers models as they are (vLLM's Transformers backend, SGLang) plug in their own
attention through `AttentionInterface`: a model qualifies when every attention layer calls
`ALL_ATTENTION_FUNCTIONS[config._attn_implementation]`, the keyword arguments of the model call reach it, and the model
declares `_supports_attention_backend`. Shown here for every supported family with an attention function registered the
way those engines register theirs: it counts its calls and runs the attention the model would run anyway."""

import importlib

import pytest
import torch
from tiny import attnres_twin, family_params, random_ids, tiny_source_model
from transformers import AttentionInterface, AttentionMaskInterface, AutoModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import eager_mask, sdpa_mask

import attnres
from attnres.families import RECURRENT_LAYER_TYPES, SUPPORTED_FAMILIES
from attnres.modeling_attnres import family_class, family_of


class CountingAttention:
    """An attention function that records each call (the attention module, its keyword arguments) and runs `sdpa`, or
    for "eager" the eager attention of the module's own family (Gemma2's softcapping and GPT-OSS's sinks live there)."""

    def __init__(self, base: str):
        self.base = base
        self.calls = []

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        self.calls.append((module, kwargs))
        if self.base == "sdpa":
            attention = sdpa_attention_forward
        else:
            attention = importlib.import_module(type(module).__module__).eager_attention_forward
        return attention(module, query, key, value, attention_mask, **kwargs)


COUNTING = {base: CountingAttention(base) for base in ("sdpa", "eager")}
for base, counting_attention in COUNTING.items():
    AttentionInterface.register(f"counting_{base}", counting_attention)
    # The masks the base attention gets; without a registered mask the model passes none (as it does for vLLM, whose
    # attention masks by itself)
    AttentionMaskInterface.register(f"counting_{base}", {"sdpa": sdpa_mask, "eager": eager_mask}[base])

NUM_LAYERS = 3


def test_attention_backend_support_is_declared():
    assert attnres.AttnResForCausalLM.is_backend_compatible()
    assert attnres.AttnResModel.is_backend_compatible()


@pytest.mark.parametrize("family", family_params(SUPPORTED_FAMILIES))
def test_every_layer_calls_the_registered_attention_with_the_call_kwargs(family):
    model = attnres_twin(tiny_source_model(family, num_layers=NUM_LAYERS), seed=1, attnres_block_size=2)
    ids = random_ids(length=12)  # longer than the tiny sliding windows (6)
    with torch.no_grad():
        expected = model(ids).logits
    base = model.config._attn_implementation
    family_supports_sdpa = family_class(family_of(model.config), "PreTrainedModel")._supports_sdpa
    assert base == ("sdpa" if family_supports_sdpa else "eager")

    counting_attention = COUNTING[base]
    counting_attention.calls.clear()
    model.set_attn_implementation(f"counting_{base}")
    with torch.no_grad():
        logits = model(ids, engine_metadata="from the model call").logits

    attention_modules = [module for module, _ in counting_attention.calls]
    # Each attention layer once, in order (hybrids: not their recurrent layers)
    attention_layers = [layer for layer in model.model.layers if layer.layer_type not in RECURRENT_LAYER_TYPES]
    # each layer's attention under the source's name (`self_attn`; GPT-NeoX: `attention`, GPT-J: `attn`, ...)
    attention_name = family_of(model.config).attention
    assert attention_modules == [getattr(layer, attention_name) for layer in attention_layers if layer.mixers]
    assert all(kwargs["engine_metadata"] == "from the model call" for _, kwargs in counting_attention.calls)
    assert torch.equal(logits, expected), (logits - expected).abs().max().item()


def test_attention_set_on_the_text_config_is_used():
    """vLLM's backend sets its attention on `config.get_text_config()` alone, then builds with `from_config`."""
    config = attnres.AttnResConfig(text_config=tiny_source_model("llama", num_layers=NUM_LAYERS).config.to_dict())
    assert config.get_text_config() is config.text_config
    config.get_text_config()._attn_implementation = "counting_sdpa"
    model = AutoModel.from_config(config).eval()
    assert model.config._attn_implementation == "counting_sdpa"

    COUNTING["sdpa"].calls.clear()
    with torch.no_grad():
        model(random_ids(length=12))
    assert [module for module, _ in COUNTING["sdpa"].calls] == [layer.self_attn for layer in model.layers]
