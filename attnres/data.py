"""Text data for continued pretraining: documents in, fixed-length token sequences out.

Documents come from a Hugging Face dataset (Hub or local, optionally streamed), from local `.txt` / `.jsonl` /
`.parquet` files or folders of them, or, by default, from the Python standard library's own source files: a corpus
of real code that every machine has, which suits the HumanEval target. A held-out part is set aside by document, so
no held-out text is trained on. Each document is tokenised without special tokens, followed by EOS, concatenated and
cut into sequences of `seq_len` tokens (the run_clm "group_texts" packing); the loss then needs no padding or mask.
Shuffling and sharding across processes are left to the data loader (see `attnres.training`).
"""

import codecs
import itertools
import os
import sysconfig
from pathlib import Path

from datasets import Dataset, IterableDataset, load_dataset
from transformers import PreTrainedTokenizerBase

from .errors import DataError

# Local files by extension, and the `datasets` builder that reads each kind. A `.txt` file is one document.
LOCAL_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
# Parts of the standard library that differ between installations of the same Python version (third-party packages,
# test suites that distributions ship separately, build-specific settings): left out of the default corpus.
STDLIB_EXCLUDED_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
STDLIB_EXCLUDED_PREFIX = "_sysconfigdata"
# Documents tokenised and packed together; the tail of each group shorter than one sequence is dropped.
PACKING_GROUP_SIZE = 1000
# Bytes of a text file checked at a time: a corpus file is read once whole before `datasets` reads it
TEXT_CHECK_CHUNK = 1 << 20


def stdlib_source_files() -> list[str]:
    """The `.py` files of this Python's standard library, in a fixed (sorted) order: the default corpus."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(
        str(path)
        for path in root.rglob("*.py")
        if not STDLIB_EXCLUDED_FOLDERS.intersection(path.relative_to(root).parts[:-1])
        and not path.name.startswith(STDLIB_EXCLUDED_PREFIX)
    )


def local_data_files(path: Path) -> tuple[str, list[str]]:
    """(builder, files) for a local file or a folder searched recursively; all files must be of one kind."""
    files = sorted(p for p in path.rglob("*") if p.suffix in LOCAL_BUILDERS) if path.is_dir() else [path]
    builders = {LOCAL_BUILDERS.get(file.suffix) for file in files}
    if not files or None in builders:
        raise DataError(f"{path}: expected {', '.join(LOCAL_BUILDERS)} files or a folder holding them")
    if len(builders) > 1:
        raise DataError(f"{path} mixes {' and '.join(sorted(builders))} files; point --dataset at one kind")
    builder = builders.pop()
    if builder == "text":
        for file in files:  # the first such file of a folder, in sorted order
            check_utf8_text(file)
    return builder, [str(file) for file in files]


def check_utf8_text(file: Path) -> None:
    """Refuse a text file that is not UTF-8 (Latin-1, say) or is binary (a NUL byte), which would be trained on as
    U+FFFD replacement characters and noise: one line with the file, the first such byte's offset and the fix."""
    found = first_non_text_byte(file)
    if found is not None:
        offset, what = found
        raise DataError(
            f"{file} is not UTF-8 text: at byte offset {offset}, {what}; convert it to UTF-8 (e.g. iconv -f latin1 "
            "-t utf-8) or remove it from the dataset"
        )


def first_non_text_byte(file: Path) -> tuple[int, str] | None:
    """(offset, what it is) of the first byte of `file` that is a NUL or no part of valid UTF-8, or None."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    position = 0
    with file.open("rb") as stream:
        while True:
            chunk = stream.read(TEXT_CHECK_CHUNK)
            pending = len(decoder.getstate()[0])  # the bytes of a character cut by the previous chunk's end
            found = []
            if b"\0" in chunk:
                found.append((position + chunk.index(b"\0"), "a NUL byte, as in binary files"))
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as error:
                byte = error.object[error.start]  # `object`: the cut character's bytes, then the chunk
                found.append((position - pending + error.start, f"0x{byte:02x} is no part of valid UTF-8"))
            if found or not chunk:
                return min(found, default=None)
            position += len(chunk)


def load_documents(
    dataset: str | None, dataset_config: str | None, split: str, streaming: bool
) -> Dataset | IterableDataset:
    """One split of documents: the stdlib corpus (`dataset=None`), local files, or a Hugging Face dataset.

    A local folder with a subfolder named after a split (`train/`, `validation/`, ...) holds one split per subfolder;
    any other local files, and the stdlib corpus, are a single split, `"train"`: hold documents out of it with
    `split_held_out`.
    """
    if dataset is not None and not os.path.exists(dataset):
        try:
            return load_dataset(dataset, dataset_config, split=split, streaming=streaming)
        except (OSError, ValueError) as error:  # not found, offline, or no such configuration or split
            raise DataError(f"cannot load {split!r} of the dataset {dataset!r}: {error}") from error
    split_folder = Path(dataset) / split if dataset is not None else None
    if split_folder is not None and split_folder.is_dir():
        builder, data_files = local_data_files(split_folder)
    elif split != "train":
        raise DataError(
            f"{dataset or 'the standard-library corpus'} is one split of documents, with no {split!r} split: hold "
            f"documents out of it with --eval-size instead"
            + ("" if dataset is None else f", or put them in {split_folder}")
        )
    else:
        builder, data_files = ("text", stdlib_source_files()) if dataset is None else local_data_files(Path(dataset))
    # `sample_by="document"`: a text file is one document, not one per line
    text_options = {"sample_by": "document", "encoding_errors": "replace"} if builder == "text" else {}
    return load_dataset(builder, data_files=data_files, split="train", streaming=streaming, **text_options)


def document_fields(documents: Dataset | IterableDataset) -> list[str]:
    if documents.column_names is not None:
        return documents.column_names
    return list(next(iter(documents), {}))  # a streamed dataset whose features are only known once read


def check_text_field(documents: Dataset | IterableDataset, text_field: str, name: str) -> None:
    """Fail before any tokenising when the documents lack the text field; list the fields they have."""
    fields = document_fields(documents)
    if text_field not in fields:
        raise DataError(
            f"{name} has no text field {text_field!r}; its fields are {', '.join(fields)}. Pass --text-field FIELD."
        )


def split_held_out(
    documents: Dataset | IterableDataset, eval_size: float, seed: int
) -> tuple[Dataset | IterableDataset, Dataset | IterableDataset]:
    """(training, held-out) documents. `eval_size` below 1 is a fraction of the documents, from 1 a count."""
    if isinstance(documents, IterableDataset):
        if eval_size < 1 or eval_size != int(eval_size):
            raise DataError(
                f"--eval-size {eval_size}: a streamed dataset has no known length, so hold out a number of "
                "documents (e.g. --eval-size 500) or name its own held-out split with --eval-split"
            )
        return documents.skip(int(eval_size)), documents.take(int(eval_size))
    if len(documents) < 2:
        raise DataError(
            f"the dataset holds {len(documents)} document(s), and a held-out part is set aside by document: add "
            "documents, or give the held-out documents their own folder (a folder with train/ and validation/ "
            "subfolders and --eval-split validation)"
        )
    try:
        splits = documents.train_test_split(test_size=eval_size if eval_size < 1 else int(eval_size), seed=seed)
    except ValueError as error:  # e.g. too few documents for the requested split
        raise DataError(f"cannot hold out --eval-size {eval_size} of {len(documents)} documents: {error}") from error
    return splits["train"], splits["test"]


def _tokenize_and_pack(
    batch: dict[str, list], tokenizer: PreTrainedTokenizerBase, text_field: str, seq_len: int
) -> dict[str, list[list[int]]]:
    texts = [text for text in batch[text_field] if text]  # datasets may hold empty or missing (None) texts
    if not texts:  # a tokenizer fails on an empty batch; no text packs into no sequence
        return {"input_ids": []}
    # verbose=False: no warning about documents longer than the model's context; packing cuts them to seq_len
    token_ids = tokenizer(texts, add_special_tokens=False, verbose=False)["input_ids"]
    stream = list(itertools.chain.from_iterable(ids + [tokenizer.eos_token_id] for ids in token_ids))
    return {"input_ids": [stream[start : start + seq_len] for start in range(0, len(stream) - seq_len + 1, seq_len)]}


def pack(
    documents: Dataset | IterableDataset, tokenizer: PreTrainedTokenizerBase, text_field: str, seq_len: int
) -> Dataset | IterableDataset:
    """Token sequences (`input_ids`) of exactly `seq_len`, EOS after each document; lazily when streamed."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to separate documents; set tokenizer.eos_token")
    options = {} if isinstance(documents, IterableDataset) else {"desc": f"Tokenising and packing ({seq_len} tokens)"}
    return documents.map(
        _tokenize_and_pack,
        batched=True,
        batch_size=PACKING_GROUP_SIZE,
        remove_columns=document_fields(documents),
        fn_kwargs={"tokenizer": tokenizer, "text_field": text_field, "seq_len": seq_len},
        **options,
    )
