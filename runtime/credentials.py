"""Credentials a flow run reads from Prefect Secret blocks, so that no worker, deployment or
parameter has to carry them.

    TRAINFLOW_MLFLOW_SECRET_BLOCK  {"username": ..., "password": ...}  MLflow's basic-auth
    TRAINFLOW_S3_SECRET_BLOCK      {"access_key_id": ..., "secret_access_key": ...}  for an
                                   s3:// artifact root the client writes to itself
    KAGGLE_SECRET_BLOCK            see tasks/data.py

Each block's values go into this process's environment under the names MLflow and boto3 read
(a variable already set wins), and only there: `launch_env` keeps them from the training ranks,
which need none of them.
"""

from __future__ import annotations

import json
import os

SECRET_BLOCKS = {
    "TRAINFLOW_MLFLOW_SECRET_BLOCK": {"username": "MLFLOW_TRACKING_USERNAME",
                                      "password": "MLFLOW_TRACKING_PASSWORD"},
    "TRAINFLOW_S3_SECRET_BLOCK": {"access_key_id": "AWS_ACCESS_KEY_ID",
                                  "secret_access_key": "AWS_SECRET_ACCESS_KEY"},
}
SECRET_VARIABLES = ("MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN", "AWS_SECRET_ACCESS_KEY",
                    "AWS_SESSION_TOKEN", "KAGGLE_KEY", "KAGGLE_API_TOKEN")
"""What a training rank's environment never holds."""


class MissingSecretBlock(RuntimeError):
    pass


def secret_block(variable: str) -> dict | None:
    """The JSON object of the Prefect Secret block that environment variable `variable` names;
    None when it names none. A block that does not exist is a MissingSecretBlock."""
    name = os.environ.get(variable)
    if not name:
        return None
    from prefect.blocks.system import Secret

    try:
        value = Secret.load(name).get()
    except ValueError:
        raise MissingSecretBlock(
            f"{variable} names the Prefect Secret block {name!r}, which does not exist on "
            f"this Prefect server: create it (e.g. Secret(value={{...}}).save({name!r})) or "
            f"unset {variable}") from None
    return json.loads(value) if isinstance(value, str) else value


def use_secret_blocks() -> list[str]:
    """Load the Secret blocks named in the environment; return the variables they set."""
    set_now = []
    for variable, fields in SECRET_BLOCKS.items():
        data = secret_block(variable)
        if data is None:
            continue
        name = os.environ[variable]
        missing = sorted(set(fields) - set(data))
        if missing:
            raise MissingSecretBlock(f"the Prefect Secret block {name!r} ({variable}) lacks "
                                     f"{', '.join(missing)}; it holds a JSON object with "
                                     f"{', '.join(sorted(fields))}")
        for key, env_name in fields.items():
            if not os.environ.get(env_name):
                os.environ[env_name] = str(data[key])
                set_now.append(env_name)
    return set_now
