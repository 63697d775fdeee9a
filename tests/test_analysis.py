"""`attnres analyze`: depth-weight maps, magnitude and gradient profiles, and the JSON behind them."""

import json
import math

import pytest
import torch
from PIL import Image
from tiny import VOCAB, attnres_twin, tiny_source_model, tiny_tokenizer

import attnres
from attnres.analysis import analyze, depth_weight_entropy, depth_weight_map, mixing_matrix, token_mixing_matrices
from attnres.conversion import convert_to_attnres
from attnres_cli.command import main


def text_ids(length: int = 48, batch: int = 2) -> torch.Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mode,block_size", [("block", 2), ("full", None)])
def test_pictures_and_json_follow_the_layout(mode, block_size, tmp_path):
    source = tiny_source_model("llama", num_layers=5)
    model = attnres_twin(source, attnres_mode=mode, attnres_block_size=block_size, attnres_scale_by_num_sources=True)
    report = analyze(model, text_ids(), tmp_path, baseline=source)

    for name in ("depth_weights.png", "magnitudes.png", "gradients.png"):
        with Image.open(tmp_path / name) as image:
            width, height = image.size
        assert 500 <= width <= 3000 and 400 <= height <= 3000, (name, image.size)

    saved = json.loads((tmp_path / "analysis.json").read_text())
    assert saved == json.loads(json.dumps(report))
    num_sublayers = 2 * 5
    assert len(saved["sublayers"]) == num_sublayers
    assert len(saved["depth_weights"]) == num_sublayers + 1  # plus the output aggregation
    assert all(len(row) == len(saved["sources"]) for row in saved["depth_weights"])
    visible = [sum(w is not None for w in row) for row in saved["depth_weights"]]
    assert visible == model.config.num_sources() == saved["num_sources"]
    expected_columns = 1 + 2 * 5 if mode == "full" else 1 + 2 + 1  # embedding, blocks 1-2, partial sum
    assert len(saved["sources"]) == expected_columns
    for profile in ("attnres", "baseline"):
        assert len(saved["magnitudes"][profile]["input_rms"]) == num_sublayers
        assert len(saved["magnitudes"][profile]["output_rms"]) == num_sublayers
        assert len(saved["gradients"][profile]) == num_sublayers
        assert all(g > 0 for g in saved["gradients"][profile])


@pytest.mark.parametrize("family", ["qwen3", "olmo2"])  # OLMo-2's sublayers read the stream without an input norm
def test_converted_model_looks_uniformly_and_matches_its_baseline(family, tmp_path):
    source = tiny_source_model(family, num_layers=4)
    model = attnres_twin(source, attnres_block_size=2, attnres_scale_by_num_sources=True)
    report = analyze(model, text_ids(), tmp_path, baseline=source)
    for row, count in zip(report["depth_weights"], report["num_sources"], strict=True):
        assert [w for w in row if w is not None] == pytest.approx([1 / count] * count, abs=1e-6)
    assert report["entropy"] == pytest.approx(report["max_entropy"], abs=1e-5)
    # With zero queries and rescaling, every sublayer reads and writes what the source's sublayer does.
    for key in ("input_rms", "output_rms"):
        assert report["magnitudes"]["attnres"][key] == pytest.approx(report["magnitudes"]["baseline"][key], rel=1e-4)
    assert report["loss"]["attnres"] == pytest.approx(report["loss"]["baseline"], abs=1e-5)


@pytest.mark.slow  # 300 training steps
def test_training_moves_depth_weights_away_from_uniform(tmp_path):
    torch.manual_seed(0)
    model = attnres_twin(tiny_source_model("llama", num_layers=4), attnres_block_size=1).train()
    depth_parameters = [p for n, p in model.named_parameters() if "_res_" in n]
    other_parameters = [p for n, p in model.named_parameters() if "_res_" not in n]
    optimizer = torch.optim.AdamW([{"params": other_parameters, "lr": 3e-3}, {"params": depth_parameters, "lr": 3e-2}])
    # A learnable pattern: each sequence repeats a short random motif.
    generator = torch.Generator().manual_seed(1)
    for _ in range(300):
        motif = torch.randint(3, VOCAB, (8, 6), generator=generator)
        ids = motif.repeat(1, 6)
        model(ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    report = analyze(model, text_ids(), tmp_path)
    deviation = max(
        abs(w - 1 / count)
        for row, count in zip(report["depth_weights"], report["num_sources"], strict=True)
        for w in row
        if w is not None
    )
    print(f"largest deviation from uniform depth weights after 300 steps: {deviation:.3f}")
    assert deviation > 0.1
    assert min(e / m for e, m in zip(report["entropy"][1:], report["max_entropy"][1:], strict=True)) < 0.95


def test_entropy_of_known_distributions():
    uniform = torch.full((2, 3, 4), 0.25)
    one_hot = torch.tensor([[[1.0, 0.0, 0.0]]])
    entropy = depth_weight_entropy((uniform[:1], one_hot))
    assert entropy.shape == (1, 2)
    assert entropy[0].tolist() == pytest.approx([math.log(4), 0.0], abs=1e-6)


def test_analyze_command_writes_the_report(tmp_path):
    model = attnres_twin(tiny_source_model("mistral", num_layers=3), seed=2, attnres_block_size=1)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    text = tmp_path / "text.txt"
    text.write_text("Where each sublayer looks in depth, measured on a short text. " * 4)
    output = tmp_path / "out"
    status = main(["analyze", str(tmp_path / "model"), "--text", str(text), "--tokens", "40", "--output", str(output)])
    assert status == 0
    report = json.loads((tmp_path / "out" / "analysis.json").read_text())
    assert report["tokens"] == 40 and report["num_sources"] == model.config.num_sources()
    assert {p.name for p in (tmp_path / "out").iterdir()} == {
        "analysis.json",
        "depth_weights.png",
        "mixing_matrices.png",
        "magnitudes.png",
        "gradients.png",
    }


def test_a_window_places_each_weight_under_its_source():
    """Full AttnRes with a window of 3: each row holds the embedding and the 3 latest sublayer outputs, in place."""
    config = attnres_twin(tiny_source_model("llama", num_layers=3), attnres_mode="full", attnres_window=3).config
    depth_weights = tuple(torch.arange(1.0, count + 1).expand(2, 4, count) for count in config.num_sources())
    rows = depth_weight_map(config, depth_weights)
    # Columns: the embedding, A0, M0, A1, M1, A2, M2. M0 reads the embedding and A0; M2 the embedding, A1, M1 and A2;
    # the output aggregation the embedding, M1, A2 and M2
    assert rows[1] == [1.0, 2.0, None, None, None, None, None]
    assert rows[5] == [1.0, None, None, 2.0, 3.0, 4.0, None]
    assert rows[6] == [1.0, None, None, None, 2.0, 3.0, 4.0]


# --------------------------------------------------------------------------------------------------------------------
# The depth-mixing matrix of every rule
# --------------------------------------------------------------------------------------------------------------------

# Every rule that reads a weighted sum of the sources with one weight per source (LayerScale's is per channel, as are
# Highway's default gates and multihead AttnRes's, one per channel group: their M is the mean, which rebuilds no
# channel exactly), and the AttnRes ablations that change how the weights are made or which sources are seen
SCALAR_MIXING = {
    "prenorm": {}, "rezero": {}, "highway-token": {"attnres_highway_gate": "token"}, "denseformer": {}, "mhc": {},
    "block": {"attnres_block_size": 1},
    "full": {}, "full-window": {"attnres_window": 2}, "full-sigmoid": {"attnres_score": "sigmoid"},
    "full-projected-query": {"attnres_query": "projected"},
}  # fmt: skip


def random_rule_model(rule: str, seed: int = 0, **settings) -> attnres.AttnResForCausalLM:
    """A tiny 4-layer Llama of `rule` with every parameter the rule adds moved off its init."""
    config = attnres.AttnResConfig(
        text_config=tiny_source_model("llama", num_layers=4).config.to_dict(), attnres_mode=rule, **settings
    )
    torch.manual_seed(seed)
    model = attnres.AttnResForCausalLM(config).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_res_" in name:
                parameter.add_(0.3 * torch.randn(parameter.shape))
    return model


@pytest.mark.parametrize("variant", list(SCALAR_MIXING))
def test_each_token_s_mixing_matrix_rebuilds_every_sublayer_input(variant):
    """Summing the sources (embedding, each sublayer's output) with a token's row of M gives exactly what the sublayer
    read before its norm, and the output's row what the final norm read."""
    model = random_rule_model(variant.split("-")[0], **SCALAR_MIXING[variant])
    for row, error in rebuild_errors(model).items():
        assert error <= 3e-7, row


def test_highway_s_per_channel_gates_enter_m_as_their_mean():
    """M holds the mean of a per-channel gate: exact where every channel's gate is the same (W = 0, one bias value per
    sublayer), a rough one where they differ: with random W and b (the 0.3 * randn of `random_rule_model`) the
    sublayer inputs rebuilt from M are off by 54% to 99% of their largest entry (measured)."""
    model = random_rule_model("highway")
    assert min(error for row, error in rebuild_errors(model).items() if row > 0) > 0.3  # row 0 reads the embedding
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "_res_gate.weight" in name:
                parameter.zero_()
            elif "_res_gate.bias" in name:
                parameter.fill_(torch.randn(()).item())
    assert max(rebuild_errors(model).values()) <= 3e-7


def rebuild_errors(model: attnres.AttnResForCausalLM) -> dict[int, float]:
    """For each sublayer (and the output, 2 * layers), the largest difference between what it read before its norm
    and the sources summed with its rows of M, relative to the largest entry of what it read."""
    ids = text_ids(length=16)
    layers, inputs, outputs = model.model.layers, {}, {}

    def keep(store, index, take_input):
        return lambda module, args, output: store.__setitem__(index, args[0] if take_input else output)

    handles = [model.model.norm.register_forward_hook(keep(inputs, 2 * len(layers), True))]
    for layer_index, layer in enumerate(layers):
        attention, mlp = 2 * layer_index, 2 * layer_index + 1
        handles += [
            layer.input_layernorm.register_forward_hook(keep(inputs, attention, True)),
            layer.post_attention_layernorm.register_forward_hook(keep(inputs, mlp, True)),
            layer.self_attn.register_forward_hook(
                lambda module, args, output, i=attention: outputs.update({i: output[0]})
            ),
            layer.mlp.register_forward_hook(keep(outputs, mlp, False)),
        ]
    with torch.no_grad():
        model(ids)
    for handle in handles:
        handle.remove()
    sources = torch.stack([model.model.embed_tokens(ids).detach()] + [outputs[i] for i in range(2 * len(layers))], -2)
    matrices = token_mixing_matrices(model, ids)  # [B,T,R,S]
    assert matrices.shape == (2, 16, 2 * len(layers) + 1, 2 * len(layers) + 1)
    assert torch.all(matrices.triu(1)[..., :-1, :] == 0)  # no sublayer reads a later output
    errors = {}
    for row, read in inputs.items():
        rebuilt = (matrices[..., row, :, None] * sources).sum(-2)
        errors[row] = ((rebuilt - read).abs().max() / read.abs().max()).item()
    return errors


def test_matrices_of_the_rules_at_their_published_start():
    """PreNorm reads every source with weight 1, ReZero only the embedding, Highway's gates start at sigmoid(-1), and
    Full AttnRes's zero queries weigh each source alike."""
    ids = text_ids(length=8)
    source = tiny_source_model("llama", num_layers=2)

    def matrix(rule: str) -> torch.Tensor:
        config = attnres.AttnResConfig(text_config=source.config.to_dict(), attnres_mode=rule)
        model = attnres.AttnResForCausalLM(config).eval()
        return torch.tensor([[math.nan if w is None else w for w in row] for row in mixing_matrix(model, ids)])

    visible = torch.ones(5, 5).tril().bool()
    prenorm, rezero, highway, full = (matrix(rule) for rule in ("prenorm", "rezero", "highway", "full"))
    assert torch.equal(prenorm[visible], torch.ones(15)) and prenorm[~visible].isnan().all()
    assert torch.equal(rezero[:, 0], torch.ones(5)) and torch.equal(rezero[:, 1:][visible[:, 1:]], torch.zeros(10))
    gate = torch.sigmoid(torch.tensor(-1.0))
    torch.testing.assert_close(
        highway[4, :], torch.stack([(1 - gate) ** 4, *(gate * (1 - gate) ** k for k in (3, 2, 1, 0))])
    )
    torch.testing.assert_close(full[visible], torch.cat([torch.full((row,), 1 / row) for row in range(1, 6)]))


@pytest.mark.parametrize(
    "family, rule",
    [
        *(("llama", rule) for rule in ("denseformer", "mhc", "rezero_prenorm", "block", "full")),
        # Falcon-H1's attention sublayer is its Mamba-2 and attention in parallel, their outputs multiplied and summed
        ("falcon_h1", "rezero_prenorm"),
    ],
)
def test_a_converted_model_mixes_as_its_source(family, rule):
    """An exact conversion starts as PreNorm: M is 1 for every earlier source (mHC within its float rounding)."""
    converted = convert_to_attnres(tiny_source_model(family, num_layers=3), mode=rule)
    rows = mixing_matrix(converted, text_ids(length=8))
    for row_index, row in enumerate(rows):
        assert row[row_index + 1 :] == [None] * (len(row) - row_index - 1)
        assert all(abs(weight - 1) < 1e-6 for weight in row[: row_index + 1]), (row_index, row)


def test_analyze_draws_the_rules_side_by_side(tmp_path):
    """`--compare` draws each model's M in one figure; PostNorm, which has none, is analysed without one."""
    folders = {}
    for rule in ("block", "mhc", "highway", "postnorm"):
        folders[rule] = tmp_path / rule
        random_rule_model(rule, **({"attnres_block_size": 1} if rule == "block" else {})).save_pretrained(folders[rule])
        tiny_tokenizer().save_pretrained(folders[rule])
    text = tmp_path / "text.txt"
    text.write_text("Where each sublayer looks in depth, measured on a short text. " * 4)
    arguments = ["--text", str(text), "--tokens", "32"]
    compare = ["--compare", str(folders["mhc"]), str(folders["highway"])]
    assert main(["analyze", str(folders["block"]), *arguments, *compare, "--output", str(tmp_path / "rules")]) == 0
    report = json.loads((tmp_path / "rules" / "analysis.json").read_text())
    assert list(report["mixing_matrices"]) == [
        "this model: block",
        f"{folders['mhc']}: mhc",
        f"{folders['highway']}: highway",
    ]
    assert (
        Image.open(tmp_path / "rules" / "mixing_matrices.png").size[0]
        > Image.open(tmp_path / "rules" / "magnitudes.png").size[0]
    )
    assert main(["analyze", str(folders["postnorm"]), *arguments, "--output", str(tmp_path / "postnorm-analysis")]) == 0
    written = {path.name for path in (tmp_path / "postnorm-analysis").iterdir()}
    assert written == {"analysis.json", "magnitudes.png", "gradients.png"}
