"""sentinels: always-armed watches that name where a training run went wrong (docs/sentinels.md)."""

from __future__ import annotations

import math

from ..core.capability import Capability, Component
from ..core.settings import Setting, boolean, choice, integer, nonempty_text, size, string_list, text


def _engines(value) -> list | None:
    urls = string_list(value)
    for url in urls or ():
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"expected http:// or https:// URLs of the engines' servers, got {url!r}")
    return urls


def _rtol(value) -> float:
    return _threshold(value)


def _threshold(value) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"expected a number > 0, got {value!r}") from None
    if not number > 0 or math.isinf(number):
        raise ValueError(f"expected a finite number > 0, got {value!r}")
    return number


SETTINGS = {
    "nonfinite": Setting(False, boolean, "fold 'all finite?' of every training-side dump call site and of the "
                                         "gradients into device flags (no host sync a call), read back once a "
                                         "step: the first non-finite site in execution order is reported; off: "
                                         "each call site costs one flag test"),
    "dump_after": Setting(0, integer(low=0), "after a non-finite event, dump this many following steps' tensors "
                                             "of that layer (0: none; needs the dump spec)"),
    "routing_health": Setting(False, boolean, "per step and MoE layer: tokens per expert, max/mean imbalance, "
                                              "dead experts, router entropy, native-vs-replayed agreement"),
    "mismatch": Setting(False, boolean, "per sample: max |dlogp|, k3, the fraction over ln 2 of the trainer's "
                                        "log-probs against the rollout's (source_patch.watch_logprobs)"),
    "threshold": Setting(math.log(2), _threshold, "a sample whose max |dlogp| exceeds this triggers capture of "
                                                  "both sides"),
    "max_triggers": Setting(4, integer(low=0), "triggered samples at most per step"),
    "max_bytes": Setting(1 << 30, size(low=1), "bytes of triggered dumps at most per run"),
    "engines": Setting(None, _engines, "the engines' HTTP servers (SGLang with the dump spec and "
                                       "DUMPER_SERVER_PORT=reuse): a triggered sample's prompt+response is "
                                       "prefilled with dumps on by the first that accepts it (POST "
                                       "/dumper/prefill); empty: the trainer side only"),
    "engine_files": Setting("auto", choice("auto", "fetch"), "where the engine's dumps of a capture go: auto "
                            "(into the run folder's path, on the engine's host; copied over HTTP when the trainer "
                            "does not see them there, e.g. another host without a shared filesystem), fetch (into "
                            "the engine's own dump folder, always copied over HTTP: an engine that cannot write "
                            "the trainer's paths)"),
    "token": Setting("", text, "bearer token sent to the engines (SGLang's --admin-api-key or --api-key); "
                               "empty: none"),
    "rtol": Setting(1e-4, _rtol, "the verdict's relative L2 above which a layer diverges (compare --rtol)"),
    "dir": Setting("./sp-sentinels", nonempty_text, "the run folder: <dir>/rank-<r>/events.jsonl and "
                                                   "metrics.jsonl; source-patch watch reads it"),
}

CAPABILITY = Capability(
    name="sentinels",
    summary="always-armed watches: the first non-finite tensor, rollout/training mismatch, routing health",
    components={"sentinels": Component(control="control", settings=SETTINGS)},
    call_sites={"control": ("sentinels_attach", "sentinels_schedule", "sentinels_grads", "sentinels_step")},
    specs=("sentinels.yaml",),
    page="sentinels.md",
)
