"""retrain's TensorBoard event files against TensorBoard's own reader and PyTorch's own writer (the one
NeMo's logger uses): what the stand-in writes reads as TensorBoard reads it, and what NeMo writes reads
back here."""

from __future__ import annotations

from pathlib import Path

import pytest

from retrain.tensorboard import EventWriter, frame, read_scalars, records


def test_tensorboard_reads_what_retrain_writes(tmp_path: Path) -> None:
    loader = pytest.importorskip("tensorboard.backend.event_processing.event_file_loader")
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    writer = EventWriter(path)
    writer.scalars(3, {"reduced_train_loss": 2.5, "lr": 1e-4})
    writer.scalars(7, {"val_loss": 1.25})
    events = list(loader.EventFileLoader(str(path)).Load())
    assert events[0].file_version == "brain.Event:2"
    got = [(e.step, v.tag, v.tensor.float_val[0]) for e in events[1:] for v in e.summary.value]
    assert got == [(3, "reduced_train_loss", 2.5), (3, "lr", pytest.approx(1e-4)), (7, "val_loss", 1.25)]


def test_retrain_reads_what_pytorchs_writer_writes(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    summary = pytest.importorskip("torch.utils.tensorboard")
    writer = summary.SummaryWriter(str(tmp_path))
    for step in range(5):
        writer.add_scalar("reduced_train_loss", 10.0 / (step + 1), step)
    writer.add_scalar("val_loss", 1.5, 4)
    writer.close()
    (path,) = tmp_path.glob("events.out.tfevents.*")
    scalars = read_scalars(path.read_bytes())
    assert [(s.tag, s.step) for s in scalars][-2:] == [("reduced_train_loss", 4), ("val_loss", 4)]
    assert [s.value for s in scalars if s.tag == "reduced_train_loss"] == [
        10.0,
        5.0,
        pytest.approx(10 / 3),
        2.5,
        2.0,
    ]


def test_a_torn_tail_is_ignored_and_corruption_is_named(tmp_path: Path) -> None:
    path = tmp_path / "events.out.tfevents.1.host.1.0"
    EventWriter(path).scalars(1, {"loss": 1.0})
    data = path.read_bytes()
    assert len(list(records(data + frame(b"x")[:7]))) == 2  # a writer cut off mid-record
    broken = bytearray(data)
    broken[-6] ^= 0xFF
    with pytest.raises(ValueError, match="corrupt record"):
        list(records(bytes(broken)))
