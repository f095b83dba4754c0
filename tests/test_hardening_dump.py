"""Issue 36, items 6 and 8: the dump endpoint against idle unauthenticated sockets
(slowloris), and `source-patch compare` against crafted dump directories: every
malformed input is one clean line on stderr and exit 2, never a traceback, never 1
(1 means divergence)."""

import http.client
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch

from source_patch.runtime.core.endpoint import free_port

TOKEN = "slowloris-token"
HALF_REQUEST = b"GET /state HTTP/1.1\r\nHost: x\r\n"  # the blank line that ends it never comes


# ---------------------------------------------------------------- dump endpoint


@pytest.fixture
def endpoint(dumper):
    dumper.configure(port=free_port(), token=TOKEN)
    return int(dumper.state()["control"].rsplit(":", 1)[1])


def get_state(port, timeout=3.0):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", "/state", headers={"Authorization": f"Bearer {TOKEN}"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def half_request(port):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(HALF_REQUEST)
    return sock


def closed_by_server(sock, wait):
    """True if the server closes ``sock`` within ``wait`` seconds."""
    sock.settimeout(max(wait, 0.001))
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except OSError:  # timed out: still open
        return False


def test_200_idle_half_requests_do_not_delay_the_token_holder(endpoint, dumper, capfd):
    idle = [half_request(endpoint) for _ in range(200)]
    try:
        start = time.perf_counter()
        status, state = get_state(endpoint)  # before: ~60 s (200 / 16 workers x 5 s)
        assert status == 200 and time.perf_counter() - start < 1.0
        assert state["counters"]["errors"] == 0
    finally:
        for sock in idle:
            sock.close()
    assert "Traceback" not in capfd.readouterr().err


def test_unauthenticated_sockets_are_capped_and_timed_out(endpoint):
    from source_patch.runtime.dump.server import _Server

    idle = [half_request(endpoint) for _ in range(100)]
    try:
        time.sleep(1.0)  # well before the 2 s auth timeout: only the cap has closed any
        evicted = sum(closed_by_server(s, 0.01) for s in idle)
        assert evicted == 100 - _Server.MAX_UNAUTHENTICATED
        start = time.monotonic()
        assert all(closed_by_server(s, 5 - (time.monotonic() - start)) for s in idle)
        assert time.monotonic() - start < _Server.AUTH_TIMEOUT_S + 1
    finally:
        for sock in idle:
            sock.close()


def test_a_trickling_client_is_cut_at_the_auth_deadline_not_per_read(endpoint):
    from source_patch.runtime.dump.server import _Server

    sock = socket.create_connection(("127.0.0.1", endpoint), timeout=10)
    start = time.monotonic()
    try:
        for byte in HALF_REQUEST * 4:  # one byte every 0.1 s: each read is quick
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
    except OSError:
        pass  # the server hung up mid-trickle
    finally:
        closed = closed_by_server(sock, 2)
        sock.close()
    assert closed and time.monotonic() - start < _Server.AUTH_TIMEOUT_S + 1.5


def test_authenticated_requests_still_work_after_the_idle_ones_go(endpoint):
    idle = [half_request(endpoint) for _ in range(20)]
    for sock in idle:
        sock.close()
    assert [get_state(endpoint)[0] for _ in range(20)] == [200] * 20


def test_stopping_the_endpoint_hangs_up_on_idle_sockets(endpoint, dumper):
    idle = [half_request(endpoint) for _ in range(10)]
    try:
        time.sleep(0.3)  # accepted, their threads blocked reading
        dumper.configure(port=0)  # stops the endpoint (its accept loop, and so the 2 s timeout)
        start = time.monotonic()
        assert all(closed_by_server(s, 1 - (time.monotonic() - start)) for s in idle)  # not after 5 s
    finally:
        for sock in idle:
            sock.close()


# ---------------------------------------------------------------- compare


def records(train: bool, hidden: int = 8, vocab: int = 16) -> list:
    """One forward pass of two requests (2 tokens each), the same numbers on both sides:
    SGLang's names and 0-based layers on the rollout side, Megatron's on the training side."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, hidden, generator=g)
    logits = torch.randn(4, vocab, generator=g)
    layer = 1 if train else 0
    routes = (torch.arange(4)[None, :] < 2).expand(4, 4).clone() if train else torch.tensor([[0, 1]] * 4)
    out = [["input_ids", {}, torch.tensor([5, 6, 7, 8])],
           ["positions", {}, torch.tensor([0, 1, 0, 1])],
           ["row_request", {"rids": ["r0", "r1"]}, torch.tensor([0, 0, 1, 1], dtype=torch.int32)],
           ["layer_input", {"layer": layer}, x],
           ["mlp_output", {"layer": layer}, x * 2],
           ["routing_map" if train else "topk_ids", {"layer": layer}, routes],
           ["logits", {}, logits]]
    return [[name, {"step": 0, "rank": 0, **tags}, tensor] for name, tags, tensor in out]


def write_dump(folder, recs, after=None):
    """``recs`` as the dump runtime writes them: one safetensors file and its manifest
    lines in folder/rank-0; then ``after(rank_dir)`` breaks something."""
    from source_patch.runtime.dump import files

    rank_dir = folder / "rank-0"
    rank_dir.mkdir(parents=True)
    entries = [(f"{seq:08d}:{name}", tensor.contiguous()) for seq, (name, _, tensor) in enumerate(recs)]
    files.write_safetensors(rank_dir / "f.safetensors", entries, {"format": "pt"})
    lines = [{"seq": seq, "name": name, "tags": tags, "file": "f.safetensors", "key": key,
              "shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
              "bytes": tensor.numel() * tensor.element_size(), "session": "s"}
             for seq, ((name, tags, tensor), (key, _)) in enumerate(zip(recs, entries))]
    (rank_dir / "manifest.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    if after is not None:
        after(rank_dir)
    return folder


def named(recs, name):
    return next(r for r in recs if r[0] == name)


def set_tag(name, key, value):
    return lambda recs: named(recs, name)[1].__setitem__(key, value)


def drop_tag(name, key):
    return lambda recs: named(recs, name)[1].pop(key)


def set_tensor(name, make):
    def edit(recs):
        named(recs, name)[2] = make()
    return edit


def edit_lines(edit):
    """An ``after`` that rewrites the manifest: edit(list of line dicts) -> lines (dicts or raw text)."""
    def after(rank_dir):
        path = rank_dir / "manifest.jsonl"
        lines = edit([json.loads(text) for text in path.read_text().splitlines()])
        path.write_bytes(b"".join((l if isinstance(l, bytes) else
                                   (l if isinstance(l, str) else json.dumps(l)).encode()) + b"\n" for l in lines))
    return after


def set_field(key, value, index=3):
    def edit(lines):
        if value is KeyError:
            del lines[index][key]
        else:
            lines[index][key] = value
        return lines
    return edit_lines(edit)


def edit_header(edit):
    """An ``after`` that rewrites the safetensors header: edit(header dict) -> dict or raw bytes."""
    def after(rank_dir):
        path = rank_dir / "f.safetensors"
        blob = path.read_bytes()
        length = int.from_bytes(blob[:8], "little")
        header = edit(json.loads(blob[8:8 + length]))
        raw = header if isinstance(header, bytes) else json.dumps(header).encode()
        path.write_bytes(len(raw).to_bytes(8, "little") + raw + blob[8 + length:])
    return after


def set_entry(key, value):
    def edit(header):
        entry = next(v for k, v in header.items() if k.endswith(":layer_input"))
        entry[key] = value
        return header
    return edit_header(edit)


def rename_key(header):
    key = next(k for k in header if k.endswith(":layer_input"))
    header[key + "-renamed"] = header.pop(key)
    return header


def replace_file(content):
    def after(rank_dir):
        (rank_dir / "f.safetensors").write_bytes(content)
    return after


def truncate_file(rank_dir):
    path = rank_dir / "f.safetensors"
    path.write_bytes(path.read_bytes()[:-40])


def fifo_manifest(rank_dir):
    (rank_dir / "manifest.jsonl").unlink()
    os.mkfifo(rank_dir / "manifest.jsonl")


def folder_manifest(rank_dir):
    (rank_dir / "manifest.jsonl").unlink()
    (rank_dir / "manifest.jsonl").mkdir()


def fifo_file(rank_dir):
    (rank_dir / "f.safetensors").unlink()
    os.mkfifo(rank_dir / "f.safetensors")


def symlinked_file(rank_dir):
    real = rank_dir.parent / "elsewhere.safetensors"
    (rank_dir / "f.safetensors").rename(real)
    (rank_dir / "f.safetensors").symlink_to(real)


def missing_file(rank_dir):
    (rank_dir / "f.safetensors").unlink()


DEEP = "[" * 100_000 + "]" * 100_000

# id: (side broken, edit of the records before writing, break after writing, what stderr names)
CASES = {
    # manifest lines
    "line-is-a-list": ("train", None, edit_lines(lambda ls: ls[:3] + [[1, 2]] + ls[4:]), "expected a dict"),
    "line-without-file": ("train", None, set_field("file", KeyError), "'file' is missing"),
    "line-file-absolute": ("train", None, set_field("file", "/etc/passwd"), "'file' is '/etc/passwd'"),
    "line-file-dotdot": ("train", None, set_field("file", "../rank-0/f.safetensors"), "a plain file name"),
    "line-file-dotdot-only": ("rollout", None, set_field("file", ".."), "a plain file name"),
    "line-file-in-subfolder": ("train", None, set_field("file", "sub/f.safetensors"), "a plain file name"),
    "line-file-not-a-string": ("train", None, set_field("file", 7), "a plain file name"),
    "line-deeply-nested": ("rollout", None, edit_lines(lambda ls: ls + ['{"seq": 9, "tags": ' + DEEP + "}"]),
                           "nested deeper than 32"),
    "line-not-json": ("rollout", None, edit_lines(lambda ls: ls[:2] + ["{not json"] + ls[2:]), "not valid JSON"),
    "line-not-utf8": ("rollout", None, edit_lines(lambda ls: ls + [b'{"name": "\xff"}']), "not UTF-8"),
    "line-over-1MiB": ("rollout", None, edit_lines(lambda ls: ls + ['{"x": "' + "a" * (1 << 20) + '"}']),
                       "over 1,048,576 bytes"),
    "line-without-name": ("train", None, set_field("name", KeyError), "'name' is missing"),
    "line-seq-a-string": ("train", None, set_field("seq", "3"), "'seq' is '3'"),
    "line-tags-a-list": ("train", None, set_field("tags", [1]), "'tags' is [1]"),
    "line-shape-negative": ("train", None, set_field("shape", [-4, 8]), "'shape' is [-4, 8]"),
    "manifest-a-folder": ("rollout", None, folder_manifest, "not a regular file"),
    # the tensor files
    "file-missing": ("train", None, missing_file, "cannot open"),
    "file-symlink": ("train", None, symlinked_file, "cannot open"),
    "file-empty": ("train", None, replace_file(b""), "not a safetensors file"),
    "file-not-safetensors": ("train", None, replace_file(b"hello world, not a tensor file" * 10),
                             "not a safetensors file"),
    "header-length-absurd": ("train", None, replace_file((1 << 63).to_bytes(8, "little") + b"{}"),
                             "not a safetensors file"),
    "header-not-json": ("rollout", None, edit_header(lambda h: b"{nope"), "header: not valid JSON"),
    "header-a-list": ("rollout", None, edit_header(lambda h: [h]), "expected a dict"),
    "header-deeply-nested": ("rollout", None, edit_header(lambda h: {**h, "x": json.loads("[" * 40 + "]" * 40)}),
                             "nested deeper than 32"),
    "header-key-missing": ("train", None, edit_header(rename_key), "not in the file"),
    "header-dtype-unknown": ("train", None, set_entry("dtype", "C64"), "unknown dtype 'C64'"),
    "header-shape-absurd": ("train", None, set_entry("shape", [2 ** 40, 2 ** 40]), "does not fit"),
    "header-shape-negative": ("train", None, set_entry("shape", [-4, -8]), "is not a list of"),
    "header-shape-too-many-dims": ("train", None, set_entry("shape", [1] * 65), "is not a list of"),
    "header-offsets-past-the-end": ("train", None, set_entry("data_offsets", [0, 2 ** 62]), "outside the file"),
    "file-truncated": ("train", None, truncate_file, "outside the file"),
    # tags and tensors the comparison relies on
    "layer-a-string": ("rollout", set_tag("layer_input", "layer", "0"), None, "tag 'layer' is '0'"),
    "step-a-list": ("train", set_tag("mlp_output", "step", [0]), None, "tag 'step' is [0]"),
    "rank-a-bool": ("train", set_tag("input_ids", "rank", True), None, "tag 'rank' is True"),
    "tp-a-string": ("train", set_tag("logits", "tp", "0"), None, "tag 'tp' is '0'"),
    "no-rids": ("rollout", drop_tag("row_request", "rids"), None, "tag 'rids' is missing"),
    "rids-not-a-list": ("rollout", set_tag("row_request", "rids", "r0"), None, "tag 'rids' is 'r0'"),
    "row-request-empty": ("rollout", set_tensor("row_request", lambda: torch.tensor([], dtype=torch.int64)), None,
                          "expected a non-empty integer tensor"),
    "row-request-out-of-range": ("train", set_tensor("row_request", lambda: torch.tensor([0, 0, 1, 5])), None,
                                 "values 0..5 outside -1..1"),
    "row-request-floats": ("train", set_tensor("row_request", lambda: torch.tensor([0.0, 0.0, 1.0, 1.0])), None,
                           "expected a non-empty integer tensor"),
    "positions-count": ("rollout", set_tensor("positions", lambda: torch.tensor([0, 1, 0])), None,
                        "3 positions for 4 rows"),
    "hidden-size-mismatch": ("train", lambda recs: recs.__setitem__(slice(None), records(True, hidden=9)), None,
                             "rows of 8, 9 values"),
    "vocab-size-mismatch": ("train", lambda recs: recs.__setitem__(slice(None), records(True, vocab=17)), None,
                            "rows of 16, 17 values"),
    "input-ids-two-per-row": ("train", set_tensor("input_ids", lambda: torch.tensor([[5, 0], [6, 0], [7, 0], [8, 0]])),
                              None, "2 values, expected one token id"),
}


def build(tmp_path, case):
    side, before, after, _ = CASES[case]
    recs = {"rollout": records(False), "train": records(True)}
    if before is not None:
        before(recs[side])
    return [write_dump(tmp_path / name, recs[name], after if name == side else None) for name in ("rollout", "train")]


def run_cli(*args):
    from source_patch.patcher import cli

    return cli.main(["compare", *map(str, args)])


def test_the_untouched_pair_compares_clean_and_a_changed_one_diverges(tmp_path, capsys):
    rollout, train = build(tmp_path, "line-is-a-list")[0], tmp_path / "train-ok"
    write_dump(train, records(True))
    assert run_cli(rollout, train) == 0
    out = capsys.readouterr().out
    assert "no divergence" in out and "routing agreement" in out and "next-token log-probs" in out

    changed = records(True)
    named(changed, "mlp_output")[2] = named(changed, "mlp_output")[2] * 1.5
    assert run_cli(rollout, write_dump(tmp_path / "train-changed", changed)) == 1


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_malformed_dump_is_one_clean_line_and_exit_2(tmp_path, capsys, case):
    rollout, train = build(tmp_path, case)
    assert run_cli(rollout, train) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("source-patch: error: "), captured.err
    assert CASES[case][3] in lines[0]
    assert "Traceback" not in captured.err and captured.out == ""


def test_next_token_ids_outside_the_vocabulary_are_a_clean_error(tmp_path, capsys):
    sides = [records(False), records(True)]
    for recs in sides:
        named(recs, "input_ids")[2] = torch.tensor([5, 99, 7, 8])
    dirs = [write_dump(tmp_path / n, r) for n, r in zip(("rollout", "train"), sides)]
    assert run_cli(*dirs) == 2
    assert "token ids 8..99 outside the logits' vocabulary of 16" in capsys.readouterr().err


def cli_subprocess(*args, timeout=60):
    """The real `source-patch compare` in a child process (a hang fails, not blocks)."""
    return subprocess.run([sys.executable, "-m", "source_patch.patcher.cli", "compare", *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("case", ["fifo-manifest", "fifo-file", "fifo-at-an-absolute-file", "deep-line"])
def test_the_real_cli_neither_hangs_nor_opens_what_a_manifest_points_at(tmp_path, case):
    fifo = tmp_path / "outside.fifo"
    after = {"fifo-manifest": fifo_manifest, "fifo-file": fifo_file,
             "fifo-at-an-absolute-file": set_field("file", str(fifo)),
             "deep-line": edit_lines(lambda ls: ls + ['{"tags": ' + DEEP + "}"])}[case]
    os.mkfifo(fifo)  # opened by anyone, the child would block here
    rollout = write_dump(tmp_path / "rollout", records(False))
    train = write_dump(tmp_path / "train", records(True), after)
    result = cli_subprocess(rollout, train)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("source-patch: error: "), result.stderr
    assert "Traceback" not in result.stderr


def test_reports_into_a_missing_folder_or_onto_a_folder_are_clean_errors(tmp_path, capsys):
    rollout = write_dump(tmp_path / "rollout", records(False))
    train = write_dump(tmp_path / "train", records(True))
    for flag, target, said in (("--html", tmp_path / "no" / "such" / "r.html", "no folder"),
                               ("--json-out", tmp_path / "missing" / "r.json", "no folder"),
                               ("--html", tmp_path, "is a folder")):
        assert run_cli(rollout, train, flag, target) == 2
        captured = capsys.readouterr()
        assert captured.err.count("\n") == 1 and said in captured.err and captured.out == ""
        assert not (tmp_path / "no").exists() and not (tmp_path / "missing").exists()


def test_json_reports_hold_no_bare_nan(tmp_path, capsys):
    rollout, train = records(False), records(True)
    named(train, "mlp_output")[2] = torch.full((4, 8), float("nan"))
    named(rollout, "layer_input")[2] = torch.ones(4, 8)
    named(train, "layer_input")[2] = torch.zeros(4, 8)  # a zero reference: relative L2 is infinite
    dirs = [write_dump(tmp_path / "rollout", rollout), write_dump(tmp_path / "train", train)]
    out = tmp_path / "report.json"
    assert run_cli(*dirs, "--json-out", out, "--html", tmp_path / "report.html") == 1

    def no_bare_constants(name):
        raise AssertionError(f"bare {name} in the JSON report")

    report = json.loads(out.read_text(), parse_constant=no_bare_constants)
    rows = {(r["name"], r["layer"]): r for r in report["rows"]}
    assert rows[("mlp_output", 0)]["rel_l2"] == "NaN" and rows[("mlp_output", 0)]["ok"] is False
    assert rows[("layer_input", 0)]["rel_l2"] == "Infinity"
    assert report["first_divergent"] == ["layer_input", 0]
    assert (tmp_path / "report.html").read_text().startswith("<!doctype html>")
