"""routing: which experts each token was routed to, captured and replayed in Megatron and SGLang (docs/routing.md)."""

from __future__ import annotations

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, choice, text


def _mode(value) -> str:
    return choice("off", "capture", "replay")(str(value).strip().lower())


MEGATRON = {
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

SGLANG = {
    "mode": Setting("off", _mode, "off: every call site costs one flag test; capture: keep each request's "
                                  "routed expert ids; replay: route each request with its record's ids"),
    "dir": Setting("", text, "capture: each finished request's record goes to <dir>/rank<R>/<rid>.safetensors "
                             "(empty: kept in memory)"),
    "replay": Setting("", text, "replay: a folder as capture writes it, or one record file; a folder without "
                                "records replays nothing (one warning)"),
}

CAPABILITY = Capability(
    name="routing",
    summary="MoE routing captured in SGLang and Megatron, and replayed in training (R3)",
    components={
        "routing": Component(control="megatron.control", settings=MEGATRON,
                             changes_results={"mode": ("replay",)}),
        "routing_sglang": Component(control="sglang.control", settings=SGLANG,
                                    changes_results={"mode": ("replay",)}),
    },
    call_sites={
        "megatron.control": ("routing_enter", "routing_exit", "routing_topk", "routing_probs", "routing_fused",
                             "routing_schedule", "routing_schedule_end", "routing_microbatch_begin",
                             "routing_microbatch_end", "routing_step"),
        "sglang.call_sites": ("routing_sglang_topk", "routing_sglang_batch", "routing_sglang_release",
                              "routing_sglang_graph_build"),
    },
    specs=("routing.yaml", "moe.yaml"),
    page="routing.md",
)
