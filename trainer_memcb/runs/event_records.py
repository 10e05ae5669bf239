"""TensorBoard event files, read record by record within bounds, without TensorFlow.

An event file is a TFRecord file (tensorflow/core/lib/io/record_writer.cc): each record is an
8-byte little-endian length, the masked CRC-32C of those 8 bytes, the payload (a serialized
`Event` protobuf) and the masked CRC-32C of the payload. Reading it here rather than through
TensorBoard's loader bounds what one file can cost: the length is checked against what is left of
the file before anything is read, a record larger than a scalar event can be (an image, a
histogram, a graph) is stepped over unread and unchecked, and the number of records is capped.
A record cut short at the end is the end of a file still being written: what came before is kept.
"""

from __future__ import annotations

import os
import struct
from typing import Any, Iterator

from trainer_memcb.utils.safe_io import UnsafeFileError, open_regular
from trainer_memcb.utils.units import GiB, KiB

__all__ = ["MAX_EVENT_FILE_BYTES", "MAX_SCALAR_RECORD_BYTES", "MAX_RECORDS", "read_events"]

MAX_EVENT_FILE_BYTES = 1 * GiB
# A scalar event (wall time, step, one tag and one value) takes well under 1 KiB.
MAX_SCALAR_RECORD_BYTES = 64 * KiB
MAX_RECORDS = 1_000_000
_HEADER = struct.Struct("<QI")
_FOOTER = struct.Struct("<I")


def read_events(path: str) -> Iterator[Any]:
    """The `Event` protobufs of one event file, in order, records too large for a scalar left out.

    Raises:
        UnsafeFileError: not a regular file, larger than MAX_EVENT_FILE_BYTES, a checksum that
            does not match, a payload that is not an Event, or more than MAX_RECORDS records.
    """
    # The CRC is TensorBoard's own pure-Python one; the protobuf is TensorBoard's copy of TensorFlow's.
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c
    from google.protobuf.message import DecodeError

    with open_regular(path, MAX_EVENT_FILE_BYTES) as handle:
        size = os.fstat(handle.fileno()).st_size
        records = 0
        while True:
            header = handle.read(_HEADER.size)
            if len(header) < _HEADER.size:
                return
            length, length_crc = _HEADER.unpack(header)
            if masked_crc32c(header[:8]) != length_crc:
                raise UnsafeFileError(f"{path} is not a TensorBoard event file (record {records}: bad length checksum)")
            if length + _FOOTER.size > size - handle.tell():
                return
            records += 1
            if records > MAX_RECORDS:
                raise UnsafeFileError(f"{path} holds more than {MAX_RECORDS:,} records; not read further")
            if length > MAX_SCALAR_RECORD_BYTES:
                handle.seek(length + _FOOTER.size, os.SEEK_CUR)
                continue
            payload = handle.read(length)
            footer = handle.read(_FOOTER.size)
            if len(payload) < length or len(footer) < _FOOTER.size:
                return
            if masked_crc32c(payload) != _FOOTER.unpack(footer)[0]:
                raise UnsafeFileError(f"{path} is damaged (record {records - 1}: bad data checksum)")
            try:
                event = Event.FromString(payload)
            except DecodeError:
                raise UnsafeFileError(f"{path} is not a TensorBoard event file (record {records - 1} is not an event)") from None
            yield event
