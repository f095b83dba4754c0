"""The compiled-code cache: hits, misses, corruption, races, and no libcst on a hit."""

import importlib
import marshal
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from source_patch.patcher import cache as cache_mod
from source_patch.patcher import finder as finder_mod
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


def entries(cache_dir: Path, kind: str = "") -> list[Path]:
    """Code entries by content key (kind ""), or those of ``kind`` ("stat", "requires")."""
    if kind:
        return sorted((cache_dir / kind).rglob("*.spc"))
    return sorted(p for p in cache_dir.rglob("*.spc")
                  if not {"specs", "stat", "requires"} & set(p.relative_to(cache_dir).parts))


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
    (by_stat,) = entries(cache_dir, "stat")  # the fixture's source is settled: keyed by stat too
    good, good_stat = entry.read_bytes(), by_stat.read_bytes()
    assert good_stat[36:] == good[36:]  # the same checked payload under another key
    for bad in (b"", good[:10], good[:-5], good[:-1] + bytes([good[-1] ^ 1]),
                good[:60] + bytes([good[60] ^ 0x10]) + good[61:],  # a flipped bit inside
                MAGIC + os.urandom(200), b"\x00" * len(good)):
        by_stat.unlink()  # else the stat entry answers without looking at this one
        entry.write_bytes(bad)
        assert import_add(spec, cache_dir) == 300
        assert entry.read_bytes() == good  # rewritten
        assert by_stat.read_bytes() == good_stat
        # The same damage to the stat entry: rejected, then rewritten from the content entry.
        by_stat.write_bytes(bad[:4] + good_stat[4:36] + bad[36:] if len(bad) > 36 else bad)
        assert import_add(spec, cache_dir) == 300
        assert by_stat.read_bytes() == good_stat


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

    code = ("import sys; from source_patch.patcher import spec; s = spec.load('routing'); "
            "print(len(s.patches), s.patches[0].location, 'yaml' in sys.modules, 'packaging' in sys.modules, "
            "sep='|')")
    env = {**os.environ, "SOURCE_PATCH_CACHE": str(tmp_path / "cache")}
    cold, warm = (subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                                 timeout=60).stdout.strip().split("|") for _ in range(2))
    assert cold[:2] == warm[:2] and cold[2] == "True"
    assert warm[2:] == ["False", "False"]


# ---------------------------------------------------------------- stat keys (warm imports read no source)

MODULE = """
def add(a, b):
    return a + b
"""

MODULE_SPEC = """
source_patch: 1
name: s
patches:
  - id: p
    module: {module}
    target: add
    edits:
      - {{at: return, code: "result = result * 100"}}
"""


@pytest.fixture
def module(tmp_path, monkeypatch, request):
    """A fresh top-level module in its own sys.path entry: (name, its file, a spec patching it)."""
    site = tmp_path / "site"
    site.mkdir()
    name = "spstat_" + "".join(c if c.isalnum() else "_" for c in request.node.name)
    source = site / f"{name}.py"
    source.write_text(MODULE)
    monkeypatch.syspath_prepend(str(site))
    spec = tmp_path / "module_spec.yaml"
    spec.write_text(MODULE_SPEC.format(module=name))
    yield name, source, spec
    sys.modules.pop(name, None)


@pytest.fixture
def no_race_window(monkeypatch):
    """Stat-key a file as soon as it is written (normally: once it is 2 s old)."""
    monkeypatch.setattr(cache_mod, "RACY_NS", 0)


def call_add(name, spec, cache_dir):
    with patched(spec, cache_dir=cache_dir):
        return importlib.import_module(name).add(1, 2)


class Reads:
    """Counts reads of target sources (PatchingLoader.get_data) and rewrites."""

    def __init__(self, monkeypatch):
        self.reads = self.rewrites = 0
        original_read, original_rewrite = finder_mod.PatchingLoader.get_data, finder_mod.patch_source

        def read(loader, path):
            self.reads += 1
            return original_read(loader, path)

        def rewrite(*args, **kwargs):
            self.rewrites += 1
            return original_rewrite(*args, **kwargs)

        monkeypatch.setattr(finder_mod.PatchingLoader, "get_data", read)
        monkeypatch.setattr(finder_mod, "patch_source", rewrite)


def test_a_warm_import_reads_no_source(module, tmp_path, monkeypatch, no_race_window):
    name, source, spec = module
    counts, cache_dir = Reads(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (1, 1)
    assert len(entries(cache_dir)) == 1 and len(entries(cache_dir, "stat")) == 1
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (1, 1)  # served by the stat key alone


def test_a_touched_unchanged_source_hits_by_content(module, tmp_path, monkeypatch, no_race_window):
    name, source, spec = module
    counts, cache_dir = Reads(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    st = source.stat()
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))  # another signature
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (2, 1)  # read and hashed, not rewritten
    assert len(entries(cache_dir)) == 1 and len(entries(cache_dir, "stat")) == 2  # remembered
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (2, 1)


def test_a_changed_source_with_the_same_size_and_mtime_misses(module, tmp_path, monkeypatch,
                                                              no_race_window):
    """What a timestamp pyc would miss: the ctime in the signature changes anyway."""
    name, source, spec = module
    counts, cache_dir = Reads(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    st = source.stat()
    time.sleep(0.05)  # past the file system's timestamp granularity
    source.write_text(MODULE.replace("a + b", "a - b"))
    os.utime(source, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (source.stat().st_size, source.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert call_add(name, spec, cache_dir) == -100
    assert counts.rewrites == 2


def test_a_young_source_is_not_stat_keyed(module, tmp_path, monkeypatch):
    """Within RACY_NS of a change, a rewrite in the same clock tick could keep the
    signature: such a file is looked up by content only, every time."""
    name, source, spec = module
    counts, cache_dir = Reads(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (2, 1)
    assert entries(cache_dir, "stat") == [] and len(entries(cache_dir)) == 1
    source.write_text(MODULE.replace("a + b", "a - b"))  # size kept; at once
    assert call_add(name, spec, cache_dir) == -100


def test_content_checks_opt_out_of_stat_keys(module, tmp_path, monkeypatch, no_race_window):
    name, source, spec = module
    monkeypatch.setenv("SOURCE_PATCH_CACHE_CHECK", "content")
    counts, cache_dir = Reads(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert call_add(name, spec, cache_dir) == 300
    assert (counts.reads, counts.rewrites) == (2, 1)  # every import reads and hashes
    assert entries(cache_dir, "stat") == [] and len(entries(cache_dir)) == 1


def test_a_stat_entry_is_checked_like_any_entry(module, tmp_path, monkeypatch, no_race_window):
    """A stat entry whose payload was altered into other well-formed code of the same
    length is refused (the CRC covers the payload), as is one stored under another key."""
    name, source, spec = module
    cache_dir = tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    (by_stat,) = entries(cache_dir, "stat")
    blob = by_stat.read_bytes()
    altered = blob[:48] + blob[48:].replace(b"add", b"bdd")  # defines bdd, not add
    assert altered != blob and isinstance(marshal.loads(altered[48:]), type(compile("", "", "exec")))
    by_stat.write_bytes(altered)
    assert call_add(name, spec, cache_dir) == 300
    assert by_stat.read_bytes() == blob  # rewritten
    by_stat.write_bytes(blob[:4] + bytes(32) + blob[36:])  # another key
    assert call_add(name, spec, cache_dir) == 300
    assert by_stat.read_bytes() == blob


def test_the_stat_key_covers_the_signature_and_the_slice(tmp_path):
    sig = (1, 2, 3, 4, 5)
    k = cache_mod.stat_key(sig, b"d", "/f.py")
    assert len(k) == 32
    others = {cache_mod.stat_key(sig[:i] + (sig[i] + 1,) + sig[i + 1:], b"d", "/f.py") for i in range(5)}
    others |= {cache_mod.stat_key(sig, b"e", "/f.py"), cache_mod.stat_key(sig, b"d", "/g.py")}
    assert k not in others and len(others) == 7
    assert cache_mod.settled((0, 0, 0, 10, 20), now_ns=20 + cache_mod.RACY_NS)
    assert not cache_mod.settled((0, 0, 0, 10, 20), now_ns=19 + cache_mod.RACY_NS)
    assert not cache_mod.settled((0, 0, 0, 30, 20), now_ns=29 + cache_mod.RACY_NS)  # mtime ahead of ctime


# ---------------------------------------------------------------- `requires` verdicts, remembered


REQ_SPEC = MODULE_SPEC.replace("name: s\n", 'name: r\nrequires:\n  fakedist: ">=1.0"\non_unmet: skip\n')


@pytest.fixture
def gated(module, tmp_path):
    """The module, a ``fakedist`` 1.0 installed beside it, and a spec requiring fakedist>=1.0."""
    name, source, _ = module
    info = source.parent / "fakedist-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 1.0\n\n")
    spec = tmp_path / "req_spec.yaml"
    spec.write_text(REQ_SPEC.format(module=name))
    return name, source, spec, info


class Judged:
    def __init__(self, monkeypatch):
        self.calls = 0
        original = finder_mod.judge

        def judge(*args):
            self.calls += 1
            return original(*args)

        monkeypatch.setattr(finder_mod, "judge", judge)


def test_a_requires_verdict_is_remembered(gated, tmp_path, monkeypatch, no_race_window):
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert judged.calls == 1 and len(entries(cache_dir, "requires")) == 1
    assert call_add(name, spec, cache_dir) == 300  # a new finder: the verdict comes from the cache
    assert judged.calls == 1


def test_a_remembered_verdict_follows_the_metadata(gated, tmp_path, monkeypatch, no_race_window, recwarn):
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    time.sleep(0.05)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 0.5\n\n")
    assert call_add(name, spec, cache_dir) == 3  # skipped: found 0.5
    assert judged.calls == 2
    assert any("found 0.5" in str(w.message) for w in recwarn)


def test_a_remembered_verdict_follows_the_site_directory(gated, tmp_path, monkeypatch, no_race_window,
                                                         recwarn):
    """Upgrading replaces the dist-info folder (the directory changes); uninstalling removes it."""
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    time.sleep(0.05)
    newer = info.parent / "fakedist-0.9.dist-info"
    info.rename(newer)
    (newer / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 0.9\n\n")
    assert call_add(name, spec, cache_dir) == 3
    assert judged.calls == 2
    time.sleep(0.05)
    (newer / "METADATA").unlink()
    newer.rmdir()
    assert call_add(name, spec, cache_dir) == 3
    assert judged.calls == 3
    assert any("which is not installed" in str(w.message) for w in recwarn)


def damaged(good: bytes) -> tuple:
    """A cache entry emptied, truncated, and with its last bit flipped."""
    return b"", good[:-3], good[:-1] + bytes([good[-1] ^ 1])


def test_a_corrupt_verdict_is_judged_again(gated, tmp_path, monkeypatch, no_race_window):
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    (memo,) = entries(cache_dir, "requires")
    good = memo.read_bytes()
    for bad in damaged(good):
        memo.write_bytes(bad)
        for entry in entries(cache_dir, "stat"):  # which carries the verdict too
            entry.unlink()
        assert call_add(name, spec, cache_dir) == 300
        assert memo.read_bytes() == good
    assert judged.calls == 4


class KindReads:
    """Counts CodeCache.read calls per kind ("", "specs", "stat", "requires")."""

    def __init__(self, monkeypatch):
        self.kinds = []
        original = CodeCache.read

        def read(cache, k, kind=""):
            self.kinds.append(kind)
            return original(cache, k, kind)

        monkeypatch.setattr(CodeCache, "read", read)


def test_a_warm_import_reads_its_verdict_from_the_stat_entry(gated, tmp_path, monkeypatch, no_race_window):
    """One read for code and verdict: the stat entry carries the verdicts that decided it."""
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    reads = KindReads(monkeypatch)
    assert call_add(name, spec, cache_dir) == 300
    assert judged.calls == 1 and [k for k in reads.kinds if k != "specs"] == ["stat"]


def test_a_corrupt_stat_entry_with_a_verdict_falls_back(gated, tmp_path, monkeypatch, no_race_window):
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    (by_stat,) = entries(cache_dir, "stat")
    good = by_stat.read_bytes()
    for bad in damaged(good):
        by_stat.write_bytes(bad)
        assert call_add(name, spec, cache_dir) == 300  # the verdict from requires/, the code by content
        reads = KindReads(monkeypatch)
        assert call_add(name, spec, cache_dir) == 300
        assert [k for k in reads.kinds if k != "specs"] == ["stat"]  # written again, whole
    assert judged.calls == 1


TWO_PATCHES = """
source_patch: 1.1
name: two
patches:
  - id: newer
    module: {module}
    target: add
    requires: {{fakedist: ">=2"}}
    edits:
      - {{at: return, code: "result = result + 1"}}
  - id: older
    module: {module}
    target: add
    requires: {{fakedist: "<2"}}
    edits:
      - {{at: return, code: "result = result * 100"}}
"""


def test_a_skipped_patch_is_remembered_in_the_stat_entry(gated, tmp_path, monkeypatch, no_race_window):
    """Version-gated variants of one target: the stat entry says which applied, with
    the verdicts that decided it; a change of version decides again."""
    name, source, _, info = gated
    spec = tmp_path / "two.yaml"
    spec.write_text(TWO_PATCHES.format(module=name))
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert judged.calls == 2
    reads = KindReads(monkeypatch)
    assert call_add(name, spec, cache_dir) == 300
    assert judged.calls == 2 and [k for k in reads.kinds if k != "specs"] == ["stat"]
    time.sleep(0.05)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakedist\nVersion: 2.0\n\n")
    assert call_add(name, spec, cache_dir) == 4  # now the other patch
    assert judged.calls == 4
    assert call_add(name, spec, cache_dir) == 4
    assert judged.calls == 4


def test_a_young_site_directory_is_not_remembered(gated, tmp_path, monkeypatch):
    name, source, spec, info = gated
    judged, cache_dir = Judged(monkeypatch), tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert call_add(name, spec, cache_dir) == 300
    assert judged.calls == 2 and entries(cache_dir, "requires") == []


def test_content_checks_opt_out_of_remembered_verdicts(gated, tmp_path, monkeypatch, no_race_window):
    name, source, spec, info = gated
    monkeypatch.setenv("SOURCE_PATCH_CACHE_CHECK", "content")
    cache_dir = tmp_path / "cache"
    assert call_add(name, spec, cache_dir) == 300
    assert entries(cache_dir, "requires") == []


def test_a_loaded_spec_is_named_by_its_cache_key(write_spec):
    """Stat entries of a loaded spec's patches are keyed by the spec's cache key (its
    text, file and the tool); a spec made from it otherwise is another, unnamed spec."""
    import dataclasses

    from source_patch.patcher.spec import load

    spec = load(write_spec(SPEC))
    assert len(spec.cache_key) == 32 and load(write_spec(SPEC.replace("100", "7"))).cache_key != spec.cache_key
    other = dataclasses.replace(spec, description="x")
    assert not hasattr(other, "cache_key")


def test_the_stat_keys_patch_part_covers_the_slice_digest(write_spec):
    """Every field that changes spec.slice_digest (the content key's) changes
    finder.slice_parts (the stat key's), for Patch, Edit and Location alike."""
    import dataclasses

    from source_patch.patcher.cache import slice_digest
    from source_patch.patcher.spec import load

    patch = load(write_spec(SPEC)).patches[0]

    def variants(obj):
        for f in dataclasses.fields(obj):
            value = getattr(obj, f.name)
            for other in ("x", 7, None, True):
                if type(other) is not type(value) or other == value:
                    continue
                try:
                    yield dataclasses.replace(obj, **{f.name: other})
                except (TypeError, ValueError):
                    pass

    changed = 0
    for p in variants(patch):
        if slice_digest([p]) != slice_digest([patch]):
            changed += 1
            assert finder_mod.slice_parts([p]) != finder_mod.slice_parts([patch]), p
    for e in variants(patch.edits[0]):
        p = dataclasses.replace(patch, edits=(e,) + patch.edits[1:])
        if slice_digest([p]) != slice_digest([patch]):
            changed += 1
            assert finder_mod.slice_parts([p]) != finder_mod.slice_parts([patch]), e
    for loc in variants(patch.location):
        p = dataclasses.replace(patch, location=loc)
        if slice_digest([p]) != slice_digest([patch]):
            changed += 1
            assert finder_mod.slice_parts([p]) != finder_mod.slice_parts([patch]), loc
    assert changed >= 8  # the comparison ran over the fields that matter


def test_the_import_benchs_worker_reimports_real_megatron_modules_patched_and_not(tmp_path):
    """bench/import_bench.py's worker on a warm cache: a hit (no libcst), then re-import
    pairs whose loaders it checks (PatchingLoader with the finder, the .pyc without)."""
    import json

    bench = Path(__file__).parents[1] / "bench" / "import_bench.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH")}
    env["SOURCE_PATCH_CACHE"] = str(tmp_path / "cache")
    results = []
    for mode in ("cold", "warm"):  # the cold run fills the cache
        out = subprocess.run([sys.executable, bench, "--worker", mode, "--repeat", "3"], env=env,
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-2000:]
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    cold, warm = results
    assert cold["miss"] and cold["again"] == []
    assert not warm["miss"] and len(warm["again"]) == 3
    assert all(patched > 0 and plain > 0 for patched, plain in warm["again"])
