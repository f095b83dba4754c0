"""Sentinels: always-armed watches on the training side that say *where* a run went wrong,
while it runs (docs/sentinels.md).

    manifest.py       its declaration: settings, control, call sites, specs, docs page
    control.py        configure / state / reset / flush / close: arms the watches below
    events.py         the run folder's JSON lines: events.jsonl (what happened) and metrics.jsonl
                      (per-step figures), one file each per rank
    nonfinite.py      non-finite provenance: every dump call site and the gradients folded into
                      device flags, read back once a step; the first non-finite site reported
    routing_health.py tokens per expert, imbalance, dead experts, router entropy, native vs
                      replayed agreement, per step and layer
    mismatch.py       rollout/training log-prob mismatch per sample, and the capture it triggers
    capture.py        that capture on both sides (the trainer's rows through core/watch.py, the
                      engine's /dumper/prefill) and its verdict, from a background thread
    watch.py          `source-patch watch RUN_FOLDER`: the events and the metrics' last values
"""
