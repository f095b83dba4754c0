"""``source-patch matrix`` on hostile or broken wheels (issue 36, item 7): each is one clean
error line naming the wheel, exit 2 (1 means an anchor is broken), nothing written outside
the matrix cache's own folder; the unpack cache is keyed by the wheel's content."""

import hashlib
import os
import signal
import stat
import zipfile

import pytest

from source_patch.patcher import cli, matrix

SPEC = """
source_patch: 1.1
name: fix
patches:
  - id: anchor
    module: fixpkg.mod
    target: f
    edits:
      - {at: after, match: "y = x + 2", code: "pass"}
"""
META = ("fixpkg-2.0.dist-info/METADATA", "Name: fixpkg\nVersion: 2.0\n\n")
GOOD = {META[0]: META[1], "fixpkg/__init__.py": "",
        "fixpkg/mod.py": "def f(x):\n    y = x + 2\n    return y\n",
        "fixpkg/other.py": "z = 1\n"}
BOMB = "fixpkg/big.py", "#" * (4 << 20)  # 4 MiB declared, a few KiB on disk


def write_wheel(path, files, method=zipfile.ZIP_DEFLATED):
    with zipfile.ZipFile(path, "w", method) as zf:
        for name, data in files.items() if isinstance(files, dict) else files:
            zf.writestr(name if isinstance(name, zipfile.ZipInfo) else zipfile.ZipInfo(name), data,
                        compress_type=method)
    return path


def symlink_member():
    info = zipfile.ZipInfo("fixpkg/link.py")
    info.external_attr = (stat.S_IFLNK | 0o777) << 16
    return info


def patched_bytes(old, new, files=None, method=zipfile.ZIP_DEFLATED):
    """A valid wheel, then ``old`` replaced by ``new`` in its bytes."""
    def build(path):
        write_wheel(path, files or GOOD, method)
        data = path.read_bytes()
        assert data.count(old) >= 1
        path.write_bytes(data.replace(old, new))
    return build


def wheel_of(files, method=zipfile.ZIP_DEFLATED):
    return lambda path: write_wheel(path, files, method)


# (id, build(path), limits, what the error says)
BAD = [
    ("empty", lambda p: p.write_bytes(b""), None, "not a readable zip archive"),
    ("not-a-zip", lambda p: p.write_bytes(b"hello, not a zip\n" * 8), None, "not a readable zip archive"),
    ("truncated", lambda p: (write_wheel(p, GOOD), p.write_bytes(p.read_bytes()[:200])), None,
     "not a readable zip archive"),
    ("corrupt-member", patched_bytes(b"y = x + 2", b"y = x + 3", method=zipfile.ZIP_STORED), None,
     "fixpkg/mod.py cannot be read (Bad CRC-32"),
    ("directory", lambda p: p.mkdir(), None, "is not a regular file"),
    ("fifo", lambda p: os.mkfifo(p), None, "is not a regular file"),
    ("name-not-utf8", patched_bytes("é".encode(), b"\xff\xfe", {**GOOD, "fixpkg/é.py": ""}), None,
     "not a readable zip archive ('utf-8' codec can't decode"),
    ("source-not-utf8", wheel_of({**GOOD, "fixpkg/mod.py": b"def f(x):\n    y = x + 2  # \xff\n"}), None,
     "fixpkg/mod.py is not UTF-8 (invalid start byte at byte 27)"),
    ("symlink-member", wheel_of([*GOOD.items(), (symlink_member(), "/etc/passwd")]), None,
     "fixpkg/link.py is not a regular file in the archive"),
    ("absolute-member", wheel_of({**GOOD, "/tmp/evil.py": "x = 1"}), None,
     "unsafe path in the archive: /tmp/evil.py"),
    ("dotdot-member", wheel_of({**GOOD, "fixpkg/../../evil.py": "x = 1"}), None,
     "unsafe path in the archive: fixpkg/../../evil.py"),
    ("duplicate-member", wheel_of([*GOOD.items(), ("fixpkg/mod.py", "def f(x):\n    pass\n")]), None,
     "an entry name appears twice"),
    ("no-metadata", wheel_of({k: v for k, v in GOOD.items() if k != META[0]}), None,
     "expected one *.dist-info/METADATA, found 0"),
    ("ratio-bomb", wheel_of(dict([*GOOD.items(), BOMB])), None, "fixpkg/big.py expands more than 200 times"),
    ("too-large-total", wheel_of(dict([*GOOD.items(), BOMB])), dict(total_bytes=1 << 20),
     "declares more than 1,048,576 bytes uncompressed"),
    ("too-many-members", wheel_of({**GOOD, **{f"fixpkg/m{i}.py": "" for i in range(10)}}), dict(members=8),
     "14 entries, more than 8"),
    ("member-too-large", wheel_of(GOOD), dict(member_bytes=30), "fixpkg/mod.py is 37 bytes, more than 30"),
    ("wheel-too-large", wheel_of(GOOD), dict(wheel_bytes=100), "larger than 100 bytes"),
]


@pytest.fixture
def no_hang():
    """A FIFO that blocks the open fails the test instead of hanging it."""
    def expire(*_):
        raise TimeoutError("matrix hung")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(30)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """The matrix cache inside a code-cache root holding an entry of its own."""
    root = tmp_path / "home" / ".cache" / "source-patch"
    root.mkdir(parents=True)
    (root / "code-entry").write_text("keep")
    monkeypatch.setattr(matrix, "CACHE", root / "matrix")
    (tmp_path / "fix.yaml").write_text(SPEC)
    (tmp_path / "dist").mkdir()
    return root / "matrix"


def outside(tmp_path, cache):
    """Every path under tmp_path but the matrix cache's own folder (and the code cache that
    the test session's conftest points at)."""
    return {p for p in tmp_path.rglob("*") if cache not in (p, *p.parents) and "spcache" not in p.parts}


@pytest.mark.parametrize("name, build, limits, says", BAD, ids=[case[0] for case in BAD])
@pytest.mark.filterwarnings("ignore:Duplicate name")
def test_a_bad_wheel_is_one_error_line_and_exit_2(name, build, limits, says, tmp_path, home, monkeypatch,
                                                  capsys, no_hang):
    if limits:
        monkeypatch.setattr(matrix, "LIMITS", matrix.Limits(**limits))
    wheel = tmp_path / "dist" / ("...whl" if name == "not-a-zip" else f"fixpkg-2.0-{name}.whl")
    build(wheel)
    before = outside(tmp_path, home)
    code = cli.main(["matrix", str(tmp_path / "fix.yaml"), "--releases", str(wheel)])
    out, err = capsys.readouterr()
    assert (code, out) == (2, "")
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"source-patch: error: wheel {wheel}: "), err
    assert says in err, err
    assert outside(tmp_path, home) == before
    assert not home.exists() or not any(home.iterdir())  # no entry, no temp folder left


@pytest.mark.parametrize("name", ["fixpkg-2.0-py3-none-any.whl", "...whl"])
def test_another_wheel_under_the_same_name_is_checked_on_its_own_files(name, tmp_path, home, capsys):
    wheel = tmp_path / "dist" / name
    args = ["matrix", str(tmp_path / "fix.yaml"), "--releases", str(wheel)]
    write_wheel(wheel, GOOD)
    first = hashlib.sha256(wheel.read_bytes()).hexdigest()
    before = outside(tmp_path, home)
    assert cli.main(args) == 0
    assert "| fixpkg 2.0 | ok 1/1 |" in capsys.readouterr().out
    write_wheel(wheel, {**GOOD, "fixpkg/mod.py": "def f(x):\n    y = x * 3\n    return y\n"})  # anchor gone
    second = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert cli.main(args) == 1
    assert "| fixpkg 2.0 | BROKEN 1/1 |" in capsys.readouterr().out
    assert outside(tmp_path, home) == before
    entries = sorted(home.iterdir())
    assert sorted(p.name.split("-")[0] for p in entries) == sorted([first, second])
    for folder in [home, *entries]:
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    # Only what the spec's module resolves through, and the metadata, is unpacked.
    files = {p.relative_to(entries[0]).as_posix() for p in entries[0].rglob("*") if p.is_file()}
    assert files == {META[0], "fixpkg/__init__.py", "fixpkg/mod.py"}


def test_a_crash_mid_unpack_is_never_a_cached_hit(tmp_path, home, monkeypatch):
    wheel = write_wheel(tmp_path / "dist" / "fixpkg-2.0-py3-none-any.whl", GOOD)
    calls, read = [], zipfile.ZipFile.read

    def dies_on_the_second_member(self, *a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # as a kill would, half-way through
        return read(self, *a, **k)

    monkeypatch.setattr(zipfile.ZipFile, "read", dies_on_the_second_member)
    with pytest.raises(KeyboardInterrupt):
        matrix.release(wheel, modules={"fixpkg.mod"})
    assert list(home.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setattr(matrix, "CACHE", home)
    rel = matrix.release(wheel, modules={"fixpkg.mod"})
    assert (rel.label, rel.tops) == ("fixpkg 2.0", {"fixpkg"})
    assert (matrix.Path(rel.root) / "fixpkg" / "mod.py").read_text() == GOOD["fixpkg/mod.py"]


def test_a_cache_others_can_write_to_is_refused(tmp_path, home, capsys):
    wheel = write_wheel(tmp_path / "dist" / "fixpkg-2.0-py3-none-any.whl", GOOD)
    home.mkdir()
    home.chmod(0o777)
    assert cli.main(["matrix", str(tmp_path / "fix.yaml"), "--releases", str(wheel)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "writable by others" in err, err
    assert list(home.iterdir()) == []


def test_a_directory_release_never_hangs_on_a_fifo_nor_tracebacks_on_bytes(tmp_path, home, capsys, no_hang):
    root = tmp_path / "rel"
    (root / "fixpkg-2.0.dist-info").mkdir(parents=True)
    (root / META[0]).write_text(META[1])
    (root / "fixpkg").mkdir()
    (root / "fixpkg" / "__init__.py").write_text("")
    args = ["matrix", str(tmp_path / "fix.yaml"), "--releases", str(root)]
    os.mkfifo(root / "fixpkg" / "mod.py")
    assert cli.main(args) == 1  # not a regular file: no module there, as `check --against` says
    assert "**broken** on 2.0: module fixpkg.mod not found" in capsys.readouterr().out
    (root / "fixpkg" / "mod.py").unlink()
    (root / "fixpkg" / "mod.py").write_bytes(b"def f(x):\n    y = x + 2  # \xff\n")
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.splitlines()[-1].startswith("source-patch: error: ") and "mod.py: not UTF-8" in err, err


def test_writing_into_a_missing_folder_is_an_error_line(tmp_path, home, capsys):
    wheel = write_wheel(tmp_path / "dist" / "fixpkg-2.0-py3-none-any.whl", GOOD)
    code = cli.main(["matrix", str(tmp_path / "fix.yaml"), "--releases", str(wheel),
                     "--write", str(tmp_path / "missing" / "compat.md")])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.splitlines()[-1].startswith("source-patch: error: cannot write ")
