"""mHC's connection of one sublayer against an independent implementation: lucidrains' `hyper-connections`
(`pip install hyper-connections==0.4.11`; skipped without it), its `ManifoldConstrainedHyperConnections`.

Its formulation is narrower than the paper's, by design: it RMS-normalises each stream on its own (with a gain
1 + gamma, gamma 0 at init) and projects each with one [d, ...] matrix shared by the streams, so its read weight and
output share for stream j, and its mix's column j (what stream j gives the others), come from stream j alone; the
paper, and we, project the flattened, jointly normalised streams [m*d], so every coefficient sees every stream. Ours
holds theirs where phi is block-diagonal (their shared projection in each stream's block) and the streams have equal
RMS (then the two norms agree). Its Sinkhorn-Knopp normalises our rows, then our columns (its matrix is our A
transposed), so its columns are exact where our rows are; on well-conditioned logits both converge to float
precision."""

import pytest
import torch

from attnres.depth_rules import HyperConnection, read_streams, write_streams

hyper_connections = pytest.importorskip("hyper_connections")

BATCH, TOKENS, STREAMS, HIDDEN = 2, 3, 4, 16


def their_connection() -> torch.nn.Module:
    """Their connection of one sublayer, every parameter random (static logits, shared projections, scales), but for
    their norm's gain, which ours does not have: 1 + gamma, gamma = 0."""
    torch.manual_seed(0)
    theirs = hyper_connections.ManifoldConstrainedHyperConnections(STREAMS, dim=HIDDEN, layer_index=1)
    with torch.no_grad():
        for parameter in theirs.parameters():
            parameter.copy_(0.5 * torch.randn_like(parameter))
        theirs.norm.gamma.zero_()
    return theirs


def our_connection(theirs: torch.nn.Module) -> HyperConnection:
    """Ours holding theirs: each coefficient's row of phi is their shared projection in the block of the stream it
    comes from; b = (their read logits, output logits, mix logits transposed); g = their three scales."""
    shared = theirs.dynamic_alpha_fn[0].T  # [1 + m, d]: the read's projection, then one per target of the mix
    weight = torch.zeros(STREAMS * (2 + STREAMS), STREAMS, HIDDEN)  # [coefficient, the stream it reads, d]
    for source in range(STREAMS):
        weight[source, source] = shared[0]
        weight[STREAMS + source, source] = theirs.dynamic_beta_fn
        for target in range(STREAMS):  # our A[target, source] is their mix [source, target]
            weight[2 * STREAMS + target * STREAMS + source, source] = shared[1 + target]
    bias = torch.cat([theirs.static_alpha[:, 0], theirs.static_beta, theirs.static_alpha[:, 1:].T.flatten()])
    gate = torch.stack([theirs.pre_branch_scale[0], theirs.h_post_scale, theirs.residual_scale[0]])
    ours = HyperConnection(HIDDEN, STREAMS, read_stream=1, writes=True, eps=0.0)
    with torch.no_grad():
        ours.weight.copy_(weight.flatten(1))
        ours.bias.copy_(bias)
        ours.gate.copy_(gate)
    return ours


def connect(theirs, ours, streams: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Both connections on streams [B,T,m,d] and one output [B,T,d]. -> (our read, theirs, our written streams,
    theirs)"""
    output = torch.randn(BATCH, TOKENS, HIDDEN)
    with torch.no_grad():
        their_read, write = theirs(streams.transpose(1, 2).flatten(0, 1))  # theirs: [(B m),T,d]
        their_written = write(output).unflatten(0, (BATCH, STREAMS)).transpose(1, 2)
        our_read, _ = read_streams(streams, *ours(), ours.eps)
        our_written = write_streams(streams, output, *ours(), ours.eps)
    return our_read, their_read, our_written, their_written


def test_one_sublayer_reads_and_writes_the_streams_as_lucidrains_mhc_where_their_formulation_is_ours():
    """Streams of equal RMS at every token, the only ones on which their per-stream norm is our joint one: the read
    and the written streams agree to float rounding (3.6e-7 and 4.8e-7 measured; A's entries 0.15 to 0.42, beta 0.15
    to 1.91). One stream at 3 times the others' RMS moves the written streams apart by 0.55 (measured): the
    formulations differ there, by design. (Our A's bias untransposed would be off by 0.31.)"""
    theirs = their_connection()
    ours = our_connection(theirs)
    torch.manual_seed(1)
    streams = torch.randn(BATCH, TOKENS, STREAMS, HIDDEN)
    streams = streams * streams.square().mean(-1, keepdim=True).rsqrt()  # each stream of RMS 1
    our_read, their_read, our_written, their_written = connect(theirs, ours, streams)
    torch.testing.assert_close(our_read, their_read, rtol=0, atol=1e-6)
    torch.testing.assert_close(our_written, their_written, rtol=0, atol=1e-6)

    streams[:, :, 0] *= 3
    our_read, their_read, our_written, their_written = connect(theirs, ours, streams)
    assert (our_written - their_written).abs().max() > 0.1
