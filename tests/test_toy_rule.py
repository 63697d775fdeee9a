"""A new depth-mixing rule is one class (depth_rules.py) and one entry (rules.py): "half", a toy (h <- h + f/2),
registered here and nowhere else, is checked by the config, built, trained, saved and reloaded, refused for conversion
with its own reason, and analysed (its depth-mixing matrix rebuilds what each sublayer reads)."""

import json

import pytest
import torch
from tiny import random_ids, tiny_source_config, tiny_source_model

import attnres
from attnres import rules
from attnres.analysis import mixing_matrix, token_mixing_matrices
from attnres.configuration_attnres import AttnResConfigError
from attnres.conversion import ConversionError, convert_to_attnres
from attnres.depth_rules import DEPTH_RULES, DepthRule, plain_coefficients


class HalfRule(DepthRule):
    """h <- h + f(norm(h)) / 2"""

    def write(self, depth, output, head, norm):
        return depth.add(output / 2)

    def coefficients(self, stream, head):
        return plain_coefficients(stream, write=0.5)


HALF = rules.RuleSpec("Half (each sublayer output halved)", "stream", "it halves each sublayer output", learns=False)


@pytest.fixture
def half_rule(monkeypatch):
    monkeypatch.setitem(rules.RULES, "half", HALF)
    monkeypatch.setitem(DEPTH_RULES, "half", HalfRule())


def half_model(seed: int = 0) -> attnres.AttnResForCausalLM:
    config = attnres.AttnResConfig(text_config=tiny_source_config("llama", num_layers=2).to_dict(), attnres_mode="half")
    torch.manual_seed(seed)
    return attnres.AttnResForCausalLM(config)


def test_an_unregistered_rule_is_refused_by_the_config():
    with pytest.raises(AttnResConfigError, match="attnres_mode: got 'half', expected one of"):
        half_model()


def test_a_rule_of_one_class_and_one_entry_runs_everywhere(half_rule, tmp_path):
    model = half_model()
    ids = random_ids()
    # It computes h + f/2: each sublayer's contribution to the final norm's input is half what it adds
    matrix = torch.tensor([[0.0 if w is None else w for w in row] for row in mixing_matrix(model.eval(), ids)])
    assert torch.equal(matrix[-1], torch.tensor([1.0, 0.5, 0.5, 0.5, 0.5]))
    assert token_mixing_matrices(model, ids).shape[-2:] == (5, 5)

    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(20):
        loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1.0

    model.eval().save_pretrained(tmp_path / "half")
    reloaded = attnres.AttnResForCausalLM.from_pretrained(tmp_path / "half").eval()
    saved = json.loads((tmp_path / "half" / "config.json").read_text())
    assert reloaded.config.attnres_mode == "half" and saved["attnres_saved_layout"] == {"attnres_mode": "half"}
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, model(ids).logits)

    with pytest.raises(ConversionError, match="--mode half cannot start as the source computes: it halves each"):
        convert_to_attnres(tiny_source_model("llama", num_layers=2), mode="half")
