"""The model classes, registered with transformers' Auto classes for `model_type="attnres"` when this module loads.

`attnres/__init__.py` loads it on first use of a model class, and every module of the package that loads models
imports it, so that AutoConfig / AutoModel / AutoModelForCausalLM know AttnRes without `trust_remote_code`.
"""

import importlib.util

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_attnres import SUPPORTED_FAMILIES, AttnResConfig
from .modeling_attnres import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel

AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

# PEFT chooses LoRA's default target modules by model_type; AttnRes keeps the source family's projection names.
if importlib.util.find_spec("peft") is not None:
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.setdefault("attnres", ["q_proj", "v_proj"])

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]
