"""The residual rules: how each sublayer reads its input from the depth state and how its output joins it, one class
per rule (`DEPTH_RULES`, keyed as rules.py's `RULES`), with the modules each rule learns per sublayer (`RuleModule`s,
each owning the init its paper gives).

AttnRes reads a depth mix (depth_mix_backends.py's `depth_attention`); the other rules are the ones the paper compares
it with (its Table 4): PreNorm, PostNorm, ReZero, LayerScale, Highway, DenseFormer, mHC and mHC-lite. Shapes as in
depth_mixing.py. Copied next to the weights as remote code: it imports only torch, the standard library and the two
files above.
"""

import itertools
import math
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch
from torch import nn

from .depth_mix_backends import DepthMixPolicy, depth_attention, recomputed, score_completed_blocks
from .depth_mixing import DepthAttention, DepthState, fp32_region, inverse_rms, upcast


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
    w + W RMSNorm(v) / d, v the hidden state (depth_mixing.py's `projected_input`). Zero at init, so the query
    starts as the pseudo-query w. Not an `nn.Linear`, for the reason `AttnResPseudoQuery` gives.

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
    """DenseFormer per sublayer: the learned static weights of one sublayer over its sources (embedding, then every
    earlier output), all 1 at init: the plain residual sum."""

    def __init__(self, num_sources: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_sources))

    def init_weights(self, init) -> None:
        init.ones_(self.weight)

    def forward(self) -> torch.Tensor:
        return self.weight


class DepthWeightedAverage(RuleModule):
    """DenseFormer's depth-weighted average (DWA) after one decoder layer (Pagliardini et al. 2024, "DenseFormer:
    Enhancing Information Flow in Transformers via Depth Weighted Averaging", Eq. 1; dilation and period as the
    authors' DWAModules, github.com/epfml/DenseFormer): learned static weights over the block outputs X_0 (the
    embedding) .. X_j (j = `output_index`, the layer's own output), every `dilation`-th back from X_j. X_j's weight is
    1 and the others 0 at init, so the average starts as the plain stream. A layer that does not average (the period)
    has the module without weights: the rule keeps its output all the same, for the later averages."""

    def __init__(self, output_index: int, dilation: int, averages: bool):
        super().__init__()
        self.output_index, self.dilation = output_index, dilation
        self.weight = nn.Parameter(self.initial_weights()) if averages else None

    def initial_weights(self) -> torch.Tensor:
        weights = torch.zeros(self.output_index // self.dilation + 1)
        weights[-1] = 1.0
        return weights

    def init_weights(self, init) -> None:
        if self.weight is not None:
            init.copy_(self.weight, self.initial_weights())

    def averaged(self, outputs: tuple) -> tuple:
        """Of the block outputs X_0 .. X_j, those it weighs, oldest first: every `dilation`-th back from X_j."""
        return outputs[self.output_index % self.dilation :: self.dilation]

    def forward(self) -> torch.Tensor | None:
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
    reads_norms = True  # whether it reads through the sublayers' input norms and the final norm

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
    """h <- h + s * f(norm(h)): ReZero on PreNorm (s a scalar) or LayerScale (s a vector [d]), s =
    `attnres_scale_init` at init, else the rule's published value."""

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


class NormFreeScaledOutputRule(ScaledOutputRule):
    """ReZero as published (Bachlechner et al. 2020, "ReZero is All You Need", Eq. 2): x_{i+1} = x_i + a_i F(x_i),
    with no normalisation layer: each sublayer reads the raw stream, h <- h + a f(h), and the model's output is the
    stream itself, without the final norm. The norms inside a sublayer (QK-norm, the output norms of Gemma and OLMo-2)
    are the sublayer's own and stay. The input norms and the final norm stay in the model, unread and frozen (a
    data-parallel step would otherwise wait for their gradients), so that its checkpoint keeps the family's layout."""

    reads_norms = False

    def read(self, depth, head, norm, scores, policy):
        return depth.partial_sum, None

    def finish(self, depth, head, final_norm, policy):
        return depth.partial_sum, None


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
    """DenseFormer per sublayer, as the Kimi paper's Table 5 writes it: each sublayer's input is norm(sum_i a_i v_i)
    over the embedding and every earlier sublayer output v_i, with learned static weights a (all 1 at init, which is
    the plain stream)."""

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


class DepthWeightedAverageRule(DepthRule):
    """DenseFormer as published: each decoder layer (its block) runs on the stream as PreNorm does, h <- h +
    f(norm(h)) per sublayer, and after it the stream becomes the depth-weighted average of the block outputs so far
    (its MLP's `DepthWeightedAverage`): X_0 the embedding, X_j the stream after layer j's MLP, Y_j = sum_i a_ji X_i,
    which layer j + 1 reads and the final norm reads after the last layer. The depth state keeps X_0 .. X_j as its
    completed blocks (with no inverse RMS: nothing scores them) and the stream as its partial sum."""

    parts = ("average",)

    def __init__(self, num_layers: int = 0):
        self.num_layers = num_layers

    def configured(self, config) -> "DepthWeightedAverageRule":
        return DepthWeightedAverageRule(config.text_config.num_hidden_layers)

    def heads(self, config, sources, sublayer):
        if sublayer % 2 == 0:
            return {}  # an attention sublayer: inside its block
        output_index = sublayer // 2 + 1
        averages = output_index % config.attnres_dwa_period == 0
        return {"average": DepthWeightedAverage(output_index, config.attnres_dwa_dilation, averages)}

    def write(self, depth, output, head, norm):
        outputs = depth.completed_blocks or (depth.partial_sum,)  # X_0, the embedding, kept at the first write
        stream = depth.add(output).partial_sum
        if head:  # an MLP: its block ends with X_j, then the average
            (average,) = head
            outputs += (stream,)
            if average.weight is not None:
                stream = weighted_average(average.averaged(outputs), average().to(stream))
        return DepthState(outputs, depth.completed_inv_rms, stream)

    def coefficients(self, stream, head):
        """As a recurrence on L + 2 streams: the running stream, then X_0 .. X_L, each the embedding at the start
        (X_0 stays so). An MLP's step keeps the stream it read in X_j's stream and adds its output there; its
        average, of X_j = h + y among the others, is a_jj h + sum a_ji X_i in the carry and a_jj y in the write."""
        size = self.num_layers + 2
        carry, write = torch.eye(size), torch.zeros(size)
        write[0] = 1.0
        if head:
            (average,) = head
            output_index = average.output_index
            carry[1 + output_index], write[1 + output_index] = carry[0], 1.0
            if average.weight is not None:
                weights = average().detach().float().cpu()
                kept = range(output_index % average.dilation, output_index, average.dilation)  # all but X_j
                carry[0] = 0.0
                carry[0, [1 + index for index in kept]] = weights[:-1]
                carry[0, 0] = write[0] = weights[-1]
        ones = stream.new_ones(*stream.shape[:-1], 1, dtype=torch.float32)
        read, carry, write = (coefficient.to(stream.device) for coefficient in (torch.eye(size)[0], carry, write))
        return StreamCoefficients(ones * read, ones.unsqueeze(-1) * carry, ones * write)


def weighted_average(sources: tuple[torch.Tensor, ...], weights: torch.Tensor) -> torch.Tensor:
    """sum_i weights_i sources_i, newest first: at DenseFormer's init (1 on the newest, 0 on the others) the newest
    itself, bit for bit."""
    mixed = sources[-1] * weights[-1]
    for source, weight in zip(sources[:-1], weights[:-1], strict=True):
        mixed = mixed + source * weight
    return mixed


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
    "rezero": NormFreeScaledOutputRule(per_channel=False),
    "rezero_prenorm": ScaledOutputRule(per_channel=False),
    "layerscale": ScaledOutputRule(per_channel=True),
    "highway": HighwayRule(),
    "denseformer": DepthWeightedAverageRule(),
    "denseformer_sublayers": DenseFormerRule(),
    "mhc": HyperConnectionRule(),
    "mhc_lite": PermutationMixRule(),
}
