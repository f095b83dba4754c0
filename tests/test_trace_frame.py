"""The binary trace frame (runtime/trace/frame.py): layout, round trip, rejection."""

import json
import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from source_patch.runtime.trace import frame as tf

DTYPES = [np.float32, np.float64, np.int64, np.int32, np.uint8, np.float16]


def test_layout_matches_the_documented_table():
    a = np.arange(6, dtype=np.float64).reshape(2, 3)
    meta = {"sub": "s1", "name": "layer_output", "layer": 3}
    data = tf.encode(a, meta, seq=7, step=42, time=1234.5, flags=1)
    assert data[0:4] == b"SPTF" and data[4] == 1 and data[5] == 1 and data[6] == 2 and data[7] == 1
    meta_len, reserved = struct.unpack_from("<II", data, 8)
    assert reserved == 0
    assert struct.unpack_from("<Q", data, 16) == (7,)
    assert struct.unpack_from("<q", data, 24) == (42,)
    assert struct.unpack_from("<d", data, 32) == (1234.5,)
    assert struct.unpack_from("<2I", data, 40) == (2, 3)
    assert json.loads(data[48:48 + meta_len]) == meta
    start = 48 + meta_len + (-(48 + meta_len) % 8)
    assert start % 8 == 0 and set(data[48 + meta_len:start]) <= {0}
    assert data[start:] == a.astype("<f8").tobytes() and len(data) == start + 48


@settings(max_examples=60, deadline=None)
@given(array=st.sampled_from(DTYPES).flatmap(lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=4,
                                                                                          max_side=5))),
       seq=st.integers(0, 2**64 - 1), step=st.integers(-1, 2**63 - 1),
       time=st.floats(allow_nan=False, allow_infinity=False),
       meta=st.dictionaries(st.text(max_size=8), st.one_of(st.integers(-2**53, 2**53), st.text(max_size=8),
                                                           st.none(), st.booleans()), max_size=4))
def test_round_trip(array, seq, step, time, meta):
    frame = tf.decode(tf.encode(array, meta, seq=seq, step=step, time=time))
    assert frame.header.seq == seq and frame.step == step and frame.header.time == time
    assert frame.meta == meta and frame.array.shape == array.shape
    assert frame.array.dtype == np.dtype(array.dtype).newbyteorder("<")
    np.testing.assert_array_equal(frame.array, array)


def test_big_endian_input_is_stored_little_endian():
    a = np.arange(4, dtype=">f4")
    frame = tf.decode(tf.encode(a, {}))
    assert frame.array.dtype == np.dtype("<f4") and frame.array.tolist() == [0, 1, 2, 3]


def test_set_seq_stamps_in_place():
    data = bytearray(tf.encode(np.zeros(2, np.float32), {"a": 1}, seq=0))
    tf.set_seq(data, 99)
    assert tf.decode(bytes(data)).seq == 99


@pytest.mark.parametrize("mutate, message", [
    (lambda d: b"XXXX" + d[4:], "bad magic"),
    (lambda d: d[:4] + b"\x02" + d[5:], "version 2"),
    (lambda d: d[:5] + b"\x09" + d[6:], "unknown dtype code 9"),
    (lambda d: d[:-1], "header says"),
    (lambda d: d + b"\0", "header says"),
    (lambda d: d[:20], "shorter than the 40-byte header"),
    (lambda d: d[:44], "ends inside"),
])
def test_malformed_frames_are_rejected(mutate, message):
    data = tf.encode(np.ones((2, 2), np.float32), {"k": "v"})
    with pytest.raises(tf.FrameError, match=message):
        tf.decode(mutate(data))


def test_unsupported_dtype_is_refused():
    with pytest.raises(tf.FrameError, match="unsupported dtype"):
        tf.encode(np.zeros(2, np.complex64), {})


@settings(max_examples=40, deadline=None)
@given(arrays=st.lists(st.sampled_from(DTYPES).flatmap(
    lambda dt: hnp.arrays(dt, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))), min_size=1, max_size=6),
    names=st.lists(st.text(max_size=9), min_size=6, max_size=6))
def test_a_message_of_several_frames_splits_back_into_them(arrays, names):
    frames = [tf.encode(a, {"name": n}, seq=i, step=i) for i, (a, n) in enumerate(zip(arrays, names))]
    message = tf.join(frames)
    parts = tf.split(message)
    assert [bytes(p) for p in parts] == frames
    base = np.frombuffer(message, np.uint8).ctypes.data
    offsets = [np.frombuffer(p, np.uint8).ctypes.data - base for p in parts]
    assert offsets[0] == 0 and all(o % 8 == 0 for o in offsets)  # every frame starts 8-byte aligned
    for part, a in zip(parts, arrays):
        np.testing.assert_array_equal(tf.decode(part).array, a)


@pytest.mark.parametrize("cut, message", [(lambda m: m[:-3], "needs"), (lambda m: m + b"\0" * 20, "shorter"),
                                         (lambda m: m + b"Z" * 48, "no frame at offset")])
def test_a_damaged_message_does_not_split(cut, message):
    joined = tf.join([tf.encode(np.ones(3, np.float32), {"a": 1}), tf.encode(np.ones(2, np.int64), {})])
    with pytest.raises(tf.FrameError, match=message):
        tf.split(cut(joined))
