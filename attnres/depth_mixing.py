"""The depth mix of Attention Residuals (Kimi Team, arXiv 2603.15031): how each sublayer's input is formed from the
earlier representations, and the depth state the decoder layers hand on to each other.

    h = sum_i softmax_i(w . RMSNorm(v_i)) * v_i        (paper Eqs. 2-4; w: a learned, input-independent pseudo-query)

The sources v_i of a sublayer are the completed blocks (b_0 = the token embedding, then one sum per finished block; in
Full mode every sublayer output is a block of its own) and the partial sum of the current block. As fla ships a naive
reference beside each fused kernel, this file holds two functions with the same signature: `depth_mix_reference`, the
direct computation, and `depth_mix_two_phase` (paper Algorithm 1), which the model runs. `DEPTH_MIX_BACKENDS` holds
them by name, as transformers holds attention functions; `DepthMixPolicy` says which one runs and how. Phase 1 scores
queries against the completed blocks, whose inverse RMS the depth state keeps from when each closed; a decoder layer
runs it once for both of its sublayers (`score_completed_blocks`). Phase 2 lets the partial sum join the softmax and
reads the mixture. `DepthAttention` holds the paper's ablations of this formula (its Table 4), each one field.

Shapes: B batch, T tokens, n completed blocks, q queries, S sources of one sublayer (n, or n + 1 with the partial
sum), H depth heads (channel groups, 1 unless ablated), d hidden size. Plain tensor ops: PyTorch differentiates and
compiles them. This file is copied next to the weights as remote code, with modeling_attnres.py: it imports only torch
and the standard library.
"""

import contextlib
import itertools
import math
import re
from collections.abc import Callable
from dataclasses import astuple, dataclass
from functools import partial
from typing import NamedTuple

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


class RuleModule(nn.Module):
    """A module of the head a rule learns for one sublayer. It owns its parameters' init, the one its rule's paper
    gives: `init_weights(init)` sets them with transformers' `initialization` functions (handed in, as this file
    imports only torch), which leave alone the parameters a checkpoint has loaded."""

    def init_weights(self, init) -> None:
        raise NotImplementedError


class AttnResPseudoQuery(RuleModule):
    """The pseudo-query w of one sublayer (paper Eq. 3), zero at init (uniform depth weights).

    Calling the module returns w [1,d], so that hooks which place or gather parameters on a module call (Accelerate
    offload, FSDP2, DeepSpeed ZeRO-3) see it read. Not an `nn.Linear`: the score is not w applied to one input, and
    adapters for linear layers (PEFT's "all-linear") must not wrap it.
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden_size))

    def init_weights(self, init) -> None:
        init.zeros_(self.weight)  # "all pseudo-query vectors must be initialized to zero" (paper §5)

    def forward(self) -> torch.Tensor:
        return self.weight


class AttnResQueryProjection(RuleModule):
    """The input-dependent query's projection W [d,d] of one sublayer (ablation `query="projected"`): the query is
    w + W RMSNorm(v) / d, v the latest source. Zero at init, so the query starts as the pseudo-query w. Not an
    `nn.Linear`, for the reason `AttnResPseudoQuery` gives.

    Why 1/d: the logit RMSNorm(v)ᵀ Wᵀ k̂ is a bilinear form of two vectors of norm ~sqrt(d), so under Adam (every
    entry of W moving at the learning rate) it moves ~d times faster than wᵀ k̂. Unscaled, the depth softmax turns
    one-hot within the first steps and training stalls (small study: held-out loss 2.75 after 627K tokens, where
    Full reaches 1.86); divided by d it moves at the pseudo-query's pace (1.98).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, hidden_size))

    def init_weights(self, init) -> None:
        init.zeros_(self.weight)

    def forward(self) -> torch.Tensor:
        return self.weight


class AttnResKeyNorm(RuleModule):
    """The RMSNorm of the depth keys: its gain g [d] and eps. The values stay raw (paper Eq. 2, A4).

    Calling the module returns g (see `AttnResPseudoQuery`): the direct computation scales the normalised keys by it,
    the two-phase one folds it into the query.
    """

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def init_weights(self, init) -> None:
        init.ones_(self.weight)

    def forward(self) -> torch.Tensor:
        return self.weight


class AttnResSourceLogits(RuleModule):
    """The learned logit of each source of one sublayer (ablation `query="scalars"`: input-independent mixing, no query
    and no key), zero at init: uniform weights, as zero pseudo-queries give."""

    def __init__(self, num_sources: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_sources))

    def init_weights(self, init) -> None:
        init.zeros_(self.weight)

    def forward(self) -> torch.Tensor:
        return self.weight


# The weights of the sources from their logits [..., S, H], and the factor that makes zero logits read the plain sum
# of the sources (`scale_by_num_sources`): softmax gives each 1/S, a sigmoid 1/2
SCORES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int], int]]] = {
    "softmax": (partial(torch.softmax, dim=-2), lambda num_sources: num_sources),
    "sigmoid": (torch.sigmoid, lambda num_sources: 2),  # not renormalised: each source weighs on its own
}
QUERIES = ("pseudo", "projected", "scalars")


@dataclass(frozen=True)
class DepthAttention:
    """How Block and Full AttnRes weigh their sources: the paper's AttnRes, or its ablations (paper Table 4), one
    field each. The defaults are the paper's AttnRes."""

    eps: float  # of the keys' RMSNorm, and of the RMSNorm before a query projection
    query: str = "pseudo"  # "pseudo": w; "projected": w + W RMSNorm(latest source); "scalars": a logit per source
    score: str = "softmax"  # or "sigmoid" (a key of SCORES)
    key_norm: bool = True  # False: the keys are the raw sources
    heads: int = 1  # channel groups, each with its own weights over depth
    window: int | None = None  # Full AttnRes: the embedding and the `window` latest sublayer outputs only

    @classmethod
    def of(cls, config) -> "DepthAttention":
        return cls(
            config.attnres_eps,
            config.attnres_query,
            config.attnres_score,
            config.attnres_key_norm,
            config.attnres_depth_heads,
            config.attnres_window,
        )

    @property
    def parts(self) -> tuple[str, ...]:
        """The modules of one sublayer's head (see `DepthRule.parts`)."""
        if self.query == "scalars":
            return ("logits",)
        return ("proj",) + ("query_proj",) * (self.query == "projected") + ("norm",) * self.key_norm

    @property
    def shares_phase_one(self) -> bool:
        """Whether a layer's two sublayers score the same completed blocks with queries known before the layer runs."""
        return self.query == "pseudo" and self.window is None


class DepthParameters(NamedTuple):
    """What one sublayer's depth attention learns, read from its head; None where `DepthAttention` has no such part."""

    pseudo_query: torch.Tensor | None = None  # w [1,d]
    query_projection: torch.Tensor | None = None  # W [d,d]
    key_gain: torch.Tensor | None = None  # g [d]
    source_logits: torch.Tensor | None = None  # [S]


PARAMETER_OF_PART = {
    "proj": "pseudo_query",
    "query_proj": "query_projection",
    "norm": "key_gain",
    "logits": "source_logits",
}


def fp32_region(like: torch.Tensor) -> contextlib.AbstractContextManager:
    """Depth logits and softmax run in fp32 and values in their own dtype, whatever the surrounding autocast.

    Without autocast there is nothing to switch off, and entering the context would cost a decode step more than one of
    its ops."""
    if torch.is_autocast_enabled(like.device.type):
        return torch.autocast(like.device.type, enabled=False)
    return contextlib.nullcontext()


def fp32_or_wider(dtype: torch.dtype) -> torch.dtype:
    """fp32, or `dtype` where it is wider (float64 models stay float64 throughout). Compared in Python:
    `torch.promote_types` is an operator call, which a decode step pays for at every use."""
    return dtype if dtype == torch.float64 else torch.float32


def cast(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The values in `dtype`, without the operator call `.to` costs a decoding step where they are in it already."""
    return values if values.dtype == dtype else values.to(dtype)


def upcast(values: torch.Tensor) -> torch.Tensor:
    """The values in `fp32_or_wider` their dtype."""
    return cast(values, fp32_or_wider(values.dtype))


def inverse_rms(values: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., d] -> [...] fp32 (or wider), from one norm reduction that reads the values in their own dtype."""
    norm = torch.linalg.vector_norm(values, dim=-1, dtype=fp32_or_wider(values.dtype))
    return torch.rsqrt(norm.square() / values.shape[-1] + eps)


class DepthState(NamedTuple):
    """What the depth mixes read and the sublayers write, handed from layer to layer.

    Each completed block is kept once, as it closed, and read by every later sublayer; its inverse RMS is computed then
    too. The decoder layers pass these tensors as positional arguments, which reentrant checkpointing tracks.
    """

    completed_blocks: tuple[torch.Tensor, ...]  # n x [B,T,d]
    completed_inv_rms: torch.Tensor  # [B,T,n] fp32 (or wider)
    # [B,T,d] (mHC: its m residual streams [B,T,m,d]); None from the closing of a block to the next sublayer output
    partial_sum: torch.Tensor | None

    def close_block(self, eps: float) -> "DepthState":
        """The partial sum becomes a completed block; the next sublayer output starts a new one."""
        inv_rms = torch.cat([self.completed_inv_rms, inverse_rms(self.partial_sum, eps).unsqueeze(-1)], dim=-1)
        return DepthState(self.completed_blocks + (self.partial_sum,), inv_rms, None)

    def add(self, sublayer_output: torch.Tensor) -> "DepthState":
        """The partial sum with a sublayer's output [B,T,d] added (the residual add of the source model)."""
        partial_sum = sublayer_output if self.partial_sum is None else self.partial_sum + sublayer_output
        return DepthState(self.completed_blocks, self.completed_inv_rms, partial_sum)

    def sources(self) -> tuple[torch.Tensor, ...]:
        """The sources of a sublayer that reads this state, in order: the completed blocks, then the partial sum."""
        return self.completed_blocks + (() if self.partial_sum is None else (self.partial_sum,))

    def window(self, size: int | None) -> "DepthState":
        """The state a sliding window reads: the embedding and the `size` latest of the other sources (Full AttnRes:
        sublayer outputs). The older ones stay in the state, unread."""
        num_completed = len(self.completed_blocks)
        kept = num_completed - 1 if size is None else min(num_completed - 1, size - (self.partial_sum is not None))
        if kept == num_completed - 1:
            return self
        start = num_completed - kept
        blocks = self.completed_blocks[:1] + self.completed_blocks[start:]
        inv_rms = torch.cat([self.completed_inv_rms[..., :1], self.completed_inv_rms[..., start:]], dim=-1)
        return DepthState(blocks, inv_rms, self.partial_sum)


def sublayer_query(depth: DepthState, learned: DepthParameters, eps: float) -> torch.Tensor:
    """The query: w [1,d], or, with a projection, w + W RMSNorm(v) / d per token [B,T,1,d] from the latest source v
    (1/d: see `AttnResQueryProjection`). fp32"""
    query = upcast(learned.pseudo_query)
    if learned.query_projection is None:
        return query
    latest = depth.sources()[-1]  # [B,T,d]
    normalized = upcast(latest) * inverse_rms(latest, eps).unsqueeze(-1)
    return (query + normalized @ upcast(learned.query_projection).T / latest.shape[-1]).unsqueeze(-2)


def mean_over_groups(weights: torch.Tensor) -> torch.Tensor:
    """[B,T,S,H] -> [B,T,S], the depth weights a sublayer reports; a single group is its own mean, without the
    reduction a decode step would pay for."""
    return weights.squeeze(-1) if weights.shape[-1] == 1 else weights.mean(-1)


def depth_mix_reference(
    depth: DepthState,
    learned: DepthParameters,
    options: DepthAttention,
    scale_by_num_sources: bool,
    block_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The direct computation (paper Fig. 2), the reference for every other backend: stack the sources, normalise
    them as keys, score per channel group, softmax (or sigmoid), weighted sum. It scores every source itself:
    `block_logits`, another backend's phase 1, is not read. -> mixed input [B,T,d], depth weights [B,T,S] (the mean
    over the channel groups)"""
    sources = torch.stack(depth.sources(), dim=-2)  # [B,T,S,d]
    weigh, exact_start_scale = SCORES[options.score]
    with fp32_region(sources):
        values = upcast(sources)
        if options.query == "scalars":
            logits = upcast(learned.source_logits).unsqueeze(-1).expand(*sources.shape[:-1], 1)  # [B,T,S,1]
        else:
            keys = values * inverse_rms(sources, options.eps).unsqueeze(-1) * upcast(learned.key_gain) \
                if options.key_norm else values  # fmt: skip
            products = keys * sublayer_query(depth, learned, options.eps)  # [B,T,S,d]
            logits = group_sums(products, options.heads)  # [B,T,S,H]; no 1/sqrt(d)
        weights = weigh(logits)  # [B,T,S,H]
        value_weights = weights * exact_start_scale(sources.shape[-2]) if scale_by_num_sources else weights
        return weighted_sum(value_weights, values, sources.dtype), mean_over_groups(weights)


def group_sums(products: torch.Tensor, heads: int) -> torch.Tensor:
    """[..., d] -> [..., H], the sum over each channel group; one group without splitting the channels (each
    operation saved is one a decoding step does not pay for)."""
    return products.sum(-1, keepdim=True) if heads == 1 else products.unflatten(-1, (heads, -1)).sum(-1)


def weighted_sum(weights: torch.Tensor, stacked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The stacked sources [B,T,S,d] weighted by `weights` [B,T,S,H] (each channel group by its own) and summed over
    the sources, one group without splitting the channels. -> [B,T,d] in `dtype`"""
    heads = weights.shape[-1]
    if heads == 1:
        return cast((weights * stacked).sum(-2), dtype)
    grouped = stacked.unflatten(-1, (heads, -1))  # [B,T,S,H,d/H]
    return cast((weights.unsqueeze(-1) * grouped).sum(-3).flatten(-2), dtype)


Blocks = torch.Tensor | tuple[torch.Tensor, ...]  # the completed blocks: stacked [B,T,n,d], or n x [B,T,d] as kept


# Above this many elements per block, a stack of the blocks costs more in copying than it saves in operations
LARGEST_STACKED_BLOCK = 2**16


def stacks(blocks: tuple[torch.Tensor, ...]) -> bool:
    """Whether the mix reads `blocks` as one stack [B,T,n,d] rather than one by one.

    Eager and small (decode, short prompts), one stack and one product per phase: few operations, which is what such a
    step pays for. Larger, or compiled, one product and one weighted sum per block, which read each block in place
    where a stack would copy them all for every sublayer (the compiler fuses them into kernels; eager, the copy costs
    more than the extra operations)."""
    return not torch.compiler.is_compiling() and blocks[0].numel() <= LARGEST_STACKED_BLOCK


def stacked_if_small(blocks: tuple[torch.Tensor, ...]) -> Blocks:
    """The blocks as the products of both phases read them best (see `stacks`)."""
    return torch.stack(blocks, dim=-2) if stacks(blocks) else blocks


def reads_copies(blocks: tuple[torch.Tensor, ...]) -> bool:
    """Whether the mix over `blocks` makes copies of them that autograd would keep: a stack, or fp32 copies of
    narrower blocks for the logits."""
    return stacks(blocks) or any(block.dtype != fp32_or_wider(block.dtype) for block in blocks)


def folded_queries(query: torch.Tensor, key_gain: torch.Tensor | None, heads: int) -> torch.Tensor:
    """w . (g * v / rms(v)) = (w * g) . v / rms(v): the key-norm gain folds into the query, which channel groups split
    into one query per group, zero outside it. [1,d] or [B,T,1,d] -> [H,d] or [B,T,H,d] fp32"""
    query = query if key_gain is None else query * upcast(key_gain)
    if heads == 1:
        return query
    group_of_channel = torch.arange(query.shape[-1], device=query.device) // (query.shape[-1] // heads)  # [d]
    return query * (group_of_channel == torch.arange(heads, device=query.device).unsqueeze(-1))  # [H,d] mask


def completed_logits(blocks: Blocks, completed_inv_rms: torch.Tensor | None, queries: torch.Tensor) -> torch.Tensor:
    """Phase 1: logits of the folded queries [q,d] (or per token [B,T,q,d]) against the completed blocks, each read
    once, scaled by their inverse RMS where the keys are normalised. -> [B,T,n,q]"""
    if isinstance(blocks, torch.Tensor):  # stacked [B,T,n,d]
        logits = upcast(blocks) @ queries.mT
    else:
        per_block = [upcast(block).unsqueeze(-2) @ queries.mT for block in blocks]  # n x [B,T,1,q]
        logits = per_block[0] if len(per_block) == 1 else torch.cat(per_block, dim=-2)
    return logits if completed_inv_rms is None else logits * completed_inv_rms.unsqueeze(-1)


def read_sources(weights: torch.Tensor, sources: Blocks) -> torch.Tensor:
    """The sources weighted by `weights` [B,T,S,H] (each channel group by its own) and summed. -> [B,T,d] in the
    sources' dtype"""
    heads = weights.shape[-1]
    if isinstance(sources, torch.Tensor):  # stacked [B,T,S,d]
        # A product and a sum: fewer operations than a batched matmul of 5-d operands, and fp32 weights times narrower
        # sources promote inside the product
        return weighted_sum(weights, sources, sources.dtype)
    # One multiply-add per block; mixed dtypes promote inside the op, so a narrower block is read, and kept, as it is
    first, *rest = (source.unflatten(-1, (heads, -1)) for source in sources)  # [B,T,H,d/H] each
    mixed = weights[..., 0, :, None] * first  # [B,T,H,d/H] fp32
    for i, source in enumerate(rest, start=1):
        mixed = torch.addcmul(mixed, weights[..., i, :, None], source)
    return cast(mixed.flatten(-2), sources[0].dtype)


def merge_partial_sum(
    logits: torch.Tensor,
    blocks: tuple[torch.Tensor, ...],
    partial_sum: torch.Tensor | None,
    score: str,
    scale_by_num_sources: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: the weights over all sources, from their logits [B,T,S,H] (the partial sum's last), then one weighted
    read of the completed blocks plus the partial sum [B,T,d].

    One softmax over n + 1 logits equals the paper's online-softmax merge of the two groups. The partial sum is
    read stacked with the completed blocks (eager: one product, where a separate term for it would cost a decode step
    more operations than the stack). -> mixed input [B,T,d], depth weights [B,T,S] (the mean over channel groups)
    """
    weigh, exact_start_scale = SCORES[score]
    weights = weigh(logits)  # [B,T,S,H]
    # At zero queries softmax * S is exactly 1 per source (for the source counts AttnRes uses): the exact stream.
    value_weights = weights * exact_start_scale(weights.shape[-2]) if scale_by_num_sources else weights
    sources = blocks + (() if partial_sum is None else (partial_sum,))
    return read_sources(value_weights, stacked_if_small(sources)), mean_over_groups(weights)


def depth_mix_two_phase(
    depth: DepthState,
    learned: DepthParameters,
    options: DepthAttention,
    scale_by_num_sources: bool,
    block_logits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`depth_mix_reference` in two phases (paper Algorithm 1), with the completed blocks' inverse RMS that the depth
    state keeps. `block_logits` [B,T,n,H]: this query's phase 1, where `score_completed_blocks` ran it for the whole
    layer; without it, phase 1 runs here. -> mixed input [B,T,d], depth weights [B,T,S]"""
    with fp32_region(depth.completed_inv_rms):
        if options.query == "scalars":  # no keys: the logits are the parameters
            num_sources = len(depth.sources())
            logits = (
                upcast(learned.source_logits).unsqueeze(-1).expand(*depth.completed_inv_rms.shape[:-1], num_sources, 1)
            )
        else:
            queries = folded_queries(sublayer_query(depth, learned, options.eps), learned.key_gain, options.heads)
            inv_rms = depth.completed_inv_rms if options.key_norm else None
            logits = block_logits
            if logits is None:
                logits = completed_logits(stacked_if_small(depth.completed_blocks), inv_rms, queries)
            if depth.partial_sum is not None:
                partial_inv_rms = (
                    inverse_rms(depth.partial_sum, options.eps).unsqueeze(-1) if options.key_norm else None
                )
                logits = torch.cat([logits, completed_logits((depth.partial_sum,), partial_inv_rms, queries)], dim=-2)
        return merge_partial_sum(logits, depth.completed_blocks, depth.partial_sum, options.score, scale_by_num_sources)


# The depth-mix backends by name, as transformers' ALL_ATTENTION_FUNCTIONS holds attention functions. One signature:
#     backend(depth, learned, options, scale_by_num_sources, block_logits) -> mixed input [B,T,d], weights [B,T,S]
# `naive` is the reference each other backend is tested against (a fused kernel plugs in as one more entry, with
# its name in the configuration's IMPLEMENTATIONS). How a mix is run, recomputed or wrapped in one operator for
# compiled training, is `DepthMixPolicy`'s, applied around the backend by `depth_attention`.
DEPTH_MIX_BACKENDS: dict[str, Callable[..., tuple[torch.Tensor, torch.Tensor]]] = {
    "naive": depth_mix_reference,
    "two_phase": depth_mix_two_phase,
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
            folded_queries(sublayer_query(depth, learned, options.eps), learned.key_gain, options.heads)
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
    # Only the two-phase mix reads its sources in place: the reference stacks them, the projected query normalises the
    # latest one, and both make copies
    in_place = policy.backend == "two_phase" and options.query != "projected" and not reads_copies(depth.sources())
    keeps_copies = policy.recompute or not in_place
    sublayer_input, weights = recomputed(mix, learned, block_logits, *depth_inputs, keeps_copies=keeps_copies)
    return (sublayer_input if policy.recompute else input_norm(sublayer_input)), weights


# --------------------------------------------------------------------------------------------------------------------
# The residual rules: how each sublayer reads its input from the depth state, and how its output joins the state
# --------------------------------------------------------------------------------------------------------------------


class ResidualScale(RuleModule):
    """ReZero's scalar or LayerScale's per-channel vector on one sublayer's output (init: `initial_value`)."""

    def __init__(self, shape: tuple[int, ...], initial_value: float):
        super().__init__()
        self.initial_value = initial_value
        self.weight = nn.Parameter(torch.full(shape, initial_value))

    def init_weights(self, init) -> None:
        init.constant_(self.weight, self.initial_value)

    def forward(self) -> torch.Tensor:
        return self.weight


class HighwayGate(RuleModule):
    """The gate of one sublayer, read from the stream h before it: per channel (Highway Networks' gate, Srivastava et
    al. 2015), g = sigmoid(W h/rms(h) + b) with W [d,d] and b [d]; or per token, g = sigmoid(w . h/rms(h) + b) with w
    [d] and b a scalar.

    W (or w) starts at zero and b at `INITIAL_BIAS`, so every token and channel starts with the same gate,
    sigmoid(-1) = 0.27, leaning to carry the stream (Highway Networks' advice of a negative bias). The stream is
    RMS-normalised first because its scale grows with depth: on the raw stream the same W would open the gates of deep
    sublayers further than those of shallow ones, and their logits would move faster under training.
    """

    INITIAL_BIAS = -1.0

    def __init__(self, hidden_size: int, eps: float, per_channel: bool = True):
        super().__init__()
        self.per_channel = per_channel
        weight_shape = (hidden_size, hidden_size) if per_channel else (hidden_size,)
        self.weight = nn.Parameter(torch.zeros(weight_shape))
        bias_shape = (hidden_size,) if per_channel else (1,)  # [1], not a scalar: FSDP2 shards dim 0
        self.bias = nn.Parameter(torch.full(bias_shape, self.INITIAL_BIAS))
        self.eps = eps

    def init_weights(self, init) -> None:
        init.zeros_(self.weight)
        init.constant_(self.bias, self.INITIAL_BIAS)

    def forward(self, stream: torch.Tensor) -> torch.Tensor:
        """[B,T,d] -> g [B,T,d] per channel ([B,T,1] per token) in the stream's dtype"""
        if not self.per_channel:
            return token_gate(stream, self.weight, self.bias, self.eps)
        # Recomputed in backward: the fp32 normalised stream and logits that the matmul and sigmoid would keep are
        # each twice a bf16 stream, per sublayer
        return recomputed(partial(channel_gate, eps=self.eps), stream, self.weight, self.bias)


def channel_gate(stream: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """Highway's per-channel gate sigmoid(W h/rms(h) + b), fp32 inside. -> [B,T,d] in the stream's dtype"""
    with fp32_region(stream):
        normalized = upcast(stream) * inverse_rms(stream, eps).unsqueeze(-1)
        logits = torch.addmm(upcast(bias), normalized.flatten(0, -2), upcast(weight).T).view_as(normalized)
        return torch.sigmoid(logits).to(stream.dtype)


def token_gate(stream: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """The per-token gate sigmoid(w . h/rms(h) + b). -> [B,T,1] in the stream's dtype"""
    with fp32_region(stream):
        # A product and a sum, not a matmul of an fp32 copy: autograd then keeps the stream as it is, not the copy
        logit = (stream * upcast(weight)).sum(-1) * inverse_rms(stream, eps) + upcast(bias)
    return torch.sigmoid(logit).unsqueeze(-1).to(stream.dtype)


class SourceWeights(RuleModule):
    """DenseFormer's learned static weights of one sublayer over its sources (embedding, then every earlier output),
    all 1 at init: the plain residual sum."""

    def __init__(self, num_sources: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_sources))

    def init_weights(self, init) -> None:
        init.ones_(self.weight)

    def forward(self) -> torch.Tensor:
        return self.weight


class HyperConnection(RuleModule):
    """mHC's connection of one sublayer to the m residual streams H [B,T,m,d] (paper Eqs. 7-8), or, with
    `writes=False`, the output aggregation's read of them.

    From the streams, RMS-normalised and flattened (x [B,T,m*d]), each coefficient is a gated projection plus a
    static bias, constrained:

        alpha = sigmoid(g_pre * (x . phi_pre) + b_pre)          [m]    the read: input = norm(sum_j alpha_j H_j)
        beta = 2 sigmoid(g_post * (x . phi_post) + b_post)      [m]    the write: H_i <- sum_j A_ij H_j + beta_i y
        A = SinkhornKnopp(g_res * mat(x . phi_res) + b_res)     [m,m]  doubly stochastic

    `weight` holds phi (pre rows, then post, then res; zero at init, as Hyper-Connections initialise their dynamic
    projections), `gate` the gating factors g (pre, post, res; the paper's 0.01 at init) and `bias` b. The biases start
    the model as its plain residual stream: with every stream a copy of the embedding, alpha sums to 1 (so the read is
    the stream), beta = 2 sigmoid(0) = 1 and A, whose rows sum to 1, keeps the copies equal to h + the sum of the
    outputs. One stream weighs twice each other in the read (stream `read_stream`, the sublayer's index mod m):
    Hyper-Connections start each layer reading its own stream (e_{k mod n}), which breaks the symmetry between the
    copies that would otherwise keep them equal through training.

    A starts leaning to the identity, as Hyper-Connections' A_r = I: `IDENTITY_SHARE` I + (1 - `IDENTITY_SHARE`) / m,
    so each write keeps that share of the differences between the streams. The uniform 1/m (b_res = 0) would keep none:
    a rank-1 A makes every stream the streams' mean plus its own share of the output. The share is the eigenvalue by
    whose square each Sinkhorn-Knopp iteration shrinks an imbalance of the logits near A: at 2/3, 20 iterations
    reach (2/3)^40 = 9e-8, float32's precision; at 0.9 on the diagonal (0.87) columns were still off by 7e-5 after 30
    AdamW steps at lr 1e-2, where here they were off by 3e-8 (measured on a tiny model, 4 streams). The first step
    learns no mix, whatever its init: the streams are equal copies then, and every A leaves them so.
    """

    INITIAL_GATE = 0.01  # the gating factors' init (mHC paper, Table 5)
    SINKHORN_ITERATIONS = 20  # t_max of the paper
    IDENTITY_SHARE = 2 / 3  # A at init: this much of the identity, the rest uniform (see the class's docstring)

    def __init__(self, hidden_size: int, num_streams: int, read_stream: int, writes: bool, eps: float):
        super().__init__()
        self.num_streams, self.read_stream, self.writes, self.eps = num_streams, read_stream, writes, eps
        rows = 2 * num_streams + self.mix_rows(num_streams) if writes else num_streams
        self.weight = nn.Parameter(torch.zeros(rows, num_streams * hidden_size))
        self.gate = nn.Parameter(torch.full((3 if writes else 1,), self.INITIAL_GATE))
        self.bias = nn.Parameter(self.initial_bias())

    def init_weights(self, init) -> None:
        init.zeros_(self.weight)
        init.constant_(self.gate, self.INITIAL_GATE)
        init.copy_(self.bias, self.initial_bias())

    def initial_bias(self) -> torch.Tensor:
        """b at init: the read's logits give alpha = 2/(m+1) to `read_stream` and 1/(m+1) to each other stream; the
        write's give beta = 1 (b_post = 0) and A = s I + (1 - s) / m, s = `IDENTITY_SHARE` (b_res = c I)."""
        streams = self.num_streams
        read = torch.full((streams,), -math.log(streams))  # sigmoid(-log m) = 1/(m+1)
        read[self.read_stream] = math.log(2 / (streams - 1))  # sigmoid = 2/(m+1)
        if not self.writes:
            return read
        return torch.cat([read, torch.zeros(streams), self.initial_mix_bias()])

    @staticmethod
    def mix_rows(streams: int) -> int:
        """phi_res's rows: one logit per entry of A"""
        return streams**2

    def initial_mix_bias(self) -> torch.Tensor:
        """b_res at init: c I, flattened"""
        return self.initial_mix_logit(self.num_streams) * torch.eye(self.num_streams).flatten()

    def mix(self, logits: torch.Tensor) -> torch.Tensor:
        """A [..., m, m] from its logits [..., `mix_rows`]"""
        return sinkhorn_mix(logits)

    @classmethod
    def initial_mix_logit(cls, streams: int) -> float:
        """c of b_res = c I: exp(c) : 1 is the ratio of A's diagonal, s + (1 - s)/m, to the rest, (1 - s)/m; log(2m + 1)
        at s = 2/3 (0.75 and 1/12 at m = 4). exp(b_res) has equal row and column sums, so one Sinkhorn-Knopp iteration
        makes it doubly stochastic."""
        share = cls.IDENTITY_SHARE
        return math.log(1 + streams * share / (1 - share))

    def forward(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(phi, g, b): read in a module call, for hooks (see `AttnResPseudoQuery`)"""
        return self.weight, self.gate, self.bias


def sinkhorn_knopp(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    """[..., m, m] logits -> doubly stochastic matrices: exp, then columns and rows normalised in turn, as the paper's
    Eq. 9 (M(t) = T_r(T_c(M(t-1)))). The last normalisation makes the rows sum to 1 exactly, the columns to within
    the iterations' convergence. Exact rows make each written stream a convex combination of the streams read (none
    grows past the largest) and keep equal copies equal, so a converted model computes its source. With the columns
    exact instead, a tiny model leaning 0.9 to the identity found the rows' gap and widened it: rows summing to 0.5 to
    2 after 100 AdamW steps at lr 1e-2 (measured)."""
    matrix = (logits - logits.amax(dim=(-2, -1), keepdim=True)).exp()  # shifted: the same matrix, without overflow
    for _ in range(iterations):
        matrix = matrix / matrix.sum(dim=-2, keepdim=True)
        matrix = matrix / matrix.sum(dim=-1, keepdim=True)
    return matrix


class PermutationConnection(HyperConnection):
    """mHC-lite's connection (Yang and Gao, "mHC-lite: You Don't Need 20 Sinkhorn-Knopp Iterations", arXiv
    2601.05732): mHC's, but for A, a convex combination of the m! permutation matrices P_k (Birkhoff-von Neumann),
    doubly stochastic exactly, with no Sinkhorn-Knopp iterations:

        w = softmax(g_res * (x . phi_res) + b_res)   [m!]   A = sum_k w_k P_k   [m,m]

    phi_res has m! rows (in place of mHC's m^2), one per permutation, as in the authors' code (github.com/FFTYYY/
    mhc-lite, hyper_conn/mhc_lite.py: a projection from the flattened normalised streams n*C to n!, a 0.01 scale,
    a static bias, a softmax, then a sum over `itertools.permutations`' matrices eye[perm]). The read and beta are
    mHC's here (`HyperConnection`), as are phi (zero at init) and the gates (0.01): the code has its own static
    biases for them, and a gain on its RMSNorm, which mHC's form here does not have.

    b_res at init: log(2 m! + 1) for the identity (permutation 0), 0 for the others, which gives A = 2/3 I + 1/(3m),
    mHC's init here: the other m! - 1 weights 1/(3 m!) each sum to (m-1)!/(3 m!) J - 1/(3 m!) I, since every
    entry of A is covered by (m-1)! permutations. The authors' code starts the identity at 0 and the others at -8,
    A = 0.992 I + ... at m = 4 (the paper is silent on why): we keep mHC's 2/3 so that the two rules differ only in
    how they build A. The code applies A transposed (H_t <- sum_s A_st H_s); the transposes of the permutation
    matrices are the permutation matrices, so that is the same set of mixes, and at init the same A.
    """

    @staticmethod
    def mix_rows(streams: int) -> int:
        return math.factorial(streams)

    def initial_mix_bias(self) -> torch.Tensor:
        bias = torch.zeros(self.mix_rows(self.num_streams))
        bias[0] = math.log(2 * self.mix_rows(self.num_streams) + 1)  # itertools lists the identity first
        return bias

    def mix(self, logits: torch.Tensor) -> torch.Tensor:
        return permutation_mix(logits, self.num_streams)


def permutation_matrices(streams: int) -> torch.Tensor:
    """The m! permutation matrices P_k [m!, m*m] (P_k[i, perm_k[i]] = 1: row i of P H is stream perm_k[i]), in the
    order of `itertools.permutations`, the identity first. Built at each call, not cached: torch.compile folds them
    into constants, and warns that it ignores a functools cache (at most 720 x 36 entries, m = 6)."""
    permutations = torch.tensor(list(itertools.permutations(range(streams))))
    return torch.eye(streams)[permutations].flatten(-2)


def permutation_mix(logits: torch.Tensor, streams: int) -> torch.Tensor:
    """mHC-lite's A: [..., m!] logits -> sum_k softmax(logits)_k P_k [..., m, m]"""
    matrices = permutation_matrices(streams).to(logits.device, logits.dtype)
    return (torch.softmax(logits, dim=-1) @ matrices).unflatten(-1, (streams, streams))


def normalized_streams(streams: torch.Tensor, eps: float) -> torch.Tensor:
    """[B,T,m,d] -> the streams flattened and RMS-normalised without a gain, x [B,T,m*d] fp32 (or wider)"""
    flat = streams.flatten(-2)
    return upcast(flat) * inverse_rms(flat, eps).unsqueeze(-1)


def read_streams(
    streams: torch.Tensor, weight: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """mHC's read: sum_j alpha_j H_j. -> [B,T,d] in the streams' dtype, alpha [B,T,m] fp32"""
    num_streams = streams.shape[-2]
    with fp32_region(streams):
        logits = normalized_streams(streams, eps) @ upcast(weight[:num_streams]).T  # [B,T,m]
        alpha = torch.sigmoid(logits * upcast(gate[0]) + upcast(bias[:num_streams]))
        read = (alpha.unsqueeze(-2).to(streams.dtype) @ streams).squeeze(-2)
    return read, alpha


def sinkhorn_mix(logits: torch.Tensor) -> torch.Tensor:
    """mHC's A: [..., m*m] logits -> [..., m, m], doubly stochastic by Sinkhorn-Knopp"""
    streams = math.isqrt(logits.shape[-1])
    return sinkhorn_knopp(logits.unflatten(-1, (streams, streams)), HyperConnection.SINKHORN_ITERATIONS)


def write_coefficients(
    streams: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mix: Callable[[torch.Tensor], torch.Tensor] = sinkhorn_mix,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The write coefficients of mHC (or, with `mix` a `PermutationConnection`'s, mHC-lite), from the streams
    [B,T,m,d] the sublayer read. -> beta [B,T,m], A [B,T,m,m], fp32"""
    num_streams = streams.shape[-2]
    with fp32_region(streams):
        logits = normalized_streams(streams, eps) @ upcast(weight[num_streams:]).T  # [B,T,m + the mix's rows]
        post_logits, residual_logits = logits[..., :num_streams], logits[..., num_streams:]
        post_bias, residual_bias = upcast(bias[num_streams : 2 * num_streams]), upcast(bias[2 * num_streams :])
        beta = 2 * torch.sigmoid(post_logits * upcast(gate[1]) + post_bias)
        return beta, mix(residual_logits * upcast(gate[2]) + residual_bias)


def write_streams(
    streams: torch.Tensor,
    output: torch.Tensor,
    weight: torch.Tensor,
    gate: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    mix: Callable[[torch.Tensor], torch.Tensor] = sinkhorn_mix,
) -> torch.Tensor:
    """mHC's write of a sublayer's output y [B,T,d]: H_i <- sum_j A_ij H_j + beta_i y. -> [B,T,m,d]"""
    beta, residual = write_coefficients(streams, weight, gate, bias, eps, mix)
    dtype = streams.dtype
    return torch.addcmul(residual.to(dtype) @ streams, beta.to(dtype).unsqueeze(-1), output.unsqueeze(-2))


Head = tuple[nn.Module, ...]  # the modules one sublayer's rule learns, in the order of the rule's `parts`


class StreamCoefficients(NamedTuple):
    """One sublayer of a recurrence on m streams H [B,T,m,d] (m = 1 but for mHC), as its coefficients in the
    depth-mixing matrix M (paper §3, Table 1): it reads sum_j read_j H_j, then writes H <- carry @ H + write y, per
    token. fp32; a per-channel coefficient enters as its mean over the channels."""

    read: torch.Tensor  # [B,T,m]
    carry: torch.Tensor | None  # [B,T,m,m]; None for the output, which writes nothing
    write: torch.Tensor | None  # [B,T,m]


def plain_coefficients(stream: torch.Tensor, carry: float | torch.Tensor = 1.0, write: float | torch.Tensor = 1.0):
    """The coefficients of h <- carry h + write y on one stream [B,T,d] (carry, write: numbers or [B,T,1])."""
    ones = stream.new_ones(*stream.shape[:-1], 1, dtype=torch.float32)
    return StreamCoefficients(ones, (ones * carry).unsqueeze(-1), ones * write)


class DepthRule:
    """A depth-mixing rule as the decoder layers run it. `parts` names the modules of one sublayer's head (the model
    registers them as `<sublayer>_res_<part>`); `heads` builds them. The sublayer's input norm is handed to `read` and
    `write`: PreNorm-style rules normalise what they read, PostNorm what they write.

    The default is the plain residual stream (PreNorm): read norm(h), write h + f.
    """

    parts: tuple[str, ...] = ()
    mixes_sources = False  # whether reads weigh sources, the output aggregation's too (which then has a head)

    @property
    def all_parts(self) -> tuple[str, ...]:
        """The parts a head of this rule may have, under any of its options."""
        return self.parts

    def configured(self, config) -> "DepthRule":
        """The rule as `config` sets it (AttnRes: its ablation options); the others take nothing from it."""
        return self

    @property
    def output_parts(self) -> tuple[str, ...]:
        """The parts of the output aggregation's head: only a rule that weighs sources weighs them there too."""
        return self.parts if self.mixes_sources else ()

    def heads(self, config, sources: int, sublayer: int) -> dict[str, nn.Module]:
        """The modules of sublayer `sublayer` (A0 = 0, M0 = 1, ..., the output aggregation `config.num_sublayers()`),
        which mixes `sources` sources."""
        return {}

    def start(self, config, embedding: torch.Tensor) -> torch.Tensor:
        """The depth state's stream before layer 0, from the token embedding [B,T,d]: the embedding itself."""
        return embedding

    def score(self, depth: DepthState, heads: tuple[Head, ...]) -> tuple[torch.Tensor | None, ...]:
        """Work that several sublayers reading the same depth state share (AttnRes's phase 1); one entry per head."""
        return (None,) * len(heads)

    def read(
        self, depth: DepthState, head: Head, norm: Callable, scores: torch.Tensor | None, policy: DepthMixPolicy
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """-> the sublayer's input [B,T,d], its weights over the sources [B,T,S] (None where the rule has none)"""
        return norm(depth.partial_sum), None

    def finish(self, depth: DepthState, head: Head, final_norm: Callable, policy: DepthMixPolicy):
        """The model's output from the last depth state: a read by the output head, through the final norm."""
        return self.read(depth, head, final_norm, None, policy)

    def write(self, depth: DepthState, output: torch.Tensor, head: Head, norm: Callable) -> DepthState:
        """The depth state with the sublayer's output [B,T,d] joined."""
        return depth.add(output)

    # Why the rule has no depth-mixing matrix M, where it has none
    no_mixing_matrix: str | None = None

    def coefficients(self, stream: torch.Tensor, head: Head) -> StreamCoefficients:
        """A recurrence's coefficients in M for the sublayer (or, with the output's head, the output) that reads
        `stream`, the depth state's partial sum. Rules that weigh sources (`mixes_sources`) have their depth weights
        as their rows of M instead."""
        return plain_coefficients(stream)


class AttnResRule(DepthRule):
    """Block and Full AttnRes: each sublayer's input is its depth attention over the sources, as `options` (the
    config's, through `configured`) weigh them."""

    mixes_sources = True
    all_parts = ("proj", "query_proj", "norm", "logits")  # under any options

    def __init__(self, options: DepthAttention | None = None):
        self.options = options or DepthAttention(eps=0.0)

    def configured(self, config) -> "AttnResRule":
        return AttnResRule(DepthAttention.of(config))

    @property
    def parts(self) -> tuple[str, ...]:
        return self.options.parts

    def heads(self, config, sources, sublayer):
        hidden_size = config.text_config.hidden_size
        modules = {
            "proj": lambda: AttnResPseudoQuery(hidden_size),
            "query_proj": lambda: AttnResQueryProjection(hidden_size),
            "norm": lambda: AttnResKeyNorm(hidden_size, config.attnres_eps),
            "logits": lambda: AttnResSourceLogits(sources),
        }
        return {part: modules[part]() for part in self.parts}

    def score(self, depth, heads):
        if not self.options.shares_phase_one:  # the queries of a projection come from the sublayer's own sources
            return (None,) * len(heads)
        return score_completed_blocks(depth, self.options, *heads)

    def read(self, depth, head, norm, scores, policy):
        return depth_attention(depth, head, self.options, norm, scores, policy)


class PostNormRule(DepthRule):
    """h <- norm(h + f(h)): the sublayer reads the stream as it is, which the norm of the last write has normalised."""

    no_mixing_matrix = (
        "PostNorm normalises the stream after each sum, so no sublayer reads a weighted sum of the sources"
    )

    def read(self, depth, head, norm, scores, policy):
        return depth.partial_sum, None

    def finish(self, depth, head, final_norm, policy):
        return final_norm(depth.partial_sum), None

    def write(self, depth, output, head, norm):
        return DepthState(depth.completed_blocks, depth.completed_inv_rms, norm(depth.partial_sum + output))


class ScaledOutputRule(DepthRule):
    """h <- h + s * f(norm(h)): ReZero (s a scalar) or LayerScale (s a vector [d]), s = `attnres_scale_init` at init,
    else the rule's published value."""

    parts = ("scale",)

    def __init__(self, per_channel: bool):
        self.per_channel = per_channel

    def initial_scale(self, config) -> float:
        if config.attnres_scale_init is not None:
            return config.attnres_scale_init
        if not self.per_channel:
            return 0.0  # ReZero: every sublayer starts as the identity
        layers = config.text_config.num_hidden_layers
        return 0.1 if layers <= 18 else 1e-5 if layers <= 24 else 1e-6  # CaiT's rule by depth

    def heads(self, config, sources, sublayer):
        shape = (config.text_config.hidden_size,) if self.per_channel else (1,)  # [1], not a scalar: FSDP2 shards dim 0
        return {"scale": ResidualScale(shape, self.initial_scale(config))}

    def write(self, depth, output, head, norm):
        (scale,) = head
        return depth.add(output * scale().to(output.dtype))

    def coefficients(self, stream, head):
        if not head:  # the output, which reads the stream
            return plain_coefficients(stream)
        (scale,) = head
        return plain_coefficients(stream, write=scale().detach().float().mean())


class HighwayRule(DepthRule):
    """h <- (1 - g) h + g f(norm(h)), g = sigmoid(W h/rms(h) + b) per channel (`HighwayGate`; the config's
    `attnres_highway_gate="token"`: sigmoid(w . h/rms(h) + b) per token)."""

    parts = ("gate",)

    def __init__(self, per_channel: bool = True):
        self.per_channel = per_channel

    def configured(self, config) -> "HighwayRule":
        return HighwayRule(per_channel=config.attnres_highway_gate == "channel")

    def heads(self, config, sources, sublayer):
        return {"gate": HighwayGate(config.text_config.hidden_size, config.attnres_eps, self.per_channel)}

    def write(self, depth, output, head, norm):
        (gate,) = head
        stream = depth.partial_sum
        # Under autocast the output is narrower than the stream, and lerp takes one dtype: the stream's, as an add would
        mixed = torch.lerp(stream, output.to(stream.dtype), gate(stream))
        return DepthState(depth.completed_blocks, depth.completed_inv_rms, mixed)

    def coefficients(self, stream, head):
        if not head:  # the output, which reads the stream
            return plain_coefficients(stream)
        (gate,) = head
        # A per-channel gate enters as its mean: exact where the channels' gates are equal (at init), else the mix of
        # the average channel, since each channel's own row multiplies its own gates down the depth
        opening = gate(stream).float().mean(-1, keepdim=True)  # [B,T,1]
        return plain_coefficients(stream, carry=1 - opening, write=opening)


class DenseFormerRule(DepthRule):
    """Each sublayer's input is norm(sum_i a_i v_i) over the embedding and every earlier output v_i, with learned
    static weights a (all 1 at init, which is the plain stream)."""

    parts = ("weights",)
    mixes_sources = True

    def heads(self, config, sources, sublayer):
        return {"weights": SourceWeights(sources)}

    def read(self, depth, head, norm, scores, policy):
        (source_weights,) = head
        partial = () if depth.partial_sum is None else (depth.partial_sum,)
        sources = depth.completed_blocks + partial
        weights = source_weights().to(sources[0].dtype)  # [S]
        mixed = sources[0] * weights[0]
        for index in range(1, len(sources)):  # in the order the stream sums them: exact at weights 1
            mixed = mixed + sources[index] * weights[index]
        return norm(mixed), weights.float().expand(*mixed.shape[:-1], -1)


class HyperConnectionRule(DepthRule):
    """mHC (DeepSeek, arXiv 2512.24880), on Hyper-Connections (Zhu et al., ICLR 2025): the depth state is m residual
    streams [B,T,m,d], each a copy of the token embedding before layer 0. Each sublayer reads norm(sum_j alpha_j H_j)
    and writes H_i <- sum_j A_ij H_j + beta_i y, its coefficients computed from the streams by its `HyperConnection`;
    the output reads the streams as a sublayer does (a learned alpha, as DeepSeek-V4's mHC head), then the final norm.
    Every coefficient is per token: generation with the KV cache computes what a full forward does.
    """

    parts = ("connection",)
    connection_class = HyperConnection

    @property
    def output_parts(self) -> tuple[str, ...]:
        return self.parts  # the output's learned read of the streams

    def heads(self, config, sources, sublayer):
        num_streams, num_sublayers = config.attnres_num_streams, config.num_sublayers()
        connection = self.connection_class(
            config.text_config.hidden_size,
            num_streams,
            sublayer % num_streams,
            sublayer < num_sublayers,
            config.attnres_eps,
        )
        return {"connection": connection}

    def start(self, config, embedding):
        return embedding.unsqueeze(-2).expand(*embedding.shape[:-1], config.attnres_num_streams, -1)

    def read(self, depth, head, norm, scores, policy):
        (connection,) = head
        streams = depth.partial_sum
        parameters = [parameter.to(streams.device) for parameter in connection()]  # see score_completed_blocks
        read, _ = recomputed(partial(read_streams, eps=connection.eps), streams, *parameters)
        return norm(read), None

    def write(self, depth, output, head, norm):
        (connection,) = head
        streams = depth.partial_sum
        parameters = [parameter.to(streams.device) for parameter in connection()]
        write = partial(write_streams, eps=connection.eps, mix=connection.mix)
        streams = recomputed(write, streams, output, *parameters)
        return DepthState(depth.completed_blocks, depth.completed_inv_rms, streams)

    def coefficients(self, stream, head):
        (connection,) = head
        parameters = [parameter.to(stream.device) for parameter in connection()]
        _, alpha = read_streams(stream, *parameters, connection.eps)
        if not connection.writes:  # the output's read
            return StreamCoefficients(alpha, None, None)
        beta, carry = write_coefficients(stream, *parameters, connection.eps, connection.mix)
        return StreamCoefficients(alpha, carry, beta)


class PermutationMixRule(HyperConnectionRule):
    """mHC-lite: mHC with each A a convex combination of permutation matrices (`PermutationConnection`)"""

    connection_class = PermutationConnection


DEPTH_RULES = {
    "block": AttnResRule(),
    "full": AttnResRule(),
    "prenorm": DepthRule(),
    "postnorm": PostNormRule(),
    "rezero": ScaledOutputRule(per_channel=False),
    "layerscale": ScaledOutputRule(per_channel=True),
    "highway": HighwayRule(),
    "denseformer": DenseFormerRule(),
    "mhc": HyperConnectionRule(),
    "mhc_lite": PermutationMixRule(),
}
