"""The house keeps the plan of docs/architecture.md: imports point down its table of rooms and never in a circle, every
module (of `attnres` and of `attnres_cli`, the command beside it) has its row, the model files import only what travels
with them (the depth-mix room only torch), the light rooms only the standard library and each other, and the tiny
models of the tests cover the families of the one family table."""

import ast
import re
import sys
from pathlib import Path

import pytest
from tiny import FAMILY_OVERRIDES

from attnres.families import SUPPORTED_FAMILIES

ROOT = Path(__file__).parents[1]
PACKAGES = (ROOT / "attnres", ROOT / "attnres_cli")
REMOTE_CODE = {
    "attnres.configuration_attnres",
    "attnres.depth_mixing",
    "attnres.depth_mix_backends",
    "attnres.depth_rules",
    "attnres.modeling_attnres",
    "attnres.families",
    "attnres.rules",
}
REMOTE_CODE_DEPENDENCIES = {"torch", "transformers", "packaging"}
# Fused kernels a depth-mix backend imports when it runs, never before: a saved model loads without them
OPTIONAL_KERNELS = {"fla"}
LIGHT = {
    "attnres.options",
    "attnres.errors",
    "attnres.requirements",
    "attnres.rules",
    "attnres.families",
    "attnres_cli",
    "attnres_cli.argparse_private",
    "attnres.folders",
}
# The command's entry as a module of the package (`python -m attnres.training` is `attnres train`)
COMMAND_ENTRIES = {"attnres.training.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for package in PACKAGES for path in package.rglob("*.py")}


def imported(module: str) -> set[str]:
    """What `module` imports, anywhere in it (inside functions too): the package's modules it names, and the top-level
    names of everything else."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # `from . import data` names a module; `from .cards import model_card` a name in one
            names.update(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names)
    return {name if name in MODULES else name.partition(".")[0] for name in names}


def rooms() -> list[str]:
    """The paths in the first column of docs/architecture.md's table, from the top floor down."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return re.findall(r"^\| `(attnres(?:_cli)?/[^`]*)` \|", text, flags=re.MULTILINE)


def floors() -> dict[str, int]:
    """Each module of the package -> the row of its room (0 = the top floor): its file's own row, else its folder's."""
    paths = rooms()
    floor = {}
    for module, path in MODULES.items():
        relative = path.relative_to(ROOT).as_posix()
        folders = [room for room in paths if room.endswith("/") and relative.startswith(room)]
        room = relative if relative in paths else max(folders, key=len, default=None)
        assert room is not None, f"{relative} has no row in docs/architecture.md"
        floor[module] = paths.index(room)
    return floor


def test_every_room_of_the_table_exists_and_every_module_has_one():
    for room in rooms():
        assert (ROOT / room).exists(), f"docs/architecture.md names {room}, which does not exist"
    assert len(floors()) == len(MODULES)


def test_imports_point_down_the_table():
    floor = floors()
    upward = [
        f"{module} imports {target}"
        for module in MODULES
        for target in imported(module) & MODULES.keys()
        if floor[target] < floor[module]
    ]
    assert not upward, upward


def test_no_import_circle():
    graph = {module: imported(module) & MODULES.keys() for module in MODULES}
    done, path = set(), []

    def visit(module: str) -> None:
        assert module not in path, "import circle: " + " -> ".join(path[path.index(module) :] + [module])
        if module in done:
            return
        path.append(module)
        for target in sorted(graph[module] - {module}):
            visit(target)
        path.pop()
        done.add(module)

    for module in sorted(graph):
        visit(module)


def test_the_model_files_import_only_what_travels_with_them():
    for module in REMOTE_CODE:
        outside = imported(module) - REMOTE_CODE - REMOTE_CODE_DEPENDENCIES - OPTIONAL_KERNELS - sys.stdlib_module_names
        assert not outside, (module, outside)


@pytest.mark.parametrize("module", ["attnres.depth_mixing", "attnres.depth_mix_backends", "attnres.depth_rules"])
def test_the_depth_mix_room_imports_only_torch(module):
    """Tensor math on the depth state, its backends and the rules: no transformers, no config (its settings arrive as
    arguments)."""
    room = {"attnres.depth_mixing", "attnres.depth_mix_backends", "attnres.depth_rules"}
    outside = imported(module) - {"torch"} - OPTIONAL_KERNELS - room - sys.stdlib_module_names
    assert not outside, outside


def test_the_light_rooms_import_only_the_standard_library_and_each_other():
    for module in LIGHT:
        outside = imported(module) - LIGHT - sys.stdlib_module_names
        assert not outside, (module, outside)


def test_the_library_does_not_import_the_command():
    reaching_up = [
        module
        for module in MODULES
        if module.split(".")[0] == "attnres" and module not in COMMAND_ENTRIES
        if any(name.split(".")[0] == "attnres_cli" for name in imported(module))
    ]
    assert not reaching_up, reaching_up


def test_the_command_loads_exactly_the_light_modules_it_imports():
    """What the command's modules import of `attnres` at their top level is what `attnres_cli` loads without the
    package's `__init__` (anything else would load torch, or fail)."""
    import attnres_cli

    top_level = set()
    for module in ("attnres_cli.command", "attnres_cli.argparse_private"):
        tree = ast.parse(MODULES[module].read_text(encoding="utf-8"))
        top_level |= {node.module for node in tree.body if isinstance(node, ast.ImportFrom) and node.module}
    light = {name for name in top_level if name.startswith("attnres.")}
    light |= {name for module in light for name in imported(module) if name.startswith("attnres.")}
    assert light == {f"attnres.{name}" for name in attnres_cli.LIGHT_MODULES}


def test_the_tiny_models_cover_exactly_the_supported_families():
    assert set(FAMILY_OVERRIDES) == set(SUPPORTED_FAMILIES), "tests/tiny.py: tiny settings for every supported family"
