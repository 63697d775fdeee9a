"""The depth-mix backends: one signature on plain tensors, chosen by name (`attnres_implementation`), as transformers
chooses attention functions; and how a mix is run around its backend (`DepthMixPolicy`: recomputed in backward, or one
opaque operator for compiled training), applied from outside the math.

    backend(depth, learned, options, scale_by_num_sources, block_logits) -> mixed input [B,T,d], depth weights [B,T,S]

`naive` (depth_mixing.py's `depth_mix_reference`) is the reference every other backend is tested against; `two_phase`
is paper Algorithm 1; `fla` is flash-linear-attention's fused Triton kernel (`fla.ops.attnres.fused_attnres`) where it
is installed and the tensors are on a GPU. Shapes as in depth_mixing.py. Copied next to the weights as remote code: it
imports only torch, the standard library and depth_mixing.py (fla only inside its backend, when that one runs).
"""

import re
from collections.abc import Callable
from dataclasses import astuple
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from .depth_mixing import (
    PARAMETER_OF_PART,
    DepthAttention,
    DepthParameters,
    DepthState,
    cast,
    completed_logits,
    depth_mix_reference,
    depth_mix_two_phase,
    folded_queries,
    fp32_or_wider,
    fp32_region,
    reads_copies,
    stacked_if_small,
    sublayer_query,
)


def fused_attnres_for(device: torch.device) -> Callable:
    """flash-linear-attention's fused AttnRes kernel, `fla.ops.attnres.fused_attnres`, for tensors on `device`, or an
    error that says what is missing. Imported here, when the `fla` backend runs: fla is optional, and its kernels are
    Triton's, which run on a GPU only."""
    if device.type == "cpu":
        raise RuntimeError(
            "attnres_implementation='fla' runs flash-linear-attention's Triton kernel, which needs the model on a GPU; "
            "this depth state is on the CPU. Set model.config.attnres_implementation = 'two_phase' there."
        )
    try:
        from fla.ops.attnres import fused_attnres
    except ImportError as missing:
        raise ImportError(
            f"attnres_implementation='fla' needs flash-linear-attention with Triton ({missing}): "
            "`pip install flash-linear-attention`, or set model.config.attnres_implementation = 'two_phase'."
        ) from missing
    return fused_attnres


def depth_mix_fla(
    depth: DepthState,
    learned: DepthParameters,
    options: DepthAttention,
    scale_by_num_sources: bool,
    block_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The paper's mix by flash-linear-attention's fused kernel: key norm, scores, softmax and weighted sum in one pass
    over the sources, with a backward of its own that keeps per token only scalars and recomputes the rest. It runs the
    paper's AttnRes only (a pseudo-query, softmax, normalised keys, one depth head: the configuration refuses the other
    ablations with it), scores every source itself (`block_logits` is not read), and its depth weights carry no
    gradient (fla marks them so): a loss on them needs another backend. -> mixed input [B,T,d] in the sources' dtype,
    depth weights [B,T,S] fp32"""
    sources = depth.sources()
    fused_attnres = fused_attnres_for(sources[0].device)
    with fp32_region(sources[0]):
        mixed, weights = fused_attnres(
            learned.pseudo_query.flatten(), sources, learned.key_gain, rms_eps=options.eps, return_weights=True
        )  # [B,T,d], [S,B,T]
    # fla reads the mean where the queries are zero; the exact start reads the plain sum (as `SCORES` scales)
    mixed = mixed * len(sources) if scale_by_num_sources else mixed
    return mixed, cast(weights.movedim(0, -1), fp32_or_wider(sources[0].dtype))


# The depth-mix backends by name, as transformers' ALL_ATTENTION_FUNCTIONS holds attention functions. One signature:
#     backend(depth, learned, options, scale_by_num_sources, block_logits) -> mixed input [B,T,d], weights [B,T,S]
# `naive` is the reference each other backend is tested against (a fused kernel plugs in as one more entry, with
# its name in the configuration's IMPLEMENTATIONS). How a mix is run, recomputed or wrapped in one operator for
# compiled training, is `DepthMixPolicy`'s, applied around the backend by `depth_attention`.
DEPTH_MIX_BACKENDS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "naive": depth_mix_reference,
    "two_phase": depth_mix_two_phase,
    "fla": depth_mix_fla,
}


class DepthMixPolicy(NamedTuple):
    """How the depth mixes of one forward run, read from the config at every forward (see the model's
    `depth_mix_policy`)."""

    backend: str  # a key of DEPTH_MIX_BACKENDS
    scale_by_num_sources: bool  # zero logits read the plain sum of the sources (exact conversion)
    recompute: bool  # the mix and the sublayer's input norm recomputed in backward, not kept
    one_operator: bool  # the mix runs as `depth_mix_operator` (compiled training, where the config asks for it)

    @property
    def shares_phase_one(self) -> bool:
        """Whether a layer scores its sublayers' queries against the completed blocks once, before they run: the
        two-phase backend run inline (one operator runs both phases inside itself)."""
        return self.backend == "two_phase" and not self.one_operator


def recomputed(
    function: Callable[..., tuple | torch.Tensor], *inputs: torch.Tensor | None, keeps_copies: bool = True
) -> tuple | torch.Tensor:
    """`function(*inputs)`, whose intermediates autograd does not keep but recomputes in the backward pass, where it
    `keeps_copies`: intermediates of the size of its inputs.

    The depth mix is cheap to run and costly to keep: its stacked blocks [B,T,n,d] (in fp32 for the logits), kept for
    every sublayer, would outweigh the layer itself. A non-reentrant checkpoint keeps only the inputs, which are the
    depth state the layers share anyway; it nests under gradient checkpointing and compiles as one region. A mix that
    reads its inputs in place keeps little more than they are, and runs once: recomputing it would cost time for no
    memory.
    """
    if torch.is_grad_enabled() and keeps_copies:
        return checkpoint(function, *inputs, use_reentrant=False)
    return function(*inputs)


def learned_parameters(head: tuple[nn.Module, ...], options: DepthAttention, device: torch.device) -> DepthParameters:
    """What the head's modules hold, read in module calls for hooks to see, and brought to the depth state's device
    because a device map may place a head's modules elsewhere (Accelerate moves the arguments of a module call, not its
    output)."""
    learned = {PARAMETER_OF_PART[part]: module() for part, module in zip(options.parts, head, strict=True)}
    # Compared here: `.to` is an operator call even where it has nothing to move, which a decoding step pays for
    return DepthParameters(**{name: p if p.device == device else p.to(device) for name, p in learned.items()})


def score_completed_blocks(depth: DepthState, options: DepthAttention, *heads: tuple[nn.Module, ...]) -> tuple:
    """Phase 1 for several sublayers that read the same completed blocks (a decoder layer's attention and MLP): their
    folded queries scored in one product. -> one [B,T,n,H] per head"""
    device = depth.completed_inv_rms.device
    queries = torch.cat(
        [
            folded_queries(sublayer_query(depth, learned, options), learned.key_gain, options.heads)
            for learned in (learned_parameters(head, options, device) for head in heads)
        ]
    )  # [q*H,d]

    def score(queries, completed_inv_rms, *completed_blocks):
        with fp32_region(completed_inv_rms):
            inv_rms = completed_inv_rms if options.key_norm else None
            return completed_logits(stacked_if_small(completed_blocks), inv_rms, queries)

    logits = recomputed(
        score,
        queries,
        depth.completed_inv_rms,
        *depth.completed_blocks,
        keeps_copies=reads_copies(depth.completed_blocks),
    )  # [B,T,n,q*H]
    # Sliced, not split: torch's lazy tensors (a second device in the device-map tests) cannot cat split's views
    heads_count = options.heads
    return tuple(logits[..., i * heads_count : (i + 1) * heads_count] for i in range(len(heads)))


# --------------------------------------------------------------------------------------------------------------------
# Compiled training: the depth mix as one operator the compiler does not look into
# --------------------------------------------------------------------------------------------------------------------
# Inlined, each sublayer's mix fuses with its neighbours into kernels of its own (each has its own number of sources
# and place in its block), so the first compiled training step took about 3x its source's compile time. As one opaque
# operator it runs as it does in eager mode, inside the compiled graph, and the layers around it compile to the same
# kernels, built once. Its backward is autograd's own: `torch.func.vjp` of the same mix, run by a second operator for
# the same reason. Like a recomputed region it keeps only its inputs, the depth state the layers share anyway.

OPERATOR_NAMESPACE = re.sub(r"\W", "_", __name__)  # this module's own: remote code of another version registers its own


def mixes_in_one_operator() -> bool:
    """Whether the depth mixes may run as `depth_mix_operator` (`attnres_compiled_mix="operator"`): while compiling a
    graph that autograd will differentiate. Compiled inference (prefill, decoding) keeps the mix inline, where the
    compiler fuses it into few kernels."""
    return torch.compiler.is_compiling() and torch.is_grad_enabled()


# The operators' inputs: the depth state, the head's parameters (in the order of `DepthAttention.parts`), then the
# fields of `DepthAttention`, the backend the operator runs and the policy's `scale_by_num_sources`; spelled out, so
# that no torch version has to infer it
MIX_INPUTS = (
    "Tensor[] completed_blocks, Tensor completed_inv_rms, Tensor? partial_sum, Tensor[] parameters, float eps, "
    "str query, str score, bool key_norm, int heads, int? window, str backend, bool scale_by_num_sources"
)


def mix_of_tensors(
    completed_blocks: list[torch.Tensor],
    completed_inv_rms: torch.Tensor,
    partial_sum: torch.Tensor | None,
    parameters: list[torch.Tensor],
    *settings,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The mix `depth_attention` computes, from what an operator can take (`MIX_INPUTS`). -> mixed input [B,T,d], depth
    weights [B,T,S]"""
    *fields, backend, scale_by_num_sources = settings
    options = DepthAttention(*fields)
    learned = DepthParameters(
        **{PARAMETER_OF_PART[part]: value for part, value in zip(options.parts, parameters, strict=True)}
    )
    state = DepthState(tuple(completed_blocks), completed_inv_rms, partial_sum)
    mixed, weights = DEPTH_MIX_BACKENDS[backend](state, learned, options, scale_by_num_sources)
    return mixed.contiguous(), weights.contiguous()  # the layout the fake tensors promise, whichever way it ran


depth_mix_operator = torch.library.custom_op(
    f"{OPERATOR_NAMESPACE}::depth_mix", mutates_args=(), schema=f"({MIX_INPUTS}) -> (Tensor, Tensor)"
)(mix_of_tensors)
depth_mix_operator.register_fake(mix_of_tensors)  # shapes and dtypes: the mix itself, on fake tensors


def mix_gradients(
    grad_mixed: torch.Tensor,
    grad_weights: torch.Tensor,
    completed_blocks: list[torch.Tensor],
    completed_inv_rms: torch.Tensor,
    partial_sum: torch.Tensor | None,
    parameters: list[torch.Tensor],
    *settings,
) -> list[torch.Tensor]:
    """The gradients of `depth_mix_operator`'s inputs, by `torch.func.vjp` of the same mix: the completed blocks',
    then the inverse RMS's, the partial sum's (where there is one) and the parameters'."""

    def mix(blocks, inv_rms, learned, *partial):  # torch.func takes tensors only: no partial sum, no argument
        return mix_of_tensors(blocks, inv_rms, partial[0] if partial else None, learned, *settings)

    partial = () if partial_sum is None else (partial_sum,)
    _, vjp = torch.func.vjp(mix, list(completed_blocks), completed_inv_rms, list(parameters), *partial)
    grad_blocks, grad_inv_rms, grad_parameters, *grad_partial = vjp((grad_mixed, grad_weights))
    # An operator's outputs may alias neither its inputs nor each other: a gradient passed through unchanged, or one
    # sharing memory with another (the zeros of unused inputs), is copied
    inputs = (grad_mixed, grad_weights, *completed_blocks, completed_inv_rms, *partial, *parameters)
    taken = {tensor.untyped_storage().data_ptr() for tensor in inputs}
    fresh = []
    for grad in (*grad_blocks, grad_inv_rms, *grad_partial, *grad_parameters):
        grad = grad.contiguous()  # the layout the fake tensors promise
        storage = grad.untyped_storage().data_ptr()
        fresh.append(grad.clone() if storage in taken else grad)
        taken.add(storage)
    return fresh


depth_mix_backward_operator = torch.library.custom_op(
    f"{OPERATOR_NAMESPACE}::depth_mix_backward",
    mutates_args=(),
    schema=f"(Tensor grad_mixed, Tensor grad_weights, {MIX_INPUTS}) -> Tensor[]",
)(mix_gradients)


@depth_mix_backward_operator.register_fake
def gradient_layouts(grad_mixed, grad_weights, completed_blocks, completed_inv_rms, partial_sum, parameters, *settings):
    """`mix_gradients`' outputs as fake tensors: one per differentiable input, of its shape and dtype."""
    inputs = [*completed_blocks, completed_inv_rms, *([] if partial_sum is None else [partial_sum]), *parameters]
    return [tensor.new_empty(tensor.shape) for tensor in inputs]


def save_mix_inputs(ctx, inputs: tuple, output: tuple) -> None:
    completed_blocks, completed_inv_rms, partial_sum, parameters, *settings = inputs
    ctx.num_blocks, ctx.settings = len(completed_blocks), settings
    ctx.output_layouts = [(tensor.shape, tensor.dtype, tensor.device) for tensor in output]
    ctx.save_for_backward(*completed_blocks, completed_inv_rms, partial_sum, *parameters)


def mix_backward(ctx, *grad_outputs: torch.Tensor | None) -> tuple:
    saved, num_blocks = ctx.saved_tensors, ctx.num_blocks
    completed_blocks, (completed_inv_rms, partial_sum) = saved[:num_blocks], saved[num_blocks : num_blocks + 2]
    grad_mixed, grad_weights = (
        torch.zeros(shape, dtype=dtype, device=device) if grad is None else grad  # an output nothing read
        for grad, (shape, dtype, device) in zip(grad_outputs, ctx.output_layouts, strict=True)
    )
    gradients = depth_mix_backward_operator(
        grad_mixed,
        grad_weights,
        list(completed_blocks),
        completed_inv_rms,
        partial_sum,
        list(saved[num_blocks + 2 :]),
        *ctx.settings,
    )
    has_partial_sum = partial_sum is not None
    grad_blocks, grad_inv_rms = gradients[:num_blocks], gradients[num_blocks]
    grad_partial_sum = gradients[num_blocks + 1] if has_partial_sum else None
    grad_parameters = gradients[num_blocks + 1 + has_partial_sum :]
    return grad_blocks, grad_inv_rms, grad_partial_sum, grad_parameters, *(None,) * len(ctx.settings)


depth_mix_operator.register_autograd(mix_backward, setup_context=save_mix_inputs)


def depth_attention(
    depth: DepthState,
    head: tuple[nn.Module, ...],
    options: DepthAttention,
    input_norm: Callable[[torch.Tensor], torch.Tensor],
    block_logits: torch.Tensor | None,
    policy: DepthMixPolicy,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The (normalised) input of one sublayer, mixed over the depth state (its window of it) by its head's modules,
    with the backend `policy` names, run as it says.

    `block_logits` [B,T,n,H]: this sublayer's phase 1 where the layer ran it (`policy.shares_phase_one`), else None.
    With `policy.recompute`, `input_norm` runs inside the recomputed region (the mix output is then not kept either),
    after it otherwise. -> sublayer input [B,T,d], depth weights [B,T,S] fp32
    """
    depth = depth.window(options.window)
    learned = learned_parameters(head, options, depth.completed_inv_rms.device)
    if policy.one_operator:
        parameters = [parameter for parameter in learned if parameter is not None]  # in the order of `options.parts`
        mixed, weights = depth_mix_operator(
            list(depth.completed_blocks), depth.completed_inv_rms, depth.partial_sum, parameters, *astuple(options),
            policy.backend, policy.scale_by_num_sources,
        )  # fmt: skip
        return input_norm(mixed), weights
    backend = DEPTH_MIX_BACKENDS[policy.backend]

    def mix(learned, block_logits, partial_sum, completed_inv_rms, *completed_blocks):
        state = DepthState(completed_blocks, completed_inv_rms, partial_sum)
        mixed, weights = backend(state, learned, options, policy.scale_by_num_sources, block_logits)
        return (input_norm(mixed) if policy.recompute else mixed), weights

    depth_inputs = (depth.partial_sum, depth.completed_inv_rms, *depth.completed_blocks)
    # The reference stacks the sources and the projected query normalises its hidden state, both making copies; the two
    # phases make them where `reads_copies` says; fla's kernel reads the sources where they lie
    in_place = policy.backend == "fla" or (
        policy.backend == "two_phase" and not options.projects_query and not reads_copies(depth.sources())
    )
    keeps_copies = policy.recompute or not in_place
    sublayer_input, weights = recomputed(mix, learned, block_logits, *depth_inputs, keeps_copies=keeps_copies)
    return (sublayer_input if policy.recompute else input_norm(sublayer_input)), weights
