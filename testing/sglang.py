"""A real SGLang engine for tests and examples, isolated in processes of its own.

    from source_patch.testing.sglang import SGLangServer, SGLangEngine, tiny_checkpoint

    model = tiny_checkpoint()                                   # a tiny random Qwen3-MoE, cached
    with SGLangServer(model, specs=["routing"]) as server:   # python -m sglang.launch_server
        out = server.generate(input_ids=[1, 2, 3], max_new_tokens=4)
    with SGLangEngine(model, specs=["dump"]) as engine:  # sglang.Engine in a driver process
        out = engine.generate([[1, 2, 3]], {"temperature": 0, "max_new_tokens": 4})

The server and the engine's driver run in their own sessions: SGLang kills its whole
process tree when a child fails at start-up (its SIGQUIT handler), which must never
take the caller (pytest) with it; close() ends the whole group.  Specs reach SGLang's
spawned scheduler processes through SOURCE_PATCH and the start hook; ``sglang_cpu``
is always added, so the engine runs on a CPU-only machine.  The driver speaks JSON
lines on its stdin/stdout (no pickle).  pytest users get the ``sglang_checkpoint``,
``sglang_server`` and ``sglang_engine`` fixtures (testing/pytest_plugin.py).

Importing this module imports nothing heavy; the checkpoint is built in a subprocess.
"""

from __future__ import annotations

import hashlib
import json
import os
import runpy
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

from source_patch.runtime.core.endpoint import free_port  # noqa: F401 - part of this module's API

START_TIMEOUT = 300.0   # seconds; an engine starts in 25-60 s on 2 busy cores
ENGINE_ARGS = {         # what a real engine needs on CPU (see docs/sglang.md)
    "device": "cpu", "attention_backend": "torch_native", "sampling_backend": "pytorch",
    "disable_cuda_graph": True, "mem_fraction_static": 0.5, "max_total_tokens": 4096, "dtype": "float32",
    # An idle scheduler otherwise spins at 25-55% of a core: a few shared engines left
    # idle in a test session would starve every other test on a small machine.
    "sleep_on_idle": True,
}
TINY_QWEN3_MOE = dict(  # Qwen3MoeConfig fields of the tiny model (seed 0)
    vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
    norm_topk_prob=True, tie_word_embeddings=False, max_position_embeddings=512,
)
SENTENCES = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test.",
             "Megatron trains, SGLang serves, source-patch watches both."]


class EngineError(RuntimeError):
    """The engine did not start, died, or refused a request; the message has the log's tail."""


# ---------------------------------------------------------------- checkpoint


def cache_root() -> Path:
    return Path(os.environ.get("SOURCE_PATCH_SGLANG_CACHE") or Path.home() / ".cache" / "source-patch" / "sglang")


def tiny_checkpoint(cache_dir: str | os.PathLike | None = None, seed: int = 0, **config) -> Path:
    """A tiny random Qwen3-MoE checkpoint (safetensors) with a byte-level BPE tokenizer,
    built once per (config, seed) under ``cache_dir`` and reused; ``config`` overrides
    fields of :data:`TINY_QWEN3_MOE`.  Built in a temp folder and renamed into place,
    so an interrupted build never leaves a half checkpoint behind."""
    fields = {**TINY_QWEN3_MOE, **config}
    digest = hashlib.sha256(json.dumps([fields, seed, SENTENCES], sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / f"qwen3-moe-{digest}"
    if (target / "model.safetensors").is_file() and (target / "tokenizer.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=".build-") as tmp:
        build = Path(tmp) / "model"
        request = json.dumps({"config": fields, "seed": seed, "out": str(build)})
        result = subprocess.run([sys.executable, "-m", __name__, "checkpoint", request],
                                capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            raise EngineError(f"building the tiny checkpoint failed:\n{result.stderr[-4000:]}")
        try:
            os.replace(build, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not another process's finished build
                raise
    return target


def _build_checkpoint(request: dict) -> None:
    import torch

    _define_torchvision_schemas(torch)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(request["seed"])
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**request["config"]))
    model.save_pretrained(request["out"], safe_serialization=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=min(1000, request["config"]["vocab_size"] - 8),
                                  special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 10, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(request["out"])


def _define_torchvision_schemas(torch) -> None:
    """transformers imports torchvision, whose only build on the index needs these
    schemas beside a CPU torch (the same fix as patches/sglang_cpu.yaml)."""
    for name in ("nms", "qnms"):
        try:
            torch.library.define(f"torchvision::{name}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
        except RuntimeError:
            pass


# ---------------------------------------------------------------- processes


def _environment(specs, env: dict | None, workdir: Path) -> dict:
    names = ["sglang_cpu", *[str(s) for s in specs if str(s) != "sglang_cpu"]]
    resolved = [str(Path(s).resolve()) if (os.sep in s or s.endswith(".yaml")) else s for s in names]
    environ = {**os.environ, "SOURCE_PATCH": ",".join(resolved), "SOURCE_PATCH_WORKDIR": str(workdir),
               "PYTHONUNBUFFERED": "1"}
    environ.update({k: str(v) for k, v in (env or {}).items()})
    return environ


class _Process:
    """A child in its own session with a log file; close() ends its whole group."""

    def __init__(self, argv: list, environ: dict, workdir: Path, name: str):
        self.workdir = workdir
        self.log_path = workdir / f"{name}.log"
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, env=environ, cwd=workdir, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.PIPE, start_new_session=True)

    def log_tail(self, chars: int = 6000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def check_alive(self, what: str) -> None:
        if self.proc.poll() is not None:
            raise EngineError(f"{what}: the process exited with {self.proc.returncode}; log "
                              f"{self.log_path}:\n{self.log_tail()}")

    def close(self, timeout: float = 20.0) -> None:
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    self.proc.wait(wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        self._reap_group()
        if not self._log.closed:
            self._log.close()

    def _reap_group(self) -> None:
        """SGLang's children may outlive the leader: kill what is left of the group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


class SGLangServer:
    """``python -m sglang.launch_server`` on 127.0.0.1 with ``specs`` active."""

    def __init__(self, model_path, specs=(), args=(), env: dict | None = None,
                 workdir: str | os.PathLike | None = None, timeout: float = START_TIMEOUT):
        self.model_path = Path(model_path)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="sp-sglang-server-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", __name__, "serve", "sglang.launch_server", "--model-path", str(self.model_path),
                "--host", "127.0.0.1", "--port", str(self.port), *_flags(ENGINE_ARGS), *map(str, args)]
        self._process = _Process(argv, _environment(specs, env, self.workdir), self.workdir, "server")
        try:
            self._wait_ready(timeout)
        except BaseException:
            self.close()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._process.check_alive("sglang.launch_server did not start")
            try:
                if self.get("/health", timeout=5)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise EngineError(f"sglang.launch_server not ready after {timeout:.0f} s; log "
                          f"{self._process.log_path}:\n{self._process.log_tail()}")

    def request(self, method: str, path: str, body=None, timeout: float = 120.0) -> tuple:
        """(status, parsed JSON or text) of one HTTP request; never raises on a status."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            status, raw = exc.code, exc.read()
        try:
            return status, json.loads(raw)
        except ValueError:
            return status, raw.decode(errors="replace")

    def get(self, path: str, timeout: float = 60.0) -> tuple:
        return self.request("GET", path, timeout=timeout)

    def post(self, path: str, body=None, timeout: float = 120.0) -> tuple:
        return self.request("POST", path, {} if body is None else body, timeout)

    def generate(self, input_ids=None, text=None, max_new_tokens: int = 8, temperature: float = 0.0,
                 sampling: dict | None = None, **fields):
        """POST /generate; ``input_ids`` a list (one request) or a list of lists (a batch)."""
        body = {"sampling_params": {"temperature": temperature, "max_new_tokens": max_new_tokens,
                                    **(sampling or {})}, **fields}
        if input_ids is not None:
            body["input_ids"] = input_ids
        if text is not None:
            body["text"] = text
        status, reply = self.post("/generate", body)
        if status != 200:
            raise EngineError(f"/generate answered {status}: {reply}")
        return reply

    def log_tail(self, chars: int = 6000) -> str:
        return self._process.log_tail(chars)

    def alive(self) -> bool:
        return self._process.proc.poll() is None

    def close(self) -> None:
        self._process.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SGLangEngine:
    """The offline ``sglang.Engine``, in a driver process of its own (JSON lines)."""

    def __init__(self, model_path, specs=(), engine_args: dict | None = None, env: dict | None = None,
                 workdir: str | os.PathLike | None = None, timeout: float = START_TIMEOUT):
        self.model_path = Path(model_path)
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="sp-sglang-engine-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        kwargs = {"model_path": str(self.model_path), "skip_tokenizer_init": True, **ENGINE_ARGS,
                  **(engine_args or {})}
        self._reply_path = self.workdir / "driver.out"
        argv = [sys.executable, "-m", __name__, "engine", json.dumps(kwargs), str(self._reply_path)]
        self._process = _Process(argv, _environment(specs, env, self.workdir), self.workdir, "engine")
        self._replies = None
        try:
            self._await("started", timeout)
        except BaseException:
            self.close()
            raise

    def _await(self, what: str, timeout: float) -> dict:
        """The driver's next reply line (its replies go to a file: SGLang prints to stdout)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._replies is None and self._reply_path.exists():
                self._replies = open(self._reply_path)
            line = self._replies.readline() if self._replies is not None else ""
            if line.endswith("\n"):
                reply = json.loads(line)
                if not reply.get("ok"):
                    raise EngineError(f"{what}: {reply.get('error')}\n{self._process.log_tail()}")
                return reply
            self._process.check_alive(what)
            time.sleep(0.05)
        raise EngineError(f"{what}: no reply after {timeout:.0f} s; log {self._process.log_path}:\n"
                          f"{self._process.log_tail()}")

    def _ask(self, message: dict, timeout: float) -> object:
        self._process.check_alive(message["op"])
        self._process.proc.stdin.write((json.dumps(message) + "\n").encode())
        self._process.proc.stdin.flush()
        return self._await(message["op"], timeout).get("result")

    def generate(self, input_ids, sampling_params: dict | None = None, timeout: float = 300.0, **kwargs):
        """``Engine.generate(input_ids=..., sampling_params=..., **kwargs)``."""
        params = {"temperature": 0.0, "max_new_tokens": 8, **(sampling_params or {})}
        return self._ask({"op": "call", "method": "generate",
                          "kwargs": {"input_ids": input_ids, "sampling_params": params, **kwargs}}, timeout)

    def call(self, method: str, timeout: float = 300.0, **kwargs):
        """Any Engine method by name with JSON arguments (init_weights_update_group, ...);
        the result comes back JSON-encoded (other objects as their str)."""
        return self._ask({"op": "call", "method": method, "kwargs": kwargs}, timeout)

    def log_tail(self, chars: int = 6000) -> str:
        return self._process.log_tail(chars)

    def close(self) -> None:
        proc = self._process.proc
        if proc.poll() is None:
            try:
                proc.stdin.write(b'{"op": "shutdown"}\n')
                proc.stdin.flush()
                proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                pass
        self._process.close()
        if self._replies is not None:
            self._replies.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _flags(args: dict) -> list:
    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags += [flag, str(value)]
    return flags


# ---------------------------------------------------------------- the driver process


def _drive_engine(kwargs: dict, reply_path: str) -> None:
    """Run ``sglang.Engine(**kwargs)`` and answer JSON requests from stdin."""
    with open(reply_path, "w") as replies:
        def reply(**message):
            replies.write(json.dumps(message, default=str) + "\n")
            replies.flush()

        try:
            import sglang

            engine = sglang.Engine(**kwargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the caller, then exit
            reply(ok=False, error=f"sglang.Engine failed: {type(exc).__name__}: {exc}")
            raise
        reply(ok=True, result="started")
        for line in sys.stdin:
            message = json.loads(line)
            if message["op"] == "shutdown":
                break
            try:
                result = getattr(engine, message["method"])(**message.get("kwargs", {}))
                reply(ok=True, result=result)
            except Exception as exc:  # noqa: BLE001 - the caller sees it as EngineError
                reply(ok=False, error=f"{message.get('method')}: {type(exc).__name__}: {exc}")
        engine.shutdown()


def _serve(module: str, args: list) -> None:
    """``python -m MODULE ARGS`` in this process, and its whole process group ended once
    stdin closes: the test process that started it died without closing it (a killed
    pytest worker runs no teardown), so no server outlives its test run.  (The engine
    driver ends at stdin's end by itself.)"""
    def watch() -> None:
        sys.stdin.buffer.read()
        os.killpg(0, signal.SIGTERM)
        time.sleep(10.0)  # (only reached if SIGTERM spared this process)
        os.killpg(0, signal.SIGKILL)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["checkpoint"]:
        _build_checkpoint(json.loads(argv[1]))
    elif argv[:1] == ["engine"]:
        _drive_engine(json.loads(argv[1]), argv[2])
    elif argv[:1] == ["serve"] and len(argv) > 1:
        _serve(argv[1], argv[2:])
    else:
        print("usage: python -m source_patch.testing.sglang checkpoint JSON | engine KWARGS REPLIES"
              " | serve MODULE ARGS...", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
