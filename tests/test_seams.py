"""Every reach into another library's private parts is behind a seam: attnres/compat/, one module per library, and the
seam block at the top of configuration_attnres.py and modeling_attnres.py, which travel alone as remote code.

The scan reads the source of the package, the benchmarks and the scripts, and fails, naming file and line, where
another library's private part is named anywhere else: a name with a leading underscore that the package does not
define itself (an attribute, also by name in `getattr`, by a name built from a leading underscore, or as a key of
`vars(...)` or `__dict__`; an import, also by `importlib.import_module`; a keyword argument; a method or class
attribute that overrides one of a library's base classes), and the few parts without one that a library keeps for
itself (`INTERNAL_NAMES`, `INTERNAL_WRITES`,
`INTERNAL_ENVIRONMENT`). Then one test per seam checks that the installed release still has what the seam reaches for,
so that a release that removes one fails here the day it is out."""

import argparse
import ast
import importlib
import inspect
import os
import re
from pathlib import Path

import pytest
import torch
from tiny import attnres_twin, tiny_source_model
from transformers import PreTrainedConfig, PreTrainedModel

from attnres import compat, modeling_attnres
from attnres.compat import PrivatePartMissing, require
from attnres.modeling_attnres import MODEL_HOOKS, REFUSES_STATEFUL_ASSISTED_DECODING, AttnResForCausalLM

ROOT = Path(__file__).parents[1]
PACKAGES = (ROOT / "attnres", ROOT / "attnres_cli")
SCANNED = (*PACKAGES, ROOT / "benchmarks", ROOT / "scripts")  # the package, and the code that runs beside it
SEAMS = (ROOT / "attnres" / "compat", ROOT / "attnres_cli" / "argparse_private.py")  # the package's, the command's
MODEL_FILES = {"configuration_attnres.py", "modeling_attnres.py"}  # their seam: the block headed "# Seam:"

# Parts other libraries keep for themselves without a leading underscore, named nowhere outside a seam: modules
# transformers does not export (what they hold), tables and attributes that PEFT, DeepSpeed and lm-eval keep
INTERNAL_NAMES = {
    "merge_with_config_defaults",
    "OutputRecorder",
    "capture_outputs",
    "SubConfigSpec",
    "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING",
    "ds_numel",
    "ds_shape",
    "ds_persist",
    "ds_tensor",
    "get_git_commit_hash",
}
# ... and state they read that is theirs to set: read anywhere, assigned only in a seam
INTERNAL_WRITES = {"HF_HUB_OFFLINE", "fsdp_plugin", "distributed_type", "recompile_limit", "hf_quantizer"}
INTERNAL_ENVIRONMENT = {"ACCELERATE_USE_CPU"}  # set by `accelerate launch --cpu`, for the Accelerator to read


ATTRIBUTE_BUILTINS = {"getattr", "hasattr", "setattr", "delattr"}
IMPORTERS = {"import_module", "__import__"}  # importlib's and the builtin: a module by name


def is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def package_files() -> list[Path]:
    return sorted(path for package in PACKAGES for path in package.rglob("*.py"))


def scanned_files() -> list[Path]:
    return sorted(path for folder in SCANNED for path in folder.rglob("*.py"))


def leading_text(node: ast.expr) -> str | None:
    """The text a computed name starts with, where the expression shows it: an f-string's or a sum's first literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return leading_text(node.values[0])
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return leading_text(node.left)
    return None


def is_namespace_of(node: ast.expr) -> bool:
    """Whether `node` is an object's attribute namespace: `vars(x)` or `x.__dict__`."""
    is_vars = isinstance(node, ast.Call) and getattr(node.func, "id", None) == "vars"
    return is_vars or (isinstance(node, ast.Attribute) and node.attr == "__dict__")


def own_names(trees: list[ast.Module]) -> set[str]:
    """The private names the package defines: functions, classes, variables, arguments, and `self._x` attributes."""
    names = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in {"self", "cls"}:
                    names.add(node.attr)
    return {name for name in names if is_private(name)}


def overridden_names() -> set[str]:
    """Private names that a class of the package defines over another library's base class (a hook of theirs)."""
    names = set()
    for path in package_files():
        if path.name == "__main__.py":  # running it trains
            continue
        module = importlib.import_module(
            ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        )
        for cls in vars(module).values():
            if not (isinstance(cls, type) and cls.__module__ == module.__name__):
                continue
            foreign_bases = [base for base in cls.__mro__[1:] if not base.__module__.startswith("attnres")]
            names |= {name for name in vars(cls) if is_private(name) and any(name in vars(b) for b in foreign_bases)}
    return names


def seam_block(path: Path) -> range:
    """The line numbers of a model file's seam: from its "# Seam:" header to the next section's opening rule."""
    lines = path.read_text(encoding="utf-8").splitlines()
    header = next(index for index, line in enumerate(lines) if line.startswith("# Seam:"))
    rules = [index for index in range(header + 1, len(lines)) if lines[index].startswith("# ----")]
    return range(header, rules[1] + 1)  # 1-based: the header's line up to the line before that rule


def private_reaches(tree: ast.Module, own: set[str], overridden: set[str], hooks: set[str] = frozenset()) -> list:
    """(line, what) of each private part of another library that `tree` names; `hooks`: names its classes may
    define (and call on `super()`)."""
    foreign = lambda name: is_private(name) and (name not in own or name in overridden)  # noqa: E731
    reaches = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for statement in node.body:
                targets = [statement.name] if isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef)) else []
                if isinstance(statement, (ast.Assign, ast.AnnAssign)):
                    assigned = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
                    targets = [target.id for target in assigned if isinstance(target, ast.Name)]
                reaches += [
                    (statement.lineno, f"{node.name}.{name} (a hook of a base class)")
                    for name in targets
                    if name in overridden and name not in hooks
                ]
        elif isinstance(node, ast.Attribute):
            on_super = isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) == "super"
            if foreign(node.attr) and not (on_super and node.attr in hooks):
                reaches.append((node.lineno, f".{node.attr}"))
            elif node.attr in INTERNAL_NAMES or (node.attr in INTERNAL_WRITES and isinstance(node.ctx, ast.Store)):
                reaches.append((node.lineno, f".{node.attr}"))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [node.module or ""] if isinstance(node, ast.ImportFrom) else [alias.name for alias in node.names]
            names = [alias.name for alias in node.names] if isinstance(node, ast.ImportFrom) else []
            if any(is_private(part) for module in modules for part in module.split(".")):
                reaches.append((node.lineno, f"import of {', '.join(modules)}"))
            reaches += [(node.lineno, f"import of {name}") for name in names if foreign(name) or name in INTERNAL_NAMES]
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in ATTRIBUTE_BUILTINS and len(node.args) > 1:
            name = node.args[1].value if isinstance(node.args[1], ast.Constant) else None
            if isinstance(name, str) and foreign(name):
                reaches.append((node.lineno, f"{node.func.id}(..., {name!r})"))
            start = leading_text(node.args[1]) if name is None else None
            if start is not None and is_private(start + "x"):  # a name built from a leading underscore
                reaches.append((node.lineno, f"{node.func.id}(..., computed {start!r}...)"))
        elif isinstance(node, ast.Call) and (getattr(node.func, "id", None) or getattr(node.func, "attr", None)) in (
            IMPORTERS
        ):
            module = leading_text(node.args[0]) if node.args else None
            if module is not None and any(is_private(part) for part in module.split(".")):
                reaches.append((node.lineno, f"import of {module} by name"))
        elif isinstance(node, ast.Subscript) and is_namespace_of(node.value):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            if isinstance(key, str) and foreign(key):
                reaches.append((node.lineno, f"[{key!r}] of an attribute namespace"))
        elif isinstance(node, ast.keyword) and node.arg is not None and foreign(node.arg):
            reaches.append((node.lineno, f"{node.arg}="))
        elif isinstance(node, ast.Constant) and node.value in INTERNAL_NAMES:
            reaches.append((node.lineno, repr(node.value)))
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Store):
            key = node.slice.value if isinstance(node.slice, ast.Constant) else None
            if key in INTERNAL_ENVIRONMENT:
                reaches.append((node.lineno, f"[{key!r}] ="))
    return reaches


def test_no_private_part_of_another_library_is_named_outside_a_seam():
    trees = {path: ast.parse(path.read_text(encoding="utf-8")) for path in scanned_files()}
    own, overridden = own_names(list(trees.values())), overridden_names()
    outside = []
    for path, tree in trees.items():
        if any(path.is_relative_to(seam) for seam in SEAMS):
            continue
        block = seam_block(path) if path.name in MODEL_FILES else range(0)
        hooks = set(MODEL_HOOKS) if path.name == "modeling_attnres.py" else set()
        lines = path.read_text(encoding="utf-8").splitlines()
        outside += [
            f"{path.relative_to(ROOT)}:{line}: {what}: {lines[line - 1].strip()}"
            for line, what in sorted(private_reaches(tree, own, overridden, hooks))
            if line not in block
        ]
    assert not outside, "private parts of other libraries outside a seam:\n" + "\n".join(outside)


def scan(source: str, hooks: set[str] = frozenset()) -> list[str]:
    tree = ast.parse(source)
    return [what for _, what in private_reaches(tree, own_names([tree]), {"_init_weights"}, hooks)]


def test_the_scan_finds_each_kind_of_reach_and_passes_the_package_own_names():
    source = """
import torch._dynamo
from transformers.utils.output_capturing import capture_outputs
from somewhere import _hidden
class Model(PreTrainedModel):
    def _init_weights(self, module): ...
    def _own(self):
        self._cache = 1
        return self._cache, self._own(), _helper()
def _helper():
    model.config._attn_implementation_internal = "eager"
    os.environ["ACCELERATE_USE_CPU"] = "false"
    state.fsdp_plugin = plugin
    cached_file(path, _raise_exceptions_for_missing_entries=False)
    importlib.import_module("torch._dynamo").reset()
    getattr(model, f"_{name}"), getattr(model, "_hf_" + name), vars(model)["_modules"], model.__dict__["_buffers"]
    getattr(model, f"{name}_res_proj"), vars(args)["seed"]
    return getattr(parameter, "ds_shape", None), state.fsdp_plugin, hasattr(model, "_hf_peft_config_loaded")
"""
    assert sorted(scan(source)) == sorted(
        [
            "import of torch._dynamo",
            "import of capture_outputs",
            "import of _hidden",
            "Model._init_weights (a hook of a base class)",
            "._attn_implementation_internal",
            "['ACCELERATE_USE_CPU'] =",
            ".fsdp_plugin",
            "_raise_exceptions_for_missing_entries=",
            "import of torch._dynamo by name",
            "getattr(..., computed '_'...)",
            "getattr(..., computed '_hf_'...)",
            "['_modules'] of an attribute namespace",
            "['_buffers'] of an attribute namespace",
            "hasattr(..., '_hf_peft_config_loaded')",
            "'ds_shape'",
        ]
    )
    assert (
        scan("class M(Base):\n    def _init_weights(self):\n        super()._init_weights()\n", {"_init_weights"}) == []
    )


def test_the_seam_error_names_the_release_and_the_range():
    with pytest.raises(PrivatePartMissing) as caught:
        require(False, torch, "_dynamo.config.recompile_limit")
    assert str(caught.value) == (
        f"torch {torch.__version__} has no _dynamo.config.recompile_limit, which AttnRes relies on; AttnRes supports "
        f'torch>=2.6,<2.15 up to the releases that have it: pip install "torch>=2.6,<2.15,<{torch.__version__}"'
    )


def test_the_seams_state_the_requirements_of_setup_cfg():
    setup = re.sub(r"\[[a-z,]+\]", "", (ROOT / "setup.cfg").read_text(encoding="utf-8"))  # without extras
    for library, requirement in compat.REQUIREMENTS.items():
        assert requirement in setup, f"compat.REQUIREMENTS[{library!r}] = {requirement!r} is not what setup.cfg says"


# One test per seam: what it reaches for is in the installed release, and does what the package relies on.


def test_transformers_seam(tmp_path):
    from attnres.compat.transformers_private import attention_implementation, saved_config_file

    assert saved_config_file(tmp_path) is None  # a folder without config.json
    model = attnres_twin(tiny_source_model("llama", num_layers=2))
    model.save_pretrained(tmp_path / "model")
    assert saved_config_file(tmp_path / "model") == str(tmp_path / "model" / "config.json")
    model.set_attn_implementation("eager")
    assert attention_implementation(model) == "eager"


def test_model_files_seam():
    """The hooks the model classes define are transformers', and the private parts their seam blocks take exist."""
    hooks_of_transformers = {hook for hook in MODEL_HOOKS if hasattr(PreTrainedModel, hook)}
    retired = set() if REFUSES_STATEFUL_ASSISTED_DECODING else {"_is_stateful"}  # gone in 5.25, defined only before
    assert hooks_of_transformers == set(MODEL_HOOKS) - retired
    assert hasattr(AttnResForCausalLM, "_is_stateful") is REFUSES_STATEFUL_ASSISTED_DECODING
    assert isinstance(PreTrainedConfig._attn_implementation, property)
    from transformers import configuration_utils
    from transformers.utils import generic, output_capturing

    assert all(hasattr(module, name) for module, name in [(configuration_utils, "SubConfigSpec"),
                                                          (generic, "merge_with_config_defaults"),
                                                          (output_capturing, "OutputRecorder"),
                                                          (output_capturing, "capture_outputs")])  # fmt: skip
    # the source family's modules read the backend that transformers chose for the model as it was made
    config = attnres_twin(tiny_source_model("llama", num_layers=2)).config
    config._attn_implementation, config.text_config._attn_implementation_internal = None, None
    model = AttnResForCausalLM(config)
    assert (model.config._attn_implementation, model.config.text_config._attn_implementation) == ("sdpa", "sdpa")


def test_the_family_seam_names_a_part_a_release_lacks(monkeypatch):
    """A transformers release whose family module lost a class AttnRes builds from stops the model's construction
    naming the part and the releases to install, not with an AttributeError deep inside."""
    from transformers.models.llama import modeling_llama

    config = attnres_twin(tiny_source_model("llama", num_layers=2)).config
    monkeypatch.delattr(modeling_llama, "LlamaDecoderLayer")
    with pytest.raises(ImportError, match=r"modeling_llama\.LlamaDecoderLayer.*pip install \"transformers>="):
        AttnResForCausalLM(config)


def test_no_module_reaches_into_transformers_models_but_the_family_seam():
    """`transformers.models.<family>` is reached only by `family_part` (modeling_attnres.py's family seam): a module
    path written elsewhere in the package would bypass its check."""
    reaches = [
        f"{path.relative_to(ROOT)}:{number}"
        for path in package_files()
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1)
        if "transformers.models." in line.split("#", 1)[0]  # code, not a comment about it
    ]
    assert reaches == ["attnres/modeling_attnres.py:" + str(family_part_line())], reaches


def family_part_line() -> int:
    source, first = inspect.getsourcelines(modeling_attnres.family_part)
    return first + next(i for i, line in enumerate(source) if "transformers.models." in line)


def test_huggingface_hub_seam():
    from huggingface_hub import is_offline_mode

    from attnres.compat.hub_private import set_hub_offline

    before = is_offline_mode()
    try:
        set_hub_offline(not before)
        assert is_offline_mode() is (not before)
    finally:
        set_hub_offline(before)
    assert is_offline_mode() is before


def test_peft_seam():
    """`import attnres` makes LoRA without target modules adapt the projections PEFT adapts in Llama."""
    peft = pytest.importorskip("peft")
    model = attnres_twin(tiny_source_model("llama", num_layers=2))
    adapted = peft.get_peft_model(model, peft.LoraConfig(r=2))
    targets = {name.rsplit(".", 1)[-1] for name, module in adapted.named_modules() if hasattr(module, "lora_A")}
    assert targets == {"q_proj", "v_proj"}


def test_accelerate_seam(monkeypatch):
    """The state attributes `hand_fsdp_to_state` sets (tests/test_distributed.py runs FSDP2 on them), and the variable
    that `leave_device_to_deepspeed` sets, which the Accelerator reads."""
    state = pytest.importorskip("accelerate.state")
    from attnres.compat.accelerate_private import leave_device_to_deepspeed

    assert {"fsdp_plugin", "distributed_type"} <= set(state.AcceleratorState._known_attrs)
    monkeypatch.setenv("ACCELERATE_USE_CPU", "1")
    leave_device_to_deepspeed()
    assert os.environ["ACCELERATE_USE_CPU"] == "false"


def test_torch_seam():
    from attnres.compat.torch_private import raise_recompile_limit

    with torch._dynamo.config.patch(recompile_limit=8):
        raise_recompile_limit(40)
        assert torch._dynamo.config.recompile_limit == 40
        raise_recompile_limit(10)  # never lowered
        assert torch._dynamo.config.recompile_limit == 40


def test_deepspeed_seam():
    """ZeRO-3 still gives the parameters it partitions the attributes the seam reads."""
    partition_parameters = pytest.importorskip("deepspeed.runtime.zero.partition_parameters")
    from attnres.compat.deepspeed_private import ZERO3_ATTRIBUTES

    source = inspect.getsource(partition_parameters)
    assert [name for name in ZERO3_ATTRIBUTES if f".{name} = " not in source] == []


def test_lm_eval_seam(tmp_path, monkeypatch, capfd):
    """Outside a git repository, lm-eval's git probe inside the seam's block prints nothing."""
    evaluator = pytest.importorskip("lm_eval.evaluator")
    from attnres.compat.lm_eval_private import quiet_git_probe

    assert "get_git_commit_hash()" in inspect.getsource(evaluator.simple_evaluate)  # what the block replaces
    monkeypatch.chdir(tmp_path)
    with quiet_git_probe():
        evaluator.get_git_commit_hash()
    probe = evaluator.get_git_commit_hash
    assert probe.__module__ != "attnres.compat.lm_eval_private"  # lm-eval's own again
    assert capfd.readouterr().err == ""
    probe()
    assert "not a git repository" in capfd.readouterr().err.lower()


def test_argparse_seam():
    from attnres_cli.argparse_private import DefaultsHelpFormatter, option_actions

    parser = argparse.ArgumentParser(formatter_class=DefaultsHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps")
    parser.add_argument("--name", default=None, help="a name")
    parser.add_argument("--mode", default="fast", help="how (default: fast unless --steps is 0)")
    text = " ".join(parser.format_help().split())
    assert "--steps STEPS steps (default: 3)" in text
    assert "--name NAME a name --mode" in text  # no default to show
    assert text.count("default:") == 2  # --mode's help says it already
    assert [action.dest for action in option_actions(parser)] == ["help", "steps", "name", "mode"]
