"""What every capability shares.  Nothing here imports a capability's code; capability.py
reads their manifests (runtime/<name>/manifest.py), which import only core.

    settings.py       the runtime settings: schemas, environment > spec > default
    settings_doc.py   docs/settings.md, generated from the schemas
    capability.py     what a capability is: its declaration (each manifest found), the control
                      surface every capability exposes, and its checker
    events.py         in-process events (emit, subscribe, capture)
    endpoint.py       loopback endpoints: LOCAL_RANK offsets, the 0600 URL+token file, free ports
    private.py        the one writer of every file we write, and the trusted-folder reader
    bounded.py        the bounded reader of every structured input (JSON, headers, wheels)
    tags.py           ambient tags (phase, microbatch) and JSON-safe tag values
    ranks.py          the process's global and parallel ranks, from what is already initialised
    slicing.py        how Megatron splits a sequence over context/sequence-parallel ranks (zigzag)
    failures.py       failure counting: counted, the first of each kind logged, the latest kept
    sglang_batch.py   which request and position each row of an SGLang batch is
    graph_stage.py    graph-safe call sites: staged under CUDA graph capture, drained after each
                      replay (imports torch)
    sglang_graphs.py  graph_stage.py driven from SGLang's decode graph runner
"""
