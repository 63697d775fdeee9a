"""The package's reach into huggingface_hub's private parts: its offline switch, which has no public setter."""

import huggingface_hub
from huggingface_hub import constants, is_offline_mode

from . import require


def set_hub_offline(offline: bool) -> None:
    """Switch huggingface_hub's offline mode (HF_HUB_OFFLINE, read once at import) for this process from now on.

    huggingface_hub and transformers ask `is_offline_mode()`, which reads the module constant set here; a release
    that reads it elsewhere fails the check instead of leaving the network on.
    """
    require(hasattr(constants, "HF_HUB_OFFLINE"), huggingface_hub, "constants.HF_HUB_OFFLINE")
    constants.HF_HUB_OFFLINE = offline
    require(is_offline_mode() is offline, huggingface_hub, "is_offline_mode() that reads constants.HF_HUB_OFFLINE")
