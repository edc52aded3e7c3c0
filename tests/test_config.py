"""The configuration models: defaults, validation, and errors that show valid usage."""

import ast
import subprocess
import sys

import pytest
from pydantic import ValidationError

from training.config import (
    LAUNCH_ONLY,
    PER_MACHINE,
    SEARCHABLE,
    DatasetSpec,
    InvalidParameters,
    RegistrySpec,
    Role,
    SplitSpec,
    TrainingSpec,
    merge_blocks,
    validate_blocks,
)
from training.handoff import JobFileError, SplitResult, TrainJob


def test_defaults_need_only_the_source():
    spec = DatasetSpec(source="builtin:digits")
    assert (spec.labels, spec.subdir, spec.kind) == ("folders", None, "builtin")
    assert SplitSpec() == SplitSpec(val_fraction=0.1, test_fraction=0.1, seed=42)
    training = TrainingSpec()
    assert (training.model, training.pretrained, training.mixed_precision) == (
        "basicnet", False, "no")
    assert RegistrySpec().metric == "accuracy"


def test_the_default_learning_rate_follows_the_model_until_one_is_given():
    assert (TrainingSpec().lr, TrainingSpec(model="resnet18").lr) == (0.01, 0.005)
    assert TrainingSpec(model="resnet18", lr=0.02).lr == 0.02
    # A run that changes only the model of a deployment's training block gets that model's rate.
    deployment = {"training": {"model": "basicnet", "epochs": 3}}
    merged = merge_blocks(deployment, {"training": {"model": "resnet18"}}, ("training",))
    assert validate_blocks({"dataset": {"source": "builtin:digits"}, **merged}
                           )["training"].lr == 0.005
    # A bad model is one problem, not two: the rate that follows it is not reported on its own.
    with pytest.raises(InvalidParameters) as error:
        validate_blocks({"dataset": {"source": "builtin:digits"},
                         "training": {"model": "resnet-18"}})
    assert [p.split(":")[0] for p in error.value.problems] == ["training.model"]


def test_kaggle_sources_are_parsed():
    assert DatasetSpec(source="kaggle:competitions/dogs-vs-cats").kaggle_ref == (
        "competitions", "dogs-vs-cats")
    assert DatasetSpec(source="kaggle:datasets/owner/some-data").kaggle_ref == (
        "datasets", "owner/some-data")


@pytest.mark.parametrize(("model", "fields", "needle"), [
    (DatasetSpec, {"source": "s3://bucket/images"}, "unknown dataset source scheme 's3'"),
    (DatasetSpec, {"source": "builtin:mnist"}, 'available: "builtin:digits"'),
    (DatasetSpec, {"source": "kaggle:dogs"}, "kaggle:competitions/dogs-vs-cats"),
    (DatasetSpec, {"source": "x", "labels": "xml"}, 'use "folders", "filename"'),
    (DatasetSpec, {"source": "x", "labels": "csv:../etc/passwd"}, "relative to the source"),
    (DatasetSpec, {"source": "x", "color": "red"}, "Extra inputs are not permitted"),
    (SplitSpec, {"val_fraction": 0.5, "test_fraction": 0.5}, "must sum below 1"),
    (SplitSpec, {"val_fraction": -0.1}, "greater than 0"),
    (TrainingSpec, {"epochs": -1}, "greater than or equal to 1"),
    (TrainingSpec, {"num_processes": 0}, "at least 1"),
    (TrainingSpec, {"model": "resnet-18"}, "unknown model 'resnet-18'"),
    (TrainingSpec, {"optimizer": "adagrad"}, "'adam', 'adamw' or 'sgd'"),
    (TrainingSpec, {"mixed_precision": "fp8"}, "'no', 'fp16' or 'bf16'"),
    (TrainingSpec, {"num_machines": 2, "machine_rank": 2}, "must be below"),
    (TrainingSpec, {"node_work_queue": "gpu-{rank}"}, "{machine_rank}"),
    (TrainingSpec, {"batch_sise": 3}, "Extra inputs are not permitted"),
])
def test_bad_values_name_the_problem(model, fields, needle):
    with pytest.raises(ValidationError) as error:
        model(**fields)
    assert needle in str(error.value)


def test_any_torchvision_classifier_is_accepted():
    for name in ("resnet18", "vgg16", "mobilenet_v3_small", "efficientnet_b0"):
        assert TrainingSpec(model=name).model == name


def test_model_names_are_torchvisions_catalogue_read_without_importing_torch():
    check = ("import sys; from training.config import TrainingSpec\n"
             "from training.catalogue import torchvision_model_names\n"
             "try:\n    TrainingSpec(model='resnet-18')\nexcept ValueError as e:\n"
             "    print('refused' if 'unknown model' in str(e) else e)\n"
             "print(sorted(torchvision_model_names())); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "refused" and out[2] == "False"
    import torchvision

    assert ast.literal_eval(out[1]) == sorted(torchvision.models.list_models(
        module=torchvision.models))
    assert {"resnet18", "vgg16", "vit_b_16"} <= set(ast.literal_eval(out[1]))


def test_job_file_round_trip(tmp_path):
    split = SplitResult(manifest=tmp_path / "m.csv", manifest_sha256="0" * 64, quarantined=0,
                        counts={"train": {"a": 8}, "val": {"a": 1}, "test": {"a": 1}},
                        class_names=["a"], channels=3, root=tmp_path)
    job = TrainJob(split=split, output_dir=tmp_path / "out",
                   training={"epochs": 3, "num_processes": 2})
    path = job.save()
    assert path == tmp_path / "out" / "job.json"
    again = TrainJob.load(path)
    assert again == job and again.training.epochs == 3
    path.write_text('{"split": 3}')
    with pytest.raises(JobFileError, match=f"job file {path} is not a valid training job"):
        TrainJob.load(path)


def test_auto_processes_on_a_cpu_machine(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)  # true on any machine
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    assert TrainingSpec(num_processes="auto").resolved_num_processes() == 2
    monkeypatch.setattr("os.cpu_count", lambda: 1)
    assert TrainingSpec(num_processes="auto").resolved_num_processes() == 1


def test_auto_loader_workers_are_none_on_cpu_and_the_spare_cores_on_gpus():
    auto = TrainingSpec()
    assert auto.loader_workers == "auto"
    assert auto.workers_per_rank(on_gpu=False, cores=64, ranks_here=2) == 0
    assert auto.workers_per_rank(on_gpu=True, cores=16, ranks_here=1) == 4
    assert auto.workers_per_rank(on_gpu=True, cores=16, ranks_here=8) == 1
    assert auto.workers_per_rank(on_gpu=True, cores=8, ranks_here=8) == 0
    assert TrainingSpec(loader_workers=2).workers_per_rank(on_gpu=False, cores=2,
                                                           ranks_here=2) == 2


def test_a_job_file_that_is_not_json_is_refused_before_training(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "job.json"
    bad.write_text('{"manifest": "m.csv", "output_dir": ')
    done = subprocess.run([sys.executable, "-m", "training.train", "--job", str(bad)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"job file {bad} is not a valid training job" in done.stderr
    assert not (tmp_path / "progress").exists()


def test_the_spec_hash_counts_the_world_size():
    """Batch size is per process: more processes is a different training, not "unchanged"."""
    from tasks.lineage import spec_hash

    one, two = (TrainingSpec(num_processes=n) for n in (1, 2))
    assert spec_hash(one, SplitSpec()) != spec_hash(two, SplitSpec())
    assert spec_hash(one, SplitSpec()) == spec_hash(TrainingSpec(num_processes=1,
                                                                 hang_timeout_s=9), SplitSpec())
    assert spec_hash(one, SplitSpec()) != spec_hash(one, SplitSpec(seed=7))


def test_every_training_field_declares_one_role():
    """A new field without its role would be hashed, searched and replayed by accident."""
    for name, info in TrainingSpec.model_fields.items():
        declared = [m for m in info.metadata if isinstance(m, Role)]
        assert len(declared) == 1, f"TrainingSpec.{name} declares {declared}: give it one Role"


def test_the_rules_follow_the_declared_roles():
    from tasks.lineage import spec_hash

    assert "epochs" not in SEARCHABLE and {"lr", "model", "seed"} <= SEARCHABLE
    assert {"num_processes", "accelerate_config_file", "num_machines"} <= LAUNCH_ONLY
    assert not SEARCHABLE & LAUNCH_ONLY and PER_MACHINE < LAUNCH_ONLY
    base = TrainingSpec(num_processes=1)
    for name in LAUNCH_ONLY - {"num_processes", "num_machines", "machine_rank"}:
        changed = base.model_copy(update={name: "x"})  # unvalidated: only the hash reads it
        assert spec_hash(changed, SplitSpec()) == spec_hash(base, SplitSpec()), name
    for name, value in {"lr": 0.1, "epochs": 3, "seed": 1, "optimizer": "sgd"}.items():
        changed = base.model_copy(update={name: value})
        assert spec_hash(changed, SplitSpec()) != spec_hash(base, SplitSpec()), name
    node = TrainingSpec(num_machines=2, machine_rank=1, main_process_ip="10.0.0.2",
                        main_process_port=29500).on_this_machine()
    assert {name: getattr(node, name) for name in PER_MACHINE} == {
        "machine_rank": 0, "main_process_ip": None, "main_process_port": None}


def test_every_train_flow_deployment_in_prefect_yaml_has_valid_parameters():
    from pathlib import Path

    import yaml

    from training.config import BLOCKS, RetrainSpec

    recipe = yaml.safe_load((Path(__file__).parents[1] / "prefect.yaml").read_text())
    checked = []
    for deployment in recipe["deployments"]:
        if deployment["entrypoint"] != "flows/train_flow.py:train_flow":
            continue
        for name, block in deployment.get("parameters", {}).items():
            {**BLOCKS, "retrain": RetrainSpec}[name].model_validate(block)
        checked.append(deployment["name"])
    assert {"digits", "dogs-vs-cats", "mnist"} <= set(checked)


def test_every_deployment_in_prefect_yaml_gives_its_flow_valid_parameters():
    """As the server will validate them: each deployment's parameters against its flow's own
    signature (train-node's come from train-flow at run time)."""
    import importlib
    from pathlib import Path

    import yaml

    recipe = yaml.safe_load((Path(__file__).parents[1] / "prefect.yaml").read_text())
    checked = []
    for deployment in recipe["deployments"]:
        path, name = deployment["entrypoint"].split(":")
        flow = getattr(importlib.import_module(path.removesuffix(".py").replace("/", ".")), name)
        if flow.name == "train-node":
            continue
        flow.validate_parameters(deployment.get("parameters", {}))
        checked.append(f"{flow.name}/{deployment['name']}")
    assert {"train-flow/photos", "predict-flow/photos-incoming",
            "watch-data/every-10-minutes", "sweep-flow/digits-sweep"} <= set(checked)


def test_the_registered_name_follows_the_dataset_unless_one_is_named(tmp_path):
    flowers = tmp_path / "My Flowers"
    flowers.mkdir()
    named = {source: validate_blocks({"dataset": {"source": source}})["registry"].model_name
             for source in ("builtin:digits", str(flowers), "torchvision:EMNIST/balanced",
                            "kaggle:competitions/dogs-vs-cats-redux-kernels-edition")}
    assert named == {"builtin:digits": "digits", str(flowers): "my-flowers",
                     "torchvision:EMNIST/balanced": "emnist",
                     "kaggle:competitions/dogs-vs-cats-redux-kernels-edition":
                         "dogs-vs-cats-redux-kernels-edition"}
    given = validate_blocks({"dataset": {"source": "builtin:digits"},
                             "registry": {"model_name": "team-digits"}})
    assert given["registry"].model_name == "team-digits"
