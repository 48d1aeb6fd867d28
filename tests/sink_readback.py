"""Read what the metric sinks wrote, with the readers of the libraries that wrote it.

TensorBoard: the ``tensorboard`` package's ``EventAccumulator``. W&B: its offline
``.wandb`` file is a LevelDB-style record log (a 7-byte ``:W&B`` header, then 32 KiB
blocks of records with a 7-byte header: crc32c, length, type) of ``wandb_internal_pb2``
``Record`` protobufs; wandb no longer ships a Python reader, so the framing is read
here and each record is parsed with wandb's own protobuf classes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Scalars = list[tuple[str, int, float]]  # (name, step, value)

_HEADER = 7  # ":W&B" + magic 0xBEE1 + version
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def tensorboard_scalars(logdir: Path) -> Scalars:
    from tensorboard.backend.event_processing.event_accumulator import (
        SCALARS,
        EventAccumulator,
    )

    acc = EventAccumulator(str(logdir), size_guidance={SCALARS: 0})
    acc.Reload()
    return sorted((tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag))


def _wandb_records(path: Path) -> Iterator[bytes]:
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a .wandb file"
    pos, parts = _HEADER, b""
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # the block's tail is padding
            pos += left
            continue
        length, kind = struct.unpack_from("<HB", data, pos + 4)
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == _FULL:
            yield body
        elif kind == _FIRST:
            parts = body
        elif kind == _MIDDLE:
            parts += body
        elif kind == _LAST:
            yield parts + body
        elif kind == 0:  # zero-filled tail of an unfinished block
            return


def wandb_run(directory: Path) -> tuple[dict[str, Any], Scalars]:
    """The config and the scalars (against ``trainer_step``) of the one offline run
    under ``directory``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = directory.glob("wandb/offline-run-*/run-*.wandb")
    config: dict[str, Any] = {}
    scalars: Scalars = []
    for raw in _wandb_records(path):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        kind = record.WhichOneof("record_type")
        if kind in ("run", "config"):
            items = record.run.config.update if kind == "run" else record.config.update
            config.update({i.key: json.loads(i.value_json) for i in items})
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json)
                   for i in record.history.item}  # fmt: skip
            step = int(row.pop("trainer_step"))
            scalars += [(k, step, float(v)) for k, v in row.items() if not k.startswith("_")]
    return config, sorted(scalars)
