"""Configuration of Block / Full Attention Residuals (Kimi Team, arXiv 2603.15031) around a source architecture.

`AttnResConfig` nests the full config of the source family (`text_config`, as multimodal configs do) and adds the
AttnRes settings. Attributes of the source architecture (`hidden_size`, `vocab_size`, ...) read through to
`text_config`, so code written for the source model keeps working on `model.config`.

It checks a config against `FAMILIES` (families.py, the source families AttnRes supports) and `RULES` (rules.py, the
depth-mixing rules and their options), both data. This file is copied next to the weights as remote code, with the
files it imports: it imports only `transformers`, `packaging` (which transformers requires), the standard library and
those two.
"""

import math

import transformers
from packaging.version import Version

from .families import ALIBI, ENCODER, FAMILIES, OLDEST_TRANSFORMERS, POST_NORM, REFUSED_FAMILIES, SUPPORTED_FAMILIES
from .rules import (
    ATTNRES_MODES,
    ATTNRES_OPTIONS,
    DEFAULT_NUM_STREAMS,
    MAX_PERMUTATION_STREAMS,
    MOVED_NAMES,
    NAMING,
    NAMING_KEY,
    OPTION_MODES,
    RULE_OPTIONS,
    RULES,
    stream_mix_rows,
)

# --------------------------------------------------------------------------------------------------------------------
# Seam: transformers' private parts. This file, modeling_attnres.py and the three depth files (with families.py and
# rules.py, data) travel without the attnres package (whose seams are attnres/compat/), to whatever transformers a Hub
# user has;
# what they take of transformers that transformers keeps for itself is in this block and the one at the top of
# modeling_attnres.py, each part checked, so that a release without it stops with the version needed
# (tests/test_seams.py holds the files to that).
# --------------------------------------------------------------------------------------------------------------------

# Stop at import, naming the fix, where these files cannot run (see OLDEST_TRANSFORMERS)
if Version(transformers.__version__) < Version(OLDEST_TRANSFORMERS):
    raise ImportError(
        f"AttnRes models need transformers>={OLDEST_TRANSFORMERS}, found {transformers.__version__}: "
        f'pip install -U "transformers>={OLDEST_TRANSFORMERS}"'
    )


def require_transformers(present: bool, what: str) -> None:
    """Stop, naming the releases to install, where the installed transformers lacks a private part of these files."""
    if not present:
        raise ImportError(
            f"transformers {transformers.__version__} has no {what}, which AttnRes models rely on: "
            f'pip install "transformers>={OLDEST_TRANSFORMERS},<{transformers.__version__}"'
        )


# Imported once the version is known to be one these files run on
from transformers import AutoConfig, PreTrainedConfig, configuration_utils  # noqa: E402

# How a config declares a nested config of its own (`text_config`): transformers does not export it
require_transformers(hasattr(configuration_utils, "SubConfigSpec"), "configuration_utils.SubConfigSpec")
SubConfigSpec = configuration_utils.SubConfigSpec

# --------------------------------------------------------------------------------------------------------------------
# The settings: their bounds, and the checks of a config (the families and the rules are families.py's and rules.py's)
# --------------------------------------------------------------------------------------------------------------------

IMPLEMENTATIONS = ("two_phase", "naive", "fla")
# What flash-linear-attention's kernel computes: the paper's AttnRes, none of its ablations
FLA_SETTINGS = {
    "attnres_query": "pseudo",
    "attnres_score": "softmax",
    "attnres_key_norm": True,
    "attnres_depth_heads": 1,
}
# mHC's projections may outweigh the source this many times at most: beyond, the stream count is a typo or out of
# memory (1000 streams on SmolLM2-135M would need 4e12 parameters)
MAX_STREAM_PARAMETERS_RATIO = 4
# The keys of `attnres_saved_layout` (`AttnResConfig.depth_layout`)
LAYOUT_KEYS = ("attnres_mode", "attnres_block_size", *RULE_OPTIONS, NAMING_KEY)


def _is_integer(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


COMPILED_MIXES = ("inline", "operator")
DEFAULT_NUM_BLOCKS = 8


class AttnResConfigError(ValueError):
    """A config AttnRes cannot run with: a setting out of range, an unsupported source family, or a config.json whose
    depth layout was edited away from the layout of the weights saved beside it."""


def layer_types_of(text_config: PreTrainedConfig) -> list[str]:
    """Mask / RoPE type of each decoder layer, as the source family's own model chooses them."""
    if getattr(text_config, "layer_types", None) is not None:
        return list(text_config.layer_types)
    kind = "sliding_attention" if getattr(text_config, "sliding_window", None) else "full_attention"
    return [kind] * text_config.num_hidden_layers


def _refusal(text_config: PreTrainedConfig) -> str | None:
    """Why a source architecture cannot convert exactly, from its config alone; None where nothing says so."""
    model_type = text_config.model_type
    if model_type == "opt" and not getattr(text_config, "do_layer_norm_before", True):
        return POST_NORM
    if model_type == "falcon" and getattr(text_config, "alibi", False):
        return ALIBI
    if model_type not in SUPPORTED_FAMILIES and getattr(text_config, "is_encoder_decoder", False):
        return ENCODER
    return REFUSED_FAMILIES.get(model_type)


def _check_family(text_config: PreTrainedConfig) -> None:
    model_type = text_config.model_type
    supported = ", ".join(SUPPORTED_FAMILIES)
    reason = _refusal(text_config)
    if reason is not None:
        raise AttnResConfigError(f"text_config: '{model_type}' is {reason}. Supported families: {supported}.")
    if model_type == "gemma3":
        raise AttnResConfigError(
            "text_config: 'gemma3' is the multimodal Gemma3 config; pass its text part (`config.text_config`, "
            f"model_type 'gemma3_text'). Supported families: {supported}."
        )
    if model_type not in SUPPORTED_FAMILIES:
        raise AttnResConfigError(
            f"text_config: unsupported family '{model_type}': no row of AttnRes's family table says how its decoder "
            f"layer runs, so its conversion could not be shown exact. Supported families: {supported}."
        )
    oldest = FAMILIES[model_type].oldest_transformers
    if Version(transformers.__version__) < Version(oldest):
        raise AttnResConfigError(
            f"text_config: '{model_type}' needs transformers>={oldest} (the first release whose {model_type} "
            f"modules take the calls AttnRes makes), found "
            f'{transformers.__version__}: pip install -U "transformers>={oldest}"'
        )


def _names_saved_before(saved: dict | None) -> dict:
    """The names a saved layout gives that have moved to other forms since it was saved (`MOVED_NAMES`), with the
    names of the forms its weights compute: {layout key: (name saved, name now)}; none in a layout of `NAMING`."""
    if not isinstance(saved, dict) or NAMING_KEY in saved:
        return {}
    return {key: (saved[key], moved[saved[key]]) for key, moved in MOVED_NAMES.items() if saved.get(key) in moved}


def _as_named_now(saved: dict | None) -> dict | None:
    """A saved layout in today's names (`_names_saved_before`), with the options its rule gained since it was saved
    at the value its weights hold (`RuleOption.saved_before`: Highway's gate was a scalar per token before it had the
    option)."""
    if saved is None:
        return None
    renamed = {key: now for key, (_, now) in _names_saved_before(saved).items()}
    saved = {key: value for key, value in saved.items() if key != NAMING_KEY} | renamed
    rule = RULES.get(saved.get("attnres_mode"))
    if rule is None:
        return saved
    options = {name: RULE_OPTIONS[name].saved_before for name in rule.options}
    return {name: value for name, value in options.items() if value is not None} | saved


class AttnResConfig(PreTrainedConfig):
    r"""
    Args:
        text_config (`dict` or `PreTrainedConfig`):
            The full config of the source architecture, one of `SUPPORTED_FAMILIES` (its `model_type`). Others are
            refused, naming why (post-norm, parallel attention and MLP, hybrid, encoder, or no family row).
        attnres_mode (`str`, defaults to `"block"`):
            The depth-mixing rule, one of `RULES`. `"block"`: each sublayer attends over the token embedding,
            the sums of the completed blocks and the partial sum of the current block. `"full"`: each sublayer attends
            over the embedding and every earlier sublayer output. The others are the rules the paper compares AttnRes
            with: `"prenorm"` (the source's own residual stream), `"postnorm"` (the stream normalised after each
            sublayer, by that sublayer's input norm), `"rezero"` (each sublayer output scaled by a learned scalar, 0
            at init, with no norm on the stream: ReZero as published), `"rezero_prenorm"` and `"layerscale"` (each
            sublayer output scaled by a learned scalar or per-channel vector, the sublayer reading norm(h)),
            `"highway"` (a per-channel gate g = sigmoid(W h/rms(h) + b) between the stream and the output, h <- (1 -
            g) h + g f; see `attnres_highway_gate`), `"denseformer"` (DenseFormer as published: after each decoder
            layer the stream becomes a learned weighted average of the embedding and every layer output so far, 1 on
            the newest and 0 on the others at init; see `attnres_dwa_dilation` and `attnres_dwa_period`),
            `"denseformer_sublayers"` (each sublayer input a learned weighted sum of the embedding and every earlier
            sublayer output, weights 1 at init: the Kimi paper's view of DenseFormer). `"mhc"`: manifold-constrained
            hyper-connections (DeepSeek, arXiv 2512.24880): `attnres_num_streams` residual streams, each sublayer
            reading a learned mix of them and writing its output into each with its own weight, the streams mixed
            by a per-token doubly stochastic matrix (Sinkhorn-Knopp); it starts as the plain residual stream.
            `"mhc_lite"`: mHC with that matrix a per-token convex combination of the m! permutation matrices (arXiv
            2601.05732), doubly stochastic exactly, without Sinkhorn-Knopp.
        attnres_block_size (`int`, *optional*):
            Decoder layers per block for `"block"` mode (the paper's `block_size` counts sublayers: it is twice this,
            or this where the family's layers have one residual branch, attention and MLP in parallel).
            Blocks start at the decoder layers whose 0-based index is a multiple of it. Defaults to
            `ceil(num_hidden_layers / 8)`, about 8 blocks. Ignored in `"full"` mode.
        attnres_eps (`float`, *optional*):
            Epsilon of the RMSNorm applied to the depth keys. Defaults to the source's `rms_norm_eps`.
        attnres_implementation (`str`, defaults to `"two_phase"`):
            `"two_phase"`: the completed blocks are scored once per decoder layer for both of its pseudo-queries, with
            each block's RMS computed once, and the partial sum joins the softmax afterwards (paper Algorithm 1).
            `"naive"`: the direct computation (stack, normalise, score, softmax, weighted sum) per sublayer, kept as
            the reference the fast path is tested against. `"fla"`: flash-linear-attention's fused Triton kernel
            (`fla.ops.attnres.fused_attnres`; a GPU and `pip install flash-linear-attention`), for the paper's AttnRes
            without ablations; its depth weights carry no gradient. A one-token decoding step mixes directly whatever
            this says.
        attnres_scale_by_num_sources (`bool`, defaults to `False`):
            Multiply each mixed sublayer input by its number of sources. With zero pseudo-queries the mixture is the
            mean of the sources, i.e. the standard residual stream divided by their number; the sublayers' RMSNorm
            cancels that scale except for its epsilon (`RMSNorm(h/k)` uses `eps*k^2`). Rescaling restores the stream
            exactly, so converted checkpoints reproduce their source bit for bit up to float rounding. Converted models
            turn it on; models trained from scratch can stay paper-literal (`False`).
        attnres_scale_init (`float`, *optional*):
            The initial value of the `"rezero"` and `"rezero_prenorm"` scalars and `"layerscale"` vectors. Defaults
            to each rule's published initialisation for training from scratch: 0 for ReZero; for LayerScale, CaiT's
            0.1 up to 18 layers, 1e-5 up to 24, 1e-6 beyond. Conversion sets 1, the plain stream.
        attnres_recompute (`bool`, defaults to `False`):
            The depth mix never keeps its intermediates for the backward pass (it recomputes them); with this on, it
            does not keep its output either, and recomputes the sublayer's input norm with it, so that a layer keeps
            what the source's layer keeps. Read at every forward, like `use_cache`: setting it on a loaded model's
            config takes effect.
        attnres_compiled_mix (`str`, defaults to `"inline"`):
            How `torch.compile` compiles the depth mix of a training step. `"inline"`: into the graph, where the
            compiler fuses it with its neighbours (the fastest steps, but each sublayer's mix becomes kernels of its
            own, so the first step compiles about 3x as long as the source's). `"operator"`: as one custom operator per
            mix that the compiler does not look into, its backward autograd's own (`torch.func.vjp` of the same mix):
            the first step compiles in 1.3x to 1.6x the source's time (Block), but every step runs the mix unfused
            (SmolLM2-135M on a CPU: a compiled step 1.29x the source's, against 1.04x inline). Compiled inference and
            eager mode are the same either way. Read at every forward, like `use_cache`.
        attnres_num_streams (`int`, defaults to 4):
            The number m of residual streams of `"mhc"` and `"mhc_lite"` modes (the paper's expansion rate n), at
            least 2, and at most `MAX_PERMUTATION_STREAMS` (6) for `"mhc_lite"`, which learns a weight per
            permutation matrix (m! of them). Each sublayer's projection holds (2m + m^2) * m * hidden_size parameters
            under mHC (96 * hidden_size at m = 4), (2m + m!) * m * hidden_size under mHC-lite (128 * hidden_size at
            m = 4); a count whose projections would outweigh the source model more than
            `MAX_STREAM_PARAMETERS_RATIO` times is refused. An option of those two rules only: another value under
            another rule is refused.
        attnres_highway_gate (`str`, defaults to `"channel"`):
            The gate of `"highway"` mode. `"channel"`: one gate per channel, g = sigmoid(W h/rms(h) + b) with W a
            hidden_size x hidden_size matrix (zero at init) and b a vector (-1 at init) per sublayer, as Highway
            Networks gate. `"token"`: one scalar gate per token, g = sigmoid(w . h/rms(h) + b), w a vector and b a
            scalar. An option of `"highway"` only; saved with the weights, since the two hold different parameters.
        attnres_dwa_dilation (`int`, defaults to 1):
            `"denseformer"`: each layer's average weighs every k-th block output back from its own (DenseFormer's
            dilation; 1: all of them), at most num_hidden_layers.
        attnres_dwa_period (`int`, defaults to 1):
            `"denseformer"`: an average after every P-th decoder layer only (DenseFormer's DWA period; 1: after
            each), at most num_hidden_layers.
        attnres_query (`str`, defaults to `"pseudo"`):
            Block and Full AttnRes: what scores the sources. `"pseudo"`: the paper's learned pseudo-query w.
            `"projected"` (ablation): an input-dependent query w + W RMSNorm(v) / hidden_size per token, v the hidden
            state (the sum of the sources: the embedding and every earlier output), W a hidden_size x hidden_size
            matrix per sublayer, zero at init (the 1/hidden_size keeps its logits moving at the pseudo-query's pace
            under Adam). `"projected_latest"`: the same, v the latest source (the previous sublayer's output in
            Full mode), as `"projected"` was until the hidden state took the name. `"scalars"` (ablation,
            input-independent mixing): a learned logit per source replaces query and key, zero at init.
        attnres_score (`str`, defaults to `"softmax"`):
            Block and Full AttnRes: `"softmax"` over the sources, or `"sigmoid"` (ablation) of each logit, not
            renormalised.
        attnres_key_norm (`bool`, defaults to `True`):
            Block and Full AttnRes: RMS-normalise the keys; `False` (ablation) scores the raw sources.
        attnres_depth_heads (`int`, defaults to 1):
            Block and Full AttnRes: split the channels into this many equal groups (it must divide hidden_size), each
            with its own weights over depth (ablation; the paper's H = 16). The keys keep one RMS over all channels.
        attnres_window (`int`, *optional*):
            Full AttnRes only (ablation, sliding-window aggregation): each sublayer mixes the embedding and only the
            `attnres_window` latest sublayer outputs (the paper's W = 8). None: all of them.
        attnres_saved_layout (`dict`, *optional*):
            Written by `save_pretrained`, not set by hand: the depth layout (`depth_layout()`) of the weights saved
            beside this config. Loading a config.json whose `attnres_mode`, `attnres_block_size`,
            `attnres_num_streams`, `attnres_highway_gate` or ablation options were edited away from it is refused,
            since the same weights would then compute something else. Changing the layout from Python
            (`from_pretrained(..., attnres_block_size=4)`) is not refused: that is a deliberate choice.
    """

    model_type = "attnres"
    # The layer types are the source's (`text_config.layer_types`), checked by its own class; read through this
    # config, transformers' generic check would refuse types only the source allows (Nemotron-H's "mlp")
    layer_types = None
    sub_configs_defaults = {"text_config": SubConfigSpec(config_class=AutoConfig, model_type="llama")}

    text_config: dict | PreTrainedConfig | None = None
    attnres_mode: str = "block"
    attnres_block_size: int | None = None
    attnres_eps: float | None = None
    attnres_implementation: str = "two_phase"
    attnres_scale_by_num_sources: bool = False
    attnres_scale_init: float | None = None
    attnres_recompute: bool = False
    attnres_compiled_mix: str = "inline"
    attnres_num_streams: int = DEFAULT_NUM_STREAMS
    attnres_highway_gate: str = "channel"
    attnres_dwa_dilation: int = 1
    attnres_dwa_period: int = 1
    attnres_query: str = "pseudo"
    attnres_score: str = "softmax"
    attnres_key_norm: bool = True
    attnres_depth_heads: int = 1
    attnres_window: int | None = None
    attnres_saved_layout: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self, **kwargs):
        super().__post_init__(**kwargs)
        _check_family(self.text_config)
        # The flag lives in the text config of the source; the tying machinery reads it from the top-level config.
        self.tie_word_embeddings = self.tie_word_embeddings or self.text_config.tie_word_embeddings
        self._take_names_saved_before()
        self.check_attnres()
        self._check_saved_layout()

    def save_pretrained(self, *args, **kwargs):
        # Before transformers opens config.json: `to_dict` checks too, but only once the file is open for writing
        self.check_attnres()
        return super().save_pretrained(*args, **kwargs)

    def check_attnres(self) -> None:
        """Check every AttnRes setting, whichever way it arrived (the constructor, config.json, `from_pretrained`'s
        keyword overrides, which transformers sets after construction, or an assignment), and fill in the defaults
        that depend on the source (block size, eps). The model checks again when it is built, and `to_dict` (which
        saving and printing go through) before it writes. Raises `AttnResConfigError` naming the setting, its value
        and what it takes."""
        num_layers = self.text_config.num_hidden_layers
        if not isinstance(self.attnres_mode, str) or self.attnres_mode not in RULES:
            raise AttnResConfigError(f"attnres_mode: got {self.attnres_mode!r}, expected one of {tuple(RULES)}.")
        for name in ("attnres_scale_by_num_sources", "attnres_recompute"):
            if not isinstance(getattr(self, name), bool):
                raise AttnResConfigError(f"{name}: got {getattr(self, name)!r}, expected true or false.")
        if self.attnres_scale_init is not None and not _is_real(self.attnres_scale_init):
            raise AttnResConfigError(f"attnres_scale_init: got {self.attnres_scale_init!r}, expected a finite number.")
        if self.attnres_recompute and self.attnres_mode not in ATTNRES_MODES:
            raise AttnResConfigError(
                f"attnres_recompute: True recomputes AttnRes's depth mix, which attnres_mode={self.attnres_mode!r} "
                "has none of: drop it (mHC recomputes its stream reads and writes always)."
            )
        self.check_implementation()
        if self.attnres_block_size is None:
            self.attnres_block_size = math.ceil(num_layers / DEFAULT_NUM_BLOCKS)
        if not _is_integer(self.attnres_block_size) or not 1 <= self.attnres_block_size <= num_layers:
            raise AttnResConfigError(
                f"attnres_block_size: got {self.attnres_block_size!r}, expected an integer number of decoder layers "
                f"per block from 1 to num_hidden_layers={num_layers}."
            )
        self._check_streams()
        self._check_options()
        self._check_input_norms()
        if self.attnres_eps is None:
            self.attnres_eps = getattr(self.text_config, FAMILIES[self.text_config.model_type].norm_eps_key)
        if not _is_real(self.attnres_eps) or not self.attnres_eps > 0:
            raise AttnResConfigError(f"attnres_eps: got {self.attnres_eps!r}, expected a positive number.")
        layout = self.attnres_saved_layout
        if layout is not None and not (isinstance(layout, dict) and set(layout) <= set(LAYOUT_KEYS)):
            raise AttnResConfigError(
                f"attnres_saved_layout: got {layout!r}, expected the dict of {', '.join(LAYOUT_KEYS)} that AttnRes "
                "writes when it saves: put back the one the folder was saved with, or remove the key."
            )

    def check_implementation(self) -> None:
        """The depth mix's backend and how compiled training runs it: checked with the config, and at every forward,
        where a loaded model's config may have been set since (see `depth_mix_policy`)."""
        if self.attnres_implementation not in IMPLEMENTATIONS:
            raise AttnResConfigError(
                f"attnres_implementation: got {self.attnres_implementation!r}, expected one of {IMPLEMENTATIONS}."
            )
        if self.attnres_compiled_mix not in COMPILED_MIXES:
            raise AttnResConfigError(
                f"attnres_compiled_mix: got {self.attnres_compiled_mix!r}, expected one of {COMPILED_MIXES}."
            )
        if self.attnres_implementation != "fla":
            return
        ablated = {name: getattr(self, name) for name, value in FLA_SETTINGS.items() if getattr(self, name) != value}
        if ablated:
            raise AttnResConfigError(
                f"attnres_implementation='fla': flash-linear-attention's kernel computes the paper's AttnRes only "
                f"({FLA_SETTINGS}), and this config sets {ablated}. Use attnres_implementation='two_phase'."
            )
        if self.attnres_compiled_mix == "operator":
            raise AttnResConfigError(
                "attnres_compiled_mix='operator' wraps the mix in an operator whose backward is torch.func's, which "
                "flash-linear-attention's kernel (an autograd.Function with its own backward) cannot run under. Use "
                "attnres_compiled_mix='inline' with attnres_implementation='fla' (compiled, fla's kernel runs between "
                "graphs), or attnres_implementation='two_phase'."
            )

    def _check_streams(self) -> None:
        """The stream count of mHC and mHC-lite: an integer of at least 2, within memory (and for mHC-lite, within
        `MAX_PERMUTATION_STREAMS`)."""
        streams, modes = self.attnres_num_streams, OPTION_MODES["attnres_num_streams"]
        if not _is_integer(streams) or streams < 2:
            raise AttnResConfigError(
                f"attnres_num_streams: got {streams!r}, expected an integer number of mHC residual streams of at "
                "least 2 (one stream is the plain residual stream: attnres_mode='prenorm')."
            )
        if self.attnres_mode not in modes:
            return  # a count set under another rule: `_check_options` refuses it, as any rule option of another rule
        if RULES[self.attnres_mode].permutation_mix and streams > MAX_PERMUTATION_STREAMS:
            raise AttnResConfigError(
                f"attnres_num_streams: got {streams}, over mHC-lite's {MAX_PERMUTATION_STREAMS}: it learns a weight "
                f"per permutation matrix, {math.factorial(streams):,} of them at {streams} streams (the paper uses "
                "4): choose fewer streams, or attnres_mode='mhc'."
            )
        self._check_stream_memory(streams)

    def _check_stream_memory(self, streams: int) -> None:
        """Each connection's projection: m rows for the read, m for the write's beta and `stream_mix_rows` for A
        (m^2 for mHC, m! for mHC-lite), each of m * hidden_size columns."""
        text = self.text_config
        hidden, layers = text.hidden_size, text.num_hidden_layers
        rows = 2 * streams + stream_mix_rows(self.attnres_mode, streams)
        added = (self.num_sublayers() + 1) * rows * streams * hidden
        source = layers * 12 * hidden**2 + text.vocab_size * hidden  # about: attention, MLP, embedding
        if added > MAX_STREAM_PARAMETERS_RATIO * source:
            raise AttnResConfigError(
                f"attnres_num_streams: {streams} streams add {added:,} parameters ({added * 4 / 1e9:.1f} GB in "
                f"float32), over {MAX_STREAM_PARAMETERS_RATIO}x the source model's ~{source:,}: the paper uses 4; "
                "choose fewer streams."
            )

    def _check_input_norms(self) -> None:
        """PostNorm normalises the stream with each sublayer's input norm: on a family without one it would silently
        compute PreNorm (the model refuses it where a one-branch layer's attention and MLP have a norm each)."""
        model_type = self.text_config.model_type
        if self.attnres_mode != "postnorm":
            return
        family = FAMILIES[model_type]
        for layer_type in dict.fromkeys(layer_types_of(self.text_config)):
            norms = family.norms(layer_type)
            if None in (norms.attention_input_norm, norms.mlp_input_norm):
                raise AttnResConfigError(
                    f"attnres_mode='postnorm' normalises the stream with each sublayer's input norm, and {model_type} "
                    f"has none (its {layer_type} layers normalise only sublayer outputs), so it would compute PreNorm: "
                    "use another rule."
                )

    def _check_options(self) -> None:
        """The rule options: each of its values, on the modes it applies to, in combinations that mean something."""
        for name, option in RULE_OPTIONS.items():
            value = getattr(self, name)
            if value == option.default:
                continue
            if self.attnres_mode not in OPTION_MODES[name]:
                modes = " or ".join(f"attnres_mode={mode!r}" for mode in OPTION_MODES[name])
                raise AttnResConfigError(
                    f"{name}: {value!r} is an option of {modes}, not of attnres_mode={self.attnres_mode!r}: drop it, "
                    f"or set {modes}."
                )
            valid = value in option.choices if option.choices else _is_integer(value) and value >= 1
            if not valid or isinstance(value, bool) != isinstance(option.default, bool):
                expected = f"one of {option.choices}" if option.choices else "a positive integer"
                raise AttnResConfigError(f"{name}: got {value!r}, expected {expected}.")
        num_layers = self.text_config.num_hidden_layers
        for name in ("attnres_dwa_dilation", "attnres_dwa_period"):
            if getattr(self, name) > num_layers:
                raise AttnResConfigError(
                    f"{name}: got {getattr(self, name)}, over num_hidden_layers={num_layers}: no decoder layer would "
                    "average what it sets; pick at most the number of layers."
                )
        hidden_size = self.text_config.hidden_size
        if hidden_size % self.attnres_depth_heads:
            raise AttnResConfigError(
                f"attnres_depth_heads: got {self.attnres_depth_heads}, which does not divide hidden_size={hidden_size} "
                "into equal channel groups: pick a divisor of hidden_size."
            )
        if self.attnres_query == "scalars" and (self.attnres_depth_heads != 1 or not self.attnres_key_norm):
            raise AttnResConfigError(
                "attnres_query='scalars' learns one logit per source, with no query or key to split into "
                "attnres_depth_heads or to normalise (attnres_key_norm): drop those, or use another attnres_query."
            )

    def depth_layout(self) -> dict:
        """The settings that decide what trained weights compute: the rule, and for Block AttnRes its block size, its
        options that are not ablations (mHC's number of streams, Highway's gate), for AttnRes the ablation options set
        away from their defaults."""
        rule = RULES[self.attnres_mode]
        layout = {"attnres_mode": self.attnres_mode}
        if rule.sources == "blocks":
            layout["attnres_block_size"] = self.attnres_block_size
        layout |= {name: getattr(self, name) for name in rule.options if not RULE_OPTIONS[name].ablation}
        # Only those set: a layout saved before the options existed is the same layout
        layout |= {name: getattr(self, name) for name in self.ablated_options()}
        if any(layout.get(key) in moved for key, moved in MOVED_NAMES.items()):
            layout[NAMING_KEY] = NAMING  # a name that meant another form before: it means this one
        return layout

    def ablated_options(self) -> tuple[str, ...]:
        """The ablation options set away from the paper's AttnRes."""
        return tuple(name for name, option in ATTNRES_OPTIONS.items() if getattr(self, name) != option.default)

    def _take_names_saved_before(self) -> None:
        """A config.json saved before a name it holds moved to another form (`MOVED_NAMES`): the settings that hold
        the name as saved take the name of the form its weights compute (a ReZero model of before `NAMING` is
        "rezero_prenorm"), so that it loads and computes what it computed."""
        for key, (saved, now) in _names_saved_before(self.attnres_saved_layout).items():
            if getattr(self, key) == saved:
                setattr(self, key, now)

    def _check_saved_layout(self) -> None:
        saved = _as_named_now(self.attnres_saved_layout)
        layout = {key: value for key, value in self.depth_layout().items() if key != NAMING_KEY}
        self.attnres_saved_layout = None  # `to_dict` writes the layout the config has when it is saved
        if saved is None or saved == layout:
            return
        # The rule first: under another rule the block size means nothing
        key = next(key for key in LAYOUT_KEYS if saved.get(key) != layout.get(key))
        default = ATTNRES_OPTIONS[key].default if key in ATTNRES_OPTIONS else None  # an option absent: its default
        edited, made_with = f"{key}={getattr(self, key)!r}", f"{key}={saved.get(key, default)!r}"
        raise AttnResConfigError(
            f"config.json says {edited}, but the weights saved with it were made with {made_with} "
            "(its attnres_saved_layout), and would compute something else: put the saved value back, or, to run "
            "these weights with another layout on purpose, pass it to from_pretrained (e.g. "
            "`from_pretrained(folder, attnres_block_size=4)`) or convert the source again with it."
        )

    def to_dict(self) -> dict:
        # Checked first: a setting changed since construction is never written (saving goes through here)
        self.check_attnres()
        # The layout travels with every saved config, so that a later edit of config.json is caught at load.
        return super().to_dict() | {"attnres_saved_layout": self.depth_layout()}

    def __getattr__(self, name: str):
        # Only reached for attributes this config lacks: read through to the source architecture's config.
        text_config = self.__dict__.get("text_config")
        if text_config is None or name.startswith("__"):
            raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")
        return getattr(text_config, name)

    def __setattr__(self, name: str, value) -> None:
        # Writes follow reads: an attribute that reads through to the source architecture is written there, so that
        # `config.num_hidden_layers = 2` changes what the model builds rather than a shadow copy beside it.
        text_config = self.__dict__.get("text_config")
        if (
            isinstance(text_config, PreTrainedConfig)
            and name not in self.__dict__
            and name not in type(self).__annotations__
            and not hasattr(type(self), name)
            and name in text_config.__dict__
        ):
            setattr(text_config, name, value)
            return
        super().__setattr__(name, value)

    # Tensor and expert parallelism shard the sublayers as the source's plans say (`from_pretrained(tp_plan="auto")`,
    # vLLM's Transformers backend): the AttnRes model keeps the source's module names, the plans' row-wise layers
    # all-reduce each sublayer's output before the depth mix reads it, and the depth-mix parameters, which no plan
    # names, are replicated. The class-level plans of PreTrainedConfig would hide the source's from the read-through.
    @property
    def base_model_tp_plan(self) -> dict | None:
        return self.text_config.base_model_tp_plan

    @base_model_tp_plan.setter
    def base_model_tp_plan(self, plan: dict | None) -> None:
        # Older transformers (5.20) write the plan back in __init__ (adding the tied embedding's rule): to the source's
        self.text_config.base_model_tp_plan = plan

    @property
    def base_model_ep_plan(self) -> dict | None:
        return self.text_config.base_model_ep_plan

    @base_model_ep_plan.setter
    def base_model_ep_plan(self, plan: dict | None) -> None:
        self.text_config.base_model_ep_plan = plan

    @property
    def base_model_pp_plan(self) -> None:
        """None: pipeline stages would hand on the whole depth state (the completed blocks and the partial sum), not
        the one hidden state the source's plan names, so AttnRes models do not split into pipeline stages."""
        return None

    def sublayers_per_layer(self) -> int:
        """How many residual branches each decoder layer has, each reading the depth mix once: 2 (attention, then MLP)
        in the two-sublayer layout, 1 in the one-branch layout (attention and MLP in parallel, or one mixer per layer:
        the family's `one_branch`)."""
        return 1 if FAMILIES[self.text_config.model_type].has_one_branch(self.text_config) else 2

    def num_sublayers(self) -> int:
        """The residual branches of the whole model, in order (A0, M0, A1, ..., or B0, B1, ... in one-branch layers)."""
        return self.sublayers_per_layer() * self.text_config.num_hidden_layers

    def sublayer_starts_block(self, sublayer_index: int) -> bool:
        """Whether sublayer `sublayer_index` (0-based; attention = 2*layer, MLP = 2*layer + 1; in one-branch layers
        the branch = layer) opens a new block.

        The rule of the paper's Block AttnRes pseudocode (arXiv 2603.15031), `layer_number % (block_size // 2) == 0`,
        on the 0-based index, its block size counting sublayers (branches): `attnres_block_size` decoder layers of
        `sublayers_per_layer` each; where every sublayer output is a source of its own, each opens one; the
        recurrences keep one stream, which never closes.
        """
        sources = RULES[self.attnres_mode].sources
        if sources != "blocks":
            return sources == "outputs"
        return sublayer_index % (self.sublayers_per_layer() * self.attnres_block_size) == 0

    def num_sources(self) -> list[int]:
        """How many sources each sublayer mixes, in order (A0, M0, A1, ..., or B0, B1, ...), then the output
        aggregation (1 for each of the recurrences: the stream); with `attnres_window`, at most the embedding and the
        window."""
        counts, completed, has_partial = [], 0, True  # before layer 0 the partial sum is the embedding
        for sublayer in range(self.num_sublayers()):
            if self.sublayer_starts_block(sublayer):
                completed, has_partial = completed + 1, False
            counts.append(completed + has_partial)
            has_partial = True
        counts.append(completed + 1)
        return counts if self.attnres_window is None else [min(count, 1 + self.attnres_window) for count in counts]


AttnResConfig.register_for_auto_class()  # save_pretrained copies this file next to the weights

__all__ = ["AttnResConfig", "FAMILIES", "RULES", "SUPPORTED_FAMILIES"]
