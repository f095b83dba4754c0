"""What several capabilities need to know about a framework's machinery, kept apart
from core's plain parts because it follows the frameworks (and may import torch):

    graph_stage.py    graph-safe call sites: staged under CUDA graph capture, drained after
                      each replay (imports torch)
    sglang_graphs.py  graph_stage.py driven from SGLang's decode graph runner
    sglang_batch.py   which request and position each row of an SGLang batch is
    readback.py       a device tensor read back to the host without waiting for the device
                      (pinned memory and an event; imports torch)
"""
