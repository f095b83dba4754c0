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


# ---------------------------------------------------------------- trust and cold start


def test_a_cache_others_can_write_is_not_used(write_spec, tmp_path, recwarn):
    spec = write_spec(SPEC)
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    assert import_add(spec, shared) == 300  # still patched: parsed, not loaded
    assert entries(shared) == []  # and nothing written there for others to swap
    assert any("writable by group or others (mode 777)" in str(w.message) for w in recwarn)


def test_a_new_cache_is_private(write_spec, tmp_path):
    spec = write_spec(SPEC)
    cache = tmp_path / "fresh" / "cache"
    assert import_add(spec, cache) == 300
    (entry,) = entries(cache)
    assert oct(entry.stat().st_mode & 0o777) == "0o600"
    assert oct(cache.stat().st_mode & 0o777) == "0o700" and oct(entry.parent.stat().st_mode & 0o777) == "0o700"
    assert not list(cache.rglob("*.lock"))


def test_the_key_covers_the_patchers_source_contents(tmp_path, monkeypatch):
    """Same sizes and times (a reproducible rebuild) but other contents: another key."""
    from source_patch.patcher import cache as cache_mod

    copy = tmp_path / "patcher"
    copy.mkdir()
    original = Path(cache_mod.__file__).parent
    for f in original.glob("*.py"):
        (copy / f.name).write_bytes(f.read_bytes())
        os.utime(copy / f.name, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns))
    monkeypatch.setattr(cache_mod, "__file__", str(copy / "cache.py"))
    cache_mod._tool_versions.cache_clear()
    before = cache_mod._tool_versions()
    edited = copy / "engine.py"
    stamp = edited.stat()
    text = edited.read_bytes()
    edited.write_bytes(text.replace(b"a", b"b", 1))  # one byte: same size
    os.utime(edited, ns=(stamp.st_atime_ns, stamp.st_mtime_ns))
    cache_mod._tool_versions.cache_clear()
    try:
        assert cache_mod._tool_versions() != before
    finally:
        cache_mod._tool_versions.cache_clear()


def test_a_dead_lock_holder_does_not_block(tmp_path):
    """A process that dies holding a key's lock releases it with its life (flock)."""
    cache = CodeCache(tmp_path / "c")
    k = bytes(32)
    cache._mkdir(cache.path(k).parent)
    lock = cache.path(k).with_suffix(".lock")
    holder = subprocess.Popen([sys.executable, "-c", f"import fcntl, os, time; f = open({str(lock)!r}, 'a'); "
                               "fcntl.flock(f, fcntl.LOCK_EX); print('held', flush=True); time.sleep(60)"],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    holder.wait()
    import time

    start = time.monotonic()
    with cache.lock(k):
        waited = time.monotonic() - start
    assert waited < 2


def test_a_spec_read_before_is_rebuilt_without_yaml(tmp_path):
    """The compiled-spec cache: the second interpreter gets an equal Spec and never
    imports PyYAML or packaging (what start-up with SOURCE_PATCH set pays)."""
    import os
    import subprocess
    import sys

    code = ("import sys; from source_patch.patcher import spec; s = spec.load('moe'); "
            "print(len(s.patches), s.patches[0].location, 'yaml' in sys.modules, 'packaging' in sys.modules, "
            "sep='|')")
    env = {**os.environ, "SOURCE_PATCH_CACHE": str(tmp_path / "cache")}
    cold, warm = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                 timeout=60).stdout.strip().split("|") for _ in range(2))
    assert cold[:2] == warm[:2] and cold[2] == "True"
    assert warm[2:] == ["False", "False"]
