"""Networks as users write them: a callable that loads its own weights is fine-tuned with only
`model` and `epochs` given; a size a network cannot take is refused before any download; the
kept epoch is the one the gate would choose; long work shows how far it has got."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest
import torch
from mlflow import MlflowClient

from tasks.lineage import FLOW_RUN_ID
from tasks.preflight import PreflightError, check_training
from tasks.train import run_training
from tests.user_code import install_package
from training.config import TrainingSpec
from training.engine.checkpoint import better, noise
from training.handoff import TrainJob
from training.models.build import model_for
from training.storage import tracking_uri

NETS = textwrap.dedent("""
    from pathlib import Path

    import torch
    from torch import nn

    WEIGHTS = Path(__file__).with_name("imagenet_like.pt")

    def body():
        # Three 5x5 convolutions and two poolings: no image under 32 px gets through.
        return nn.Sequential(nn.Conv2d(3, 8, 5), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
                             nn.Conv2d(8, 8, 5), nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(8, 16, 5),
                             nn.AdaptiveAvgPool2d(1), nn.Flatten())

    def scratch(num_classes):
        return nn.Sequential(body(), nn.Linear(16, num_classes))

    def pretrained(num_classes):
        # The usual way: the published network with its head, loaded, then a new head.
        network = nn.Sequential(body(), nn.Linear(16, 10))
        network.load_state_dict(torch.load(WEIGHTS, weights_only=True))
        network[1] = nn.Linear(16, num_classes)
        return network
""")

DECLARED = textwrap.dedent("""
    from broughtnets.convs import pretrained as _pretrained

    pretrained_cfg = {"input_size": (3, 40, 40), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}

    def small(num_classes):
        return _pretrained(num_classes)
""")


@pytest.fixture
def user_nets(tmp_path, monkeypatch):
    """`broughtnets.convs` (weights loaded in `pretrained`, none in `scratch`) and
    `broughtnets.declared` (the same loaded network, declaring its input as timm's do)."""
    for name in [m for m in sys.modules if m.split(".")[0] == "broughtnets"]:
        monkeypatch.delitem(sys.modules, name)  # each test's own files, not an earlier test's
    folder = install_package(tmp_path / "code", monkeypatch, "broughtnets",
                             {"convs": NETS, "declared": DECLARED})
    from broughtnets.convs import WEIGHTS, body

    torch.manual_seed(7)
    torch.save(torch.nn.Sequential(body(), torch.nn.Linear(16, 10)).state_dict(), WEIGHTS)
    return folder


def test_a_network_that_loads_its_own_weights_gets_the_fine_tuning_defaults(user_nets):
    resolved = check_training(TrainingSpec(model="broughtnets.convs:pretrained", epochs=3),
                              gpus=[])
    spec = resolved.training
    fine_tuning = TrainingSpec(model="broughtnets.convs:pretrained", epochs=3, pretrained=True)
    assert spec == fine_tuning
    assert (spec.pretrained, spec.image_size, spec.fit, spec.augment, spec.optimizer) == (
        True, 224, "crop", "crop_flip", "adamw")
    assert (spec.lr, spec.backbone_lr_factor) == (1e-3, 0.1)
    assert any("arrives pretrained" in note and "its callable loads weights" in note
               for note in resolved.notes)
    # A field the user gave is kept; the defaults around it still follow the weights.
    given = check_training(TrainingSpec(model="broughtnets.convs:pretrained", epochs=3,
                                        optimizer="sgd", lr=0.001, lr_schedule="constant"),
                           gpus=[]).training
    assert (given.optimizer, given.lr, given.lr_schedule) == ("sgd", 0.001, "constant")
    assert (given.pretrained, given.fit, given.image_size, given.batchnorm) == (
        True, "crop", 224, "auto")


def test_pretrained_true_is_accepted_for_a_users_callable_and_means_its_own_weights(
        user_nets, digits_split, tmp_path):
    said = check_training(TrainingSpec(model="broughtnets.convs:pretrained", pretrained=True),
                          gpus=[])
    assert said.notes == ["broughtnets.convs:pretrained is pretrained, as training.pretrained says"]
    _, split = digits_split
    job = TrainJob(split=split, training=said.training, output_dir=tmp_path)
    loaded = torch.load(user_nets / "broughtnets" / "imagenet_like.pt", weights_only=True)
    built = model_for(job).state_dict()
    assert torch.equal(built["0.0.weight"], loaded["0.0.weight"])  # the callable's, untouched
    assert built["1.weight"].shape == (len(split.class_names), 16)  # with the data's head


def test_an_untrained_network_is_trained_from_scratch_and_a_size_it_cannot_take_is_refused(
        user_nets):
    with pytest.raises(PreflightError) as refused:
        check_training(TrainingSpec(model="broughtnets.convs:scratch"), gpus=[])
    assert str(refused.value).startswith(
        "training.image_size 28 is too small for broughtnets.convs:scratch: its forward pass "
        "fails at 28 px")
    assert "the smallest size it takes is 32 px" in str(refused.value)
    scratch = check_training(TrainingSpec(model="broughtnets.convs:scratch", image_size=32),
                             gpus=[])
    assert not scratch.training.pretrained and scratch.training.optimizer == "adam"
    assert "arrives untrained" in scratch.notes[0]
    # torchvision's networks are checked too, without making their weights.
    with pytest.raises(PreflightError, match="smallest size it takes is 32 px"):
        check_training(TrainingSpec(model="vgg16"), gpus=[])


def test_a_pretrained_network_that_declares_its_input_size_gets_it(user_nets):
    resolved = check_training(TrainingSpec(model="broughtnets.declared:small"), gpus=[])
    assert resolved.training.pretrained and resolved.training.image_size == 40
    assert "image_size 40, as broughtnets.declared:small declares" in resolved.notes[-1]
    kept = check_training(TrainingSpec(model="broughtnets.declared:small", image_size=64),
                          gpus=[]).training
    assert kept.image_size == 64


@pytest.mark.parametrize(("later", "kept"), [
    # The overconfident from-scratch run: val loss lowest early while accuracy climbs well
    # beyond the noise of 150 images; the gate compares accuracy, so the later epoch is kept.
    ({"val_accuracy": 0.653, "val_loss": 0.827}, "later"),
    # Within one standard error of 150 images (about 0.04): the lower val loss decides.
    ({"val_accuracy": 0.580, "val_loss": 0.760}, "earlier"),
    ({"val_accuracy": 0.560, "val_loss": 0.650}, "later"),
])
def test_the_epoch_is_kept_on_the_gates_metric_with_near_ties_by_val_loss(later, kept):
    earlier = {"val_accuracy": 0.567, "val_loss": 0.695, "val_images": 150}
    rule = "val_accuracy~val_loss"
    assert better({**later, "val_images": 150}, earlier, rule) == (kept == "later")
    assert noise(0.567, 150) == pytest.approx((0.567 * 0.433 / 150) ** 0.5)


def test_a_long_epoch_shows_its_progress_from_the_ranks_heartbeats(digits_split, tmp_path,
                                                                    caplog):
    """The log line every 30 s (here: every heartbeat) and the shares the Prefect progress
    artifact is given, from a real 2-process launch; that launch keeps the epoch on the val
    figure of the gate's metric, here macro F1."""
    from runtime import progress_display

    _, split = digits_split
    job = TrainJob(split=split, output_dir=tmp_path / "train", metric="macro_f1", training={
        "epochs": 2, "image_size": 12, "batch_size": 8, "heartbeat_steps": 5})
    shares = []
    logger = logging.getLogger("progress-test")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(progress_display, "LOG_EVERY_S", 0.0)
        patch.setattr(progress_display, "FRACTION_EVERY_S", 0.0)
        with caplog.at_level(logging.INFO, logger="progress-test"):
            result = run_training(job, logger, resume=False, on_progress=shares.append)
    assert result.world_size == 2
    assert result.chosen_by == "val_macro_f1~val_loss"
    assert all(0 < h.val_macro_f1 <= 1 for h in result.history)
    lines = [r.getMessage() for r in caplog.records if "train:" in r.getMessage()]
    batches = -(-split.size("train") // (2 * 8))  # each rank's steps
    assert any(line.startswith("epoch 2/2 train: ") and f" of {batches} steps (" in line
               and " images/s, about " in line and line.endswith(" left") for line in lines)
    within_epochs = [s for s in shares if 0 < s < 1 and s != 0.5]
    assert within_epochs and shares == sorted(shares) and shares[-1] == 1.0


@pytest.mark.slow
def test_train_flow_fine_tunes_a_users_pretrained_network_given_only_model_and_epochs(
        user_nets, prefect_engine, session_home):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        LogFilter,
        LogFilterFlowRunId,
    )

    from flows.train_flow import train_flow

    result = train_flow(dataset={"source": "builtin:digits"},
                        training={"model": "broughtnets.declared:small", "epochs": 2},
                        registry={"model_name": "users-own-pretrained"})
    run = MlflowClient(tracking_uri()).get_run(result.mlflow_run_id)
    params = run.data.params
    assert (params["pretrained"], params["image_size"], params["fit"], params["optimizer"],
            params["batchnorm_used"]) == ("True", "40", "crop", "adamw", "frozen")
    assert params["epoch_chosen_by"] == "val_accuracy~val_loss"
    # Its "ImageNet" weights are a random network's: what is checked is how it was trained.
    assert result.evaluation.images == sum(result.trained.job.split.counts["test"].values())
    flow_run = run.data.tags[FLOW_RUN_ID]
    with get_client(sync_client=True) as client:
        logs = client.read_logs(log_filter=LogFilter(
            flow_run_id=LogFilterFlowRunId(any_=[flow_run])))
        progress = client.read_artifacts(artifact_filter=ArtifactFilter(
            flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run])))
    assert any("broughtnets.declared:small arrives pretrained" in log.message for log in logs)
    assert [a.data for a in progress if a.type == "progress"] == [100.0]
