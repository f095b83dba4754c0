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
    rows.py           which request and position each row of a training micro-batch is
                      (source_patch.batch): kept ambient, pulled by the dump and routing replay
    failures.py       failure counting: counted, the first of each kind logged, the latest kept
    watch.py          the hooks dump's and routing's call sites call for a watching capability
                      (the sentinels), so that neither imports the other
    commands.py       what every CLI shares: exit codes, the one error line (JSON under --json),
                      the parser, printed commands
    control.py        the capability contract implemented once (Control): each control module
                      supplies what differs
    adapters/         what several capabilities need to know of a framework's machinery: CUDA
                      graph staging, SGLang's graph runner and batch rows (may import torch)
"""
