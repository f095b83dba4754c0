"""examples/rl_loop.py: rollout (real SGLang), train (Megatron-Core twin), weight sync back,
three times; the engine serves weight versions 1, 2, 3 and agrees with the trainer; with
the twin's routers perturbed, replaying the engine's expert ids removes most of the
log-prob mismatch and replaying its ids and weights removes all of it."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
EXAMPLE = Path(__file__).parent.parent / "examples" / "rl_loop.py"


def max_dlogp(lines, label: str) -> list:
    return [float(re.search(r"max (\S+)", line).group(1)) for line in lines if line.startswith(f"  {label}:")]


@pytest.mark.slow
@pytest.mark.usefixtures("in_shared_code_cache")
def test_three_iterations_serve_weight_versions_1_2_3_and_replay_removes_the_mismatch(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path), "--router-noise", "0.3"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    served = [m.group(1) for line in lines if (m := re.match(r"iteration \d: engine served weight version (\S+);", line))]
    assert served == ["default", "1", "2"]
    assert "after 3 updates the engine serves weight version 3" in lines
    # Each rollout dumped into a run of its own; the first one's replay command is printed.
    dumps = next(tmp_path.glob("rl-*")) / "dumps"
    assert sorted(d.name for d in dumps.iterdir()) == ["final", "iteration-1", "iteration-2", "iteration-3", "startup"]
    from source_patch.runtime.core import commands  # the command as printed: runnable from a fresh shell

    assert lines[-1].startswith(f"  {commands.command('replay', dumps / 'iteration-1', '--checkpoint')} "), lines[-1]
    assert sum("success True" in line for line in lines) == 3
    # The engine computes what the trainer computes, with the trainer's pushed weights.
    for label in ("mismatch", "replay ids", "replay ids+weights"):
        assert len(max_dlogp(lines, label)) == 3 and max(max_dlogp(lines, label)) < 1e-4, label
    assert all(line.count("100.0%") == 2 for line in lines if line.startswith("  routing agreement"))
    # Perturbed routers: routes differ; ids replay leaves the recomputed weights' error, ids+weights none.
    noisy, ids, both = (max_dlogp(lines, f"router noise 0.3, {label}")
                        for label in ("mismatch", "replay ids", "replay ids+weights"))
    assert len(noisy) == len(ids) == len(both) == 3
    assert all(n > 1e-3 and b < 1e-5 and b < i < n for n, i, b in zip(noisy, ids, both)), (noisy, ids, both)
    assert all("100.0%" not in line for line in lines if line.startswith("  router noise 0.3, routing agreement"))
