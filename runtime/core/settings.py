"""Settings of runtime components: their schemas, and where values come from.

A value is taken, in order of precedence, from the environment
(``SOURCE_PATCH_<COMPONENT>_<KEY>``), then from the ``runtime:`` section of the
active specs (later specs win; a ``component[distribution]`` section counts once a
patch requiring that distribution has applied), then from the schema's default.  This module
imports nothing heavy: the spec loader uses it to validate ``runtime:`` sections.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class Setting:
    default: Any
    parse: Callable[[Any], Any]  # raises ValueError/TypeError with a message for bad values
    help: str


# component -> key -> Setting.  Components register their schema here, not in their
# own (heavier) modules, so specs can be validated without importing them.
SCHEMAS: dict[str, dict[str, Setting]] = {}


def check(component: str, key: str, value: Any) -> Any:
    """The parsed value; KeyError naming the valid keys, or ValueError/TypeError."""
    schema = SCHEMAS[component]
    if key not in schema:
        raise KeyError(f"unknown key {key!r} for runtime component {component!r} "
                         f"(valid keys: {', '.join(sorted(schema))})")
    return schema[key].parse(value)


def check_all(component: str, changes: dict) -> dict[str, Any]:
    """Every change parsed before any is applied (a capability's ``configure``): the
    first bad one raises as ``check`` does, and nothing has changed."""
    return {key: check(component, key, value) for key, value in changes.items()}


def resolve(component: str, environ=os.environ) -> dict[str, Any]:
    """Effective settings of a component: environment over specs over defaults."""
    schema = SCHEMAS[component]
    values = {key: setting.default for key, setting in schema.items()}
    finder = _finder()
    for spec in finder.specs if finder else ():
        values.update(spec.runtime.get(component, {}))
        for (name, dist), scoped in spec.scoped_runtime.items():  # `dump[sglang]:` in a spec
            if name == component and dist in finder.applied_dists:
                values.update(scoped)
    for key in schema:
        raw = environ.get(variable(component, key))
        if raw is not None:
            values[key] = from_environ(component, key, raw)
    return values


def variable(component: str, key: str) -> str:
    """The environment variable of a setting: ``SOURCE_PATCH_DUMP_PORT``."""
    return f"SOURCE_PATCH_{component.upper()}_{key.upper()}"


def from_environ(component: str, key: str, raw: str) -> Any:
    """An environment value parsed; ValueError naming the variable, the value and what is allowed."""
    try:
        return check(component, key, raw)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{variable(component, key)}={raw!r}: {exc}") from None


def environ_errors(environ=os.environ) -> list[str]:
    """One line per ``SOURCE_PATCH_<COMPONENT>_<KEY>`` its schema refuses.  Activation
    checks them all (patcher/activation.py): a bad one is refused at start-up, not at a
    call site deep in the job."""
    errors = []
    for component, schema in SCHEMAS.items():
        for key in schema:
            raw = environ.get(variable(component, key))
            if raw is not None:
                try:
                    from_environ(component, key, raw)
                except ValueError as exc:
                    errors.append(str(exc))
    return errors


def _finder():
    import sys

    activation = sys.modules.get("source_patch.patcher.activation")
    return activation.installed_finder() if activation else None


# -- parsers shared by components


def boolean(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (true/false, 1/0, yes/no, on/off), got {value!r}")


def integer(low: int | None = None) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected an integer, got {type(value).__name__}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"expected an integer, got {value!r}") from None
        if low is not None and number < low:
            raise ValueError(f"expected an integer >= {low}, got {number}")
        return number
    return parse


def choice(*options: str) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        if value not in options:
            raise ValueError(f"expected one of {', '.join(options)}, got {value!r}")
        return value
    return parse


def redacted(config: dict) -> dict:
    """A copy of a component's configuration that is safe to show: no token value."""
    config = dict(config)
    if config.get("token"):
        config["token"] = "<set>"
    return config


def text(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {type(value).__name__}")
    return value


# -- the dump runtime (source_patch.runtime.dump.api)
#
# Parsers accept both the forms a spec or a JSON request gives (lists, ints, bools)
# and the comma-separated strings an environment variable gives.  Their outputs are
# JSON-serialisable (a spec keeps them as canonical JSON).


def _items(value: Any, what: str) -> list:
    if isinstance(value, str):
        return [part.strip() for part in value.split(",") if part.strip()]
    if isinstance(value, (list, tuple)):
        return list(value)
    raise TypeError(f"expected {what} (a list or a comma-separated string), got {type(value).__name__}")


def string_list(value: Any) -> list[str] | None:
    """A list of non-empty strings; None, '' and [] mean "no filter" (None)."""
    if value is None:
        return None
    out = []
    for item in _items(value, "strings"):
        if not isinstance(item, str):
            raise TypeError(f"expected strings, got {type(item).__name__} {item!r}")
        if item.strip():
            out.append(item.strip())
    return out or None


def int_filter(value: Any) -> list | None:
    """Non-negative integers and ranges: ``"0-3,7,10-"`` or ``[0, "2-5", 9]``.

    Canonical form: a list of ints and ``"lo-hi"`` / ``"lo-"`` strings (inclusive,
    ``lo-`` is open-ended).  None, '' and [] mean "no filter" (None).
    """
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]
    out: list = []
    for item in _items(value, "integers or ranges"):
        if isinstance(item, bool) or not isinstance(item, (int, str)):
            raise TypeError(f"expected an integer or a range such as '0-3', got {type(item).__name__} {item!r}")
        if isinstance(item, int):
            if item < 0:
                raise ValueError(f"expected integers >= 0, got {item}")
            out.append(item)
            continue
        text_ = item.strip()
        low, dash, high = text_.partition("-")
        try:
            lo = int(low)
            hi = int(high) if high.strip() else None
        except ValueError:
            raise ValueError(f"expected an integer or a range such as '0-3' or '10-', got {item!r}") from None
        if lo < 0 or (hi is not None and hi < lo):
            raise ValueError(f"bad range {item!r}: expected 0 <= low <= high")
        if not dash:
            out.append(lo)
        else:
            out.append(f"{lo}-{'' if hi is None else hi}")
    return out or None


class IntSet:
    """Membership in a canonical int filter (settings.int_filter): ints and 'lo-hi' / 'lo-'."""

    __slots__ = ("ints", "ranges")

    def __init__(self, spec: list):
        self.ints = frozenset(i for i in spec if isinstance(i, int))
        self.ranges = []
        for item in spec:
            if isinstance(item, str):
                low, _, high = item.partition("-")
                self.ranges.append((int(low), int(high) if high else None))

    def __contains__(self, value) -> bool:
        if isinstance(value, bool) or not isinstance(value, int):
            return False
        return value in self.ints or any(lo <= value and (hi is None or value <= hi) for lo, hi in self.ranges)


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
               "tib": 1 << 40}


def size(low: int = 0) -> Callable[[Any], int]:
    """A byte count: an integer, or a string with a binary unit ('512M', '2GiB', '64k')."""
    def parse(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise TypeError(f"expected a byte count (e.g. 1073741824 or '1G'), got {type(value).__name__}")
        if isinstance(value, int):
            number = value
        else:
            raw = value.strip().lower().replace("_", "")
            digits = raw.rstrip("abcdefghijklmnopqrstuvwxyz ")
            unit = raw[len(digits):].strip()
            if unit not in _SIZE_UNITS or not digits:
                raise ValueError(f"expected a byte count such as 1073741824, '512M' or '2GiB', got {value!r}")
            try:
                number = int(float(digits) * _SIZE_UNITS[unit])
            except (ValueError, OverflowError):  # 'nan', '1e400'
                raise ValueError(f"expected a byte count such as '512M', got {value!r}") from None
        if number < low:
            raise ValueError(f"expected a byte count >= {low}, got {number}")
        return number
    return parse


def seconds(positive: bool = False) -> Callable[[Any], float]:
    """A number of seconds: finite and >= 0, or (``positive``) > 0, infinity allowed."""
    def parse(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, str)):
            raise TypeError(f"expected a number of seconds, got {type(value).__name__}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"expected a number of seconds, got {value!r}") from None
        if positive and not number > 0:
            raise ValueError(f"expected a positive number of seconds, got {value!r}")
        if not positive and (not number >= 0 or number == float("inf")):
            raise ValueError(f"expected a finite number of seconds >= 0, got {value!r}")
        return number
    return parse


def _port(value: Any) -> int:
    try:
        number = integer(low=0)(value)
    except ValueError:
        number = -1  # not a number, or negative: said as the range below, with the value given
    if not 0 <= number <= 65535:
        raise ValueError(f"expected a port number 0-65535, got {value!r}")
    return number


def _exp_name(value: Any) -> str:
    name = text(value).strip()
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"expected a plain directory name (no '/', '\\' or NUL, not '.' or '..'), got {value!r}")
    return name


def _rank_dir(value: Any) -> str:
    name = text(value).strip()
    if name.count("{rank}") != 1 or name.replace("{rank}", "").strip("-_.").count("{") or \
            "}" in name.replace("{rank}", "") or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise ValueError(f"expected a plain folder name with one {{rank}} in it (e.g. 'rank-{{rank}}'), "
                         f"got {value!r}")
    return name


def _nonempty_text(value: Any) -> str:
    if not text(value).strip():
        raise ValueError("expected a non-empty string")
    return value.strip()


SCHEMAS["dump"] = {
    "enable": Setting(False, boolean, "dump at all; when false a dump() call costs one flag test"),
    "dir": Setting("./sp-dumps", _nonempty_text, "root directory; records go to <dir>/<exp_name>/rank-<r>/"),
    "exp_name": Setting("default", _exp_name, "experiment name: the directory under dir"),
    "rank_dir": Setting("rank-{rank}", _rank_dir, "each process's folder under dir/exp_name; {rank} is its "
                        "global rank (the SGLang dump spec uses engine_{rank})"),
    "names": Setting(None, string_list, "record names to keep (fnmatch globs such as 'attn_*'); empty = all"),
    "layers": Setting(None, int_filter, "layer tags to keep ('0-3,7'); records without a layer tag are skipped"),
    "steps": Setting(None, int_filter, "steps to keep ('0-3,100-')"),
    "ranks": Setting(None, int_filter, "global ranks that dump ('0,8-15')"),
    "phases": Setting(None, string_list, "phase tags to keep (inference, fwd_only, fwd_bwd, ...)"),
    "queue_bytes": Setting(1 << 30, size(low=1), "bytes of copies waiting for the writer (host memory bound)"),
    "on_full": Setting("block", choice("block", "drop"),
                       "when the queue is full: block the caller until there is room, or drop the record"),
    "file_bytes": Setting(256 << 20, size(low=1), "the writer packs queued records into files of up to this size"),
    "gpu_copy": Setting("clone", choice("clone", "direct"),
                        "clone: device copy on the current stream, then async D2H (safe against in-place reuse); "
                        "direct: async D2H from the tensor itself (no device memory, not safe if it is overwritten)"),
    "fsync": Setting(False, boolean, "fsync each file and manifest append (durable across a machine crash; slower)"),
    "drop_behind": Setting(True, boolean, "files older than the dump's newest drop_behind_bytes leave the page "
                           "cache (the writer advises them away): a large dump neither evicts what training reads "
                           "nor fills memory the machine never used (no first-run cliff on a VM); it then runs at "
                           "the disk's speed"),
    "drop_behind_bytes": Setting(2 << 30, size(), "bytes of the newest dump files left in the page cache with "
                                 "drop_behind (a dump smaller than this is never advised away; 0: every file as "
                                 "soon as written)"),
    "port": Setting(0, _port, "HTTP control endpoint: 0 = off, else listen on port + LOCAL_RANK"),
    "host": Setting("127.0.0.1", _nonempty_text, "address the control endpoint binds"),
    "token": Setting("", text, "bearer token of the control endpoint; empty = generate one per process"),
    "max_request_bytes": Setting(64 << 10, size(low=1), "largest request body the control endpoint reads"),
}


# -- routing capture / replay (source_patch.runtime.routing.megatron.control, patches/routing.yaml)

SCHEMAS["routing"] = {
    "mode": Setting("off", choice("off", "capture", "replay"),
                    "off: every call site costs one flag test; capture: keep the top-k indices of every "
                    "(step, microbatch, layer); replay: route with recorded indices"),
    "dir": Setting("", text, "capture: records are written here at each step end (and at exit); "
                             "replay: records are read from here; empty = in memory only (capture)"),
    "probs": Setting(False, boolean, "capture also the combine weights (probs) of the chosen experts"),
    "replay_probs": Setting(False, boolean, "replay also the recorded combine weights (the record's probs) "
                                            "instead of recomputing them from live scores; no gradient then "
                                            "reaches the router through them"),
}


# -- routing capture / replay in SGLang (source_patch.runtime.routing.sglang.control, patches/routing.yaml)


def _mode(value: Any) -> str:
    return choice("off", "capture", "replay")(str(value).strip().lower())


SCHEMAS["sglang_routing"] = {
    "mode": Setting("off", _mode, "off: every call site costs one flag test; capture: keep each request's "
                                  "routed expert ids; replay: route each request with its record's ids"),
    "dir": Setting("", text, "capture: each finished request's record goes to <dir>/rank<R>/<rid>.safetensors "
                             "(empty: kept in memory)"),
    "replay": Setting("", text, "replay: a folder as capture writes it, or one record file; a folder without "
                                "records replays nothing (one warning)"),
}


# -- live tensor tracing (source_patch.runtime.trace.control, patches/trace.yaml)


SCHEMAS["trace"] = {
    "enable": Setting(False, boolean, "trace at all; when false a trace() call costs one flag test"),
    "host": Setting("127.0.0.1", _nonempty_text, "address the hub (WebSocket + page) binds"),
    "port": Setting(0, _port, "hub port: 0 = no hub (nothing traced), else listen on port + LOCAL_RANK"),
    "token": Setting("", text, "token clients must send; empty = generate one per process "
                               "(written with the URL to a 0600 file under dir)"),
    "dir": Setting("./sp-trace", _nonempty_text, "where a process writes its URL + generated token file"),
    "ranks": Setting([0], int_filter, "global ranks that trace and serve a hub ('0,8-15'); empty = all"),
    "max_message": Setting(64 << 10, size(low=256), "largest client-to-hub message; larger closes with 1009"),
    "client_queue": Setting(64, integer(low=1), "frames waiting per client; more are dropped (and counted)"),
    "stall_timeout": Setting(5.0, seconds(), "a client whose queue stays full, or whose send blocks, this "
                                            "long is closed with 1008 'too slow'"),
    "queue": Setting(256, integer(low=1), "results waiting for the publisher thread; more are dropped"),
    "max_clients": Setting(8, integer(low=1), "connections one hub accepts at once"),
    "raw_max_elements": Setting(1 << 16, integer(low=1), "the raw compressor's cap (and default)"),
    "wait": Setting(0.0, seconds(), "seconds the process waits, when its hub starts, for a first "
                                   "subscription (0 = never; a scripted capture sets it to miss no step)"),
    "hub": Setting("process", choice("process", "thread"), "where the hub, frame encoding and the "
                   "compressors' host stage run: a forwarder process (off this process's GIL) or a thread"),
    "triton": Setting(True, boolean, "tiles of a CUDA tensor in one fused Triton kernel when Triton can be "
                                     "imported (false: one torch reduction per statistic)"),
    "triton_launch": Setting("auto", choice("auto", "direct", "native", "triton"), "the fused kernel's "
                             "launches after the first of each input layout: straight into its compiled "
                             "launcher (direct: less host time a call), the planned due call compiled whole with "
                             "source-patch's own launch (native: built by `source-patch build-native`; "
                             "where not built, said once and direct), native where built and else direct, "
                             "silently (auto), or through Triton's own dispatch every call (triton)"),
    "device_timing": Setting(False, boolean, "time each traced reduction on the GPU with CUDA events "
                                             "(stats: cost_seconds.device_reduce); one more event per result"),
}


# -- weight sync, trainer -> engines (source_patch.runtime.weight_sync.sync, patches/weight_sync.yaml)


SCHEMAS["weight_sync"] = {
    "enable": Setting(False, boolean, "trainer: push the weights after every `every` successful optimizer "
                                      "steps; when false the call site costs one flag test"),
    "host": Setting("127.0.0.1", _nonempty_text, "rendezvous address: the trainer's TCPStore, where "
                                                 "engine ranks connect (SGLang's master_address)"),
    "port": Setting(0, _port, "rendezvous port (SGLang's master_port); required when enabled"),
    "world_size": Setting(2, integer(low=2), "ranks in the update group: 1 trainer + every engine rank"),
    "group_name": Setting("source_patch_weights", _nonempty_text, "the update group's name (SGLang's group_name)"),
    "backend": Setting("auto", choice("auto", "nccl", "gloo", "ipc", "mooncake"),
                       "how updates reach the engines: nccl / gloo broadcast over the update group (auto: nccl "
                       "when CUDA is available, else gloo); ipc: colocated, engines copy from the trainer's "
                       "exported memory (CUDA IPC; shared memory on CPU); mooncake: engines read the trainer's "
                       "registered memory through a Mooncake TransferEngine (docs/weight_sync.md, Backends)"),
    "engines": Setting(None, string_list, "trainer, ipc / mooncake: the engines' HTTP URLs "
                       "(http://127.0.0.1:30000,...); each update is posted to each as SGLang's "
                       "update_weights_from_tensor with load_format source_patch"),
    "mooncake_host": Setting("127.0.0.1", _nonempty_text, "mooncake: the address this process's "
                             "TransferEngine advertises to its peers (trainer and engines)"),
    "mooncake_metadata": Setting("P2PHANDSHAKE", _nonempty_text, "mooncake: where TransferEngines find each "
                                 "other: P2PHANDSHAKE (directly) or a metadata server's URL, e.g. a "
                                 "mooncake_master's http://127.0.0.1:PORT/metadata"),
    "mooncake_protocol": Setting("tcp", choice("tcp", "rdma"), "mooncake: the TransferEngine's transport"),
    "mooncake_device": Setting("", text, "mooncake, rdma: the NICs to use (Mooncake's device names, "
                               "comma-separated; empty: every one found)"),
    # At least 4 KiB (receivers also refuse more than 16,384 buckets: wire.MAX_BUCKETS).
    "bucket_bytes": Setting(512 << 20, size(low=4 << 10), "bytes per bucket; the sender double-buffers two of them "
                            "(512 MiB: the fastest of 128 MiB-1 GiB on two H100, docs/benchmarks.md)"),
    "nccl_ctas": Setting(0, integer(low=0), "trainer, nccl: thread blocks per collective of the update group "
                         "(NCCL's minimum and maximum; 0: NCCL's choice); every rank must use the same (engines: "
                         "NCCL_MIN_CTAS and NCCL_MAX_CTAS in their environment)"),
    "checksum": Setting(True, boolean, "per-bucket checksum (int64 word sum on the device), checked by receivers"),
    "from_buffers": Setting(True, boolean, "trainer: send the parameters that lie in Megatron's contiguous "
                            "parameter buffers (distributed optimizer, no tensor- or expert-parallel "
                            "gather) straight from them: no packing, no per-tensor work per push"),
    "replay_packing": Setting(True, boolean, "trainer, GPU: a bucket packed from the same tensors (same "
                              "addresses, contiguous) as the push before is packed by replaying its copies, "
                              "captured once as a CUDA graph (thread-local capture, nothing allocated): ~10 us of "
                              "host time per bucket instead of ~1 us per tensor"),
    "timeout_s": Setting(300.0, seconds(positive=True), "longest wait for any step of an update (also the first "
                                                  "connection); then the update fails instead of hanging"),
    "every": Setting(1, integer(low=1), "trainer: push after every N-th successful optimizer step"),
    "on_error": Setting("log", choice("log", "raise"), "trainer: a failed push is logged and counted "
                                                       "(training continues) or raised from optimizer.step()"),
    "stage": Setting("update", choice("update", "bucket"), "engine: 'update' receives and verifies the whole "
                     "update before loading (a failure changes nothing; memory: one model copy); 'bucket' "
                     "verifies and loads bucket by bucket (memory: two buckets; a failure mid-way leaves "
                     "a partial update, reported as such)"),
    "max_metadata_bytes": Setting(64 << 20, size(low=1), "engine: largest manifest it accepts"),
    "max_update_bytes": Setting(1 << 40, size(low=1), "engine: largest update (sum of tensor bytes) it accepts"),
    "vocab_size": Setting(0, integer(low=0), "trainer: cut padded embedding / output-layer rows to this "
                                             "vocabulary size (0 = send as is)"),
}


# -- feature capture in SGLang (source_patch.runtime.features.capture, patches/features.yaml)


def _layer_list(value: Any) -> list[int] | None:
    """0-based layer ids; None / '' / [] = EAGLE3's default (layers 2, L//2, L-3)."""
    if value is None or value == "" or value == []:
        return None
    try:
        items = [int(v) for v in (value.split(",") if isinstance(value, str) else _items(value, "layer ids"))]
    except ValueError:
        raise ValueError(f"expected layer ids such as '2,16,29', got {value!r}") from None
    if any(v < 0 for v in items):
        raise ValueError(f"expected layer ids >= 0, got {items}")
    return sorted(set(items))


SCHEMAS["features"] = {
    "enable": Setting(False, boolean, "capture extend (prefill) features per request; when false every "
                                      "call site costs one flag test"),
    "store": Setting("", text, "where tensors go: dir:///path (safetensors files) or "
                               "mooncake://127.0.0.1:PORT?store=NAME (required when enabled)"),
    "stream": Setting("", text, "the ref stream file (JSON lines) the trainer tails (required when enabled)"),
    "db": Setting("", text, "the SQLite control plane shared with the trainer (default: stream + '.db')"),
    "layers": Setting(None, _layer_list, "0-based layers whose input hidden state is captured; "
                                         "empty = EAGLE3's low/middle/high (2, L//2, L-3)"),
    "final": Setting(True, boolean, "capture the final hidden state (after the last norm) too"),
    "high_watermark": Setting(64, integer(low=1), "samples committed but not acked by the trainer above "
                                                  "which the engine pauses before publishing"),
    "ranks": Setting([0], int_filter, "global ranks that publish (tensor-parallel ranks hold copies)"),
}
