"""examples/features_pipeline.py end to end: a real SGLang server captures features into a
real Mooncake store, a separate trainer process consumes every sample exactly once."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).parent.parent / "examples" / "features_pipeline.py"


@pytest.mark.slow
@pytest.mark.usefixtures("in_shared_code_cache")
@pytest.mark.parametrize("store", ["mooncake"])  # dir://: test_features_store.py, and test_features_sglang.py's engine
def test_the_pipeline_example_trains_on_every_sample(tmp_path, store):
    pytest.importorskip("mooncake.store")
    out = subprocess.run([sys.executable, str(EXAMPLE), "--samples", "6", "--store", store, "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=600, env=dict(os.environ))
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trained = [line for line in out.stdout.splitlines() if line.startswith("trainer: sample ")]
    assert sorted(line.split()[2] for line in trained) == [f"sample-{i:03d}" for i in range(6)]
    assert out.stdout.splitlines()[-1] == "committed 6, in flight 0, acked 6, lost 0"
