"""examples/rl_loop.py: rollout (real SGLang), train (Megatron-Core twin), weight sync back,
three times; the engine serves weight versions 1, 2, 3 and agrees with the trainer."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
EXAMPLE = Path(__file__).parent.parent / "examples" / "rl_loop.py"


@pytest.mark.slow
def test_three_iterations_serve_weight_versions_1_2_3(tmp_path):
    out = subprocess.run([sys.executable, str(EXAMPLE), "--out", str(tmp_path)], capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = out.stdout.splitlines()
    served = [m.group(1) for line in lines if (m := re.match(r"iteration \d: engine served weight version (\S+);", line))]
    assert served == ["default", "1", "2"]
    assert lines[-1] == "after 3 updates the engine serves weight version 3"
    # The engine computes what the trainer computes, with the trainer's pushed weights.
    mismatches = [float(re.search(r"max (\S+)", line).group(1)) for line in lines
                  if re.match(r"  (mismatch|replay ids|replay ids\+weights):", line)]
    assert len(mismatches) == 9 and max(mismatches) < 1e-4  # no replay, ids, ids + weights; 3 iterations
    routing = [line for line in lines if "routing agreement per layer" in line]
    assert len(routing) == 3 and all(line.count("100.0%") == 2 for line in routing)
    assert sum("success True" in line for line in lines) == 3
