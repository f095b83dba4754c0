"""The dump runtime: tensors from call sites to safetensors files and a JSON-lines
manifest, written asynchronously.

    manifest.py its declaration: settings, control modules, call sites, specs, docs page
    api.py      call sites (dump, dump_context, dump_microbatch, dump_step) and control
                (configure, state, flush, reset, close); importable from this package.
                The ground floor: it owns dump's state, which the others reach only
                through its public names (on, fail, nudge, rank_dir)
    writer.py   the pipeline: host snapshots, bounded queue, writer thread
    files.py    the on-disk format: safetensors files + manifest lines
    server.py   the loopback, token-protected HTTP control endpoint (and its CLI)
    reader.py   load dumps back (and its CLI)
    sglang.py   inside SGLang: forward-pass tags, row map, model summary, the /dumper/* handler
(comparing dumps: runtime/verdict/)

``source_patch.runtime.dump.configure`` (and the rest of the control API) loads
api.py (and torch) on first use; ``dump.reader`` alone does not.
"""

_API = ("dump", "dump_context", "dump_microbatch", "dump_step", "enabled", "configure", "configure_from_settings",
        "public_config", "state", "reset", "flush", "close")


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
