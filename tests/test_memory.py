"""Activation memory in every precision users train in: the bytes autograd keeps for the backward pass (counted through
`saved_tensors_hooks`, so deterministic and device-independent: not a timed test), AttnRes against its source, and
the recomputing settings that reach those bounds give the gradients of the plain model."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch
from tiny import attnres_twin, random_ids, tiny_source_model

from attnres import depth_mixing

OVERHEAD = Path(__file__).resolve().parents[1] / "benchmarks" / "overhead.py"


def load_overhead():
    spec = importlib.util.spec_from_file_location("overhead", OVERHEAD)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("overhead", module)
    spec.loader.exec_module(module)
    return module


overhead = load_overhead()

# AttnRes / source saved bytes, at most: (Block, Full). Full keeps every sublayer output as a source, so under
# gradient checkpointing (where the source keeps only each layer's input) its floor is about 2x.
BOUNDS = {
    "plain": (1.15, 1.30),
    "gradient checkpointing": (1.10, 2.2),
    "gradient checkpointing (reentrant)": (1.10, 2.2),
    "attnres_recompute": (1.05, 1.10),
}


# The mix reads its blocks stacked below `LARGEST_STACKED_BLOCK` elements (1 x 64 tokens of d=256) and one by one
# above it (2 x 256), recomputed only where it copies them: both paths stay within the bounds at 8 layers, and the
# stacked one, which copies, at 32 (15-20 s each; at 2 x 256 a minute or more each, so not there). The fast tier keeps
# the stacked path at 8 layers: the per-block one takes 25 s a case on an idle core, most of the tier's time.
@pytest.mark.parametrize(
    "num_layers, tokens",
    [
        (8, (1, 64)),
        pytest.param(8, (2, 256), marks=pytest.mark.slow),
        pytest.param(32, (1, 64), marks=pytest.mark.slow),
    ],
    ids=["8-stacked", "8-per-block", "32-stacked"],
)
@pytest.mark.parametrize("precision", list(overhead.PRECISIONS))
@pytest.mark.parametrize("setting", list(BOUNDS))
def test_saved_activations_stay_flat_in_depth(setting, precision, num_layers, tokens, one_thread):
    assert depth_mixing.stacks((torch.empty(*tokens, 256),)) == (tokens == (1, 64))
    for mode, bound in zip(("block", "full"), BOUNDS[setting], strict=True):
        ratio = overhead.saved_memory_ratio(num_layers, mode, precision, setting, tokens=tokens)
        print(f"{setting}, {precision}, {mode}, {num_layers} layers, {tokens}: {ratio:.3f} (bound {bound})")
        assert ratio <= bound, (mode, ratio)


def training_gradients(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    output = model(ids, labels=ids, output_depth_weights=True)
    entropy = sum(-(w * w.clamp_min(1e-9).log()).sum(-1).mean() for w in output.depth_weights)
    (output.loss + entropy).backward()
    return output.logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("mode", ["block", "full"])
@pytest.mark.parametrize(
    "setting", ["attnres_recompute", "gradient checkpointing", "gradient checkpointing (reentrant)"]
)
def test_recomputing_changes_nothing_but_memory(mode, setting, one_thread):
    model = attnres_twin(tiny_source_model("llama", num_layers=4), seed=1, attnres_mode=mode, attnres_block_size=2)
    model.train()
    ids = random_ids()
    plain_logits, plain_grads = training_gradients(model, ids)
    if setting == "attnres_recompute":
        model.config.attnres_recompute = True  # read at forward time, like use_cache
    else:
        model.activation_checkpointing_enable({"use_reentrant": setting.endswith("(reentrant)")})
    logits, grads = training_gradients(model, ids)
    assert torch.equal(logits, plain_logits)
    assert grads.keys() == plain_grads.keys() and any("_res_proj" in name for name in grads)
    for name, grad in grads.items():
        assert (grad - plain_grads[name]).abs().max().item() <= 1e-6 * max(1.0, grad.abs().max().item()), name


def test_recomputed_mix_keeps_retain_graph_and_double_backward(one_thread):
    """Two backward passes over one graph, and a gradient penalty (double backward), through the recomputed mix and
    norm: the same second derivatives as without recomputation."""
    model = attnres_twin(tiny_source_model("llama", num_layers=2), seed=1, attnres_block_size=1)
    model.set_attn_implementation("eager")  # sdpa's CPU kernel has no double backward
    ids = random_ids()
    query = model.model.layers[1].mlp_res_proj.weight
    penalty_gradients = []
    for recompute in (False, True):
        model.config.attnres_recompute = recompute
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward(retain_graph=True)
        once = {name: p.grad.clone() for name, p in model.named_parameters()}
        loss.backward()
        for name, p in model.named_parameters():
            torch.testing.assert_close(p.grad, 2 * once[name], rtol=1e-5, atol=1e-7)
        (gradient,) = torch.autograd.grad(model(ids, labels=ids).loss, query, create_graph=True)
        penalty_gradients.append(torch.autograd.grad(gradient.square().sum(), query)[0])
    assert penalty_gradients[0].abs().sum() > 0
    torch.testing.assert_close(penalty_gradients[1], penalty_gradients[0], rtol=1e-5, atol=1e-8)
