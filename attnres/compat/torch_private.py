"""The package's reach into torch's private parts: dynamo's recompile limit, which has no public setter, and, for the
benchmarks, the dispatch mode that sees every aten operation and the pytree helpers it reads them with, which torch
keeps in private modules."""

import torch
import torch._dynamo
import torch.utils._python_dispatch
import torch.utils._pytree

from . import require


def raise_recompile_limit(at_least: int) -> None:
    """Let dynamo compile at least `at_least` graphs of one function for the rest of this process."""
    require(hasattr(torch._dynamo.config, "recompile_limit"), torch, "_dynamo.config.recompile_limit")
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, at_least)


def dispatch_mode_base() -> type:
    """`TorchDispatchMode`: a subclass's `__torch_dispatch__` sees every aten operation run inside it."""
    present = hasattr(torch.utils._python_dispatch, "TorchDispatchMode")
    require(present, torch, "utils._python_dispatch.TorchDispatchMode")
    return torch.utils._python_dispatch.TorchDispatchMode


def tensor_leaves(tree) -> list:
    """The leaves of a nest of tuples, lists and dicts (an operation's arguments and output)."""
    require(hasattr(torch.utils._pytree, "tree_leaves"), torch, "utils._pytree.tree_leaves")
    return torch.utils._pytree.tree_leaves(tree)
