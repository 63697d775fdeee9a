"""Stock-model parity: what users of any transformers model (and PEFT) rely on works the same on AttnRes."""

from functools import partial

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import attnres_twin, tiny_source_config, tiny_source_model
from tiny import random_ids as tiny_random_ids

import attnres
from attnres.auto import ATTNRES_MODULES

random_ids = partial(tiny_random_ids, length=12)  # this file's sequence length


def test_past_key_values_is_the_deprecated_alias_of_cache():
    model, ids = attnres_twin(tiny_source_model("llama"), seed=1), random_ids()
    with torch.no_grad():
        full = model(ids).logits
        prefix = model(ids[:, :7], use_cache=True)
        with pytest.warns(FutureWarning, match="Use `cache` instead"):
            rest = model(ids[:, 7:], past_key_values=prefix.cache, use_cache=True)
    assert rest.cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(rest.logits, full[:, 7:], rtol=0, atol=1e-5)


def test_config_writes_reach_the_source_config():
    config = attnres.AttnResConfig(text_config=tiny_source_config("llama", num_layers=5))
    config.num_hidden_layers = 2
    config.use_cache = False
    assert config.text_config.num_hidden_layers == 2 and config.num_hidden_layers == 2
    assert config.text_config.use_cache is False
    assert len(attnres.AttnResForCausalLM(config).model.layers) == 2
    config.attnres_mode = "full"  # AttnRes's own settings stay where they are
    assert config.attnres_mode == "full" and not hasattr(config.text_config, "attnres_mode")


def lora_model(target_modules, seed: int = 4):
    model = attnres_twin(tiny_source_model("llama", num_layers=3), seed=seed, attnres_block_size=1)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
    return get_peft_model(model, config)


def test_all_linear_lora_wraps_only_the_projections_and_merges_exactly():
    peft_model, ids = lora_model("all-linear"), random_ids()
    wrapped = {name.rsplit(".", 1)[-1] for name, module in peft_model.named_modules() if hasattr(module, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with torch.no_grad():
        adapted = peft_model(ids).logits
        merged = peft_model.merge_and_unload()(ids).logits
    assert (adapted - merged).abs().max().item() <= 1e-5


def train_and_save_adapter(peft_model, ids: torch.Tensor, folder) -> torch.Tensor:
    """Two AdamW steps on `ids`, the adapter saved into `folder` -> the trained model's logits on `ids`."""
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(2):
        peft_model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    with torch.no_grad():
        trained = peft_model(ids).logits
    peft_model.save_pretrained(folder)
    return trained


def test_lora_defaults_and_attnres_parameters_beside_it(tmp_path):
    # Without target_modules PEFT uses its default for model_type "attnres"; the AttnRes parameters train beside LoRA
    # as modules_to_save and come back with the adapter.
    model = attnres_twin(tiny_source_model("llama", num_layers=3), seed=4, attnres_block_size=1)
    config = LoraConfig(r=4, modules_to_save=["self_attention_res_proj", "mlp_res_proj", "output_attn_res_proj"])
    peft_model = get_peft_model(model, config)
    assert {"q_proj", "v_proj"} <= set(peft_model.peft_config["default"].target_modules)
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert any("mlp_res_proj" in name for name in trainable) and any("lora_A" in name for name in trainable)
    ids = random_ids()
    trained = train_and_save_adapter(peft_model, ids, tmp_path / "adapter")
    fresh = attnres_twin(tiny_source_model("llama", num_layers=3), seed=4, attnres_block_size=1)
    untrained_query = fresh.model.layers[1].mlp_res_proj.weight.detach().clone()
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    trained_query = reloaded.base_model.model.model.layers[1].mlp_res_proj.modules_to_save["default"].weight
    assert (trained_query - untrained_query).abs().max().item() > 1e-3  # the pseudo-query trained, and came back
    with torch.no_grad():
        assert (reloaded(ids).logits - trained).abs().max().item() <= 1e-5


@pytest.mark.parametrize("rule", ["rezero", "layerscale", "highway", "denseformer", "mhc"])
def test_every_rule_trains_beside_lora_and_comes_back_with_the_adapter(rule, tmp_path):
    """As `attnres train --lora` sets it up (every rule's modules in `modules_to_save`): the rule's own parameters
    train beside LoRA, save with the adapter and come back onto a fresh model with the trained logits."""

    def model_of_rule() -> attnres.AttnResForCausalLM:
        text_config = tiny_source_model("llama", num_layers=3).config.to_dict()
        torch.manual_seed(0)
        return attnres.AttnResForCausalLM(attnres.AttnResConfig(text_config=text_config, attnres_mode=rule))

    peft_model = get_peft_model(model_of_rule(), LoraConfig(r=4, modules_to_save=ATTNRES_MODULES))
    trainable = {name for name, p in peft_model.named_parameters() if p.requires_grad}
    assert any("_res_" in name for name in trainable) and any("lora_A" in name for name in trainable)
    ids = random_ids()
    trained = train_and_save_adapter(peft_model, ids, tmp_path / "adapter")
    fresh = model_of_rule()
    initial = {name: p.detach().clone() for name, p in fresh.named_parameters() if "_res_" in name}
    reloaded = PeftModel.from_pretrained(fresh, tmp_path / "adapter")
    came_back = {
        name.replace(".modules_to_save.default", ""): p
        for name, p in reloaded.base_model.model.named_parameters()
        if "_res_" in name and "modules_to_save" in name
    }
    assert came_back.keys() == initial.keys()
    assert max((came_back[name] - initial[name]).abs().max().item() for name in initial) > 1e-3
    with torch.no_grad():
        assert (reloaded(ids).logits - trained).abs().max().item() <= 1e-5
