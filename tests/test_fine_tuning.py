"""Fine-tuning as people do it: the layouts they download, images as the weights saw them in
pretraining, the recipe's defaults that follow the weights, BatchNorm with a few images per
rank, the head first, and an honestly chosen epoch; served exactly as evaluated."""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from tasks.report import how_split
from tasks.train import run_training
from tests.imagegen import photo
from tests.test_given_splits import write_split_tree
from tests.user_code import install_package
from trainflow_serving.images import Geometry, load_resized
from training.config import DatasetSpec, SplitSpec, TrainingSpec, merge_blocks, validate_blocks
from training.data.augment import augmentation
from training.data.labels import DatasetError
from training.data.sources import prepare
from training.data.split import read_manifest, split_dataset
from training.data.store import DecodeStore
from training.handoff import TrainJob
from training.models.build import head_name
from training.train import batchnorm_mode

LOG = logging.getLogger("test-fine-tuning")

NETS = textwrap.dedent("""
    from torch import nn

    # The weights' input statistics, the way timm's models carry theirs.
    pretrained_cfg = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}

    def bn_net(num_classes):
        return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                             nn.Conv2d(8, 16, 3, padding=1, stride=2), nn.BatchNorm2d(16),
                             nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                             nn.Linear(16, num_classes))
""")
HEAD = "8"  # bn_net's last Linear


def write_tree(root, splits: dict[str, dict[str, int]]) -> dict[str, set[str]]:
    """Non-square JPEGs, ants drawn as cats and bees as dogs."""
    return write_split_tree(root, splits, size=(40, 28), drawn_as={"ants": "cat", "bees": "dog"},
                            ext="jpg")


def test_a_train_and_val_download_is_measured_on_its_val_folder(tmp_path, home):
    """hymenoptera_data as downloaded: train/{ants,bees}, val/{ants,bees}, no test/."""
    written = write_tree(tmp_path / "hymenoptera_data", {"train": {"ants": 30, "bees": 30},
                                                          "val": {"ants": 8, "bees": 7}})
    ref = prepare(DatasetSpec(source=str(tmp_path / "hymenoptera_data")), home)
    assert ref.class_names == ["ants", "bees"]  # not "train" and "val"
    result = split_dataset(ref, SplitSpec(), home)
    rows = read_manifest(result.manifest)
    by_split = {s: {p for p, _, sp in rows if sp == s} for s in ("train", "val", "test")}
    assert by_split["test"] == written["val"]  # the given held-out folder is what is measured
    assert by_split["train"] | by_split["val"] == written["train"]
    assert result.counts["val"] == {"ants": 3, "bees": 3}  # carved from train
    assert how_split(result) == "as given: train/ as train, val/ as test; val carved from train"


@pytest.mark.parametrize(("folders", "needle"), [
    ({"train": {"a": 4}, "extra": {"a": 4}}, "other folders stand beside them (extra/)"),
    ({"val": {"a": 4}, "test": {"a": 4}}, "there is no train/ beside them"),
    ({"train": {"a": 4}, "b": {"a": 4}}, "other folders stand beside them (b/)"),
])
def test_classes_named_like_split_folders_are_refused_with_the_fix(tmp_path, home, folders,
                                                                   needle):
    write_tree(tmp_path / "data", folders)
    with pytest.raises(DatasetError) as error:
        prepare(DatasetSpec(source=str(tmp_path / "data")), home)
    assert needle in str(error.value)
    assert "point dataset.source (or dataset.subdir) at the folder" in str(error.value)
    assert not (home / "splits").exists()


def test_the_recipe_defaults_follow_the_starting_weights():
    scratch, tuned = TrainingSpec(), TrainingSpec(model="resnet18", pretrained=True)
    assert (scratch.image_size, scratch.fit, scratch.augment, scratch.optimizer,
            scratch.backbone_lr_factor, scratch.lr) == (28, "squash", "none", "adam", 1.0, 0.01)
    assert (tuned.image_size, tuned.fit, tuned.augment, tuned.optimizer, tuned.lr) == (
        224, "crop", "crop_flip", "adamw", 0.001)
    assert tuned.backbone_lr_factor == 0.1
    assert TrainingSpec(weights="w.safetensors").fit == "crop"
    # What is given is kept; what is not follows the weights, also when a run's block
    # overrides another field of a deployment's (merged, then validated once).
    assert TrainingSpec(pretrained=True, model="resnet18", fit="squash", image_size=64).fit \
        == "squash"
    merged = merge_blocks({"dataset": {"source": "builtin:digits"},
                           "training": {"model": "resnet18", "pretrained": True}},
                          {"training": {"epochs": 4}}, ("training",))
    training = validate_blocks(merged)["training"]
    assert (training.epochs, training.image_size, training.augment) == (4, 224, "crop_flip")
    with pytest.raises(ValueError, match="freeze_epochs 2 leaves no epoch for every layer"):
        TrainingSpec(model="resnet18", pretrained=True, epochs=2, freeze_epochs=2)
    with pytest.raises(ValueError, match="freeze_epochs trains a new head on pretrained"):
        TrainingSpec(freeze_epochs=1, epochs=3)


@pytest.mark.parametrize("size", [(40, 28), (28, 40), (33, 33), (97, 41)])
def test_the_crop_fit_is_torchvisions_resize_and_centre_crop(tmp_path, size):
    from torchvision.transforms import v2

    path = tmp_path / "photo.png"
    photo("cat", 3, max(size)).resize(size).save(path)
    ours = load_resized(path, Geometry(24, 27), 3)
    with Image.open(path) as img:
        theirs = v2.CenterCrop(24)(v2.Resize(27)(img.convert("RGB")))
    assert np.array_equal(ours, np.asarray(theirs).transpose(2, 0, 1))
    assert load_resized(path, Geometry(24), 3).shape == (3, 24, 24)  # squash, unchanged
    assert Geometry.parse(Geometry(24, 27).name) == Geometry(24, 27)
    assert Geometry.parse("24px") == Geometry(24)


@pytest.mark.parametrize("augment", ["crop", "crop_flip", "trivialaugment", "randaugment"])
def test_each_augmentation_gives_the_input_size_with_its_own_draw_per_image(augment):
    spec = TrainingSpec(augment=augment, image_size=16)
    transform = augmentation(spec)
    torch.manual_seed(0)
    image = torch.randint(0, 256, (3, 19, 19), dtype=torch.uint8)
    outs = [transform(image) for _ in range(6)]
    assert all(o.shape == (3, 16, 16) and o.dtype == torch.uint8 for o in outs)
    assert len({o.numpy().tobytes() for o in outs}) > 1
    assert augmentation(TrainingSpec(augment="none")) is None


@pytest.mark.parametrize(("fields", "device", "processes", "mode"), [
    ({"pretrained": True, "model": "resnet18", "batch_size": 16}, "cpu", 2, "frozen"),
    ({"pretrained": True, "model": "resnet18", "batch_size": 16}, "cuda", 2, "sync"),
    ({"pretrained": True, "model": "resnet18", "batch_size": 8}, "cuda", 2, "frozen"),
    ({"pretrained": True, "model": "resnet18", "batch_size": 64}, "cpu", 1, "train"),
    ({"model": "resnet18", "batch_size": 8}, "cpu", 2, "train"),
    ({"model": "resnet18"}, "cuda", 4, "sync"),
    ({"model": "resnet18", "batchnorm": "frozen"}, "cpu", 1, "frozen"),
])
def test_batchnorm_auto_follows_the_weights_and_the_images_per_statistic(fields, device,
                                                                         processes, mode):
    assert batchnorm_mode(TrainingSpec(**fields), device, processes) == mode


def test_batchnorm_sync_on_cpu_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match='needs CUDA processes .* use "frozen" or "train"'):
        batchnorm_mode(TrainingSpec(model="resnet18", batchnorm="sync"), "cpu", 2)


def test_the_head_is_found_for_torchvision_timm_style_and_user_networks():
    from torch import nn
    from torchvision.models import mobilenet_v3_small, resnet18

    class TimmLike(nn.Module):
        def __init__(self):
            super().__init__()
            self.features, self.head, self.aux = nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2)

        def get_classifier(self):
            return self.head

    assert head_name(resnet18()) == "fc"
    assert head_name(mobilenet_v3_small()) == "classifier.3"
    assert head_name(TimmLike()) == "head"  # not the last Linear
    assert head_name(TimmLike(), "aux") == "aux"
    with pytest.raises(ValueError, match="training.head 'fc' is not a module of TimmLike"):
        head_name(TimmLike(), "fc")


@pytest.fixture
def bn_nets(tmp_path, monkeypatch):
    install_package(tmp_path / "code", monkeypatch, "ftnets", {"convs": NETS})
    from ftnets.convs import bn_net

    torch.manual_seed(7)
    pretrained = bn_net(1000)
    with torch.no_grad():  # statistics no new batch would give, to see whether they move
        for module in pretrained.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.05, 0.05)
                module.running_var.uniform_(0.5, 1.5)
    weights = tmp_path / "imagenet.safetensors"
    save_file(pretrained.state_dict(), weights)
    return weights


@pytest.fixture
def hymenoptera(tmp_path, home):
    write_tree(tmp_path / "hymenoptera_data", {"train": {"ants": 60, "bees": 60},
                                                "val": {"ants": 12, "bees": 12}})
    ref = prepare(DatasetSpec(source=str(tmp_path / "hymenoptera_data")), home)
    return split_dataset(ref, SplitSpec(), home)


def _fine_tune(split, tmp_path, weights, name, **training):
    job = TrainJob(split=split, output_dir=tmp_path / name / "train", training={
        "model": "ftnets.convs:bn_net", "weights": str(weights), "image_size": 24,
        "epochs": 2, "num_processes": 2, "batch_size": 8, **training})
    return job, run_training(job, LOG, resume=False, evaluate_into=tmp_path / name / "eval")


def _params(job) -> dict:
    return next(json.loads(line)["params"] for line in
                (job.output_dir / "progress" / "rank0.jsonl").read_text().splitlines()
                if json.loads(line)["event"] == "params")


@pytest.mark.slow
def test_frozen_batchnorm_keeps_the_weights_statistics_and_train_moves_them(
        hymenoptera, bn_nets, tmp_path):
    start = load_file(bn_nets)
    frozen_job, frozen = _fine_tune(hymenoptera, tmp_path, bn_nets, "frozen")
    assert frozen.world_size == 2 and _params(frozen_job)["batchnorm_used"] == "frozen"
    trained = load_file(frozen.weights)
    for key in ("1.running_mean", "1.running_var", "4.running_mean", "4.running_var"):
        assert torch.equal(trained[key], start[key]), key
    assert not torch.equal(trained["1.weight"], start["1.weight"])  # its scale still learns
    train_job, moving = _fine_tune(hymenoptera, tmp_path, bn_nets, "train", batchnorm="train")
    assert _params(train_job)["batchnorm_used"] == "train"
    assert not torch.equal(load_file(moving.weights)["1.running_mean"], start["1.running_mean"])


@pytest.mark.slow
def test_the_head_learns_alone_for_freeze_epochs_then_every_layer_learns(
        hymenoptera, bn_nets, tmp_path):
    start = load_file(bn_nets)
    job, result = _fine_tune(hymenoptera, tmp_path, bn_nets, "head-first", freeze_epochs=1,
                             choose_epoch="last", batchnorm="train")
    first = load_file(next(job.output_dir.glob("checkpoints/checkpoint_1/model.safetensors")))
    backbone = [k for k in start if not k.startswith(f"{HEAD}.")]
    for key in backbone:  # after the head's epoch: weights and statistics as they came
        assert torch.equal(first[key], start[key]), key
    assert first[f"{HEAD}.weight"].shape == (2, 16)
    last = load_file(result.weights)
    assert not torch.equal(last["0.weight"], start["0.weight"])  # then the backbone learned
    assert [h.epoch for h in result.history] == [1, 2] and result.best_epoch == 2


@pytest.mark.slow
def test_the_epoch_is_chosen_on_validation_loss_or_the_last_kept_for_a_small_val_split(
        hymenoptera, bn_nets, tmp_path):
    job, by_loss = _fine_tune(hymenoptera, tmp_path, bn_nets, "by-loss", epochs=3,
                              choose_epoch="val_loss", choose_min_val_images=1)
    assert by_loss.chosen_by == "val_loss" and _params(job)["epoch_chosen_by"] == "val_loss"
    assert by_loss.best_epoch == min(by_loss.history, key=lambda h: h.val_loss).epoch
    _, small = _fine_tune(hymenoptera, tmp_path, bn_nets, "small-val", epochs=3)
    assert hymenoptera.size("val") < TrainingSpec().choose_min_val_images
    assert small.chosen_by == "last" and small.best_epoch == 3


SERVED_INPUT = r"""
import hashlib, json, sys
import mlflow
from trainflow_serving.images import load_resized_bytes
model = mlflow.pyfunc.load_model(sys.argv[1]).unwrap_python_model()
paths = json.load(sys.stdin)
print(json.dumps({"geometry": [model.geometry.side, model.geometry.resize],
                  "hashes": [hashlib.sha256(load_resized_bytes(open(p, "rb").read(),
                             model.geometry, model.channels).tobytes()).hexdigest()
                             for p in paths]}))
"""


@pytest.mark.slow
def test_the_served_model_sees_exactly_what_evaluation_saw(hymenoptera, bn_nets, tmp_path):
    """Trained with the fine-tuning defaults (aspect kept, centre crop), registered, loaded in
    a fresh process: its input for each test image is the evaluated one, byte for byte."""
    import mlflow
    from mlflow import MlflowClient

    from tasks.evaluate import evaluate_model
    from tasks.lineage import FLOW_RUN_ID
    from tasks.register import register_model
    from training.config import RegistrySpec

    job, trained = _fine_tune(hymenoptera, tmp_path, bn_nets, "served")
    assert trained.preprocessing.crop_from == 27 and trained.preprocessing.mean == [0.5] * 3
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        experiment = MlflowClient(uri).create_experiment(
            "ft", artifact_location=(tmp_path / "a").as_uri())
        run_id = MlflowClient(uri).create_run(experiment).info.run_id
        evaluation = evaluate_model.fn(trained, run_id)
        register_model.fn(trained, evaluation, RegistrySpec(model_name="ft"), run_id,
                          {FLOW_RUN_ID: "ft"})
        model_dir = mlflow.artifacts.download_artifacts("models:/ft/1",
                                                         dst_path=str(tmp_path / "m"))
    tests = [p for p, _, s in read_manifest(hymenoptera.manifest) if s == "test"]
    done = subprocess.run([sys.executable, "-c", SERVED_INPUT, model_dir], text=True,
                          input=json.dumps([str(hymenoptera.root / p) for p in tests]),
                          capture_output=True, timeout=300, env={"PATH": "/usr/bin:/bin",
                                                                 "HOME": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    served = json.loads(done.stdout.strip().splitlines()[-1])
    geometry = trained.preprocessing.geometry
    assert served["geometry"] == [geometry.side, geometry.resize] == [24, 27]
    store = DecodeStore(hymenoptera.manifest.parent.parent, geometry)
    with store.locked(exclusive=False) as index:
        found = store.lookup(index, tests)
        evaluated = [hashlib.sha256(np.ascontiguousarray(found.images[row]).tobytes())
                     .hexdigest() for row in found.rows]
    assert served["hashes"] == evaluated


def test_a_head_that_is_not_there_or_sync_batchnorm_on_a_cpu_is_refused_in_preflight(bn_nets):
    from tasks.preflight import PreflightError, check_training

    base = {"model": "ftnets.convs:bn_net", "weights": str(bn_nets), "image_size": 24}
    with pytest.raises(PreflightError, match="training.head 'fc' is not a module of Sequential"):
        check_training(TrainingSpec(**base, head="fc"), gpus=[])
    with pytest.raises(PreflightError, match="training.head '1' is a BatchNorm2d, not an nn"):
        check_training(TrainingSpec(**base, head="1"), gpus=[])
    with pytest.raises(PreflightError, match='batchnorm="sync" needs CUDA GPUs'):
        check_training(TrainingSpec(**base, batchnorm="sync"), gpus=[])
    check_training(TrainingSpec(**base, head=HEAD), gpus=[])


def test_the_input_statistics_are_the_weights_own_unless_named(bn_nets, tmp_path, digits_split):
    from training.models.build import IMAGENET_MEAN, preprocessing_for

    _, split = digits_split

    def mean_of(**training):
        return preprocessing_for(TrainJob(split=split, output_dir=tmp_path, training=training)).mean

    user = {"model": "ftnets.convs:bn_net", "weights": str(bn_nets)}
    assert mean_of(**user) == [0.5, 0.5, 0.5]  # its module's pretrained_cfg
    assert mean_of(**user, normalization="imagenet") == list(IMAGENET_MEAN)
    assert mean_of(model="resnet18", pretrained=True) == list(IMAGENET_MEAN)
    assert mean_of(model="resnet18", pretrained=True, normalization="inception") == [0.5] * 3
