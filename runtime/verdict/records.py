"""One side's dump records in memory, and the checks every part of a comparison relies on.

    recs = records.load("sp-dumps/train")                          # every name
    recs = records.load("sp-dumps/rollout", ["input_ids", ...])    # only these names
    records.tag(rec, "layer")                                      # an int or None, else DumpError

A :class:`Rec` holds its tensor (reader.Record reads its file at each access); tests and
callers may build them directly.  Reading goes through the dump reader's bounded
reader: each safetensors file's header is read once, whatever the number of its
records (reader.read_tensors).
"""

from __future__ import annotations

from typing import NamedTuple

from ..dump import reader

# The row map: which request and token position each row of a pass is (dump/sglang.py,
# core/rows.py); input_ids carries the token of each row for the layout self-test.
MAPS = ("input_ids", "positions", "row_request")

DumpError = reader.DumpError  # malformed dumps: exit 2, as unreadable ones


class LayoutError(ValueError):
    """The two sides do not hold the same tokens at the rows they claim, or nothing pairs."""


class Rec(NamedTuple):
    """A record with its tensor in memory."""

    name: str
    tags: dict
    tensor: "torch.Tensor"  # noqa: F821 - torch is imported when a comparison runs
    where: str = ""  # its manifest line, for errors


def where(rec) -> str:
    """The record for an error message: its name and manifest line."""
    at = getattr(rec, "where", "")
    return f"{rec.name} ({at})" if at else rec.name


def tag(rec, key: str):
    """An integer tag the comparison groups or orders by (step, rank, layer, tp, ...), or
    None; anything else is a DumpError (a string layer would pair nothing, silently)."""
    value = rec.tags.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise DumpError(f"{where(rec)}: tag '{key}' is {reader.shown(value)}, expected an integer")


def manifest(path) -> list:
    """The records of a dump folder, tensors not read yet (reader.Record)."""
    return reader.load(path)


def read(records, names=None) -> list:
    """:class:`Rec` of the reader.Records whose name is in ``names`` (all: None), each
    file's tensors read in one open."""
    kept = [r for r in records if names is None or r.name in names]
    keys: dict = {}
    for r in kept:
        keys.setdefault(r.file, []).append(r.key)
    tensors = {file: reader.read_tensors(file, wanted) for file, wanted in keys.items()}
    return [Rec(r.name, r.tags, tensors[r.file][r.key], f"{r.file.parent / reader.MANIFEST} record {r.seq}")
            for r in kept]


def load(path, names=None) -> list:
    """The records of a dump folder with their tensors, only ``names`` when given."""
    return read(manifest(path), None if names is None else set(names))
