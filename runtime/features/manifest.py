"""features: hidden states captured in SGLang and streamed to the trainer (docs/features.md)."""

from __future__ import annotations

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, int_filter, integer, listed, text


def _layer_list(value) -> list[int] | None:
    """0-based layer ids; None / '' / [] = EAGLE3's default (layers 2, L//2, L-3)."""
    if value is None or value == "" or value == []:
        return None
    try:
        items = [int(v) for v in (value.split(",") if isinstance(value, str) else listed(value, "layer ids"))]
    except ValueError:
        raise ValueError(f"expected layer ids such as '2,16,29', got {value!r}") from None
    if any(v < 0 for v in items):
        raise ValueError(f"expected layer ids >= 0, got {items}")
    return sorted(set(items))


SETTINGS = {
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

CAPABILITY = Capability(
    name="features",
    summary="hidden states captured per request in SGLang, streamed to the trainer by reference",
    components={"features": Component(control="capture", settings=SETTINGS)},
    call_sites={"capture": ("features_forward", "features_layer", "features_final", "features_forward_end")},
    specs=("features.yaml",),
    page="features.md",
)
