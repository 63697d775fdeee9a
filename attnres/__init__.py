"""AttnRes: Attention Residuals (Kimi Team, arXiv 2603.15031) for Hugging Face Transformers.

`import attnres` registers `model_type="attnres"` with AutoConfig, AutoModel and AutoModelForCausalLM (and PEFT's
LoRA defaults; see `attnres.auto`), in every process, as model libraries do: AttnRes folders then load through the
Auto classes without `trust_remote_code`, with the installed classes. That loads torch and transformers, so the
`attnres` command, whose `--help` answers before torch loads, lives outside this package (`attnres_cli`), and reads
the package's light modules (errors, requirements, families, rules, options: standard library only) alone.
"""

# The light modules (standard library only), which the command (`attnres_cli`) may have loaded already, alone: bound
# here as the package's attributes either way
from . import errors, families, options, requirements, rules  # noqa: F401
from .auto import SUPPORTED_FAMILIES, AttnResConfig, AttnResForCausalLM, AttnResModel, AttnResPreTrainedModel

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]
