"""The model as the rest of the package sees it: its classes, registered with transformers' Auto classes for
`model_type="attnres"` when this module loads, and which of its parameters are the ones AttnRes adds.

`import attnres` loads it (as does the import of any module of the package, which imports the package first), so
that AutoConfig / AutoModel / AutoModelForCausalLM know AttnRes without `trust_remote_code` and load AttnRes folders
with these classes, not the folders' copies of them.
"""

import importlib.util

from torch import nn
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

# All of these are `attnres.<name>` too: attnres/__init__.py imports its `__all__` from here
from .configuration_attnres import SUPPORTED_FAMILIES, AttnResConfig  # noqa: F401
from .depth_rules import DEPTH_RULES
from .modeling_attnres import SUBLAYER_NAMES, AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel  # noqa: F401

AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

# The modules AttnRes adds to the source model, by their names in modeling_attnres.py: what each depth-mixing rule
# learns for each sublayer (a one-branch layer's branch) and for the output aggregation (Block and Full AttnRes: a
# pseudo-query and a key norm, or what their ablations learn instead).
# PEFT's `modules_to_save` takes these names.
ATTNRES_MODULES = sorted(
    {
        f"{sublayer}_res_{part}"
        for sublayer in (*{name for names in SUBLAYER_NAMES.values() for name in names}, "output_attn")
        for rule in DEPTH_RULES.values()
        for part in rule.all_parts
    }
)

# PEFT chooses LoRA's default target modules by model_type; AttnRes keeps the source family's projection names.
if importlib.util.find_spec("peft") is not None:
    from .compat.peft_private import register_lora_targets

    register_lora_targets("attnres", ["q_proj", "v_proj"])


def is_attnres_parameter(name: str) -> bool:
    """Whether a parameter (or state-dict key) is one that AttnRes adds, also under a PEFT wrapper's longer names."""
    return any(part in ATTNRES_MODULES for part in name.split("."))


def added_parameter_count(model: nn.Module) -> int:
    """Parameters that AttnRes adds to the source: those of its depth-mixing rule."""
    return sum(parameter.numel() for name, parameter in model.named_parameters() if is_attnres_parameter(name))
