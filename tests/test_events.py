"""The typed messages between the ranks and the task: written and read as the same models."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from training.engine.events import (
    EpochEnded,
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
    rank0.emit(EpochEnded, epoch=1, epochs=2, metrics={"val_accuracy": 0.5, "val_images": 179},
               is_best=True, checkpoint="c", world_size=2)
    rank0.emit(Trained, world_size=2, best={"epoch": 1, "val_accuracy": 0.5},
               history=[{"epoch": 1, "val_accuracy": 0.5}], weights="w.safetensors",
               preprocessing={"image_size": 28})
    events = ProgressReader(tmp_path).poll()
    assert [type(e) for e in events] == [Started, Heartbeat, EpochEnded, Trained]
    assert events[1].rank == 1 and events[1].step == 10
    assert events[2].metrics["val_images"] == 179 and isinstance(
        events[2].metrics["val_images"], int)  # counts stay integers
    done = last_from_rank_0(events, Trained)
    assert done is not None and done.best["epoch"] == 1 and done.weights == "w.safetensors"
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
