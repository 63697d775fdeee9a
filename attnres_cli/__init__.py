"""The `attnres` command (`command.py`) and its seam into argparse (`argparse_private.py`).

It is a package of its own, beside `attnres`, because importing any module of a package runs that package's
`__init__` first, and `import attnres` registers the model classes with transformers' Auto classes, which loads torch:
inside `attnres`, `attnres --help` would wait for torch. What the command needs before a command runs (the options and
their choices, the families, the rules, the error types) lives in `attnres`'s light modules, which import only the
standard library and each other: importing this package loads them by their path, under their own names, without the
package's `__init__`, so the library imports the same modules later (one `OptionError` class, one `TrainingConfig`).
A command imports the modules that do its work when it runs.
"""

import importlib.util
import sys
from pathlib import Path

# attnres's light modules, each after those it imports
LIGHT_MODULES = ("errors", "requirements", "families", "rules", "options")


def load_light_modules() -> None:
    """Load `attnres.<name>` for each of `LIGHT_MODULES` from its file, unless `attnres` (or the module) is loaded."""
    if "attnres" in sys.modules:
        return  # the package's own imports load them where needed
    package = importlib.util.find_spec("attnres")  # where it is, without running its `__init__`
    folder = Path(package.origin).parent
    for name in LIGHT_MODULES:
        qualified = f"attnres.{name}"
        if qualified in sys.modules:
            continue
        spec = importlib.util.spec_from_file_location(qualified, folder / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[qualified] = module  # before running it, as the import system does
        spec.loader.exec_module(module)


load_light_modules()
