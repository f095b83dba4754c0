"""Feature streaming from a rollout engine to a trainer (docs/features.md).

    ref.py       FeatureRef: what a sample's tensors are and where they live (JSON, checked)
    base.py      FeatureStore, the interface both backends implement: put / get / release, counters
    store.py     the shared-directory backend and open_store(url)
    mooncake.py  the Mooncake backend (zero-copy over the transfer engine)
    stream.py    the ref stream (append-only JSON lines) and its SQLite control plane
    capture.py   hidden-state capture inside SGLang's model forward (patches/features.yaml)
"""
