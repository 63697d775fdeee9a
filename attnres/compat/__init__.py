"""The seams: every reach into another library's private parts, one module per library, each a small named function.

A private part (a name with a leading underscore, a module or table a library keeps for itself, an attribute of its
own state) can change in any release without notice. The package names none outside these modules
(tests/test_seams.py holds it to that, and checks that the installed releases still have each one), so an upgrade is
checked here: each function first checks that what it reaches for is still there, and stops with `PrivatePartMissing`,
naming the library's release and the range AttnRes runs on, instead of failing later or silently doing nothing. The
model files, which travel alone as remote code, keep their own seam at the top of modeling_attnres.py and
configuration_attnres.py.

Standard library only here: the process of the `attnres` command imports `argparse_private` before anything heavy.
"""

import platform
import sys
from types import ModuleType

# What setup.cfg requires of each library (pip's name first); a release that lacks a private part ends the range
REQUIREMENTS = {
    "accelerate": "accelerate>=1.10",
    "deepspeed": "deepspeed>=0.19",
    "huggingface_hub": "huggingface_hub>=1.0",
    "lm_eval": "lm-eval>=0.4.13,<0.5",
    "peft": "peft>=0.17",
    "torch": "torch>=2.6,<2.15",
    "transformers": "transformers>=5.24",
}


class PrivatePartMissing(ImportError):
    """A library release without a private part that AttnRes relies on."""


def require(present: bool, library: ModuleType, what: str) -> None:
    """Stop with `PrivatePartMissing` unless `present`: the installed `library` lacks `what`."""
    if present:
        return
    name = library.__name__
    if name in sys.stdlib_module_names:
        raise PrivatePartMissing(
            f"Python {platform.python_version()}'s {name} has no {what}, which AttnRes relies on: "
            "run it on an earlier Python, or a newer attnres"
        )
    requirement = REQUIREMENTS[name]
    raise PrivatePartMissing(
        f"{name} {library.__version__} has no {what}, which AttnRes relies on; AttnRes supports {requirement} up to "
        f'the releases that have it: pip install "{requirement},<{library.__version__}"'
    )
