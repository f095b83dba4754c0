"""Hidden-state features from an unforked SGLang engine into a trainer process.

    python examples/features_pipeline.py                 # Mooncake store (a master on 127.0.0.1)
    python examples/features_pipeline.py --store dir     # a shared folder instead

1. starts a Mooncake master on 127.0.0.1 (``--store dir``: a folder under --out);
2. starts a real SGLang server (a tiny random Qwen3-MoE on CPU) with
   ``SOURCE_PATCH=features`` capturing every prefill: input ids, positions, a loss
   mask, the input hidden state of EAGLE3's layers and the final hidden state;
3. starts a trainer process (this file, ``--train``) that tails the ref stream,
   reads each sample's tensors straight from the store, trains a tiny draft head on
   them (the next token from the captured hidden states) and acks every sample
   after its optimizer step;
4. sends the prompts (the request's ``rid`` is the sample id), waits for the
   trainer, and prints the stream's state (committed, in flight, acked, lost).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=24, help="prompts (one sample each)")
    p.add_argument("--store", choices=("mooncake", "dir"), default="mooncake")
    p.add_argument("--out", default="sp-features", help="run folder (stream, control plane, logs)")
    p.add_argument("--train", action="store_true", help=argparse.SUPPRESS)  # the trainer process
    p.add_argument("--url", help=argparse.SUPPRESS)
    p.add_argument("--stream", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def ramp(start: int, length: int, vocab: int) -> list[int]:
    """A learnable prompt: every token is the previous one plus one."""
    return [(start + i) % vocab for i in range(length)]


# --------------------------------------------------------------------------- trainer


def train(args) -> None:
    """The trainer: tail the stream, fetch, one optimizer step per sample, ack."""
    import torch

    from source_patch.runtime.features.store import open_store
    from source_patch.runtime.features.stream import Consumer

    store = open_store(args.url)
    consumer = Consumer(args.stream, args.stream + ".db", idle_timeout=120.0)
    head = optimizer = None
    seen = 0
    try:
        for ref in consumer:
            tensors = store.get(ref)
            hidden = torch.cat([tensors[k] for k in sorted(tensors) if k.startswith("hidden_l")], dim=-1)
            ids = tensors["input_ids"].long()
            if head is None:
                head = torch.nn.Linear(hidden.shape[-1], 1024)
                optimizer = torch.optim.Adam(head.parameters(), lr=3e-2)
            loss = torch.nn.functional.cross_entropy(head(hidden[:-1].float()), ids[1:])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            consumer.ack([ref])  # durable: a restarted trainer will not see it again
            store.release(ref)   # consumed objects are removed from the store
            seen += 1
            print(f"trainer: sample {ref.sample_id} ({len(ids)} tokens, {ref.nbytes} B) "
                  f"loss {loss.item():.3f}", flush=True)
            if seen == args.samples:
                break
    finally:
        consumer.close()
        store.close()
    print(f"trainer: trained on {seen} samples", flush=True)


# --------------------------------------------------------------------------- driver


@contextlib.contextmanager
def feature_store(kind: str, run: Path):
    if kind == "dir":
        yield f"dir://{(run / 'store').resolve()}"
        return
    from source_patch.runtime.features.mooncake import master

    with master(log=run / "mooncake_master.log") as address:
        yield f"mooncake://{address}?store=example"


def drive(args) -> None:
    from source_patch.testing.sglang import SGLangServer, tiny_checkpoint

    run = Path(args.out).resolve() / time.strftime("features-%Y%m%d-%H%M%S")
    run.mkdir(parents=True)
    stream = run / "refs.jsonl"
    with feature_store(args.store, run) as url:
        env = {"SOURCE_PATCH_FEATURES_ENABLE": "1", "SOURCE_PATCH_FEATURES_STORE": url,
               "SOURCE_PATCH_FEATURES_STREAM": str(stream)}
        print(f"starting SGLang (sglang_cpu, features; store {url}) ...", flush=True)
        started = time.monotonic()
        with SGLangServer(tiny_checkpoint(), specs=["features"], env=env, workdir=run,
                          args=["--disable-radix-cache", "--skip-server-warmup"]) as server:
            print(f"engine ready in {time.monotonic() - started:.1f} s", flush=True)
            trainer = subprocess.Popen([sys.executable, __file__, "--train", "--url", url, "--stream", str(stream),
                                        "--samples", str(args.samples)],
                                       env={**os.environ, "GLOG_minloglevel": "2"})  # Mooncake's INFO lines
            prompts = {f"sample-{i:03d}": ramp(7 * i, 8 + i % 5, 32) for i in range(args.samples)}
            for rid, prompt in prompts.items():  # one request each, so each is its own sample
                server.generate(input_ids=prompt, rid=rid, max_new_tokens=1)
            print(f"engine: {len(prompts)} prompts served", flush=True)
            code = trainer.wait(timeout=300)
        status = subprocess.run([sys.executable, "-m", "source_patch.runtime.features.stream", "status",
                                 "--db", str(stream) + ".db", "--stream", str(stream), "--json"],
                                capture_output=True, text=True, timeout=60)
    state = json.loads(status.stdout)
    print(f"\nstream: {stream}")
    print("committed {committed}, in flight {in_flight}, acked {acked}, lost {lost}".format(**state))
    if code != 0 or state["lost"] or state["acked"] != args.samples:
        sys.exit(f"error: trainer exit {code}, state {state}")


def main(argv=None) -> None:
    args = parse_args(argv)
    train(args) if args.train else drive(args)


if __name__ == "__main__":
    main()
