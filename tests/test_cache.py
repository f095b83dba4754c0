"""The compiled-code cache: hits, misses, corruption, races, and no libcst on a hit."""

import os
import subprocess
import sys
from pathlib import Path

from source_patch.patcher import patched
from source_patch.patcher.cache import MAGIC, CodeCache

SPEC = """
source_patch: 1
name: c
patches:
  - id: p
    module: spfix.basic
    target: add
    edits:
      - {at: return, code: "result = result * 100"}
"""


def entries(cache_dir: Path) -> list[Path]:
    return sorted(cache_dir.rglob("*.spc"))


def import_add(spec, cache_dir):
    with patched(spec, cache_dir=cache_dir):
        from spfix import basic
        return basic.add(1, 2)


def test_miss_then_hit(write_spec, tmp_path):
    spec, cache_dir = write_spec(SPEC), tmp_path / "cache"
    assert import_add(spec, cache_dir) == 300
    (entry,) = entries(cache_dir)
    stamp = entry.stat().st_mtime_ns
    assert import_add(spec, cache_dir) == 300
    assert entries(cache_dir) == [entry] and entry.stat().st_mtime_ns == stamp


def test_a_different_spec_slice_is_a_different_entry(write_spec, tmp_path):
    cache_dir = tmp_path / "cache"
    assert import_add(write_spec(SPEC), cache_dir) == 300
    assert import_add(write_spec(SPEC.replace("100", "7")), cache_dir) == 21
    assert len(entries(cache_dir)) == 2


def test_corrupt_short_or_foreign_files_are_misses(write_spec, tmp_path):
    spec, cache_dir = write_spec(SPEC), tmp_path / "cache"
    import_add(spec, cache_dir)
    (entry,) = entries(cache_dir)
    good = entry.read_bytes()
    for bad in (b"", good[:10], good[:-5], good[:-1] + bytes([good[-1] ^ 1]),
                MAGIC + os.urandom(200), b"\x00" * len(good)):
        entry.write_bytes(bad)
        assert import_add(spec, cache_dir) == 300
        assert entry.read_bytes() == good  # rewritten


def test_unwritable_cache_still_patches(write_spec, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert import_add(write_spec(SPEC), blocker / "cache") == 300
    assert CodeCache(blocker / "cache").put(b"k" * 32, compile("1", "f", "eval")) is False


def test_a_hit_does_not_import_libcst(write_spec, tmp_path):
    spec, cache_dir = write_spec(SPEC), tmp_path / "cache"
    code = ("import sys, spfix.basic as b; assert b.add(1, 2) == 300; "
            "print('libcst' in sys.modules)")
    env = {**os.environ, "SOURCE_PATCH": str(spec), "SOURCE_PATCH_CACHE": str(cache_dir)}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, text=True, capture_output=True,
                           timeout=60) for _ in range(2)]
    assert [r.stdout.strip() for r in runs] == ["True", "False"], [r.stderr for r in runs]
