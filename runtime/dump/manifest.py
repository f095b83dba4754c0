"""dump: tensors from call sites to safetensors files, asynchronously (docs/dump.md)."""

from __future__ import annotations

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, choice, int_filter, nonempty_text, port, size, string_list, text


def _exp_name(value) -> str:
    name = text(value).strip()
    if not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        raise ValueError(f"expected a plain directory name (no '/', '\\' or NUL, not '.' or '..'), got {value!r}")
    return name


def _rank_dir(value) -> str:
    name = text(value).strip()
    if name.count("{rank}") != 1 or name.replace("{rank}", "").strip("-_.").count("{") or \
            "}" in name.replace("{rank}", "") or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise ValueError(f"expected a plain folder name with one {{rank}} in it (e.g. 'rank-{{rank}}'), "
                         f"got {value!r}")
    return name

SETTINGS = {
    "enable": Setting(False, boolean, "dump at all; when false a dump() call costs one flag test"),
    "dir": Setting("./sp-dumps", nonempty_text, "root directory; records go to <dir>/<exp_name>/rank-<r>/"),
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
    "port": Setting(0, port, "HTTP control endpoint: 0 = off, else listen on port + LOCAL_RANK"),
    "host": Setting("127.0.0.1", nonempty_text, "address the control endpoint binds"),
    "token": Setting("", text, "bearer token of the control endpoint; empty = generate one per process"),
    "max_request_bytes": Setting(64 << 10, size(low=1), "largest request body the control endpoint reads"),
}

CAPABILITY = Capability(
    name="dump",
    summary="tensors from call sites to safetensors files and a manifest, written asynchronously",
    components={"dump": Component(control="api", settings=SETTINGS)},
    call_sites={
        "api": ("dump", "dump_context", "dump_step", "dump_microbatch", "dump_flush", "dump_state",
                "dump_configure"),
        "sglang": ("dump_sglang_forward", "dump_sglang_forward_end", "dump_sglang_control", "dump_sglang_replay",
                   "dump_sglang_graph_build"),
    },
    specs=("dump.yaml",),
    page="dump.md",
)
