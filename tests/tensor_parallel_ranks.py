"""One rank of tests/test_tensor_parallel.py (run under torchrun): each model folder loaded sharded by its source
family's plans, against the same folder loaded whole in this process. Rank 0 prints one JSON object.

Usage: python -m torch.distributed.run --nproc_per_node=2 tensor_parallel_ranks.py FOLDER...
"""

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import attnres  # noqa: F401  (registers the AttnRes classes)

PROMPT = (torch.arange(24).reshape(2, 12) * 7) % 90 + 3  # token ids of the tiny vocabulary


def whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def compare(sharded, single) -> dict:
    """Logits, greedy tokens, one training step's loss and gradients of the sharded model against the whole one."""
    with torch.no_grad():
        logits = (sharded(PROMPT).logits - single(PROMPT).logits).abs().max().item()
        greedy = [model.generate(PROMPT, max_new_tokens=8, do_sample=False) for model in (sharded, single)]
    losses, gradients = [], []
    for model in (sharded, single):
        model.train().zero_grad()
        loss = model(PROMPT, labels=PROMPT).loss
        loss.backward()
        losses.append(loss.item())
        gradients.append({name: whole(parameter.grad) for name, parameter in model.named_parameters()})
    depth_parameters = [parameter for name, parameter in sharded.named_parameters() if "_res_" in name]
    return {
        "tp_plan_rules": len(sharded.tp_plan),
        "pp_plan_rules": len(sharded.pp_plan),
        "logit_diff": logits,
        "same_greedy_tokens": torch.equal(*greedy),
        "loss_diff": abs(losses[0] - losses[1]),
        "gradient_diff": max((gradients[0][name] - gradients[1][name]).abs().max().item() for name in gradients[1]),
        "depth_parameters": len(depth_parameters),
        "depth_parameters_replicated": not any(isinstance(parameter, DTensor) for parameter in depth_parameters),
    }


def main(folders: list[str]) -> None:
    results = {}
    for folder in folders:
        single = AutoModelForCausalLM.from_pretrained(folder)
        layouts = {"tensor": {"tp_plan": "auto"}}
        if single.config.base_model_ep_plan:
            layouts["expert"] = {"distributed_config": DistributedConfig(tp_size=2, ep_size=2)}
        for layout, how in layouts.items():
            results[f"{single.config.text_config.model_type}-{layout}"] = compare(
                AutoModelForCausalLM.from_pretrained(folder, **how), single
            )
    if dist.get_rank() == 0:
        print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:])
