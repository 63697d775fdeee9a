"""The evidence protocol's three-way split: held-out documents share little text with training, the share is measured
exactly, the split is a function of the seed, and a corpus too small for it is refused in one line."""

import random

import pytest

from attnres.errors import DataError
from attnres.splits import WINDOW_BYTES, HoldOut, shared_with, shared_with_others, split_documents, write_split

HOLD_OUT = HoldOut(documents=2, bytes=2000, document_bytes=(500, 5000), max_shared=0.1)


def prose(seed: int, length: int = 1200) -> bytes:
    """Random lowercase words: no 32-byte window in common with another seed's text."""
    rng = random.Random(seed)
    text = ""
    while len(text) < length:
        text += "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) + " "
    return text[:length].encode()


def corpus() -> dict[str, bytes]:
    """12 distinct documents and 8 templated release notes that share most of their text with each other."""
    template = prose(1000, 1500)
    documents = {f"guide/{index:02d}.txt": prose(index) for index in range(12)}
    documents |= {f"releases/{index}.txt": template + f"\nVersion {index}: a fix.\n".encode() for index in range(8)}
    return documents


def windows_found(texts: list[bytes], others: list[bytes]) -> float:
    """The reference: every window of `texts` looked up in a set of every window of `others`."""
    found = {text[i : i + WINDOW_BYTES] for text in others for i in range(len(text) - WINDOW_BYTES + 1)}
    windows = [text[i : i + WINDOW_BYTES] for text in texts for i in range(len(text) - WINDOW_BYTES + 1)]
    return sum(window in found for window in windows) / len(windows)


def test_templated_documents_stay_in_training_and_the_share_is_measured():
    documents = corpus()
    split = split_documents(documents, seed=0, hold_out=HOLD_OUT)
    held_out = split.validation + split.test
    assert not any(name.startswith("releases/") for name in held_out)
    assert split.too_shared == 8
    assert len(split.validation) >= 2 and sum(len(documents[name]) for name in split.validation) >= 2000
    assert sorted(split.train + held_out) == sorted(documents) and len(set(held_out)) == len(held_out)
    training = [documents[name] for name in split.train]
    for name, chosen in (("validation", split.validation), ("test", split.test)):
        expected = windows_found([documents[n] for n in chosen], training)
        assert split.shared_with_train[name] == pytest.approx(expected, abs=1e-12)


def test_shares_equal_the_reference_on_text_with_known_overlap():
    base = prose(7, 2000)
    texts = [base[:1000] + prose(8, 1000), prose(9, 1000), base[500:1500]]  # text 0 shares its 500 bytes 500-999
    assert shared_with_others(texts) == pytest.approx(
        [windows_found([texts[i]], texts[:i] + texts[i + 1 :]) for i in range(3)], abs=1e-12
    )
    assert 0.2 < shared_with_others(texts)[0] < 0.3 and shared_with_others(texts)[1] == 0.0
    assert shared_with([texts[2]], [texts[0]]) == pytest.approx(windows_found([texts[2]], [texts[0]]), abs=1e-12)


def test_the_split_is_a_function_of_the_seed():
    documents = corpus()
    assert split_documents(documents, 3, HOLD_OUT) == split_documents(dict(reversed(documents.items())), 3, HOLD_OUT)
    assert split_documents(documents, 3, HOLD_OUT).test != split_documents(documents, 4, HOLD_OUT).test


def test_a_corpus_too_small_is_refused_in_one_line():
    documents = {name: text for name, text in corpus().items() if name < "guide/03"}
    with pytest.raises(DataError, match=r"too few documents .* 3 of the 3 documents are 500-5000 bytes") as error:
        split_documents(documents, 0, HOLD_OUT)
    assert "\n" not in str(error.value)


def test_the_written_folders_hold_each_split(tmp_path):
    documents = corpus() | {"code/module.py": prose(50, 400)}  # too short to be held out
    split = split_documents(documents, 0, HOLD_OUT)
    write_split(documents, split, tmp_path)
    assert (tmp_path / "train" / "code" / "module.py.txt").read_bytes() == documents["code/module.py"]
    for name in split.test:
        assert (tmp_path / "test" / name).read_bytes() == documents[name]
    assert sum(1 for path in tmp_path.rglob("*") if path.is_file()) == len(documents)
