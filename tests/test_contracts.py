"""The contracts PyTorch and transformers users rely on, kept by the depth mix: any use of autograd, autocast,
torch.compile (fullgraph, static-cache decoding) and Accelerate's device maps (offloading, two devices)."""

import contextlib
from dataclasses import astuple

import pytest
import torch
from accelerate import dispatch_model
from tiny import attnres_twin, random_ids, tiny_source_model
from transformers import AutoModelForCausalLM

from attnres import depth_mix_backends, depth_mixing, depth_rules
from attnres.depth_mix_backends import depth_attention
from attnres.depth_mixing import DepthAttention, DepthState
from attnres.depth_rules import AttnResKeyNorm, AttnResPseudoQuery
from attnres.modeling_attnres import depth_mix_policy

MODES = ["block", "full"]


def small_model(mode: str, num_layers: int = 4, family: str = "llama"):
    return attnres_twin(
        tiny_source_model(family, num_layers=num_layers), seed=2, attnres_mode=mode, attnres_block_size=2
    )


def two_losses(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """A loss on the logits and one on the depth weights themselves (an entropy regulariser, say)."""
    out = model(ids, output_depth_weights=True)
    entropy = sum(-(w * w.clamp_min(1e-9).log()).sum(-1).mean() for w in out.depth_weights)
    return out.logits.float().square().mean(), entropy


def gradients(model) -> dict[str, torch.Tensor]:
    return {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_gradients_close(expected: dict, actual: dict, relative: float) -> None:
    assert expected.keys() == actual.keys() and any("_res_proj" in name for name in expected)
    for name in expected:
        scale = max(1.0, expected[name].abs().max().item())
        assert (expected[name] - actual[name]).abs().max().item() <= relative * scale, name


@pytest.mark.parametrize("mode", MODES)
def test_two_backward_passes_equal_one_backward_of_the_sum(mode, one_thread):
    model, ids = small_model(mode).train(), random_ids()
    logit_loss, depth_loss = two_losses(model, ids)
    logit_loss.backward(retain_graph=True)
    depth_loss.backward()
    separate = gradients(model)
    model.zero_grad()
    sum(two_losses(model, ids)).backward()
    assert_gradients_close(gradients(model), separate, 1e-5)


def hessian_vector_products(model, ids, implementation: str) -> list[torch.Tensor]:
    model.config.attnres_implementation = implementation
    parameters = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(sum(two_losses(model, ids)), parameters, create_graph=True)
    directions = [torch.randn(g.shape, generator=torch.Generator().manual_seed(i)) for i, g in enumerate(grads)]
    dot = sum((g * v).sum() for g, v in zip(grads, directions, strict=True))
    return torch.autograd.grad(dot, parameters, allow_unused=True)


@pytest.mark.parametrize("mode", MODES)
def test_double_backward_equals_direct_reference(mode, one_thread):
    model, ids = small_model(mode, num_layers=3).train(), random_ids(length=8)
    model.set_attn_implementation("eager")  # sdpa's CPU kernel has no double backward
    direct = hessian_vector_products(model, ids, "naive")
    two_phase = hessian_vector_products(model, ids, "two_phase")
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    checked = 0
    for name, expected, actual in zip(names, direct, two_phase, strict=True):
        if expected is None:
            assert actual is None or actual.abs().max() == 0, name
            continue
        scale = max(1.0, expected.abs().max().item())
        assert (expected - actual).abs().max().item() <= 1e-4 * scale, name
        checked += "_res_" in name
    assert checked >= 6  # the depth parameters' second derivatives are among those compared


def autocast_gradients(model, ids, implementation: str) -> torch.Tensor:
    model.config.attnres_implementation = implementation
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = sum(two_losses(model, ids))
    loss.backward()
    return torch.cat([g.flatten() for g in gradients(model).values()])


@pytest.mark.parametrize("mode", MODES)
def test_bf16_autocast_training_step_is_as_close_to_fp32_as_direct(mode, one_thread):
    model, ids = small_model(mode).train(), random_ids()
    model.config.attnres_implementation = "naive"
    sum(two_losses(model, ids)).backward()
    reference = torch.cat([g.flatten() for g in gradients(model).values()])
    errors = {
        implementation: ((autocast_gradients(model, ids, implementation) - reference).norm() / reference.norm()).item()
        for implementation in ("naive", "two_phase")
    }
    print(f"{mode}: bf16 autocast gradient error relative to fp32 {errors}")
    assert errors["two_phase"] <= 1.25 * errors["naive"] + 1e-3
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = model.model.layers[1].mlp_res_proj.weight.detach().clone()
    optimizer.step()
    assert not torch.equal(before, model.model.layers[1].mlp_res_proj.weight)


@pytest.mark.parametrize("implementation", ["two_phase", "naive"])
def test_depth_logits_and_softmax_stay_fp32_under_autocast(implementation):
    model = small_model("block")
    model.config.attnres_implementation = implementation
    generator = torch.Generator().manual_seed(0)
    completed = tuple(torch.randn(2, 5, 64, generator=generator) * 4 for _ in range(3))
    inv_rms = torch.rsqrt(torch.stack(completed, -2).square().mean(-1) + 1e-6)
    partial_sum = torch.randn(2, 5, 64, generator=generator) * 4
    pseudo_query, key_norm = AttnResPseudoQuery(64), AttnResKeyNorm(64, 1e-6)
    with torch.no_grad():
        pseudo_query.weight.normal_(generator=generator)
        key_norm.weight.uniform_(0.5, 1.5, generator=generator)

    def depth_weights():
        depth = DepthState(completed, inv_rms, partial_sum)
        policy = depth_mix_policy(model.config)
        head, options = (pseudo_query, key_norm), DepthAttention(eps=1e-6)
        return depth_attention(depth, head, options, lambda mixed: mixed, None, policy)[1]

    plain = depth_weights()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = depth_weights()
        returned = model(random_ids(), output_depth_weights=True).depth_weights
    assert autocast.dtype == torch.float32 and all(w.dtype == torch.float32 for w in returned)
    assert (plain - autocast).abs().max().item() <= 1e-6
    assert plain.std(-1).min() > 1e-2  # the weights are far from uniform: bf16 logits would move them


def test_offloaded_device_map_gives_the_plain_logits(tmp_path):
    model = small_model("block", num_layers=4)
    model.save_pretrained(tmp_path / "model")
    ids = random_ids()
    with torch.no_grad():
        expected = model(ids).logits
        size = sum(p.numel() * p.element_size() for p in model.parameters())
        offloaded = AutoModelForCausalLM.from_pretrained(
            tmp_path / "model",
            device_map="auto",
            max_memory={"cpu": size // 2},
            offload_folder=str(tmp_path / "offload"),
        )
        placement = set(offloaded.hf_device_map.values())
        assert "disk" in placement, offloaded.hf_device_map  # some layers really live on disk
        logits = offloaded(ids).logits
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)


# What a device map places in a 4-layer model (each decoder layer whole: `_no_split_modules`), over two devices that
# refuse each other's tensors, the CPU and torch's lazy tensor device (which computes on the CPU), and the disk
SPREAD_OVER_TWO_DEVICES_AND_DISK = {
    "model.embed_tokens": "disk",
    "model.rotary_emb": "lazy",
    "model.layers.0": "cpu",
    "model.layers.1": "lazy",
    "model.layers.2": "disk",
    "model.layers.3": "lazy",
    "model.output_attn_res_proj": "disk",
    "model.output_attn_res_norm": "lazy",
    "model.norm": "disk",
    "lm_head": "disk",  # tied to the embedding
}


@pytest.fixture(scope="module")
def lazy_device() -> None:
    """torch's lazy tensor device, set up once per process."""
    pytest.importorskip("torch._lazy.ts_backend").init()


@pytest.mark.parametrize(
    "device_map, parameter_devices, implementation",
    [
        (SPREAD_OVER_TWO_DEVICES_AND_DISK, {"cpu", "lazy", "meta"}, "two_phase"),
        (SPREAD_OVER_TWO_DEVICES_AND_DISK, {"cpu", "lazy", "meta"}, "naive"),
        (dict.fromkeys(SPREAD_OVER_TWO_DEVICES_AND_DISK, "disk"), {"meta"}, "two_phase"),
    ],
    ids=["cpu-lazy-disk", "cpu-lazy-disk-naive", "all-on-disk"],
)
@pytest.mark.usefixtures("lazy_device")
def test_each_module_reads_only_its_arguments_and_parameters(
    device_map, parameter_devices, implementation, tmp_path, monkeypatch
):
    """Accelerate's hooks move the arguments of a module call to the module's device, and bring an offloaded module's
    parameters from the meta device for its own call only (each module with parameters on its own, the pseudo-queries
    and key norms included). A module that read another's parameter, or a tensor that reached it other than as an
    argument, fails here; so does the output mix unless it brings its pseudo-query (on disk) and key norm to the last
    layer's sources."""
    for module in (depth_mixing, depth_mix_backends, depth_rules):  # autocast: no lazy
        monkeypatch.setattr(module, "fp32_region", lambda like: contextlib.nullcontext())
    model, ids = small_model("block", num_layers=4), random_ids()
    model.config.attnres_implementation = implementation
    with torch.no_grad():
        expected = model(ids).logits
        dispatch_model(model, device_map, main_device="cpu", offload_dir=str(tmp_path))  # disk: runs on the CPU
        assert {parameter.device.type for parameter in model.parameters()} == parameter_devices
        logits = model(ids).logits
    print(f"max logit difference {(logits - expected).abs().max().item():.1e}")
    # The lazy device runs TorchScript's CPU kernels, whose float32 rounding differs from eager's by about 1e-6 (1.1e-6
    # on one AVX2 CPU); all on disk computes as eager does, to the bit. A misread tensor errs by far more.
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


@pytest.mark.slow  # torch.compile: 10 to 30 s a case
@pytest.mark.parametrize(
    "mode, recompute, compiled_mix",
    [("block", False, "inline"), ("full", False, "inline"), ("block", True, "inline"), ("block", False, "operator"),
     ("full", True, "operator")],
)  # fmt: skip
def test_compiled_fullgraph_forward_and_training_step_equal_eager(mode, recompute, compiled_mix, one_thread):
    torch._dynamo.reset()
    model, ids = small_model(mode, num_layers=3).train(), random_ids()
    model.config.attnres_recompute = recompute
    model.config.attnres_compiled_mix = compiled_mix
    compiled = torch.compile(model, fullgraph=True)
    eager_out = model(ids, labels=ids)
    eager_out.loss.backward()
    eager = gradients(model)
    model.zero_grad()
    compiled_out = compiled(ids, labels=ids)
    compiled_out.loss.backward()
    assert (eager_out.logits - compiled_out.logits).abs().max().item() <= 1e-5
    assert_gradients_close(eager, gradients(model), 1e-5)


def mix_operator_inputs(num_blocks: int, partial: bool, dtype=torch.float64, backend="two_phase", **options) -> tuple:
    """Inputs of `depth_mix_operator`: random depth state and head parameters, and the settings."""
    generator = torch.Generator().manual_seed(num_blocks)

    def random(*shape):
        return torch.randn(*shape, generator=generator, dtype=dtype).requires_grad_()

    attention = DepthAttention(1e-6, **options)
    shapes = {"proj": (1, 8), "query_proj": (8, 8), "norm": (8,), "logits": (num_blocks + partial,)}
    parameters = [random(*shapes[part]) for part in attention.parts]
    completed_inv_rms = (torch.rand(2, 3, num_blocks, generator=generator, dtype=dtype) + 0.5).requires_grad_()
    blocks = [random(2, 3, 8) for _ in range(num_blocks)]
    return blocks, completed_inv_rms, random(2, 3, 8) if partial else None, parameters, *astuple(attention), \
        backend, True  # fmt: skip


MIX_OPERATOR_CASES = {
    "block": (3, True, {}),
    "embedding only": (1, False, {}),
    "reference": (2, True, {"backend": "naive"}),
    "scalars": (2, True, {"query": "scalars"}),
    "projected, sigmoid, heads, no key norm": (
        2, True, {"query": "projected", "score": "sigmoid", "heads": 2, "key_norm": False},
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", MIX_OPERATOR_CASES)
def test_the_depth_mix_operator_of_compiled_training_is_the_mix_with_autograds_gradients(case, one_thread):
    """Compiled training runs each depth mix as one operator (the compiler does not fuse it into kernels of its own):
    its registrations pass PyTorch's own check, and its output and gradients are those eager autograd gives for the
    same mix, to float64 rounding."""
    num_blocks, partial, options = MIX_OPERATOR_CASES[case]
    inputs = mix_operator_inputs(num_blocks, partial, **options)
    checks = torch.library.opcheck(
        depth_mix_backends.depth_mix_operator, mix_operator_inputs(num_blocks, partial, **options)
    )
    assert set(checks.values()) == {"SUCCESS"}, checks
    blocks, inv_rms, partial_sum, parameters, *settings = inputs
    leaves = [*blocks, inv_rms, *([partial_sum] if partial else []), *parameters]
    outputs = [
        depth_mix_backends.depth_mix_operator(*inputs),
        depth_mix_backends.mix_of_tensors(blocks, inv_rms, partial_sum, parameters, *settings),
    ]
    mixed, weights = outputs[0]
    cotangents = (torch.randn_like(mixed), torch.randn_like(weights))
    via_operator, eager = (torch.autograd.grad(output, leaves, cotangents, allow_unused=True) for output in outputs)
    for actual, expected in zip((*outputs[0], *via_operator), (*outputs[1], *eager), strict=True):
        expected = torch.zeros_like(actual) if expected is None else expected  # an input the mix does not read
        torch.testing.assert_close(actual, expected, rtol=1e-12, atol=1e-12)


def test_compiled_training_graph_calls_the_operator_once_per_mix(one_thread):
    """With `attnres_compiled_mix="operator"`, every depth mix of a compiled training step is one operator call (2 per
    layer, plus the output's); compiled inference keeps the mix inline, where the compiler fuses it into few kernels
    for decoding, and so does the default, "inline", in training."""
    torch._dynamo.reset()
    model, ids = small_model("full", num_layers=3).train(), random_ids()
    model.config.attnres_compiled_mix = "operator"
    graphs = []

    def recording_backend(graph_module, example_inputs):
        graphs.append([node.target for node in graph_module.graph.nodes])
        return graph_module.forward

    compiled = torch.compile(model, fullgraph=True, backend=recording_backend)
    compiled(ids, labels=ids).loss.backward()
    with torch.no_grad():
        compiled(ids)
    operator = getattr(torch.ops, depth_mix_backends.OPERATOR_NAMESPACE).depth_mix.default
    model.config.attnres_compiled_mix = "inline"
    compiled(ids, labels=ids).loss.backward()
    training, inference, inline_training = graphs
    assert training.count(operator) == 2 * 3 + 1
    assert operator not in inference and operator not in inline_training


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("mode", MODES)
def test_static_cache_compiled_generation_equals_eager(mode, one_thread):
    torch._dynamo.reset()
    model, prompt = small_model(mode, num_layers=3).eval(), random_ids(batch=1, length=6)
    settings = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    eager_tokens = model.generate(prompt, **settings)
    model.forward = torch.compile(model.forward, fullgraph=True)
    compiled_tokens = model.generate(prompt, cache_implementation="static", **settings)
    assert torch.equal(eager_tokens, compiled_tokens)
