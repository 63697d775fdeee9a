"""The package's reach into PEFT's private parts: its table of LoRA's default target modules, which has no public
way to add a model type."""

import peft
from peft.utils import constants

from . import require


def register_lora_targets(model_type: str, modules: list[str]) -> None:
    """Let `LoraConfig()` without `target_modules` pick `modules` on models of `model_type` (unless already set)."""
    table = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
    require(isinstance(getattr(constants, table, None), dict), peft, f"utils.constants.{table}")
    getattr(constants, table).setdefault(model_type, modules)
