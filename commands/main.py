"""`trainflow`: the project's command-line tools.

    trainflow services start|stop [--folder .services]   # Prefect + MLflow servers, a worker
    trainflow predict IMAGE... [--model NAME --alias champion]
    trainflow rerun MODEL_NAME VERSION [--deployment train-flow/digits]
    trainflow champion MODEL_NAME VERSION [--reason "..."]   # rollback, or a person's choice
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"services": "commands.services", "predict": "commands.predict",
            "rerun": "commands.rerun", "champion": "commands.champion"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        sys.exit(f"usage: trainflow {{{','.join(COMMANDS)}}} ...\n\n{__doc__.strip()}")
    # Imported on demand: `services` must not pay for torch, nor `predict` for Prefect.
    importlib.import_module(COMMANDS[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    main()
