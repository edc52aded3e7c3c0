"""`trainflow`: the project's command-line tools.

    trainflow train [--training.epochs 5 ...] [--config FILE.yaml] [--json]   # train-flow here
    trainflow run DEPLOYMENT [--training.epochs 2 ...] [--watch]   # through a worker
    trainflow sweep --search_space '{"lr": {"log_uniform": [1e-4, 0.1]}}' [--n_trials 8 ...]
    trainflow audit SOURCE [--output audit.json]   # duplicates, wrong labels, outliers
    trainflow predict IMAGE... [--model NAME --alias champion]
    trainflow champion MODEL_NAME VERSION [--reason "..."]   # rollback, or a person's choice
    trainflow rerun MODEL_NAME VERSION [--deployment train-flow/digits]
    trainflow services start|stop [--folder .services]   # Prefect + MLflow servers, a worker
    trainflow work-pool create NAME [--type kubernetes ...]   # with the lost-run automations
    trainflow notify --webhook URL | --block TYPE/NAME   # approval waits, failures, aliases

`trainflow COMMAND --help` lists each command's options.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {"train": "commands.train:train", "run": "commands.train:run",
            "sweep": "commands.train:sweep", "audit": "commands.audit:main",
            "predict": "commands.predict:main", "champion": "commands.champion:main",
            "rerun": "commands.rerun:main", "services": "commands.services_command:main",
            "work-pool": "commands.work_pool:main", "notify": "commands.notify:main"}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__.strip())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        sys.exit(f"trainflow: unknown command {argv[0]!r}; one of {', '.join(COMMANDS)} "
                 "(trainflow --help)")
    # Imported on demand: `services` must not pay for torch, nor `predict` for Prefect.
    module, function = COMMANDS[argv[0]].split(":")
    getattr(importlib.import_module(module), function)(argv[1:])


if __name__ == "__main__":
    main()
