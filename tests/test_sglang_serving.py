"""A real SGLang 0.5.23 engine on this CPU-only machine under source-patch specs:
patches/sglang_cpu.yaml lifts its CUDA assumptions in every engine process (reached
through SOURCE_PATCH and the start hook).  The HTTP server and the offline Engine
both generate what transformers computes on the same checkpoint."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang_reference import greedy

pytestmark = pytest.mark.slow

PROMPTS = [[1, 2, 3, 4, 5, 6, 7], [11, 12, 13], [900, 17, 4, 250, 31]]
NEW = 6


def test_sglang_cpu_checks_without_importing_sglang(check_sglang_spec):
    out = check_sglang_spec("sglang_cpu")
    for patch in ("torchvision-schemas", "rotary-native-without-cuda", "host-register-without-cuda"):
        assert f"{patch}: at " in out


def test_the_server_generates_what_transformers_computes(instrumented_sglang, hf_qwen3):
    server = instrumented_sglang.server
    first = server.generate(input_ids=PROMPTS, max_new_tokens=NEW, sampling={"ignore_eos": True})
    again = server.generate(input_ids=PROMPTS, max_new_tokens=NEW, sampling={"ignore_eos": True})
    tokens = [o["output_ids"] for o in first]
    assert tokens == [o["output_ids"] for o in again]  # greedy is deterministic run to run
    assert tokens == [greedy(hf_qwen3, p, NEW) for p in PROMPTS]
    assert all(o["meta_info"]["weight_version"] == "default" for o in first)


def test_the_offline_engine_generates_the_same(sglang_engine, hf_qwen3):
    engine = sglang_engine()  # sglang.Engine in its driver process, sglang_cpu only
    out = engine.generate(PROMPTS, {"max_new_tokens": NEW, "ignore_eos": True})
    assert [o["output_ids"] for o in out] == [greedy(hf_qwen3, p, NEW) for p in PROMPTS]


def test_a_server_that_cannot_start_is_reported_with_its_log(sglang_checkpoint, tmp_path):
    """The harness never hangs on a dead server, and says why it died."""
    from source_patch.testing.sglang import EngineError, SGLangServer

    with pytest.raises(EngineError, match=r"did not start(.|\n)*no-such-flag"):
        SGLangServer(sglang_checkpoint, args=["--no-such-flag"], workdir=tmp_path, timeout=120)


GUARDED = """
import os, sys, time
from pathlib import Path
from source_patch.testing.sglang import _Process
server = _Process([sys.executable, "-m", "source_patch.testing.sglang", "serve", "http.server", "0", "--bind",
                   "127.0.0.1"], dict(os.environ), Path(sys.argv[1]), "server")
print(server.proc.pid, flush=True)
time.sleep(600)
"""


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # (a zombie is gone)
    except (FileNotFoundError, IndexError):
        return False


def test_a_server_ends_with_the_test_process_that_started_it(tmp_path):
    """SGLangServer runs its server under ``python -m source_patch.testing.sglang serve``:
    when the process that started it dies without closing it (a killed pytest worker
    runs no teardown), the server's process group ends instead of outliving the run
    (two SGLang servers, ~2.6 GB, once did).  Shown on a module that serves forever."""
    parent = subprocess.Popen([sys.executable, "-c", GUARDED, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    server = int(parent.stdout.readline())
    time.sleep(1.0)
    assert _running(server)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 20
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.2)
    alive = _running(server)
    if alive:
        os.killpg(server, signal.SIGKILL)
    assert not alive, "the server outlived the process that started it"
