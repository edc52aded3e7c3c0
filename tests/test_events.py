"""The typed messages between the ranks and the task: written and read as the same models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from training.engine.events import (
    EpochEnded,
    Evaluated,
    Failed,
    Heartbeat,
    Started,
    Trained,
    last_from_rank_0,
)
from training.engine.progress import MalformedEvent, ProgressReader, ProgressWriter


def test_messages_come_back_as_the_models_they_were_written_as(tmp_path):
    rank0, rank1 = ProgressWriter(tmp_path, 0), ProgressWriter(tmp_path, 1)
    rank0.emit(Started, world_size=2, device="cpu", pid=1, threads=1)
    rank1.emit(Heartbeat, phase="train", epoch=1, step=10)
    figures = {"epoch": 1, "train_loss": 0.9, "train_accuracy": 0.6, "val_loss": 0.8,
               "val_accuracy": 0.5, "val_images": 179, "epoch_seconds": 2.0,
               "images_per_second": 800.0, "learning_rate": 0.005, "optimizer_steps": 23}
    rank0.emit(EpochEnded, epoch=1, epochs=2, metrics=figures, is_best=True, checkpoint="c",
               world_size=2)
    rank0.emit(Trained, world_size=2, best=figures, history=[figures], weights="w.safetensors",
               preprocessing={"image_size": 28})
    events = ProgressReader(tmp_path).poll()
    assert [type(e) for e in events] == [Started, Heartbeat, EpochEnded, Trained]
    assert events[1].rank == 1 and events[1].step == 10
    assert events[2].metrics.val_images == 179 and isinstance(
        events[2].metrics.val_images, int)  # counts stay integers
    assert "epoch" not in events[2].metrics.figures()  # a step, not a logged metric
    done = last_from_rank_0(events, Trained)
    assert done is not None and done.best.epoch == 1 and done.weights == "w.safetensors"
    assert last_from_rank_0(events, Failed) is None


def test_a_misspelt_field_fails_where_it_is_written_naming_the_message(tmp_path):
    writer = ProgressWriter(tmp_path, 0)
    with pytest.raises(ValidationError, match="for Heartbeat\nstpe\n  Extra inputs"):
        writer.emit(Heartbeat, phase="train", stpe=3)
    assert ProgressReader(tmp_path).poll() == []  # nothing half-written


def test_an_unknown_message_is_refused_where_it_is_read(tmp_path):
    ProgressWriter(tmp_path, 0).emit(Heartbeat, phase="train")
    with open(tmp_path / "progress" / "rank0.jsonl", "a") as f:
        f.write('{"event": "done", "rank": 0, "time": 1.0}\n')  # an older rank's message
    with pytest.raises(MalformedEvent, match=r"^rank 0 sent a message the task cannot read "
                       r"\(Input tag 'done' found using 'event' does not match"):
        ProgressReader(tmp_path).poll()


def test_epoch_and_test_figures_are_typed_and_refuse_a_missing_or_unknown_figure(tmp_path):
    writer = ProgressWriter(tmp_path, 0)
    with pytest.raises(ValidationError, match="val_accuracy\n  Field required"):
        writer.emit(EpochEnded, epoch=1, epochs=2, metrics={"epoch": 1}, is_best=True,
                    checkpoint="c", world_size=1)
    per_class = {"cat": {"precision": 1.0, "recall": 0.5, "f1": 0.67, "support": 17}}
    writer.emit(Evaluated, metrics={"accuracy": 0.9, "loss": 0.3, "macro_f1": 0.8, "images": 17,
                                    "per_class": per_class}, world_size=1, out="o")
    done = last_from_rank_0(ProgressReader(tmp_path).poll(), Evaluated)
    assert done.metrics.per_class["cat"].support == 17  # "17 images", never "17.0"
    assert isinstance(done.metrics.per_class["cat"].support, int)
    assert done.metrics.scores() == {"accuracy": 0.9, "loss": 0.3, "macro_f1": 0.8}
