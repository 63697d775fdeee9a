"""`python -m attnres.training ...`, for launchers that start a module: `torchrun -m`, `accelerate launch -m`.

It is `attnres train`, with the same options, messages and error handling.
"""

import sys

from attnres_cli.command import main

sys.exit(main(["train", *sys.argv[1:]]))
