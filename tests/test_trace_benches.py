"""The trace benches' CPU smoke runs: they run, and what they print holds together
(bench/compressor_bench.py, bench/trace_bench.py --calls with bench/gc_probe.py).
overhead_bench.py's `everything at once`, which traces with a client too, is checked in
tests/test_overhead_bench.py."""

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout


def test_the_compressor_bench_times_due_calls_back_to_back_and_after_other_work():
    out = run("bench/compressor_bench.py", "--quick")
    rows = {m.group(1).strip(): (float(m.group(2)), float(m.group(3)))
            for m in re.finditer(r"^(.{1,48}?)\s+([\d.]+)\s+([\d.]+)$", out, re.M)}
    for hub in range(2):  # hub: process, hub: thread
        disabled, due = rows["disabled"][hub], rows["tiles subscription, due"][hub]
        assert 0 < disabled < due, rows
        assert rows["the same, after other work"][hub] > 0, rows


def test_the_due_call_bench_counts_the_planned_calls_bytecodes_and_times_it_whole_and_cut():
    out = run("bench/due_call_bench.py", "--rounds", "2", "--calls", "200", "--lines", "--cuts", "--cold-rounds", "2")
    counted = dict((f, int(n)) for f, n in re.findall(r"(\w+) (\d+)", out.split("bytecodes a call runs: ")[1].splitlines()[0]))
    assert counted["_fast"] > 100, out
    assert re.search(r"^planned due call, the state put back after\s+[\d.]+ / [\d.]+ \[", out, re.M), out
    # every cut's line found in api._fast (else the bench exits), each row timed
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        from due_call_bench import CUTS, cut
    finally:
        sys.path.remove(str(ROOT / "bench"))
    assert all(callable(cut(marker)) for _, marker, _ in CUTS)  # the native launch's lines too (a GPU's)
    table = out.split("cut after each part")[1]
    direct = [label for label, _, part in CUTS if part != "native"]
    for label in direct + ["the whole call", "a lock taken and given back"]:
        assert re.search(rf"^{re.escape(label)}\s+[\d.]+", table, re.M), (label, table)


def test_the_due_call_bench_times_the_compiled_call_against_the_python_one(native_build, monkeypatch):
    """--compiled on the CPU: the native plan's call from Python and compiled, a stand-in
    launch, cold, alternated, with a paired ratio; without a build it says what to do."""
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build))
    out = run("bench/due_call_bench.py", "--compiled", "--cold-rounds", "4")
    table = out.split("the whole call, cold")[1]
    for row in ("the call in Python (api._fast)", "the call compiled (due)"):
        assert re.search(rf"^{re.escape(row)}\s+[\d.]+ / [\d.]+ \[", table, re.M), table
    assert re.search(r"^now / then, paired by round\s+[\d.]+x \(", table, re.M), table
    monkeypatch.setenv("SOURCE_PATCH_NATIVE_DIR", str(native_build / "none here"))
    bad = subprocess.run([sys.executable, "bench/due_call_bench.py", "--compiled"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode != 0 and "--compiled: no native launch built" in bad.stderr, bad.stderr


def test_the_due_call_bench_times_the_call_against_another_version_and_a_cut_gives_the_lock_back(tmp_path):
    """--against: another version's call (here an api.py file: today's, under another
    name) and today's, cold, alternated, with a paired ratio; a bad revision is refused
    by name.  A cut inside the lock's try runs its finally: the lock is free after it."""
    other = tmp_path / "api_then.py"
    other.write_text((ROOT / "runtime" / "trace" / "api.py").read_text())
    out = run("bench/due_call_bench.py", "--rounds", "1", "--calls", "100", "--against", str(other),
              "--cold-rounds", "4")
    table = out.split("the whole call, cold")[1]
    assert re.search(r"^the call at api_then\.py\s+[\d.]+ / [\d.]+ \[", table, re.M), table
    assert re.search(r"^the call now\s+[\d.]+ / [\d.]+ \[", table, re.M), table
    assert re.search(r"^now / then, paired by round\s+[\d.]+x \([\d.]+ \.\. [\d.]+\)", table, re.M), table
    bad = subprocess.run([sys.executable, "bench/due_call_bench.py", "--against", "no-such-revision"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--against no-such-revision: neither a file nor a revision" in bad.stderr, bad.stderr
    # in a process of its own: the bench's stand-ins replace the trace runtime's state
    # (its publisher, ring, streams), which later tests of this worker would inherit
    out = run("-c", LOCK_CHECK)
    found = re.fullmatch(r"cuts (\d+) ok\s*", out)
    assert found and int(found.group(1)) >= 5, out


# every direct cut that gets as far as its line returns True; the lock must be free after
# each, and the cut inside the lock closes the lock's try with its own finally
LOCK_CHECK = """
import sys, inspect, textwrap
sys.path.insert(0, "bench")
import torch
import due_call_bench as bench
x = torch.randn(bench.LAYOUT)
plan = bench.stand_ins(x)
_, put_back, _ = bench.due_call(plan, x)
done = 0
for label, marker, part in bench.CUTS:
    if part != "native" and bench.cut(marker)(plan, ("h", 1), x, {"layer": 1}) is True:
        assert not bench.api._lock.locked(), label
        done += 1
        put_back()
lines = textwrap.dedent(inspect.getsource(bench.api._fast)).split("\\n")
at = next(i for i, line in enumerate(lines) if "head = ring.head" in line)
assert "lock.release()" in "\\n".join(bench.closers(lines, at))
print("cuts", done, "ok")
"""


def test_trace_bench_calls_times_the_parts_of_each_due_call_in_training():
    out = run("bench/trace_bench.py", "--quick", "--resolve", "--calls", "--toggle-steps", "40")
    parts = {m.group(1): int(m.group(3)) for m in
             re.finditer(r"^toggling client, \s*(.+?): first [\d.]+ ms, then mean ([\d.]+) us; (\d+) calls", out, re.M)}
    calls = parts["due call, general path (_compress)"]
    assert calls > 0 and parts["device stage (launch, ring)"] == calls, parts  # one device stage per due call
    report = re.search(r"^toggling client: \[\{'traced': (\d+).*'due trace\(\) calls': '(\d+) calls, mean ([\d.]+) us",
                       out, re.M)
    assert report and int(report.group(1)) > 0 and int(report.group(2)) > 0, out  # the probe left frames flowing
    assert float(report.group(3)) > 0, out
