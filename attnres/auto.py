"""The model classes, registered with transformers' Auto classes for `model_type="attnres"` when this module loads.

`attnres/__init__.py` loads it on first use of a model class, and every module of the package that loads models
imports it, so that AutoConfig / AutoModel / AutoModelForCausalLM know AttnRes without `trust_remote_code`.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_attnres import SUPPORTED_FAMILIES, AttnResConfig
from .modeling_attnres import AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel

AutoConfig.register("attnres", AttnResConfig, exist_ok=True)
AutoModel.register(AttnResConfig, AttnResModel, exist_ok=True)
AutoModelForCausalLM.register(AttnResConfig, AttnResForCausalLM, exist_ok=True)

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]
