"""What AttnRes requires of each library, and what every seam shares: the error a release without a private part stops
with, and the check that raises it.

The seams themselves are `attnres.compat` (one module per library) and, for the command, `attnres_cli.argparse_private`.
Standard library only: the command's process checks its argparse seam before anything heavy loads.
"""

import platform
import sys
from types import ModuleType

from .errors import AttnResInputError

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


class PrivatePartMissing(AttnResInputError, ImportError):
    """A library release without a private part that AttnRes relies on; the message names the release to install."""


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
