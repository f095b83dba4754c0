"""Issue 57, item 5 (the readers and writers it names here): bounded everywhere, and a
FIFO never hangs.

- The routing record reader (routing/records/file.py; `replay --routes`, SGLang replay
  and Ray's `collect_routes` read through it): a deep header or metadata was a
  RecursionError, string data_offsets a TypeError, a layer id of Infinity an
  OverflowError, a FIFO a hang.  Now each is a RoutingRecordError naming the file.
- `compare --html/--json`: a FIFO or a device at the target hung or was written into;
  now refused at once, before the comparison, and a report is written through
  core/private.py (a symbolic link at the target is replaced, never followed).
- `post_update`'s reply (weight_sync/request.py): nested JSON was a RecursionError, a
  URL with CR/LF a raw InvalidURL; now both are WeightSyncError."""

import json
import os
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import torch
from test_hardening_dump import records, write_dump

from source_patch.patcher import cli
from source_patch.runtime.verdict import compare_html
from source_patch.runtime.routing.records import describe
from source_patch.runtime.routing.records.file import METADATA_KEY, RoutingRecordError, read_header
from source_patch.runtime.routing.records.record import RoutingRecord, load
from source_patch.runtime.weight_sync.request import post_update
from source_patch.runtime.weight_sync.wire import WeightSyncError

DEEP = b"[" * 100_000 + b"]" * 100_000


def release(fifo) -> None:
    """Unblock whoever waits on ``fifo``: a writer gets a reader, a reader a writer."""
    for flags in (os.O_RDONLY | os.O_NONBLOCK, os.O_WRONLY | os.O_NONBLOCK):
        try:
            os.close(os.open(fifo, flags))
        except OSError:
            pass


def within_a_second(call, fifo, grace=10.0):
    """``call()``, in a thread: its result or exception must come within a second; one
    still blocked after ``grace`` fails the test instead of hanging it."""
    box = {}

    def run():
        started = time.monotonic()
        try:
            box["result"] = call()
        except Exception as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc
        box["took"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(grace)
    if thread.is_alive():
        release(fifo)
        thread.join(5)
        pytest.fail(f"still blocked after {grace} s on {fifo}")
    assert box["took"] < 1.0, box["took"]
    if "error" in box:
        raise box["error"]
    return box["result"]


# ------------------------------------------------------------------ the routing record reader

def a_record(tmp_path):
    rec = RoutingRecord(indices={0: torch.tensor([[0, 1], [1, 2], [2, 3]])}, num_experts=4, token_order="requests",
                        sample_ids=["r0"], seq_lens=[3], source="sglang")
    return rec.save(tmp_path / "r0.safetensors")


def rewrite(path, edit):
    """The file with its safetensors header (a dict) edited; ``edit`` may return raw bytes."""
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    header = edit(json.loads(blob[8:8 + n]))
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + blob[8 + n:])
    return path


def edit_meta(edit):
    def on_header(header):
        meta = json.loads(header["__metadata__"][METADATA_KEY])
        new = edit(meta)
        header["__metadata__"][METADATA_KEY] = new if isinstance(new, str) else json.dumps(new)
        return header
    return on_header


def set_offsets(value):
    def on_header(header):
        header["layer.0.indices"]["data_offsets"] = value
        return header
    return on_header


ROUTING_CASES = {
    "header-deeply-nested": (lambda h: b'{"x": ' + DEEP + b"}", "corrupt safetensors header: nested deeper"),
    "metadata-deeply-nested": (edit_meta(lambda m: json.dumps(m)[:-1] + ', "extra": ' + DEEP.decode() + "}"),
                               "corrupt routing metadata: nested deeper"),
    "offsets-strings": (set_offsets(["0", "6"]), "corrupt safetensors entry 'layer.0.indices'"),
    "offsets-reversed": (set_offsets([6, 0]), "corrupt safetensors entry 'layer.0.indices'"),
    "offsets-not-the-shape": (set_offsets([0, 5]), "corrupt safetensors entry 'layer.0.indices'"),
    "shape-floats": (lambda h: {**h, "layer.0.indices": {**h["layer.0.indices"], "shape": [3.0, 2.0]}},
                     "corrupt safetensors entry"),
    "layers-infinity": (edit_meta(lambda m: {**m, "layers": [float("inf")]}), "lacks or mangles 'layers'"),
    "metadata-not-a-string": (lambda h: {**h, "__metadata__": {METADATA_KEY: 7}}, "not a routing record"),
}


@pytest.mark.parametrize("case", sorted(ROUTING_CASES))
def test_a_malformed_routing_file_is_one_routing_record_error(tmp_path, case):
    """Each from the header alone (`describe` and the readers that list files start
    there; before, offsets were only checked by safetensors once the tensors loaded),
    and from a full load; the layers are read with the tensors."""
    edit, said = ROUTING_CASES[case]
    path = rewrite(a_record(tmp_path), edit)
    for read in (load,) if case.startswith("layers-") else (read_header, load):
        with pytest.raises(RoutingRecordError) as caught:
            read(path)
        assert str(path) in str(caught.value), str(caught.value)
        assert read is load and not case.startswith("layers-") or said in str(caught.value), str(caught.value)


def test_the_reader_still_reads_a_good_file_and_its_cli_says_bad_ones_in_one_line(tmp_path, capsys):
    path = a_record(tmp_path)
    assert load(path).indices[0].tolist() == [[0, 1], [1, 2], [2, 3]]
    rewrite(path, set_offsets(["0", "6"]))
    assert describe.main([str(path)]) == 2  # unusable input
    err = capsys.readouterr().err
    assert err.startswith("source-patch: error: ") and err.count("\n") == 1 and "corrupt safetensors entry" in err


def test_sglang_replay_says_a_rank_that_is_not_an_integer_in_one_line(tmp_path):
    """Two ranks' records of one request, one with a string rank in its metadata: the
    merge compared ranks with >= and raised a raw TypeError (SGLang replay and Ray's
    collect_routes merge through it)."""
    from source_patch.runtime.routing.sglang import files as routing_sglang_files

    for rank, said in ((0, 0), (1, "1")):
        (tmp_path / f"rank{rank}").mkdir()
        path = a_record(tmp_path / f"rank{rank}")
        rewrite(path, edit_meta(lambda m, said=said: {**m, "extra": {**(m.get("extra") or {}), "rank": said}}))
    with pytest.raises(RoutingRecordError, match="rank is '1', not an integer"):
        routing_sglang_files.merge_rank_files(tmp_path)


def test_a_routing_file_that_is_a_fifo_is_refused_within_a_second(tmp_path):
    from source_patch.runtime.routing.sglang.files import merge_rank_files

    (tmp_path / "rank0").mkdir()
    path = tmp_path / "rank0" / "r1.safetensors"
    os.mkfifo(path)
    for read in (load, read_header, lambda p: merge_rank_files(tmp_path)):
        with pytest.raises(RoutingRecordError, match="is not a regular file"):
            within_a_second(lambda: read(path), path)


# ------------------------------------------------------------------ compare's report targets

@pytest.fixture
def dumps(tmp_path):
    return write_dump(tmp_path / "rollout", records(False)), write_dump(tmp_path / "train", records(True))


@pytest.mark.parametrize("flag", ["--json-out", "--html"])
def test_a_fifo_or_a_device_as_the_report_is_refused_within_a_second(tmp_path, capsys, dumps, flag):
    fifo = tmp_path / "report.fifo"
    os.mkfifo(fifo)
    for target in (fifo, os.devnull):
        assert within_a_second(lambda: cli.main(["compare", *map(str, dumps), flag, str(target)]), fifo) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and "is not a regular file" in captured.err, captured.err
        assert str(target) in captured.err and captured.out == ""  # refused before comparing


def test_the_html_writer_refuses_a_fifo_itself(tmp_path):
    fifo = tmp_path / "page.fifo"
    os.mkfifo(fifo)
    with pytest.raises(OSError, match="not a regular file"):
        within_a_second(lambda: compare_html.write({"rows": []}, fifo), fifo)


def test_a_report_replaces_a_link_at_its_path_never_writes_through_it(tmp_path, capsys, dumps):
    victim = tmp_path / "victim.txt"
    victim.write_text("untouched")
    for flag, name in (("--json-out", "r.json"), ("--html", "r.html")):
        link = tmp_path / name
        link.symlink_to(victim)
        assert cli.main(["compare", *map(str, dumps), flag, str(link)]) == 0
        assert victim.read_text() == "untouched" and not link.is_symlink() and link.stat().st_size > 0
    capsys.readouterr()


# ------------------------------------------------------------------ post_update's reply

class Answering(BaseHTTPRequestHandler):
    """Answers every POST with ``self.server.answer``: (status, body)."""

    def do_POST(self):  # noqa: N802 - http.server's name
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        status, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def engine():
    server = HTTPServer(("127.0.0.1", 0), Answering)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status, said", [(200, "nested deeper than"), (500, "refused the update: HTTP 500")])
def test_a_deeply_nested_reply_is_a_weight_sync_error(engine, status, said):
    engine.answer = (status, DEEP)
    url = f"http://127.0.0.1:{engine.server_port}"
    with pytest.raises(WeightSyncError, match=said):
        post_update(url, b"{}", 5.0, session=False)
    engine.answer = (200, b'{"success": true}')
    post_update(url, b"{}", 5.0)  # a good answer still loads


@pytest.mark.parametrize("url", ["http://127.0.0.1:1/\r\nX-Injected: 1", "http://[::1", 30000])
def test_an_engine_url_with_control_characters_or_malformed_is_a_weight_sync_error(url):
    with pytest.raises(WeightSyncError, match="engine URL .*expected http"):
        post_update(url, b"{}", 1.0)


def test_a_file_url_is_refused_not_read_as_the_engines_answer(tmp_path):
    for path in ("begin_weight_update", "update_weights_from_tensor", "end_weight_update"):
        (tmp_path / path).write_text('{"success": true}')  # before: read, and the update "loaded"
    with pytest.raises(WeightSyncError, match="engine URL .*expected http"):
        post_update(f"file://{tmp_path}", b"{}", 1.0)
