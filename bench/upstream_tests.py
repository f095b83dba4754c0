"""Upstream's own tests, plain and under every source-patch configuration (issue 30).

    python bench/upstream_tests.py [--tests DIR] [--cpu] [--files F ...] [--jobs N] [--json OUT.json]
    python bench/upstream_tests.py --framework sglang --cpu [--engine] [--tests DIR]

Megatron-Core: DIR is a folder of Megatron-LM's test files for the installed megatron-core
release (``tests/unit_tests/...``, as ``../shared/upstream/megatron-lm/core_v0.16.1``), or a
folder holding ``megatron-lm/core_v*`` folders: then the one matching the installed
release is taken (same version, else the newest of the same minor). Default: the
environment variable SOURCE_PATCH_UPSTREAM_TESTS, else ``../shared/upstream`` next to
the checkout.

SGLang (``--framework sglang``, or a DIR holding ``test/``): DIR is a folder of SGLang's
test files (``test/registered/...``) for the installed release, or a folder holding
``v<release>`` folders (same matching). Default: SOURCE_PATCH_UPSTREAM_SGLANG_TESTS, else
``../upstream-sglang`` next to the checkout. ``upstream_sglang/focus.py`` beside this file
(ours, reported apart) runs beside them: focused calls of the SGLang functions our specs
patch, and with ``--engine`` a real SGLang server started by SGLang's own
``popen_launch_server``.

Nothing is fetched and nothing is copied: pytest reads the folder in place and runs in a
work folder (--work, else a temporary one), writing nothing into it.

Each configuration is a fresh pytest process with a JUnit XML report:

    plain        no spec
    inert        SOURCE_PATCH=routing,dump,trace,weight_sync, every capability off
    dump         ... dump on
    capture      ... routing capture on (records written at exit)
    replay       ... routing replay of capture's records (same tests, same order)
    trace        ... trace on, a client subscribed to every name
    weight_sync  ... weight sync on, no engine joined
    all          ... dump, capture, trace (with a client) and weight_sync on at once
                     (--configs only; CI runs plain, inert, all and replay of all's records)

``--cpu`` adds ``megatron_cpu`` (SGLang: ``sglang_cpu``) to every configuration (plain
included), hides the GPUs (Megatron) and runs a smaller file list. The output: outcomes
per configuration, every test whose outcome differs from plain with its cause, per file
how many tests reached real test code (not skipped, and not failing in every
configuration alike), and what this harness adapted for the machine (alike in every
configuration). Exit status 1 when an
outcome differs, a configuration did not run, or the adaptations were not alike.
docs/upstream_tests.md has the results.

The adaptations are made by the pytest plugin beside this file, ``upstream_adapt.py``
(``-p upstream_adapt``, this folder on PYTHONPATH).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
ENV_TESTS = "SOURCE_PATCH_UPSTREAM_TESTS"
ENV_SGLANG_TESTS = "SOURCE_PATCH_UPSTREAM_SGLANG_TESTS"
SPECS = "routing,dump,trace,weight_sync,sentinels"
OUTCOMES = ("passed", "failed", "error", "skipped")

# Megatron-Core's MoE, transformer layer, GPT model and inference engine tests (one GPU).
GPU_FILES = ["tests/unit_tests/transformer/moe", "tests/unit_tests/transformer/test_transformer_layer.py",
             "tests/unit_tests/models/test_gpt_model.py",
             "tests/unit_tests/inference/engines/test_static_engine.py"]
# What of them reaches real code on CPU (gloo, one process), kept small for CI.
CPU_FILES = ["tests/unit_tests/transformer/moe/test_router_replay.py",
             "tests/unit_tests/transformer/moe/test_moe_layer.py",
             "tests/unit_tests/transformer/moe/test_routers.py",
             "tests/unit_tests/transformer/moe/test_sequential_mlp.py"]
# SGLang's CPU folder (its top-k and MoE-router kernel tests) and unit tests of the modules our
# specs touch (MoE layers, model runner, weight updaters), as exported; then our focused runs.
SGLANG_FILES = ["test/registered/cpu", "test/registered/unit"]
FOCUS = HERE / "upstream_sglang" / "focus.py"


from upstream_adapt import ADAPTATIONS  # noqa: E402 - the plugin, bench/upstream_adapt.py


# ------------------------------------------------------------------ the harness


def find_tests(given: str | None, framework: str = "megatron") -> Path | None:
    """The release folder to run: --tests, else $SOURCE_PATCH_UPSTREAM_TESTS (SGLang:
    $SOURCE_PATCH_UPSTREAM_SGLANG_TESTS), else ../shared/upstream (SGLang: ../upstream-sglang)."""
    if framework == "sglang":
        root = Path(given or os.environ.get(ENV_SGLANG_TESTS) or ROOT.parent / "upstream-sglang").resolve()
        if (root / "test").is_dir():
            return root
        return release_folder(root, installed_version("sglang"), framework)
    root = Path(given or os.environ.get(ENV_TESTS) or ROOT.parent / "shared" / "upstream").resolve()
    if (root / "tests" / "unit_tests").is_dir():
        return root
    return release_folder(root, installed_version("megatron"))


def detect_framework(given: str | None) -> str:
    """sglang for a folder of SGLang's tests (test/, or v<release>/test/), else megatron."""
    root = Path(given) if given else None
    if root and ((root / "test").is_dir() or any(root.glob("v*/test"))):
        return "sglang"
    return "megatron"


def installed_version(framework: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version({"megatron": "megatron-core"}.get(framework, framework))
    except importlib.metadata.PackageNotFoundError:
        return None


def megatron_version() -> str | None:
    return installed_version("megatron")


def release_folder(root: Path, version: str | None, framework: str = "megatron") -> Path | None:
    """root/megatron-lm/core_v<version> (SGLang: root/v<version>), else the newest of the
    same major.minor there."""
    if framework == "sglang":
        folders = {p.name[1:]: p for p in root.glob("v*") if (p / "test").is_dir()}
    else:
        folders = {p.name[len("core_v"):]: p for p in (root / "megatron-lm").glob("core_v*")
                   if (p / "tests" / "unit_tests").is_dir()}
    if not version or not folders:
        return None
    if version in folders:
        return folders[version]
    minor = version.rsplit(".", 1)[0]
    same = sorted((v for v in folders if v.rsplit(".", 1)[0] == minor), key=_version_key)
    return folders[same[-1]] if same else None


def _version_key(v: str):
    return tuple(int(x) if x.isdigit() else 0 for x in v.split("."))


def configurations(work: Path, cpu: bool, framework: str = "megatron") -> dict:
    """name -> environment changes; specs inert unless a configuration turns one capability on."""
    base = f"{framework}_cpu," if cpu else ""
    # dump.yaml, trace.yaml and sentinels.yaml turn themselves on: off here; their folders in `work` regardless
    inert = {"SOURCE_PATCH": base + SPECS, "SOURCE_PATCH_DUMP_ENABLE": "0", "SOURCE_PATCH_TRACE_ENABLE": "0",
             "SOURCE_PATCH_SENTINELS_NONFINITE": "0", "SOURCE_PATCH_DUMP_DIR": str(work / "dumps"),
             "SOURCE_PATCH_TRACE_DIR": str(work / "trace"), "SOURCE_PATCH_SENTINELS_DIR": str(work / "sentinels")}
    # Megatron's routing settings and SGLang's (per request, written when it finishes): each
    # framework reads only its own
    routes, sglang_routes = str(work / "routes"), str(work / "sglang-routes")
    configs = {
        "plain": {"SOURCE_PATCH": base.rstrip(",")},
        "inert": inert,
        "dump": {**inert, "SOURCE_PATCH_DUMP_ENABLE": "1"},
        "capture": {**inert, "SOURCE_PATCH_ROUTING_MODE": "capture", "SOURCE_PATCH_ROUTING_DIR": routes,
                    "SOURCE_PATCH_ROUTING_SGLANG_MODE": "capture", "SOURCE_PATCH_ROUTING_SGLANG_DIR": sglang_routes},
        "replay": {**inert, "SOURCE_PATCH_ROUTING_MODE": "replay", "SOURCE_PATCH_ROUTING_DIR": routes,
                   "SOURCE_PATCH_ROUTING_SGLANG_MODE": "replay", "SOURCE_PATCH_ROUTING_SGLANG_REPLAY": sglang_routes},
        "trace": {**inert, "SOURCE_PATCH_TRACE_ENABLE": "1", "SOURCE_PATCH_TRACE_PORT": str(free_port()),
                  "SOURCE_PATCH_TRACE_TOKEN": secrets.token_hex(16), "SOURCE_PATCH_TRACE_WAIT": "60"},
        # no engine ever joins: a push gives up after timeout_s and training goes on (on_error: log)
        "weight_sync": {**inert, "SOURCE_PATCH_WEIGHT_SYNC_ENABLE": "1", "SOURCE_PATCH_WEIGHT_SYNC_PORT":
                        str(free_port()), "SOURCE_PATCH_WEIGHT_SYNC_WORLD_SIZE": "2",
                        "SOURCE_PATCH_WEIGHT_SYNC_TIMEOUT_S": "20"},
        # the three watches armed (the mismatch watch is called by a framework: armed, never fed)
        "sentinels": {**inert, "SOURCE_PATCH_SENTINELS_NONFINITE": "1", "SOURCE_PATCH_SENTINELS_ROUTING_HEALTH": "1",
                      "SOURCE_PATCH_SENTINELS_MISMATCH": "1"},
    }
    # every capability on at once (what CI runs, with plain, inert and replay of its capture)
    configs["all"] = {k: v for name in ("dump", "capture", "trace", "weight_sync", "sentinels")
                      for k, v in configs[name].items()}
    return configs


CAPTURING = ("capture", "all")  # the configurations that write the records replay reads
TRACING = ("trace", "all")       # those with a trace client subscribed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(changes: dict, folder: Path, cpu: bool, cache: Path, framework: str = "megatron",
              engine: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SOURCE_PATCH") and k not in ("PYTHONWARNINGS", "PYTEST_ADDOPTS")}
    env.update({k: v for k, v in changes.items() if v})
    # this plugin; upstream's `tests` and `megatron.training` (megatron is a namespace package)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), str(folder), os.environ.get("PYTHONPATH")]))
    env.update(PYTHONDONTWRITEBYTECODE="1", SOURCE_PATCH_CACHE=str(cache), SP_UPSTREAM_CPU="1" if cpu else "0",
               MASTER_PORT=str(free_port()), SP_UPSTREAM_FRAMEWORK=framework, SP_UPSTREAM_ENGINE="1" if engine else "0")
    if framework == "sglang":
        env["PATH"] = os.pathsep.join(filter(None, [str(Path(sys.executable).parent), env.get("PATH")]))
        if cpu:
            env.update(OMP_NUM_THREADS="1")
    elif cpu:
        env.update(CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    return env


def run_pytest(folder: Path, files: list, env: dict, xml: Path, timeout: float) -> dict:
    """One pytest process; returns {"outcomes": {test: (outcome, cause)}, "seconds", "status", "tail"}.
    It runs in the work folder, without an ini file, cache or bytecode: nothing is written into
    the upstream folder."""
    cmd = [sys.executable, "-m", "pytest", "-p", "upstream_adapt", "-p", "no:cacheprovider", "-q", "-c", os.devnull,
           "--rootdir", str(folder), "--continue-on-collection-errors", "--junitxml", str(xml),
           "-o", "junit_family=xunit1", *(str(folder / f) for f in files)]
    start = time.perf_counter()
    # its own session: a timeout ends pytest and whatever it started (a trace forwarder, say)
    proc = subprocess.Popen(cmd, cwd=xml.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
        status = f"exit {proc.returncode}"
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        output, _ = proc.communicate()
        status = f"timed out after {timeout:.0f} s"
    outcomes = parse_junit(xml) if xml.exists() else {}
    return {"outcomes": outcomes, "seconds": time.perf_counter() - start, "status": status, "tail": output[-3000:]}


def parse_junit(path: Path) -> dict:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname, file = case.get("classname") or "", case.get("file") or ""
        if not classname and "bench/" in file:  # our focused runs, outside the rootdir: no class name
            classname = "bench." + file.rsplit("bench/", 1)[1].removesuffix(".py").replace("/", ".")
        test = f"{classname}::{case.get('name')}" if classname else case.get("name")
        outcome, cause = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                cause = first_line(child.get("message") or child.text or "")
                if "retry() exceed" in cause:  # SGLang's CustomTestCase wraps the cause: its first E line
                    inner = [ln[1:].strip() for ln in (child.text or "").splitlines()
                             if ln.startswith("E ") and "retry() exceed" not in ln]
                    cause = inner[0][:300] if inner else cause
                break
        out[test] = (outcome, cause)
    return out


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")[:300]


class TraceClient:
    """A client subscribed to every traced name, for the `trace` configuration."""

    def __init__(self, env: dict, work: Path):
        self.out = work / "trace.sptrace"
        url = f"http://127.0.0.1:{env['SOURCE_PATCH_TRACE_PORT']}/"
        cmd = [sys.executable, "-m", "source_patch.runtime.trace.client", "record", "--url", url, "--token",
               env["SOURCE_PATCH_TRACE_TOKEN"], "--name", "*", "--out", str(self.out), "--retry", "3600"]
        clean = {k: v for k, v in env.items() if k != "SOURCE_PATCH"}
        self.proc = subprocess.Popen(cmd, env=clean, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def stop(self) -> str:
        """What the client saw (it ends with the traced process, or is stopped here)."""
        try:
            text, _ = self.proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            text, _ = self.proc.communicate(timeout=15)
        return " ".join(first_line(line) for line in text.splitlines()[-2:]) or "no output"


def run_all(folder: Path, files: list, cpu: bool, names: list, timeout: float, work: Path,
            deadline: float, jobs: int, framework: str = "megatron", engine: bool = False) -> dict:
    """Every configuration in `names`, up to `jobs` at once; replay after all others (it needs capture's)."""
    configs, cache, end = configurations(work, cpu, framework), work / "spcache", time.monotonic() + deadline

    def one(name):
        left = end - time.monotonic()
        if left < 30:
            print(f"-- {name}: not run (the --deadline is spent)", flush=True)
            return name, None
        env = child_env(configs[name], folder, cpu, cache, framework, engine)
        if name == "replay" and not (work / "routes").exists():
            env.pop("SOURCE_PATCH_ROUTING_DIR")  # capture recorded nothing: replay has no records
        if name == "replay":  # SGLang's replay reads capture's folder, records or none
            (work / "sglang-routes").mkdir(exist_ok=True)
        env["SP_UPSTREAM_APPLIED"] = str(work / f"{name}.applied")
        client = TraceClient(env, work) if name in TRACING else None
        res = run_pytest(folder, files, env, work / f"{name}.xml", min(timeout, left))
        applied = work / f"{name}.applied"
        res["applied"] = applied.read_text().split() if applied.exists() else []
        if client is not None:
            res["client"] = client.stop()
        if name in CAPTURING:
            res["records"] = count_records(work / "routes") + len(list((work / "sglang-routes").rglob("*.safetensors")))
        counts = Counter(o for o, _ in res["outcomes"].values())
        print(f"-- {name} (SOURCE_PATCH={env.get('SOURCE_PATCH', '')!r}): {res['status']}, {res['seconds']:.0f} s: "
              + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES), flush=True)
        if not res["outcomes"]:
            print(res["tail"], flush=True)
        return name, res

    with ThreadPoolExecutor(max(1, jobs)) as pool:
        done = dict(pool.map(one, [n for n in names if n != "replay"]))
    if "replay" in names:
        done.update([one("replay")])
    return {n: done[n] for n in names if done.get(n) is not None}


def count_records(routes: Path) -> int:
    return sum(len(json.loads(p.read_text())["records"]) for p in routes.glob("*/index.json"))


def differences(results: dict) -> list:
    """(configuration, test, plain outcome, outcome, cause) for every outcome unlike plain's."""
    plain = results["plain"]["outcomes"]
    out = []
    for name, res in results.items():
        if name == "plain":
            continue
        for test in sorted(set(plain) | set(res["outcomes"])):
            a = plain.get(test, ("absent", ""))
            b = res["outcomes"].get(test, ("absent", res["status"]))
            if a[0] != b[0]:
                out.append((name, test, a[0], b[0], b[1] or a[1]))
    return out


def reached(results: dict) -> dict:
    """file -> (tests, reached): reached = not skipped in plain and passed in some configuration."""
    per_file: dict = {}
    tests = set().union(*(r["outcomes"] for r in results.values()))
    for test in tests:
        file = test_file(test)
        seen = [r["outcomes"].get(test, ("absent", ""))[0] for r in results.values()]
        n, ok = per_file.get(file, (0, 0))
        hit = results["plain"]["outcomes"].get(test, ("absent",))[0] != "skipped" and "passed" in seen
        per_file[file] = (n + 1, ok + hit)
    return dict(sorted(per_file.items()))


def test_file(test: str) -> str:
    """tests.unit_tests.transformer.moe.test_routers.TestTop2Router::name -> .../test_routers.py"""
    head = test.split("::")[0]
    if head.endswith(".py"):
        return head
    if head.startswith("bench."):  # our focused runs (SGLang)
        return head.replace(".", "/") + ".py"
    parts = head.split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return "/".join(parts) + ".py" if parts else head


def report(folder: Path, results: dict, names: list, cpu: bool, framework: str = "megatron") -> tuple[str, dict]:
    package = {"megatron": "megatron-core"}.get(framework, framework)
    lines = [f"upstream tests: {folder.name} ({time.strftime('%Y-%m-%d')}, {package} {installed_version(framework)}, "
             f"{f'CPU, {framework}_cpu in every configuration' if cpu else _device()})", "",
             "| configuration | passed | failed | error | skipped | differ from plain | seconds |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    diffs = differences(results)
    for name, res in results.items():
        counts = Counter(o for o, _ in res["outcomes"].values())
        n = sum(1 for d in diffs if d[0] == name)
        lines.append(f"| {name} | " + " | ".join(str(counts[o]) for o in OUTCOMES)
                     + f" | {'-' if name == 'plain' else n} | {res['seconds']:.0f} |")
    notes = [f"{name}: {res['status']}" for name, res in results.items() if not res["status"].startswith("exit")]
    notes += [f"{name}: not run (--deadline)" for name in names if name not in results]
    for name in CAPTURING:
        if name in results:
            notes.append(f"{name} wrote {results[name].get('records', 0)} records; replay replays them")
    if "trace" in results:
        notes.append(f"trace client: {results['trace'].get('client', '')}")
    lines += [""] + [f"- {n}" for n in notes]
    lines += ["", f"outcomes that differ from plain: {len(diffs)}"]
    lines += [f"- {name}: {test}: {a} -> {b}: {cause}" for name, test, a, b, cause in diffs]
    per_file = reached(results)
    lines += ["", "| file | tests | reached real test code |", "| --- | ---: | ---: |"]
    lines += [f"| {file} | {n} | {ok} |" for file, (n, ok) in per_file.items()]
    total = sum(ok for _, ok in per_file.values())
    upstream = sum(ok for f, (_, ok) in per_file.items() if not f.startswith("bench/"))
    lines += [f"| all | {sum(n for n, _ in per_file.values())} | {total} |"]
    if upstream != total:
        lines += ["", f"of which upstream's own tests: {upstream}; ours (bench/, focused runs): {total - upstream}"]
    lines += ["", "adapted for this machine, alike in every configuration:"]
    applied = {name: r["applied"] for name, r in results.items()}
    alike = len({tuple(a) for a in applied.values()}) == 1
    lines += [f"- {ADAPTATIONS[key]}" for key in ADAPTATIONS if key in applied.get("plain", [])]
    if not alike:
        lines += [f"- NOT ALIKE: {name}: {' '.join(a)}" for name, a in applied.items()]
    summary = {"folder": str(folder), "framework": framework, "version": installed_version(framework), "cpu": cpu,
               "megatron_core": megatron_version(), "differences": [list(d) for d in diffs], "reached": total,
               "reached_upstream": upstream,
               "reached_per_file": {f: ok for f, (_, ok) in per_file.items()},
               "counts": {name: dict(Counter(o for o, _ in r["outcomes"].values())) for name, r in results.items()},
               "status": {name: r["status"] for name, r in results.items()}, "adaptations_alike": alike}
    return "\n".join(lines), summary


def _device() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tests", help=f"upstream test folder (default: ${ENV_TESTS}, else ../shared/upstream; "
                                   f"SGLang: ${ENV_SGLANG_TESTS}, else ../upstream-sglang)")
    p.add_argument("--framework", choices=["megatron", "sglang"],
                   help="whose tests (default: sglang for a folder of SGLang's tests, else megatron)")
    p.add_argument("--cpu", action="store_true", help="CPU: megatron_cpu (sglang_cpu) everywhere, CPU files")
    p.add_argument("--engine", action="store_true", help="SGLang: also start a real server in the focused runs")
    p.add_argument("--files", nargs="+", help="test files or folders, relative to the release folder")
    p.add_argument("--configs", nargs="+", help="configurations to run (plain always runs first; default: all but 'all')")
    p.add_argument("--timeout", type=float, default=600, help="seconds per pytest process")
    p.add_argument("--deadline", type=float, default=3600, help="seconds for all of them: later ones are not run")
    p.add_argument("--jobs", type=int, default=1, help="configurations run at once (replay always after capture)")
    p.add_argument("--work", help="folder for reports and records (default: a temporary one)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--out", help="write the report (markdown) here too")
    args = p.parse_args(argv)

    framework = args.framework or detect_framework(args.tests)
    folder = find_tests(args.tests, framework)
    if folder is None:
        env = ENV_SGLANG_TESTS if framework == "sglang" else ENV_TESTS
        print(f"no upstream test folder for {framework} {installed_version(framework)}: give --tests DIR or set "
              f"{env}", file=sys.stderr)
        return 2
    default = SGLANG_FILES + [str(FOCUS)] if framework == "sglang" else CPU_FILES if args.cpu else GPU_FILES
    files = [f for f in (args.files or default) if (folder / f).exists()]
    every = list(configurations(Path("."), args.cpu, framework))
    names = [n for n in every if n != "all"]  # each capability alone; "all" on request (it shares capture's folder)
    if args.configs:
        names = ["plain"] + [n for n in every if n in args.configs and n != "plain"]
        if set(CAPTURING) <= set(names):
            p.error("--configs: 'capture' and 'all' both write the records replay reads; name one of them")
        if "replay" in names and not set(CAPTURING) & set(names):
            names.insert(names.index("replay"), "capture")
    work = Path(args.work or tempfile.mkdtemp(prefix="sp-upstream-"))
    work.mkdir(parents=True, exist_ok=True)
    results = run_all(folder, files, args.cpu, names, args.timeout, work, args.deadline, args.jobs, framework,
                      args.engine)
    text, summary = report(folder, results, names, args.cpu, framework)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    complete = len(results) == len(names) and all(r["outcomes"] for r in results.values())
    return 0 if complete and not summary["differences"] and summary["adaptations_alike"] else 1


if __name__ == "__main__":
    sys.exit(main())
