"""Activation across real processes: the start hook, SOURCE_PATCH, spawn, torchrun, the shared cache.

Every child is ``sys.executable`` (the venv's interpreter, whose site-packages
holds the ``source_patch.pth`` start hook) and is bounded by a timeout.  The
conftest puts tests/fixtures on PYTHONPATH and gives each test its own
SOURCE_PATCH_CACHE; SOURCE_PATCH is unset unless a test sets it.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import queue as queue_mod
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

from source_patch.patcher import spec as spec_mod
from source_patch.patcher.cache import CodeCache, key, slice_digest
from source_patch.runtime.core.endpoint import free_port

FIXTURES = Path(__file__).parent / "fixtures"
PROCFIX = FIXTURES / "procfix"
TIMEOUT = 90

# Patches spfix.basic.add: on entry it records its arguments in the module-level
# IMPORTED list, and at its return it emits the result through the runtime handle.
SPEC = """\
source_patch: 1
name: proc-test
patches:
  - id: add-entry
    module: spfix.basic
    target: add
    edits:
      - at: entry
        code: |
          IMPORTED.append(("add", a, b))
      - at: return
        code: |
          __sp__.emit("spfix.add", result, a=a, b=b)
"""

ANCHOR_MISS = """\
source_patch: 1
name: proc-anchor-miss
patches:
  - id: no-such-anchor
    module: spfix.basic
    target: add
    edits:
      - at: before
        match: "does_not_exist(...)"
        code: |
          pass
"""

# One line of Python printing what importing spfix.basic did, as JSON on the last stdout line.
REPORT = "import json, procfix.workers as w; print(json.dumps(w.report()))"


def run_py(code: str, *, spec: str | os.PathLike | None = None, cwd=None, env=None,
           timeout: float = TIMEOUT, args=()) -> subprocess.CompletedProcess:
    """Run ``python -c code`` (or a script when code is a path) with SOURCE_PATCH=spec."""
    environ = dict(os.environ if env is None else env)
    environ.pop("SOURCE_PATCH", None)
    if spec is not None:
        environ["SOURCE_PATCH"] = os.fspath(spec)
    argv = [sys.executable, "-c", code, *args]
    return subprocess.run(argv, cwd=cwd, env=environ, capture_output=True, text=True,
                          timeout=timeout)


def last_json(proc: subprocess.CompletedProcess):
    assert proc.returncode == 0, f"child failed (rc={proc.returncode}):\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines, f"child printed nothing; stderr:\n{proc.stderr}"
    return json.loads(lines[-1])


def assert_patched(info: dict) -> None:
    assert info["patched"], info
    assert info["applied"] == ["add-entry"], info
    assert info["imported"] == [["add", 1, 2]], info  # the entry edit ran exactly once
    assert info["result"] == 3


def assert_unpatched(info: dict) -> None:
    assert not info["patched"], info
    assert info["imported"] == [], info


@pytest.fixture
def spec_file(write_spec) -> Path:
    return write_spec(SPEC, "proc.yaml")


def test_start_hook_is_installed_in_this_interpreter():
    """The premise of every test here: the venv's site-packages holds the start hook."""
    hook = Path(sysconfig.get_paths()["purelib"], "source_patch.pth")
    assert hook.exists(), f"{hook} missing: the tests below would not exercise the start hook"
    assert "startup" in hook.read_text()


# --------------------------------------------------------------------------- subprocess


def test_subprocess_is_patched_with_source_patch_set(spec_file):
    code = textwrap.dedent("""
        import json
        from source_patch.runtime import capture
        import procfix.workers as w
        with capture("spfix.add") as events:
            info = w.report()
        info["events"] = [[e.name, e.value, e.tags] for e in events]
        print(json.dumps(info))
    """)
    info = last_json(run_py(code, spec=spec_file))
    assert_patched(info)
    assert info["events"] == [["spfix.add", 3, {"a": 1, "b": 2}]]
    assert info["env"] == str(spec_file)


def test_subprocess_is_not_patched_without_source_patch(spec_file):
    proc = run_py(REPORT)
    info = last_json(proc)
    assert_unpatched(info)
    assert info["env"] is None
    assert "source-patch" not in proc.stderr


def test_empty_source_patch_is_off(spec_file):
    info = last_json(run_py(REPORT, spec=" , "))
    assert_unpatched(info)


def test_spec_path_is_made_absolute_for_grandchildren(tmp_path):
    """Parent gets SOURCE_PATCH=<relative path>; a grandchild in another cwd is still patched."""
    home = tmp_path / "home"
    (home / "specs").mkdir(parents=True)
    (home / "specs" / "proc.yaml").write_text(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    code = textwrap.dedent(f"""
        import json, os, subprocess, sys
        import procfix.workers as w
        own = w.report("child")
        grandchild = subprocess.run(
            [sys.executable, "-c", {REPORT!r}], cwd={str(elsewhere)!r},
            capture_output=True, text=True, timeout={TIMEOUT})
        print(json.dumps({{"own": own, "rc": grandchild.returncode,
                           "stderr": grandchild.stderr, "out": grandchild.stdout}}))
    """)
    info = last_json(run_py(code, spec=os.path.join("specs", "proc.yaml"), cwd=home))
    assert_patched(info["own"])
    assert info["own"]["env"] == str((home / "specs" / "proc.yaml").resolve())
    assert info["rc"] == 0, info["stderr"]
    grandchild = json.loads(info["out"].splitlines()[-1])
    assert_patched(grandchild)
    assert grandchild["env"] == str((home / "specs" / "proc.yaml").resolve())

    # The control: the same relative value used as-is from that other directory is a
    # missing spec file, which fails loudly (so the rewrite above is what made it work).
    proc = run_py(REPORT, spec=os.path.join("specs", "proc.yaml"), cwd=elsewhere)
    assert proc.returncode != 0
    assert "cannot read spec" in proc.stderr


# --------------------------------------------------------------------------- multiprocessing


def _collect(results: "mp.Queue", n: int) -> list[dict]:
    out = []
    for _ in range(n):
        try:
            status, value = results.get(timeout=TIMEOUT)
        except queue_mod.Empty:
            pytest.fail(f"only {len(out)} of {n} children reported within {TIMEOUT}s")
        assert status == "ok", value
        out.append(value)
    return out


def _join_all(procs) -> None:
    for p in procs:
        p.join(timeout=TIMEOUT)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join(timeout=10)
    assert not alive, f"{len(alive)} children did not exit"
    assert [p.exitcode for p in procs] == [0] * len(procs)


@pytest.mark.slow
def test_multiprocessing_spawn_children_are_patched(spec_file, monkeypatch):
    """This (unpatched) test process sets SOURCE_PATCH; its spawn children inherit it."""
    from procfix import workers

    monkeypatch.setenv("SOURCE_PATCH", str(spec_file))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=workers.run_report, args=(results, i)) for i in range(2)]
    for p in procs:
        p.start()
    try:
        infos = _collect(results, len(procs))
    finally:
        _join_all(procs)
    assert len({i["pid"] for i in infos}) == 2
    for info in infos:
        assert_patched(info)


@pytest.mark.slow
def test_spawn_children_of_a_patched_parent_in_another_cwd(tmp_path):
    """A patched parent started with a relative SOURCE_PATCH chdirs, then starts a spawn Pool."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "proc.yaml").write_text(SPEC)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, SOURCE_PATCH="proc.yaml")
    proc = subprocess.run([sys.executable, str(PROCFIX / "spawn_driver.py"), "2", str(elsewhere)],
                          cwd=home, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    info = last_json(proc)
    assert_patched(info["driver"])
    assert len({c["pid"] for c in info["children"]}) == 2
    for child in info["children"]:
        assert_patched(child)
        assert child["env"] == str((home / "proc.yaml").resolve())


@pytest.mark.slow
def test_concurrent_cold_imports_share_one_cache_entry(spec_file, tmp_path, monkeypatch):
    """8 spawn children import the target at once against one empty cache directory:
    exactly one parses (the key's lock), the others load what it wrote."""
    from procfix import workers

    n = 8
    cache_dir = tmp_path / "shared-cache"
    cache_dir.mkdir()
    monkeypatch.setenv("SOURCE_PATCH", str(spec_file))
    monkeypatch.setenv("SOURCE_PATCH_CACHE", str(cache_dir))
    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    procs = [ctx.Process(target=workers.run_cold_import, args=(results, barrier, i))
             for i in range(n)]
    for p in procs:
        p.start()
    try:
        infos = _collect(results, n)
    finally:
        _join_all(procs)

    assert sorted(i["tag"] for i in infos) == list(range(n))
    for info in infos:
        assert_patched(info)
    assert sum(i["rewrote"] for i in infos) == 1, infos  # one parses, the others wait and load it

    # One code entry (compiled specs live apart, under specs/, the same code by stat
    # key under stat/, and start-up records under boot/); no temp files left over.
    def code_files():
        return sorted(p for p in cache_dir.rglob("*") if p.is_file()
                      and not {"specs", "boot", "stat", "requires"} & set(p.relative_to(cache_dir).parts))

    files = code_files()
    assert len(files) == 1 and files[0].suffix == ".spc", files
    assert all(p.suffix == ".spc" for p in (cache_dir / "stat").rglob("*") if p.is_file())
    assert all(p.suffix == ".spc" for p in (cache_dir / "specs").rglob("*") if p.is_file())
    assert all(p.suffix == ".spb" for p in (cache_dir / "boot").rglob("*") if p.is_file())
    # The entry is the one a loader of this target looks up, and it reads back as code.
    import importlib.util

    origin = importlib.util.find_spec("spfix.basic").origin
    patches = [p for p in spec_mod.load(spec_file).patches if p.module == "spfix.basic"]
    k = key(Path(origin).read_bytes(), slice_digest(patches), origin)
    cache = CodeCache(cache_dir)
    assert files[0] == cache.path(k)
    code = cache.get(k)
    assert code is not None and code.co_filename == origin

    # A later process is served from that entry: patched without rewriting (no libcst).
    warm = last_json(run_py(REPORT, spec=spec_file))
    assert_patched(warm)
    assert not warm["rewrote"]
    assert code_files() == files


@pytest.mark.slow
def test_torchrun_workers_are_patched(spec_file, tmp_path):
    pytest.importorskip("torch")
    out = tmp_path / "ranks"
    out.mkdir()
    env = dict(os.environ, SOURCE_PATCH=str(spec_file), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
           str(PROCFIX / "torch_worker.py"), str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr[-4000:]
    infos = {p.name: json.loads(p.read_text()) for p in out.glob("rank*.json")}
    assert sorted(infos) == ["rank0.json", "rank1.json"], proc.stderr[-4000:]
    for info in infos.values():
        assert info["world_size"] == "2"
        assert_patched(info)
    assert len({i["pid"] for i in infos.values()}) == 2


# --------------------------------------------------------------------------- failures are loud


def test_invalid_yaml_spec_fails_the_target_import(write_spec):
    bad = write_spec("source_patch: 1\nname: [\npatches:\n  - module: spfix.basic\n", "bad.yaml")
    proc = run_py(REPORT, spec=bad)
    assert proc.returncode != 0
    assert f"source-patch: error: {bad}:" in proc.stderr
    assert "invalid YAML" in proc.stderr
    assert "NotActivatedError" in proc.stderr and "so importing procfix is refused" in proc.stderr


def test_invalid_spec_fails_even_under_except_importerror(write_spec):
    """Upstream code wraps optional imports in `except ImportError`: that must not hide it."""
    bad = write_spec(SPEC.replace("at: entry", "at: entrance"), "bad.yaml")
    code = textwrap.dedent("""
        try:
            import spfix.basic
        except ImportError:
            print("swallowed")
    """)
    proc = run_py(code, spec=bad)
    assert proc.returncode != 0
    assert "swallowed" not in proc.stdout
    # The validation error names the file, line, column and field.
    assert f"{bad}:8:13: patches[0].edits[0].at: unknown anchor 'entrance'" in proc.stderr


def test_missing_spec_file_fails_the_target_import(tmp_path):
    missing = tmp_path / "nope" / "missing.yaml"
    proc = run_py(REPORT, spec=missing)
    assert proc.returncode != 0
    assert f"source-patch: error: {missing}: cannot read spec" in proc.stderr
    assert "NotActivatedError" in proc.stderr


def test_missing_spec_does_not_blame_sitecustomize(tmp_path):
    proc = run_py("pass", spec=tmp_path / "missing.yaml")
    assert "cannot read spec" in proc.stderr
    # (an environment's own sitecustomize may still fail on a blocked third-party import)
    assert "so importing sitecustomize is refused" not in proc.stderr


def test_unmatched_anchor_raises_anchor_error(write_spec):
    spec = write_spec(ANCHOR_MISS, "miss.yaml")
    code = textwrap.dedent("""
        import json
        from source_patch.patcher.errors import AnchorError
        try:
            import spfix.basic
        except AnchorError as exc:
            print(json.dumps({"module": exc.module, "file": exc.file, "text": str(exc)}))
        else:
            print(json.dumps({"imported": True}))
    """)
    info = last_json(run_py(code, spec=spec))
    import importlib.util

    origin = importlib.util.find_spec("spfix.basic").origin
    assert info.get("module") == "spfix.basic", info
    assert info["file"] == origin
    assert "'no-such-anchor'" in info["text"]
    assert f"{spec}:4" in info["text"]  # the patch's place in the spec
    assert "does_not_exist(...)" in info["text"]

    # Uncaught, it ends the child with the error on stderr.
    proc = run_py(REPORT, spec=spec)
    assert proc.returncode != 0
    assert "AnchorError: cannot patch module spfix.basic" in proc.stderr
    assert origin in proc.stderr and "'no-such-anchor'" in proc.stderr


# --------------------------------------------------------------------------- idempotence


def test_start_hook_twice_does_not_double_patch(spec_file):
    purelib = sysconfig.get_paths()["purelib"]
    code = textwrap.dedent(f"""
        import json, site, sys
        from source_patch.patcher import activation, startup
        from source_patch.patcher.finder import PatchFinder
        assert startup._done  # the start hook already ran at interpreter start
        startup.run()                 # a second call
        site.addsitedir({purelib!r})  # a second site pass re-executes the .pth line
        startup._done = False         # and the hook's work itself, from scratch
        startup.run()
        activation.activate_from_env()
        import procfix.workers as w
        info = w.report()
        activation.activate_from_env()  # once more, after the target is imported
        finders = [f for f in sys.meta_path if isinstance(f, PatchFinder)]
        info["finders"] = len(finders)
        info["specs"] = [s.name for s in finders[0].specs]
        info["failed"] = [type(f).__name__ for f in sys.meta_path
                          if type(f).__name__ == "FailedActivation"]
        print(json.dumps(info))
    """)
    proc = run_py(code, spec=spec_file)
    info = last_json(proc)
    assert_patched(info)
    assert info["finders"] == 1
    assert info["specs"] == ["proc-test"]
    assert info["failed"] == []
    assert "source-patch: error" not in proc.stderr


def test_same_spec_named_twice_patches_once(spec_file, tmp_path):
    refs = f"{spec_file},{os.path.relpath(spec_file, tmp_path)}"
    info = last_json(run_py(REPORT, spec=refs, cwd=tmp_path))
    assert_patched(info)
