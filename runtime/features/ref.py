"""A reference to one sample's features in a store: what travels on the ref stream.

The ref says everything a reader needs to allocate and fetch each tensor (name,
shape, dtype, byte size) and where it lives (store, sample id, generation), so no
header travels with the data and nothing is ever unpickled.  A ref read from a
stream is untrusted: ``FeatureRef.from_json`` checks every field and its limits.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

# dtype name -> bytes per element; the only dtypes a ref may name (no object dtypes)
DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4,
          "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:\-]{0,199}\Z")  # store names, sample ids, tensor names
MAX_TENSORS = 1024
MAX_DIMS = 8
MAX_TENSOR_BYTES = 16 << 30


class RefError(ValueError):
    """A ref that is malformed, or that no longer matches what the store holds."""


@dataclass(frozen=True)
class TensorMeta:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype]


@dataclass(frozen=True)
class FeatureRef:
    store: str
    sample_id: str
    generation: int
    tensors: tuple[TensorMeta, ...]

    def key(self, name: str) -> str:
        """The store key of one tensor: ``{store}/{sample}/g{generation}/{name}``."""
        return f"{self.store}/{self.sample_id}/g{self.generation}/{name}"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> dict:
        return {"store": self.store, "sample_id": self.sample_id, "generation": self.generation,
                "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in self.tensors]}

    @classmethod
    def from_json(cls, doc) -> "FeatureRef":
        """A ref from decoded JSON, every field checked (RefError says which)."""
        if not isinstance(doc, dict) or set(doc) != {"store", "sample_id", "generation", "tensors"}:
            raise RefError("a ref is an object with exactly store, sample_id, generation, tensors")
        store, sample, generation = doc["store"], doc["sample_id"], doc["generation"]
        tensors = doc["tensors"]
        for what, value in (("store", store), ("sample_id", sample)):
            check_id(value, what)
        if type(generation) is not int or not 0 <= generation < 2**62:
            raise RefError(f"generation must be a non-negative integer, got {generation!r}")
        if not isinstance(tensors, list) or not 0 < len(tensors) <= MAX_TENSORS:
            raise RefError(f"tensors must be a list of 1 to {MAX_TENSORS} entries")
        metas = tuple(_tensor(t) for t in tensors)
        if len({m.name for m in metas}) != len(metas):
            raise RefError("tensor names must be unique within a ref")
        return cls(store, sample, generation, metas)


def check_id(value, what: str) -> str:
    if not isinstance(value, str) or not _ID.match(value):
        raise RefError(f"{what} must be 1-200 characters of letters, digits, '_', '.', ':', '-' "
                       f"starting with a letter or digit, got {str(value)[:80]!r}")
    return value


def _tensor(doc) -> TensorMeta:
    if not isinstance(doc, dict) or set(doc) != {"name", "shape", "dtype"}:
        raise RefError("a tensor entry is an object with exactly name, shape, dtype")
    name, shape, dtype = check_id(doc["name"], "tensor name"), doc["shape"], doc["dtype"]
    if dtype not in DTYPES:
        raise RefError(f"dtype {str(dtype)[:40]!r} is not one of {', '.join(DTYPES)}")
    if (not isinstance(shape, list) or len(shape) > MAX_DIMS
            or not all(type(d) is int and 0 <= d < 2**40 for d in shape)):
        raise RefError(f"shape of {name!r} must be a list of at most {MAX_DIMS} non-negative integers")
    meta = TensorMeta(name, tuple(shape), dtype)
    if meta.nbytes > MAX_TENSOR_BYTES:
        raise RefError(f"tensor {name!r} is {meta.nbytes} bytes, over the {MAX_TENSOR_BYTES >> 30} GiB limit")
    return meta


def meta_of(name: str, tensor) -> TensorMeta:
    """The meta of a torch tensor (its dtype must be one a ref may name)."""
    dtype = str(tensor.dtype).removeprefix("torch.")
    if dtype not in DTYPES:
        raise RefError(f"tensor {name!r}: dtype {dtype} cannot be stored (one of {', '.join(DTYPES)})")
    return TensorMeta(check_id(name, "tensor name"), tuple(tensor.shape), dtype)
