"""Whether a converted model computes what its source computed: both run on a fixed sample text (`SAMPLE_TEXT`), and
the converted model's logits, mean NLL and greedy tokens must match the source's within the source's own float noise.

`verify_conversion` measures; `VerificationReport` holds the figures, judges them against the thresholds below and
shows them, on the terminal and in a model card; its `to_dict` is what a converted folder's origin record keeps.
"""

import copy
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

from .compat.transformers_private import attention_implementation
from .errors import ConversionError
from .modeling_attnres import AttnResForCausalLM

# The exactness contract, checked in float32. The converted model's logits may differ from the source's by at most
# NOISE_FACTOR times the source's own float noise: how far its logits move when its attention runs in a second
# implementation (sdpa vs eager), and never less than one float32 step of its largest logit. Correct conversions
# measured 0.5-1.2 times that noise (every tiny family, logits scaled up 3000x, SmolLM2-135M); broken ones (no
# source-count rescale, a swapped norm, a dropped block) 1000 to 10^6 times. The mean NLL is held to the same rule
# (its noise taken as at least one float32 step of the NLL), and never to less than 1e-5.
NOISE_FACTOR = 4
FP32_MIN_NLL_DIFF_ALLOWED = 1e-5
FP32_EPS = torch.finfo(torch.float32).eps


@dataclass
class VerificationReport:
    """How closely a converted model reproduces its source on `SAMPLE_TEXT` (fixed random token ids for a source that
    has no tokenizer: the exactness the thresholds hold the conversion to does not depend on the text).

    Logits are compared with a float32 reference: the source itself when both models run in float32, otherwise the
    source run in float32 on the same weights. In float32 the largest logit difference may be at most `NOISE_FACTOR`
    times the source's own float noise (`noise_max_abs_logit_diff`, at least one float32 step of the largest logit),
    the mean NLL likewise (`noise_nll_diff`, at least one float32 step of the NLL; and no less than 1e-5), and every
    greedy token must agree. An absolute
    limit would refuse correct conversions of models whose logits are large, and calibrating on the source's noise
    keeps the check as tight as float32 allows on small ones.

    In a lower precision the converted model's mean abs logit error may be no larger than the source's own, i.e. the
    conversion adds no error beyond the rounding that precision already carries. The mean, not the max: a max over
    ~10^7 logits that are each a few bfloat16 roundings off is an extreme value that changes order from one text to
    the next, while the mean measures the systematic error. NLL and greedy tokens are then reported only, as
    rounding alone moves them.
    """

    dtype: torch.dtype
    num_tokens: int  # tokens of the sample text scored
    max_abs_logit_diff: float  # converted model vs the float32 reference
    mean_abs_logit_diff: float
    source_max_abs_logit_diff: float  # the source in `dtype` vs the same reference (zero in float32)
    source_mean_abs_logit_diff: float
    source_nll: float  # mean next-token negative log-likelihood, both in `dtype`
    converted_nll: float
    greedy_tokens: int  # tokens each model generated greedily
    greedy_tokens_agreeing: int  # leading generated tokens that are identical
    max_abs_source_logit: float = 0.0  # the largest logit of the source, in magnitude
    # float32: the source against itself with its attention in a second implementation ("sdpa vs eager"), or in
    # float64 where it has only one ("float32 vs float64"); None in reports written before that fallback
    noise_implementations: str | None = None
    noise_max_abs_logit_diff: float = 0.0
    noise_nll_diff: float = 0.0
    random_token_ids: bool = False  # run on fixed random token ids: the source had no tokenizer to encode the text

    @property
    def inputs(self) -> str:
        return f"{self.num_tokens} {'random token ids' if self.random_token_ids else 'tokens'}"

    @property
    def nll_diff(self) -> float:
        return abs(self.converted_nll - self.source_nll)

    @property
    def max_abs_logit_diff_allowed(self) -> float:
        """`NOISE_FACTOR` x the source's own float noise: its second attention implementation, or one float32 step of
        its largest logit, whichever is larger."""
        return NOISE_FACTOR * max(self.noise_max_abs_logit_diff, FP32_EPS * self.max_abs_source_logit)

    @property
    def nll_diff_allowed(self) -> float:
        noise = max(self.noise_nll_diff, FP32_EPS * self.source_nll)
        return max(FP32_MIN_NLL_DIFF_ALLOWED, NOISE_FACTOR * noise)

    @property
    def passed(self) -> bool:
        if self.dtype == torch.float32:
            return (
                self.max_abs_logit_diff <= self.max_abs_logit_diff_allowed
                and self.nll_diff <= self.nll_diff_allowed
                and self.greedy_tokens_agreeing == self.greedy_tokens
            )
        return self.mean_abs_logit_diff <= self.source_mean_abs_logit_diff

    def rows(self) -> list[tuple[str, str, str]]:
        """(figure, value, required) rows, shared by the terminal output and the model card."""
        precision = str(self.dtype).removeprefix("torch.")
        greedy = f"{self.greedy_tokens_agreeing}/{self.greedy_tokens}"
        if self.dtype == torch.float32:
            implementations = self.noise_implementations or "a second implementation (none available)"
            return [
                (
                    f"max abs logit diff, converted vs source (float32, {self.inputs})",
                    f"{self.max_abs_logit_diff:.3g}",
                    f"<= {self.max_abs_logit_diff_allowed:.3g} ({NOISE_FACTOR} x the source's own noise)",
                ),
                (
                    f"source's own noise: max abs logit diff of the source, attention {implementations}",
                    f"{self.noise_max_abs_logit_diff:.3g}",
                    f"taken as at least one float32 step of its largest logit ({self.max_abs_source_logit:.3g}): "
                    f"{FP32_EPS * self.max_abs_source_logit:.3g}",
                ),
                ("mean abs logit diff", f"{self.mean_abs_logit_diff:.3g}", ""),
                ("mean NLL, source / converted", f"{self.source_nll:.6f} / {self.converted_nll:.6f}", ""),
                (
                    "NLL diff",
                    f"{self.nll_diff:.3g}",
                    f"<= {self.nll_diff_allowed:.3g} ({NOISE_FACTOR} x the source's own: {self.noise_nll_diff:.3g}, "
                    f"at least one float32 step of its NLL; at least {FP32_MIN_NLL_DIFF_ALLOWED:.3g})",
                ),
                ("greedy tokens identical", greedy, "all"),
            ]
        return [
            (
                f"mean abs logit diff from the source in float32 ({self.inputs}), converted ({precision})",
                f"{self.mean_abs_logit_diff:.3g}",
                f"<= {self.source_mean_abs_logit_diff:.3g}, the source's own in {precision}",
            ),
            (
                "max abs logit diff from the source in float32, converted",
                f"{self.max_abs_logit_diff:.3g}",
                f"reported only; the source's own: {self.source_max_abs_logit_diff:.3g}",
            ),
            (f"mean NLL ({precision}), source / converted", f"{self.source_nll:.6f} / {self.converted_nll:.6f}", ""),
            ("NLL diff", f"{self.nll_diff:.3g}", "reported only"),
            (f"greedy tokens identical ({precision})", greedy, "reported only"),
        ]

    def format(self) -> str:
        rows = [("figure", "value", "required"), *self.rows()]
        widths = [max(len(row[column]) for row in rows) for column in range(2)]
        lines = [f"  {figure:<{widths[0]}}  {value:>{widths[1]}}  {limit}".rstrip() for figure, value, limit in rows]
        return "\n".join(lines + [f"  verification {'passed' if self.passed else 'FAILED'}"])

    def to_markdown(self) -> str:
        lines = ["| figure | value | required |", "|---|---|---|"]
        lines += [f"| {figure} | {value} | {limit} |" for figure, value, limit in self.rows()]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """Plain JSON values (the dtype by name), as `from_dict` reads them back."""
        return {**asdict(self), "dtype": str(self.dtype).removeprefix("torch.")}

    @classmethod
    def from_dict(cls, figures: dict) -> "VerificationReport":
        return cls(**{**figures, "dtype": getattr(torch, figures["dtype"])})


@dataclass
class _Run:
    logits: torch.Tensor  # [T, vocab] float32
    nll: float
    generated: torch.Tensor  # [new_tokens]


@torch.no_grad()
def _run(model: PreTrainedModel, input_ids: torch.Tensor, prompt: torch.Tensor, greedy: GenerationConfig) -> _Run:
    logits = model(input_ids=input_ids).logits[0].float()
    nll = F.cross_entropy(logits[:-1], input_ids[0, 1:]).item()
    generated = model.generate(prompt, attention_mask=torch.ones_like(prompt), generation_config=greedy)
    return _Run(logits, nll, generated[0, prompt.shape[1] :])


def _abs_diff(logits: torch.Tensor, reference: torch.Tensor) -> tuple[float, float]:
    """(max, mean) of the absolute difference."""
    diff = (logits - reference).abs()
    return diff.max().item(), diff.mean().item()


@torch.no_grad()
def _attention_noise(model: PreTrainedModel, input_ids: torch.Tensor, run: _Run) -> tuple[str | None, float, float]:
    """(implementations, max abs logit diff, NLL diff): how far the model's figures in `run` move when its attention
    runs in a second implementation (eager for sdpa and the rest, sdpa for eager). A model with only one that runs
    here (Gemma2's softcapping and GPT-OSS's sinks have no sdpa) is measured against itself in float64 instead: its
    own float32 rounding, on a float64 copy of the weights (twice their memory, while it runs)."""
    current = attention_implementation(model)
    other = "sdpa" if current == "eager" else "eager"
    try:
        model.set_attn_implementation(other)
    except (ValueError, ImportError):
        reference = copy.deepcopy(model).to(torch.float64)
        if reference.get_experts_implementation()[""] not in (None, "eager"):
            reference.set_experts_implementation("eager")  # grouped_mm has no float64 kernel
        logits = reference(input_ids=input_ids).logits[0]
        del reference
        implementations = "float32 vs float64"
    else:
        try:
            logits = model(input_ids=input_ids).logits[0].float()
        finally:
            model.set_attn_implementation(current)
        implementations = f"{current} vs {other}"
    nll_diff = abs(F.cross_entropy(logits[:-1], input_ids[0, 1:]).item() - run.nll)
    return implementations, (logits - run.logits).abs().max().item(), nll_diff


def leading_agreement(first: torch.Tensor, second: torch.Tensor) -> int:
    """How many leading tokens two generations [T] share."""
    differs = (first != second).nonzero()
    return len(first) if len(differs) == 0 else int(differs[0, 0])


def verify_conversion(
    source: PreTrainedModel,
    converted: AttnResForCausalLM,
    tokenizer: PreTrainedTokenizerBase | None,
    text: str | None = None,
    max_tokens: int = 512,
    new_tokens: int = 64,
    prompt_tokens: int = 64,
) -> VerificationReport:
    """Run source and converted model on the same text: logits, mean NLL, and greedy continuations of its start.

    Both models must be in the same dtype. In float32 the source runs once more with its attention in a second
    implementation, which measures its own float noise. Outside float32 the source also runs in float32 (a copy with
    the same weights) as the reference both are measured against; the copy costs twice the weights' memory while it
    runs. Without a tokenizer both run on `max_tokens` fixed random token ids instead of text.
    """
    if source.dtype != converted.dtype:
        raise ConversionError(
            f"the source is in {source.dtype} and the converted model in {converted.dtype}: verify them in one dtype "
            "(load or cast both with the same torch_dtype)"
        )
    if tokenizer is None and text is not None:
        raise ConversionError("a text to verify on needs the tokenizer that encodes it: pass tokenizer= as well")
    input_ids = verification_input_ids(tokenizer, text, max_tokens, converted.config.vocab_size).to(converted.device)
    prompt = input_ids[:, :prompt_tokens]
    greedy = greedy_config(source, tokenizer, new_tokens)
    source_run = _run(source, input_ids, prompt, greedy)
    converted_run = _run(converted, input_ids, prompt, greedy)
    noise = None, 0.0, 0.0
    if converted.dtype == torch.float32:
        reference_logits = source_run.logits
        noise = _attention_noise(source, input_ids, source_run)
    else:
        with torch.no_grad():
            # `.to`, not `.float()`: transformers refuses `.float()` on GGUF-loaded (already dequantised) models
            reference_logits = copy.deepcopy(source).to(torch.float32)(input_ids=input_ids).logits[0]
    max_abs_logit_diff, mean_abs_logit_diff = _abs_diff(converted_run.logits, reference_logits)
    source_max_abs_logit_diff, source_mean_abs_logit_diff = _abs_diff(source_run.logits, reference_logits)
    return VerificationReport(
        dtype=converted.dtype,
        num_tokens=input_ids.shape[1],
        max_abs_logit_diff=max_abs_logit_diff,
        mean_abs_logit_diff=mean_abs_logit_diff,
        source_max_abs_logit_diff=source_max_abs_logit_diff,
        source_mean_abs_logit_diff=source_mean_abs_logit_diff,
        source_nll=source_run.nll,
        converted_nll=converted_run.nll,
        greedy_tokens=len(source_run.generated),
        greedy_tokens_agreeing=leading_agreement(source_run.generated, converted_run.generated),
        max_abs_source_logit=source_run.logits.abs().max().item(),
        noise_implementations=noise[0],
        noise_max_abs_logit_diff=noise[1],
        noise_nll_diff=noise[2],
        random_token_ids=tokenizer is None,
    )


def greedy_config(
    source: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, new_tokens: int
) -> GenerationConfig:
    """Greedy decoding of exactly `new_tokens` tokens, with the source's end-of-sequence token."""
    pad_token_id = source.generation_config.pad_token_id
    if pad_token_id is None:  # a single unpadded sequence: any id does, and naming one spares generate's notice
        pad_token_id = tokenizer.eos_token_id if tokenizer is not None else 0
    return GenerationConfig(
        do_sample=False,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,  # no early stop: compare the same number of tokens every time
        eos_token_id=source.generation_config.eos_token_id,
        pad_token_id=pad_token_id,
    )


def verification_input_ids(
    tokenizer: PreTrainedTokenizerBase | None, text: str | None, max_tokens: int, vocab_size: int
) -> torch.Tensor:
    """[1, tokens]: the text (default `SAMPLE_TEXT`) encoded, or without a tokenizer `max_tokens` random ids, the same
    on every run."""
    if tokenizer is None:
        return torch.randint(vocab_size, (1, max_tokens), generator=torch.Generator().manual_seed(0))
    return tokenizer(text or SAMPLE_TEXT, return_tensors="pt").input_ids[:, :max_tokens]


# A fixed sample of real English prose and Python code, scored by `verify_conversion`. At least 512 tokens for
# common tokenizers. The prose is the Gettysburg Address (Bliss copy, public domain) and a paragraph on this method.
SAMPLE_TEXT = '''\
Four score and seven years ago our fathers brought forth on this continent, a new nation, conceived in Liberty, and \
dedicated to the proposition that all men are created equal.

Now we are engaged in a great civil war, testing whether that nation, or any nation so conceived and so dedicated, \
can long endure. We are met on a great battle-field of that war. We have come to dedicate a portion of that field, as \
a final resting place for those who here gave their lives that that nation might live. It is altogether fitting and \
proper that we should do this.

But, in a larger sense, we can not dedicate -- we can not consecrate -- we can not hallow -- this ground. The brave \
men, living and dead, who struggled here, have consecrated it, far above our poor power to add or detract. The world \
will little note, nor long remember what we say here, but it can never forget what they did here. It is for us the \
living, rather, to be dedicated here to the unfinished work which they who fought here have thus far so nobly \
advanced. It is rather for us to be here dedicated to the great task remaining before us -- that from these honored \
dead we take increased devotion to that cause for which they gave the last full measure of devotion -- that we here \
highly resolve that these dead shall not have died in vain -- that this nation, under God, shall have a new birth of \
freedom -- and that government of the people, by the people, for the people, shall not perish from the earth.

In a standard transformer, every layer adds its output to a single running sum, the residual stream, and the next \
layer reads that sum through a normalisation. Attention Residuals replace the fixed sum with a learned choice: each \
layer scores the earlier representations with a small query vector and reads a weighted mixture of them. When the \
queries are zero, all weights are equal, and the mixture is the familiar residual stream up to a known scale.

```python
from collections import Counter
from pathlib import Path


def word_frequencies(path: Path, top: int = 10) -> list[tuple[str, int]]:
    """Count how often each word occurs in a text file and return the most common ones."""
    counts = Counter()
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            words = (word.strip(".,;:!?\\"'()[]").lower() for word in line.split())
            counts.update(word for word in words if word)
    return counts.most_common(top)


def binary_search(items: list[int], target: int) -> int:
    """Return the index of `target` in the sorted list `items`, or -1 when it is absent."""
    low, high = 0, len(items) - 1
    while low <= high:
        middle = (low + high) // 2
        if items[middle] == target:
            return middle
        if items[middle] < target:
            low = middle + 1
        else:
            high = middle - 1
    return -1


if __name__ == "__main__":
    for word, count in word_frequencies(Path("speech.txt")):
        print(f"{word:>12} {count}")
```
'''
