"""The depth mix of Attention Residuals (Kimi Team, arXiv 2603.15031): how each sublayer's input is formed from the
earlier representations, and the depth state the decoder layers hand on to each other. The math only: the backends
that run it (depth_mix_backends.py) and the residual rules that use it (depth_rules.py) live beside it.

    h = sum_i softmax_i(w . RMSNorm(v_i)) * v_i        (paper Eqs. 2-4; w: a learned, input-independent pseudo-query)

The sources v_i of a sublayer are the completed blocks (b_0 = the token embedding, then one sum per finished block; in
Full mode every sublayer output is a block of its own) and the partial sum of the current block. As fla ships a naive
reference beside each fused kernel, this file holds two functions with the same signature: `depth_mix_reference`, the
direct computation, and `depth_mix_two_phase` (paper Algorithm 1), which the model runs. Phase 1 scores queries against
the completed blocks, whose inverse RMS the depth state keeps from when each closed; a decoder layer runs it once for
both of its sublayers (`score_completed_blocks`). Phase 2 lets the partial sum join the softmax and reads the mixture.
`DepthAttention` holds the paper's ablations of this formula (its Table 4), each one field.

Shapes: B batch, T tokens, n completed blocks, q queries, S sources of one sublayer (n, or n + 1 with the partial
sum), H depth heads (channel groups, 1 unless ablated), d hidden size. Plain tensor ops: PyTorch differentiates and
compiles them. This file is copied next to the weights as remote code, with modeling_attnres.py: it imports only torch
and the standard library.
"""

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import torch

# The weights of the sources from their logits [..., S, H], and the factor that makes zero logits read the plain sum
# of the sources (`scale_by_num_sources`): softmax gives each 1/S, a sigmoid 1/2
SCORES: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[int], int]]] = {
    "softmax": (partial(torch.softmax, dim=-2), lambda num_sources: num_sources),
    "sigmoid": (torch.sigmoid, lambda num_sources: 2),  # not renormalised: each source weighs on its own
}
QUERIES = ("pseudo", "projected", "projected_latest", "scalars")
PROJECTED_QUERIES = ("projected", "projected_latest")


@dataclass(frozen=True)
class DepthAttention:
    """How Block and Full AttnRes weigh their sources: the paper's AttnRes, or its ablations (paper Table 4), one
    field each. The defaults are the paper's AttnRes."""

    eps: float  # of the keys' RMSNorm, and of the RMSNorm before a query projection
    # "pseudo": w; "projected": w + W RMSNorm(sum of the sources); "projected_latest": w + W RMSNorm(latest source);
    # "scalars": a logit per source
    query: str = "pseudo"
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
        return ("proj",) + ("query_proj",) * self.projects_query + ("norm",) * self.key_norm

    @property
    def projects_query(self) -> bool:
        """Whether the query is projected per token from what the sublayer reads."""
        return self.query in PROJECTED_QUERIES

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


def sublayer_query(depth: DepthState, learned: DepthParameters, options: DepthAttention) -> torch.Tensor:
    """The query: w [1,d], or, with a projection, w + W RMSNorm(v) / d per token [B,T,1,d] (1/d: see
    `AttnResQueryProjection`), v the hidden state (`projected_input`). fp32"""
    query = upcast(learned.pseudo_query)
    if learned.query_projection is None:
        return query
    hidden = projected_input(depth, options.query)  # [B,T,d]
    normalized = upcast(hidden) * inverse_rms(hidden, options.eps).unsqueeze(-1)
    return (query + normalized @ upcast(learned.query_projection).T / hidden.shape[-1]).unsqueeze(-2)


def projected_input(depth: DepthState, query: str) -> torch.Tensor:
    """What a projected query reads: "projected", the hidden state, the sum of the sources in fp32 (the embedding and
    every earlier output: the stream of the standard residual, and with zero queries the sublayer's input up to its
    scale, which the RMSNorm removes; with a window, the sum of the sources in it); "projected_latest", the latest
    source (Full: the previous sublayer's output), as the ablation read until naming 2. [B,T,d]"""
    sources = depth.sources()
    if query == "projected_latest":
        return sources[-1]
    hidden = upcast(sources[0])
    for source in sources[1:]:
        hidden = hidden + source
    return hidden


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
            products = keys * sublayer_query(depth, learned, options)  # [B,T,S,d]
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
            queries = folded_queries(sublayer_query(depth, learned, options), learned.key_gain, options.heads)
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
