"""Both ends of weight_transport over gloo (or NCCL, one GPU per end), one scenario
after another on one group.

    python tests/e2e/weight_sync_transport.py send|receive PORT OUT.json [gloo|nccl]

Each scenario is one update (version = its index + 1); the receiver checks what it
got against the same seeded tensors.  Results: OUT.json, per scenario
``{"ok": true}`` or ``{"error": type, "message": ..., "seconds": ...}``, plus for
a streamed receive the number of tensors handed out before a failure, and on the
receiver how many manifests the update carried (only a layout it has not seen).
"""

import json
import os
import sys
import time

import torch

from source_patch.runtime.weight_sync import receiver as wt_receiver
from source_patch.runtime.weight_sync import transport as wt

BUCKET = 64 << 10
LINK_TIMEOUT = 2.0
# (name, receive stage, receiver's before_verify target bucket or None, receiver option)
SCENARIOS = [
    ("roundtrip-update", "update", None, None),
    ("roundtrip-bucket", "bucket", None, None),
    ("tamper-update", "update", 1, None),
    ("tamper-bucket", "bucket", 2, None),
    ("abandon-bucket", "bucket", None, "stop-after-3"),
    ("refuse-manifest", "update", None, "max-update-bytes-1000"),
    ("roundtrip-after-failures", "bucket", None, None),
    ("other-layout", "update", None, "other-layout"),
    ("refuse-new-layout", "update", None, "third-layout max-update-bytes-1000"),
    ("first-layout-again", "bucket", None, None),
    ("stall", "update", None, "sender-stalls"),
]


def tensors():
    gen = torch.Generator().manual_seed(7)
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.int8,
              torch.uint8, torch.bool, torch.float64]
    out = []
    for i in range(200):
        n = int(torch.randint(1, 3000, (1,), generator=gen))
        values = torch.randn(n, generator=gen) * 50
        out.append((f"t{i}", values.to(dtypes[i % len(dtypes)])))
    out.append(("larger.than.a.bucket", torch.randn(100_000, generator=gen).view(250, 400)))
    out.append(("scalar", torch.tensor(2.5)))
    out.append(("empty", torch.zeros(0, 3)))
    return out


DEVICE = "cpu"  # nccl: cuda:<rank>


def tensors_for(option):
    layouts = {"other-layout": -3, "third-layout": -2}
    cut = next((n for name, n in layouts.items() if option and name in option), None)
    return [(name, t.to(DEVICE)) for name, t in tensors()[:cut]]


def send(link, version, option):
    data = tensors_for(option)
    if option == "sender-stalls":
        time.sleep(LINK_TIMEOUT + 1)  # the receiver gives up first
        return
    manifest = wt.plan([(n, tuple(t.shape), t.dtype) for n, t in data], BUCKET, version)
    wt.send(link, manifest, (t for _, t in data))


handed = 0  # tensors the last receive handed out (streamed: also before a failure)


def receive(link, version, stage, tamper, option):
    global handed
    handed = 0
    expected = tensors_for(option)
    wt_receiver.before_verify = (lambda k, buf: buf[:8].bitwise_not_() if k == tamper else None)
    limit = 1000 if option and "max-update-bytes-1000" in option else 1 << 40
    update = wt.receive(link, stage=stage, max_update_bytes=limit)
    assert update.version == version
    stream = iter(update.tensors)
    try:
        for (name, got), (want_name, want) in zip(stream, expected):
            assert name == want_name and got.dtype == want.dtype and got.shape == want.shape, name
            assert torch.equal(got, want), name  # before the next item: streamed buffers are reused
            handed += 1
            if option == "stop-after-3" and handed == 3:
                stream.close()  # what the engine's loaded site does when load_weights failed
                raise wt.WeightSyncError("consumer stopped after 3 tensors")
    finally:
        wt_receiver.before_verify = None
    assert handed == len(expected)


manifests = 0  # manifests the last receive got


def counted(receive_manifest):
    def wrapper(*args, **kwargs):
        global manifests
        manifests += 1
        return receive_manifest(*args, **kwargs)
    return wrapper


def main():
    global manifests, DEVICE
    role, port, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    backend = sys.argv[4] if len(sys.argv) > 4 else "gloo"
    rank = 0 if role == "send" else 1
    if backend == "nccl":
        DEVICE = f"cuda:{rank}"
        torch.cuda.set_device(rank)
    wt_receiver._manifest = counted(wt_receiver._manifest)
    torch.set_num_threads(1)
    group = wt.open_group("127.0.0.1", port, rank, 2, "transport_test", backend, 60)
    link = wt.Link(group, LINK_TIMEOUT)
    results = []
    for index, (name, stage, tamper, option) in enumerate(SCENARIOS):
        start = time.monotonic()
        result = {"scenario": name}
        manifests = 0
        try:
            if role == "send":
                send(link, index + 1, option)
            else:
                receive(link, index + 1, stage, tamper, option)
            result["ok"] = True
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            result.update(ok=False, error=type(exc).__name__, message=str(exc))
        if role == "receive":
            result.update(handed=handed, manifests=manifests)
        result["seconds"] = round(time.monotonic() - start, 3)
        results.append(result)
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
