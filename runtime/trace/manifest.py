"""trace: live tensor statistics streamed to WebSocket clients and the browser view (docs/trace.md)."""

from __future__ import annotations

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, choice, int_filter, integer, nonempty_text, port, seconds, size, text


SETTINGS = {
    "enable": Setting(False, boolean, "trace at all; when false a trace() call costs one flag test"),
    "host": Setting("127.0.0.1", nonempty_text, "address the hub (WebSocket + page) binds"),
    "port": Setting(0, port, "hub port: 0 = no hub (nothing traced), else listen on port + LOCAL_RANK"),
    "token": Setting("", text, "token clients must send; empty = generate one per process "
                               "(written with the URL to a 0600 file under dir)"),
    "dir": Setting("./sp-trace", nonempty_text, "where a process writes its URL + generated token file"),
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

CAPABILITY = Capability(
    name="trace",
    summary="live tensor statistics from call sites, streamed to WebSocket clients and a browser view",
    components={"trace": Component(control="control", settings=SETTINGS)},
    call_sites={
        "": ("trace",),  # the package's export: it reads the settings (control.py) before the first call
        "api": ("trace_step",),
        "control": ("trace_state", "trace_sglang_graph_build"),
    },
    specs=("trace.yaml",),
    page="trace.md",
)
