"""The registered model's package: MLflow's model from code, its weights, its description
and the exact requirements that trained it."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import mlflow

import trainflow_serving
from trainflow_serving import DESCRIPTION_ARTIFACT, WEIGHTS_ARTIFACT
from trainflow_serving.model_names import TIMM, is_user_model
from training.data.rows import image_bytes
from training.data.split import read_manifest
from training.handoff import TrainResult

if TYPE_CHECKING:
    from mlflow.models.model import ModelInfo

SERVING_PACKAGES = ("safetensors", "pillow", "numpy", "pandas")


def serving_packages(model_name: str) -> tuple[str, ...]:
    """What the served model imports besides torch: timm's models need timm."""
    return SERVING_PACKAGES + (("timm",) if model_name.startswith(TIMM) else ())


SERVING_DIR = Path(trainflow_serving.__file__).parent


SERVED_MODEL = SERVING_DIR / "pyfunc_model.py"


def code_paths(model_name: str) -> list[str]:
    """What the served model imports: the serving package, and a user's `<module>:<callable>`
    network's top-level package (or module file), so it loads where that code is absent."""
    paths = [str(SERVING_DIR)]
    if is_user_model(model_name):
        top = model_name.partition(":")[0].split(".")[0]
        spec = importlib.util.find_spec(top)
        if spec is None or spec.origin is None and not spec.submodule_search_locations:
            raise RuntimeError(f"the module of training.model {model_name} is not importable "
                               "here, so it cannot travel with the registered model")
        locations = list(spec.submodule_search_locations or [])
        paths.append(locations[0] if locations else spec.origin)
    return paths


def log_model(trained: TrainResult, run_id: str) -> ModelInfo:
    """Log the model from code (trainflow_serving/pyfunc_model.py), nothing of ours pickled.

    Weights go as a safetensors artifact, the model's description as JSON, and the
    trainflow_serving package as its only code, so the served model decodes, resizes and
    normalises with training's own functions.
    """
    import pandas as pd
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    names = trained.class_names
    description = {"model": trained.job.training.model, "class_names": names,
                   "preprocessing": trained.preprocessing.model_dump()}
    signature = ModelSignature(
        inputs=Schema([ColSpec("binary", "image")]),
        outputs=Schema([ColSpec("string", "label", required=False),
                        ColSpec("double", "probability", required=False),
                        *[ColSpec("double", f"probability_{c}", required=False) for c in names],
                        ColSpec("string", "error", required=False)]))
    example_file = next(trained.job.split.root / path for path, _, split in
                        read_manifest(trained.job.split.manifest) if split == "test")
    with tempfile.TemporaryDirectory() as tmp, \
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None):
        description_file = Path(tmp) / "description.json"
        description_file.write_text(json.dumps(description, indent=2))
        model_info = mlflow.pyfunc.log_model(
            name="model", python_model=str(SERVED_MODEL),
            code_paths=code_paths(trained.job.training.model),
            artifacts={WEIGHTS_ARTIFACT: str(trained.weights),
                       DESCRIPTION_ARTIFACT: str(description_file)},
            signature=signature, metadata=description,
            input_example=pd.DataFrame({"image": [image_bytes(example_file)]}),
            # Explicit requirements: inferring them starts a subprocess that imports the model.
            # The exact versions that trained it, so a serving host gets the same.
            pip_requirements=[f"mlflow=={mlflow.__version__}",
                              *(f"{name}=={importlib.metadata.version(name).split('+')[0]}"
                                for name in ("torch", "torchvision",
                                             *serving_packages(trained.job.training.model)))],
        )
    return model_info

