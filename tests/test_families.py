"""Every supported source family, on a tiny random model whose weights are scaled up and whose norm gains are
perturbed (so that a misplaced norm, multiplier or dropout changes the logits): conversion reproduces the source within
its own float noise, including greedy generation with the cache; the two-phase path equals the naive one; the cache
changes nothing; a saved model reloads as remote code without the package; and a few training steps lower a
held-out loss as much as they lower the source's."""

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from tiny import (
    attnres_twin,
    family_params,
    random_ids,
    stdlib_text_ids,
    tiny_source_config,
    tiny_source_model,
    tiny_tokenizer,
)
from transformers import AutoConfig

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.configuration_attnres import AttnResConfigError
from attnres.conversion import ConversionError, attnres_config_for, convert_to_attnres, verify_conversion
from attnres.families import SUPPORTED_FAMILIES
from attnres.rules import RULES

SCALED_INIT = 0.1  # initializer_range: 5x the configs' 0.02, so that every sublayer moves the stream


def perturbed_source(family: str, num_layers: int = 5, **overrides):
    """The family's tiny source model with larger weights and norm gains away from their init."""
    source = tiny_source_model(family, num_layers=num_layers, initializer_range=SCALED_INIT, **overrides)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in source.named_parameters():
            if "norm" in name and parameter.dim() == 1:
                parameter.copy_(parameter + 0.3 * torch.randn(parameter.shape, generator=generator))
    return source


@pytest.mark.parametrize("family", family_params(SUPPORTED_FAMILIES))
def test_conversion_reproduces_the_source_within_its_noise(family):
    """Logits within 4x the source's own float noise (fp32), the same NLL, and 24 greedy tokens generated with the
    cache identical to the source's own (`verify_conversion`)."""
    source = perturbed_source(family)
    model = convert_to_attnres(copy.deepcopy(source), block_size=2)
    report = verify_conversion(source, model, tiny_tokenizer(), new_tokens=24)
    print(
        f"{family}: max abs logit diff {report.max_abs_logit_diff:.3g}, noise ({report.noise_implementations}) "
        f"{report.noise_max_abs_logit_diff:.3g}, allowed {report.max_abs_logit_diff_allowed:.3g}, "
        f"largest logit {report.max_abs_source_logit:.3g}"
    )
    assert report.passed, report.format()
    assert report.noise_implementations is not None  # calibrated on the source, not a bare float32 step


@pytest.mark.parametrize("family", family_params(SUPPORTED_FAMILIES))
def test_cache_and_two_phase_change_nothing(family):
    """With trained-looking (random) depth parameters: greedy generation with the cache equals generation without it,
    and the two-phase path gives the naive path's logits and gradients up to float32 rounding."""
    model = attnres_twin(perturbed_source(family), seed=2, attnres_block_size=2)
    prompt = random_ids(batch=1, length=7)
    kwargs = dict(max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)

    # Two-phase vs naive (dropout off): in float64 the same function; in float32 about as far from it as the naive
    # computation. The scaled-up weights amplify float32 rounding to 1e-6..1e-3 of the scale, depending on the family,
    # and how much of it each path's rounding meets varies with the CPU's kernels (4.6x the naive's for Mistral on one
    # AVX2 CPU, under 2x on another); a wrong formula errs by far more than 1e-2.
    ids = random_ids(length=12)
    float64_model = copy.deepcopy(model).double()
    exact_logits, exact = logits_and_gradients(float64_model, ids, "naive")
    errors = {"float64": error_against(exact_logits, exact, *logits_and_gradients(float64_model, ids, "two_phase"))}
    for implementation in ("naive", "two_phase"):
        errors[implementation] = error_against(exact_logits, exact, *logits_and_gradients(model, ids, implementation))
    print(
        f"{family}: two-phase vs naive in float64 {errors['float64']:.1e}; float32 error relative to float64, "
        f"naive {errors['naive']:.2e}, two-phase {errors['two_phase']:.2e}"
    )
    assert errors["float64"] <= 1e-10
    assert errors["two_phase"] <= 10 * errors["naive"] + 1e-6


def logits_and_gradients(model, ids, implementation: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.config.attnres_implementation = implementation
    model.zero_grad()
    logits = model(ids).logits
    logits.square().mean().backward()
    grads = {name: p.grad.double() for name, p in model.named_parameters() if p.grad is not None}
    return logits.detach().double(), grads


def relative_error(values: torch.Tensor, exact: torch.Tensor) -> float:
    return (values - exact).abs().max().item() / max(1.0, exact.abs().max().item())


def error_against(exact_logits: torch.Tensor, exact: dict, logits: torch.Tensor, grads: dict) -> float:
    """The largest relative error of the logits and of every parameter's gradient."""
    assert grads.keys() == exact.keys()
    return max(relative_error(logits, exact_logits), *(relative_error(grads[name], exact[name]) for name in exact))


def held_out_loss_after_training(model, train_ids: torch.Tensor, held_out_ids: torch.Tensor) -> tuple[float, float]:
    """(held-out loss before, after) 5 AdamW steps of 4 training sequences each, in eval mode: dropout (Phi-3's
    resid_pdrop) would draw different masks for a source and its conversion."""

    def held_out_loss() -> float:
        with torch.no_grad():
            return model(held_out_ids, labels=held_out_ids).loss.item()

    model.eval()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    before = held_out_loss()
    for batch in train_ids.split(4)[:5]:
        model(batch, labels=batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return before, held_out_loss()


@pytest.mark.parametrize("family", family_params(SUPPORTED_FAMILIES))
def test_training_steps_lower_the_held_out_loss_as_the_source_s(family):
    """Trained on one module's text, the converted model scores better on another module's text, as much as its
    source trained the same way on the same batches (measured: falls of 0.06 nats (Granite, whose logits are scaled
    down 8x) to 1.0 (Gemma3), the two within 0.06 of each other)."""
    train_ids, held_out_ids = stdlib_text_ids("textwrap", 20, 16), stdlib_text_ids("bisect", 8, 16)
    source = perturbed_source(family)
    model = convert_to_attnres(copy.deepcopy(source), block_size=2)
    source_before, source_after = held_out_loss_after_training(source, train_ids, held_out_ids)
    before, after = held_out_loss_after_training(model, train_ids, held_out_ids)
    print(
        f"{family}: held-out loss {before:.3f} -> {after:.3f}; the source's {source_before:.3f} -> {source_after:.3f}"
    )
    assert before == pytest.approx(source_before, abs=1e-4)  # the conversion is exact
    assert before - after > 0.5 * (source_before - source_after) > 0.02
    assert abs(after - source_after) < 0.1


@pytest.mark.parametrize(
    "model_type, settings, reason",
    [
        ("bert", {}, "post-norm architecture"),
        ("opt", dict(do_layer_norm_before=False), "post-norm architecture"),
        ("falcon", dict(alibi=True), "Falcon with ALiBi"),
        ("t5", {}, "encoder"),
        ("gpt2", {}, "unsupported family 'gpt2': no row"),
    ],
)
def test_other_architectures_are_refused_by_name_with_the_reason(model_type, settings, reason):
    """From the config alone, before any weights load: what the architecture has, why, and what is supported."""
    with pytest.raises(ConversionError) as error:
        attnres_config_for(AutoConfig.for_model(model_type, **settings))
    message = str(error.value)
    assert f"'{model_type}'" in message and reason in message, message
    assert f"Supported families: {', '.join(SUPPORTED_FAMILIES)}." in message


@pytest.mark.parametrize(
    "family, settings, sublayers",
    [
        ("llama", {}, 2),
        ("gpt_neox", dict(use_parallel_residual=True), 1),
        ("gpt_neox", dict(use_parallel_residual=False), 2),
        ("phi", {}, 1),
        ("falcon", dict(new_decoder_architecture=True, parallel_attn=True), 1),
        ("falcon", dict(new_decoder_architecture=False, parallel_attn=True), 1),
        ("falcon", dict(new_decoder_architecture=False, parallel_attn=False), 2),
    ],
)
def test_each_layer_has_the_residual_branches_of_its_source(family, settings, sublayers):
    """One depth mix per residual branch: two where attention and MLP run one after the other, one where they run in
    parallel on the same input; the block size counts decoder layers, so a block holds that many branches each."""
    config = attnres_config_for(tiny_source_config(family, num_layers=4, **settings), block_size=2)
    assert config.sublayers_per_layer() == sublayers and config.num_sublayers() == 4 * sublayers
    starts = [index for index in range(config.num_sublayers()) if config.sublayer_starts_block(index)]
    assert starts == [0, 2 * sublayers]


@pytest.mark.parametrize(
    "family, settings, sublayers",
    [
        ("gpt_neox", dict(use_parallel_residual=False), 2),
        # Falcon-7B's decoder: one norm for both, one key-value head; Falcon-RW's layout without ALiBi: sequential
        pytest.param("falcon", dict(new_decoder_architecture=False, multi_query=True), 1, marks=pytest.mark.slow),
        pytest.param("falcon", dict(new_decoder_architecture=False, parallel_attn=False), 2, marks=pytest.mark.slow),
        # OLMo-Hybrid's released checkpoints: no theta, so no RoPE on its attention layers (the tiny model has RoPE)
        pytest.param(
            "olmo_hybrid", dict(rope_parameters=dict(rope_type="default", rope_theta=None)), 2, marks=pytest.mark.slow
        ),
    ],
)
def test_the_other_layouts_of_a_family_convert_exactly(family, settings, sublayers):
    """GPT-NeoX with `use_parallel_residual=False` adds attention's output before its MLP reads the stream: the
    two-sublayer layout, exact as the parallel one (test_conversion_reproduces_the_source_within_its_noise). Falcon's
    old decoder (its tiny model has the new one) runs its attention and MLP in parallel on one norm, or in sequence.
    OLMo-Hybrid without a RoPE theta runs its attention without position embeddings, as its source does."""
    source = perturbed_source(family, **settings)
    model = convert_to_attnres(copy.deepcopy(source), block_size=2)
    assert model.config.sublayers_per_layer() == sublayers
    assert (model.model.rotary_emb is None) == (source.get_decoder().rotary_emb is None)
    report = verify_conversion(source, model, tiny_tokenizer(), new_tokens=24)
    assert report.passed, report.format()


ROUND_TRIP = """
import json, sys, torch
sys.modules["attnres"] = None  # the package must not be needed
from transformers import AutoModelForCausalLM
folders, ids = json.loads(sys.argv[1]), torch.load(sys.argv[2])
diffs = {}
for family, folder in folders.items():
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
    with torch.no_grad():
        diffs[family] = (model(ids).logits - torch.load(folder + "/expected.pt")).abs().max().item()
print(json.dumps(diffs))
"""


def test_save_and_reload_as_remote_code(tmp_path):
    """Every family with trained (random) depth parameters, saved and loaded in a Python without the package."""
    ids, folders = random_ids(length=12), {}
    torch.save(ids, tmp_path / "ids.pt")
    for family in SUPPORTED_FAMILIES:
        model = attnres_twin(perturbed_source(family, num_layers=3), seed=3, attnres_block_size=2)
        folder = tmp_path / family
        model.save_pretrained(folder)
        with torch.no_grad():
            torch.save(model(ids).logits, folder / "expected.pt")
        folders[family] = str(folder)
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-c", textwrap.dedent(ROUND_TRIP), json.dumps(folders), str(tmp_path / "ids.pt")]
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert child.returncode == 0, child.stderr[-3000:]
    diffs = json.loads(child.stdout.strip().splitlines()[-1])
    assert diffs.keys() == folders.keys() and max(diffs.values()) == 0.0, diffs


@pytest.mark.slow  # about 20 s a family: every rule that converts
@pytest.mark.parametrize("family", ["gpt_neox", "phi"])  # a norm each for attention and MLP; one norm for both
def test_every_rule_that_converts_is_exact_on_one_branch_layers_and_caches_alike(family):
    """The residual rules run on one-branch layers as on two sublayers: each converts to what the source computes (mHC
    up to the rounding of its equal stream weights), and with its parameters moved off their init generates the same
    tokens with and without the cache."""
    source, ids = tiny_source_model(family, num_layers=3), random_ids()
    greedy = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        expected = source(ids).logits
    for rule in (name for name, spec in RULES.items() if spec.converts is None):
        model = convert_to_attnres(source, mode=rule, block_size=1)
        assert model.config.sublayers_per_layer() == 1
        with torch.no_grad():
            tolerance = 1e-6 if rule in ("mhc", "mhc_lite") else 0
            assert (model(ids).logits - expected).abs().max().item() <= tolerance, rule
            for name, parameter in model.named_parameters():
                if "branch_res_" in name or "output_attn_res_" in name:
                    parameter.add_(0.3 * torch.randn(parameter.shape, generator=torch.Generator().manual_seed(0)))
        prompt = ids[:1, :5]
        assert torch.equal(model.generate(prompt, **greedy), model.generate(prompt, use_cache=False, **greedy)), rule


def test_postnorm_needs_one_input_norm_per_branch():
    """PostNorm normalises the stream with the branch's input norm: Phi's, which attention and MLP share; GPT-NeoX's
    branch has one each, so no one norm stands for it, and the model says so."""
    AttnResForCausalLM(AttnResConfig(text_config=tiny_source_config("phi", num_layers=2), attnres_mode="postnorm"))
    config = AttnResConfig(text_config=tiny_source_config("gpt_neox", num_layers=2), attnres_mode="postnorm")
    with pytest.raises(AttnResConfigError, match="gpt_neox's one-branch layers have two .*: use another rule"):
        AttnResForCausalLM(config)


@pytest.mark.parametrize("family", ["granite", "falcon_h1"])
def test_given_embeddings_are_multiplied_as_the_source_does(family):
    """Granite multiplies `inputs_embeds` given to the model by its embedding multiplier, Falcon-H1 only the embedding
    it looks up from ids: the converted model does what its source does with either input."""
    source, ids = perturbed_source(family, num_layers=2), random_ids(length=10)
    model = convert_to_attnres(copy.deepcopy(source), block_size=1)
    embeddings = source.get_input_embeddings()(ids)
    with torch.no_grad():
        for inputs in (dict(input_ids=ids), dict(inputs_embeds=embeddings)):
            assert (model(**inputs).logits - source(**inputs).logits).abs().max().item() <= 1e-5, inputs.keys()
