"""What a checkpoint folder is made of, for the processes that move checkpoints without
loading them (runtime/remote.py imports this, not checkpoint.py, which needs torch)."""

import re

KEEP_CHECKPOINTS = 2
STATE_FILE = "trainer_state.json"
"""Written last into a checkpoint folder: a folder without it is incomplete."""


def checkpoint_number(name: str) -> int:
    """The epoch of a `checkpoint_<n>` folder's name (or a key ending in it); -1 for another."""
    match = re.search(r"checkpoint_(\d+)$", name)
    return int(match.group(1)) if match else -1
