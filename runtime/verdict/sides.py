"""Which kind of run each side of a comparison is, and how it numbers its layers.

Either side may be a rollout (SGLang) or a training run (Megatron): the kind is read
from the records themselves, never from the order of the arguments.

* SGLang: records tagged ``forward_mode`` (dump/sglang.py tags every forward pass),
  a ``row_request`` with ``rows_per_request``, or names only its spec dumps
  (``topk_ids``, ``attention_input`` ...).  Its ``layer_id`` counts from 0.
* Megatron: records tagged ``cp`` or ``dp`` (only Megatron's parallel state has those
  groups: core/ranks.py), or names only its spec dumps (``routing_map``,
  ``layer_output``, ``embedding_output``).  Its ``layer_number`` counts from 1.

The layer base is then taken from the data where the data says it: a side with a
``layer`` tag of 0 counts from 0 whatever its kind; else SGLang counts from 0 and a
side whose lowest layer is 1 or more (Megatron, or a side of unknown kind) from 1.
Every layer in a report is numbered from 0: ``tag - base`` of its side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import records

SGLANG, MEGATRON, UNKNOWN = "SGLang", "Megatron", "unknown"
_SGLANG_NAMES = {"topk_ids", "topk_weights", "attention_input", "mlp_input", "router_logits"}
_MEGATRON_NAMES = {"routing_map", "layer_output", "embedding_output"}


@dataclass
class Side:
    label: str                  # "A" or "B": the first or second folder of the command line
    folder: str | None          # None for records handed over in memory
    records: list = field(default_factory=list, repr=False)
    kind: str = UNKNOWN
    base: int = 0               # subtracted from a layer tag: the report's 0-based layer
    numbering: str = ""         # how its layer tags become the report's layers, in words

    def __str__(self) -> str:
        return self.label if self.folder is None else f"{self.label} ({self.folder})"

    def layer(self, value):
        """The report's layer of a record's ``layer`` tag (None stays None)."""
        return None if value is None else value - self.base


def detect(side: Side, base: int | None = None) -> Side:
    """``side`` with its kind, layer base (``base`` when given: --layer-offset) and
    numbering; every record's step, rank, layer and microbatch tags checked."""
    kinds, layers = set(), set()
    for r in side.records:
        for key in ("step", "rank", "microbatch"):
            records.tag(r, key)
        layer = records.tag(r, "layer")
        if layer is not None:
            layers.add(layer)
        if "forward_mode" in r.tags or "rows_per_request" in r.tags or r.name in _SGLANG_NAMES:
            kinds.add(SGLANG)
        if "cp" in r.tags or "dp" in r.tags or r.name in _MEGATRON_NAMES:
            kinds.add(MEGATRON)
    side.kind = kinds.pop() if len(kinds) == 1 else UNKNOWN
    if base is not None:
        side.base = base
        side.numbering = f"{side.label}'s layer tags" + (f" - {base}" if base else "")
    elif not layers:
        side.base, side.numbering = 0, "no layer tags"
    elif 0 in layers or side.kind == SGLANG:
        side.base = 0
        side.numbering = "SGLang's layer_id" if side.kind == SGLANG else "its layer tags (from 0)"
    else:  # Megatron's layer_number, 1-based; a side of unknown kind whose layers start at 1 or later too
        side.base, side.numbering = 1, "Megatron's layer_number - 1"
    return side


def numbering(a: Side, b: Side, offset: int | None = None) -> str:
    """The report's layer numbering in one line (the table's header, JSON ``layer_numbering``)."""
    if offset is not None:
        return f"layers numbered as A's layer tags; B's layer tags - {offset} (--layer-offset {offset})"
    if a.numbering == b.numbering:
        return f"layers numbered from 0 as {a.numbering} (both sides)"
    return f"layers numbered from 0 as {a.numbering} (A); {b.numbering} (B)"
