"""The folders that `attnres` commands write: what they hold, one check before a command writes into one, one way of
writing a file or folder whole or not at all, and the metrics a training run logs there.

Nothing here imports the rest of the package, so every module can use it.
"""

import errno
import fcntl
import json
import logging
import os
import shutil
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import InterruptedReplaceError

CHECKPOINTS_FOLDER = "checkpoints"
METRICS_FILE = "metrics.jsonl"
TRAINING_CONFIG_FILE = "training_config.json"
DISK_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# What the errors of writers that drop errno say of a full disk: safetensors' SafetensorError ("No space left on
# device"), and torch.save's RuntimeErrors for a write that came up short, which name no cause at all
DISK_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "file write failed", "unexpected pos")
SIZE_UNITS = ((10**12, "TB"), (10**9, "GB"), (10**6, "MB"), (10**3, "kB"))

logger = logging.getLogger(__name__)


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
    check_not_set_aside(output_dir, error)
    if output_dir.exists() and not output_dir.is_dir():
        raise error(f"{output_dir} exists and is not a folder")
    check_can_be_made(output_dir, error)
    if non_empty_fix is not None and output_dir.is_dir() and any(output_dir.iterdir()):
        raise error(f"{output_dir} exists and is not empty; {non_empty_fix}")


def replace_fix(overwrite: bool) -> str | None:
    """`check_output_dir`'s `non_empty_fix` for a command that replaces its output whole with `--overwrite`."""
    return None if overwrite else "pass --overwrite (overwrite=True) to replace it"


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


def previous_path(path: Path) -> Path:
    """Where `put_in_place` sets an output aside while its replacement moves in."""
    return path.with_name(f".{path.name}.previous")


def check_not_set_aside(path: Path, error: type[Exception]) -> None:
    """Raise `error` when `path` is missing because a replacement of it was stopped halfway (a kill between the two
    renames of `put_in_place`): its old contents are in `.NAME.previous`, which the user restores or deletes."""
    previous = previous_path(path)
    if previous.exists() and not path.exists():
        raise error(
            f"{path} is missing: an earlier --overwrite was stopped while replacing it, and the old output is in "
            f"{previous}; restore it (mv {previous} {path}) or delete {previous}, then rerun"
        )


def put_in_place(staged: Path, path: Path) -> None:
    """Move the complete `staged` file or folder to `path`, replacing what was there; a rename, so `path` is never
    half-written. A folder cannot be renamed over another: the old one is set aside as `.NAME.previous` (a notice
    says so, for a kill between the two renames) and deleted once the new one is in place."""
    check_not_set_aside(path, InterruptedReplaceError)  # that `.previous` is the old output's only copy
    if not (staged.is_dir() and path.exists()):
        os.replace(staged, path)
        return
    if path.is_dir() and not path.is_symlink() and not any(path.iterdir()):
        path.rmdir()  # an empty folder holds nothing to set aside
        staged.rename(path)
        return
    previous = previous_path(path)
    remove(previous)  # left by a replacement killed after its second rename: `path` holds the newer output
    logger.info(f"Replacing {path}: the old output is in {previous} until the new one is in place")
    path.rename(previous)
    staged.rename(path)
    remove(previous)


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


def is_disk_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of space (or quota), whichever library raised it."""
    if isinstance(error, OSError) and error.errno in DISK_FULL_ERRNOS:
        return True
    return any(words in str(error) for words in DISK_FULL_WORDS)


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """The bytes of `tensors` (torch tensors, or anything with `numel` and `element_size`): about what saving them
    writes."""
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def format_size(size_in_bytes: int) -> str:
    """1234567 -> '1.2 MB', in the decimal units of `--max-shard-size`."""
    unit_bytes, unit = next(((bytes_, name) for bytes_, name in SIZE_UNITS if size_in_bytes >= bytes_), (1, "bytes"))
    return f"{size_in_bytes / unit_bytes:.1f} {unit}" if unit_bytes > 1 else f"{size_in_bytes} bytes"


def free_space(path: Path) -> int:
    """Bytes free on the disk that holds `path` (or would, for a folder not made yet)."""
    existing = next(folder for folder in (path, *path.absolute().parents) if folder.exists())
    return shutil.disk_usage(existing).free


@contextmanager
def disk_space_for(
    folder: Path, needed_bytes: int, error: type[Exception], fix: str = "choose an output folder on another disk"
) -> Iterator[None]:
    """Turn a full disk while the block writes `folder` into `error`, one line: the folder, about how much space
    writing it needs and how much is free, and `fix`. Put it around `written_whole`, so that the free space is told
    once the partial files are gone."""
    try:
        yield
    except Exception as failure:
        if not is_disk_full(failure):
            raise
        raise error(
            f"the disk is full: writing {folder} needs about {format_size(needed_bytes)}, and "
            f"{format_size(free_space(folder))} is free there; free up space, or {fix}"
        ) from failure


@contextmanager
def output_lock(path: Path, error: type[Exception]) -> Iterator[None]:
    """Hold `path` (an output file or folder) for this process while a command writes it: a lock file beside it,
    `.NAME.lock` (see `lock_held`), removed at the end. A second command on the same output is refused with `error`;
    a lock whose process is gone (killed) is taken."""
    check_can_be_made(path, error)
    path = path.resolve()  # `.` and `out/` have a name too
    with lock_held(path.with_name(f".{path.name}.lock")) as owner:
        if owner is not None:
            raise error(
                f"{path} is being written by another attnres process (pid {owner}); wait for it to finish, or "
                "choose another output folder"
            )
        yield


@contextmanager
def lock_held(lock: Path) -> Iterator[int | None]:
    """Take the lock file `lock` for this process -> None when taken, else the process id of the live holder.

    The lock is an advisory `flock` on the file, which the system drops when its process ends, however it ends: a lock
    left by a killed process is simply taken. The holder's process id is written in the file for messages; the file is
    removed at the end."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    while True:
        descriptor = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(descriptor)
            yield lock_owner(lock)
            return
        if is_same_file(descriptor, lock):
            break
        os.close(descriptor)  # its holder removed the file between our open and our lock: lock the new one
    os.ftruncate(descriptor, 0)
    os.write(descriptor, str(os.getpid()).encode())
    try:
        yield None
    finally:
        lock.unlink(missing_ok=True)  # before the unlock, so that no one locks a file that is about to go
        os.close(descriptor)


def is_same_file(descriptor: int, path: Path) -> bool:
    """Whether the open file `descriptor` is still the file at `path`."""
    try:
        return os.path.samestat(os.fstat(descriptor), os.stat(path))
    except FileNotFoundError:
        return False


def lock_owner(lock: Path) -> int:
    """The process id written in a held `lock`: 0 while the holder has not written it yet."""
    for _ in range(20):
        try:
            owner = int(lock.read_text().strip() or 0)
        except (OSError, ValueError):
            owner = 0
        if owner:
            return owner
        time.sleep(0.05)  # the holder writes its id right after it takes the lock
    return 0


def read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The records of `metrics.jsonl` that `attnres train` wrote in `folder`; empty for any other folder."""
    file = folder / METRICS_FILE
    return [json.loads(line) for line in file.read_text().splitlines()] if file.is_file() else []
