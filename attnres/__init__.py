"""AttnRes: Attention Residuals (Kimi Team, arXiv 2603.15031) for Hugging Face Transformers.

`import attnres` registers `model_type="attnres"` with AutoConfig, AutoModel and AutoModelForCausalLM (and PEFT's
LoRA defaults; see `attnres.auto`), in every process, as model libraries do: AttnRes folders then load through the
Auto classes without `trust_remote_code`, with the installed classes. That loads torch and transformers, so the
`attnres` command, whose `--help` answers before torch loads, lives outside this package (`attnres_cli`).
"""

from .auto import SUPPORTED_FAMILIES, AttnResConfig, AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]
