"""The mistakes a user can fix, one error type for each kind, all of them `AttnResInputError`: their message names the
problem and the fix, and the `attnres` command shows it as one line on stderr (any other error is a bug, and shows its
traceback). The modules that raise them export them too: `attnres.conversion.ConversionError`,
`attnres.training.TrainingError`, `attnres.eval.EvalError`, ...

Standard library only: the options of `attnres.options` raise some of them before anything heavy loads, and the
command loads this module without torch (see `attnres_cli`).
"""


class AttnResInputError(Exception):
    """A mistake the user can fix (a path, an option, a model or data that cannot be used as asked); the message names
    the problem and the fix."""


class OptionError(AttnResInputError, ValueError):
    """An option whose value cannot work (a size, a count, a device, a file); the message names it and what to pass."""


class SourceError(AttnResInputError):
    """A model argument that cannot be had or read: a missing folder or file, a Hub id out of reach (offline: not in
    the cache), a damaged file, or code of its own that it needs and may not run."""


class ConversionError(AttnResInputError):
    """A source model that cannot be converted as asked, or whose conversion cannot be written."""


class TrainingError(AttnResInputError, RuntimeError):
    """A training run that cannot start or go on as asked."""


class DataError(AttnResInputError, ValueError):
    """Training data that cannot be used as asked."""


class EvalError(AttnResInputError):
    """An evaluation that cannot run as asked (unknown task, missing data, no permission to run code, a model that
    does not load)."""


class AnalysisError(AttnResInputError, ValueError):
    """A model or text the analysis cannot use."""


class HubUploadError(AttnResInputError, RuntimeError):
    """An upload that failed (no token, no permission, the Hub out of reach); the local folder is complete and usable
    either way."""


class InterruptedReplaceError(AttnResInputError, FileExistsError):
    """An output is missing because an earlier `--overwrite` stopped between setting it aside and moving its
    replacement in: the old output is in `.NAME.previous`, its only copy, which nothing deletes."""
