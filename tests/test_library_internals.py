"""The two places that lean on another library's internals to save start-up time, each held
to what it relies on, so that an upgrade that changes them fails here rather than silently.
(The third kind, reading torchvision's source instead of importing torch, is held by
test_config's model names against `torchvision.models.list_models()` and test_catalogues'
tables against torchvision's own dataset classes.)"""

from __future__ import annotations

import subprocess
import sys

from tests.formats import write_hf_parquet
from training.config import DatasetSpec
from training.data.sources import prepare

WARMED = """
import mlflow
from mlflow.utils import requirements_utils as r
assert r._MODULES_TO_PACKAGES is None
r._init_packages_to_modules_map()  # what tasks/train.py's warm_imports builds early
built = r._MODULES_TO_PACKAGES
assert built and "torch" in built
r.warn_dependency_requirement_mismatches([f"mlflow=={mlflow.__version__}", "torch"])
assert r._MODULES_TO_PACKAGES is built  # log_model's check used it, and built nothing again
print("ok")
"""


def test_mlflow_builds_its_package_map_once_and_log_model_reuses_it():
    done = subprocess.run([sys.executable, "-c", WARMED], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_a_hugging_face_datasets_fingerprint_follows_its_content(tmp_path, home):
    """training/data/tables.py names an hf: source's version by each split's `_fingerprint`."""
    names = ["circle", "square"]
    write_hf_parquet(tmp_path / "hub", {"train": 20, "test": 6}, names)
    spec = DatasetSpec(source=f"hf:{tmp_path / 'hub'}")
    first = prepare(spec, home).fingerprint
    assert prepare(spec, home).fingerprint == first
    write_hf_parquet(tmp_path / "hub", {"train": 21, "test": 6}, names)
    assert prepare(spec, home).fingerprint != first
