"""The seams: every reach into another library's private parts, one module per library, each a small named function.

A private part (a name with a leading underscore, a module or table a library keeps for itself, an attribute of its
own state) can change in any release without notice. The package names none outside these modules
(tests/test_seams.py holds it to that, and checks that the installed releases still have each one), so an upgrade is
checked here: each function first checks that what it reaches for is still there, and stops with `PrivatePartMissing`,
naming the library's release and the range AttnRes runs on, instead of failing later or silently doing nothing. The
model files, which travel alone as remote code, keep their own seam at the top of modeling_attnres.py and
configuration_attnres.py.

The check and its error are `attnres.requirements`, shared with the command's own seam (argparse), which loads it
without this package (see `attnres_cli`).
"""

from ..requirements import REQUIREMENTS, PrivatePartMissing, require

__all__ = ["REQUIREMENTS", "PrivatePartMissing", "require"]
