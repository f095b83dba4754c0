"""Hidden-state capture inside SGLang's model forward (patches/features.yaml).

Four call sites per model family: the forward's entry (the batch: which rows are
which request), each decoder layer after its input is formed (the residual
stream entering the layer: EAGLE3's "aux hidden state"), the final norm, and the
forward's end, where the batch is split per request and each request's tensors go
to the feature store and its ref onto the stream.  Only extend (prefill) passes
are captured, and only requests whose extend starts at position 0: a prefix served
from the radix cache, or a chunked prefill, would give a partial sample, so such a
request is skipped and counted (serve with --disable-radix-cache and
--chunked-prefill-size -1 to capture every request).

A sample is named by its SGLang rid (pass your own sample id as the request's
``rid``).  Its tensors: ``input_ids``, ``positions``, ``loss_mask`` (ones: every
prompt token; narrow it from your data), ``hidden_l{k}`` for each captured layer k
and ``final_hidden``.  Failures are counted and logged, never raised into SGLang;
publishing blocks while the trainer is ``high_watermark`` samples behind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ..core import settings
from ..core.control import Control
from ..core.failures import Counters
from ..core.ranks import global_rank
from ..core.adapters.sglang_batch import BatchRows, batch_rows, is_probe

SETTINGS = "features"  # its settings component (the capability contract: core/capability.py)
_log = logging.getLogger("source_patch.features")
_counters = Counters(("published", "skipped_partial", "skipped_duplicate", "errors", "lost"),
                     "source_patch.features", "features")
_config: dict | None = None
_enabled: bool | None = None  # None: not resolved yet (settings are read on first use)
_batch = None
_publisher = None


def eagle3_layers(num_layers: int) -> list[int]:
    """EAGLE3's low / middle / high layers (SGLang's default aux layers), in range."""
    return sorted({min(max(k, 0), num_layers - 1) for k in (2, num_layers // 2, num_layers - 3)})


@dataclass
class _Batch:
    rows: BatchRows
    input_ids: object
    positions: object
    layers: frozenset
    hidden: dict = field(default_factory=dict)
    final: object = None


def _on() -> bool:
    if _enabled is None:
        configure_from_settings()
    return _enabled


def _apply(config: dict) -> dict:
    global _config, _enabled
    ranks = config["ranks"]
    on = bool(config["enable"]) and (ranks is None or global_rank() in settings.IntSet(ranks))
    if on and not (config["store"] and config["stream"]):
        on = False
        _log.error("source-patch features: enabled without a store and a stream "
                   "(SOURCE_PATCH_FEATURES_STORE, SOURCE_PATCH_FEATURES_STREAM): nothing is captured")
    if _publisher is not None and config != _config:
        _stop()  # the next publication opens the new store and stream
    _config, _enabled = config, on
    return config


def enabled() -> bool:
    return bool(_on())


def features_forward(model, input_ids, positions, forward_batch) -> None:
    """Entry of the model's forward: remember the batch if it is an extend pass."""
    global _batch
    _batch = None
    if not (_enabled if _enabled is not None else _on()):
        return
    try:
        rows = batch_rows(forward_batch)
        if isinstance(rows, BatchRows) and rows.mode == "extend":
            layers = _config["layers"] or eagle3_layers(model.config.num_hidden_layers)
            _batch = _Batch(rows, input_ids, positions, frozenset(layers))
    except Exception as exc:  # noqa: BLE001 - capture must never break serving
        _counters.fail("features_forward", exc)


def features_layer(layer_id: int, hidden) -> None:
    """A decoder layer's input (the residual stream): copied, since the next fused
    add-norm updates it in place."""
    batch = _batch
    if batch is not None and layer_id in batch.layers:
        batch.hidden[layer_id] = hidden.detach().clone()


def features_final(hidden) -> None:
    if _batch is not None:
        _batch.final = hidden.detach().clone()


def features_forward_end(result=None):
    """End of the forward: split per request, store, publish.  Returns ``result``."""
    global _batch
    batch, _batch = _batch, None
    if batch is not None:
        try:
            _publish(batch)
        except Exception as exc:  # noqa: BLE001
            _counters.fail("features_forward_end", exc, lost=len(batch.rows.rids))
    return result


def _publish(batch: _Batch) -> None:
    import torch

    rows = batch.rows
    ids, pos = batch.input_ids.cpu(), batch.positions.cpu()  # one device sync per captured pass
    hidden = {k: v.cpu() for k, v in sorted(batch.hidden.items())}
    final = batch.final.cpu() if batch.final is not None and _config["final"] else None
    publisher = _get_publisher()
    offset = 0
    for i, (rid, n) in enumerate(zip(rows.rids, rows.lens)):
        rows_of = slice(offset, offset + n)
        offset += n
        if is_probe(rid):
            continue
        if rows.starts is None or rows.starts[i] != 0:
            _skip_partial(rid, rows.starts[i] if rows.starts else None)
            continue
        tensors = {"input_ids": ids[rows_of], "positions": pos[rows_of],
                   "loss_mask": torch.ones(n, dtype=torch.uint8)}
        tensors.update({f"hidden_l{k}": h[rows_of] for k, h in hidden.items()})
        if final is not None:
            tensors["final_hidden"] = final[rows_of]
        publisher.publish(str(rid), {k: v.contiguous() for k, v in tensors.items()})


def _skip_partial(rid, start) -> None:
    _counters.add("skipped_partial")
    if _counters.counts["skipped_partial"] == 1:
        _log.warning("source-patch features: request %s extends from position %s, not 0 (a radix-cache "
                     "prefix or a chunked prefill): its sample would be partial, so it is skipped; serve "
                     "with --disable-radix-cache --chunked-prefill-size -1 to capture every request",
                     rid, start)


class _Publisher:
    """The store and the producer end of the stream, opened on first use."""

    def __init__(self, config: dict):
        from .store import open_store
        from .stream import Producer

        self.store = open_store(config["store"])
        db = config["db"] or config["stream"] + ".db"
        self.producer = Producer(config["stream"], db, high_watermark=config["high_watermark"])

    def publish(self, sample_id: str, tensors: dict) -> None:
        if self.producer.plane.state(sample_id) is not None:
            # Committed before (a restarted engine, a repeated rid): storing it again
            # would bump its generation and stale the ref the trainer already has.
            _counters.add("skipped_duplicate")
            return
        if self.producer.publish(self.store.put(sample_id, tensors)):
            _counters.add("published")
        else:
            _counters.add("skipped_duplicate")

    def close(self) -> None:
        try:
            self.producer.close()
        finally:
            self.store.close()


def _get_publisher() -> _Publisher:
    global _publisher
    if _publisher is None:
        _publisher = _Publisher(_config)
    return _publisher


def _clear() -> None:
    """reset(): the counters, and the batch in flight."""
    global _batch
    _counters.reset()
    _batch = None


def _stop(_timeout: float | None = None) -> bool:
    """close(): the stream producer and the store (the next publication opens them again)."""
    global _publisher
    publisher, _publisher = _publisher, None
    if publisher is not None:
        publisher.close()
    return True


_control = Control(SETTINGS, apply=_apply, enabled=lambda: bool(_enabled), counters=lambda: _counters.snapshot(),
                   last_error=lambda: _counters.last_error, clear=_clear, stop=_stop)
configure, configure_from_settings, state, reset, flush, close = _control.surface()
