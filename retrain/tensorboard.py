"""TensorBoard event files, written and read without TensorFlow or the tensorboard package.

NeMo's ``exp_manager`` (through Lightning's TensorBoardLogger) writes ``events.out.tfevents.*`` beside the
run's ``checkpoints/`` folder; the local stand-in trainer writes the same files, and the run's results
are read back from them (:func:`read_scalars`) whichever trainer ran.

The format, as TensorFlow defines it (``tensorflow/core/lib/io/record_writer.cc``, ``event.proto``,
``summary.proto``): a file is a sequence of TFRecords, each ``uint64 length | uint32 masked_crc32c(length)
| data | uint32 masked_crc32c(data)`` (little endian), and each record's data is an ``Event`` protobuf:
``wall_time`` (1, double), ``step`` (2, int64), ``file_version`` (3, string, the first event:
"brain.Event:2"), ``summary`` (5) holding repeated ``Summary.Value`` (1) with ``tag`` (1, string) and a
scalar as ``simple_value`` (2, float) or, as newer writers do, a ``tensor`` (8, TensorProto:
``float_val`` 5 / ``double_val`` 6 packed, or ``tensor_content`` 4).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import google_crc32c

FILE_VERSION = b"brain.Event:2"
_MASK_DELTA = 0xA282EAD8


def _masked_crc(data: bytes) -> int:
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + _MASK_DELTA) & 0xFFFFFFFF


# --- protobuf wire format, the few fields used ---------------------------------------------------


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, 2) + _varint(len(data)) + data


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a serialized message; varints as ints, the rest as bytes."""
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _read_varint(buf, pos)
            yield field, wire, value
        elif wire == 1:
            yield field, wire, buf[pos : pos + 8]
            pos += 8
        elif wire == 2:
            length, pos = _read_varint(buf, pos)
            yield field, wire, buf[pos : pos + length]
            pos += length
        elif wire == 5:
            yield field, wire, buf[pos : pos + 4]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")


# --- events --------------------------------------------------------------------------------------


def encode_event(wall_time: float, step: int, *, scalars: dict[str, float] | None = None) -> bytes:
    """One ``Event``: the file-version header when ``scalars`` is None, else a summary of scalars."""
    out = _key(1, 1) + struct.pack("<d", wall_time) + _key(2, 0) + _varint(step)
    if scalars is None:
        return out + _bytes_field(3, FILE_VERSION)
    values = b"".join(
        _bytes_field(1, _bytes_field(1, tag.encode()) + _key(2, 5) + struct.pack("<f", value))
        for tag, value in scalars.items()
    )
    return out + _bytes_field(5, values)


def frame(record: bytes) -> bytes:
    """A TFRecord: length, its masked CRC, the data, its masked CRC."""
    length = struct.pack("<Q", len(record))
    return length + struct.pack("<I", _masked_crc(length)) + record + struct.pack("<I", _masked_crc(record))


def records(data: bytes) -> Iterator[bytes]:
    """The records of an event file; ValueError on a corrupt one (a torn tail is simply ignored)."""
    pos = 0
    while pos + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, pos)
        (length_crc,) = struct.unpack_from("<I", data, pos + 8)
        if length_crc != _masked_crc(data[pos : pos + 8]):
            raise ValueError(f"corrupt record length at byte {pos}")
        end = pos + 12 + length + 4
        if end > len(data):
            return  # the writer was cut off mid-record
        record = data[pos + 12 : pos + 12 + length]
        (data_crc,) = struct.unpack_from("<I", data, end - 4)
        if data_crc != _masked_crc(record):
            raise ValueError(f"corrupt record data at byte {pos}")
        yield record
        pos = end


@dataclass(frozen=True)
class Scalar:
    tag: str
    step: int
    value: float
    wall_time: float


def _tensor_value(tensor: bytes) -> float | None:
    dtype = 0
    for field, _, value in _fields(tensor):
        if field == 1 and isinstance(value, int):
            dtype = value
        elif field == 5 and isinstance(value, bytes):  # float_val (packed, or one fixed32)
            return float(struct.unpack_from("<f", value)[0])
        elif field == 6 and isinstance(value, bytes):  # double_val
            return float(struct.unpack_from("<d", value)[0])
        elif field == 4 and isinstance(value, bytes) and value:  # tensor_content
            if dtype == 2:  # DT_DOUBLE
                return float(struct.unpack_from("<d", value)[0])
            return float(struct.unpack_from("<f", value)[0])
    return None


def decode_scalars(record: bytes) -> list[Scalar]:
    """The scalars one ``Event`` record carries (none for headers and non-scalar summaries)."""
    wall, step, summary = 0.0, 0, b""
    for field, _, value in _fields(record):
        if field == 1 and isinstance(value, bytes):
            wall = struct.unpack("<d", value)[0]
        elif field == 2 and isinstance(value, int):
            step = value if value < 1 << 63 else value - (1 << 64)
        elif field == 5 and isinstance(value, bytes):
            summary = value
    out = []
    for field, _, value in _fields(summary):
        if field != 1 or not isinstance(value, bytes):
            continue
        tag, scalar = "", None
        for vf, wire, vv in _fields(value):
            if vf == 1 and isinstance(vv, bytes):
                tag = vv.decode("utf-8", "replace")
            elif vf == 2 and wire == 5 and isinstance(vv, bytes):
                scalar = float(struct.unpack("<f", vv)[0])
            elif vf == 8 and isinstance(vv, bytes):
                scalar = _tensor_value(vv)
        if tag and scalar is not None:
            out.append(Scalar(tag, step, scalar, wall))
    return out


def read_scalars(data: bytes) -> list[Scalar]:
    """Every scalar of an event file's bytes, in file order."""
    return [s for record in records(data) for s in decode_scalars(record)]


def event_file_name(wall_time: float | None = None) -> str:
    """``events.out.tfevents.<time>.<host>.<pid>.0``, the name TensorBoard's writers give."""
    import os

    stamp = int(wall_time if wall_time is not None else time.time())
    return f"events.out.tfevents.{stamp}.{socket.gethostname()}.{os.getpid()}.0"


class EventWriter:
    """Appends scalar events to one local event file (the header written first)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "ab") as f:
            if f.tell() == 0:
                f.write(frame(encode_event(time.time(), 0)))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        with open(self.path, "ab") as f:
            f.write(frame(encode_event(time.time(), step, scalars=values)))
