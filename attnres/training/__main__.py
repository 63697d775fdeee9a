"""`python -m attnres.training ...`, for launchers that start a module: `torchrun -m`, `accelerate launch -m`.

It is `attnres train`, with the same options, messages and error handling; being a module of the `attnres` package,
it registers the model classes (loading torch) before it parses, which `attnres train --help` does not.
"""

import sys

from attnres_cli.command import main

sys.exit(main(["train", *sys.argv[1:]]))
