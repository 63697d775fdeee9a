"""The package's reach into torch's private parts: dynamo's recompile limit, which has no public setter."""

import torch
import torch._dynamo

from . import require


def raise_recompile_limit(at_least: int) -> None:
    """Let dynamo compile at least `at_least` graphs of one function for the rest of this process."""
    require(hasattr(torch._dynamo.config, "recompile_limit"), torch, "_dynamo.config.recompile_limit")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, at_least)
