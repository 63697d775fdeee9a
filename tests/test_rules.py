"""The depth-mixing rules side by side (PreNorm, PostNorm, ReZero, LayerScale, Highway, DenseFormer, mHC, Block and
Full AttnRes): each converts exactly where it can start as the source, is refused in one line where it cannot, trains
from scratch, reloads, and generates with and without the cache, in the package and as remote code."""

import json
import math
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from tiny import (
    family_params,
    random_ids,
    run_cli,
    stdlib_text_ids,
    tiny_source_config,
    tiny_source_model,
    tiny_tokenizer,
)

import attnres
from attnres.cards import describe_layout
from attnres.configuration_attnres import RESIDUAL_RULES, AttnResConfigError
from attnres.conversion import ConversionError, convert_to_attnres
from attnres.depth_mixing import write_coefficients
from attnres.folders import read_metrics

EXACT_RULES = [name for name, rule in RESIDUAL_RULES.items() if rule.converts is None]
FAMILIES = ["llama", "gemma3_text", "qwen3_moe"]  # plain, (1 + w) norms with output norms and sliding layers, MoE
TRAINING_FAMILIES = ["llama", "gemma3_text", "qwen2"]  # qwen2 (biased projections) for MoE: its steps take 5x longer


def scratch_model(family: str, rule: str, seed: int = 0, **settings) -> attnres.AttnResForCausalLM:
    text_config = tiny_source_config(family, num_layers=4).to_dict()
    config = attnres.AttnResConfig(text_config=text_config, attnres_mode=rule, **settings)
    torch.manual_seed(seed)
    return attnres.AttnResForCausalLM(config)


def test_the_rules_the_paper_compares_are_all_offered():
    assert set(RESIDUAL_RULES) == {
        "prenorm", "postnorm", "rezero", "layerscale", "highway", "denseformer", "mhc", "block", "full"
    }  # fmt: skip
    assert [name for name, rule in RESIDUAL_RULES.items() if rule.converts is not None] == ["postnorm", "highway"]


@pytest.mark.parametrize("family", family_params(FAMILIES))
@pytest.mark.parametrize("rule", EXACT_RULES)
def test_exact_rules_convert_to_what_the_source_computes(rule, family):
    source = tiny_source_model(family)
    ids = random_ids()
    with torch.no_grad():
        expected = source(ids).logits
        converted = convert_to_attnres(source, mode=rule)
        logits = converted(ids).logits
    assert converted.config.attnres_mode == rule
    # The recurrences and DenseFormer add the same tensors in the same order: bit for bit, but for the MoE family,
    # whose experts run in the order of the routing (1.2e-7 measured). mHC reads and mixes m equal copies of the stream
    # with weights that sum to 1, up to their float rounding (4.8e-7 measured)
    tolerance = 1e-5 if rule in ("block", "full", "mhc") else 1e-6 if family == "qwen3_moe" else 0
    assert (logits - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("rule", ["postnorm", "highway"])
def test_rules_that_cannot_start_exact_are_refused_for_conversion(rule):
    with pytest.raises(ConversionError, match=rf"--mode {rule} cannot start as the source computes: .*--from-scratch"):
        convert_to_attnres(tiny_source_model("llama"), mode=rule)


@pytest.fixture(scope="module")
def text_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out sequences of two different standard-library modules, as the tiny tokenizer reads them."""
    return stdlib_text_ids("textwrap", 64, 48), stdlib_text_ids("bisect", 8, 48)


@pytest.mark.parametrize("family", family_params(TRAINING_FAMILIES, fast=["llama"]))
@pytest.mark.parametrize("rule", list(RESIDUAL_RULES))
def test_every_rule_trains_from_scratch(rule, family, text_batches):
    """30 AdamW steps on one module's text lower the loss on another module's text by at least 1 nat (of ~4.6)."""
    train_ids, held_out_ids = text_batches
    model = scratch_model(family, rule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def held_out_loss() -> float:
        with torch.no_grad():
            return model(held_out_ids, labels=held_out_ids).loss.item()

    before = held_out_loss()
    for step in range(30):
        batch = train_ids[(step * 8) % 64 :][:8]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    after = held_out_loss()
    print(f"{rule} {family}: held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 1.0


def randomize_rule_parameters(model: attnres.AttnResForCausalLM, seed: int = 0) -> None:
    """Every parameter the rule adds away from its init, so that reloading and caching are tested off the identity."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_res_" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))


REMOTE_CODE_SCRIPT = """
import sys, torch
sys.modules["attnres"] = None  # the package must not be needed
from transformers import AutoModelForCausalLM
ids = torch.load(sys.argv[1])
for folder in sys.argv[2:]:
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    torch.save(model.generate(ids, max_new_tokens=8, do_sample=False), folder + "/remote.pt")
"""


@pytest.mark.slow  # every rule on three families, saved, reloaded and run again in a process of its own
def test_every_rule_reloads_and_generates_with_and_without_the_cache_and_as_remote_code(tmp_path):
    ids = random_ids(batch=1, length=6)
    expected = {}
    for family in FAMILIES:
        for rule in RESIDUAL_RULES:
            model = scratch_model(family, rule).eval()
            randomize_rule_parameters(model)
            folder = tmp_path / f"{family}-{rule}"
            model.save_pretrained(folder)
            reloaded = attnres.AttnResForCausalLM.from_pretrained(folder).eval()
            with torch.no_grad():
                # equal up to the float rounding of products over weights that sit elsewhere in memory (1.2e-7)
                torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
                cached = model.generate(ids, max_new_tokens=8, do_sample=False)
                uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
            assert torch.equal(cached, uncached), (family, rule)
            expected[folder] = cached
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    folders = [str(folder) for folder in expected if folder.name.startswith("llama-")]
    command = [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "ids.pt"), *folders]
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=300)
    for folder in folders:
        assert torch.equal(torch.load(Path(folder) / "remote.pt"), expected[Path(folder)]), folder


def test_rezero_and_layerscale_start_as_published_and_conversion_starts_them_at_one():
    rezero, layerscale = scratch_model("llama", "rezero"), scratch_model("llama", "layerscale")
    assert rezero.model.layers[0].self_attention_res_scale.weight.tolist() == [0.0]
    assert torch.all(layerscale.model.layers[0].mlp_res_scale.weight == 0.1)  # CaiT's value up to 18 layers
    converted = convert_to_attnres(tiny_source_model("llama"), mode="layerscale")
    assert torch.all(converted.model.layers[0].mlp_res_scale.weight == 1)


def test_mhc_streams_part_and_stay_mixed_by_doubly_stochastic_matrices_as_it_trains(text_batches):
    """mHC (3 streams here, 4 by default) starts with equal copies of the embedding, mixed by the uniform matrix 1/3.
    After 8 AdamW steps the copies have parted, and every layer's attention mixes them by a matrix whose rows and
    columns still sum to 1 within 1e-4 at every token, and which has left 1/3 after the first layer (whose streams are
    the copies of the embedding: every doubly stochastic matrix leaves them as they are, so none is learnt there)."""
    train_ids, held_out_ids = text_batches
    model = scratch_model("llama", "mhc", attnres_num_streams=3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(8):
        batch = train_ids[step * 8 :][:8]
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    streams_read = []  # the streams each decoder layer's attention reads
    hooks = [
        layer.register_forward_pre_hook(lambda _, args: streams_read.append(args[0])) for layer in model.model.layers
    ]
    with torch.no_grad():
        model(held_out_ids)
    for hook in hooks:
        hook.remove()
    for layer, streams in zip(model.model.layers, streams_read, strict=True):
        connection = layer.self_attention_res_connection
        with torch.no_grad():
            _, mix = write_coefficients(streams, *connection(), connection.eps)  # [B,T,3,3]
        assert mix.shape == (*held_out_ids.shape, 3, 3) and mix.min() >= 0
        torch.testing.assert_close(mix.sum(-1), torch.ones(mix.shape[:-1]), rtol=0, atol=1e-4)
        torch.testing.assert_close(mix.sum(-2), torch.ones(mix.shape[:-1]), rtol=0, atol=1e-4)
        # float noise is 1e-7; after the first layer these matrices have moved by 2.8e-3 to 1e-2 (measured)
        assert layer.layer_idx == 0 or (mix - 1 / 3).abs().max() > 5e-4
    last = streams_read[-1]  # its streams differ by 1.5e-3 of their largest value (measured), equal copies by none
    assert (last - last.mean(-2, keepdim=True)).abs().max() > 1e-4 * last.abs().max()


def test_mhc_needs_two_streams_and_a_config_edited_away_from_its_streams_is_refused(tmp_path):
    text_config = tiny_source_config("llama", num_layers=2).to_dict()
    with pytest.raises(AttnResConfigError, match=r"attnres_num_streams: got 1, .*attnres_mode='prenorm'"):
        attnres.AttnResConfig(text_config=text_config, attnres_mode="mhc", attnres_num_streams=1)
    attnres.AttnResForCausalLM(attnres.AttnResConfig(text_config=text_config, attnres_mode="mhc")).save_pretrained(
        tmp_path
    )
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attnres_saved_layout"] == {"attnres_mode": "mhc", "attnres_num_streams": 4}
    (tmp_path / "config.json").write_text(json.dumps(saved | {"attnres_num_streams": 2}))
    with pytest.raises(AttnResConfigError, match="says attnres_num_streams=2, but the weights saved with it were made"):
        attnres.AttnResForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("start", [[], ["--from-scratch"]], ids=["converted", "from-scratch"])
def test_the_command_line_trains_mhc(start, tmp_path):
    """`attnres train --convert --mode mhc`, from the source's weights or from scratch, trains and saves mHC."""
    source = tmp_path / "source"
    tiny_source_model("llama", num_layers=2).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    dataset = tmp_path / "text.jsonl"  # one document per paragraph, some of them held out
    dataset.write_text("".join(json.dumps({"text": part}) + "\n" for part in text.split("\n\n") if part.strip()))
    output = tmp_path / "run"
    command = ["train", "--output-dir", output, "--model", source, "--dataset", dataset, "--convert", "--mode", "mhc"]
    run = ["--seq-len", 32, "--batch-size", 4, "--max-steps", 2, "--eval-size", 0.1, "--log-every", 1]
    code, _, stderr = run_cli(*command, *start, *run)
    assert code == 0, stderr
    assert json.loads((output / "config.json").read_text())["attnres_saved_layout"]["attnres_mode"] == "mhc"
    losses = [record["loss"] for record in read_metrics(output) if "loss" in record]
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)


@pytest.mark.parametrize("rule", [rule for rule in RESIDUAL_RULES if rule not in ("block", "full")])
def test_the_model_card_names_the_rule_not_block_attnres(rule):
    config = attnres.AttnResConfig(text_config=tiny_source_config("llama", num_layers=4).to_dict(), attnres_mode=rule)
    layout = describe_layout(config)
    assert layout.startswith(RESIDUAL_RULES[rule].label) and "Block AttnRes" not in layout, layout
