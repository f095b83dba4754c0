"""Compare two runs' dumps layer by layer, token by token: a rollout (SGLang) or a
training run (Megatron) on either side (patches/dump.yaml dumps both alike).

    source-patch compare A B [--exp-name NAME]... [--json] [--json-out r.json] [--html r.html] [--rtol 1e-4]

    import source_patch.runtime.verdict.compare as dump_compare
    report = dump_compare.compare("sp-dumps/rollout", "sp-dumps/train")
    print(report.table()); report.first_divergent     # (name, layer) or None

The steps, each its own module:

* each side's kind and layer numbering, from its records (sides.py): every layer in a
  report is numbered from 0 (SGLang's ``layer_id``; Megatron's ``layer_number - 1``);
* shards joined: tensor-parallel copies, slices and partial sums, expert-parallel
  pieces in global expert order, vocab-parallel logits (join.py);
* rows keyed by (request id, token position) through each pass's ``row_request`` (+ its
  ``rids`` tag) and ``positions``, context- and sequence-parallel slices reassembling by
  their keys (rows.py); where both sides name their rows, the rows of each (name, layer)
  are paired by key, after the layout self-test: the token id of every paired (request,
  position) must be the same on both sides, or the comparison stops with the first
  mismatch (a misaligned batch can have matching shapes and still pair the wrong
  tokens); where neither does, tensors are paired by (step, micro-batch, name, layer)
  and compared element by element when their shapes are equal;
* per (name, layer), in layer order: rows compared, max |a - b|, relative L2 ``||a - b||
  / ||b||``, cosine, and the drill-down (drill.py): where the largest |a - b| is, its
  percentiles, the worst tokens; the first row past ``rtol`` is the first divergent
  layer, and its tokens, every one, make the report's per-token view;
* routing agreement and next-token log-probs (agreement.py);
* what could not be compared, one line each naming the side and what it lacks: a name
  or layer only one side dumped, a side with no row map where the other has one, tensors
  of different shapes, rows only one side holds; the positions a rollout took from its
  prefix cache (radix cache on: the engine dumps only what it computed) are counted and
  said, never an error.  Nothing comparable at all is an error.

Exit codes of the CLI: 0 no divergence, 1 divergence, 2 anything that stops the
comparison (a failed layout self-test, nothing that pairs, unreadable or malformed
dumps, a report that cannot be written, a dump root whose runs are of different kinds),
always as one line ``source-patch: error: ...`` on stderr (and as JSON on stdout under
``--json``, which prints the report as JSON instead of the table).  A dump root is read
at its latest run (reader.choose); the reports record their inputs
(:func:`describe_inputs`).  Torch is imported when a comparison runs, not with this
module (``source-patch replay --help`` reads its options).
"""

from __future__ import annotations

import json
import math
import os
import stat
import sys
import time
from pathlib import Path

from ..core import commands
from ..dump import reader
from . import agreement, drill, join, records, rows, sides
from .records import MAPS, DumpError, LayoutError, Rec, load  # noqa: F401 - the public names of a comparison
from .report import Report, Row  # noqa: F401

# The quantities both dump specs write with the same meaning, in the order a layer computes
# them: the table's order within a layer (other names follow, alphabetically).
NAMES = ("layer_input", "attention_output", "pre_mlp_residual", "mlp_output", "final_hidden", "logits")
ROUTING = agreement.ROUTING
_ORDER = {name: i for i, name in enumerate(NAMES)}
# Names without a layer computed before the first layer: the table (and the first
# divergent row) puts them first, the others without a layer last.
BEFORE_LAYERS = ("embedding_output", "embeddings")


def _table_order(key) -> tuple:
    name, layer = key
    place = 0 if name in BEFORE_LAYERS else 2 if layer is None else 1
    return place, layer or 0, _ORDER.get(name, len(NAMES)), name


def compare(a, b, *, rtol: float = 1e-4, layer_offset: int | None = None) -> Report:
    """The report for two dump folders (or lists of :class:`Rec`): A against B, B the
    reference of relative L2.  ``layer_offset``: B's layer tag = A's + this, instead of
    each side's numbering read from its records."""
    side_a, side_b = _side(a, "A"), _side(b, "B")
    sides.detect(side_a, None if layer_offset is None else 0)
    sides.detect(side_b, layer_offset)
    report = Report(rtol=rtol, layer_numbering=sides.numbering(side_a, side_b, layer_offset))
    lacking = _read(side_a, side_b)
    report.joined = join.join(side_a, side_b)
    ia, ib = rows.index(side_a), rows.index(side_b)
    pairing = rows.pair(ia, ib)
    if pairing.size:
        rows.self_test(ia, ib, pairing)
        report.prefix_cache_rows, report.not_compared = rows.not_compared(ia, ib, pairing)
        report.tokens, report.requests = pairing.size, len({k[0] for k in pairing.keys})
    measured = {}
    keys = {k for index in (ia, ib) for k in (*index.rows, *index.loose) if k[0] not in MAPS + ROUTING}
    for name, layer in sorted(keys, key=_table_order):
        found = _pair_rows(ia, ib, pairing, name, layer) if (name, layer) in ia.rows and (name, layer) in ib.rows \
            else _pair_tensors(ia, ib, name, layer, lacking)
        if found is None:
            continue
        x, y, labels = found
        m = drill.measure(x, y, labels)
        report.rows.append(Row(name, layer, m.rows, m.max_abs, m.rel_l2, m.cosine, m.rel_l2 <= rtol,
                               m.where, m.percentiles, m.worst))
        measured[(name, layer)] = (m.per_row, labels)
    agreement.routing(report, ia, ib, pairing)
    agreement.next_token_logprobs(report, ia, ib, pairing)
    report.not_compared += _lines(lacking)
    if not report.rows and not report.routing and report.logprobs is None:
        raise LayoutError(_nothing(ia, ib, pairing, report.not_compared))
    if report.rows:
        shown = next((r for r in report.rows if not r.ok), None) or max(
            report.rows, key=lambda r: math.inf if math.isnan(r.rel_l2) else r.rel_l2)
        report.token_view = drill.token_view(shown.name, shown.layer, *measured[(shown.name, shown.layer)])
    return report


def _side(x, label: str) -> sides.Side:
    if isinstance(x, list):
        return sides.Side(label, None, x)
    return sides.Side(label, str(x), records.manifest(x))


def _read(a: sides.Side, b: sides.Side) -> list:
    """Read the tensors a comparison needs: the row maps, routing, and every name both
    sides dumped; the (name, layer)s only one side dumped are returned, not read."""
    names = [{r.name for r in side.records} for side in (a, b)]
    wanted = (names[0] & names[1]) | set(MAPS) | set(ROUTING)
    lacking = []
    for side, other, mine, theirs in ((a, b, names[0], names[1]), (b, a, names[1], names[0])):
        for r in side.records:
            if r.name not in theirs and r.name not in wanted:
                lacking.append((r.name, side.layer(r.tags.get("layer")), f"only in {side} ({other.label} lacks it)"))
        if side.folder is not None:
            side.records = records.read(side.records, wanted)
        else:
            side.records = [r for r in side.records if r.name in wanted]
    return lacking


def _pair_rows(ia, ib, pairing, name, layer):
    """(x, y, labels) of the rows of (name, layer) both sides hold, or None."""
    import torch

    pa, pb = ia.rows[(name, layer)], ib.rows[(name, layer)]
    wa, wb = rows.widths(pa), rows.widths(pb)
    if len(wa | wb) != 1:
        raise DumpError(f"{name} layer {'-' if layer is None else layer}: rows of "
                        f"{', '.join(map(str, sorted(wa | wb)))} values (the two sides' hidden or vocabulary "
                        f"sizes differ?: {ia.side} {sorted(wa)}, {ib.side} {sorted(wb)})")
    if not pairing.size:
        return None
    at_a, at_b = rows.locate(pa, pairing.slot_a, pairing.size), rows.locate(pb, pairing.slot_b, pairing.size)
    slots = ((at_a >= 0) & (at_b >= 0)).nonzero().reshape(-1)
    if not len(slots):
        return None
    labels = drill.Labels(keys=_Picked(pairing.keys, slots), tokens=_Picked(pairing.tokens, slots))
    return rows.take(pa, at_a[slots], torch.float32), rows.take(pb, at_b[slots], torch.float32), labels


class _Picked:
    """``values[slots[i]]`` by index, without building the list (only the reported rows are read)."""

    def __init__(self, values, slots):
        self.values, self.slots = values, slots.tolist()

    def __len__(self):
        return len(self.slots)

    def __getitem__(self, i):
        value = self.values[self.slots[i]]
        return value.item() if hasattr(value, "item") else value

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def _pair_tensors(ia, ib, name, layer, lacking):
    """(x, y, labels) of the tensors of (name, layer) neither side names rows of, paired
    by (step, micro-batch) (and rank, where a step has several), equal shapes compared
    element by element; what cannot be paired goes to ``lacking``."""
    import torch

    for index, other in ((ia, ib), (ib, ia)):
        if (name, layer) in index.rows and (name, layer) in other.loose:
            lacking.append((name, layer, f"{other.side} has no row map for it, {index.side.label} names its rows"))
            return None
        if (name, layer) not in other.rows and (name, layer) not in other.loose:
            lacking.append((name, layer, f"only in {index.side} ({other.side.label} lacks it)"))
            return None
    steps: dict = {}
    for i, index in enumerate((ia, ib)):
        for r in index.loose[(name, layer)]:
            steps.setdefault((r.tags.get("step"), r.tags.get("microbatch")), ([], []))[i].append(r)
    pairs = []
    for (step, microbatch), (xs, ys) in sorted(steps.items(), key=lambda kv: [(v is None, v or 0) for v in kv[0]]):
        matched = list(zip(xs, ys)) if len(xs) == len(ys) == 1 else [
            (x, y) for x in xs for y in ys if x.tags.get("rank") == y.tags.get("rank")]
        if not matched:
            lacking.append((name, layer, f"step {step} microbatch {microbatch}: " + (
                f"only in {ib.side}" if not xs else f"only in {ia.side}" if not ys else
                "A's and B's ranks do not match")))
        for x, y in matched:
            if x.tensor.shape != y.tensor.shape:
                lacking.append((name, layer, f"shapes differ: {ia.side} {list(x.tensor.shape)}, "
                                             f"{ib.side} {list(y.tensor.shape)}"))
            else:
                pairs.append((x.tensor, y.tensor, step, microbatch))
    if not pairs:
        return None
    width = {t.shape[-1] if t.dim() else 1 for t, _, _, _ in pairs}
    width = width.pop() if len(width) == 1 else 1
    xs, ys, pieces, start = [], [], [], 0
    for x, y, step, microbatch in pairs:
        xs.append(x.reshape(-1, width).float())
        ys.append(y.reshape(-1, width).float())
        pieces.append((start, len(xs[-1]), width, step, microbatch))
        start += len(xs[-1])
    return torch.cat(xs), torch.cat(ys), drill.Labels(pieces=pieces)


def _lines(lacking) -> list:
    """One line per (what, name) of what was not compared, its layers together."""
    merged: dict = {}
    for name, layer, what in lacking:
        merged.setdefault((name, what), set()).add(layer)
    out = []
    for (name, what), layers in merged.items():
        numbered = sorted(x for x in layers if x is not None)
        where = ("" if not numbered else (f" layer {numbered[0]}" if len(numbered) == 1 else
                                          f" layers {_ranges(numbered)}")) + (" (and no layer)" if None in layers
                                                                              and numbered else "")
        out.append(f"not compared: {name}{where}: {what}")
    return out


def _ranges(values) -> str:
    spans, start = [], values[0]
    for prev, cur in zip(values, values[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            spans.append(str(start) if start == prev else f"{start}-{prev}")
            start = cur
    return ", ".join(spans)


def _nothing(a, b, pairing, lines) -> str:
    """Why nothing could be compared, in one line."""
    for index, other in ((a, b), (b, a)):
        if other.maps and not index.maps and index.loose:
            return (f"{index.side} has no row_request / positions records, {other.side.label} has: its rows cannot be "
                    "paired by (request, position), and no tensor pairs as it is")
        if index.maps and ("input_ids", None) not in index.rows:
            return f"{index.side} has no input_ids rows: the layout self-test cannot run, so no row is paired"
    if a.maps and b.maps and not pairing.size:
        return (f"no (request, position) is held by both sides: {a.side} holds requests "
                f"{_few({k[0] for k in a.keys})}, {b.side} {_few({k[0] for k in b.keys})}")
    if lines:
        return lines[0] + (f" (and {len(lines) - 1} more such lines)" if len(lines) > 1 else "")
    return f"nothing to compare: {a.side} and {b.side} hold no records of a name both dumped"


def _few(values, most: int = 4) -> str:
    shown = sorted(map(repr, values))
    return ", ".join(shown[:most]) + (f" and {len(shown) - most} more" if len(shown) > most else "") or "none"


def index_rows(recs) -> dict:
    """{(name, layer tag): {(rid, position): row tensor}} of one side's records (their
    layer tags as dumped): the row maps read the way a comparison reads them."""
    side = sides.detect(sides.Side("A", None, recs), 0)
    index = rows.index(side)
    names = index.key_list()
    out: dict = {}
    for key, pieces in index.rows.items():
        target = out.setdefault(key, {})
        for t, ids in pieces:
            for i, row in zip(ids.tolist(), t):
                if i >= 0:
                    target[names[i]] = row
    return out


def gather_vocab_parallel(recs) -> list:
    """One side's records with its tensor-parallel shards joined (join.py; vocab-parallel
    logits concatenated along the vocabulary, in TP order)."""
    side, other = sides.Side("A", None, list(recs)), sides.Side("B", None, [])
    join.join(sides.detect(side), sides.detect(other))
    return side.records


DESCRIPTION = ("Compare two runs' dumps of the same tokens layer by layer: rollout (SGLang) or training "
               "(Megatron) on either side. Exit 0: no divergence, 1: divergence, 2: cannot compare.")
INPUTS = "replay.json"  # what `source-patch replay` writes into its run: checkpoint, builder, routes, versions


def add_report_arguments(p) -> None:
    """The options of a comparison (shared with `source-patch replay --compare`)."""
    p.add_argument("--rtol", type=float, default=1e-4, metavar="R",
                   help="relative L2 above which a layer diverges (default 1e-4)")
    p.add_argument("--layer-offset", type=int, default=None, metavar="N",
                   help="B's layer tag = A's + this (default: each side's numbering read from its records, "
                        "layers shown from 0: SGLang's layer_id, Megatron's layer_number - 1)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout instead of the table "
                   "(an error too: {\"error\": ..., \"exit\": 2})")
    p.add_argument("--json-out", metavar="FILE", help="write the report here as JSON (NaN and infinities as strings)")
    p.add_argument("--html", metavar="FILE", help="write the report here as a self-contained HTML page with plots")


def parser(prog: str = "python -m source_patch.runtime.verdict.compare"):
    p = commands.Parser(prog=prog, description=DESCRIPTION)
    p.add_argument("rollout", help="A: one run's dumps (a rollout's or a training run's): a dump root "
                   "(its latest run), a run or a rank folder")
    p.add_argument("train", help="B: the other run's dumps, the same way (the reference of relative L2)")
    p.add_argument("--exp-name", action="append", metavar="NAME",
                   help="the run to read under a dump root: once for both sides, twice for A's then B's")
    add_report_arguments(p)
    return p


def main(argv=None, prog: str = "python -m source_patch.runtime.verdict.compare") -> int:
    args = parser(prog).parse_args(argv)
    try:
        names = args.exp_name or [None]
        if len(names) > 2:
            raise ValueError("--exp-name: at most twice (A's run, then B's)")
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
