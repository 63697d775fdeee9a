"""The Accelerator of a run and the distribution it runs: the engine asked for (DDP, FSDP2, DeepSpeed ZeRO-3) or a
`TrainingError` that says why it cannot run, set up on CPU processes too, where Accelerate would fall back to DDP;
how the prepared model is spread; and, for export, the model as it was before FSDP2 sharded it.

Accelerate has no public way to run FSDP or DeepSpeed on CPU processes: what this sets of its internals is in
compat/accelerate_private.py, and tests/test_distributed.py pins what that rests on.
"""

import os
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.tracking import get_available_trackers
from accelerate.utils import (
    DataLoaderConfiguration,
    DistributedType,
    FullyShardedDataParallelPlugin,
    GradientAccumulationPlugin,
    InitProcessGroupKwargs,
    LoggerType,
    ProjectConfiguration,
    is_deepspeed_available,
    parse_flag_from_env,
)
from torch import nn
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel

from ..compat.accelerate_private import hand_fsdp_to_state, leave_device_to_deepspeed
from ..compat.deepspeed_private import zero3_share
from ..compat.torch_private import raise_recompile_limit
from ..errors import TrainingError
from ..options import TrainingConfig


def resolve_mixed_precision(choice: str) -> str | None:
    """`auto`: what `accelerate launch` was configured with, else bf16 where the GPU supports it, else fp32."""
    if choice != "auto":
        return choice
    if "ACCELERATE_MIXED_PRECISION" in os.environ:
        return None  # the Accelerator reads it
    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "no"


# How the error messages name Accelerate's distributed types
ENGINE_NAMES = {
    DistributedType.FSDP: "FSDP",
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.NO: "one process alone",
    DistributedType.MULTI_CPU: "DDP over CPU processes",
    DistributedType.MULTI_GPU: "DDP over GPUs",
}


def requested_engine() -> DistributedType | None:
    """FSDP or DeepSpeed where `accelerate launch` (from its config file) or the environment asks for one, else None."""
    if parse_flag_from_env("ACCELERATE_USE_DEEPSPEED"):
        return DistributedType.DEEPSPEED
    if parse_flag_from_env("ACCELERATE_USE_FSDP"):
        return DistributedType.FSDP
    return None


def check_trackers(report_to: list[str]) -> None:
    """`TrainingError` for a `--report-to` name that is not one of Accelerate's trackers (its `LoggerType`, less "all",
    which would log to whatever is installed), or that names one whose package is not installed."""
    trackers = [tracker.value for tracker in LoggerType if tracker is not LoggerType.ALL]
    unknown = [name for name in report_to if name not in trackers]
    if unknown:
        raise TrainingError(f"--report-to {' '.join(unknown)}: not a tracker of Accelerate; pass {', '.join(trackers)}")
    unavailable = [name for name in report_to if LoggerType(name) not in get_available_trackers()]
    if unavailable:
        raise TrainingError(f"--report-to {' '.join(unavailable)}: pip install {' '.join(unavailable)}, or drop it")


def make_accelerator(config: TrainingConfig) -> Accelerator:
    """The Accelerator of this process, running the engine that was asked for or stopping with a `TrainingError`.

    Accelerate enables FSDP and DeepSpeed only on GPUs (and other accelerators); on CPUs it would quietly train the
    processes as DDP instead. Both engines run on CPU processes over gloo all the same, so there this process sets them
    up: DeepSpeed through Accelerate's own path (with DeepSpeed's CPU accelerator), which needs Accelerate not to be
    told to use the CPU; FSDP2 by handing Accelerate's multi-CPU state the FSDP plugin (`shard_with_fsdp2`).
    """
    engine = requested_engine()
    if engine is DistributedType.DEEPSPEED and not is_deepspeed_available():
        raise TrainingError('DeepSpeed was asked for (ACCELERATE_USE_DEEPSPEED=true): pip install "attnres[deepspeed]"')
    placement: dict[str, Any] = {}
    if not torch.accelerator.is_available():
        if engine is DistributedType.DEEPSPEED and "LOCAL_RANK" in os.environ:  # started by a launcher
            leave_device_to_deepspeed()
            placement["kwargs_handlers"] = [InitProcessGroupKwargs(backend="gloo")]
        else:
            placement["cpu"] = True  # launched processes train together over gloo, without ACCELERATE_USE_CPU=1
    output_dir = Path(config.output_dir)
    accelerator = Accelerator(
        mixed_precision=resolve_mixed_precision(config.mixed_precision),
        # Steps are counted in optimizer steps across epochs: the end of an epoch does not cut an accumulation short.
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=config.grad_accum, sync_with_dataloader=False
        ),
        dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True, data_seed=config.seed),
        log_with=config.report_to or None,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        **placement,
    )
    if engine is DistributedType.FSDP and accelerator.distributed_type is DistributedType.MULTI_CPU:
        shard_with_fsdp2(accelerator)
    if accelerator.distributed_type is DistributedType.FSDP and accelerator.mixed_precision != "no":
        keep_depth_state_precise(accelerator.state.fsdp_plugin)
    # Launched processes on an accelerator that Accelerate does not train across (MPS, say) would each run alone
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > accelerator.num_processes:
        raise TrainingError(
            f"{world_size} processes were launched, but each runs alone (Accelerate cannot join them on "
            f"{accelerator.device}): set ACCELERATE_USE_CPU=1 to train across CPU processes"
        )
    if engine is not None and accelerator.distributed_type is not engine:
        launch = "started by a launcher" if "WORLD_SIZE" in os.environ else "not started by a launcher"
        raise TrainingError(
            f"{ENGINE_NAMES[engine]} was asked for (ACCELERATE_USE_{engine.value}=true), but this process ({launch}, "
            f"ACCELERATE_USE_CPU={os.environ.get('ACCELERATE_USE_CPU', 'unset')}) would train as "
            f"{ENGINE_NAMES.get(accelerator.distributed_type, accelerator.distributed_type.value)} on "
            f"{accelerator.device}. Start the processes with `accelerate launch --config_file "
            "examples/accelerate/<fsdp2 or deepspeed_zero3>.yaml -m attnres.training ...` (where there are GPUs, "
            "without ACCELERATE_USE_CPU=1), or choose examples/accelerate/ddp.yaml for data parallel."
        )
    return accelerator


def shard_with_fsdp2(accelerator: Accelerator) -> None:
    """Let Accelerate prepare, clip, checkpoint and gather the model with FSDP2 over this multi-CPU (gloo) group.

    Accelerate keeps FSDP for GPUs (state.py enables it for MULTI_GPU and the like only), yet its FSDP2 code is device
    independent and `fully_shard` runs over gloo: the state gets the plugin that `accelerate launch` described in the
    environment (FSDP_* variables), as it would on GPUs.
    """
    plugin = FullyShardedDataParallelPlugin()
    if plugin.fsdp_version != 2:
        raise TrainingError("on CPU processes attnres train shards with FSDP2 only: set fsdp_version: 2")
    if accelerator.mixed_precision != "no":
        plugin.set_mixed_precision(accelerator.mixed_precision)
    hand_fsdp_to_state(accelerator, plugin)


def allow_a_graph_per_layer(accelerator: Accelerator, num_layers: int) -> None:
    """Let Accelerate's regional compilation (`dynamo_config: use_regional_compilation`) compile every AttnRes layer.

    It compiles each decoder layer on its own, and AttnRes layers differ (each reads its own number of sources), so
    dynamo traces one graph per distinct layer: more than its `recompile_limit` of 8 in a model of 8 blocks or more.
    Past the limit it fails under fullgraph and leaves the remaining layers uncompiled otherwise. Compiling the model
    whole makes one graph and needs nothing.
    """
    if accelerator.state.dynamo_plugin.use_regional_compilation:
        raise_recompile_limit(2 * num_layers + 8)


def keep_depth_state_precise(plugin: FullyShardedDataParallelPlugin) -> None:
    """FSDP2 mixed precision that leaves the depth state between decoder layers as the layers made it.

    Accelerate's FSDP2 policy casts every floating input of every unit to the compute dtype and reduces gradients in
    it. The inverse RMS of the completed sources crosses layers in fp32 for the depth softmax; cast to bf16 it moved
    the loss of a 3-step bf16 run on 2 CPU ranks 5e-2 from one process (7.7e-3 without the cast, fp32 gradient
    reduction; DDP 1.2e-3). The layers' other inputs already come out of bf16 modules, so nothing else changes.
    """
    if plugin.fsdp_version != 2:
        return
    policy = plugin.mixed_precision_policy
    plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=policy.param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False
    )


def distribution(accelerator: Accelerator, model: nn.Module) -> dict[str, Any]:
    """How the prepared model is actually spread: engine, processes, device, and the share of the weights held here."""
    kind = accelerator.distributed_type
    zero3 = kind is DistributedType.DEEPSPEED and accelerator.state.deepspeed_plugin.zero_stage == 3
    if kind is DistributedType.FSDP:
        engine = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    elif kind is DistributedType.DEEPSPEED:
        engine = f"DeepSpeed ZeRO-{accelerator.state.deepspeed_plugin.zero_stage}"
    else:
        engine = "DDP" if accelerator.num_processes > 1 else "single process"
    held = whole = 0
    for parameter in model.parameters():
        if isinstance(parameter, DTensor):  # FSDP2: this process's shard
            held, whole = held + parameter.to_local().numel(), whole + parameter.numel()
        elif zero3:  # this process's partition, or all of a small ("persistent") parameter
            held_here, in_all = zero3_share(parameter)
            held, whole = held + held_here, whole + in_all
        else:
            held, whole = held + parameter.numel(), whole + parameter.numel()
    return {
        "engine": engine,
        "world_size": accelerator.num_processes,
        "device": accelerator.device.type,
        "backend": accelerator.state.backend,
        "mixed_precision": accelerator.mixed_precision,
        "parameter_share": round(held / whole, 4),  # of the model's parameters, held by each process
    }


def unsharded_twin(model: FSDPModule, state_dict: dict[str, torch.Tensor]) -> PreTrainedModel:
    """A model of the class `model` had before FSDP2 sharded it, holding the gathered `state_dict`, to save.

    `fully_shard` gives the model a subclass of its own (`FSDPAttnResForCausalLM`, defined in torch): saved as is, the
    config would name that class and the folder would ship torch's FSDP files as remote code, not modeling_attnres.py.
    The gathered weights are separate tensors, so the twin ties them again (one embedding in the file, not two).
    """
    model_class = next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))
    with torch.device("meta"):
        twin = model_class(model.config)
    twin.load_state_dict(state_dict, assign=True)
    twin.tie_weights()
    return twin
