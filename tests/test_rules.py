"""The depth-mixing rules side by side (PreNorm, PostNorm, ReZero, LayerScale, Highway, DenseFormer, mHC, mHC-lite,
Block and Full AttnRes): each converts exactly where it can start as the source, is refused in one line where it
cannot, trains from scratch, reloads, and generates with and without the cache, in the package and as remote code."""

import copy
import itertools
import json
import math
import os
import subprocess
import sys
import sysconfig
from functools import partial
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
from attnres.analysis import depth_weight_entropy
from attnres.cards import describe_layout
from attnres.configuration_attnres import AttnResConfigError
from attnres.conversion import ConversionError, convert_to_attnres
from attnres.depth_mixing import DepthAttention, DepthParameters, DepthState, sublayer_query
from attnres.depth_rules import (
    DEPTH_RULES,
    HighwayGate,
    HighwayRule,
    HyperConnection,
    PermutationConnection,
    ResidualScale,
    sinkhorn_knopp,
    write_coefficients,
    write_streams,
)
from attnres.folders import read_metrics
from attnres.modeling_attnres import depth_mix_policy
from attnres.rules import MOVED_NAMES, NAMING, NAMING_KEY, RULES

EXACT_RULES = [name for name, rule in RULES.items() if rule.converts is None]
FAMILIES = ["llama", "gemma3_text", "qwen3_moe"]  # plain, (1 + w) norms with output norms and sliding layers, MoE
TRAINING_FAMILIES = ["llama", "gemma3_text", "qwen2"]  # qwen2 (biased projections) for MoE: its steps take 5x longer


def scratch_model(family: str, rule: str, seed: int = 0, num_layers: int = 4, **settings) -> attnres.AttnResForCausalLM:
    text_config = tiny_source_config(family, num_layers=num_layers).to_dict()
    config = attnres.AttnResConfig(text_config=text_config, attnres_mode=rule, **settings)
    torch.manual_seed(seed)
    return attnres.AttnResForCausalLM(config)


def test_the_rules_the_paper_compares_are_all_offered():
    assert set(RULES) == {
        "prenorm", "postnorm", "rezero", "rezero_prenorm", "layerscale", "highway", "denseformer",
        "denseformer_sublayers", "mhc", "mhc_lite", "block", "full",
    }  # fmt: skip
    assert [name for name, rule in RULES.items() if rule.converts is not None] == ["postnorm", "rezero", "highway"]


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
    # with weights that sum to 1, up to their float rounding (5.1e-7 measured)
    tolerance = 1e-5 if rule in ("block", "full", "mhc", "mhc_lite") else 1e-6 if family == "qwen3_moe" else 0
    assert (logits - expected).abs().max().item() <= tolerance


@pytest.mark.parametrize("rule", ["postnorm", "rezero", "highway"])
def test_rules_that_cannot_start_exact_are_refused_for_conversion(rule):
    with pytest.raises(ConversionError, match=rf"--mode {rule} cannot start as the source computes: .*--from-scratch"):
        convert_to_attnres(tiny_source_model("llama"), mode=rule)


# --------------------------------------------------------------------------------------------------------------------
# Highway's gate, per channel (Highway Networks) or per token
# --------------------------------------------------------------------------------------------------------------------


def highway_write(gate: HighwayGate, stream: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """The stream after Highway's write of `output`, as the decoder layers run it."""
    rule = HighwayRule(per_channel=gate.per_channel)
    depth = DepthState((), stream.new_zeros(*stream.shape[:-1], 0), stream)
    return rule.write(depth, output, (gate,), norm=None).partial_sum


def random_highway_gate(per_channel: bool, hidden_size: int = 64, eps: float = 1e-6) -> HighwayGate:
    gate = HighwayGate(hidden_size, eps, per_channel)
    with torch.no_grad():
        gate.weight.copy_(0.2 * torch.randn(gate.weight.shape))
        gate.bias.copy_(torch.randn(gate.bias.shape) - 1)
    return gate


def test_highway_writes_the_paper_s_per_channel_gate():
    """Highway Networks (Srivastava et al. 2015, Eq. 3 with C = 1 - T): y = H(x) * T(x) + x * (1 - T(x)), the transform
    gate T(x) = sigmoid(W_T x + b_T) per channel. Ours: x is the stream h, RMS-normalised inside the gate only, and H(x)
    the sublayer's output f."""
    torch.manual_seed(0)
    gate = random_highway_gate(per_channel=True)
    h, f = 3 * torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    W, b, eps = gate.weight.detach(), gate.bias.detach(), gate.eps
    rmsnorm_h = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    T = torch.sigmoid(rmsnorm_h @ W.T + b)  # [B,T,d]: a gate per channel
    y = f * T + h * (1 - T)
    written = highway_write(gate, h, f)
    print(f"per-channel Highway against the paper's equation: max difference {(written - y).abs().max():.3g}")
    assert (written - y).abs().max() <= 1e-6
    assert T.std(-1).min() > 0.05  # the channels' gates differ: a scalar gate could not give y


def test_the_token_gate_is_the_scalar_gate_highway_had():
    """`attnres_highway_gate="token"`: g = sigmoid(w . h/rms(h) + b), one scalar per token."""
    torch.manual_seed(0)
    gate = random_highway_gate(per_channel=False)
    h, f = 3 * torch.randn(2, 5, 64), torch.randn(2, 5, 64)
    w, b, eps = gate.weight.detach(), gate.bias.detach(), gate.eps
    g = torch.sigmoid((h * w).sum(-1, keepdim=True) / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + eps) + b)
    assert gate.weight.shape == (64,) and gate.bias.shape == (1,)
    assert (highway_write(gate, h, f) - ((1 - g) * h + g * f)).abs().max() <= 1e-6


@pytest.mark.parametrize("gate, shapes", [("channel", [(64, 64), (64,)]), ("token", [(64,), (1,)])])
def test_highway_starts_every_gate_at_sigmoid_minus_one_and_saves_its_kind(gate, shapes, tmp_path):
    """W = 0 and b = -1: every channel of every token opens sigmoid(-1) = 0.27 at init. The saved layout holds the
    gate's kind, so that a config.json edited to the other kind is refused."""
    model = scratch_model("llama", "highway", attnres_highway_gate=gate)
    head = model.model.layers[0].self_attention_res_gate
    assert [tuple(parameter.shape) for parameter in (head.weight, head.bias)] == shapes
    assert torch.equal(head.weight, torch.zeros(shapes[0])) and torch.equal(head.bias, torch.full(shapes[1], -1.0))
    stream = torch.randn(2, 3, 64)
    torch.testing.assert_close(head(stream), torch.full_like(stream[..., : shapes[1][0]], 0.2689414), rtol=0, atol=1e-7)
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attnres_saved_layout"] == {"attnres_mode": "highway", "attnres_highway_gate": gate}
    other = "token" if gate == "channel" else "channel"
    (tmp_path / "config.json").write_text(json.dumps(saved | {"attnres_highway_gate": other}))
    with pytest.raises(AttnResConfigError, match=f"says attnres_highway_gate='{other}', but the weights saved with"):
        attnres.AttnResForCausalLM.from_pretrained(tmp_path)


def test_a_highway_model_saved_before_the_gate_option_is_known_as_the_token_gate(tmp_path):
    """Its config.json has neither the option nor the option in its saved layout: refused naming the token gate it
    was made with, and it loads to the same logits once config.json says so."""
    model = scratch_model("llama", "highway", attnres_highway_gate="token").eval()
    randomize_rule_parameters(model)
    model.save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["attnres_highway_gate"], config["attnres_saved_layout"]["attnres_highway_gate"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttnResConfigError, match="says attnres_highway_gate='channel', but .* made with .*='token'"):
        attnres.AttnResForCausalLM.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"attnres_highway_gate": "token"}))
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(attnres.AttnResForCausalLM.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


# --------------------------------------------------------------------------------------------------------------------
# DenseFormer as published: a depth-weighted average after each decoder layer
# --------------------------------------------------------------------------------------------------------------------


def papers_denseformer_logits(source, weights: list[torch.Tensor | None], dilation: int, ids) -> torch.Tensor:
    """The paper's DenseFormer (Pagliardini et al. 2024, Eq. 1), line by line around the source model's own blocks:
    X_0 the embedding, X_i = B_i(Y_{i-1}), and after block i, where it has weights (its period), Y_i = sum_j
    alpha_ij X_j over X_0 .. X_i, every `dilation`-th back from X_i (elsewhere Y_i = X_i); the final norm reads
    Y_L. Forward hooks put the average after each of the source's decoder layers."""
    outputs = []
    layers = source.model.layers
    hooks = [layers[0].register_forward_pre_hook(lambda module, args: outputs.append(args[0]))]

    def average(module, args, output, block: int):
        outputs.append(output)
        if weights[block] is None:
            return output
        kept = outputs[(block + 1) % dilation :: dilation]
        return sum(alpha * x for alpha, x in zip(weights[block], kept, strict=True))

    hooks += [layer.register_forward_hook(partial(average, block=i)) for i, layer in enumerate(layers)]
    try:
        with torch.no_grad():
            return source(ids).logits
    finally:
        for hook in hooks:
            hook.remove()


@pytest.mark.parametrize("dilation, period", [(1, 1), (2, 3)])
def test_denseformer_averages_the_block_outputs_as_the_paper_and_converts_exactly(dilation, period):
    """Converted, it computes its source bit for bit (X_i's weight 1, the others 0). With random weights it computes
    the paper's equation around the source's blocks (2.4e-7 and 1.2e-7 measured; the authors' DWAModules, run the
    same way, gave 2.4e-7 and 1.2e-7 on six layers: not a dependency, as it is not on PyPI)."""
    source = tiny_source_model("llama", num_layers=6)
    ids = random_ids()
    options = {"attnres_dwa_dilation": dilation, "attnres_dwa_period": period}
    with torch.no_grad():
        expected = source(ids).logits
        model = convert_to_attnres(source, mode="denseformer", options=options).eval()
        assert torch.equal(model(ids).logits, expected)
        randomize_rule_parameters(model)
        logits = model(ids).logits
    weights = [layer.mlp_res_average.weight for layer in model.model.layers]
    assert [w is not None for w in weights] == [(i + 1) % period == 0 for i in range(6)]
    assert [len(w) for w in weights if w is not None] == [
        (i + 1) // dilation + 1 for i in range(6) if (i + 1) % period == 0
    ]
    difference = (logits - papers_denseformer_logits(source, weights, dilation, ids)).abs().max().item()
    print(f"DenseFormer (dilation {dilation}, period {period}) against the paper's equation: {difference:.2g}")
    assert difference <= 1e-6 and (logits - expected).abs().max() > 0.1


@pytest.mark.parametrize("option", ["attnres_dwa_dilation", "attnres_dwa_period"])
def test_a_denseformer_option_past_the_depth_is_refused(option):
    with pytest.raises(AttnResConfigError, match=rf"{option}: got 5, over num_hidden_layers=4: .*at most"):
        scratch_model("llama", "denseformer", **{option: 5})


# Each name that moved to a published form (rules.py's MOVED_NAMES): the settings of the form it named before, and
# those of the form it names now
MOVED = {
    "rezero": ({"attnres_mode": "rezero_prenorm"}, {"attnres_mode": "rezero"}),
    "denseformer": ({"attnres_mode": "denseformer_sublayers"}, {"attnres_mode": "denseformer"}),
    "projected": (
        {"attnres_mode": "full", "attnres_query": "projected_latest"},
        {"attnres_mode": "full", "attnres_query": "projected"},
    ),
}


def form_model(settings: dict) -> attnres.AttnResForCausalLM:
    options = {key: value for key, value in settings.items() if key != "attnres_mode"}
    return scratch_model("llama", settings["attnres_mode"], **options).eval()


def test_every_moved_name_is_tested():
    assert set(MOVED) == {name for moved in MOVED_NAMES.values() for name in moved}


@pytest.mark.parametrize("name", list(MOVED))
def test_a_model_saved_before_its_name_moved_loads_and_computes_what_it_computed(name, tmp_path):
    """Saved before `NAMING`, its config.json and layout named its form by the moved name, without `NAMING_KEY`: it
    loads as the form it computed, under today's name, to the same logits, and saves under that name. Saved now, the
    same name carries the naming and loads as the published form."""
    before, now = MOVED[name]
    key = next(key for key, moved in MOVED_NAMES.items() if name in moved)
    model = form_model(before)
    randomize_rule_parameters(model)
    model.save_pretrained(tmp_path / "before")
    config = json.loads((tmp_path / "before" / "config.json").read_text())
    layout = config["attnres_saved_layout"]
    assert NAMING_KEY not in layout  # today's name of the older form moved nowhere
    config |= {key: name, "attnres_saved_layout": layout | {key: name}}  # as it was saved then
    (tmp_path / "before" / "config.json").write_text(json.dumps(config))
    reloaded = attnres.AttnResForCausalLM.from_pretrained(tmp_path / "before").eval()
    assert getattr(reloaded.config, key) == before[key]
    ids = random_ids()
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)
    reloaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["attnres_saved_layout"] == layout

    published = form_model(now)
    published.save_pretrained(tmp_path / "now")
    saved = json.loads((tmp_path / "now" / "config.json").read_text())["attnres_saved_layout"]
    assert saved[key] == name and saved[NAMING_KEY] == NAMING
    assert getattr(attnres.AttnResForCausalLM.from_pretrained(tmp_path / "now").config, key) == name


def test_a_layout_saved_before_a_name_moved_still_refuses_an_edited_config(tmp_path):
    """An old ReZero model whose config.json was edited to another rule: refused, naming the form it was made with."""
    scratch_model("llama", "rezero_prenorm").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"attnres_mode": "prenorm", "attnres_saved_layout": {"attnres_mode": "rezero"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(AttnResConfigError, match="says attnres_mode='prenorm', .* made with attnres_mode='rezero_pre"):
        attnres.AttnResForCausalLM.from_pretrained(tmp_path)


@pytest.mark.parametrize("family", ["olmo2", "olmo3", "exaone4"])
def test_postnorm_is_refused_on_families_without_input_norms(family):
    """Their sublayers read the stream without an input norm, the norm PostNorm normalises the stream with: it would
    silently compute PreNorm."""
    text_config = tiny_source_config(family, num_layers=2).to_dict()
    with pytest.raises(AttnResConfigError, match=rf"'postnorm' .* and {family} has none .*: use another rule"):
        attnres.AttnResConfig(text_config=text_config, attnres_mode="postnorm")
    attnres.AttnResConfig(text_config=text_config, attnres_mode="prenorm")  # the other rules stay open


@pytest.fixture(scope="module")
def text_batches() -> tuple[torch.Tensor, torch.Tensor]:
    """Training and held-out sequences of two different standard-library modules, as the tiny tokenizer reads them."""
    return stdlib_text_ids("textwrap", 64, 48), stdlib_text_ids("bisect", 8, 48)


@pytest.mark.parametrize("family", family_params(TRAINING_FAMILIES, fast=["llama"]))
@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_trains_from_scratch(rule, family, text_batches):
    """30 AdamW steps on one module's text lower the loss on another module's text by at least 1 nat (of ~4.6)."""
    before, after = held_out_losses_around_training(scratch_model(family, rule), text_batches)
    print(f"{rule} {family}: held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 1.0


def held_out_losses_around_training(model, text_batches) -> tuple[float, float]:
    """The held-out loss before and after 30 AdamW steps on the training text."""
    train_ids, held_out_ids = text_batches
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
    return before, held_out_loss()


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


@pytest.mark.parametrize("rule", list(RULES))
def test_every_rule_takes_a_bf16_autocast_training_step_close_to_fp32(rule):
    """What GPU users train with: under bf16 autocast each rule's loss and gradients stay within bf16's noise of fp32's
    (Highway's gate once refused the bf16 sublayer output beside the fp32 stream)."""
    model = scratch_model("llama", rule).train()
    randomize_rule_parameters(model)
    ids = random_ids()

    def loss_and_gradient(autocast: bool) -> tuple[float, torch.Tensor]:
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.item(), torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    loss, gradient = loss_and_gradient(autocast=False)
    autocast_loss, autocast_gradient = loss_and_gradient(autocast=True)
    error = ((autocast_gradient - gradient).norm() / gradient.norm()).item()
    print(f"{rule}: loss {loss:.4f} fp32, {autocast_loss:.4f} autocast; gradient error {error:.4f}")
    assert abs(autocast_loss - loss) < 0.01 * loss and error < 0.05


@pytest.mark.slow  # every rule on three families, saved, reloaded and run again in a process of its own
def test_every_rule_reloads_and_generates_with_and_without_the_cache_and_as_remote_code(tmp_path):
    ids = random_ids(batch=1, length=6)
    expected = {}
    for family in FAMILIES:
        for rule in RULES:
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
    for rezero in (scratch_model("llama", "rezero"), scratch_model("llama", "rezero_prenorm")):
        assert rezero.model.layers[0].self_attention_res_scale.weight.tolist() == [0.0]
    layerscale = scratch_model("llama", "layerscale")
    assert torch.all(layerscale.model.layers[0].mlp_res_scale.weight == 0.1)  # CaiT's value up to 18 layers
    for rule in ("layerscale", "rezero_prenorm"):
        converted = convert_to_attnres(tiny_source_model("llama"), mode=rule)
        assert torch.all(converted.model.layers[0].mlp_res_scale.weight == 1)


# --------------------------------------------------------------------------------------------------------------------
# ReZero as published (no norms) and on PreNorm
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_rezero_starts_as_the_identity_with_no_norm_on_the_stream(family):
    """Every scale 0 and no norm anywhere on the stream: the model's output is the token embedding itself, bit for
    bit (Gemma3's sublayers keep their own output norms, which the zero scales silence). ReZero on PreNorm ends in the
    final norm of the embedding."""
    ids = random_ids()
    with torch.no_grad():
        rezero = scratch_model(family, "rezero").model
        assert torch.equal(rezero(ids).last_hidden_state, rezero.embed_tokens(ids))
        prenorm = scratch_model(family, "rezero_prenorm").model
        assert torch.equal(prenorm(ids).last_hidden_state, prenorm.norm(prenorm.embed_tokens(ids)))


def test_rezero_freezes_the_norms_it_never_reads_and_trains_every_other_parameter():
    """The family's input norms and final norm stay in a ReZero model (its checkpoint keeps the family's layout) but
    are never read: frozen, so that data-parallel training waits for no gradient of theirs, while every parameter it
    trains gets one."""
    model = scratch_model("llama", "rezero")
    ids = random_ids()
    model(ids, labels=ids).loss.backward()
    frozen = {name for name, parameter in model.named_parameters() if not parameter.requires_grad}
    norms = ("input_layernorm", "post_attention_layernorm")
    assert frozen == {"model.norm.weight"} | {f"model.layers.{i}.{norm}.weight" for i in range(4) for norm in norms}
    assert all(parameter.grad is not None for parameter in model.parameters() if parameter.requires_grad)
    assert all(parameter.requires_grad for parameter in scratch_model("llama", "rezero_prenorm").parameters())


def scaled_layer(rule_name: str, attention, mlp, scales: tuple[torch.Tensor, ...], x: torch.Tensor, norm):
    """One decoder layer of sublayers `attention` and `mlp` [B,T,d] -> [B,T,d], its stream as the rule (ReZero's or
    LayerScale's) reads and writes it, with the attention's and the MLP's scales ([1] or [d])."""
    rule = DEPTH_RULES[rule_name]
    heads = [(ResidualScale(tuple(scale.shape), 0.0),) for scale in scales]
    with torch.no_grad():
        for (module,), scale in zip(heads, scales, strict=True):
            module.weight.copy_(scale)
    depth = DepthState((), x.new_zeros(*x.shape[:-1], 0), x)
    policy = depth_mix_policy(scratch_model("llama", rule_name, num_layers=1).config)
    for sublayer, head in zip((attention, mlp), heads, strict=True):
        sublayer_input, _ = rule.read(depth, head, norm, None, policy)
        depth = rule.write(depth, sublayer(sublayer_input), head, norm)
    return depth.partial_sum


def test_rezero_computes_the_authors_rezero_transformer_layer():
    """The authors' ReZero package (`pip install rezero==0.1.0`, Bachlechner et al.; skipped without it): its
    `RZTXEncoderLayer` computes x + a attn(x), then x + a ffn(x), with no norm and ONE scale a per layer, shared by
    its two sublayers. Ours, around its own attention and feed-forward, computes the same where our attention's and
    MLP's scales are equal (2.4e-7 measured); ours learns one scale per sublayer, so unequal scales leave theirs
    (0.26 measured); ReZero on PreNorm reads norm(h) and leaves it too (0.066)."""
    rezero_transformer = pytest.importorskip("rezero.transformer")
    torch.manual_seed(0)
    theirs = rezero_transformer.RZTXEncoderLayer(d_model=64, nhead=4, dim_feedforward=96, dropout=0.0).eval()
    with torch.no_grad():
        theirs.resweight.fill_(0.7)

    def attention(x: torch.Tensor) -> torch.Tensor:  # theirs is sequence-first: [T,B,d]
        return theirs.self_attn(*(x.transpose(0, 1),) * 3)[0].transpose(0, 1)

    def mlp(x: torch.Tensor) -> torch.Tensor:
        return theirs.linear2(theirs.activation(theirs.linear1(x)))

    x = torch.randn(2, 5, 64)
    rms_norm = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        expected = theirs(x.transpose(0, 1)).transpose(0, 1)
        same, other = torch.tensor([0.7]), torch.tensor([0.3])
        ours = scaled_layer("rezero", attention, mlp, (same, same), x, norm=rms_norm)
        unequal = scaled_layer("rezero", attention, mlp, (same, other), x, norm=rms_norm)
        on_prenorm = scaled_layer("rezero_prenorm", attention, mlp, (same, same), x, norm=rms_norm)
    differences = [(other - expected).abs().max().item() for other in (ours, unequal, on_prenorm)]
    print("ReZero against the authors' layer: equal scales, unequal, on PreNorm:", differences)
    assert differences[0] <= 1e-6 and min(differences[1:]) > 0.05


def test_layerscale_computes_cait_s_equations():
    """CaiT (Touvron et al. 2021, Eq. 4): x'_l = x_l + diag(λ_l,1) × SA(η(x_l)), x_l+1 = x'_l + diag(λ_l,2) ×
    FFN(η(x'_l)), η the layer's norm and λ a learned vector per sublayer, written here line by line (timm's
    `LayerScale`, x * gamma, is the diag(λ) alone; timm is no test dependency: it needs torchvision)."""
    torch.manual_seed(0)
    attention = torch.nn.Linear(64, 64)
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 96), torch.nn.GELU(), torch.nn.Linear(96, 64))
    norm = torch.nn.RMSNorm(64, eps=1e-6)
    lambda_1, lambda_2, x = torch.rand(64), torch.rand(64), torch.randn(2, 5, 64)
    with torch.no_grad():
        x_prime = x + attention(norm(x)) @ torch.diag(lambda_1)  # diag(λ) × y, per token
        expected = x_prime + mlp(norm(x_prime)) @ torch.diag(lambda_2)
        ours = scaled_layer("layerscale", attention, mlp, (lambda_1, lambda_2), x, norm)
    difference = (ours - expected).abs().max().item()
    print(f"LayerScale against CaiT's equations: {difference:.2g}")
    assert difference <= 1e-6


@pytest.mark.parametrize("num_streams", [2, 3, 4])
def test_mhc_starts_each_mix_at_two_thirds_of_the_identity_and_one_third_uniform(num_streams):
    """b_res = log(2m + 1) I gives A = 2/3 I + 1/(3m) whatever the streams (0.75 on the diagonal and 1/12 off it at
    m = 4), doubly stochastic within 1e-6, with beta = 1. A write of a zero output therefore keeps 2/3 of the
    differences between the streams it reads, where the uniform 1/m (b_res = 0) would keep none."""
    connection = HyperConnection(hidden_size=8, num_streams=num_streams, read_stream=0, writes=True, eps=1e-6)
    eye = torch.eye(num_streams)
    mix_bias = connection.bias[2 * num_streams :].detach()  # after b_pre [m] and b_post [m]
    torch.testing.assert_close(mix_bias, math.log(2 * num_streams + 1) * eye.flatten())
    torch.manual_seed(0)
    streams = torch.randn(2, 5, num_streams, 8)
    with torch.no_grad():
        beta, mix = write_coefficients(streams, *connection(), connection.eps)
        written = write_streams(streams, torch.zeros(2, 5, 8), *connection(), connection.eps)
    expected = 2 / 3 * eye + 1 / (3 * num_streams)
    torch.testing.assert_close(mix, expected.expand_as(mix), rtol=0, atol=1e-6)
    torch.testing.assert_close(mix.sum(-1), torch.ones(2, 5, num_streams), rtol=0, atol=1e-6)
    torch.testing.assert_close(mix.sum(-2), torch.ones(2, 5, num_streams), rtol=0, atol=1e-6)
    assert beta.eq(1).all()
    if num_streams == 4:
        assert mix[0, 0, 0].tolist() == pytest.approx([0.75, 1 / 12, 1 / 12, 1 / 12], abs=1e-6)
    differences = streams - streams.mean(-2, keepdim=True)
    torch.testing.assert_close(written - written.mean(-2, keepdim=True), 2 / 3 * differences, rtol=0, atol=1e-6)


def test_mhc_streams_part_and_their_mixes_keep_two_thirds_of_their_differences_as_it_trains(text_batches):
    """mHC (3 streams here, 4 by default) starts with equal copies of the embedding, mixed by 2/3 I + 1/9. The first
    step learns no mix: every A whose rows sum to 1 leaves equal copies as they are, so b_res and phi_res get gradients
    of float rounding (4e-11 measured), where b_post's reach 1.2e-4. After 8 AdamW steps the copies have parted, and
    every layer's attention mixes them by a matrix whose rows and columns sum to 1 within 1e-6 at every token, which
    has left its init after the first layer (whose streams are still the copies of the embedding) and keeps about 2/3
    of the differences between the streams it reads: 0.69 to 0.70 measured, where the uniform init mHC had before this
    kept 0.004 to 0.015 (the mix averaged the streams' differences away)."""
    train_ids, held_out_ids = text_batches
    model = scratch_model("llama", "mhc", attnres_num_streams=3)
    connections = [module for module in model.modules() if isinstance(module, HyperConnection) and module.writes]
    for connection in connections:  # b = (b_pre [3], b_post [3], b_res [3x3]); phi's rows likewise
        torch.testing.assert_close(connection.bias[6:].detach(), math.log(7) * torch.eye(3).flatten())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(8):
        batch = train_ids[step * 8 :][:8]
        model(batch, labels=batch).loss.backward()
        if step == 0:
            assert max(connection.bias.grad[6:].abs().max().item() for connection in connections) < 1e-8
            assert max(connection.weight.grad[6:].abs().max().item() for connection in connections) < 1e-8
            assert min(connection.bias.grad[3:6].abs().max().item() for connection in connections) > 1e-5
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
    initial = 2 / 3 * torch.eye(3) + 1 / 9
    for layer, streams in zip(model.model.layers, streams_read, strict=True):
        connection = layer.self_attention_res_connection
        with torch.no_grad():
            _, mix = write_coefficients(streams, *connection(), connection.eps)  # [B,T,3,3]
        assert mix.shape == (*held_out_ids.shape, 3, 3) and mix.min() >= 0
        torch.testing.assert_close(mix.sum(-1), torch.ones(mix.shape[:-1]), rtol=0, atol=1e-6)
        torch.testing.assert_close(mix.sum(-2), torch.ones(mix.shape[:-1]), rtol=0, atol=1e-6)
        if layer.layer_idx > 0:
            # float noise is 1e-7; these matrices have moved by 1.9e-2 to 2.4e-2 (measured)
            assert (mix - initial).abs().max() > 5e-3
            differences = streams - streams.mean(-2, keepdim=True)
            assert 0.6 < ((mix @ differences).norm() / differences.norm()).item() < 0.75
    last = streams_read[-1]  # its streams differ by 4.1e-3 of their largest value (measured; 1.5e-3 from 1/3)
    assert (last - last.mean(-2, keepdim=True)).abs().max() > 2e-3 * last.abs().max()


def test_sinkhorn_knopp_normalises_columns_then_rows_so_that_rows_sum_to_1_exactly():
    """The paper's Eq. 9 order: however few the iterations, every row sums to 1 to float rounding (each written stream
    is a convex combination of the streams read, and equal copies stay equal); the columns only converge to it. From
    logits spread as 4 * N(0, 1), columns are off by 1.34 after one iteration and by 6.8e-2 after 20 (measured)."""
    torch.manual_seed(0)
    logits = 4 * torch.randn(256, 4, 4)
    for iterations, column_error in ((1, 1.34), (20, 6.8e-2)):
        matrix = sinkhorn_knopp(logits, iterations)
        assert matrix.min() >= 0
        torch.testing.assert_close(matrix.sum(-1), torch.ones(256, 4), rtol=0, atol=1e-6)
        assert (matrix.sum(-2) - 1).abs().max().item() == pytest.approx(column_error, rel=0.02)


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


def random_permutation_connection(num_streams: int, hidden_size: int = 8, seed: int = 0) -> PermutationConnection:
    """mHC-lite's connection with every parameter random (its gates 1, so phi's projection counts)"""
    connection = PermutationConnection(hidden_size, num_streams, read_stream=0, writes=True, eps=1e-6)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in connection.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return connection


@pytest.mark.parametrize("num_streams", [2, 3, 4, 5, 6])
def test_mhc_lite_mixes_by_exactly_doubly_stochastic_matrices_from_random_streams_and_parameters(num_streams):
    """A = sum_k w_k P_k has rows and columns summing to 1 within float rounding, whatever the logits (3.6e-7 at
    worst measured over these, at 6 streams), where mHC's 20 Sinkhorn-Knopp iterations leave its columns off by up to
    6.8e-2 on random logits (see the Sinkhorn-Knopp test above). Its weight holds 2m + m! rows of m * hidden_size
    columns."""
    connection = random_permutation_connection(num_streams)
    assert connection.weight.shape == (2 * num_streams + math.factorial(num_streams), num_streams * 8)
    streams = torch.randn(3, 7, num_streams, 8, generator=torch.Generator().manual_seed(1)) * 5
    with torch.no_grad():
        _, mix = write_coefficients(streams, *connection(), connection.eps, connection.mix)
    assert mix.min() >= 0
    ones = torch.ones(3, 7, num_streams)
    torch.testing.assert_close(mix.sum(-1), ones, rtol=0, atol=1e-6)
    torch.testing.assert_close(mix.sum(-2), ones, rtol=0, atol=1e-6)
    assert not torch.allclose(mix, mix[..., :1, :1, :, :])  # per token: the random streams give different mixes


def test_mhc_lite_computes_the_papers_equation_line_by_line():
    """A reference from the equation, in float64: w = softmax(g_res * (x . phi_res) + b_res) over the permutations of
    `itertools.permutations`, each P_k built entry by entry (P_k[i][perm_k[i]] = 1) and summed with its weight. The
    rule's A equals it within 1e-6 at 4 streams (24 permutations)."""
    connection, num_streams = random_permutation_connection(4), 4
    streams = torch.randn(2, 3, num_streams, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        _, mix = write_coefficients(streams, *connection(), connection.eps, connection.mix)
        weight, gate, bias = (parameter.double() for parameter in connection())
    flat = streams.double().flatten(-2)
    x = flat / flat.pow(2).mean(-1, keepdim=True).add(connection.eps).sqrt()
    permutations = list(itertools.permutations(range(num_streams)))
    logits = gate[2] * (x @ weight[2 * num_streams :].T) + bias[2 * num_streams :]
    weights = torch.softmax(logits, dim=-1)
    expected = torch.zeros(2, 3, num_streams, num_streams, dtype=torch.float64)
    for k, permutation in enumerate(permutations):
        matrix = torch.zeros(num_streams, num_streams, dtype=torch.float64)
        for row, column in enumerate(permutation):
            matrix[row, column] = 1.0
        expected += weights[..., k, None, None] * matrix
    assert (mix.double() - expected).abs().max().item() < 1e-6


@pytest.mark.parametrize("num_streams", [2, 3, 4, 6])
def test_mhc_lite_starts_at_mhcs_two_thirds_of_the_identity(num_streams):
    """b_res = log(2 m! + 1) on the identity permutation and 0 on the others: weights 2/3 + 1/(3 m!) and 1/(3 m!),
    so A = 2/3 I + 1/(3m) (0.75 and 1/12 at m = 4), mHC's init, with beta = 1: within 1e-6 up to 5 streams; at 6,
    720 weights summed in float32 are off by 1.7e-6 (measured)."""
    connection = PermutationConnection(hidden_size=8, num_streams=num_streams, read_stream=0, writes=True, eps=1e-6)
    mix_bias = connection.bias[2 * num_streams :].detach()
    assert mix_bias[0].item() == pytest.approx(math.log(2 * math.factorial(num_streams) + 1))
    assert mix_bias[1:].eq(0).all() and mix_bias.numel() == math.factorial(num_streams)
    streams = torch.randn(2, 5, num_streams, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        beta, mix = write_coefficients(streams, *connection(), connection.eps, connection.mix)
    expected = 2 / 3 * torch.eye(num_streams) + 1 / (3 * num_streams)
    torch.testing.assert_close(mix, expected.expand_as(mix), rtol=0, atol=3e-6 if num_streams == 6 else 1e-6)
    assert beta.eq(1).all()
    if num_streams == 4:
        assert mix[0, 0, 0].tolist() == pytest.approx([0.75, 1 / 12, 1 / 12, 1 / 12], abs=1e-6)


def test_mhc_lite_takes_at_most_six_streams_and_counts_its_projection_rows():
    """720 permutations at 6 streams; 7 (5040) is refused by the config, naming the cap. The memory bound counts
    2m + m! rows under mHC-lite, 2m + m^2 under mHC: 4 streams on a 128-wide model add 16,384 weights per
    connection under mHC-lite, 12,288 under mHC."""
    text_config = tiny_source_config("llama", num_layers=2).to_dict()
    with pytest.raises(AttnResConfigError, match=r"attnres_num_streams: got 7, over mHC-lite's 6: .* 5,040 of them"):
        attnres.AttnResConfig(text_config=text_config, attnres_mode="mhc_lite", attnres_num_streams=7)
    attnres.AttnResConfig(text_config=text_config, attnres_mode="mhc", attnres_num_streams=7)  # mHC takes 7
    for mode, rows in (("mhc_lite", 32), ("mhc", 24)):
        model = scratch_model("llama", mode, num_layers=1, attnres_num_streams=4)
        connection = model.model.layers[0].mlp_res_connection
        assert connection.weight.shape == (rows, 4 * model.config.text_config.hidden_size)
    wide = tiny_source_config("llama", num_layers=1).to_dict() | {"hidden_size": 128}
    with pytest.raises(AttnResConfigError, match="6 streams add"):  # 3 connections x 732 rows x 768: 1.7M
        attnres.AttnResConfig(text_config=wide, attnres_mode="mhc_lite", attnres_num_streams=6)


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


@pytest.mark.parametrize("rule", [rule for rule in RULES if rule not in ("block", "full")])
def test_the_model_card_names_the_rule_not_block_attnres(rule):
    config = attnres.AttnResConfig(text_config=tiny_source_config("llama", num_layers=4).to_dict(), attnres_mode=rule)
    layout = describe_layout(config)
    assert layout.startswith(RULES[rule].label) and "Block AttnRes" not in layout, layout


# The paper's ablations of AttnRes (its Table 4), as options of Block and Full AttnRes: name -> (mode, options). Four
# depth heads on the tiny models' hidden size of 64; a window of 3 sublayer outputs of their 8.
ABLATIONS = {
    "projected-query": ("full", dict(attnres_query="projected")),
    "scalar-mixing": ("full", dict(attnres_query="scalars")),
    "sigmoid": ("full", dict(attnres_score="sigmoid")),
    "full-no-key-norm": ("full", dict(attnres_key_norm=False)),
    "block-no-key-norm": ("block", dict(attnres_key_norm=False)),
    "multihead": ("block", dict(attnres_depth_heads=4)),
    "window": ("full", dict(attnres_window=3)),
}
EXACT_ABLATIONS = [name for name in ABLATIONS if name != "window"]


def ablation_model(name: str, family: str = "llama", **settings) -> attnres.AttnResForCausalLM:
    mode, options = ABLATIONS[name]
    model = scratch_model(family, mode, **options, **settings).eval()
    randomize_rule_parameters(model)
    return model


@pytest.mark.parametrize("family", family_params(FAMILIES))
@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_ablations_mix_alike_in_the_reference_and_in_two_phases(ablation, family):
    """In float64, the direct computation and the two-phase one give the same logits and depth weights."""
    model = ablation_model(ablation, family).double()
    ids = random_ids()
    outputs = {}
    with torch.no_grad():
        for implementation in ("naive", "two_phase"):
            model.config.attnres_implementation = implementation
            outputs[implementation] = model(ids, output_depth_weights=True)
    torch.testing.assert_close(outputs["two_phase"].logits, outputs["naive"].logits, rtol=0, atol=1e-10)
    for fast, direct in zip(outputs["two_phase"].depth_weights, outputs["naive"].depth_weights, strict=True):
        torch.testing.assert_close(fast, direct, rtol=0, atol=1e-12)
    assert [weights.shape[-1] for weights in outputs["naive"].depth_weights] == model.config.num_sources()


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_ablations_reload_and_generate_with_and_without_the_cache(ablation, tmp_path):
    ids = random_ids(batch=1, length=6)
    for family in FAMILIES:
        model = ablation_model(ablation, family)
        model.save_pretrained(tmp_path / family)
        reloaded = attnres.AttnResForCausalLM.from_pretrained(tmp_path / family).eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
            cached = model.generate(ids, max_new_tokens=8, do_sample=False)
            uncached = model.generate(ids, max_new_tokens=8, do_sample=False, use_cache=False)
        assert torch.equal(cached, uncached), family


@pytest.mark.slow
def test_ablations_run_as_remote_code(tmp_path):
    ids = random_ids(batch=1, length=6)
    expected = {}
    for ablation in ABLATIONS:
        model = ablation_model(ablation)
        model.save_pretrained(tmp_path / ablation)
        with torch.no_grad():
            expected[ablation] = model.generate(ids, max_new_tokens=8, do_sample=False)
    torch.save(ids, tmp_path / "ids.pt")
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules")}
    folders = [str(tmp_path / ablation) for ablation in ABLATIONS]
    command = [sys.executable, "-c", REMOTE_CODE_SCRIPT, str(tmp_path / "ids.pt"), *folders]
    subprocess.run(command, check=True, env=env, cwd=tmp_path, timeout=300)
    for ablation, tokens in expected.items():
        assert torch.equal(torch.load(tmp_path / ablation / "remote.pt"), tokens), ablation


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_ablations_keep_gradient_checkpointing_and_bf16_autocast(ablation):
    """Gradient checkpointing gives the gradients of the plain backward pass; under bf16 autocast the depth weights
    stay fp32 and the loss stays within bf16's noise of fp32's."""
    model = ablation_model(ablation).train()
    ids = random_ids()

    def loss_and_gradients() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    loss, gradients = loss_and_gradients()
    model.activation_checkpointing_enable()
    checkpointed_loss, checkpointed = loss_and_gradients()
    assert checkpointed_loss == loss and checkpointed.keys() == gradients.keys()
    for name, gradient in gradients.items():
        torch.testing.assert_close(checkpointed[name], gradient, rtol=0, atol=1e-6)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(ids, labels=ids, output_depth_weights=True)
    assert all(weights.dtype == torch.float32 for weights in output.depth_weights)
    assert abs(output.loss.item() - loss.item()) < 0.05 * loss.item()


def rule_or_ablation_model(name: str) -> attnres.AttnResForCausalLM:
    """An ablation's model, or a rule's (Block and Full are in the contract tests) with its parameters off their init:
    2 layers, for a compile of half the time (mHC's write and read, Highway's gates, all present)."""
    if name in ABLATIONS:
        return ablation_model(name)
    model = scratch_model("llama", name, num_layers=2)
    randomize_rule_parameters(model)
    return model


@pytest.mark.slow  # torch.compile: 10 to 30 s a case
@pytest.mark.parametrize(
    "name, compiled_mix",
    [*((rule, "inline") for rule in RULES if rule not in ("block", "full")),
     *((ablation, compiled_mix) for ablation in ABLATIONS for compiled_mix in ("inline", "operator"))],
)  # fmt: skip
def test_rules_and_ablations_compile_whole(name, compiled_mix, one_thread):
    """`torch.compile(fullgraph=True)` of a training step computes what eager does: its logits and each gradient err
    from a float64 run by at most 4x what eager's fp32 does (the compiler reorders fp32 sums; a random query
    projection's sharp depth softmax amplifies that, to 1.4e-5 in the logits and 3e-3 in gradients of up to 47, the
    same for eager and compiled, against a few 1e-7 for the other ablations)."""
    torch._dynamo.reset()
    model, ids = rule_or_ablation_model(name).train(), random_ids()
    model.config.attnres_compiled_mix = compiled_mix  # AttnRes's option; the other rules' configs ignore it
    exact_model = copy.deepcopy(model).double()
    exact_output = exact_model(ids, labels=ids)
    exact_output.loss.backward()
    exact_logits = exact_output.logits.detach()
    exact_gradients = {name: p.grad for name, p in exact_model.named_parameters() if p.requires_grad}
    results = []
    for forward in (model, torch.compile(model, fullgraph=True)):
        model.zero_grad()
        output = forward(ids, labels=ids)
        output.loss.backward()
        gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
        results.append((output.logits.detach(), gradients))
    (eager_logits, eager_gradients), (compiled_logits, compiled_gradients) = results

    def error(value: torch.Tensor, exact: torch.Tensor) -> float:
        return (value.double() - exact).abs().max().item()

    eager_error, compiled_error = error(eager_logits, exact_logits), error(compiled_logits, exact_logits)
    print(f"{name}: logit error from float64, eager {eager_error:.1e}, compiled {compiled_error:.1e}")
    assert compiled_error <= 4 * eager_error
    for name, exact in exact_gradients.items():
        eager_error = error(eager_gradients[name], exact)
        assert error(compiled_gradients[name], exact) <= max(4 * eager_error, 1e-6), name


@pytest.mark.parametrize("ablation", list(ABLATIONS))
def test_ablations_train_from_scratch(ablation, text_batches):
    """30 AdamW steps lower the held-out loss by at least 1 nat (of ~4.6), as for the rules."""
    mode, options = ABLATIONS[ablation]
    before, after = held_out_losses_around_training(scratch_model("llama", mode, **options), text_batches)
    print(f"{ablation}: held-out loss {before:.3f} -> {after:.3f}")
    assert after < before - 1.0


@pytest.mark.parametrize("partial", [True, False], ids=["partial-sum", "block-just-closed"])
def test_the_projected_query_reads_the_hidden_state_the_sum_of_the_sources(partial):
    """The paper's input-dependent query, "projected from the hidden state", line by line: q = w + W RMSNorm(h) / d,
    h = v_0 + ... + v_n the sum of the sublayer's sources (the embedding and every output since: the standard
    residual stream). `projected_latest` reads the latest source v_n instead, as `projected` did before naming 2."""
    torch.manual_seed(0)
    d, eps = 16, 1e-6
    blocks = tuple(torch.randn(2, 3, d) * scale for scale in (1.0, 4.0, 9.0))
    depth = DepthState(blocks, torch.zeros(2, 3, len(blocks)), torch.randn(2, 3, d) if partial else None)
    learned = DepthParameters(pseudo_query=torch.randn(1, d), query_projection=torch.randn(d, d))
    w, W = learned.pseudo_query, learned.query_projection

    def reference(v: torch.Tensor) -> torch.Tensor:
        rmsnorm_v = v / torch.sqrt(v.pow(2).mean(-1, keepdim=True) + eps)
        return (w + rmsnorm_v @ W.T / d).unsqueeze(-2)

    sources = depth.sources()
    for query, v in (("projected", sum(sources)), ("projected_latest", sources[-1])):
        ours = sublayer_query(depth, learned, DepthAttention(eps=eps, query=query))
        torch.testing.assert_close(ours, reference(v), rtol=0, atol=1e-5)
    assert (reference(sum(sources)) - reference(sources[-1])).abs().max() > 0.1


def test_the_projected_query_trains_at_the_pseudo_query_s_pace(text_batches):
    """An input-dependent query keeps a spread over depth as it trains and learns as fast as Full AttnRes. Measured
    after 30 steps: depth-weight entropy 1.46 (Full 1.50) nats, held-out loss 3.203 (3.225); from the latest source
    (`projected_latest`), 1.48 and 3.223; without the projection's 1/d (then from the latest source) the softmax went
    near one-hot (entropy 0.23) and the loss stalled (3.484)."""

    def trained(**options) -> tuple[float, float]:
        model = scratch_model("llama", "full", **options)
        _, loss = held_out_losses_around_training(model, text_batches)
        with torch.no_grad():
            entropy = depth_weight_entropy(model(text_batches[1], output_depth_weights=True).depth_weights)
        return loss, entropy[:, 1:].mean().item()  # the first sublayer reads one source

    full_loss, full_entropy = trained()
    projected_loss, projected_entropy = trained(attnres_query="projected")
    print(f"projected query: loss {projected_loss:.3f}, entropy {projected_entropy:.2f}; Full {full_loss:.3f}, "
          f"{full_entropy:.2f}")  # fmt: skip
    assert projected_entropy > 0.7 * full_entropy
    assert projected_loss < full_loss + 0.1


@pytest.mark.parametrize("family", family_params(FAMILIES))
@pytest.mark.parametrize("ablation", EXACT_ABLATIONS)
def test_ablations_convert_to_what_the_source_computes(ablation, family):
    source = tiny_source_model(family)
    ids = random_ids()
    mode, options = ABLATIONS[ablation]
    with torch.no_grad():
        expected = source(ids).logits
        converted = convert_to_attnres(source, mode=mode, options=options)
        logits = converted(ids).logits
    layout = converted.config.depth_layout()
    layout.pop(NAMING_KEY, None)  # beside the projected query, whose name moved
    assert layout == {"attnres_mode": mode, **options} | (
        {"attnres_block_size": converted.config.attnres_block_size} if mode == "block" else {}
    )
    assert (logits - expected).abs().max().item() <= 1e-5  # as Block and Full AttnRes


def test_a_window_is_refused_for_conversion_in_one_line():
    with pytest.raises(
        ConversionError, match=r"^attnres_window=3 cannot start as the source computes: .*older"
    ) as error:
        convert_to_attnres(tiny_source_model("llama"), mode="full", options=dict(attnres_window=3))
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "mode, options, message",
    [
        ("block", dict(attnres_window=8), r"attnres_window: 8 is an option of attnres_mode='full', not of .*'block'"),
        ("prenorm", dict(attnres_score="sigmoid"), r"attnres_score: 'sigmoid' is an option of .*: drop it"),
        ("full", dict(attnres_depth_heads=5), r"does not divide hidden_size=64 .*pick a divisor"),
        ("full", dict(attnres_depth_heads=0), r"attnres_depth_heads: got 0, expected a positive integer"),
        ("full", dict(attnres_query="dynamic"), r"attnres_query: got 'dynamic', expected one of"),
        ("full", dict(attnres_query="scalars", attnres_depth_heads=4), r"no query or key to split"),
        ("full", dict(attnres_window=0), r"attnres_window: got 0, expected a positive integer"),
    ],
)
def test_nonsensical_ablation_settings_are_refused(mode, options, message):
    with pytest.raises(AttnResConfigError, match=message):
        attnres.AttnResConfig(
            text_config=tiny_source_config("llama", num_layers=4).to_dict(), attnres_mode=mode, **options
        )


def test_a_config_edited_away_from_its_ablations_is_refused(tmp_path):
    ablation_model("sigmoid").save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["attnres_saved_layout"] == {"attnres_mode": "full", "attnres_score": "sigmoid"}
    (tmp_path / "config.json").write_text(json.dumps(saved | {"attnres_score": "softmax"}))
    with pytest.raises(
        AttnResConfigError, match="says attnres_score='softmax', but the weights saved with it were made"
    ):
        attnres.AttnResForCausalLM.from_pretrained(tmp_path)


def test_the_command_line_converts_and_trains_the_ablations(tmp_path):
    """`attnres convert` takes the options (and refuses a window in one line); `attnres train --convert
    --from-scratch` trains a window."""
    source = tmp_path / "source"
    tiny_source_model("llama", num_layers=2).save_pretrained(source)
    tiny_tokenizer().save_pretrained(source)
    code, _, stderr = run_cli("convert", source, tmp_path / "heads", "--depth-heads", 4, "--score", "sigmoid")
    assert code == 0, stderr
    saved = json.loads((tmp_path / "heads" / "config.json").read_text())["attnres_saved_layout"]
    assert saved["attnres_depth_heads"] == 4 and saved["attnres_score"] == "sigmoid"
    code, _, stderr = run_cli("convert", source, tmp_path / "window", "--mode", "full", "--window", 2)
    assert code != 0 and "attnres_window=2 cannot start as the source computes" in stderr
    assert not (tmp_path / "window").exists()
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    dataset = tmp_path / "text.jsonl"
    dataset.write_text("".join(json.dumps({"text": part}) + "\n" for part in text.split("\n\n") if part.strip()))
    command = ["train", "--output-dir", tmp_path / "run", "--model", source, "--dataset", dataset, "--convert"]
    options = ["--mode", "full", "--window", 2, "--from-scratch", "--query", "projected"]
    run = ["--seq-len", 32, "--batch-size", 4, "--max-steps", 2, "--eval-size", 0.1, "--log-every", 1]
    code, _, stderr = run_cli(*command, *options, *run)
    assert code == 0, stderr
    saved = json.loads((tmp_path / "run" / "config.json").read_text())["attnres_saved_layout"]
    assert saved == {"attnres_mode": "full", "attnres_query": "projected", "attnres_window": 2, NAMING_KEY: NAMING}
