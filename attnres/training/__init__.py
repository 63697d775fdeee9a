"""Continued pretraining with Accelerate, from one CPU to a GPU cluster: `attnres train`.

Accelerate owns devices, processes, mixed precision, gradient accumulation, distribution (DDP, FSDP2, DeepSpeed: pick
one with `accelerate launch --config_file examples/accelerate/<kind>.yaml`) and checkpoint contents (`save_state` /
`load_state`). On top of that, continued pretraining of AttnRes needs:

- its own learning rate, without weight decay, for the AttnRes parameters (pseudo-queries and key norms): on a
  converted model they start at zero and must move much further than the pretrained weights around them;
- `--train attnres` (only those parameters) and `--train lora` (LoRA on the projections, AttnRes parameters in full);
- checkpoints that are complete or absent (written to a temporary folder, then renamed) and that resume exactly:
  model, optimizer, scheduler, RNG and the position in the data;
- held-out loss and the entropy of the depth weights per sublayer (how far each sublayer has moved from the uniform
  mixture it starts with), in `metrics.jsonl` and Accelerate's trackers;
- a non-finite loss stops the run before it reaches the weights; SIGTERM saves a checkpoint and stops.

    accelerate launch --config_file examples/accelerate/ddp.yaml -m attnres.training --output-dir out --convert
    ACCELERATE_USE_CPU=1 torchrun --nproc_per_node 2 -m attnres.training --output-dir out --convert   # CPUs

The rooms of this package, in the order a run meets them: `recipe` (the model, what trains, optimizer and schedule),
`batches` (packed data and the position in it), `engine` (the Accelerator and the distribution it runs),
`checkpoints` (checkpoints, metrics.jsonl and SIGTERM) and `loop` (the run: start, steps, evaluation, export).
The options are `attnres.options.TrainingConfig`.
"""

from ..errors import TrainingError
from ..options import TrainingConfig
from .batches import build_datasets
from .loop import TrainingResult, train, train_from_args

__all__ = [
    "TrainingConfig",
    "TrainingError",
    "TrainingResult",
    "build_datasets",
    "train",
    "train_from_args",
]
