"""trainflow services start|stop: the local services, or the production stack.

    trainflow services start [--stack production] [--folder .services]
    trainflow services stop [--folder .services]

The command only; what it starts is in commands/services.py (the local stack) and
commands/production_stack.py (PostgreSQL, S3, MLflow with basic-auth), which builds on it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from commands import local_server, production_stack
from commands.services import start, stop


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="trainflow services",
                                     description="Start or stop the local services.")
    parser.add_argument("action", choices=["start", "stop"])
    parser.add_argument("--stack", choices=["local", "production"], default="local",
                        help="local: SQLite stores and local artifacts; production: PostgreSQL, "
                        "an S3 bucket and MLflow with basic-auth (commands/production_stack.py)")
    parser.add_argument("--folder", type=Path, default=Path(".services"))
    parser.add_argument("--prefect-port", type=int, default=4200)
    parser.add_argument("--mlflow-port", type=int, default=5000)
    parser.add_argument("--postgres-port", type=int, default=5433, help="production stack only")
    parser.add_argument("--s3-port", type=int, default=9000, help="production stack only")
    args = parser.parse_args(argv)
    if args.action == "start" and args.stack == "production":
        production_stack.start(args.folder, production_stack.StackPorts(
            args.postgres_port, args.s3_port, args.prefect_port, args.mlflow_port))
    elif args.action == "start":
        start(args.folder, args.prefect_port, args.mlflow_port)
    else:
        stop(args.folder)
        if stopped := local_server.stop():  # the one hand-started flows reuse
            print(stopped)

