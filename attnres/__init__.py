"""AttnRes: Attention Residuals (Kimi Team, arXiv 2603.15031) for Hugging Face Transformers.

Importing the package is light, so that the `attnres` command answers at once. The first use of a name below
(`attnres.AttnResConfig`, `from attnres import AttnResForCausalLM`) loads torch and transformers and registers
`model_type="attnres"` with AutoConfig, AutoModel and AutoModelForCausalLM (see `attnres.auto`).
"""

__version__ = "0.1.0"

__all__ = [
    "SUPPORTED_FAMILIES",
    "AttnResConfig",
    "AttnResForCausalLM",
    "AttnResModel",
    "AttnResPreTrainedModel",
]


def __getattr__(name: str):
    if name in __all__:
        from . import auto

        return getattr(auto, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
