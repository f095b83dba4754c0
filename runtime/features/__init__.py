"""Feature streaming from a rollout engine to a trainer (docs/features.md).

    ref.py       FeatureRef: what a sample's tensors are and where they live (JSON, checked)
    store.py     FeatureStore: put / get / release; Mooncake and shared-directory backends
    stream.py    the ref stream (append-only JSON lines) and its SQLite control plane
    capture.py   hidden-state capture inside SGLang's model forward (patches/features.yaml)
"""
