"""Every AttnRes setting is checked whichever door it comes through: the constructor, `from_pretrained`'s keyword
overrides (which transformers sets after construction), a hand-edited config.json, an assignment before saving, and
the command line's rule options. Each bad value is one `AttnResConfigError` (or `OptionError`) naming the setting,
and nothing is written."""

import json

import pytest
from tiny import tiny_source_config
from transformers import AutoConfig, AutoModelForCausalLM

from attnres import AttnResConfig, AttnResForCausalLM
from attnres.configuration_attnres import AttnResConfigError
from attnres.depth_rules import DEPTH_RULES, AttnResRule
from attnres.errors import OptionError
from attnres.options import PARAMETERLESS_MODES, TrainingConfig
from attnres.rules import ATTNRES_MODES, OPTION_MODES

# setting -> (a bad value, words of the error), on a Block AttnRes model of 2 layers
BAD_VALUES = {
    "attnres_mode": ("bogus", "attnres_mode: got 'bogus', expected one of"),
    "attnres_block_size": (2.5, "attnres_block_size: got 2.5, expected an integer"),
    "attnres_eps": (-1.0, "attnres_eps: got -1.0, expected a positive number"),
    "attnres_implementation": ("bogus", "attnres_implementation: got 'bogus'"),
    "attnres_compiled_mix": ("bogus", "attnres_compiled_mix: got 'bogus'"),
    "attnres_scale_init": ("1", "attnres_scale_init: got '1', expected a finite number"),
    "attnres_recompute": ("yes", "attnres_recompute: got 'yes', expected true or false"),
    "attnres_window": (2, "attnres_window: 2 is an option of attnres_mode='full', not of attnres_mode='block'"),
    "attnres_num_streams": (3, "attnres_num_streams: 3 is an option of attnres_mode='mhc'"),
    "attnres_highway_gate": ("token", "attnres_highway_gate: 'token' is an option of attnres_mode='highway', not of"),
    "attnres_depth_heads": (0, "attnres_depth_heads: got 0, expected a positive integer"),
}


def block_config(**settings) -> AttnResConfig:
    return AttnResConfig(text_config=tiny_source_config("llama", num_layers=2).to_dict(), **settings)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    folder = tmp_path_factory.mktemp("saved")
    AttnResForCausalLM(block_config()).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("setting", BAD_VALUES)
def test_a_bad_value_is_refused_at_every_door(setting, saved, tmp_path):
    value, words = BAD_VALUES[setting]
    with pytest.raises(AttnResConfigError, match=words):
        block_config(**{setting: value})
    with pytest.raises(AttnResConfigError, match=words):
        AutoModelForCausalLM.from_pretrained(saved, **{setting: value})
    edited = tmp_path / "edited"
    edited.mkdir()
    config = json.loads((saved / "config.json").read_text())
    (edited / "config.json").write_text(json.dumps(config | {setting: value}))
    with pytest.raises(AttnResConfigError, match=words):
        AutoConfig.from_pretrained(edited)
    model = AutoModelForCausalLM.from_pretrained(saved)
    setattr(model.config, setting, value)
    with pytest.raises(AttnResConfigError, match=words):
        model.save_pretrained(tmp_path / "out")
    assert not (tmp_path / "out" / "config.json").exists()


def test_mhc_settings_are_checked_for_its_rule_and_its_memory(saved):
    with pytest.raises(AttnResConfigError, match="attnres_recompute: True recomputes AttnRes's depth mix"):
        AutoModelForCausalLM.from_pretrained(saved, attnres_mode="mhc", attnres_recompute=True)
    with pytest.raises(AttnResConfigError, match=r"1000 streams add [\d,]+ parameters .* choose fewer streams"):
        AutoModelForCausalLM.from_pretrained(saved, attnres_mode="mhc", attnres_num_streams=1000)


@pytest.mark.parametrize("layout", ["a string", ["attnres_mode"], {"attnres_mode": "block", "extra": 1}])
def test_a_saved_layout_that_is_not_one_is_refused_in_one_line(layout, saved, tmp_path):
    config = json.loads((saved / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"attnres_saved_layout": layout}))
    with pytest.raises(AttnResConfigError, match="attnres_saved_layout: got .* expected the dict") as error:
        AutoConfig.from_pretrained(tmp_path)
    assert "\n" not in str(error.value)


def test_an_implementation_set_on_a_loaded_model_is_checked_when_it_runs(saved):
    import torch

    model = AutoModelForCausalLM.from_pretrained(saved)
    model.config.attnres_implementation = "bogus"
    with pytest.raises(AttnResConfigError, match="attnres_implementation: got 'bogus'"):
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "options, words",
    [
        (
            {"mode": "block", "num_streams": 3},
            "--num-streams is an option of --mode mhc or mhc_lite; --mode block has none",
        ),
        ({"mode": "mhc", "query": "projected"}, "--query is an option of --mode block or full; --mode mhc"),
        ({"mode": "block", "window": 3}, "--window is an option of --mode full"),
        ({"mode": "mhc", "highway_gate": "token"}, "--highway-gate is an option of --mode highway; --mode mhc has"),
        ({"mode": "mhc", "attnres_recompute": True}, "--attnres-recompute recomputes the depth mix"),
        ({"mode": "prenorm", "train": "attnres"}, "--train attnres trains the rule's own parameters, and --mode"),
    ],
)
def test_rule_options_of_another_rule_are_refused_before_anything_loads(options, words):
    with pytest.raises((OptionError, Exception), match=words):
        TrainingConfig(output_dir="unused", convert=True, **options)


def test_the_rules_declare_what_their_classes_do():
    """rules.py, which the command and the config read, against the rule classes: the rules without parameters, and
    those that mix by depth attention."""
    assert PARAMETERLESS_MODES == tuple(mode for mode, rule in DEPTH_RULES.items() if not rule.all_parts)
    assert ATTNRES_MODES == tuple(mode for mode, rule in DEPTH_RULES.items() if isinstance(rule, AttnResRule))
    assert OPTION_MODES == {
        **dict.fromkeys(("attnres_query", "attnres_score", "attnres_key_norm", "attnres_depth_heads"), ATTNRES_MODES),
        "attnres_window": ("full",),
        "attnres_num_streams": ("mhc", "mhc_lite"),
        "attnres_highway_gate": ("highway",),
        "attnres_dwa_dilation": ("denseformer",),
        "attnres_dwa_period": ("denseformer",),
    }
