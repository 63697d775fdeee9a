"""The folders that `attnres` commands write: what they hold, one check before a command writes into one, one way of
writing a file or folder whole or not at all, and the metrics a training run logs there.

Nothing here imports the rest of the package, so every module can use it.
"""

import json
import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

CHECKPOINTS_FOLDER = "checkpoints"
METRICS_FILE = "metrics.jsonl"
TRAINING_CONFIG_FILE = "training_config.json"


def check_output_dir(
    output_dir: Path,
    error: type[Exception],
    inputs: Mapping[str, str | os.PathLike | None],
    non_empty_fix: str | None,
) -> None:
    """Raise `error` before anything is written where writing `output_dir` could lose or garble files:

    - it is a file, or (unless `non_empty_fix` is None) a folder with something in it, which what the command writes
      would mix with or replace: the message names `non_empty_fix`. None lets what is there stay (`--overwrite`,
      `--resume`, or a command that writes its files beside others);
    - whatever `non_empty_fix`, it is or contains the current or the home folder, or it is, contains or lies inside
      one of `inputs` ({"the source model": path, ...}; None and what is no path on this machine, as a Hub id, pass):
      `--overwrite` replaces an earlier output, never the user's folders or what the command reads. Symlinks and
      relative spellings (`./m`, `m/`, `../x/m`) are resolved first.
    """
    check_outside(output_dir, inputs, error)
    if output_dir.exists() and not output_dir.is_dir():
        raise error(f"{output_dir} exists and is not a folder")
    check_can_be_made(output_dir, error)
    if non_empty_fix is not None and output_dir.is_dir() and any(output_dir.iterdir()):
        raise error(f"{output_dir} exists and is not empty; {non_empty_fix}")


def check_can_be_made(path: Path, error: type[Exception]) -> None:
    """Raise `error` when a file stands where a folder above `path` would have to be."""
    existing = next(parent for parent in path.absolute().parents if parent.exists())
    if not existing.is_dir():
        raise error(f"{path} cannot be made: {existing} is a file, not a folder")


def check_outside(output_dir: Path, inputs: Mapping[str, str | os.PathLike | None], error: type[Exception]) -> None:
    """The part of `check_output_dir` that no option lifts: the user's folders and the command's inputs."""
    output = output_dir.resolve()
    for place, folder in (("the current folder", Path.cwd()), ("your home folder", Path.home())):
        relation = path_relation(output, folder.resolve())
        if relation in ("is", "contains"):  # a new folder inside either is where outputs belong
            raise error(
                f"the output folder {output_dir} {relation} {place}, whose files are not this command's to replace "
                "or mix with; name a new folder for the output"
            )
    for what, path in inputs.items():
        if path is None or not Path(path).expanduser().exists():
            continue
        relation = path_relation(output, Path(path).expanduser().resolve())
        if relation is not None:
            raise error(
                f"the output folder {output_dir} {relation} {what} {path}: a command never writes into or replaces "
                "what it reads, not even with --overwrite; choose another output folder"
            )


def path_relation(path: Path, other: Path) -> str | None:
    """How `path` stands to `other`, both resolved: "is", "lies inside", "contains", or None (apart)."""
    if path == other:
        return "is"
    if other in path.parents:
        return "lies inside"
    if path in other.parents:
        return "contains"
    return None


def staging_path(path: Path) -> Path:
    """Where `path` (a file or a folder) is written before `put_in_place` moves it there: beside it, hidden, and the
    same for every process of a run, so that all of them can write into one staging folder."""
    return path.with_name(f".{path.name}.partial")


def remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


def put_in_place(staged: Path, path: Path) -> None:
    """Move the complete `staged` file or folder to `path`, replacing what was there; a rename, so `path` is never
    half-written."""
    if staged.is_dir() and path.exists():  # a folder cannot be renamed over another: set the old one aside first
        previous = path.with_name(f".{path.name}.previous")
        remove(previous)
        path.rename(previous)
        staged.rename(path)
        remove(previous)
    else:
        os.replace(staged, path)


@contextmanager
def written_whole(path: Path) -> Iterator[Path]:
    """Write `path` (a file or a folder) whole or not at all: write to the yielded staging path, which replaces `path`
    once the block completes. An interrupted or failed write leaves `path` as it was and no staging behind.

        with written_whole(output_dir) as staging:
            model.save_pretrained(staging)
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = staging_path(path)
    remove(staging)  # left over from a write that was killed
    try:
        yield staging
        put_in_place(staging, path)
    finally:
        if staging.exists():
            remove(staging)


@contextmanager
def output_lock(path: Path, error: type[Exception]) -> Iterator[None]:
    """Hold `path` (an output file or folder) for this process while a command writes it: a lock file beside it,
    `.NAME.lock`, made atomically with the process id in it and removed at the end. A second command on the same
    output is refused with `error`; a lock whose process is gone (killed) is taken over."""
    check_can_be_made(path, error)
    path = path.resolve()  # `.` and `out/` have a name too
    lock = path.with_name(f".{path.name}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            break
        except FileExistsError:
            owner = lock_owner(lock)
            if owner is not None:
                raise error(
                    f"{path} is being written by another attnres process (pid {owner}); wait for it to finish, or "
                    "choose another output folder"
                ) from None
            lock.unlink(missing_ok=True)  # left by a process that is gone
    os.write(descriptor, str(os.getpid()).encode())
    os.close(descriptor)
    try:
        yield
    finally:
        lock.unlink(missing_ok=True)


def lock_owner(lock: Path) -> int | None:
    """The live process that holds `lock`, or None when the lock is stale (its process is gone, or it is unreadable)."""
    try:
        owner = int(lock.read_text().strip() or 0)
        os.kill(owner, 0)  # signal 0: only whether the process exists
    except (ValueError, OSError) as failure:
        return owner if isinstance(failure, PermissionError) else None  # another user's live process
    return owner if owner > 0 else None


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl` that `attnres train` wrote in `folder`; empty for any other folder."""
    file = folder / METRICS_FILE
    return [json.loads(line) for line in file.read_text().splitlines()] if file.is_file() else []
