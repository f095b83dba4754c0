"""Import-time cost of source-patch: the start hook, and patched imports of real Megatron modules.

    python bench/import_bench.py            # full run (a few minutes on 2 cores)
    python bench/import_bench.py --quick    # smoke run (well under a minute)

Every number comes from fresh subprocesses of this interpreter, variants alternated
(A B, B A, A B, ...) so drift hits both sides alike; the table gives median and min
of each side, the difference of the medians and their ratio, and the paired
difference (B - A of the same round): its median and its 10th..90th percentiles.

Start-up rows
  start hook: `python -I -S -c "import site; site.addsitedir(W); site.addsitedir(D)"`
  where D holds only a copy of patcher/source_patch.pth (B) or nothing (A), and W a
  neutral one-line .pth processed first (in a venv other .pth files always precede
  source_patch.pth).  Reported as the in-process time of the addsitedir(D) call and
  as the whole process's wall time.  SOURCE_PATCH is unset: this is what installing
  the package costs every interpreter that does not use it.
  editable install: the same with setuptools' editable-install .pth and finder module
  (what `pip install -e` adds to every start-up; not source-patch code).
  venv start: the venv's `python -c pass` with SOURCE_PATCH unset (A) and set (B: the
  hook activates the specs at start-up), all B variants in the same rounds as A:
  the two bench specs and `megatron_cpu,dump` (29 target modules) from their boot
  record (the warm start-up: patcher/boot.py, nothing imported until a target is),
  and the bench specs once more with the boot record deleted before each run (the
  full activation, compiled specs from the code cache: what a first start-up after
  a change pays).  The bench checks which path each B variant took.

Import rows
  Each measured subprocess first imports the targets unpatched (which imports all
  their dependencies: torch, the rest of Megatron), then unloads the targets only
  (they cannot simply be left out: megatron/core/transformer/__init__.py imports
  transformer_layer and megatron/core/models/gpt/__init__.py imports gpt_model, so
  their parent packages cannot be imported without them), activates the specs
  (which checks that no target is imported), and times importlib.import_module of
  each target with everything else already in sys.modules: the module's own cost.
  unpatched: no activation.  cold: a fresh empty SOURCE_PATCH_CACHE (includes
  importing libcst, parsing, rewriting, compiling).  warm: a cache filled before the
  runs.  Each subprocess verifies what it measured (__source_patches__, the loader,
  whether libcst was imported) and fails loudly otherwise.  Times are wall
  (perf_counter); one row repeats the warm sum in thread CPU time, which other load
  on the machine disturbs less.

Re-imports
  Each warm subprocess then imports the targets again --repeat times in pairs, in
  alternating order: unload them, import them with the finder in sys.meta_path
  (patched, from the code cache) or taken out (unpatched, from their .pyc files),
  the garbage collector off within a pair, each import's loader checked.  This is
  the patcher's per-import cost once its one-off costs (first use of the cache
  directory, requirement verdicts, memos) are paid; with runs x repeat pairs its
  interval is narrow enough to tell 1.05x from 1.10x, which the first-import rows
  (one sample per subprocess) cannot with a few runs.

Intervals (printed under the table): the ratio of the medians, warm over unpatched,
with a bootstrap 90% interval: first imports over the fresh subprocesses (each side
resampled; then the rounds resampled, each round's two subprocesses kept together),
re-imports over the pairs (the pairs resampled).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from import_table import ratio_line, table  # bench/: standard library only, like this parent process

REPO = Path(__file__).resolve().parent.parent
BENCH_SPEC = REPO / "bench" / "import_bench_spec.yaml"
SHIPPED_SPEC = REPO / "patches" / "megatron_topk.yaml"
SPECS = [str(SHIPPED_SPEC), str(BENCH_SPEC)]
HOOK = REPO / "patcher" / "source_patch.pth"
# In the order their imports complete (checked in the worker): importing one of them
# must not import another that is still unloaded.
TARGETS = [
    "megatron.core.transformer.transformer_layer",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.models.gpt.gpt_model",
]
MODES = ("unpatched", "cold", "warm")


# --------------------------------------------------------------------------- worker


def worker(mode: str, targets: list[str], repeat: int = 0) -> None:
    """One measured import of the targets (run in a fresh subprocess); prints JSON."""
    import gc
    import importlib
    import warnings

    warnings.simplefilter("ignore")  # Megatron warns about missing TE/Apex on every import
    t0 = time.perf_counter()
    for name in targets:
        importlib.import_module(name)
    preload_s = time.perf_counter() - t0
    preloaded = len(sys.modules)
    unload(targets)  # the targets, and only them
    if "libcst" in sys.modules:
        raise SystemExit("libcst was imported before the measurement; cold numbers would be low")

    activate_s = None
    if mode != "unpatched":
        t0 = time.perf_counter()
        from source_patch.patcher import activate

        activation = activate(SPECS)  # raises ActivationError if a target is still imported
        activate_s = time.perf_counter() - t0
        if sorted(activation.modules) != sorted(targets):
            raise SystemExit(f"the specs patch {activation.modules}, expected {targets}")

    gc.collect()
    times, cpu = {}, {}
    for i, name in enumerate(targets):
        c0, t0 = time.thread_time(), time.perf_counter()
        importlib.import_module(name)
        times[name] = time.perf_counter() - t0
        cpu[name] = time.thread_time() - c0
        early = [t for t in targets[i + 1:] if t in sys.modules]
        if early:
            raise SystemExit(f"importing {name} imported {early}: reorder TARGETS")

    # Verify that what was measured is what the row says.
    for name in targets:
        module = sys.modules[name]
        applied = getattr(module, "__source_patches__", None)
        loader = type(module.__spec__.loader).__name__
        if mode == "unpatched":
            if applied is not None or loader == "PatchingLoader":
                raise SystemExit(f"{name} was patched in the unpatched run")
        else:
            expected = {p.id for s in activation.specs for p in s.patches if p.module == name}
            if not applied or {a.patch for a in applied} != expected or loader != "PatchingLoader":
                raise SystemExit(f"{name} was not patched as expected: loader {loader}, "
                                 f"__source_patches__={applied!r}, expected {sorted(expected)}")
    # libcst is imported only on a cache miss.  A warm run can miss when patcher/*.py
    # changed since the cache was filled (they are part of the key): reported, retried.
    libcst = "libcst" in sys.modules
    if mode != "warm" and libcst != (mode == "cold"):
        raise SystemExit(f"{mode} run {'imported' if libcst else 'did not import'} libcst: "
                         f"the code cache did not behave as the mode assumes")
    again = reimports(targets, repeat) if mode == "warm" and not libcst else []
    print(json.dumps({"mode": mode, "times": times, "cpu": cpu, "activate": activate_s,
                      "preload": preload_s, "preloaded": preloaded, "miss": libcst, "again": again}))


def unload(targets: list[str]) -> None:
    for name in targets:
        del sys.modules[name]
        parent, _, child = name.rpartition(".")
        if getattr(sys.modules.get(parent), child, None) is not None:
            delattr(sys.modules[parent], child)


def reimports(targets: list[str], rounds: int) -> list:
    """(patched, unpatched) seconds to import the targets again, ``rounds`` pairs in
    alternating order in this process: the finder in sys.meta_path or taken out (the
    code then comes from the .pyc files, as in an unpatched process).  The per-import
    cost of the patcher once its one-off costs are paid, resolved by many pairs."""
    import gc
    import importlib

    from source_patch.patcher.activation import installed_finder

    finder = installed_finder()
    pairs = []
    gc.disable()  # a collection inside one import of a pair would swamp the difference
    try:
        for i in range(rounds):
            pair = {}
            for patched in ((True, False) if i % 2 else (False, True)):
                unload(targets)
                if not patched:
                    sys.meta_path.remove(finder)
                try:
                    t0 = time.perf_counter()
                    for name in targets:
                        importlib.import_module(name)
                    pair[patched] = time.perf_counter() - t0
                finally:
                    if not patched:
                        sys.meta_path.insert(0, finder)
                loaders = {type(sys.modules[name].__spec__.loader).__name__ for name in targets}
                if loaders != ({"PatchingLoader"} if patched else {"SourceFileLoader"}):
                    raise SystemExit(f"re-import ({'patched' if patched else 'unpatched'}) used {loaders}")
            pairs.append((pair[True], pair[False]))
            if i % 20 == 19:
                gc.collect()  # between pairs, never inside one
    finally:
        gc.enable()
    return pairs


# --------------------------------------------------------------------------- helpers


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("SOURCE_PATCH", "SOURCE_PATCH_CACHE") and not k.startswith("PYTHON")}
    env.update(extra)
    return env


def wall(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return elapsed, proc.stdout


def alternate(runs: int, variants: dict[str, callable]) -> dict[str, list]:
    """Run the variants ``runs`` times each, in an order that alternates every round."""
    out = {k: [] for k in variants}
    names = list(variants)
    for i in range(runs):
        for name in (names if i % 2 == 0 else names[::-1]):
            out[name].append(variants[name]())
    return out


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def machine_info() -> list[str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    vers = subprocess.run(
        [sys.executable, "-W", "ignore", "-c",
         "import torch, importlib.metadata as m; print(torch.__version__, m.version('megatron-core'),"
         " m.version('libcst'))"],
        env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout.split()
    torch_v, mcore_v, libcst_v = (vers + ["?"] * 3)[:3]
    return [
        f"date      {datetime.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M %Z')}",
        f"load      {loadavg()} (1/5/15-min load average at start; other work on the machine "
        f"inflates medians)",
        f"machine   {cpu}, {os.cpu_count()} cores, {platform.system()} {platform.release()}",
        f"python    {platform.python_version()} ({sys.executable})",
        f"packages  torch {torch_v}, megatron-core {mcore_v}, libcst {libcst_v}",
    ]


# --------------------------------------------------------------------------- benches


def bench_startup(runs: int, rows: list) -> None:
    py = sys.executable
    installed = Path(__import__("sysconfig").get_paths()["purelib"])
    if (installed / HOOK.name).exists() and (installed / HOOK.name).read_bytes() != HOOK.read_bytes():
        print(f"note: the installed {installed / HOOK.name} differs from {HOOK}; benching the repo's")
    tmp = Path(tempfile.mkdtemp(prefix="sp-bench-site-"))
    try:
        empty, hook, editable, warm = (tmp / n for n in ("empty", "hook", "editable", "warm"))
        for d in (empty, hook, editable, warm):
            d.mkdir()
        shutil.copy(HOOK, hook / HOOK.name)
        # In a venv, site processes other .pth files first (distutils-precedence.pth,
        # __editable__*.pth sort before source_patch.pth): one neutral .pth processed
        # before the timed call warms the same code paths, on both sides.
        (warm / "a_warm.pth").write_text("import os\n")
        editable_files = [p for pat in ("__editable__*source_patch*.pth",
                                        "__editable___source_patch*_finder.py")
                          for p in installed.glob(pat)]
        for p in editable_files:
            shutil.copy(p, editable / p.name)

        code = (f"import site, time; site.addsitedir({str(warm)!r}); t = time.perf_counter(); "
                "site.addsitedir({d!r}); print(time.perf_counter() - t)")
        env = clean_env()

        def site_run(d: Path):
            def run():
                elapsed, out = wall([py, "-I", "-S", "-c", code.format(d=str(d))], env)
                return elapsed, float(out)
            return run

        variants = {"empty": site_run(empty), "hook": site_run(hook)}
        if len(editable_files) == 2:
            variants["editable"] = site_run(editable)
        for _ in range(3):  # warm the page cache
            for f in variants.values():
                f()
        res = alternate(runs, variants)
        rows.append(("start hook: site.addsitedir(D) call", "D empty", "D = source_patch.pth",
                     [r[1] for r in res["empty"]], [r[1] for r in res["hook"]]))
        rows.append(("start hook: `python -I -S` wall", "D empty", "D = source_patch.pth",
                     [r[0] for r in res["empty"]], [r[0] for r in res["hook"]]))
        if "editable" in res:
            rows.append(("editable install: addsitedir(D) call", "D empty", "D = __editable__*",
                         [r[1] for r in res["empty"]], [r[1] for r in res["editable"]]))

        # Start-up with SOURCE_PATCH set, code caches filled by the first runs below.
        # `full` has a cache of its own whose boot records it deletes before each run,
        # so its hook runs the full activation every time (and writes the record again).
        specs = {"bench": ",".join(SPECS), "cpu_dump": "megatron_cpu,dump", "full": ",".join(SPECS)}
        env_set = {name: clean_env(SOURCE_PATCH=refs, SOURCE_PATCH_CACHE=str(tmp / f"cache-{name}"))
                   for name, refs in specs.items()}

        def start(name: str):
            def run():
                if name == "full":
                    shutil.rmtree(tmp / "cache-full" / "boot", ignore_errors=True)
                return wall([py, "-c", "pass"], env_set[name])[0]
            return run

        def check_paths(when: str):
            """Which path each variant's start-up takes (the first meta-path finder)."""
            probe = "import sys; print(type(sys.meta_path[0]).__name__)"
            for name, expected in (("bench", "BootFinder"), ("cpu_dump", "BootFinder"), ("full", "PatchFinder")):
                if name == "full":
                    shutil.rmtree(tmp / "cache-full" / "boot", ignore_errors=True)
                took = wall([py, "-c", probe], env_set[name])[1].strip()
                if took != expected:
                    raise SystemExit(f"{when}: the {name} start-up took the {took} path, not {expected}")

        venv = {"unset": lambda: wall([py, "-c", "pass"], env)[0],
                **{name: start(name) for name in specs}}
        time.sleep(2.5)  # files younger than boot.RACY_NS are not signed into a record
        for name in specs:  # the full activation: fills the code caches, writes the records
            wall([py, "-c", "pass"], env_set[name])
        check_paths("before the runs")
        for f in venv.values():
            f()
        res = alternate(max(runs // 3, 2), venv)
        check_paths("after the runs")
        rows.append(("venv `python -c pass` wall", "SOURCE_PATCH unset", "2 bench specs, boot record",
                     res["unset"], res["bench"]))
        rows.append(("venv `python -c pass` wall", "SOURCE_PATCH unset", "megatron_cpu,dump, record",
                     res["unset"], res["cpu_dump"]))
        rows.append(("venv `python -c pass` wall", "SOURCE_PATCH unset", "2 bench specs, no record",
                     res["unset"], res["full"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_imports(runs: int, repeat: int, rows: list) -> list[str]:
    tmp = Path(tempfile.mkdtemp(prefix="sp-bench-cache-"))
    try:
        warm_cache = tmp / "warm"
        counter = iter(range(10**9))

        retries = []

        def run(mode: str):
            def go():
                for _ in range(3):
                    cache = warm_cache if mode == "warm" else tmp / f"cold-{next(counter)}"
                    env = clean_env(SOURCE_PATCH_CACHE=str(cache))
                    _, out = wall([sys.executable, __file__, "--worker", mode, "--repeat", str(repeat)], env)
                    result = json.loads(out.strip().splitlines()[-1])
                    if mode == "cold":
                        shutil.rmtree(cache, ignore_errors=True)
                    if not (mode == "warm" and result["miss"]):
                        return result
                    # The miss refilled the cache for the changed patcher sources: rerun.
                    retries.append(1)
                raise SystemExit("warm runs keep missing the code cache")
            return go

        variants = {m: run(m) for m in MODES}
        # Fills the warm cache, warms the page cache and checks every mode once.
        first = run("cold")()
        env = clean_env(SOURCE_PATCH_CACHE=str(warm_cache))
        wall([sys.executable, __file__, "--worker", "cold"], env)
        written = [p for p in warm_cache.rglob("*.spc")  # code entries by content key (compiled specs
                   # live in specs/, the same code by stat key in stat/, requires verdicts in requires/)
                   if not {"specs", "stat", "requires"} & set(p.relative_to(warm_cache).parts)]
        if len(written) != len(TARGETS):
            raise SystemExit(f"expected {len(TARGETS)} cache files, found {len(written)}")
        variants["unpatched"]()
        print(f"preload: {first['preloaded']} modules in sys.modules before the targets are "
              f"unloaded ({first['preload']:.1f} s per subprocess)", flush=True)
        res = alternate(runs, variants)
        if retries:
            print(f"note: {len(retries)} warm run(s) missed the code cache (patcher/*.py changed "
                  f"during the bench) and were rerun on the refilled cache", flush=True)

        def per(mode, name):
            return [r["times"][name] for r in res[mode]]

        def total(mode, key="times"):
            return [sum(r[key].values()) for r in res[mode]]

        for name in TARGETS:
            short = name.replace("megatron.core.", "")
            rows.append((f"import {short}", "unpatched", "patched, warm cache",
                         per("unpatched", name), per("warm", name)))
        rows.append(("import all 4 (sum)", "unpatched", "patched, warm cache",
                     total("unpatched"), total("warm")))
        rows.append(("import all 4 (sum), thread CPU time", "unpatched", "patched, warm cache",
                     total("unpatched", "cpu"), total("warm", "cpu")))
        rows.append(("import all 4 (sum)", "unpatched", "patched, cold cache",
                     total("unpatched"), total("cold")))
        for name in TARGETS:
            short = name.replace("megatron.core.", "")
            rows.append((f"import {short}", "unpatched", "patched, cold cache",
                         per("unpatched", name), per("cold", name)))
        rows.append(("import source_patch + activate()", "-", "2 specs (warm runs)",
                     None, [r["activate"] for r in res["warm"]]))
        pairs = [pair for r in res["warm"] for pair in r["again"]]
        if pairs:
            rows.append(("re-import all 4, one process", "unpatched (no finder)", "patched, warm cache",
                         [plain for _, plain in pairs], [patched for patched, _ in pairs]))
        return [ratio_line("first import of all 4, warm vs unpatched (fresh processes)",
                           total("warm"), total("unpatched")),
                ratio_line("first import of all 4, warm vs unpatched (fresh processes, paired by round)",
                           total("warm"), total("unpatched"), paired=True),
                ratio_line("re-import of all 4, patched vs unpatched (pairs in one process)",
                           [patched for patched, _ in pairs], [plain for _, plain in pairs], paired=True)]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=9,
                   help="subprocesses per import variant (default 9; each imports torch + Megatron)")
    p.add_argument("--startup-runs", type=int, default=300,
                   help="subprocesses per start-up variant (default 300)")
    p.add_argument("--repeat", type=int, default=100,
                   help="re-import pairs per warm subprocess (default 100; see 'Re-imports')")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 import runs, 20 start-up runs")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.worker, TARGETS, args.repeat)
        return
    if args.quick:
        args.runs, args.startup_runs, args.repeat = 2, 20, 10

    print("\n".join(machine_info()))
    print(f"specs     {', '.join(os.path.relpath(s, REPO) for s in SPECS)}")
    print(f"runs      {args.runs} per import variant, {args.startup_runs} per start-up variant "
          f"(alternated)", flush=True)
    started = time.perf_counter()
    rows: list = []
    bench_startup(args.startup_runs, rows)
    intervals = bench_imports(args.runs, args.repeat, rows)
    print()
    print(table(rows))
    print("\n" + "\n".join(intervals))
    print(f"\n(total bench time {time.perf_counter() - started:.0f} s; load average at the end "
          f"{loadavg()})")


if __name__ == "__main__":
    main()
