"""Compare a rollout's dumps (SGLang, patches/dump.yaml) with a training
framework's dumps of the same tokens (Megatron, patches/dump.yaml), layer by layer.

    source-patch compare ROLLOUT_DIR TRAIN_DIR [--exp-name NAME]... [--json] [--json-out r.json] [--html r.html] [--rtol 1e-4]

    import source_patch.runtime.verdict.compare as dump_compare
    report = dump_compare.compare("sp-dumps/rollout", "sp-dumps/train")
    print(report.table()); report.first_divergent     # (name, layer) or None

Every row on both sides is mapped to (request id, token position) first:

* rollout: each forward pass's ``row_request`` (+ its ``rids`` tag) and ``positions``;
* training: each step's ``row_request`` / ``positions`` records of the same ``[s, b]``
  layout as the activations (written by whoever builds the batch; -1 marks padding),
  per rank: a context-parallel (zigzag) or sequence-parallel rank dumps the row map of
  its own slice, and the pieces reassemble by (request, position) (layout.py);
  vocab-parallel logits (one vocabulary slice per TP rank) are joined first.

A layout self-test runs before any number is compared: the token id of every paired
(request, position) must be the same on both sides, or the comparison stops with the
first mismatch (a misaligned batch can have matching shapes and still pair the wrong
tokens).  Then, per (name, layer) in layer order: the rows compared, max |a - b|,
relative L2 ``||a - b|| / ||b||`` and cosine similarity; the first pair whose relative
L2 exceeds ``rtol`` is the first divergent layer.  SGLang's ``layer_id`` is 0-based,
Megatron's ``layer_number`` 1-based (``layer_offset``, default 1).

Exit codes of the CLI: 0 no divergence, 1 divergence, 2 anything that stops the
comparison (a failed layout self-test, unreadable or malformed dumps, a report that
cannot be written, a dump root whose runs are of different kinds), always as one line
``source-patch: error: ...`` on stderr (and as JSON on stdout under ``--json``, which
prints the report as JSON instead of the table).  A dump root is read at its latest run (reader.choose); the reports record
their inputs (:func:`describe_inputs`).  Torch is imported when a comparison runs, not
with this module (``source-patch replay --help`` reads its options).
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

from ..core import commands
from ..dump import reader

# rollout name -> training name: the quantities both specs dump with the same meaning
NAMES = {"layer_input": "layer_input", "attention_output": "attention_output",
         "pre_mlp_residual": "pre_mlp_residual", "mlp_output": "mlp_output",
         "final_hidden": "final_hidden", "logits": "logits"}
# Routing: SGLang's top-k expert ids per token against Megatron's routing map
# ([tokens, experts] bool): the same routing when the sets of experts are equal.
ROUTING = ("topk_ids", "routing_map")


class Rec(NamedTuple):
    """A record with its tensor in memory (reader.Record reads the file at each access)."""

    name: str
    tags: dict
    tensor: torch.Tensor
    where: str = ""  # its manifest line, for errors


def load(path, names=None) -> list:
    """The records of a dump directory that a comparison needs, tensors read once
    (each file's header once, through reader.read_tensors)."""
    wanted = set(NAMES) | set(ROUTING) | {"input_ids", "positions", "row_request"} if names is None else set(names)
    records = [r for r in reader.load(path) if r.name in wanted]
    keys: dict = {}
    for r in records:
        keys.setdefault(r.file, []).append(r.key)
    tensors = {file: reader.read_tensors(file, wanted_keys) for file, wanted_keys in keys.items()}
    return [Rec(r.name, r.tags, tensors[r.file][r.key], f"{r.file.parent / reader.MANIFEST} record {r.seq}")
            for r in records]


class LayoutError(ValueError):
    """The two sides do not hold the same tokens at the rows they claim."""


DumpError = reader.DumpError  # malformed dumps: exit 2, as unreadable ones


def _where(rec: Rec) -> str:
    return f"{rec.name} ({rec.where})" if rec.where else rec.name


def _tag(rec: Rec, key: str):
    """An integer tag the comparison groups or orders by (step, rank, layer, tp), or None."""
    value = rec.tags.get(key)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise DumpError(f"{_where(rec)}: tag '{key}' is {reader.shown(value)}, expected an integer")


@dataclass
class Row:
    name: str
    layer: int | None           # the rollout's layer id
    rows: int                   # (request, position) pairs compared
    max_abs: float
    rel_l2: float
    cosine: float
    ok: bool


@dataclass
class Report:
    rows: list = field(default_factory=list)
    tokens: int = 0             # (request, position) pairs both sides hold
    requests: int = 0
    rtol: float = 1e-4
    routing: list = field(default_factory=list)  # [{"layer", "tokens", "agreement"}], rollout layers
    routing_any_differ: float | None = None      # fraction of tokens routed differently in >= 1 layer
    logprobs: dict | None = None                 # logprobs.Mismatch.to_json() of the next tokens

    @property
    def first_divergent(self):
        bad = next((r for r in self.rows if not r.ok), None)
        return None if bad is None else (bad.name, bad.layer)

    def table(self) -> str:
        lines = [f"{self.requests} requests, {self.tokens} tokens paired; rtol {self.rtol:g}",
                 f"{'name':18} {'layer':>5} {'rows':>6} {'max|a-b|':>10} {'rel L2':>10} {'cosine':>9}  ok"]
        for r in self.rows:
            layer = "-" if r.layer is None else str(r.layer)
            lines.append(f"{r.name:18} {layer:>5} {r.rows:>6} {r.max_abs:>10.3g} {r.rel_l2:>10.3g} "
                         f"{r.cosine:>9.6f}  {'ok' if r.ok else 'DIVERGES'}")
        for r in self.routing:
            lines.append(f"{'routing agreement':18} {r['layer']:>5} {r['tokens']:>6} {r['agreement']:>10.2%}")
        if self.routing_any_differ is not None:
            lines.append(f"tokens routed differently in at least one layer: {self.routing_any_differ:.2%}")
        if self.logprobs is not None:
            lines.append(f"next-token log-probs: {self.logprobs['line']}")
        first = self.first_divergent
        lines.append("no divergence" if first is None else f"first divergent: {first[0]} layer {first[1]}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        out = {"requests": self.requests, "tokens": self.tokens, "rtol": self.rtol,
               "first_divergent": self.first_divergent, "rows": [asdict(r) for r in self.rows]}
        if self.routing:
            out["routing"] = {"per_layer": self.routing, "tokens_differing_any_layer": self.routing_any_differ}
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        return out


def _by_step(records) -> dict:
    """Records by (step, rank): each rank's row map describes its own rows (a context-
    or sequence-parallel rank holds a slice of the sequence; see layout.py)."""
    steps: dict = {}
    for r in records:
        _tag(r, "layer")
        steps.setdefault((_tag(r, "step"), _tag(r, "rank")), []).append(r)
    return steps


def _keys(row_map, positions) -> list:
    """(rid, position) of every element of a row map; None for padding (-1).  A row map
    without its ``rids``, empty, not integers, pointing past its rids or of another
    size than its positions is a DumpError (it would pair the wrong rows)."""
    import torch

    rids = row_map.tags.get("rids")
    if not (isinstance(rids, list) and rids and all(isinstance(r, (str, int)) and not isinstance(r, bool)
                                                    for r in rids)):
        raise DumpError(f"{_where(row_map)}: tag 'rids' is {reader.shown(rids)}, expected a list of request ids")
    for rec in (row_map, positions):
        if rec.tensor.numel() == 0 or rec.tensor.dtype.is_floating_point or rec.tensor.dtype == torch.bool:
            raise DumpError(f"{_where(rec)}: expected a non-empty integer tensor, got "
                            f"{list(rec.tensor.shape)} {str(rec.tensor.dtype).removeprefix('torch.')}")
    if positions.tensor.numel() != row_map.tensor.numel():
        raise DumpError(f"{_where(positions)}: {positions.tensor.numel()} positions for "
                        f"{row_map.tensor.numel()} rows of row_request")
    index = row_map.tensor.reshape(-1).tolist()
    if not -1 <= min(index) <= max(index) < len(rids):
        raise DumpError(f"{_where(row_map)}: values {min(index)}..{max(index)} outside -1..{len(rids) - 1} "
                        f"(its {len(rids)} rids)")
    rids = [str(r) for r in rids]  # one kind, so keys sort
    return [None if i < 0 else (rids[i], p) for i, p in zip(index, positions.tensor.reshape(-1).tolist())]


def gather_vocab_parallel(records) -> list:
    """Logits split over tensor-parallel ranks (Megatron's vocab-parallel output layer:
    TP rank k holds a contiguous slice of the vocabulary) joined along the vocabulary,
    in TP order, into one record per step and group; other records unchanged.  A group
    is the records of one step that differ only in their ``tp`` and ``rank`` tags."""
    import torch

    groups: dict = {}
    out = []
    for r in records:
        if r.name == "logits" and _tag(r, "tp") is not None and r.tensor.dim() > 0:
            rest = tuple(sorted((k, str(v)) for k, v in r.tags.items() if k not in ("tp", "rank")))
            groups.setdefault(rest, []).append(r)
        else:
            out.append(r)
    for shards in groups.values():
        shards.sort(key=lambda r: r.tags["tp"])
        if len(shards) > 1 and len({r.tensor.shape[:-1] for r in shards}) == 1:
            joined = torch.cat([r.tensor for r in shards], dim=-1)
            out.append(Rec("logits", shards[0].tags, joined, shards[0].where))  # keeps the lowest TP rank's rank tag
        else:
            out.extend(shards)
    return out


def index_rows(records) -> dict:
    """{(name, layer): {(rid, position): row tensor}} of one side's dumps, plus
    ``("input_ids", None)`` for the layout self-test.  Logits are keyed by each
    request's last row only where a pass computes logits per request (SGLang)."""
    out: dict = {}
    for recs in _by_step(records).values():
        named = {(r.name, r.tags.get("layer")): r for r in recs}
        row_map, positions = named.get(("row_request", None)), named.get(("positions", None))
        if row_map is None or positions is None:
            continue
        keys = _keys(row_map, positions)
        for (name, layer), rec in named.items():
            if name not in NAMES and name not in ROUTING and name != "input_ids":
                continue
            # [s, b, ...] as the row map, or its rows flattened ([s * b, ...]: the router's view)
            t = rec.tensor
            flat = t.reshape(len(keys), -1) if t.dim() > 0 and t.numel() % len(keys) == 0 and (
                t.shape[: row_map.tensor.dim()] == row_map.tensor.shape or t.shape[0] == len(keys)) else None
            target = out.setdefault((name, layer), {})
            if flat is not None:
                for key, row in zip(keys, flat):
                    if key is not None:
                        target[key] = row
            elif name == "logits" and rec.tensor.dim() > 0:  # one row per request: its last row in this pass
                last = {}
                for key in keys:
                    if key is not None:
                        last[key[0]] = key if key[0] not in last or key[1] > last[key[0]][1] else last[key[0]]
                for i, rid in enumerate(map(str, row_map.tags["rids"])):  # as _keys names them
                    if rid in last and i < rec.tensor.shape[0]:
                        target[last[rid]] = rec.tensor[i]
    return out


def compare(rollout, train, *, rtol: float = 1e-4, layer_offset: int = 1) -> Report:
    """The report for two dump directories (or lists of :class:`Rec`)."""
    a = index_rows(rollout if isinstance(rollout, list) else load(rollout))
    b = index_rows(gather_vocab_parallel(train if isinstance(train, list) else load(train)))
    ids_a, ids_b = a.get(("input_ids", None), {}), b.get(("input_ids", None), {})
    shared = sorted(set(ids_a) & set(ids_b))
    if not shared:
        raise LayoutError("no (request, position) is held by both sides: different request ids, or a side "
                          "without row_request / positions records")
    for key in shared:
        token_a, token_b = _token(ids_a[key], "rollout", key), _token(ids_b[key], "training", key)
        if token_a != token_b:
            raise LayoutError(f"layout self-test: request {key[0]!r} position {key[1]}: token "
                              f"{token_a} in the rollout, {token_b} in training")
    report = Report(tokens=len(shared), requests=len({k[0] for k in shared}), rtol=rtol)
    order = sorted((k for k in a if k[0] in NAMES), key=lambda k: (k[1] is None, k[1] or 0, _ORDER[k[0]]))
    for name, layer in order:
        other = (NAMES[name], None if layer is None else layer + layer_offset)
        if other not in b:
            continue
        keys = sorted(set(a[(name, layer)]) & set(b[other]))
        if keys:
            report.rows.append(_row(name, layer, [a[(name, layer)][k] for k in keys],
                                    [b[other][k] for k in keys], rtol))
    _routing(report, a, b, layer_offset)
    _next_token_logprobs(report, a, b, ids_a)
    return report


def _token(row: torch.Tensor, side: str, key) -> int:
    if row.numel() != 1:
        raise DumpError(f"input_ids of request {key[0]!r} position {key[1]} in {side}: {row.numel()} values, "
                        "expected one token id per row")
    return int(row.reshape(()))


def _width(rows, name, layer) -> int:
    """The values per row, the same in every row of both sides (else DumpError)."""
    sizes = sorted({t.numel() for t in rows})
    if len(sizes) != 1:
        raise DumpError(f"{name} layer {'-' if layer is None else layer}: rows of {', '.join(map(str, sizes))} "
                        "values (the two sides' hidden or vocabulary sizes differ?)")
    return sizes[0]


def _next_token_logprobs(report: Report, a: dict, b: dict, ids: dict) -> None:
    """Where both sides hold the logits at (request, p) and the token at p + 1 is known:
    each side's log-prob of that token, and the RL mismatch figures between them
    (rollout = behaviour policy).  SGLang keeps one logits row per request and pass, so
    these are the generated tokens (and the first after the prompt)."""
    import torch

    from .logprobs import mismatch, token_logprobs

    la, lb = a.get(("logits", None), {}), b.get(("logits", None), {})
    keys = sorted(k for k in set(la) & set(lb) if (k[0], k[1] + 1) in ids)
    if not keys:
        return
    targets = torch.tensor([_token(ids[(rid, pos + 1)], "rollout", (rid, pos + 1)) for rid, pos in keys])
    vocab = _width([la[k] for k in keys] + [lb[k] for k in keys], "logits", None)
    if not 0 <= int(targets.min()) <= int(targets.max()) < vocab:
        raise DumpError(f"next-token log-probs: token ids {int(targets.min())}..{int(targets.max())} outside "
                        f"the logits' vocabulary of {vocab}")
    rollout = token_logprobs(torch.stack([la[k].reshape(-1) for k in keys]), targets)
    train = token_logprobs(torch.stack([lb[k].reshape(-1) for k in keys]), targets)
    m = mismatch(rollout, train)
    report.logprobs = {**m.to_json(), "line": m.line()}


def _routing(report: Report, a: dict, b: dict, layer_offset: int) -> None:
    """Per rollout layer, the fraction of tokens whose set of experts is the same on both
    sides, and the fraction of tokens routed differently in at least one layer."""
    differ: dict = {}
    for (name, layer) in sorted(k for k in a if k[0] == ROUTING[0] and k[1] is not None):
        other = b.get((ROUTING[1], layer + layer_offset))
        if other is None:
            continue
        keys = sorted(set(a[(name, layer)]) & set(other))
        same = [set(a[(name, layer)][k].tolist()) == set(other[k].nonzero().reshape(-1).tolist())
                for k in keys]
        for k, ok in zip(keys, same):
            differ[k] = differ.get(k, False) or not ok
        if keys:
            report.routing.append({"layer": layer, "tokens": len(keys), "agreement": sum(same) / len(keys)})
    if differ:
        report.routing_any_differ = sum(differ.values()) / len(differ)


_ORDER = {name: i for i, name in enumerate(NAMES)}


def _row(name, layer, xs, ys, rtol) -> Row:
    import torch

    _width(list(xs) + list(ys), name, layer)
    x = torch.stack([t.float().reshape(-1) for t in xs])
    y = torch.stack([t.float().reshape(-1) for t in ys])
    diff = x - y
    ref = float(y.norm())
    # a zero reference: 0 if equal, else inf; a NaN anywhere stays NaN (it diverges either way)
    rel = float(diff.norm()) / ref if ref > 0 or math.isnan(ref) else (0.0 if float(diff.norm()) == 0 else math.inf)
    cos = float(torch.nn.functional.cosine_similarity(x.reshape(1, -1), y.reshape(1, -1)))
    return Row(name, layer, len(xs), float(diff.abs().max()), rel, cos, rel <= rtol)


DESCRIPTION = ("Compare rollout (SGLang) and training (Megatron) dumps of the same tokens layer by layer. "
               "Exit 0: no divergence, 1: divergence, 2: cannot compare.")
INPUTS = "replay.json"  # what `source-patch replay` writes into its run: checkpoint, builder, routes, versions


def add_report_arguments(p) -> None:
    """The options of a comparison (shared with `source-patch replay --compare`)."""
    p.add_argument("--rtol", type=float, default=1e-4, metavar="R",
                   help="relative L2 above which a layer diverges (default 1e-4)")
    p.add_argument("--layer-offset", type=int, default=1, metavar="N",
                   help="training layer = rollout layer + this (default 1: SGLang's layer ids are 0-based, "
                        "Megatron's layer numbers 1-based; the table shows the rollout's)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout instead of the table "
                   "(an error too: {\"error\": ..., \"exit\": 2})")
    p.add_argument("--json-out", metavar="FILE", help="write the report here as JSON (NaN and infinities as strings)")
    p.add_argument("--html", metavar="FILE", help="write the report here as a self-contained HTML page with plots")


def parser(prog: str = "python -m source_patch.runtime.verdict.compare"):
    p = commands.Parser(prog=prog, description=DESCRIPTION)
    p.add_argument("rollout", help="the rollout's dumps: a dump root (its latest run), a run or a rank folder")
    p.add_argument("train", help="the training side's dumps, the same way")
    p.add_argument("--exp-name", action="append", metavar="NAME",
                   help="the run to read under a dump root: once for both sides, twice for the rollout's "
                        "then the training side's")
    add_report_arguments(p)
    return p


def main(argv=None, prog: str = "python -m source_patch.runtime.verdict.compare") -> int:
    args = parser(prog).parse_args(argv)
    try:
        names = args.exp_name or [None]
        if len(names) > 2:
            raise ValueError("--exp-name: at most twice (the rollout's run, then the training side's)")
        rollout = reader.choose_for_cli(args.rollout, names[0])
        train = reader.choose_for_cli(args.train, names[-1])
    except (OSError, ValueError) as exc:
        return _fail(exc, args.json)
    return report(rollout, train, args)


def report(rollout, train, args, wrap=None) -> int:
    """Compare two dump folders with ``args``' options (:func:`add_report_arguments`),
    write the reports, print the table (under --json the report, through ``wrap``: what
    replay puts around it); the exit code (0, 1, 2; errors one line)."""
    try:
        for flag, path in (("--json-out", args.json_out), ("--html", args.html)):
            check_output(flag, path)
        result = compare(rollout, train, rtol=args.rtol, layer_offset=args.layer_offset)
        inputs = describe_inputs(rollout, train) if args.json or args.json_out or args.html else {}
    except (LayoutError, OSError, ValueError) as exc:  # DumpError is a ValueError
        return _fail(exc, args.json)
    except Exception as exc:  # noqa: BLE001 - a malformed dump nothing above foresaw: still exit 2, no traceback
        return _fail(f"unreadable dumps ({type(exc).__name__}: {exc})", args.json)
    data = json_safe({**result.to_json(), "inputs": inputs})
    code = 0 if result.first_divergent is None else 1
    try:  # before anything is printed: under --json, stdout holds one object, the report or the error
        if args.json_out:
            write_report(args.json_out, json.dumps(data, indent=1, allow_nan=False))
        if args.html:
            from . import compare_html

            compare_html.write({**result.to_json(), "inputs": inputs}, args.html)
    except OSError as exc:
        return _fail(f"cannot write the report: {exc}", args.json)
    if args.json:
        shown = {**data, "exit": code}
        print(json.dumps(wrap(shown) if wrap else shown, indent=1, allow_nan=False))
    else:
        print(result.table())
    return code


def describe_inputs(rollout, train) -> dict:
    """What a report was made from: both folders, what `source-patch replay` recorded
    in the training run (checkpoint, model builder, routes, its versions and time), the
    versions here and the time now."""
    from ..core import bounded

    train = Path(train)
    run = train.parent if (train / reader.MANIFEST).exists() else train
    out = {"rollout dumps": str(Path(rollout).resolve()), "training dumps": str(train.resolve())}
    if (run / INPUTS).exists():  # someone else's dumps too: bounded, a regular file only
        data = bounded.read_regular(run / INPUTS, max_bytes=1 << 16, what=INPUTS, error=reader.DumpError)
        recorded = bounded.load_json(data, what=str(run / INPUTS), error=reader.DumpError, max_items=100, kind=dict)
        if recorded.get("replayed rollout") == out["rollout dumps"]:
            del recorded["replayed rollout"]  # said once; shown only where it differs
        for key, value in recorded.items():  # never over what this comparison knows itself
            out.setdefault(str(key), value if isinstance(value, (str, int, float)) else json.dumps(value))
    out["compare versions"] = versions()
    out["compared at"] = time.strftime("%Y-%m-%d %H:%M:%S %z")
    return out


def versions() -> str:
    """The installed versions that a comparison or a replay depends on."""
    from importlib import metadata

    found = []
    for dist in ("source-patch", "torch", "megatron-core", "sglang"):
        try:
            found.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(found)


def check_output(flag: str, path) -> None:
    """Before comparing (or replaying): the report's folder must exist (it is not created:
    a mistyped path is an error, not a new folder), and the path must be absent or a
    regular file: a folder is refused, and so are a FIFO, a device or a socket, at once
    (writing to a FIFO would wait for a reader forever)."""
    if path is None:
        return
    folder = Path(path).parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: no folder {folder}")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder")
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):  # a link is replaced, never followed (core/private.py)
        raise ValueError(f"{flag} {path}: exists and is not a regular file (a FIFO, a device or a socket)")


def write_report(path, text: str) -> None:
    """A report written whole or not at all, never through what is at ``path`` (a link
    is replaced, a FIFO or a device refused): core/private.py's plain-file writer."""
    from ..core import private

    private.write_file(path, text.encode("utf-8"))


def _fail(message, as_json: bool = False) -> int:
    return commands.error(commands.first_line(message), as_json=as_json)


def json_safe(value):
    """``value`` with NaN and infinities as the strings "NaN", "Infinity", "-Infinity"
    (bare, as Python writes them, they are not JSON)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


if __name__ == "__main__":
    sys.exit(main())
