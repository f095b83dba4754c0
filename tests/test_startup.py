"""The start hook's fast path (patcher/boot.py): a start-up whose specs and
environment match the boot record imports nothing new, and hands over to the full
patcher at the first target import; anything that changed falls back to the full
activation, with its warnings and errors.

Children are ``sys.executable`` (the venv's, with the start hook); the conftest
gives each test its own SOURCE_PATCH_CACHE and puts tests/fixtures on PYTHONPATH.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from source_patch.patcher import boot
from source_patch.patcher import spec as spec_mod

SPEC = """\
source_patch: 1
name: boot-test
patches:
  - id: neg
    module: spfix.basic
    target: add
    edits:
      - {at: return, code: "result = -result"}
"""

# What a child saw at its first line (before importing anything itself), then what
# importing the target did; JSON on the last line.
PROBE = textwrap.dedent("""
    import sys
    first = [type(f).__name__ if not isinstance(f, type) else f.__name__ for f in sys.meta_path][0]
    modules = sorted(sys.modules)
    import json, os
    out = {"first": first, "modules": modules, "full": "source_patch.patcher.activation" in modules,
           "env": os.environ.get("SOURCE_PATCH")}
    if "--import" in sys.argv:
        import spfix.basic as b
        out["result"] = b.add(1, 2)
        out["applied"] = [a.patch for a in getattr(b, "__source_patches__", ())]
        out["finders"] = [type(f).__name__ for f in sys.meta_path
                          if type(f).__name__ in ("BootFinder", "PatchFinder")]
    print(json.dumps(out))
""")


def child(spec=None, *args, code=PROBE, cwd=None, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("SOURCE_PATCH_") or k == "SOURCE_PATCH_CACHE"}
    environ.pop("SOURCE_PATCH", None)
    if spec is not None:
        environ["SOURCE_PATCH"] = os.fspath(spec)
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code, *args], env=environ, cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def probe(spec=None, *args, **kw) -> dict:
    proc = child(spec, *args, **kw)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    info["stderr"] = proc.stderr
    return info


def records() -> list[Path]:
    return sorted(Path(os.environ["SOURCE_PATCH_CACHE"], "boot").glob("*.spb"))


@pytest.fixture
def spec_file(write_spec) -> Path:
    return write_spec(SPEC, "boot.yaml")


def warm_up(spec, **env) -> dict:
    """A full start-up that writes the record; asserts it did."""
    info = probe(spec, **env)
    assert info["first"] == "PatchFinder" and info["full"], info
    assert len(records()) == 1, info["stderr"]
    return info


# --------------------------------------------------------------------------- the fast path


def test_a_warm_start_imports_nothing_new_and_patches_at_the_first_target(spec_file):
    unset = probe()
    warm_up(spec_file)
    warm = probe(spec_file, "--import")
    assert warm["first"] == "BootFinder"
    # Against a start-up without SOURCE_PATCH: the package, the hook's module, boot.py
    # and the private-file reader it checks the record with (os and stat only), nothing
    # else (no dataclasses, typing, hashlib, json, the patcher...).
    assert set(warm["modules"]) - set(unset["modules"]) == {
        "source_patch", "source_patch.patcher", "source_patch.patcher.startup", "source_patch.patcher.boot",
        "source_patch.runtime", "source_patch.runtime.core", "source_patch.runtime.core.private"}
    # The first target import hands over: patched, one PatchFinder, no BootFinder left.
    assert warm["result"] == -3 and warm["applied"] == ["neg"], warm
    assert warm["finders"] == ["PatchFinder"]
    assert warm["env"] == str(spec_file) and warm["stderr"] == ""


def test_a_changed_spec_text_runs_the_full_activation_again(spec_file):
    warm_up(spec_file)
    spec_file.write_text(SPEC.replace("-result", "result * 10"))
    changed = probe(spec_file, "--import")
    assert changed["first"] == "PatchFinder" and changed["result"] == 30
    again = probe(spec_file, "--import")  # and the record now holds the new text
    assert again["first"] == "BootFinder" and again["result"] == 30


def test_a_broken_spec_after_a_good_record_fails_as_before(spec_file):
    warm_up(spec_file)
    spec_file.write_text(SPEC.replace("at: return", "at: returns"))
    proc = child(spec_file, code="import json; print('stdlib ok'); import spfix.basic; print('ran')")
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert f"source-patch: error: {spec_file}:8:14: patches[0].edits[0].at: unknown anchor 'returns'" in proc.stderr


def test_relative_references_are_made_absolute_for_children(spec_file, tmp_path):
    warm_up(spec_file)
    warm = probe("boot.yaml", cwd=spec_file.parent)
    assert warm["first"] == "BootFinder" and warm["env"] == str(spec_file)


def test_a_target_imported_before_the_hook_stops_the_run(spec_file):
    """python -S, the target imported, then site.main(): a record exists, but the
    fast path must not take it; the full path refuses, as without a record."""
    warm_up(spec_file)
    code = "import spfix.basic, site; site.main(); print('stdlib ok'); import spfix.notpatched; print('ran')"
    environ = {k: v for k, v in os.environ.items() if k != "SOURCE_PATCH"}
    proc = subprocess.run([sys.executable, "-S", "-c", code], env={**environ, "SOURCE_PATCH": str(spec_file)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "ran" not in proc.stdout
    assert "already imported, so they cannot be patched: spfix.basic" in proc.stderr


def test_the_report_at_exit_on_the_fast_path(spec_file):
    warm_up(spec_file)
    for args, state in (((), "not imported"), (("--import",), "applied")):
        info = probe(spec_file, *args, SOURCE_PATCH_REPORT="1")
        assert info["first"] == "BootFinder"
        assert info["stderr"].splitlines()[-2:] == [f"spec boot-test ({spec_file}):", f"  neg (spfix.basic): {state}"]


def test_runtime_settings_of_the_specs_are_seen_before_any_target_import(write_spec, tmp_path):
    """The runtime's settings look the activation up in sys.modules; importing them
    hands over, so a spec's `runtime:` section applies as after a full start-up."""
    spec = write_spec(SPEC + f"runtime:\n  dump:\n    dir: {tmp_path / 'from-spec'}\n", "rt.yaml")
    code = ("import sys; first = type(sys.meta_path[0]).__name__\n"
            "from source_patch.runtime.core import settings\n"
            "print(first, settings.resolve('dump')['dir'])")
    outputs = [child(spec, code=code) for _ in range(2)]
    assert [p.stdout.split() for p in outputs] == [["PatchFinder", str(tmp_path / "from-spec")],
                                                   ["BootFinder", str(tmp_path / "from-spec")]], outputs[1].stderr


def test_the_activation_api_after_a_fast_start_merges_into_one_finder(spec_file, write_spec):
    warm_up(spec_file)
    other = write_spec(SPEC.replace("boot-test", "other").replace("spfix.basic", "spfix.notpatched")
                       .replace("target: add", "target: <module>").replace(
                           '{at: return, code: "result = -result"}', '{at: entry, code: "EXTRA = 1"}'), "other.yaml")
    code = textwrap.dedent(f"""
        import sys
        from source_patch.patcher import activate
        from source_patch.patcher.activation import installed_finder
        assert type(sys.meta_path[0]).__name__ == "BootFinder"
        again = activate({str(spec_file)!r})           # already active: a no-op
        more = activate({str(other)!r})
        import spfix.basic, spfix.notpatched
        finders = [f for f in sys.meta_path if type(f).__name__ in ("BootFinder", "PatchFinder")]
        print(len(again.specs), len(more.specs), len(finders), [s.name for s in installed_finder().specs],
              spfix.basic.add(1, 2), spfix.notpatched.EXTRA)
    """)
    proc = child(spec_file, code=code)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["0", "1", "1", "['boot-test',", "'other']", "-3", "1"]


# --------------------------------------------------------------------------- what the record rests on


@pytest.fixture
def package_dir(tmp_path, monkeypatch) -> Path:
    """A sys.path entry holding package `bootpkg` (target `bootpkg.mod`), old enough
    for a record to sign it (see boot.RACY_NS)."""
    root = tmp_path / "pkgs"
    (root / "bootpkg").mkdir(parents=True)
    (root / "bootpkg" / "__init__.py").write_text("")
    (root / "bootpkg" / "mod.py").write_text("def f():\n    return 1\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ["PYTHONPATH"]]))
    time.sleep(boot.RACY_NS / 1e9 + 0.1)
    return root


PKG_SPEC = SPEC.replace("spfix.basic", "bootpkg.mod").replace("target: add", "target: f")


def test_a_target_file_gone_runs_the_full_lookup_and_warns(write_spec, package_dir):
    spec = write_spec(PKG_SPEC, "pkg.yaml")
    warm_up(spec)
    assert probe(spec)["first"] == "BootFinder"
    (package_dir / "bootpkg" / "mod.py").unlink()
    gone = probe(spec)
    assert gone["first"] == "PatchFinder"
    assert (f"{spec}:4:5: patches[0]: spec 'boot-test' patches bootpkg.mod, which cannot be found "
            f"(module bootpkg.mod not found on the search path)") in gone["stderr"]
    assert "SourcePatchWarning" in gone["stderr"]
    assert probe(spec)["first"] == "PatchFinder"  # no record while a target is missing: warned every time
    strict = child(spec, SOURCE_PATCH_STRICT="1", code="import json; print('stdlib ok'); import spfix")
    assert strict.returncode == 1 and "NotActivatedError" in strict.stderr
    assert "source-patch: error: " in strict.stderr and "which cannot be found" in strict.stderr


def test_a_changed_search_path_entry_runs_the_full_lookup(write_spec, package_dir):
    """A package added to (or removed from) a sys.path entry can shadow a target, or
    bring a gated one's distribution: the entry's signature changes, the lookup reruns."""
    spec = write_spec(PKG_SPEC, "pkg.yaml")
    warm_up(spec)
    assert probe(spec)["first"] == "BootFinder"
    (package_dir / "newpkg").mkdir()
    assert probe(spec)["first"] == "PatchFinder"
    time.sleep(boot.RACY_NS / 1e9 + 0.1)
    assert probe(spec)["first"] == "PatchFinder"  # rewrites the record, then
    assert probe(spec)["first"] == "BootFinder"
    other_path = probe(spec, PYTHONPATH=os.environ["PYTHONPATH"] + os.pathsep + str(package_dir / "bootpkg"))
    assert other_path["first"] == "PatchFinder"  # another sys.path: another lookup


def test_a_gated_missing_target_does_not_block_the_record(write_spec):
    """A two-framework spec where one framework is not installed: its targets are
    missing, silently (their patches require it), and the fast path still applies."""
    spec = write_spec((SPEC + """\
  - id: other-framework
    module: not_installed_fw.mod
    target: f
    requires: {not-installed-fw: ">=1"}
    edits:
      - {at: entry, code: "pass"}
""").replace("source_patch: 1\n", "source_patch: 1.1\n"), "two.yaml")
    first = warm_up(spec)
    assert "cannot be found" not in first["stderr"]
    warm = probe(spec, "--import")
    assert warm["first"] == "BootFinder" and warm["result"] == -3 and warm["stderr"] == ""


# --------------------------------------------------------------------------- unit


def test_the_fast_path_resolves_references_as_spec_resolve_does(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.yaml").write_text(SPEC)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.yml").write_text(SPEC)
    (tmp_path / "noext").write_text(SPEC)
    os.symlink(tmp_path / "a.yaml", tmp_path / "link.yaml")
    for ref in ("a.yaml", "./a.yaml", "sub/b.yml", "sub/../a.yaml", "noext", "link.yaml", str(tmp_path / "a.yaml"),
                "megatron_cpu", "dump", "moe", "missing.yaml", "sub/missing"):
        assert boot._resolve(ref) == str(spec_mod.resolve(ref)), ref
    assert boot._resolve("moe_sglang") is None  # a renamed name: resolved (and warned about) by the full path
    assert boot.MAX_SPEC_BYTES == spec_mod.MAX_SPEC_BYTES
    assert boot.split_refs(f" a.yaml ,b{os.pathsep}, c ") == ["a.yaml", "b", "c"]


def test_the_record_is_invalidated_by_the_patchers_sources(tmp_path, monkeypatch):
    """A copy of the patcher whose file changes with the same size and mtime: its
    ctime differs, and the record no longer holds.  A file added counts too."""
    copy = tmp_path / "patcher"
    copy.mkdir()
    for f in Path(boot.__file__).parent.glob("*.py"):
        shutil.copy2(f, copy / f.name)
    monkeypatch.setattr(boot, "_HERE", str(copy))
    paths, texts = (str(tmp_path / "s.yaml"),), (SPEC,)
    assert not boot.write(paths, texts, {"spfix.basic": None})  # just written: racy, not recorded
    monkeypatch.setattr(boot, "RACY_NS", 0)
    assert boot.write(paths, texts, {"spfix.basic": None})
    record = boot._load(boot.record_path(boot.cache_dir(), paths))
    assert boot._holds(record, paths, texts)
    assert not boot._holds(record, paths, (SPEC + " ",))
    assert not boot._holds(record, paths + paths, texts + texts)

    time.sleep(0.05)  # past the clock tick of the copy (ctime has no finer grain)
    edited = copy / "engine.py"
    st = edited.stat()
    edited.write_bytes(edited.read_bytes().replace(b"a", b"b", 1))
    os.utime(edited, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert edited.stat().st_size == st.st_size and edited.stat().st_mtime_ns == st.st_mtime_ns
    assert not boot._holds(record, paths, texts)

    assert boot.write(paths, texts, {"spfix.basic": None})
    record = boot._load(boot.record_path(boot.cache_dir(), paths))
    assert boot._holds(record, paths, texts)
    (copy / "new.py").write_text("")
    assert not boot._holds(record, paths, texts)


def test_a_corrupt_or_foreign_record_is_a_miss_and_is_rewritten(spec_file):
    warm_up(spec_file)
    (path,) = records()
    good = path.read_bytes()
    for bad in (b"", good[:10], good[:-7], b"SPB1" + b"\x00" * 50, b"XXXX" + good[4:],
                b"SPB1" + __import__("marshal").dumps({"format": 99})):
        path.write_bytes(bad)
        info = probe(spec_file, "--import")
        assert info["first"] == "PatchFinder" and info["result"] == -3, info["stderr"]
        assert boot._load(str(path))["texts"] == (SPEC,)  # rewritten


def test_an_untrusted_cache_directory_is_not_read(spec_file, tmp_path):
    warm_up(spec_file)
    os.chmod(os.environ["SOURCE_PATCH_CACHE"], 0o777)
    try:
        info = probe(spec_file)
    finally:
        os.chmod(os.environ["SOURCE_PATCH_CACHE"], 0o700)
    assert info["first"] == "PatchFinder" and "writable by group or others" in info["stderr"]


def test_two_threads_importing_their_first_targets_at_once_share_one_hand_over(write_spec):
    two = write_spec(SPEC + """\
  - id: extra
    module: spfix.notpatched
    target: <module>
    edits:
      - {at: entry, code: "EXTRA = 1"}
""", "two.yaml")
    warm_up(two)
    code = textwrap.dedent("""
        import sys, threading, importlib
        assert type(sys.meta_path[0]).__name__ == "BootFinder"
        barrier, out = threading.Barrier(2), {}
        def go(name):
            barrier.wait()
            out[name] = importlib.import_module(name)
        threads = [threading.Thread(target=go, args=(n,)) for n in ("spfix.basic", "spfix.notpatched")]
        for t in threads: t.start()
        for t in threads: t.join()
        finders = [type(f).__name__ for f in sys.meta_path if type(f).__name__ in ("BootFinder", "PatchFinder")]
        print(finders, out["spfix.basic"].add(1, 2), out["spfix.notpatched"].EXTRA)
    """)
    for _ in range(3):
        proc = child(two, code=code)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["['PatchFinder']", "-3", "1"]
