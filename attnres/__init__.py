"""AttnRes: Attention Residuals (Kimi Team, arXiv 2603.15031) for Hugging Face Transformers.

`import attnres` registers `model_type="attnres"` with AutoConfig, AutoModel and AutoModelForCausalLM (and PEFT's
LoRA defaults; see `attnres.auto`), as model libraries do: AttnRes folders then load through the Auto classes without
`trust_remote_code`, with the installed classes. The one exception is the process of the `attnres` command, whose
`--help` answers before torch loads: there each command registers the classes when it runs (every module of the
package that loads a model imports `attnres.auto`).
"""

import sys
from pathlib import Path

__version__ = "0.1.0"
# The console script of the `attnres` command (setup.cfg), the first word of its process's command line
COMMAND = "attnres"

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]

if Path((getattr(sys, "argv", None) or [""])[0]).stem != COMMAND:
    from . import auto  # noqa: F401  (registers the classes with the Auto classes)


def __getattr__(name: str):
    if name in __all__:
        from . import auto

        return getattr(auto, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
