"""Issue 36, items 1 and 11: the code cache is checked on every use, down to each file
(folders made 0700 whatever the umask; a folder or file another user made or can
write is never read; one warning per process), and the import path's errors are
clean: a refused import shows the user's import line, not our internals; a
SOURCE_PATCH naming no spec says so; an oversized spec fails at once, naming its line.

The cross-user cases plant files as uid 65534 (nobody) in a forked child where the
tests run as root; otherwise they are skipped and the mode checks stand in."""

from __future__ import annotations

import marshal
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from zlib import crc32

import pytest

from source_patch.patcher import SpecError, boot, cli, patched
from source_patch.patcher import spec as spec_mod
from source_patch.patcher.cache import MAGIC, CodeCache
from test_cache import SPEC  # the one-patch spec both cache test files use

NOBODY = 65534
ROOT = hasattr(os, "getuid") and os.getuid() == 0
needs_root = pytest.mark.skipif(not ROOT, reason="planting files as another uid needs root")
WARNING = "not using the code cache"



@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    """The untrusted-cache warning is once per process: each test starts afresh."""
    monkeypatch.setattr(boot, "_REFUSED", set(), raising=False)


@pytest.fixture
def shared():
    """A folder another uid can reach (tmp_path's parents are private to root)."""
    folder = Path(tempfile.mkdtemp(prefix="sp-hardening-"))
    os.chmod(folder, 0o755)
    yield folder
    shutil.rmtree(folder)


def as_nobody(fn) -> None:
    """Run ``fn()`` in a forked child as uid/gid 65534; fail the test if it raises."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the planting child failed (its traceback is above)"


def planted(k: bytes, marker: Path) -> bytes:
    """A valid cache entry under key ``k`` whose code creates ``marker`` (and breaks add)."""
    code = compile(f"open({str(marker)!r}, 'w').close()\ndef add(a, b):\n    return -1\n", "<planted>", "exec")
    payload = marshal.dumps(code)
    return MAGIC + k + len(payload).to_bytes(8, "little") + crc32(payload).to_bytes(4, "little") + payload


def import_add(spec, cache_dir) -> int:
    with patched(spec, cache_dir=cache_dir):
        from spfix import basic
        return basic.add(1, 2)


def refusals(caught) -> list[str]:
    return [str(w.message) for w in caught if WARNING in str(w.message)]


def tree_modes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): oct(p.stat().st_mode & 0o777) for p in [root, *root.rglob("*")]}


# --------------------------------------------------------------------------- 1. the code cache


def test_every_cache_folder_and_file_is_private_whatever_the_umask(write_spec, tmp_path, monkeypatch):
    """Under umask 000 the subfolders (stat/, specs/, requires/, boot/) were 0777."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("SOURCE_PATCH_CACHE", str(cache))  # compiled specs and boot records there too
    spec = write_spec(SPEC)
    old = os.umask(0)
    try:
        assert import_add(spec, cache) == 300
        proc = subprocess.run([sys.executable, "-c", "import spfix.basic as b; print(b.add(1, 2))"],
                              env={**os.environ, "SOURCE_PATCH": str(spec)}, capture_output=True, text=True,
                              timeout=120)
    finally:
        os.umask(old)
    assert proc.stdout.strip() == "300", proc.stderr
    modes = tree_modes(cache)
    assert {"stat", "specs", "boot"} <= set(modes), modes
    for name, mode in modes.items():
        assert mode == ("0o700" if (cache / name).is_dir() else "0o600"), (name, mode)
    assert not [n for n in modes if ".tmp-" in n or n.endswith(".lock")]


@needs_root
def test_another_users_entry_in_a_writable_subfolder_never_runs(write_spec, shared):
    """The attack of the issue: top folder 0755, stat/ world-writable (as an older
    version made it under umask 000); another uid swaps a stat entry's folder for its own
    holding a valid entry.  The import is served by our own entry instead, with one warning."""
    spec, cache, marker = write_spec(SPEC), shared / "cache", shared / "ran"
    assert import_add(spec, cache) == 300
    (entry,) = [p for p in cache.rglob("*.spc") if p.parts[-3] != "stat"]
    (by_stat,) = (cache / "stat").rglob("*.spc")
    kept = entry.read_bytes()
    os.chmod(cache, 0o755)
    os.chmod(cache / "stat", 0o777)

    def plant():
        folder = by_stat.parent
        folder.rename(folder.with_name("moved"))
        folder.mkdir()
        folder.joinpath(by_stat.name).write_bytes(planted(bytes.fromhex(by_stat.stem), marker))

    as_nobody(plant)
    assert by_stat.stat().st_uid == NOBODY
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert import_add(spec, cache) == 300  # patched: from our own content entry
        assert import_add(spec, cache) == 300
    assert not marker.exists()
    (message,) = refusals(caught)  # once, though every read was refused
    assert "its folder stat is writable by group or others (mode 777)" in message
    assert entry.read_bytes() == kept  # nothing of ours lost or rewritten


@needs_root
def test_a_planted_file_in_a_private_folder_is_not_read(write_spec, shared):
    """Each file is checked too: an entry owned by another uid is refused."""
    spec, cache, marker = write_spec(SPEC), shared / "cache", shared / "ran"
    assert import_add(spec, cache) == 300
    (by_stat,) = (cache / "stat").rglob("*.spc")
    for folder in (cache, cache / "stat"):
        os.chmod(folder, 0o755)
    os.chmod(by_stat.parent, 0o777)

    def plant():
        by_stat.unlink()
        by_stat.write_bytes(planted(bytes.fromhex(by_stat.stem), marker))

    as_nobody(plant)
    os.chmod(by_stat.parent, 0o755)  # its folder is safe again; the file is still theirs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert import_add(spec, cache) == 300
    assert not marker.exists()
    (message,) = refusals(caught)
    assert f"its file stat/{by_stat.parent.name}/{by_stat.name} is owned by uid {NOBODY}" in message


@pytest.mark.parametrize("who", ["mode", pytest.param("uid", marks=needs_root)])
def test_a_folder_made_after_the_first_look_is_checked_at_each_read(shared, who):
    """The trust decision was taken once per CodeCache: a cache folder absent at the
    first read and made later by another user was trusted, and its entry returned."""
    cache_dir, marker = shared / "late", shared / "ran"
    cache, k = CodeCache(cache_dir), bytes(range(32))
    assert cache.get(k) is None  # absent: a plain miss, no warning

    def plant():
        entry = cache.path(k)
        entry.parent.mkdir(parents=True)
        entry.write_bytes(planted(k, marker))

    if who == "uid":
        os.chmod(shared, 0o777)
        as_nobody(plant)
        assert cache_dir.stat().st_uid == NOBODY
    else:
        plant()
        os.chmod(cache_dir, 0o775)  # group-writable: another user could have written it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.get(k) is None and cache.get(k) is None
        assert cache.put(bytes(32), compile("", "x", "exec")) is False  # nor written
    assert len(refusals(caught)) == 1
    assert not marker.exists() and cache.path(k).exists()  # not run, and not removed


def test_a_symlinked_subfolder_is_not_followed(tmp_path, recwarn):
    cache_dir, elsewhere = tmp_path / "cache", tmp_path / "elsewhere"
    cache, k = CodeCache(cache_dir), bytes(range(32))
    entry = cache.path(k)
    (elsewhere / entry.parent.name).mkdir(parents=True, mode=0o700)
    (elsewhere / entry.parent.name / entry.name).write_bytes(planted(k, tmp_path / "ran"))
    cache_dir.mkdir(mode=0o700)
    entry.parent.symlink_to(elsewhere / entry.parent.name)
    assert cache.get(k) is None
    (message,) = refusals(recwarn)
    assert f"its folder {entry.parent.name} is a symbolic link" in message


def test_the_untrusted_warning_prints_once_per_process(write_spec, tmp_path):
    """It printed twice (the compiled-spec cache and the finder's each warned)."""
    spec, cache = write_spec(SPEC), tmp_path / "open"
    cache.mkdir()
    os.chmod(cache, 0o777)
    code = "import spfix.basic as b, spfix.notpatched; print(b.add(1, 2))"
    proc = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True,
                          env={**os.environ, "SOURCE_PATCH": str(spec), "SOURCE_PATCH_CACHE": str(cache)},
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "300", proc.stderr
    assert proc.stderr.count(WARNING) == 1, proc.stderr
    assert list(cache.iterdir()) == []  # nothing written there for others to swap


@needs_root
def test_a_planted_boot_record_cannot_turn_patching_off(write_spec, shared, monkeypatch):
    """A boot record decides which imports hand over to the patcher: one with no
    targets, planted by another uid in a writable boot/ folder, would run the job
    unpatched.  It is not read: the full start-up runs and patches."""
    cache = shared / "cache"
    monkeypatch.setenv("SOURCE_PATCH_CACHE", str(cache))
    spec = write_spec(SPEC)
    env = {**os.environ, "SOURCE_PATCH": str(spec)}
    code = "import sys; first = type(sys.meta_path[0]).__name__; import spfix.basic as b; print(first, b.add(1, 2))"

    def start():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)

    assert start().stdout.split() == ["PatchFinder", "300"]
    (record,) = (cache / "boot").glob("*.spb")
    assert start().stdout.split() == ["BootFinder", "300"]  # the record is used
    forged = boot._load(str(record))
    forged.update(targets=(), found=())
    os.chmod(cache, 0o755)
    os.chmod(cache / "boot", 0o777)

    def plant():
        record.rename(record.with_suffix(".old"))
        record.write_bytes(boot.MAGIC + marshal.dumps(forged))

    as_nobody(plant)
    proc = start()
    assert proc.stdout.split() == ["PatchFinder", "300"], proc.stderr  # patched all the same
    assert proc.stderr.count(WARNING) == 1 and "its folder boot is writable by group or others" in proc.stderr


# --------------------------------------------------------------------------- 11. the import path

BROKEN = ("source_patch: 1\nname: b\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
          "    edits:\n      - at: entrance\n        code: pass\n")
PROGRAM = "import json\nprint('stdlib ok', flush=True)\nimport spfix.basic\nprint('ran')\n"


def run(source_patch: str | None, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("SOURCE_PATCH", "SOURCE_PATCH_ON_ERROR")}
    if source_patch is not None:
        environ["SOURCE_PATCH"] = source_patch
    return subprocess.run([sys.executable, "-c", PROGRAM], env={**environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_a_refused_import_shows_the_users_import_line_not_our_frames(write_spec):
    proc = run(str(write_spec(BROKEN, "broken.yaml")))
    assert proc.returncode == 1 and "stdlib ok" in proc.stdout and "ran" not in proc.stdout
    startup, _, rest = proc.stderr.partition("Traceback (most recent call last):\n")
    assert startup.startswith("source-patch: error: ") and "unknown anchor 'entrance'" in startup
    frames = [line for line in rest.splitlines() if line.startswith("  File ")]
    assert frames == ['  File "<string>", line 3, in <module>'], proc.stderr
    assert "importlib" not in rest and "activation.py" not in rest
    assert "NotActivatedError: source-patch: SOURCE_PATCH could not be activated, so importing spfix" in rest
    assert "During handling" not in rest


@pytest.mark.parametrize("value", [",,,", " , ", os.pathsep * 2])
def test_a_source_patch_naming_no_spec_says_so(value):
    """It was silent: a value built from empty variables ran unpatched without a word."""
    proc = run(value)
    assert proc.returncode == 0 and "ran" in proc.stdout
    assert proc.stderr == (f"source-patch: warning: SOURCE_PATCH={value!r} names no spec file, so nothing is "
                           "patched (set it empty or unset it to silence this)\n")


def test_an_empty_source_patch_stays_silent():
    proc = run("")
    assert proc.returncode == 0 and "ran" in proc.stdout and proc.stderr == ""


def many_patches(n: int) -> str:
    return "source_patch: 1\nname: big\npatches:\n" + "".join(
        f"  - id: p{i}\n    module: spfix.basic\n    target: add\n    edits:\n      - {{at: entry, code: pass}}\n"
        for i in range(n))


def one_code_block(lines: int) -> str:
    return ("source_patch: 1\nname: big\npatches:\n  - id: p\n    module: spfix.basic\n    target: add\n"
            "    edits:\n      - at: entry\n        code: |\n" + "".join(f"          x = {i}\n" for i in range(lines)))


@pytest.mark.parametrize("text, line, message", [
    (many_patches(1001), 4 + 1000 * 5 + 4, "patches[1000].edits[0]: too many edits: more than 1,000 in one spec"),
    (one_code_block(6000), 9, "patches[0].edits[0].code: too much inserted code: more than 20,000 Python syntax "
                              "nodes in this spec's code and wrap fields"),
    # 14 YAML nodes a patch: the 50,001st is the last value of patch 3570
    (many_patches(5000), 4 + 3570 * 5 + 4, "too large: more than 50,000 YAML nodes"),
])
def test_an_oversized_spec_fails_at_once_naming_its_line(write_spec, capsys, text, line, message):
    """They were valid: a 5 MB code block took over 240 s in `check`, 20,000 patches 40.7 s."""
    path = write_spec(text, "big.yaml")
    start = time.monotonic()
    with pytest.raises(SpecError) as info:
        spec_mod.load(path)
    assert time.monotonic() - start < 10
    assert info.value.location.line == line and message in str(info.value), str(info.value)
    assert str(info.value).startswith(f"{path}:{line}:")
    assert cli.main(["check", str(path)]) == 2  # a bad spec, not a broken anchor (1)
    assert capsys.readouterr().err == f"source-patch: error: {info.value}\n"


def test_a_spec_at_the_limits_still_loads(write_spec):
    spec = spec_mod.load(write_spec(many_patches(1000), "edits.yaml"))
    assert len(spec.patches) == 1000
    spec = spec_mod.load(write_spec(one_code_block(4999), "code.yaml"))  # 4 nodes a line, 1 module
    assert spec.patches[0].edits[0].code.count("\n") == 4999


def test_an_aliased_edit_list_counts_at_each_use(write_spec):
    """YAML aliases repeat a list without repeating its nodes: the edits still count."""
    edits = "".join("      - {at: entry, code: pass}\n" for _ in range(100))
    text = "source_patch: 1\nname: alias\npatches:\n" + "".join(
        f"  - id: p{i}\n    module: spfix.basic\n    target: add\n    edits: " + ("&e\n" + edits if i == 0 else "*e\n")
        for i in range(11))  # 1,100 edits from ~600 YAML nodes
    with pytest.raises(SpecError, match="too many edits: more than 1,000 in one spec"):
        spec_mod.load(write_spec(text, "alias.yaml"))


def test_the_start_up_record_reader_agrees_with_the_spec_limit():
    assert boot.MAX_SPEC_BYTES == spec_mod.MAX_SPEC_BYTES == 8 << 20
