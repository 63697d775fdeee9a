"""The hybrid families (recurrent token mixers between attention layers): what their recurrent states add to the
checks every family gets in test_families.py. Padding reaches the recurrent mixers through their 2D masks; a static
cache compiles; assisted decoding works, or is refused, as for the source."""

import pytest
import torch
from test_families import perturbed_source
from tiny import (
    attnres_twin,
    family_params,
    hybrid_families,
    random_ids,
    recurrent_layer_types,
    tiny_source_config,
    tiny_source_model,
)

from attnres.families import FAMILIES, SUPPORTED_FAMILIES

HYBRIDS = hybrid_families()
# The one-branch families beside the hybrids (Nemotron-H is both): attention and MLP in parallel on one depth mix
ONE_BRANCH = [
    family
    for family in SUPPORTED_FAMILIES
    if FAMILIES[family].has_one_branch(tiny_source_config(family, num_layers=2)) and family not in HYBRIDS
]
GREEDY = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)


def test_the_tiny_hybrids_alternate_recurrent_and_attention_layers():
    """Layer 0 holds a recurrent mixer, layer 1 attention; Falcon-H1's every layer holds both, in parallel."""
    assert len(HYBRIDS) == 10, HYBRIDS
    for family in HYBRIDS:
        layer_types = tiny_source_config(family, num_layers=2).layer_types
        mixers = [FAMILIES[family].mixers(kind) for kind in layer_types]
        assert recurrent_layer_types(family, layer_types)[:1] == layer_types[:1], (family, layer_types)
        assert "full_attention" in {mixer.mask for mixer in mixers[1]}, (family, layer_types)


@pytest.mark.parametrize("family", family_params(HYBRIDS + ONE_BRANCH, fast=("bamba", "gpt_neox")))
def test_left_padded_batch_matches_single_prompts_and_the_source(family):
    """Left padding reaches the recurrent mixers as their 2D mask (Falcon-H1's beside its attention's 4D mask): each
    padded row generates what the prompt alone does, and what the source generates for the batch. Prompts outrun
    every convolution window (4 tokens). The one-branch families too: their attention and MLP read one depth mix."""
    source = perturbed_source(family, num_layers=2)
    model = attnres_twin(source, attnres_block_size=1, attnres_scale_by_num_sources=True)
    prompts = [random_ids(batch=1, length=n, seed=n)[0] for n in (5, 9, 12)]
    width = max(len(prompt) for prompt in prompts)
    ids, mask = torch.zeros(len(prompts), width, dtype=torch.long), torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :], mask[row, width - len(prompt) :] = prompt, 1
    batched = model.generate(ids, attention_mask=mask, **GREEDY)[:, width:]
    assert torch.equal(batched, source.generate(ids, attention_mask=mask, **GREEDY)[:, width:])
    for row, prompt in enumerate(prompts):
        assert torch.equal(batched[row], model.generate(prompt[None], **GREEDY)[0, len(prompt) :]), row


@pytest.mark.slow  # torch.compile: 10 to 30 s a case
@pytest.mark.parametrize("family", ["lfm2", "bamba", "nemotron_h", "olmo_hybrid", "falcon_h1"])
def test_static_cache_compiled_generation_equals_eager(family, one_thread):
    """The hybrids' sources compile with a static cache (`_can_compile_fullgraph`; Falcon-H1's says it cannot, from
    before transformers' static caches had hybrid layers, and under 5.25 compiles to its eager tokens all the same);
    so does the AttnRes model, with trained (random) depth parameters, giving the eager tokens."""
    torch._dynamo.reset()
    model, prompt = attnres_twin(perturbed_source(family, num_layers=2), seed=2), random_ids(batch=1, length=7)
    eager_tokens = model.generate(prompt, **GREEDY)
    model.forward = torch.compile(model.forward, fullgraph=True)
    assert torch.equal(model.generate(prompt, cache_implementation="static", **GREEDY), eager_tokens)


@pytest.mark.parametrize("family", ["llama", "lfm2", "bamba"])
def test_assisted_generation_works_or_is_refused_as_for_the_source(family):
    """Assisted decoding steps the recurrent states back to the last accepted token: transformers 5.25 records and
    rolls them back, where earlier releases refuse a stateful model. The model does what its source does: refuses
    with the source's error, or generates with itself as assistant exactly its own greedy tokens."""
    source = tiny_source_model(family, num_layers=2)
    model, prompt = attnres_twin(source), random_ids(batch=1, length=7)
    try:
        source.generate(prompt, assistant_model=source, **GREEDY)
    except ValueError as refusal:
        assert "stateful" in str(refusal)
        with pytest.raises(ValueError, match="assisted generation is not supported with stateful models"):
            model.generate(prompt, assistant_model=model, **GREEDY)
    else:
        assert torch.equal(model.generate(prompt, assistant_model=model, **GREEDY), model.generate(prompt, **GREEDY))
