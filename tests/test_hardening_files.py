"""Issue 57, items 2 and 3 (and item 5's code-cache lock): every file the runtime writes
goes through core/private.py (an O_EXCL|O_NOFOLLOW temporary file, flushed, renamed; private
folders made 0700 and checked), the trace's native build follows the code cache's trust
rules (a library another user could have written is refused before it is opened for
loading, with one warning, and the trace launches directly), and a FIFO planted at a
name we open never hangs.  The suite runs as root: uid 65534 stands for another user."""

import logging
import os
import re
import shutil
import stat
import subprocess
import threading
import time
from types import SimpleNamespace

import pytest

from source_patch.runtime.core import private
from source_patch.runtime.core.endpoint import write_private_json

OTHER = 65534  # nobody
TOKEN = "s3cret-token"
as_root = pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0,
                             reason="needs root, to make files another user (uid 65534) owns")


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.fixture
def umask():
    """Set the process's umask for the test; restored after."""
    saved = os.umask(0o022)
    os.umask(saved)
    yield os.umask
    os.umask(saved)


def finishes(call, seconds: float = 1.0):
    """``call()``'s outcome (its value or the exception it raised), asserting it came
    within ``seconds``: a call that blocks (on a FIFO) fails the test instead of hanging it."""
    outcome = []

    def run():
        try:
            outcome.append(call())
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            outcome.append(exc)

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds + 4)
    assert outcome, f"still blocked after {seconds + 4} s"
    assert time.monotonic() - start < seconds
    return outcome[0]


def release(fifo) -> None:
    """Open a FIFO's read end and close it: a writer blocked on it (the old code) goes on."""
    try:
        os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    except OSError:
        pass


# ---------------------------------------------------------------- private files (item 3)


def test_links_planted_at_the_temporary_name_or_the_target_are_never_written_through(tmp_path):
    folder = tmp_path / "control"
    folder.mkdir(mode=0o700)
    victim, other_victim = tmp_path / "victim", tmp_path / "other-victim"
    victim.write_text("root's own file")
    other_victim.write_text("another file")
    (folder / ".endpoint.json.tmp").symlink_to(victim)  # the old fixed temporary name
    (folder / "endpoint.json").symlink_to(other_victim)
    write_private_json(folder / "endpoint.json", {"token": TOKEN})
    assert victim.read_text() == "root's own file" and other_victim.read_text() == "another file"
    assert (folder / ".endpoint.json.tmp").is_symlink()  # left as it was
    target = folder / "endpoint.json"
    assert not target.is_symlink() and mode(target) == 0o600  # the link replaced, not followed
    assert TOKEN in target.read_text()
    assert sorted(p.name for p in folder.iterdir()) == [".endpoint.json.tmp", "endpoint.json"]


def test_a_link_at_the_exact_temporary_name_fails_the_write_and_is_not_followed(tmp_path, monkeypatch):
    """Even where the random temporary name is guessed (here: made fixed), the open is
    O_EXCL|O_NOFOLLOW: the write fails, nothing is written through the link."""
    folder = tmp_path / "control"
    folder.mkdir(mode=0o700)
    victim = tmp_path / "victim"
    victim.write_text("root's own file")
    monkeypatch.setattr(os, "urandom", lambda n: b"\0" * n)
    (folder / f".endpoint.json.{'00' * 6}.tmp").symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_private_json(folder / "endpoint.json", {"token": TOKEN})
    assert victim.read_text() == "root's own file"
    assert not (folder / "endpoint.json").exists()


def test_a_temporary_file_created_in_advance_never_receives_the_token(tmp_path, monkeypatch):
    """Another user's file at the temporary name, open on their side: what they read
    after the write is not the token (it used to be truncated, filled and renamed)."""
    folder = tmp_path / "control"
    folder.mkdir(mode=0o700)
    planted = [folder / ".endpoint.json.tmp", folder / f".endpoint.json.{'00' * 6}.tmp"]
    views = []
    for path in planted:
        path.write_text("")
        os.chmod(path, 0o666)
        views.append(open(path, "rb"))  # noqa: SIM115 - the other user's descriptor
    try:
        write_private_json(folder / "endpoint.json", {"token": TOKEN})  # a random name: written
        monkeypatch.setattr(os, "urandom", lambda n: b"\0" * n)
        with pytest.raises(FileExistsError):  # the guessed name: refused, not reused
            write_private_json(folder / "endpoint.json", {"token": TOKEN + "2"})
        assert all(TOKEN not in view.read().decode() for view in views)
    finally:
        for view in views:
            view.close()
    assert TOKEN in (folder / "endpoint.json").read_text() and mode(folder / "endpoint.json") == 0o600


def test_the_private_folder_is_0700_whatever_the_umask(tmp_path, umask):
    umask(0)
    write_private_json(tmp_path / "dump" / "exp" / "control" / "host-p1.json", {"token": TOKEN})
    umask(0o022)
    assert mode(tmp_path / "dump" / "exp" / "control") == 0o700  # the token's folder
    assert mode(tmp_path / "dump" / "exp" / "control" / "host-p1.json") == 0o600


@as_root
@pytest.mark.parametrize("make_unsafe, reason", [
    (lambda p: os.chown(p, OTHER, OTHER), f"owned by uid {OTHER}"),
    (lambda p: os.chmod(p, 0o770), re.escape("writable by group or others (mode 770)")),
], ids=["foreign", "group-writable"])
def test_a_control_folder_another_user_could_write_is_refused(tmp_path, make_unsafe, reason):
    folder = tmp_path / "control"
    folder.mkdir(mode=0o700)
    make_unsafe(folder)
    with pytest.raises(private.Untrusted, match=reason):
        write_private_json(folder / "endpoint.json", {"token": TOKEN})
    assert list(folder.iterdir()) == []


@as_root
def test_the_dump_endpoint_and_the_hub_count_a_refused_folder_in_one_line_and_go_on(tmp_path, caplog):
    """Their writers (server.ControlServer, hub.Hub) on a stand-in self: no file, one
    counted failure, one warning line naming why; the caller goes on (None)."""
    from source_patch.runtime.core.failures import Counters
    from source_patch.runtime.dump import server
    from source_patch.runtime.trace import hub

    (tmp_path / "exp" / "control").mkdir(parents=True, mode=0o700)
    os.chown(tmp_path / "exp" / "control", OTHER, OTHER)
    (tmp_path / "trace").mkdir(mode=0o700)
    os.chmod(tmp_path / "trace", 0o777)
    counters = Counters(("errors", "lost"), "source_patch.test_files", "dump")
    stand_in = SimpleNamespace(url="http://127.0.0.1:1", ws_url="ws://127.0.0.1:1", page_url="", token=TOKEN,
                               owner_pid=os.getpid(), actions=SimpleNamespace(fail=counters.fail),
                               runtime=SimpleNamespace(fail=counters.fail), config={"dir": str(tmp_path / "trace")})
    with caplog.at_level(logging.WARNING, logger="source_patch.test_files"):
        assert server.ControlServer._write_control_file(stand_in, {"dir": str(tmp_path), "exp_name": "exp"}) is None
        assert hub.Hub._write_token_file(stand_in) is None
    assert counters.counts["errors"] == 2
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2 and all("\n" not in line for line in lines)
    assert f"owned by uid {OTHER}" in lines[0] and "writable by group or others" in lines[1]
    assert not list((tmp_path / "exp" / "control").iterdir()) and not list((tmp_path / "trace").iterdir())


def test_a_private_file_is_flushed_before_its_rename_and_readers_see_it_whole(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: (events.append("fsync"), real_fsync(fd))[1])
    monkeypatch.setattr(os, "replace", lambda *a, **k: (events.append("rename"), real_replace(*a, **k))[1])
    target = tmp_path / "control" / "endpoint.json"
    write_private_json(target, {"token": TOKEN})
    assert events == ["fsync", "rename"]
    monkeypatch.undo()
    # Two large contents written in turn while another thread reads: never a part of one.
    whole = {b"a" * 300_000, b"b" * 300_000}
    seen, done = set(), threading.Event()

    def read():
        while not done.is_set():
            seen.add(target.read_bytes())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            private.write_private_file(target, sorted(whole)[i % 2])
    finally:
        done.set()
        reader.join()
    assert seen <= whole | {b'{"token": "s3cret-token"}'}
    assert not [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]


def test_a_failed_private_write_leaves_the_old_file_and_no_temporary_file(tmp_path, monkeypatch):
    target = tmp_path / "control" / "endpoint.json"
    write_private_json(target, {"token": "old"})

    def full(fd, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(OSError, match="No space left"):
        private.write_private_file(target, b"new")
    monkeypatch.undo()
    assert target.read_text() == '{"token": "old"}' and os.listdir(target.parent) == ["endpoint.json"]


# ---------------------------------------------------------------- plain files (item 3)


def test_write_file_refuses_a_fifo_at_once_and_leaves_it(tmp_path):
    fifo = tmp_path / "report.html"
    os.mkfifo(fifo)
    try:
        outcome = finishes(lambda: private.write_file(fifo, b"<html>"))
    finally:
        release(fifo)
    assert isinstance(outcome, OSError) and "exists and is not a regular file" in str(outcome)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["report.html"]


def test_write_file_refuses_a_folder(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "kept").write_text("x")
    with pytest.raises(OSError, match="exists and is not a regular file"):
        private.write_file(tmp_path / "out", b"report")
    assert (tmp_path / "out" / "kept").read_text() == "x" and os.listdir(tmp_path) == ["out"]


def test_write_file_replaces_a_link_without_writing_through_it(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("someone's file")
    (tmp_path / "report.json").symlink_to(victim)
    private.write_file(tmp_path / "report.json", b"{}")
    assert victim.read_text() == "someone's file"
    assert not (tmp_path / "report.json").is_symlink() and (tmp_path / "report.json").read_bytes() == b"{}"


@pytest.mark.parametrize("mask, expected", [(0o022, 0o644), (0o077, 0o600), (0, 0o666)])
def test_write_file_follows_the_umask(tmp_path, umask, mask, expected):
    umask(mask)
    private.write_file(tmp_path / "report.json", b"{}")
    private.write_file(tmp_path / "report.json", b"{}")  # and so does a rewrite
    umask(0o022)
    assert mode(tmp_path / "report.json") == expected


# ---------------------------------------------------------------- the code cache's lock (item 5)


def test_a_fifo_at_a_cache_lock_name_never_hangs_the_import(tmp_path):
    from source_patch.patcher.cache import CodeCache

    cache = CodeCache(tmp_path / "c")
    k = bytes(32)
    cache._mkdir(cache.path(k).parent)
    fifo = cache.path(k).with_suffix(".lock")
    os.mkfifo(fifo, 0o600)

    def compile_under_lock():
        with cache.lock(k):
            return "computed"

    try:
        assert finishes(compile_under_lock) == "computed"  # no lock: computed all the same
    finally:
        release(fifo)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)


# ---------------------------------------------------------------- the native build (item 2)


@pytest.fixture
def native_dir(tmp_path, monkeypatch):
    """SOURCE_PATCH_NATIVE_DIR, fresh (not made yet), and the native module with nothing loaded."""
    from source_patch.runtime.trace import native

    root = tmp_path / "native-root"
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(root))
    native._loaded.clear()
    yield root
    native._loaded.clear()


@pytest.fixture
def fake_compiler(tmp_path, monkeypatch):
    """$CXX: a script that writes garbage at its -o path (a build in milliseconds)."""
    script = tmp_path / "fake-c++"
    script.write_text('#!/bin/sh\nwhile [ "$#" -gt 0 ]; do [ "$1" = -o ] && printf "not a library" > "$2"; shift; done\n')
    script.chmod(0o755)
    monkeypatch.setenv("CXX", str(script))
    return script


def library_path(root):
    """Where load() looks under ``root`` for this torch's build; its folders made private."""
    from source_patch.runtime.trace import native

    name = native.module_name()
    (root / name).mkdir(parents=True, mode=0o700)
    root.chmod(0o700)
    return root / name / f"{name}.so"


@pytest.fixture
def planted_library(tmp_path):
    """A shared library whose constructor writes a marker file when it is loaded (gcc/cc);
    returns make(marker) -> its bytes."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler (cc, gcc) to build a planted library")

    def make(marker) -> bytes:
        source, out = tmp_path / "planted.c", tmp_path / "planted.so"
        source.write_text('#include <stdio.h>\n__attribute__((constructor)) static void planted(void) {\n'
                          f'  FILE *f = fopen("{marker}", "w"); if (f) {{ fputs("ran", f); fclose(f); }}\n}}\n')
        subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out), str(source)], check=True)
        return out.read_bytes()

    return make


def test_the_native_build_is_private_whatever_the_umask(native_dir, fake_compiler, umask, capsys):
    from source_patch.runtime.trace import native

    umask(0)
    try:
        built = native.build()
    finally:
        umask(0o022)
    assert mode(native_dir) == 0o700 and mode(built.parent) == 0o700 and mode(built) == 0o600
    assert os.listdir(built.parent) == [built.name]  # nothing partial left beside it
    # what was built is garbage: one line, no traceback, and no module
    assert native.load() is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not load: ImportError" in err[0] and "refused" in err[0]


@as_root
def test_a_library_another_user_owns_is_refused_before_dlopen_with_one_warning(native_dir, monkeypatch, capsys):
    """The trace's default (triton_launch: auto) on the CPU: the planted file is garbage,
    so a dlopen would fail with an ELF error; the refusal names the owner instead."""
    from source_patch.runtime.trace import api, compress, control, lifecycle, native  # noqa: F401 - api: the state

    planted = library_path(native_dir)
    planted.write_bytes(b"\x7fELF garbage")
    os.chown(planted, OTHER, OTHER)
    monkeypatch.setattr(lifecycle, "_native_said", False)
    try:
        control.configure(enable=True, triton_launch="auto")  # (port 0: no hub, nothing served)
        assert not compress.NATIVE_LAUNCH and compress.DIRECT_LAUNCH  # launched directly
        control.configure(triton_launch="native")
    finally:
        control.configure(enable=False, triton_launch="auto")
    err = [line for line in capsys.readouterr().err.splitlines() if "native" in line]
    assert f"its file {native.module_name()}/{planted.name} is owned by uid {OTHER}" in err[0]
    assert "ELF" not in err[0] and len([line for line in err if "refused" in line]) == 1


@as_root
def test_a_planted_library_never_runs(native_dir, planted_library, tmp_path, capsys):
    """A library's constructor runs at dlopen: another user's file, and a link (root's own)
    to a library, are refused before, so their markers never appear.  The control: the
    same library owned by this user in a private folder does run (then fails to import)."""
    from source_patch.runtime.trace import native

    target = library_path(native_dir)
    target.write_bytes(planted_library(tmp_path / "foreign-ran"))
    os.chown(target, OTHER, OTHER)
    assert native.load() is None
    assert f"owned by uid {OTHER}" in capsys.readouterr().err
    target.unlink()
    elsewhere = tmp_path / "elsewhere.so"
    elsewhere.write_bytes(planted_library(tmp_path / "linked-ran"))
    target.symlink_to(elsewhere)
    native._loaded.clear()
    assert native.load() is None
    assert "is a symbolic link" in capsys.readouterr().err
    assert not (tmp_path / "foreign-ran").exists() and not (tmp_path / "linked-ran").exists()
    target.unlink()
    private.write_private(str(native_dir), (target.parent.name, target.name), planted_library(tmp_path / "own-ran"))
    native._loaded.clear()
    assert native.load() is None  # loaded (its constructor ran), but it is no Python module
    assert (tmp_path / "own-ran").read_text() == "ran"
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not load: ImportError" in err[0]


@pytest.mark.parametrize("where", ["proc", "file", "foreign"])
def test_an_unusable_native_dir_is_one_line(where, tmp_path, monkeypatch, fake_compiler, capsys):
    from source_patch.patcher.cli import main
    from source_patch.runtime.trace import native

    if where == "foreign" and os.getuid() != 0:
        pytest.skip("needs root, to make a folder another user (uid 65534) owns")
    root = {"proc": "/proc/self", "file": str(tmp_path / "a-file"), "foreign": str(tmp_path / "theirs")}[where]
    if where == "file":
        (tmp_path / "a-file").write_text("not a folder")
    elif where == "foreign":
        os.mkdir(root, 0o755)
        os.chown(root, OTHER, OTHER)
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", root)
    native._loaded.clear()
    try:
        assert native.load() is None
        assert main(["build-native"]) == 2
    finally:
        native._loaded.clear()
    err = capsys.readouterr().err.strip().splitlines()
    assert "Traceback" not in "\n".join(err)
    assert err[-1].startswith(f"source-patch: error: build-native: cannot build into {root}: ")
    assert len(err) == (2 if where != "foreign" else 3)  # compiling ...; (the refusal;) the error
    if where == "foreign":
        assert f"owned by uid {OTHER}" in err[0] and f"owned by uid {OTHER}" in err[-1]
        assert os.listdir(root) == []
