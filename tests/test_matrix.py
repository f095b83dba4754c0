"""source-patch matrix: specs x releases (wheels or directories) in one command."""

import json
import zipfile

import pytest

from source_patch.patcher import cli

SPEC = """
source_patch: 1.1
name: fix
patches:
  - id: everywhere
    module: fixpkg.mod
    target: f
    edits:
      - {at: entry, code: "pass"}
  - id: old-anchor
    module: fixpkg.mod
    requires: {fixpkg: "<2"}
    target: f
    edits:
      - {at: after, match: "y = x + 1", code: "pass"}
  - id: new-anchor
    module: fixpkg.mod
    requires: {fixpkg: ">=2"}
    target: f
    edits:
      - {at: after, match: "y = x + 2", code: "pass"}
  - id: other-framework
    module: otherpkg.layers
    requires: {otherpkg: ">=1"}
    target: g
    edits:
      - {at: entry, code: "pass"}
"""


def release(root, version: str, body: str):
    (root / f"fixpkg-{version}.dist-info").mkdir(parents=True)
    (root / f"fixpkg-{version}.dist-info" / "METADATA").write_text(f"Name: fixpkg\nVersion: {version}\n\n")
    (root / "fixpkg").mkdir()
    (root / "fixpkg" / "__init__.py").write_text("")
    (root / "fixpkg" / "mod.py").write_text(f"def f(x):\n    {body}\n    return y\n")
    return root


def wheel(directory, path):
    with zipfile.ZipFile(path, "w") as zf:
        for file in directory.rglob("*"):
            if file.is_file():
                zf.write(file, file.relative_to(directory).as_posix())
    return path


@pytest.fixture
def releases(tmp_path, monkeypatch):
    from source_patch.patcher import matrix

    monkeypatch.setattr(matrix, "CACHE", tmp_path / "cache")
    one = release(tmp_path / "r1", "1.0", "y = x + 1")
    two = wheel(release(tmp_path / "r2", "2.0", "y = x + 2"), tmp_path / "fixpkg-2.0-py3-none-any.whl")
    three = release(tmp_path / "r3", "3.0", "y = x * 3")  # the anchor drifted
    spec = tmp_path / "fix.yaml"
    spec.write_text(SPEC)
    return spec, [str(one), str(two), str(three)]


def test_matrix_prints_the_table_and_exits_1_on_a_broken_anchor(releases, capsys, tmp_path):
    spec, paths = releases
    code = cli.main(["matrix", str(spec), "--releases", *paths, "--write", str(tmp_path / "compat.md"),
                     "--json-out", str(tmp_path / "m.json")])
    out, err = capsys.readouterr()
    assert code == 1
    lines = out.splitlines()
    assert lines[:5] == [
        "| release | fix |", "| --- | --- |",
        "| fixpkg 1.0 | ok 2/3, 1 gated |",
        "| fixpkg 2.0 | ok 2/3, 1 gated |",
        "| fixpkg 3.0 | BROKEN 1/3 |"]
    assert "- fix / new-anchor: **gated** on 1.0: requires fixpkg>=2" in lines
    assert "- fix / old-anchor: **gated** on 2.0, 3.0: requires fixpkg<2" in lines
    broken = next(line for line in lines if line.startswith("- fix / new-anchor: **broken** on 3.0: "))
    assert "edit at after 'y = x + 2'" in broken and "expected 1 match, found 0" in broken
    assert "matrix: 1/3 " in err and "matrix: 3/3 " in err  # progress, one line per release off a tty
    assert (tmp_path / "compat.md").read_text().startswith("# Compatibility")
    doc = json.loads((tmp_path / "m.json").read_text())
    cells = doc["specs"][0]["cells"]
    assert cells["fixpkg 2.0"]["patches"]["new-anchor"] == {"state": "applies", "reason": ""}
    assert cells["fixpkg 3.0"]["patches"]["new-anchor"]["state"] == "broken"
    assert "other-framework" not in cells["fixpkg 1.0"]["patches"]  # another framework: not counted


def test_matrix_exits_0_when_everything_applies_or_is_gated(releases, capsys):
    spec, paths = releases
    assert cli.main(["matrix", str(spec), "--releases", *paths[:2]]) == 0


def test_a_spec_requirement_refuses_the_release_as_a_whole(releases, capsys, tmp_path):
    spec, paths = releases
    spec.write_text(SPEC.replace("name: fix\n", "name: fix\nrequires: {fixpkg: '>=2'}\n"))
    assert cli.main(["matrix", str(spec), "--releases", *paths[:2]]) == 0
    out = capsys.readouterr().out
    assert "| fixpkg 1.0 | refused |" in out
    assert "- fix / (the whole spec): **refused** on 1.0: requires fixpkg>=2" in out


def test_check_exit_codes_tell_a_broken_anchor_from_an_unmet_requirement(releases, capsys):
    spec, paths = releases
    one, three = paths[0], paths[2]
    assert cli.main(["check", str(spec), "--against", three]) == 1  # broken anchor
    spec.write_text(SPEC.replace("name: fix\n", "name: fix\nrequires: {fixpkg: '>=2'}\n"))
    assert cli.main(["check", str(spec), "--against", one]) == 3  # unmet, anchors fine
    out = capsys.readouterr().out
    assert "gated new-anchor (fixpkg.mod): requires fixpkg>=2, found 1.0" in out


def test_an_unsafe_wheel_is_refused(tmp_path, monkeypatch):
    from source_patch.patcher import matrix
    from source_patch.patcher.errors import SourcePatchError

    monkeypatch.setattr(matrix, "CACHE", tmp_path / "cache")
    bad = tmp_path / "evil-1.0-py3-none-any.whl"
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("../escape.py", "x = 1")
    with pytest.raises(SourcePatchError, match="unsafe path in the archive: ../escape.py"):
        matrix.release(bad, tmp_path / "cache")
    assert not (tmp_path / "escape.py").exists()
