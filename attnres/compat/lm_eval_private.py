"""The package's reach into lm-eval's private parts: the git probe its evaluator runs, which it has no switch for."""

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager

import lm_eval
import lm_eval.evaluator
from lm_eval.loggers.utils import get_commit_from_path

from . import require


@contextmanager
def quiet_git_probe() -> Iterator[None]:
    """Inside the block, lm-eval records the git commit of the current folder with git's stderr discarded: outside a
    repository its "fatal: not a git repository" says nothing about the evaluation."""
    present = callable(getattr(lm_eval.evaluator, "get_git_commit_hash", None))
    require(present, lm_eval, "evaluator.get_git_commit_hash")
    probe = lm_eval.evaluator.get_git_commit_hash
    lm_eval.evaluator.get_git_commit_hash = quiet_git_commit_hash
    try:
        yield
    finally:
        lm_eval.evaluator.get_git_commit_hash = probe


def quiet_git_commit_hash() -> str | None:
    """lm-eval's `get_git_commit_hash`, with git's stderr discarded."""
    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL, text=True).strip()
    except (subprocess.CalledProcessError, FileNotFoundError):  # no repository here, or no git
        return get_commit_from_path(os.getcwd())
