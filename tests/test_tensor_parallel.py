"""Tensor and expert parallelism as the source family has them: `from_pretrained(folder, tp_plan="auto")` on 2 CPU ranks
(gloo, torchrun) shards an AttnRes model by its source's plans, and its logits, greedy tokens, loss and gradients equal
those of the whole model in one process. The depth-mix parameters, which no plan names, stay replicated; pipeline
stages are not offered (no `pp_plan`: stages would have to hand on the whole depth state)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny import attnres_twin, tiny_source_model

pytestmark = pytest.mark.slow  # the fast tier skips this file; CI runs it

RANKS = 2
LAUNCH_TIMEOUT = 420  # seconds: a rank that hangs fails the test instead of stalling the suite
FAMILIES = ("llama", "qwen3_moe", "gemma3_text")  # dense, mixture of experts (also expert-parallel), sliding window
LOGIT_TOLERANCE = 1e-5  # fp32: the row-wise layers' partial sums are all-reduced in another order (measured <= 2.4e-6)
GRADIENT_TOLERANCE = 5e-5  # measured <= 9.0e-6


@pytest.fixture(scope="module")
def sharded_against_whole(tmp_path_factory) -> dict:
    folders = []
    for family in FAMILIES:
        folder = tmp_path_factory.mktemp(family)
        attnres_twin(tiny_source_model(family, num_layers=4), seed=0, attnres_block_size=2).save_pretrained(folder)
        folders.append(str(folder))
    # --standalone: the ranks meet on a free local port of torchrun's choosing
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={RANKS}"]
    command += [str(Path(__file__).with_name("tensor_parallel_ranks.py")), *folders]
    ranks = subprocess.run(
        command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT
    )
    assert ranks.returncode == 0, ranks.stderr[-4000:]
    return json.loads(ranks.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("layout", [f"{family}-tensor" for family in FAMILIES] + ["qwen3_moe-expert"])
def test_a_sharded_model_computes_what_the_whole_one_does(sharded_against_whole, layout):
    result = sharded_against_whole[layout]
    assert result["tp_plan_rules"] >= 8, result  # the source's layer rules, the embedding and the head
    assert result["logit_diff"] <= LOGIT_TOLERANCE, result
    assert result["same_greedy_tokens"], result
    assert result["loss_diff"] <= LOGIT_TOLERANCE, result
    assert result["gradient_diff"] <= GRADIENT_TOLERANCE, result
    assert result["depth_parameters"] == 2 * 2 * 4 + 2 and result["depth_parameters_replicated"], result
    assert result["pp_plan_rules"] == 0, result
