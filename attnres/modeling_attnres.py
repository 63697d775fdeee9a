"""Attention Residuals (Kimi Team, arXiv 2603.15031) wired around the decoder layers of a source family.

AttnRes changes only how each sublayer's input is formed. Instead of one residual stream that every sublayer adds to,
each attention and each MLP sublayer reads a softmax mixture over depth of the earlier representations:

    h = sum_i softmax_i(w . RMSNorm(v_i)) * v_i        (paper Eqs. 2-4; w: a learned, input-independent pseudo-query)

Block AttnRes (paper §3.2) keeps as sources the token embedding b_0, one sum per completed block b_1..b_{n-1} and the
partial sum of the current block; Full AttnRes keeps every sublayer output. Attention, MLP/MoE, norms, RoPE, masks
and the KV cache are the source family's own modules, under the source checkpoint's parameter names.

This file is copied next to the weights as remote code: it imports only torch, transformers and its configuration.
"""

import importlib
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_attnres import AttnResConfig

# --------------------------------------------------------------------------------------------------------------------
# Source families: the only place where they differ.
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """How to build one source family's modules and run the two sublayers of its decoder layer."""

    module_name: str  # transformers.models.<module_name>.modeling_<module_name>
    class_prefix: str  # e.g. "Qwen3Moe" for Qwen3MoeDecoderLayer, Qwen3MoeRMSNorm, ...
    attention_input_norm: str = "input_layernorm"
    attention_output_norm: str | None = None  # Gemma3's sandwich norms normalise the sublayer outputs too
    mlp_input_norm: str = "post_attention_layernorm"
    mlp_output_norm: str | None = None
    scaled_embedding: bool = False  # Gemma3 multiplies the token embedding by sqrt(hidden_size)
    rope_per_layer_type: bool = False  # Gemma3: separate RoPE parameters for sliding and full attention layers
    num_experts_key: str | None = None  # MoE families: the config field holding the number of experts

    @property
    def module(self) -> ModuleType:
        return importlib.import_module(f"transformers.models.{self.module_name}.modeling_{self.module_name}")

    def cls(self, suffix: str) -> type:
        return getattr(self.module, self.class_prefix + suffix)


FAMILIES = {
    "llama": Family("llama", "Llama"),
    "mistral": Family("mistral", "Mistral"),
    "qwen2": Family("qwen2", "Qwen2"),
    "qwen3": Family("qwen3", "Qwen3"),
    "qwen3_moe": Family("qwen3_moe", "Qwen3Moe", num_experts_key="num_experts"),
    "mixtral": Family("mixtral", "Mixtral", num_experts_key="num_local_experts"),
    "gemma3_text": Family(
        "gemma3",
        "Gemma3",
        attention_output_norm="post_attention_layernorm",
        mlp_input_norm="pre_feedforward_layernorm",
        mlp_output_norm="post_feedforward_layernorm",
        scaled_embedding=True,
        rope_per_layer_type=True,
    ),
}


def family_of(config: AttnResConfig) -> Family:
    return FAMILIES[config.text_config.model_type]


def attention_layer_types(text_config) -> list[str]:
    """Mask / RoPE type of each decoder layer, as the source family's own model chooses them."""
    if getattr(text_config, "layer_types", None) is not None:
        return list(text_config.layer_types)
    kind = "sliding_attention" if getattr(text_config, "sliding_window", None) else "full_attention"
    return [kind] * text_config.num_hidden_layers


# --------------------------------------------------------------------------------------------------------------------
# Depth attention: the math. Shapes: B batch, T tokens, n completed sources, d hidden size.
# --------------------------------------------------------------------------------------------------------------------


class AttnResPseudoQuery(nn.Linear):
    """The pseudo-query w of one sublayer (paper Eq. 3): a bias-free Linear(d, 1), zero at init (uniform weights)."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1, bias=False)


class AttnResKeyNorm(nn.Module):
    """RMSNorm with a learnable gain, applied to the depth keys only; the values stay raw (paper Eq. 2, A4)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        values = values.float()
        return values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def depth_mix_reference(
    sources: torch.Tensor, pseudo_query: AttnResPseudoQuery, key_norm: AttnResKeyNorm, scale_by_num_sources: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The direct computation (paper Fig. 2): sources [B,T,S,d] -> mixed input [B,T,d], depth weights [B,T,S]."""
    keys = key_norm(sources)  # [B,T,S,d] fp32
    weights = (keys @ pseudo_query.weight[0].float()).softmax(-1)  # [B,T,S]; no 1/sqrt(d)
    mixed = (weights.unsqueeze(-1) * sources.float()).sum(-2)  # [B,T,d]
    if scale_by_num_sources:
        mixed = mixed * sources.shape[-2]
    return mixed.to(sources.dtype), weights


def inverse_rms(values: torch.Tensor, eps: float) -> torch.Tensor:
    """[..., d] -> [...] fp32. One reduction pass, no [..., d] temporary."""
    values = values.float()
    return torch.rsqrt(torch.linalg.vector_norm(values, dim=-1).square() / values.shape[-1] + eps)


class SourceStorage:
    """One forward pass's buffers: the finished sources [B,T,capacity,d], and in backward their summed gradients."""

    def __init__(self, like: torch.Tensor, capacity: int):
        self.values = like.new_empty(*like.shape[:-1], capacity, like.shape[-1])
        self.grads: torch.Tensor | None = None  # allocated by the first backward that reaches a source

    def write(self, slot: int, source: torch.Tensor) -> None:
        with torch.no_grad():
            self.values[..., slot, :] = source

    def grad_slots(self, num_sources: int) -> torch.Tensor:
        if self.grads is None:
            self.grads = torch.zeros_like(self.values)
        return self.grads[..., :num_sources, :]


class CompletedSources:
    """The finished sources: b_0 = the embedding, then one sum per completed block (in Full, every sublayer output).

    Each is copied once into the storage, so a sublayer reads all n of them as one view [B,T,n,d] with no re-stacking,
    and autograd keeps that one buffer, O(n·T·d) per step, instead of a stacked copy per sublayer (O(n²·T·d)).
    In backward every reader adds its gradient into one gradient buffer in place, and each source takes its slot
    once all readers are done; the `anchor` chain (one scalar per source) makes autograd run them in that order.
    """

    def __init__(self, storage: SourceStorage, blocks: tuple[torch.Tensor, ...], inv_rms: torch.Tensor, anchor=None):
        self.storage = storage
        self.blocks = blocks  # the source tensors themselves, for the direct reference path
        self.inv_rms = inv_rms  # [B,T,1,n] fp32, computed once per source, shaped to scale scores [B,T,q,n]
        self.anchor = anchor

    @classmethod
    def empty(cls, like: torch.Tensor, capacity: int) -> "CompletedSources":
        return cls(SourceStorage(like, capacity), (), like.new_empty(*like.shape[:-1], 1, 0, dtype=torch.float32))

    @property
    def stacked(self) -> torch.Tensor:
        return self.storage.values[..., : len(self.blocks), :]  # [B,T,n,d], a view

    def close(self, block: torch.Tensor, eps: float) -> "CompletedSources":
        """Append a finished source [B,T,d]. Slots are written once, so earlier views never see a change.

        Here, in `score` and in `merge_partial_sum`, the autograd functions only run when autograd records: their Python
        overhead (about 20 us a call) would otherwise dominate decoding.
        """
        slot = len(self.blocks)
        if torch.is_grad_enabled():
            anchor = StoreSource.apply(block, self.anchor, self.storage, slot)
        else:
            self.storage.write(slot, block)
            anchor = None
        inv_rms = torch.cat([self.inv_rms, inverse_rms(block, eps)[..., None, None]], dim=-1)
        return CompletedSources(self.storage, self.blocks + (block,), inv_rms, anchor)

    def score(self, queries: torch.Tensor) -> torch.Tensor:
        """Raw scores of folded queries [q,d] against every completed source. -> [B,T,q,n] fp32"""
        if torch.is_grad_enabled():
            return ScoreSources.apply(queries, self.anchor, self.storage, len(self.blocks))
        return source_scores(queries, self.stacked)


def source_scores(queries: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    return queries @ stacked.float().transpose(-1, -2)  # [q,d] . [B,T,n,d] -> [B,T,q,n]


class StoreSource(torch.autograd.Function):
    """Writes a source into its slot; returns the next anchor. Backward hands the slot's summed gradient over.

    Its anchor feeds every later reader and the next source's anchor, so autograd runs this backward only after
    all of them have added their gradients for this slot.
    """

    @staticmethod
    def forward(ctx, block: torch.Tensor, previous_anchor, storage: SourceStorage, slot: int) -> torch.Tensor:
        storage.write(slot, block)
        ctx.storage, ctx.slot = storage, slot
        return block.new_zeros(())

    @staticmethod
    def backward(ctx, grad_anchor: torch.Tensor):
        grad_block = ctx.storage.grad_slots(ctx.slot + 1)[..., ctx.slot, :] if ctx.needs_input_grad[0] else None
        return grad_block, grad_anchor if ctx.needs_input_grad[1] else None, None, None


class ScoreSources(torch.autograd.Function):
    """queries [q,d] . the first n stored sources -> [B,T,q,n] fp32.

    The storage is kept on ctx, not saved: later slots are written after this call, which `save_for_backward`'s
    version check would reject although the n slots read here never change.
    """

    @staticmethod
    def forward(ctx, queries: torch.Tensor, anchor, storage: SourceStorage, num_sources: int) -> torch.Tensor:
        queries = queries.detach()  # see MergePartialSum.forward
        ctx.save_for_backward(queries)
        ctx.storage, ctx.num_sources = storage, num_sources
        return source_scores(queries, storage.values[..., :num_sources, :])

    @staticmethod
    def backward(ctx, grad_scores: torch.Tensor):
        (queries,) = ctx.saved_tensors
        stacked = ctx.storage.values[..., : ctx.num_sources, :]
        grad_queries = (grad_scores @ stacked.float()).sum(dim=(0, 1)) if ctx.needs_input_grad[0] else None
        grad_anchor = None
        if ctx.needs_input_grad[1]:
            ctx.storage.grad_slots(ctx.num_sources).add_(grad_scores.transpose(-1, -2) @ queries)
            grad_anchor = grad_scores.new_zeros(())  # reaches StoreSource, which runs once every reader is done
        return grad_queries, grad_anchor, None, None


def folded_queries(*depth_heads: tuple[AttnResPseudoQuery, AttnResKeyNorm]) -> torch.Tensor:
    """w . (g * v / rms(v)) = (w * g) . v / rms(v): each key-norm gain folds into its query. -> [q,d] fp32"""
    pseudo_queries = torch.cat([pseudo_query.weight for pseudo_query, _ in depth_heads])
    gains = torch.stack([key_norm.weight for _, key_norm in depth_heads])
    return pseudo_queries.float() * gains.float()


def score_completed_blocks(completed: CompletedSources, queries: torch.Tensor) -> torch.Tensor:
    """Phase 1: logits of several folded queries [q,d] against all completed blocks, in one pass. -> [B,T,q,n] fp32"""
    return completed.score(queries) * completed.inv_rms


def merge_partial_sum(
    block_logits: torch.Tensor,
    completed: CompletedSources,
    partial_sum: torch.Tensor | None,
    query: torch.Tensor,
    eps: float,
    scale_by_num_sources: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Phase 2: the partial sum [B,T,d] joins the softmax over the completed blocks' logits [B,T,n].

    One softmax over n + 1 logits equals the paper's online-softmax merge of the two groups; the mixture is then one
    weighted read of the blocks plus the partial sum. -> mixed input [B,T,d], depth weights [B,T,n(+1)]
    """
    if torch.is_grad_enabled():
        return MergePartialSum.apply(
            block_logits, partial_sum, query, completed.anchor, completed.storage, len(completed.blocks), eps,
            scale_by_num_sources,
        )  # fmt: skip
    return merged_input(block_logits, completed.stacked, partial_sum, query, eps, scale_by_num_sources)[:2]


def merged_input(
    block_logits: torch.Tensor,
    stacked: torch.Tensor,
    partial_sum: torch.Tensor | None,
    query: torch.Tensor,
    eps: float,
    scale_by_num_sources: bool,
) -> tuple[torch.Tensor, ...]:
    """`merge_partial_sum` on the stacked blocks [B,T,n,d]. -> mixed [B,T,d], weights [B,T,S], and for backward:
    value weights [B,T,S] (model dtype), the partial sum's raw logit w.p and inverse RMS [B,T] (None without one)"""
    logits, raw_logit, inv_rms = block_logits, None, None
    if partial_sum is not None:
        raw_logit = partial_sum.float() @ query  # [B,T]
        inv_rms = inverse_rms(partial_sum, eps)  # [B,T]
        logits = torch.cat([block_logits, (raw_logit * inv_rms).unsqueeze(-1)], dim=-1)
    weights = logits.softmax(-1)  # [B,T,S]
    # At zero queries softmax * S is exactly 1 per source (for the source counts AttnRes uses): the exact stream.
    value_weights = (weights * weights.shape[-1] if scale_by_num_sources else weights).to(stacked.dtype)
    num_blocks = stacked.shape[-2]
    mixed = (value_weights[..., None, :num_blocks] @ stacked).squeeze(-2)  # [B,T,1,n] . [B,T,n,d] -> [B,T,d]
    if partial_sum is not None:
        mixed = torch.addcmul(mixed, value_weights[..., num_blocks:], partial_sum)
    return mixed, weights, value_weights, raw_logit, inv_rms


class MergePartialSum(torch.autograd.Function):
    """Phase 2 as one autograd node: its backward reads the stored blocks once and hands the partial sum one gradient.

    Left to autograd, the dozen small steps of `merged_input` each keep their inputs and each send the partial sum a
    gradient of its own, summed pass by pass; here the backward is written out (softmax, RMS and read rules) and saves
    only [B,T,S]-sized statistics beside the partial sum. Storage handling as in ScoreSources.
    """

    @staticmethod
    def forward(ctx, block_logits, partial_sum, query, anchor, storage: SourceStorage, num_blocks: int, eps, scale):
        # Detached: matmul takes a several times slower path when an operand requires grad, even with autograd off.
        block_logits, partial_sum, query = (
            None if t is None else t.detach() for t in (block_logits, partial_sum, query)
        )
        stacked = storage.values[..., :num_blocks, :]
        mixed, weights, value_weights, raw_logit, inv_rms = merged_input(
            block_logits, stacked, partial_sum, query, eps, scale
        )
        ctx.save_for_backward(weights, value_weights, partial_sum, query, raw_logit, inv_rms)
        ctx.storage, ctx.num_blocks, ctx.scale = storage, num_blocks, weights.shape[-1] if scale else 1
        ctx.set_materialize_grads(False)
        return mixed, weights

    @staticmethod
    def backward(ctx, grad_mixed: torch.Tensor | None, grad_weights: torch.Tensor | None):
        weights, value_weights, partial_sum, query, raw_logit, inv_rms = ctx.saved_tensors
        num_blocks = ctx.num_blocks
        stacked = ctx.storage.values[..., :num_blocks, :]
        if grad_mixed is None:
            grad_mixed = torch.zeros_like(stacked[..., 0, :])
        # Read: mixed = sum_i value_weights_i * source_i
        grad_value_weights = (stacked @ grad_mixed.unsqueeze(-1)).squeeze(-1).float()  # [B,T,n]
        if partial_sum is not None:
            grad_partial_weight = torch.linalg.vecdot(partial_sum, grad_mixed).float()  # [B,T]
            grad_value_weights = torch.cat([grad_value_weights, grad_partial_weight.unsqueeze(-1)], dim=-1)
        if grad_weights is None:  # the depth weights were not used downstream
            grad_weights = grad_value_weights * ctx.scale
        else:
            grad_weights = grad_weights + grad_value_weights * ctx.scale
        # Softmax
        grad_logits = weights * (grad_weights - (weights * grad_weights).sum(-1, keepdim=True))  # [B,T,S]
        grad_partial = grad_query = grad_anchor = None
        if partial_sum is not None:
            # logit = (p . w) * inv_rms(p), inv_rms = (|p|^2 / d + eps)^-1/2: d inv_rms / dp = -inv_rms^3 p / d
            grad_logit = grad_logits[..., num_blocks]  # [B,T]
            grad_raw_logit = grad_logit * inv_rms
            grad_rms_coefficient = grad_logit * raw_logit * inv_rms.pow(3) / -partial_sum.shape[-1]
            partial = partial_sum.float()
            if ctx.needs_input_grad[2]:
                grad_query = grad_raw_logit.reshape(-1) @ partial.reshape(-1, partial.shape[-1])  # [d]
            if ctx.needs_input_grad[1]:
                grad_partial = grad_mixed.float() * value_weights[..., num_blocks:].float()
                grad_partial = torch.addcmul(grad_partial, grad_raw_logit.unsqueeze(-1), query)
                grad_partial = torch.addcmul(grad_partial, grad_rms_coefficient.unsqueeze(-1), partial)
                grad_partial = grad_partial.to(partial_sum.dtype)
        if ctx.needs_input_grad[3]:
            ctx.storage.grad_slots(num_blocks).addcmul_(
                value_weights[..., :num_blocks].unsqueeze(-1), grad_mixed.unsqueeze(-2)
            )
            grad_anchor = grad_mixed.new_zeros(())  # reaches StoreSource, which runs once every reader is done
        grad_block_logits = grad_logits[..., :num_blocks] if ctx.needs_input_grad[0] else None
        return grad_block_logits, grad_partial, grad_query, grad_anchor, None, None, None, None


def depth_attention(
    config: AttnResConfig,
    completed: CompletedSources,
    partial_sum: torch.Tensor | None,
    pseudo_query: AttnResPseudoQuery,
    key_norm: AttnResKeyNorm,
    phase_one: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The input of one sublayer: its sources are the completed blocks, then the partial sum if there is one.

    `phase_one`: this sublayer's folded query [d] and block logits [B,T,n] when its layer already scored them.
    """
    scale = config.attnres_scale_by_num_sources
    if config.attnres_implementation == "naive":
        sources = torch.stack(completed.blocks + ((partial_sum,) if partial_sum is not None else ()), dim=-2)
        return depth_mix_reference(sources, pseudo_query, key_norm, scale)
    if phase_one is None:
        query = folded_queries((pseudo_query, key_norm))
        phase_one = query[0], score_completed_blocks(completed, query)[..., 0, :]
    query, block_logits = phase_one
    return merge_partial_sum(block_logits, completed, partial_sum, query, key_norm.eps, scale)


# --------------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------------


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """One decoder layer of the source family (its own attention, MLP and norms), fed by depth attention.

    The depth state between layers: `completed` (b_0 = embedding, then one sum per finished block; in Full mode every
    sublayer output) and `partial_sum` [B,T,d], the running sum of the current block (before layer 0: the embedding,
    which layer 0 moves into the completed sources).
    """

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.family = family_of(config)
        # Adopt the source layer's children so parameter names stay the checkpoint's (self_attn.q_proj, mlp, norms).
        source_layer = self.family.cls("DecoderLayer")(config.text_config, layer_idx)
        for name, child in source_layer.named_children():
            self.add_module(name, child)
        hidden_size = config.text_config.hidden_size
        self.self_attention_res_proj = AttnResPseudoQuery(hidden_size)
        self.self_attention_res_norm = AttnResKeyNorm(hidden_size, config.attnres_eps)
        self.mlp_res_proj = AttnResPseudoQuery(hidden_size)
        self.mlp_res_norm = AttnResKeyNorm(hidden_size, config.attnres_eps)
        self.attention_starts_block = config.sublayer_starts_block(2 * layer_idx)
        self.mlp_starts_block = config.sublayer_starts_block(2 * layer_idx + 1)

    def _norm(self, name: str | None, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if name is None else getattr(self, name)(hidden_states)

    def forward(
        self,
        partial_sum: torch.Tensor,
        completed: CompletedSources,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, ...]:
        config, family, eps = self.config, self.family, self.config.attnres_eps
        if self.attention_starts_block:
            completed = completed.close(partial_sum, eps)
            partial_sum = None

        phase_one = [None, None]
        if config.attnres_implementation == "two_phase":  # both pseudo-queries of this layer in one pass
            queries = folded_queries(
                (self.self_attention_res_proj, self.self_attention_res_norm), (self.mlp_res_proj, self.mlp_res_norm)
            )
            block_logits = score_completed_blocks(completed, queries).unbind(-2)
            phase_one = list(zip(queries, block_logits, strict=True))

        # Attention sublayer
        attention_input, attention_depth_weights = depth_attention(
            config, completed, partial_sum, self.self_attention_res_proj, self.self_attention_res_norm, phase_one[0],
        )  # fmt: skip
        attention_output, _ = self.self_attn(
            hidden_states=self._norm(family.attention_input_norm, attention_input),
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            cache=cache,
            **kwargs,
        )
        attention_output = self._norm(family.attention_output_norm, attention_output)
        partial_sum = attention_output if partial_sum is None else partial_sum + attention_output

        # MLP sublayer
        mlp_input, mlp_depth_weights = depth_attention(
            config, completed, partial_sum, self.mlp_res_proj, self.mlp_res_norm, phase_one[1],
        )  # fmt: skip
        if self.mlp_starts_block:  # Full AttnRes: from here on the attention output is a source of its own
            completed = completed.close(partial_sum, eps)
            partial_sum = None
        mlp_output = self.mlp(self._norm(family.mlp_input_norm, mlp_input))
        mlp_output = self._norm(family.mlp_output_norm, mlp_output)
        partial_sum = mlp_output if partial_sum is None else partial_sum + mlp_output

        return partial_sum, completed, attention_depth_weights, mlp_depth_weights


@dataclass
class AttnResModelOutputWithPast(MoeModelOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, returned with `output_depth_weights=True`):
        One tensor per sublayer (A0, M0, A1, ..., then the output aggregation), of shape `(batch, seq_len, sources)`:
        the softmax weights over that sublayer's sources, in order: embedding, completed blocks, partial sum.
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


@dataclass
class AttnResCausalLMOutputWithPast(MoeCausalLMOutputWithPast):
    r"""
    depth_weights (`tuple(torch.FloatTensor)`, returned with `output_depth_weights=True`):
        See [`AttnResModelOutputWithPast`].
    """

    depth_weights: tuple[torch.FloatTensor, ...] | None = None


AUTO_MAP = {
    "AutoConfig": "configuration_attnres.AttnResConfig",
    "AutoModel": "modeling_attnres.AttnResModel",
    "AutoModelForCausalLM": "modeling_attnres.AttnResForCausalLM",
}


class AttnResPreTrainedModel(PreTrainedModel):
    config_class = AttnResConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["AttnResDecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = False
    _can_record_outputs = {
        "hidden_states": OutputRecorder(AttnResDecoderLayer, index=0),  # the partial sum after each layer
        "attentions": OutputRecorder(None, index=1, class_name="self_attn"),
        "router_logits": OutputRecorder(None, index=0, class_name="mlp.gate"),
    }

    def __init__(self, config: AttnResConfig, *inputs, **kwargs):
        super().__init__(config, *inputs, **kwargs)
        # The source family's modules read their own (text) config: keep its attention and experts backends in step.
        config.text_config._attn_implementation_internal = config._attn_implementation
        config.text_config._experts_implementation_internal = config._experts_implementation

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, AttnResPseudoQuery):
            init.zeros_(module.weight)  # "all pseudo-query vectors must be initialized to zero" (paper §5)
        elif isinstance(module, AttnResKeyNorm):
            init.ones_(module.weight)
        else:
            # The source family's own rules (MoE experts, Gemma3's (1 + w) norms and per-type RoPE), applied by an
            # instance of its PreTrainedModel that carries nothing but the source config.
            family_model_cls = family_of(self.config).cls("PreTrainedModel")
            family_initializer = family_model_cls.__new__(family_model_cls)
            family_initializer.__dict__["config"] = self.config.text_config
            family_model_cls._init_weights(family_initializer, module)

    def _activation_checkpointing_enable(self, activation_checkpointing_kwargs=None, *args, **kwargs):
        if (activation_checkpointing_kwargs or {}).get("use_reentrant"):
            # Reentrant checkpointing tracks only tensor arguments, and a layer receives its sources as one object.
            raise ValueError(
                "AttnRes supports activation checkpointing with use_reentrant=False only (the default): pass "
                "activation_checkpointing_kwargs={'use_reentrant': False} or leave it unset."
            )
        super()._activation_checkpointing_enable(activation_checkpointing_kwargs, *args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        # transformers writes only the saved class's own auto_map entry; loading with AutoModel needs all three.
        self.config.auto_map = dict(AUTO_MAP)
        return super().save_pretrained(*args, **kwargs)


class AttnResModel(AttnResPreTrainedModel):
    _auto_class = "AutoModel"

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        text_config, family = config.text_config, family_of(config)
        hidden_size = text_config.hidden_size
        if family.scaled_embedding:
            self.embed_tokens = family.cls("TextScaledWordEmbedding")(
                text_config.vocab_size, hidden_size, text_config.pad_token_id, embed_scale=hidden_size**0.5
            )
        else:
            self.embed_tokens = nn.Embedding(text_config.vocab_size, hidden_size, text_config.pad_token_id)
        self.layers = nn.ModuleList(
            [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(text_config.num_hidden_layers)]
        )
        # The final aggregation over all blocks, before the final norm (paper §3.2, A1)
        self.output_attn_res_proj = AttnResPseudoQuery(hidden_size)
        self.output_attn_res_norm = AttnResKeyNorm(hidden_size, config.attnres_eps)
        self.norm = family.cls("RMSNorm")(hidden_size, eps=text_config.rms_norm_eps)
        self.rotary_emb = family.cls("RotaryEmbedding")(config=text_config)
        self.source_capacity = config.num_sources()[-1]  # fixed with the layers' block boundaries, as they are
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embed_tokens

    def set_input_embeddings(self, value: nn.Module) -> None:
        self.embed_tokens = value

    def _attention_masks(self, attention_mask, inputs_embeds, cache, position_ids, layer_types) -> dict:
        if isinstance(attention_mask, dict):  # already prepared per layer type, e.g. by `generate`
            return attention_mask
        mask_kwargs = {
            "config": self.config.text_config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            "cache": cache,
            "position_ids": position_ids,
        }
        builders = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}
        return {layer_type: builders[layer_type](**mask_kwargs) for layer_type in set(layer_types)}

    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_depth_weights: bool | None = None,
        **kwargs,
    ) -> AttnResModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        text_config, family = self.config.text_config, family_of(self.config)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=text_config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        layer_types = attention_layer_types(text_config)
        attention_masks = self._attention_masks(attention_mask, inputs_embeds, cache, position_ids, layer_types)
        if family.rope_per_layer_type:
            position_embeddings = {t: self.rotary_emb(inputs_embeds, position_ids, t) for t in set(layer_types)}
        else:
            shared = self.rotary_emb(inputs_embeds, position_ids)
            position_embeddings = {t: shared for t in set(layer_types)}

        partial_sum = inputs_embeds  # layer 0 starts the first block: the embedding becomes b_0
        completed = CompletedSources.empty(inputs_embeds, capacity=self.source_capacity)
        depth_weights = []
        for decoder_layer, layer_type in zip(self.layers, layer_types, strict=True):
            partial_sum, completed, *layer_depth_weights = decoder_layer(
                partial_sum,
                completed,
                attention_mask=attention_masks[layer_type],
                position_embeddings=position_embeddings[layer_type],
                position_ids=position_ids,
                cache=cache,
                **kwargs,
            )
            depth_weights += layer_depth_weights

        hidden_states, output_depth_weight = depth_attention(
            self.config, completed, partial_sum, self.output_attn_res_proj, self.output_attn_res_norm,
        )  # fmt: skip
        hidden_states = self.norm(hidden_states)
        return AttnResModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache,
            depth_weights=tuple(depth_weights + [output_depth_weight]) if output_depth_weights else None,
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _auto_class = "AutoModelForCausalLM"
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.text_config.vocab_size
        self.lm_head = nn.Linear(config.text_config.hidden_size, self.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        output_depth_weights: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs,
    ) -> AttnResCausalLMOutputWithPast:
        text_config, family = self.config.text_config, family_of(self.config)
        if output_router_logits is None:
            output_router_logits = getattr(text_config, "output_router_logits", False)
        outputs: AttnResModelOutputWithPast = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
            output_depth_weights=output_depth_weights,
            **kwargs,
        )
        hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        logits = self.lm_head(hidden_states)
        softcap = getattr(text_config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap

        loss = aux_loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if output_router_logits and family.num_experts_key is not None:
            aux_loss = family.module.load_balancing_loss_func(
                outputs.router_logits,
                getattr(text_config, family.num_experts_key),
                text_config.num_experts_per_tok,
                attention_mask,
            )
            if labels is not None:
                loss = loss + text_config.router_aux_loss_coef * aux_loss.to(loss.device)

        return AttnResCausalLMOutputWithPast(
            loss=loss,
            aux_loss=aux_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            depth_weights=outputs.depth_weights,
        )


__all__ = ["AttnResPreTrainedModel", "AttnResModel", "AttnResForCausalLM", "FAMILIES"]
