"""Feature streaming from a rollout engine to a trainer (docs/features.md).

    manifest.py  its declaration: settings, control modules, call sites, specs, docs page
    ref.py       FeatureRef: what a sample's tensors are and where they live (JSON, checked)
    base.py      FeatureStore, the interface both backends implement: put / get / release, counters
    store.py     the shared-directory backend and open_store(url)
    mooncake.py  the Mooncake backend (zero-copy over the transfer engine)
    stream.py    the ref stream: Producer, Consumer, the status CLI
    stream_format.py  its file format: JSON lines, the end marker, a file checked to be a stream
    stream_io.py      RefWriter and RefReader: the stream file appended to and followed
    control_plane.py  the SQLite control plane: sample states, the bound stream, the saved offset
    capture.py   hidden-state capture inside SGLang's model forward (patches/features.yaml)
"""
