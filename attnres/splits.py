"""Documents split three ways for a study: training, a validation split on which every choice is made (learning
rates, variants, early decisions), and a test split scored once, for the final table.

Held-out documents are drawn only from those that share little text with the rest of the corpus. A corpus of
templated pages (release notes, generated reference pages) otherwise puts training text into the held-out splits: in
Django's documentation, 40% of the 32-byte windows of a held-out set drawn at random occur verbatim in training. The
share is measured on exact byte windows (a rolling hash of every `WINDOW_BYTES`-byte window), once per document
against every other document, and again for the final splits against the training split: the latter is what a
study reports.
"""

import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import DataError

# Long enough that a shared window is shared text, not a common phrase of the language
WINDOW_BYTES = 32


@dataclass(frozen=True)
class HoldOut:
    """How each held-out split (validation, test) is drawn: at least `documents` documents and `bytes` bytes, each
    document of `document_bytes` (prose-sized, so that no one document makes up a split) and sharing at most
    `max_shared` of its windows with the other documents of the corpus."""

    documents: int = 8
    bytes: int = 66 * 1024  # 256 sequences of 256 bytes are scored, with room for the EOS tokens and cut tails
    document_bytes: tuple[int, int] = (1024, 16 * 1024)
    max_shared: float = 0.10


@dataclass(frozen=True)
class DocumentSplit:
    """Document names of each split, and how much of each held-out split's text occurs verbatim in training."""

    train: tuple[str, ...]
    validation: tuple[str, ...]
    test: tuple[str, ...]
    shared_with_train: dict[str, float]  # "validation", "test" -> share of their windows found in training
    too_shared: int  # documents of held-out size kept in training because they share more than `max_shared`

    def splits(self) -> dict[str, tuple[str, ...]]:
        return {"train": self.train, "validation": self.validation, "test": self.test}


def window_hashes(text: bytes, width: int = WINDOW_BYTES) -> np.ndarray:
    """A 64-bit polynomial hash of every `width`-byte window of `text` (len(text) - width + 1 of them, none for a
    shorter text). Equal windows hash equal; unequal ones collide with probability ~2^-64 per pair."""
    data = np.frombuffer(text, dtype=np.uint8).astype(np.uint64)
    count = len(data) - width + 1
    hashes = np.zeros(max(count, 0), dtype=np.uint64)
    with np.errstate(over="ignore"):  # arithmetic modulo 2^64 is the point
        for offset in range(width):
            hashes = hashes * np.uint64(1099511628211) + data[offset : offset + count] + np.uint64(1)
    return hashes


def share_found(hashes: np.ndarray, sorted_set: np.ndarray) -> float:
    """The share of `hashes` (windows, counted where they occur) that are in `sorted_set` (sorted, unique)."""
    if len(hashes) == 0 or len(sorted_set) == 0:
        return 0.0
    index = np.minimum(np.searchsorted(sorted_set, hashes), len(sorted_set) - 1)
    return float(np.mean(sorted_set[index] == hashes))


def shared_with_others(texts: list[bytes]) -> list[float]:
    """For each text, the share of its windows that occur verbatim in at least one other text."""
    hashes = [window_hashes(text) for text in texts]
    distinct, in_texts = np.unique(np.concatenate([np.unique(h) for h in hashes]), return_counts=True)
    in_several = distinct[in_texts > 1]
    return [share_found(h, in_several) for h in hashes]


def shared_with(texts: list[bytes], others: list[bytes]) -> float:
    """The share of the windows of `texts` (all of them together) that occur verbatim in `others`."""
    found = np.unique(np.concatenate([window_hashes(text) for text in others] or [np.zeros(0, np.uint64)]))
    return share_found(np.concatenate([window_hashes(text) for text in texts]), found)


def split_documents(documents: Mapping[str, bytes], seed: int, hold_out: HoldOut = HoldOut()) -> DocumentSplit:
    """Split `documents` (name -> text) for `seed`: validation and test documents drawn at random, in turn, from the
    documents `hold_out` allows; the rest is training."""
    names = sorted(documents)
    low, high = hold_out.document_bytes
    shared = dict(zip(names, shared_with_others([documents[name] for name in names]), strict=True))
    sized = [name for name in names if low <= len(documents[name]) <= high]
    eligible = [name for name in sized if shared[name] <= hold_out.max_shared]
    too_shared = len(sized) - len(eligible)
    random.Random(seed).shuffle(eligible)
    held: dict[str, list[str]] = {"validation": [], "test": []}
    for split in held:
        while len(held[split]) < hold_out.documents or sum(len(documents[n]) for n in held[split]) < hold_out.bytes:
            if not eligible:
                raise DataError(
                    f"too few documents to hold out a validation and a test split of {hold_out.documents} documents "
                    f"and {hold_out.bytes} bytes each: {len(sized)} of the {len(names)} documents are "
                    f"{low}-{high} bytes long, {too_shared} of them share more than "
                    f"{hold_out.max_shared:.0%} of their {WINDOW_BYTES}-byte windows with other documents; add "
                    "documents or allow more shared text"
                )
            held[split].append(eligible.pop())
    held_out = set(held["validation"] + held["test"])
    train = [name for name in names if name not in held_out]
    training_text = [documents[name] for name in train]
    return DocumentSplit(
        train=tuple(train),
        validation=tuple(sorted(held["validation"])),
        test=tuple(sorted(held["test"])),
        shared_with_train={
            split: shared_with([documents[name] for name in chosen], training_text) for split, chosen in held.items()
        },
        too_shared=too_shared,
    )


def write_split(documents: Mapping[str, bytes], split: DocumentSplit, folder: Path) -> None:
    """Each split as a folder of `.txt` files under `folder` (`train/`, `validation/`, `test/`), one document a file,
    as `attnres train --dataset FOLDER` reads them."""
    for split_name, names in split.splits().items():
        for name in names:
            path = folder / split_name / (name if name.endswith(".txt") else f"{name}.txt")
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(documents[name])
