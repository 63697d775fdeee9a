"""Attention Residuals (Kimi Team, arXiv 2603.15031) wired around the decoder layers of a source family.

AttnRes changes only how each sublayer's input is formed. Instead of one residual stream that every sublayer adds to,
each attention and each MLP sublayer reads a softmax mixture over depth of the earlier representations:

    h = sum_i softmax_i(w . RMSNorm(v_i)) * v_i        (paper Eqs. 2-4; w: a learned, input-independent pseudo-query)

Block AttnRes (paper §3.2) keeps as sources the token embedding b_0, one sum per completed block b_1..b_{n-1} and the
partial sum of the current block; Full AttnRes keeps every sublayer output. The mix itself is depth_mixing.py's (run
by depth_mix_backends.py, for the rules of depth_rules.py); this file wires it into the decoder layers. Attention,
MLP/MoE, norms, RoPE, masks and the KV cache are the source family's own modules, under the source checkpoint's
parameter names, built as the family's row of `FAMILIES` says.

This file is copied next to the weights as remote code, with configuration_attnres.py, the three depth files
and families.py (and rules.py, which the configuration imports): it imports only torch, transformers and those.
"""

import importlib
import inspect
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch
import transformers
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.masking_utils import (
    create_causal_mask,
    create_recurrent_attention_mask,
    create_sliding_window_causal_mask,
)
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.utils import can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg

from .configuration_attnres import AttnResConfig, AttnResConfigError, layer_types_of, require_transformers
from .depth_mix_backends import DepthMixPolicy, mixes_in_one_operator
from .depth_mixing import DepthState
from .depth_rules import DEPTH_RULES, RuleModule
from .families import FAMILIES, RECURRENT_LAYER_TYPES, Family, Mixer

# Saved next to the weights, this file runs on every transformers from OLDEST_TRANSFORMERS on. 5.24 renamed the KV
# cache from `past_key_values` to `cache` (the argument of models, layers and mask builders, and the output field):
# the cache travels under the installed version's name.
CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"
# The forwards take `cache` and accept `past_key_values` for it: with a deprecation warning from 5.24 on, as the stock
# models do, and silently before, where `generate` passes that name (`deprecate_kwarg` is silent past its version).
accepts_past_key_values = deprecate_kwarg(
    "past_key_values", "5.40.0" if CACHE_NAME == "cache" else transformers.__version__, new_name="cache"
)

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # before 5.21 each model slices itself, for an int or a 1D tensor of positions

    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep: int | torch.Tensor) -> torch.Tensor:
        return hidden_states[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep]


# --------------------------------------------------------------------------------------------------------------------
# Seam: transformers' private parts, the rest of those these files take (configuration_attnres.py says why here).
# Below this block the file names only the hooks of MODEL_HOOKS, in its classes.
# --------------------------------------------------------------------------------------------------------------------

# What transformers' own models decorate their forwards with and record outputs by: it does not export them
from transformers.utils.generic import merge_with_config_defaults  # noqa: E402
from transformers.utils.output_capturing import OutputRecorder, capture_outputs  # noqa: E402

# The class attributes and methods through which a model tells transformers what it supports and how its weights
# start: private by name, and transformers' only way. The classes below define these, and no other private name.
MODEL_HOOKS = (
    "_no_split_modules",
    "_supports_flash_attn",
    "_supports_sdpa",
    "_supports_flex_attn",
    "_supports_attention_backend",
    "_can_compile_fullgraph",
    "_is_stateful",  # read before transformers 5.25 only (below)
    "_can_record_outputs",
    "_tied_weights_keys",
    "_tp_plan",
    "_sdpa_can_dispatch",
    "_flex_attn_can_dispatch",
    "_init_weights",
)


def declares_support(model_class: type[PreTrainedModel], backend: str) -> bool:
    """Whether a transformers model class declares that it runs attention backend `backend` ("sdpa", "flex_attn")."""
    hook = f"_supports_{backend}"
    require_transformers(hasattr(model_class, hook), f"PreTrainedModel.{hook}")
    return getattr(model_class, hook)


# Before 5.25 `generate` refused assisted decoding for a model whose `_is_stateful` says its recurrent states cannot
# step back to an earlier token; 5.25 records the states and rolls them back, and reads the hook no more.
REFUSES_STATEFUL_ASSISTED_DECODING = hasattr(PreTrainedModel, "_is_stateful")


def is_stateful(model_class: type[PreTrainedModel]) -> bool:
    """Whether a transformers model class keeps recurrent states that `generate` cannot step back (before 5.25)."""
    return model_class._is_stateful


def share_backends(config: AttnResConfig) -> None:
    """Hand the attention and experts backends that transformers chose for the model to the source config, which the
    source family's modules read: transformers writes its choice past the setter that would hand it on."""
    text_config, backends = config.text_config, (config._attn_implementation, config._experts_implementation)
    text_config._attn_implementation_internal, text_config._experts_implementation_internal = backends
    shared = (text_config._attn_implementation, text_config._experts_implementation) == backends
    require_transformers(shared, "PreTrainedConfig._attn_implementation_internal / _experts_implementation_internal")


def init_weights_as_family(family_model_cls: type[PreTrainedModel], text_config, module: nn.Module) -> None:
    """Initialise `module` by the source family's own rules (MoE experts, Gemma3's (1 + w) norms and per-type RoPE):
    its PreTrainedModel's `_init_weights`, run by an instance of it that carries nothing but the source config."""
    require_transformers(hasattr(family_model_cls, "_init_weights"), "PreTrainedModel._init_weights")
    family_initializer = family_model_cls.__new__(family_model_cls)
    family_initializer.__dict__["config"] = text_config
    family_model_cls._init_weights(family_initializer, module)


# --------------------------------------------------------------------------------------------------------------------
# Seam: the source families' modules. The family table (families.py, data) names them; `family_part` is the one reach
# into `transformers.models.*`, each part checked, so that a release that moved or renamed one stops naming it.
# --------------------------------------------------------------------------------------------------------------------


def family_of(config: AttnResConfig) -> Family:
    return FAMILIES[config.text_config.model_type]


def family_part(family: Family, name: str):
    """The class or function `name` of transformers' modeling module of the family, which AttnRes runs (its decoder
    layers, norms, RoPE, initialisation, MoE loss)."""
    module_name = f"transformers.models.{family.module_name}.modeling_{family.module_name}"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError:
        module = None
    require_transformers(hasattr(module, name), f"{module_name}.{name} (the {family.class_prefix} family's)")
    return getattr(module, name)


def family_class(family: Family, suffix: str) -> type:
    """The family's class of that name, e.g. "DecoderLayer" -> Qwen3MoeDecoderLayer."""
    return family_part(family, family.class_prefix + suffix)


def uses_rope(family: Family, text_config) -> bool:
    """Whether the source's attention layers rotate their queries and keys."""
    if family.rope_needs_theta:
        return (getattr(text_config, "rope_parameters", None) or {}).get("rope_theta") is not None
    if family.rope_switch is None:
        return family.rotary_embedding
    key, value = family.rope_switch
    return getattr(text_config, key) == value


def sum_outputs(outputs: Iterable[torch.Tensor]) -> torch.Tensor:
    """The outputs added in order, as the source adds them (GraniteMoeHybrid: experts, then the shared MLP)."""
    outputs = iter(outputs)
    total = next(outputs)
    for output in outputs:
        total = total + output
    return total


def depth_mix_policy(config: AttnResConfig, num_tokens: int = 2) -> DepthMixPolicy:
    """How the depth mixes run, read from the config at every forward: setting them on a loaded model's config takes
    effect, as `use_cache` does. The backend is `attnres_implementation`'s.

    A step of one token per sequence (a decoding step) mixes directly, whatever the implementation: there the two
    phases cost more operations than they save (phase 1 scores a layer's two queries once, but the partial sum then
    needs its own norm, product and concatenation), and a decoding step pays for each operation, not for its size
    (SmolLM2-135M, 5 December 2026: 2183 aten operations per token for the source, 3951 in two phases, 3452 directly).

    `one_operator`: each mix is one opaque operator, where the config asks for it and a training step is compiling."""
    config.check_implementation()  # set on a loaded model's config since it was checked
    return DepthMixPolicy(
        backend=config.attnres_implementation if num_tokens > 1 else "naive",
        scale_by_num_sources=config.attnres_scale_by_num_sources,
        recompute=config.attnres_recompute,
        one_operator=config.attnres_compiled_mix == "operator" and mixes_in_one_operator(),
    )


# --------------------------------------------------------------------------------------------------------------------
# Modules
# --------------------------------------------------------------------------------------------------------------------


# The sublayers of a decoder layer, by the name of their depth-mixing heads (`<sublayer>_res_<part>`), in each layout
SUBLAYER_NAMES = {2: ("self_attention", "mlp"), 1: ("branch",)}


class AttnResDecoderLayer(GradientCheckpointingLayer):
    """One decoder layer of the source family (its own attention, MLP and norms), fed by depth attention.

    Two layouts, as the family's row says: two sublayers (attention, then MLP), each reading its own depth mix; or one
    residual branch (attention and MLP in parallel on the same input, or the layer's one mixer), reading one.

    The depth state between layers travels as the call's positional tensors (see `DepthState`): `partial_sum` [B,T,d],
    the running sum of the current block (before layer 0: the embedding, which layer 0 closes as b_0; mHC: its m
    residual streams [B,T,m,d]);
    `completed_inv_rms` [B,T,n] and `*completed_blocks` [B,T,d] each, the completed blocks (in Full mode every
    sublayer output), each kept once and read by every later layer.
    """

    def __init__(self, config: AttnResConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        family = self.family = family_of(config)
        self.layer_type = layer_types_of(config.text_config)[layer_idx]
        # Adopt the source layer's children so parameter names stay the checkpoint's (self_attn.q_proj, mlp, norms).
        source_layer_class = family_class(family, family.decoder_layers.get(self.layer_type, family.decoder_layer))
        type_argument = {"layer_type": self.layer_type} if family.layer_type_argument else {}
        source_layer = source_layer_class(config.text_config, layer_idx, **type_argument)
        for name, child in source_layer.named_children():
            self.add_module(name, child)
        for path, function in family.computed_buffers.items():  # as the source's model registers them (Falcon-H1)
            owner, name = path.rsplit(".", 1)
            buffer = family_part(family, function)(config.text_config)
            self.get_submodule(owner).register_buffer(name, buffer, persistent=False)
        self.norms = family.norms(self.layer_type, lambda name: getattr(source_layer, name, None) is not None)
        # The token mixers (none in a layer that holds only an MLP: Nemotron-H's; several in parallel: Falcon-H1's) and
        # the MLP parts the layer has
        self.mixers = family.mixers(self.layer_type)
        mlp_layer = family.mlp_layers.get(self.layer_type)
        candidates = (mlp_layer,) if mlp_layer else family.mlp
        self.mlp_parts = [name for name in candidates if getattr(source_layer, name, None) is not None]
        # What the depth-mixing rule learns for each sublayer: `<sublayer>_res_<part>` (self_attention, mlp; branch)
        self.rule = DEPTH_RULES[config.attnres_mode].configured(config)
        self.sublayers = SUBLAYER_NAMES[config.sublayers_per_layer()]
        sources, first = config.num_sources(), len(self.sublayers) * layer_idx
        for offset, sublayer in enumerate(self.sublayers):
            for part, module in self.rule.heads(config, sources[first + offset], first + offset).items():
                self.add_module(f"{sublayer}_res_{part}", module)
        self.starts_block = [config.sublayer_starts_block(first + offset) for offset in range(len(self.sublayers))]
        # The norm each sublayer's depth mix is read through (the rule applies it; PostNorm writes with it): its
        # input norm; in a one-branch layer the norm its attention and MLP share, or none where each has its own (GPT-
        # NeoX), which the branch then applies to its parts
        # A one-branch layer whose attention and MLP have a norm each applies them itself, inside the branch (unless
        # its rule reads no norms: ReZero as published)
        self.branch_norms = False
        if len(self.sublayers) == 2:
            self.read_norms = (self.norms.attention_input_norm, self.norms.mlp_input_norm)
        else:
            shared = self.norms.attention_input_norm == self.norms.mlp_input_norm
            self.read_norms = (self.norms.attention_input_norm if shared else None,)
            self.branch_norms = not shared and self.rule.reads_norms
            if config.attnres_mode == "postnorm" and not shared:
                raise AttnResConfigError(
                    "attnres_mode='postnorm' normalises the stream with the input norm of each residual branch, and "
                    f"{config.text_config.model_type}'s one-branch layers have two ({self.norms.attention_input_norm} "
                    f"before attention, {self.norms.mlp_input_norm} before the MLP), so no one norm would stand for "
                    "them: use another rule."
                )

        self.residual_multiplier = (
            None if family.residual_multiplier_key is None
            else getattr(config.text_config, family.residual_multiplier_key)
        )  # fmt: skip

    def _head(self, sublayer: str) -> tuple[nn.Module, ...]:
        # The parts the sublayer has: a rule may learn nothing for some (DenseFormer: for attention sublayers)
        names = (f"{sublayer}_res_{part}" for part in self.rule.parts)
        children = dict(self.named_children())
        return tuple(children[name] for name in names if name in children)

    def _norm(self, name: str | None, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states if name is None else getattr(self, name)(hidden_states)

    def _multiplier(self, key: str | None) -> float | None:
        return None if key is None else getattr(self.config.text_config, key)

    def _mix_tokens(
        self,
        hidden_states: torch.Tensor,
        attention_masks: dict[str, torch.Tensor | None],
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        **kwargs,
    ) -> torch.Tensor:
        """The token mixers' output [B,T,d]: attention's, or a hybrid's recurrent mixer's (which takes no RoPE); where
        several run in parallel (Falcon-H1), their outputs summed in the source's order, each after its multipliers."""
        return sum_outputs(
            self._mixer_output(
                mixer, self._run_mixer(mixer, hidden_states, attention_masks, position_embeddings, kwargs)
            )
            for mixer in self.mixers
        )

    def _run_mixer(
        self,
        mixer: Mixer,
        hidden_states: torch.Tensor,
        attention_masks: dict[str, torch.Tensor | None],
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None,
        kwargs: dict,
    ) -> torch.Tensor:
        """One token mixer's own output, before its output multiplier, on the mask of its type."""
        token_mixer, attention_mask, kwargs = getattr(self, mixer.module), attention_masks.get(mixer.mask), dict(kwargs)
        input_multiplier = self._multiplier(mixer.input_multiplier_key)
        if input_multiplier is not None:
            hidden_states = hidden_states * input_multiplier
        if mixer.mask in RECURRENT_LAYER_TYPES:
            kwargs.pop("position_ids", None)  # as the sources call them: transformers 5.20's reject positions
            return token_mixer(hidden_states=hidden_states, attention_mask=attention_mask, **kwargs)
        if self.family.attention_cache_argument is not None:
            kwargs[self.family.attention_cache_argument] = kwargs.pop(CACHE_NAME, None)
        output, _ = token_mixer(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        return output

    def _mixer_output(self, mixer: Mixer, output: torch.Tensor) -> torch.Tensor:
        """A token mixer's output as the sublayer sums it: after its output multiplier (Falcon-H1's)."""
        output_multiplier = self._multiplier(mixer.output_multiplier_key)
        return output if output_multiplier is None else output * output_multiplier

    def _mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        output = sum_outputs(getattr(self, name)(hidden_states) for name in self.mlp_parts)
        return output[0] if self.family.mlp_returns_tuple else output

    def _sublayer_output(self, sublayer: int, output: torch.Tensor) -> torch.Tensor:
        """What sublayer `sublayer` (0: attention, 1: MLP) adds to the stream: its output after the family's output
        norm, residual dropout and residual multiplier, in the source's order."""
        family = self.family
        output = self._norm((self.norms.attention_output_norm, self.norms.mlp_output_norm)[sublayer], output)
        if family.output_dropouts is not None:
            output = getattr(self, family.output_dropouts[sublayer])(output)
        if self.residual_multiplier is not None:
            output = output * self.residual_multiplier
        return output

    def _run_sublayer(self, index: int, hidden_states: torch.Tensor, *mixer_args, **kwargs) -> torch.Tensor:
        """What sublayer `index` adds to the stream, from the input its depth mix gave it (through its read norm)."""
        if len(self.sublayers) == 2:
            if index == 0:
                return self._sublayer_output(0, self._mix_tokens(hidden_states, *mixer_args, **kwargs))
            return self._sublayer_output(1, self._mlp(hidden_states))
        # One branch: its attention (or single mixer) and its MLP on the same input, each through its own input norm
        # where the layer has two; their outputs summed, as the source adds them in one residual add
        outputs = []
        if self.mixers:
            attention_input = (
                self._norm(self.norms.attention_input_norm, hidden_states) if self.branch_norms else hidden_states
            )
            outputs.append(self._sublayer_output(0, self._mix_tokens(attention_input, *mixer_args, **kwargs)))
        if self.mlp_parts:
            mlp_input = self._norm(self.norms.mlp_input_norm, hidden_states) if self.branch_norms else hidden_states
            outputs.append(self._sublayer_output(1, self._mlp(mlp_input)))
        return sum_outputs(outputs)

    def forward(
        self,
        partial_sum: torch.Tensor,
        completed_inv_rms: torch.Tensor,
        *completed_blocks: torch.Tensor,
        attention_mask: dict[str, torch.Tensor | None] | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> tuple[torch.Tensor, ...]:
        """-> (partial_sum, each sublayer's depth weights (attention, MLP; or the branch's), completed_inv_rms,
        *completed_blocks)

        `attention_mask`: the model's masks by layer type (a recurrent type's 2D padding mask, an attention type's
        mask), of which each token mixer takes its own (`Mixer.mask`).

        The cache (KV, or a hybrid's recurrent state) is in `kwargs` under `CACHE_NAME`, passed on to the token mixer as
        the installed version names it.
        """
        policy, rule = depth_mix_policy(self.config, partial_sum.shape[1]), self.rule
        depth = DepthState(completed_blocks, completed_inv_rms, partial_sum)
        if self.starts_block[0]:
            depth = depth.close_block(self.config.attnres_eps)
        heads = tuple(self._head(sublayer) for sublayer in self.sublayers)
        # Once for all sublayers (AttnRes's phase 1): the MLP's mix reads the same completed blocks as the
        # attention's (a block the MLP closes closes after its mix)
        scores = rule.score(depth, heads) if policy.shares_phase_one else (None,) * len(heads)
        depth_weights = []
        for index, (head, sublayer_scores) in enumerate(zip(heads, scores, strict=True)):
            norm = partial(self._norm, self.read_norms[index])
            # In Full mode the MLP still reads the attention output as its partial sum, which closes after it
            sublayer_input, weights = rule.read(depth, head, norm, sublayer_scores, policy)
            if index and self.starts_block[index]:
                depth = depth.close_block(self.config.attnres_eps)
            output = self._run_sublayer(index, sublayer_input, attention_mask or {}, position_embeddings, **kwargs)
            depth = rule.write(depth, output, head, norm)
            depth_weights.append(weights)

        completed_blocks, completed_inv_rms, partial_sum = depth
        return partial_sum, *depth_weights, completed_inv_rms, *completed_blocks


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
    _can_compile_fullgraph = True
    _can_record_outputs = {
        "hidden_states": OutputRecorder(
            AttnResDecoderLayer, index=0
        ),  # the partial sum (mHC: streams) after each layer
        "attentions": OutputRecorder(None, index=1, class_name="self_attn"),
        "router_logits": [  # the router of an MoE layer: `mlp.gate` (Qwen3-MoE, Mixtral, DeepSeek-V3), `mlp.router`
            OutputRecorder(None, index=0, class_name="mlp.gate"),
            OutputRecorder(None, index=0, class_name="mlp.router"),
        ],
    }

    def __init__(self, config: AttnResConfig, *inputs, **kwargs):
        config.check_attnres()  # what `from_pretrained(folder, attnres_...=...)` or an assignment set since
        super().__init__(config, *inputs, **kwargs)
        share_backends(config)  # the source family's modules read their own (text) config

    if REFUSES_STATEFUL_ASSISTED_DECODING:

        @property
        def _is_stateful(self) -> bool:
            # As the source family's model says: a hybrid's recurrent states cannot step back to an earlier token, so
            # `generate` refuses assisted decoding, which would need that
            return is_stateful(family_class(family_of(self.config), "PreTrainedModel"))

    def _sdpa_can_dispatch(self, is_init_check: bool = False) -> bool:
        # The source family's attention decides: Gemma2's softcapping and GPT-OSS's sinks have no sdpa path, so those
        # models fall back to eager (as their own models do) or refuse an explicit request.
        family = family_of(self.config)
        family_model_cls = family_class(family, "PreTrainedModel")
        if not (family.supports_sdpa and declares_support(family_model_cls, "sdpa")):
            raise ValueError(
                f"{family_model_cls.__name__} (the source family of this AttnRes model) does not support sdpa "
                "attention; use attn_implementation='eager'."
            )
        return super()._sdpa_can_dispatch(is_init_check)

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        family_model_cls = family_class(family_of(self.config), "PreTrainedModel")
        if not declares_support(family_model_cls, "flex_attn"):
            raise ValueError(f"{family_model_cls.__name__} does not support flex attention; use 'eager'.")
        return super()._flex_attn_can_dispatch(is_init_check)

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, RuleModule):  # a rule's own parameters: its module knows their init
            module.init_weights(init)
        else:
            family = family_of(self.config)
            init_weights_as_family(family_class(family, "PreTrainedModel"), self.config.text_config, module)
            # The buffers the source's model computes (Falcon-H1's), on the module that holds them: a layer itself
            # holds nothing of its own, so transformers does not initialise it when loading remote code
            buffers = dict(module.named_buffers(recurse=False))
            for path, function in family.computed_buffers.items():
                name = path.rsplit(".", 1)[-1]
                if name in buffers:
                    init.copy_(buffers[name], family_part(family, function)(self.config.text_config))

    def save_pretrained(self, *args, **kwargs):
        # transformers writes only the saved class's own auto_map entry; loading with AutoModel needs all three.
        self.config.auto_map = dict(AUTO_MAP)
        return super().save_pretrained(*args, **kwargs)


class AttnResModel(AttnResPreTrainedModel):
    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        text_config, family = config.text_config, family_of(config)
        hidden_size = text_config.hidden_size
        # The embedding, the layers and the final norm under the source's names (`embed_tokens`, `layers`, `norm`;
        # GPT-J: `wte`, `h`, `ln_f`)
        padding_idx = text_config.pad_token_id if family.embedding_padding_idx else None
        if family.scaled_embedding:
            embedding = family_class(family, "TextScaledWordEmbedding")(
                text_config.vocab_size, hidden_size, padding_idx, embed_scale=hidden_size**0.5
            )
        else:
            embedding = nn.Embedding(text_config.vocab_size, hidden_size, padding_idx)
        self.add_module(family.embedding, embedding)
        self.embedding_dropout = (
            None if family.embedding_dropout_key is None
            else nn.Dropout(getattr(text_config, family.embedding_dropout_key))
        )  # fmt: skip
        layers = [AttnResDecoderLayer(config, layer_idx) for layer_idx in range(text_config.num_hidden_layers)]
        self.add_module(family.layers, nn.ModuleList(layers))
        # The final aggregation over all blocks, before the final norm (paper §3.2, A1): `output_attn_res_<part>`
        self.rule = DEPTH_RULES[config.attnres_mode].configured(config)
        if self.rule.output_parts:
            output_index = config.num_sublayers()
            for part, module in self.rule.heads(config, config.num_sources()[-1], output_index).items():
                self.add_module(f"output_attn_res_{part}", module)
        final_norm_class = (
            nn.LayerNorm if family.final_norm_class is None else family_class(family, family.final_norm_class)
        )
        final_norm = final_norm_class(hidden_size, eps=getattr(text_config, family.norm_eps_key))
        self.add_module(family.final_norm, final_norm)
        if not self.rule.reads_norms:  # ReZero without norms: the family's norms stay, unread, and need no gradient
            unread = [
                getattr(layer, name)
                for layer in self.layers
                for name in (layer.norms.attention_input_norm, layer.norms.mlp_input_norm)
                if name is not None
            ]
            for norm in (final_norm, *unread):
                norm.requires_grad_(False)
        self.rotary_emb = (
            family_class(family, "RotaryEmbedding")(config=text_config) if uses_rope(family, text_config) else None
        )
        self.gradient_checkpointing = False
        self.post_init()

    @property
    def layers(self) -> nn.ModuleList:
        """The decoder layers, whatever the source names them (`layers`; GPT-J, Falcon: `h`)."""
        # Read as nn.Module reads a registered child: this property shadows the name `layers` itself
        return nn.Module.__getattr__(self, family_of(self.config).layers)

    def get_input_embeddings(self) -> nn.Module:
        return getattr(self, family_of(self.config).embedding)

    def set_input_embeddings(self, value: nn.Module) -> None:
        setattr(self, family_of(self.config).embedding, value)

    def _attention_masks(self, attention_mask, inputs_embeds, cache, position_ids, layer_types) -> dict:
        if isinstance(attention_mask, dict):  # already prepared per layer type, e.g. by `generate`
            return attention_mask
        mask_kwargs = {
            "config": self.config.text_config,
            "inputs_embeds": inputs_embeds,
            "attention_mask": attention_mask,
            CACHE_NAME: cache,
            "position_ids": position_ids,
        }
        builders = {
            "full_attention": create_causal_mask,
            "sliding_attention": create_sliding_window_causal_mask,
            **dict.fromkeys(RECURRENT_LAYER_TYPES, create_recurrent_attention_mask),
        }
        # The masks the token mixers take: none for a layer without one (Nemotron-H's MLP layers), one each for a layer
        # with several (Falcon-H1's Mamba-2 and attention)
        family = family_of(self.config)
        mask_types = {mixer.mask for layer_type in set(layer_types) for mixer in family.mixers(layer_type)}
        return {mask_type: builders[mask_type](**mask_kwargs) for mask_type in mask_types}

    def position_embeddings_by_type(
        self, inputs_embeds: torch.Tensor, position_ids: torch.LongTensor, layer_types: list[str]
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """layer type -> the rotary (cos, sin) its layers use: one per type where the family's rope differs by type
        (Gemma3, OLMo-3: sliding and full attention), else one shared; None for all where the family has no rotary
        embedding (Kimi Linear, Jamba)."""
        if self.rotary_emb is None:
            return dict.fromkeys(layer_types)
        if family_of(self.config).rope_per_layer_type:
            return {t: self.rotary_emb(inputs_embeds, position_ids, t) for t in set(layer_types)}
        shared = self.rotary_emb(inputs_embeds, position_ids)
        return {t: shared for t in set(layer_types)}

    @accepts_past_key_values
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
        embeddings_given = inputs_embeds is not None
        if inputs_embeds is None:
            inputs_embeds = self.get_input_embeddings()(input_ids)
        # Granite: applied to given embeddings too, as there; Falcon-H1: to those looked up from ids only
        if family.embedding_multiplier_key is not None and not (
            embeddings_given and family.embedding_multiplier_on_ids_only
        ):
            inputs_embeds = inputs_embeds * getattr(text_config, family.embedding_multiplier_key)
        if use_cache and cache is None:
            cache = DynamicCache(config=text_config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        layer_types = layer_types_of(text_config)
        attention_masks = self._attention_masks(attention_mask, inputs_embeds, cache, position_ids, layer_types)
        position_embeddings = self.position_embeddings_by_type(inputs_embeds, position_ids, layer_types)

        # The embedding (mHC: m copies of it); layer 0 starts the first block: the embedding becomes b_0
        embedding = inputs_embeds if self.embedding_dropout is None else self.embedding_dropout(inputs_embeds)
        partial_sum = self.rule.start(self.config, embedding)
        completed_inv_rms = inputs_embeds.new_empty(*inputs_embeds.shape[:-1], 0, dtype=torch.float32)  # [B,T,0]
        completed_blocks = ()
        depth_weights = []
        sublayers = self.config.sublayers_per_layer()
        for decoder_layer, layer_type in zip(self.layers, layer_types, strict=True):
            partial_sum, *layer_outputs = decoder_layer(
                partial_sum,
                completed_inv_rms,
                *completed_blocks,
                attention_mask=attention_masks,
                position_embeddings=position_embeddings[layer_type],
                position_ids=position_ids,
                **{CACHE_NAME: cache},
                **kwargs,
            )
            depth_weights += layer_outputs[:sublayers]
            completed_inv_rms, *completed_blocks = layer_outputs[sublayers:]

        depth = DepthState(tuple(completed_blocks), completed_inv_rms, partial_sum)
        output_head = tuple(getattr(self, f"output_attn_res_{part}") for part in self.rule.output_parts)
        final_norm = getattr(self, family.final_norm)
        hidden_states, output_depth_weight = self.rule.finish(
            depth, output_head, final_norm, depth_mix_policy(self.config, inputs_embeds.shape[1])
        )
        return AttnResModelOutputWithPast(
            last_hidden_state=hidden_states,
            **{CACHE_NAME: cache},
            # None for the recurrences, which weigh no sources
            depth_weights=tuple(depth_weights + [output_depth_weight])
            if output_depth_weights and output_depth_weight is not None
            else None,
        )


class AttnResForCausalLM(AttnResPreTrainedModel, GenerationMixin):
    _tp_plan = {"lm_head": "colwise_gather_output"}  # as every supported family's; the layers' plans: the config's

    def __init__(self, config: AttnResConfig):
        super().__init__(config)
        family = family_of(config)
        self.model = AttnResModel(config)
        self.vocab_size = config.text_config.vocab_size
        self.lm_head = nn.Linear(config.text_config.hidden_size, self.vocab_size, bias=family.lm_head_bias)
        self.post_init()

    @property
    def _tied_weights_keys(self) -> dict[str, str]:
        # The LM head is tied (where the config ties it) to the embedding under the source's name (GPT-J: `wte`)
        return {"lm_head.weight": f"model.{family_of(self.config).embedding}.weight"}

    @accepts_past_key_values
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
        if family.logits_divisor_key is not None:
            logits = logits / getattr(text_config, family.logits_divisor_key)
        if family.logits_multiplier_key is not None:
            logits = logits * getattr(text_config, family.logits_multiplier_key)
        softcap = getattr(text_config, "final_logit_softcapping", None)
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap

        loss = aux_loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
        if output_router_logits and family.num_experts_key is not None:
            aux_loss = family_part(family, "load_balancing_loss_func")(
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
            **{CACHE_NAME: getattr(outputs, CACHE_NAME)},
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            router_logits=outputs.router_logits,
            depth_weights=outputs.depth_weights,
        )


# save_pretrained copies this file next to the weights, and config.json maps the Auto classes to these
AttnResModel.register_for_auto_class("AutoModel")
AttnResForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["AttnResPreTrainedModel", "AttnResModel", "AttnResForCausalLM"]
