"""The `attnres` command (`command.py`), and what it shares with the `attnres` package without loading torch: the
options a user chooses (`options.py`) and the error types of a user's mistakes (`errors.py`).

It is a package of its own, beside `attnres`, because importing any module of a package runs that package's
`__init__` first, and `import attnres` registers the model classes with transformers' Auto classes, which loads torch:
inside `attnres`, `attnres --help` would wait for torch. Nothing here imports `attnres` at import time; a command
imports the modules that do its work when it runs.
"""
