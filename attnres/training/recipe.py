"""What a run trains and how: the model (an AttnRes checkpoint, a source converted on the fly, or a plain source), what
`--train` marks trainable, the optimizer's parameter groups (the AttnRes parameters with a learning rate of their
own) and the learning-rate schedule.
"""

import torch
from peft import LoraConfig, get_peft_model
from torch import nn
from transformers import PreTrainedModel, get_scheduler
from transformers.integrations import is_deepspeed_zero3_enabled

from ..auto import ATTNRES_MODULES, is_attnres_parameter
from ..compat.deepspeed_private import full_shape
from ..conversion import attnres_config_for, convert_to_attnres
from ..errors import TrainingError
from ..modeling_attnres import AttnResForCausalLM
from ..options import DEFAULT_SOURCE, SCHEDULERS, TrainingConfig
from ..shrink import shrunk_config
from ..sources import load_source, load_source_config, resolve_source

LORA_TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAM_BETAS = (0.9, 0.95)


def model_location(config: TrainingConfig) -> tuple[str, str | None]:
    return resolve_source(config.model or DEFAULT_SOURCE, config.gguf_file)


def is_attnres(model: nn.Module) -> bool:
    return model.config.model_type == "attnres"


def load_model(config: TrainingConfig) -> PreTrainedModel:
    """The model to train, in float32 (mixed precision is Accelerate's autocast): AttnRes (with the installed classes,
    never the folder's copy), converted, built from the source's architecture with random weights (`--from-scratch`),
    shrunk with `--layers` and `--hidden-size` (`attnres.shrink`), or as is (a model that needs code of its own:
    `--trust-remote-code`)."""
    path, gguf_file = model_location(config)
    if not config.convert:
        return load_source(path, torch.float32, gguf_file, config.trust_remote_code)
    source_config = load_source_config(path, gguf_file, config.trust_remote_code)
    if source_config.model_type == "attnres":
        raise TrainingError(f"{path} is already an AttnRes model; drop --convert")
    if config.from_scratch:
        architecture = shrunk_config(source_config, config.layers, config.hidden_size)
        attnres_config = attnres_config_for(
            architecture, config.mode, config.block_size, exact_start=False, options=config.rule_options()
        )
        return AttnResForCausalLM(attnres_config).float()
    if is_deepspeed_zero3_enabled():  # set by the Accelerator: from_pretrained now partitions what it loads
        raise TrainingError(
            "--convert cannot read the source's weights once DeepSpeed ZeRO-3 has partitioned them: convert first "
            "(attnres convert SOURCE DIR), then train DIR without --convert"
        )
    return convert_to_attnres(
        path,
        config.mode,
        config.block_size,
        torch.float32,
        gguf_file,
        config.trust_remote_code,
        options=config.rule_options(),
    )


def make_trainable(model: PreTrainedModel, config: TrainingConfig) -> nn.Module:
    """Mark what `--train` trains: every weight, the AttnRes parameters only, or LoRA adapters plus AttnRes."""
    if config.train == "attnres":
        if not is_attnres(model):
            raise TrainingError("--train attnres needs an AttnRes model: pass an AttnRes checkpoint, or add --convert")
        for name, parameter in model.named_parameters():
            parameter.requires_grad_(is_attnres_parameter(name))
    elif config.train == "lora":
        lora_config = LoraConfig(
            task_type="CAUSAL_LM",
            r=config.lora_r,
            lora_alpha=config.lora_alpha,
            lora_dropout=config.lora_dropout,
            target_modules=LORA_TARGET_MODULES,
            modules_to_save=ATTNRES_MODULES if is_attnres(model) else None,
        )
        model = get_peft_model(model, lora_config)
    return model


def make_optimizer(model: nn.Module, config: TrainingConfig) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only, and the AttnRes parameters in a group of their own (`--attnres-lr`)."""
    groups = {"weights": [], "vectors": [], "attnres": []}
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            matrix = len(full_shape(parameter)) >= 2
            group = "attnres" if is_attnres_parameter(name) else "weights" if matrix else "vectors"
            groups[group].append(parameter)
    settings = group_settings(config)
    param_groups = [{"name": name, "params": params, **settings[name]} for name, params in groups.items() if params]
    return torch.optim.AdamW(param_groups, betas=ADAM_BETAS)


def group_settings(config: TrainingConfig) -> dict[str, dict[str, float]]:
    """Peak learning rate and weight decay of each parameter group."""
    return {
        "weights": {"lr": config.lr, "weight_decay": config.weight_decay},
        "vectors": {"lr": config.lr, "weight_decay": 0.0},
        "attnres": {"lr": config.attnres_lr, "weight_decay": 0.0},
    }


def apply_resumed_options(
    optimizer: torch.optim.Optimizer, scheduler: torch.optim.lr_scheduler.LambdaLR, config: TrainingConfig
) -> dict[str, list[float]]:
    """After a checkpoint restored the optimizer and the schedule as they were saved, set each group's peak learning
    rate and weight decay to `config`'s (the schedule's shape already follows `config`: its functions are made anew,
    not saved), so that a resumed run trains with the options it is given -> {group: [old peak lr, new peak lr]} for
    the groups whose settings changed."""
    settings, changed = group_settings(config), {}
    for index, group in enumerate(optimizer.param_groups):
        wanted = settings.get(group.get("name"))
        if wanted is None:  # a group an engine added (DeepSpeed's), which keeps what the checkpoint says
            continue
        if (scheduler.base_lrs[index], group["weight_decay"]) != (wanted["lr"], wanted["weight_decay"]):
            changed[group["name"]] = [scheduler.base_lrs[index], wanted["lr"]]
        scheduler.base_lrs[index] = group["initial_lr"] = wanted["lr"]
        group["weight_decay"] = wanted["weight_decay"]
        group["lr"] = wanted["lr"] * scheduler.lr_lambdas[index](scheduler.last_epoch)
    return changed


def make_scheduler(optimizer: torch.optim.Optimizer, config: TrainingConfig) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup, then cosine decay, a warmup-stable-decay schedule, or a constant rate, per optimizer step."""
    warmup_steps = config.max_steps // 20 if config.warmup_steps is None else config.warmup_steps
    specific = {
        "cosine": {"min_lr_rate": config.min_lr_ratio},
        "wsd": {
            "num_decay_steps": config.max_steps // 5 if config.decay_steps is None else config.decay_steps,
            "min_lr_ratio": config.min_lr_ratio,
        },
        "constant": {},
    }[config.lr_scheduler]
    return get_scheduler(
        SCHEDULERS[config.lr_scheduler],
        optimizer,
        num_warmup_steps=warmup_steps,
        num_training_steps=config.max_steps,
        scheduler_specific_kwargs=specific,
    )
