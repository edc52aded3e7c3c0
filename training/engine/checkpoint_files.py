"""What a checkpoint folder is made of, for the processes that move checkpoints without
loading them (runtime/remote.py imports this, not checkpoint.py, which needs torch)."""

KEEP_CHECKPOINTS = 2
STATE_FILE = "trainer_state.json"
"""Written last into a checkpoint folder: a folder without it is incomplete."""
