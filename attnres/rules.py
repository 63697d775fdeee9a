"""The depth-mixing rules as data: one entry per rule (its label, what its sublayers read, whether it can start as the
source computes, the options it takes) and one per option. The configuration checks a config against them, the
`attnres` command lists them in `--help` and checks its options by them, and depth_rules.py's rule classes, one per
rule, compute them.

Standard library only: the command reads this file without loading torch, and it travels with saved models as remote
code, imported by configuration_attnres.py.
"""

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class RuleOption:
    """A config field that some rules take (see `RuleSpec.options`), and its command-line option `--<flag>`.

    `choices`: the values it takes (None: a positive integer). `converts`: why a converted model cannot start as its
    source with the option away from `default` (None: it can). `ablation`: one of the paper's ablations of AttnRes (its
    Table 4), which a model's layout description lists when set."""

    flag: str
    help: str
    default: object
    choices: tuple | None = None
    converts: str | None = None
    ablation: bool = True
    # The value of weights saved before the option existed, whose saved layout therefore lacks it (None: the option
    # is as old as its rule, or an ablation, which a layout holds only away from its default)
    saved_before: object = None
    # Its values that named another form before `NAMING`: {value: that form's value now}
    moved: dict | None = None


@dataclass(frozen=True)
class RuleSpec:
    """One depth-mixing rule.

    `sources`: what a sublayer's input is formed from: "stream", one running representation (the recurrences; mHC's m
    streams; DenseFormer's stream, which each decoder layer's depth-weighted average sets); "blocks", the token
    embedding, the sums of the completed blocks and the partial sum of the current one (Block AttnRes); "outputs", the
    embedding and every sublayer output (Full AttnRes, DenseFormer per sublayer). `converts`: None where the rule can
    start as the source's plain residual stream (which conversion needs), else why it cannot. `options`: the config
    fields of `RULE_OPTIONS` it takes. `depth_attention`: its sublayers mix by depth attention (AttnRes), whose weights
    training logs and whose mix may be recomputed. `learns`: it adds parameters."""

    label: str
    sources: str
    converts: str | None = None
    options: tuple[str, ...] = ()
    depth_attention: bool = False
    learns: bool = True
    # Its m residual streams are mixed by a convex combination of the m! permutation matrices (mHC-lite), which
    # caps m at `MAX_PERMUTATION_STREAMS`; else, under a stream rule, by an m x m matrix of logits (mHC)
    permutation_mix: bool = False
    # The rule that weights saved under this rule's name before it named this form compute (see `NAMING`)
    saved_before: str | None = None


DEFAULT_NUM_STREAMS = 4
# mHC-lite mixes its streams by a weight per permutation matrix: m! of them, 720 at 6 streams and 5040 at 7
MAX_PERMUTATION_STREAMS = 6
RULE_OPTIONS = {
    "attnres_query": RuleOption(
        "query",
        "Block and Full AttnRes: what scores the sources: pseudo, the paper's learned pseudo-query (default); "
        "projected, a query projected per token from the hidden state, the sum of the sources (a d x d matrix per "
        "sublayer); projected_latest, one projected from the latest source; scalars, a learned logit per source in "
        "place of query and key",
        "pseudo",
        ("pseudo", "projected", "projected_latest", "scalars"),
        moved={"projected": "projected_latest"},  # the projected query read the latest source until naming 2
    ),
    "attnres_score": RuleOption(
        "score",
        "Block and Full AttnRes: softmax over the sources (default), or a sigmoid of each",
        "softmax",
        ("softmax", "sigmoid"),
    ),
    "attnres_key_norm": RuleOption(
        "no_key_norm",
        "Block and Full AttnRes: score the raw sources, without the keys' RMSNorm",
        True,
        (True, False),
    ),
    "attnres_depth_heads": RuleOption(
        "depth_heads",
        "Block and Full AttnRes: channel groups, each with its own depth weights; a divisor of the hidden size "
        "(default: 1)",
        1,
    ),
    "attnres_window": RuleOption(
        "window",
        "Full AttnRes: mix the embedding and only the N latest sublayer outputs (default: all); it cannot start as "
        "the source, so conversion refuses it: train it with --convert --from-scratch",
        None,
        converts="a window leaves out the older sublayer outputs, which the source's residual stream still sums",
    ),
    "attnres_num_streams": RuleOption(
        "num_streams",
        f"mHC and mHC-lite: the number of residual streams, at least 2 (mHC-lite: at most {MAX_PERMUTATION_STREAMS}; "
        f"default: {DEFAULT_NUM_STREAMS})",
        DEFAULT_NUM_STREAMS,
        ablation=False,
    ),
    "attnres_dwa_dilation": RuleOption(
        "dwa_dilation",
        "DenseFormer: each depth-weighted average reads every k-th block output back from the newest, as the "
        "published dilation (default: 1, all of them)",
        1,
        ablation=False,
    ),
    "attnres_dwa_period": RuleOption(
        "dwa_period",
        "DenseFormer: a depth-weighted average after every P-th decoder layer only, as the published DWA period "
        "(default: 1, after each)",
        1,
        ablation=False,
    ),
    "attnres_highway_gate": RuleOption(
        "highway_gate",
        "Highway: the gate between the stream and each sublayer output: channel, one gate per channel from a d x d "
        "matrix, as Highway Networks (default); token, one scalar gate per token from a vector",
        "channel",
        ("channel", "token"),
        ablation=False,
        saved_before="token",  # the scalar gate was Highway's only one until the option came
    ),
}
DEPTH_ATTENTION_OPTIONS = ("attnres_query", "attnres_score", "attnres_key_norm", "attnres_depth_heads")

RULES = {
    "block": RuleSpec("Block AttnRes", "blocks", options=DEPTH_ATTENTION_OPTIONS, depth_attention=True),
    "full": RuleSpec(
        "Full AttnRes", "outputs", options=(*DEPTH_ATTENTION_OPTIONS, "attnres_window"), depth_attention=True
    ),
    "prenorm": RuleSpec("PreNorm (the plain residual stream)", "stream", learns=False),
    "postnorm": RuleSpec(
        "PostNorm",
        "stream",
        "it normalises the stream after every sublayer, which the source does not do",
        learns=False,
    ),
    "rezero": RuleSpec(
        "ReZero (a learned scalar on each sublayer output; no norms: each sublayer reads the raw stream)",
        "stream",
        "it drops the sublayers' input norms and the final norm, which the source applies",
        saved_before="rezero_prenorm",
    ),
    "rezero_prenorm": RuleSpec(
        "ReZero on PreNorm (a learned scalar on each sublayer output, which reads the normalised stream)", "stream"
    ),
    "layerscale": RuleSpec("LayerScale (a learned vector on each sublayer output)", "stream"),
    "highway": RuleSpec(
        "Highway (an input-dependent gate between the stream and each sublayer output)",
        "stream",
        "its gate mixes the stream and the sublayer output as (1 - g) h + g f, which is never the plain sum h + f",
        options=("attnres_highway_gate",),
    ),
    "denseformer": RuleSpec(
        "DenseFormer (after each decoder layer, learned static weights over the embedding and every layer output)",
        "stream",
        options=("attnres_dwa_dilation", "attnres_dwa_period"),
        saved_before="denseformer_sublayers",
    ),
    "denseformer_sublayers": RuleSpec(
        "DenseFormer per sublayer (learned static weights over the embedding and every earlier sublayer output)",
        "outputs",
    ),
    "mhc": RuleSpec(
        "mHC (m residual streams, mixed by doubly stochastic matrices)", "stream", options=("attnres_num_streams",)
    ),
    "mhc_lite": RuleSpec(
        "mHC-lite (m residual streams, mixed by convex combinations of permutation matrices)",
        "stream",
        options=("attnres_num_streams",),
        permutation_mix=True,
    ),
}
MODES = tuple(RULES)
ATTNRES_MODES = tuple(mode for mode, rule in RULES.items() if rule.depth_attention)
# The rules that take each option
OPTION_MODES = {name: tuple(mode for mode, rule in RULES.items() if name in rule.options) for name in RULE_OPTIONS}
# The paper's ablations of AttnRes (Table 4), as options
ATTNRES_OPTIONS = {name: option for name, option in RULE_OPTIONS.items() if option.ablation}


# The names a saved layout uses. Since naming 2, "rezero" names ReZero as published (without norms) and
# "denseformer" DenseFormer as published (an average after each decoder layer), and the query "projected" reads the
# hidden state; a layout that holds such a moved name without `NAMING_KEY` was saved before, and its weights compute
# the form the name had then (`RuleSpec.saved_before`, `RuleOption.moved`), which now has a name of its own
NAMING = 2
NAMING_KEY = "attnres_naming"
MOVED_NAMES = {
    "attnres_mode": {mode: rule.saved_before for mode, rule in RULES.items() if rule.saved_before},
    **{name: option.moved for name, option in RULE_OPTIONS.items() if option.moved},
}


def stream_mix_rows(mode: str, streams: int) -> int:
    """The rows of phi_res, the projection of a stream rule's connection that gives A its logits: one per entry of A
    (m^2) for mHC, one per permutation matrix (m!) for mHC-lite."""
    return math.factorial(streams) if RULES[mode].permutation_mix else streams**2
