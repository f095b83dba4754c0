"""Non-finite provenance: which call site first saw a NaN or an Inf, per step.

Every training-side dump call site (``core.watch.tensor_hook``: activations, logits,
loss; dumping on or off) and the gradients at the optimizer step's return write "all
finite?" into a static float32 device tensor, with no host synchronisation.  An eager
call (float32, bfloat16 or float16) gets its own slot, ``flags[STATIC + k]`` for the
step's k-th call, and the calls of one layer are read together by one ``_foreach_norm``
(a reduction op costs the launching thread ~20 us of host time whatever the tensor's
size: per layer, not per call); the step's reads are kept (0-d tensors) and written into
their consecutive slots by one ``stack`` at the step's end (or at 1,024 kept):

    norms += _foreach_norm([x_k, x_k+1, ...], inf, dtype=float32)      # a layer's calls
    stack(norms, out=flags[STATIC:STATIC + len(norms)])               # the step's end

A batch is read when a call of another layer, device or stream comes, at 16 calls or
128 MiB held, and at the step's end; a tensor of 32 MiB or more (logits) is
read at once, alone (its read is device time, not host time, and it is not held).  A
call whose tensor is the previous call's, unchanged (a layer's output is the next
layer's input, and the embedding's the first layer's), is not read again: the earlier
site would be reported first anyway.  The batch holds references to tensors the
layer's forward made (most kept for backward anyway); one changed in place before its read (its ``_version`` moved) is read as it
is then, and an event on it says ``read_after_change``.  Under CUDA graph capture a
batch is kept until the capture is over (its read would be recorded, not run).

The norm with ``ord=inf`` is max |x|: NaN when x holds a NaN, inf when it holds an Inf,
finite otherwise (a maximum cannot overflow, as a sum of squares can).  Those slots are
handed out one per call in the order the calls ran, and written afresh every step:
nothing to zero.  Where a slot must stay the same from step to step (a site
under CUDA graph capture, whose replays run the recorded kernel again and again; a
float64 tensor, whose max |x| may not fit a float32) the site folds into a static slot
from the bottom, zeroed each step, in two kernels:

    flags[slot].addcmul_(vector_norm(x, inf), zero)     # 0, or NaN once anything was not finite

No copy of ``x``; on CUDA the float32 result of a 16-bit input is the reduction's own
(no cast kernel).  Gradients are read only where the step's result does not already say
they are finite (a successful step with a finite grad norm: Megatron computed it for
clipping, every gradient's bytes read once; reading them again would cost as much):
then one ``_foreach_norm`` over all of them (``main_grad`` where Megatron's DDP keeps it,
else ``grad``), stacked into their static slots (written once a step, so no fold), in
backward order (the output layer's first, the embedding's
last), after the step's activations.  A site is (name, layer, microbatch, phase) (a
captured graph's sites: microbatch None, ``cuda_graph`` True), or one parameter's
gradient.  Half the SLOTS are static, half per-call: past SLOTS/2 calls in a step the
rest fold into static slots, and past SLOTS/2 static sites the later ones share the
last, ``(more sites)``.

At each step's end (:func:`step_end`) the flags go to the host in one copy (CUDA:
non_blocking into pinned memory, an event recorded; read at the next step's end unless
already done; CPU: at once) and the static slots are zeroed.  A step with a non-finite
slot reports the first in execution order (the order the calls ran in that step; sites
under a graph replay, whose Python does not run, after those, in first-seen order): a
warning the first time in the run, an ``events.jsonl`` line (kind ``nonfinite``: step,
microbatch, phase, layer, name, rank, site activation/gradient, how many sites were
non-finite), the counter ``nonfinite_events``, and each callback of :func:`on_event`.

``dump_after`` N > 0: capabilities do not configure one another, so the event carries
``dump_request``, the dump ``configure()`` arguments that would dump that layer for the
next N steps; a callback (user code, which may import the dump runtime) applies it.
"""

from __future__ import annotations

import logging
import math
import re
import weakref

import torch

from ..core import tags as ambient, watch
from ..core.adapters.readback import Readback
from . import events

SLOTS = 1 << 15                  # 128 KiB of float32 flags on the device, as much pinned on the host
STATIC = SLOTS // 2              # static slots from the bottom; a step's calls take the rest, in order
KEPT_READS = 1024                # reads kept before they are written into their slots (else at the step's end)
BATCH_CALLS = 16                 # a layer's calls read together, at most this many
BATCH_BYTES = 128 << 20          # ... and this many bytes of tensors held until their read
ALONE_BYTES = 32 << 20           # a tensor this large is read at once, alone
_INF = float("inf")
_OWN_SLOT = (torch.float32, torch.bfloat16, torch.float16)  # max |x| fits a float32: a slot a call
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
log = logging.getLogger("source_patch.sentinels")

_armed = False
_dump_after = 0
_sites: dict = {}                # key -> site id
_info: list = []                 # site id -> its report fields
_static: list = []               # site id -> its static slot (None: none yet)
_static_site: list = []          # static slot -> its site id
_flags: torch.Tensor | None = None
_zero: torch.Tensor | None = None
_views: list = []                # static slot -> flags[slot] (a 0-d view), made with the slot
_calls = 0                       # per-call slots handed out this step
_batch: list = []                # (tensor, its _version, slot) of calls not read yet, one layer's
_batch_layer = None              # ... their layer, device, stream (CUDA: as _cuda_getCurrentStream says), bytes
_batch_device = None
_batch_stream = None
_batch_bytes = 0
_last = None                     # (weakref, _version) of the last eager call's tensor
_kept: list = []                 # (stream, [0-d norms]) read but not in their slots yet, in slot order
_kept_count = 0
_written = 0                     # per-call slots written this step (from STATIC)
_changed: set = set()            # per-call slots whose tensor changed in place before its read
_order: list = []                # (flag index, site id) in the order they ran this step
_ran: list = []                  # static slot -> the last step number (_tick) it ran in
_tick = 0
_pending = None                  # (host flags, order, statics, calls, step): a read not inspected yet
_reader = Readback()             # the flags' read back, one a step
_grads = weakref.WeakKeyDictionary()   # optimizer -> its watched (site id, param) list, in backward order
_models = weakref.WeakKeyDictionary()  # optimizer -> the model chunks it steps (sentinels_attach)
_callbacks: list = []
_counts = {"nonfinite_events": 0, "sites_watched": 0, "callback_errors": 0, "errors": 0}
_error: str | None = None
_warned = False


# ---------------------------------------------------------------- control (runtime/sentinels/control.py)


def apply(config: dict) -> None:
    global _armed, _dump_after
    _dump_after = config["dump_after"]
    _armed = bool(config["nonfinite"])
    watch.set_tensor_hook(_hook if _armed else None)
    if not _armed:  # disarmed mid-step: the held calls are never read, so no tensor stays held
        _drop_step()


def _drop_step() -> None:
    """Forget the step's calls (disarmed mid-step: armed again, the next step starts afresh)."""
    global _batch, _batch_bytes, _last, _kept, _kept_count, _written, _calls, _order, _changed
    _batch, _batch_bytes, _last, _kept, _kept_count, _written = [], 0, None, [], 0, 0
    _calls, _order, _changed = 0, [], set()


def counters() -> dict:
    return {**_counts, "sites_watched": len(_info)}


def last_error():
    return _error


def clear() -> None:
    """reset(): counters and the sites' table (slots are handed out again); flags zeroed."""
    global _error, _warned, _pending
    for key in _counts:
        _counts[key] = 0
    _error, _warned, _pending = None, False, None
    _drop_step()
    for table in (_sites, _info, _static, _static_site, _ran, _views, _grads):
        table.clear()
    if _flags is not None:
        _flags.zero_()


def on_event(callback) -> None:
    """Call ``callback(event)`` with each non-finite event (the dict written to events.jsonl),
    at the step end that reads it.  An exception it raises is counted (``callback_errors``,
    last_error) and training goes on; KeyboardInterrupt and SystemExit (and any other
    BaseException that is not an Exception) propagate out of the optimizer step: raise
    SystemExit to stop the run there."""
    _callbacks.append(callback)


def attach(optimizer, model_chunks) -> None:
    """get_megatron_optimizer's result and the model chunks it steps: gradients get their
    parameters' names."""
    try:
        if optimizer is not None and model_chunks is not None:
            _models[optimizer] = list(model_chunks)
    except TypeError:  # not weak-referenceable: its parameters go unnamed
        pass


# ---------------------------------------------------------------- the folds


def _hook(name: str, value, layer) -> None:
    """core.watch.tensor_hook: a dump call site's tensor."""
    try:
        if not isinstance(value, torch.Tensor):
            if isinstance(value, (tuple, list)):
                for i, element in enumerate(value):
                    _hook(f"{name}.{i}", element, layer)
            return
        if not value.is_floating_point() or value.numel() == 0:
            return  # integers and booleans are always finite
        # any capture, ours or not (torch.cuda.graph in user code): a replay runs no Python,
        # so the site needs a static slot
        graph = _capturing(value)
        if not graph and _last is not None and _last[0]() is value and _last[1] == value._version:
            # a layer's output handed to the next as its input: watched already, as it is now;
            # the layer before is done, so its batch is read (before this layer's in-place
            # ops, as under no_grad, can change the tensors it holds)
            if _batch and not _same_layer(layer, _batch_layer):
                read_batch()
            return
        context = ambient.context()
        key = (name, layer, None if graph else context.get("microbatch"), context.get("phase"), graph)
        site = _sites.get(key)
        if site is None:
            site = _sites[key] = _new_site(value.device, {
                "site": "activation", "name": name, "layer": ambient.tag_value(layer), "microbatch": key[2],
                "phase": key[3], **({"cuda_graph": True} if graph else {})})
        if (graph or value.dtype not in _OWN_SLOT or _calls >= SLOTS - STATIC
                or not (_flags.device == value.device or _place(value.device))):
            _fold_static(site, value)
            return
        _read_by_layer(site, value, layer)
    except Exception as exc:  # noqa: BLE001 - a watch must never break the caller
        _fail(f"the fold of {name!r}", exc)


def _read_by_layer(site: int, original, layer) -> None:
    """An eager call's own slot, read with the rest of its layer's batch (or alone)."""
    global _calls, _batch_layer, _batch_device, _batch_stream, _batch_bytes, _last
    value = original.detach()
    slot, _calls = STATIC + _calls, _calls + 1
    _order.append((slot, site))
    _last = (weakref.ref(original), original._version)
    nbytes = value.numel() * value.element_size()
    # the read runs on the stream the tensors were made on: one batch, one stream
    stream = torch._C._cuda_getCurrentStream(value.device.index) if value.is_cuda else None
    if _batch and (not _same_layer(layer, _batch_layer) or value.device != _batch_device or stream != _batch_stream
                   or len(_batch) >= BATCH_CALLS or _batch_bytes + nbytes > BATCH_BYTES or nbytes >= ALONE_BYTES):
        read_batch()  # not capturing here (a captured call folds into a static slot): read now
    if nbytes >= ALONE_BYTES:
        _keep(_norms([value]), stream, slot)
        return
    if not _batch:
        _batch_layer, _batch_device, _batch_stream, _batch_bytes = layer, value.device, stream, 0
    _batch.append((value, value._version, slot))
    _batch_bytes += nbytes


def _same_layer(a, b) -> bool:
    return a is b or (type(a) is int and type(b) is int and a == b)


def _capturing(value) -> bool:
    """A CUDA graph capture on the current stream (ours or not: torch.cuda.graph in user code)."""
    return value.is_cuda and torch.cuda.is_current_stream_capturing()


def read_batch() -> None:
    """Read the calls held: one _foreach_norm, kept for their (consecutive) slots.
    Kept while a CUDA graph is being captured (the read would be recorded, not run)."""
    global _batch, _batch_bytes
    if not _batch or _capturing(_batch[0][0]):
        return
    batch, _batch, _batch_bytes = _batch, [], 0
    tensors = [value for value, _, _ in batch]
    if _batch_stream is not None and torch._C._cuda_getCurrentStream(_batch_device.index) != _batch_stream:
        with torch.cuda.stream(_stream(_batch_stream)):  # read at a step's end on another stream
            _keep(_norms(tensors), _batch_stream, batch[0][2])
    else:
        _keep(_norms(tensors), _batch_stream, batch[0][2])
    for value, version, slot in batch:
        if value._version != version:  # changed in place since its call: read as it is now
            _changed.add(slot)


def _norms(tensors: list) -> list:
    """max |x| of each, float32: NaN where x holds a NaN, inf where it holds an Inf."""
    if len(tensors) == 1:
        return [torch.linalg.vector_norm(tensors[0], _INF, dtype=torch.float32)]
    return torch._foreach_norm(tensors, _INF, dtype=torch.float32)


def _keep(norms: list, stream, first: int) -> None:
    """The reads of the calls from slot ``first`` on (0-d tensors made on ``stream``, None on
    the CPU), written into their slots by one stack at the step's end (a stack a read would
    be one op more each): reads come in slot order."""
    global _kept_count
    if first != STATIC + _written + _kept_count:
        raise RuntimeError(f"read of slot {first} out of order (next: {STATIC + _written + _kept_count})")
    _kept.append((stream, norms))
    _kept_count += len(norms)
    if _kept_count >= KEPT_READS:
        write_kept()


def write_kept() -> None:
    """The reads kept into their slots, after those already written this step: one stack on
    the current stream (which first waits for any other stream a read was made on)."""
    global _kept, _kept_count, _written
    if not _kept:
        return
    kept, _kept, count, _kept_count = _kept, [], _kept_count, 0
    if _flags.is_cuda:
        here = torch._C._cuda_getCurrentStream(_flags.device.index)
        for stream, norms in kept:
            if stream is not None and stream != here:
                current = torch.cuda.current_stream(_flags.device)
                current.wait_stream(_stream(stream))
                for norm in norms:  # the allocator may not hand their blocks to that stream before the stack runs
                    norm.record_stream(current)
    start, _written = STATIC + _written, _written + count
    torch.stack([norm for _, norms in kept for norm in norms], out=_flags[start:start + count])


def _stream(packed: tuple):
    stream_id, device_index, device_type = packed
    return torch.cuda.Stream(stream_id=stream_id, device_index=device_index, device_type=device_type)


def _fold_static(site: int, value) -> None:
    slot = _static_slot(site)
    _ran_now(slot)
    norm = torch.linalg.vector_norm(value.detach(), _INF)
    try:
        _views[slot].addcmul_(norm, _zero)
    except RuntimeError:  # flags made on the CPU, then a GPU tensor (never the other way)
        if not _place(value.device):
            raise
        _views[slot].addcmul_(norm, _zero)


def gradients(optimizer, result=None) -> None:
    """The optimizer step's return (sentinels_grads): every gradient, in one _foreach_norm,
    unless ``result`` (the step's (success, grad_norm, num_zeros)) says they are finite."""
    if not _armed or _finite_norm(result):
        return
    try:
        watched = _grads.get(optimizer)
        if watched is None:
            watched = _grads[optimizer] = _watch_grads(optimizer)
        slots, grads = [], []
        for site, param in watched:
            grad = getattr(param, "main_grad", None)
            grad = param.grad if grad is None else grad
            if grad is not None and grad.numel():
                slots.append(_static_slot(site)), grads.append(grad.detach())
        if not grads:
            return
        _place(grads[0].device)
        norms = torch._foreach_norm(grads, _INF, dtype=torch.float32)
        if len(slots) == slots[-1] - slots[0] + 1 and _flags.device == grads[0].device:
            # the usual case: every gradient there, slots contiguous and theirs alone (written
            # once a step): max |grad| stacked straight into them, one kernel
            torch.stack(norms, out=_flags[slots[0]:slots[-1] + 1])
        else:
            for slot, norm in zip(slots, norms):
                _views[slot].addcmul_(norm, _zero)
        for slot in slots:
            _ran_now(slot)
    except Exception as exc:  # noqa: BLE001
        _fail("the fold of the gradients", exc)


def _finite_norm(result) -> bool:
    """A successful step's grad norm, a finite number: the norm of every gradient (each
    rank's, reduced over the model-parallel ranks) is finite only if each of them is, so
    none needs reading (no read of every gradient's bytes each step).  None (clip_grad 0),
    a tensor (reading it would wait for the device) or anything else: read them."""
    if not isinstance(result, tuple) or len(result) < 2 or not result[0]:
        return False
    norm = result[1]
    return isinstance(norm, (int, float)) and not isinstance(norm, bool) and math.isfinite(norm)


def _watch_grads(optimizer) -> list:
    """(site id, parameter) for each trainable parameter, in backward order."""
    named = _named_params(optimizer)
    device = next((p.device for _, p in named), torch.device("cpu"))
    out = []
    for name, param in reversed(named):
        match = _LAYER.search(name)
        # the chunk's local layer index + 1: Megatron's layer_number under one pipeline stage
        out.append((_new_site(device, {"site": "gradient", "name": f"grad:{name}",
                                       "layer": int(match.group(1)) + 1 if match else None,
                                       "microbatch": None, "phase": "grad"}), param))
    return out


def _named_params(optimizer) -> list:
    chunks = _models.get(optimizer)
    seen, out = set(), []
    if chunks:
        for i, chunk in enumerate(chunks):
            prefix = f"chunk{i}." if len(chunks) > 1 else ""
            for name, param in chunk.named_parameters():
                if param.requires_grad and id(param) not in seen:
                    seen.add(id(param))
                    out.append((prefix + re.sub(r"^(module\.)+", "", name), param))
        return out
    for param in _optimizer_params(optimizer):  # built without get_megatron_optimizer: no names
        if id(param) not in seen:
            seen.add(id(param))
            out.append((f"param{len(out)}{list(param.shape)}", param))
    return out


def _optimizer_params(optimizer) -> list:
    """The model's parameters an optimizer steps (where their main_grad is), any Megatron kind."""
    if hasattr(optimizer, "chained_optimizers"):
        return [p for member in optimizer.chained_optimizers for p in _optimizer_params(member)]
    for groups in (("model_float16_groups", "model_fp32_groups"),      # DistributedOptimizer
                   ("float16_groups", "fp32_from_fp32_groups")):        # Float16OptimizerWithFloat16Params
        if all(hasattr(optimizer, g) for g in groups):
            return [p for g in groups for group in getattr(optimizer, g) for p in group]
    return list(optimizer.get_parameters()) if hasattr(optimizer, "get_parameters") else []


def _new_site(device: torch.device, info: dict) -> int:
    _place(device)
    _info.append(info)
    _static.append(None)
    return len(_info) - 1


def _static_slot(site: int) -> int:
    """The site's static slot, handed out the first time it needs one; past STATIC, the
    last one, shared."""
    slot = _static[site]
    if slot is None:
        if len(_static_site) < STATIC:
            slot = len(_static_site)
            _static_site.append(site)
            _ran.append(-1)
            _views.append(_flags[slot])
        else:
            slot = STATIC - 1
            shared = _static_site[slot]
            _info[shared] = {**_info[shared], "name": "(more sites)"}
        _static[site] = slot
    return slot


def _place(device: torch.device) -> bool:
    """The flags on ``device``: made once, on the first site's device; moved (and True)
    only where they are on the CPU and a GPU tensor comes."""
    global _flags, _zero, _views, _pending
    if _flags is not None and (_flags.device == device or device.type == "cpu" or _flags.device.type != "cpu"):
        return False
    read_batch()  # into the old flags, on the batch's device
    write_kept()
    old = _flags
    _flags = torch.zeros(SLOTS, dtype=torch.float32, device=device)
    if old is not None:
        _flags.copy_(old)
    _zero = torch.zeros((), dtype=torch.float32, device=device)
    _views = [_flags[i] for i in range(len(_static_site))]
    _pending = None
    return True


def _ran_now(slot: int) -> None:
    if _ran[slot] != _tick:
        _ran[slot] = _tick
        _order.append((slot, _static_site[slot]))


# ---------------------------------------------------------------- the step's end


def step_end(step) -> None:
    """Read back what the step folded (without waiting on CUDA) and report it."""
    global _pending, _order, _tick, _calls, _changed, _last, _written
    if _flags is None or not (_armed or _pending):
        return
    try:
        drain()  # the last step's read: recorded a step ago, done or nearly
        read_batch()  # the step's last layer's calls
        write_kept()
        order, calls, statics, changed = _order, _calls, len(_static_site), _changed
        _order, _calls, _tick, _changed, _last, _written = [], 0, _tick + 1, set(), None, 0
        if not order and not statics:
            return  # nothing ran (a step whose sites are all under graph replays still has statics)
        host = _reader.start(_flags)  # 128 KiB: one copy, whatever the slots in use
        _flags[:statics].zero_()
        _pending = (host, order, statics, calls, changed, step)
        if _reader.done():  # CPU, or already landed: reported now, not a step late
            drain()
    except Exception as exc:  # noqa: BLE001
        _fail("reading the flags back", exc)


def drain() -> None:
    """flush()/close(), and each step end: a read still in flight is waited for and reported."""
    global _pending
    if _pending is not None:
        ready, _pending = _pending, None
        _reader.wait()
        _inspect(*ready)


def _inspect(host: torch.Tensor, order: list, statics: int, calls: int, changed: set, step) -> None:
    """``host``: the flags as the step left them (static slots [0, statics), the step's
    calls [STATIC, STATIC + calls)): a slot is bad where it is not finite."""
    # the usual step, all finite, in two sums (every slot is >= 0, NaN or inf: nothing
    # cancels, and a float64 sum cannot overflow); testing slot by slot costs 5x more
    if math.isfinite(float(host[:statics].sum(dtype=torch.float64))
                     + float(host[STATIC:STATIC + calls].sum(dtype=torch.float64))):
        return
    bad = set(torch.nonzero(~torch.isfinite(host[:statics])).flatten().tolist())
    if calls:
        bad.update((torch.nonzero(~torch.isfinite(host[STATIC:STATIC + calls])).flatten() + STATIC).tolist())
    if not bad:
        return
    ran = [(index, site) for index, site in order if index in bad]
    seen = {index for index, _ in ran}
    # static slots that no call of this step wrote: a graph replay's (its Python did not run)
    replayed = [(slot, _static_site[slot]) for slot in sorted(bad) if slot < statics and slot not in seen]
    first_slot, first = (ran or replayed)[0]
    info = _info[first]
    fields = {"step": step, "microbatch": info["microbatch"], "phase": info["phase"], "layer": info["layer"],
              "name": info["name"], "site": info["site"],
              "nonfinite_sites": len({site for _, site in ran + replayed}), "first_of_run": not _warned}
    if info.get("cuda_graph"):
        fields["cuda_graph"] = True
    if first_slot in changed:  # its tensor changed in place between the call and the read
        fields["read_after_change"] = True
    if _dump_after and info["layer"] is not None and isinstance(step, int):
        fields["dump_request"] = {"enable": True, "layers": str(info["layer"]),
                                  "steps": f"{step + 1}-{step + _dump_after}"}
    _report(fields)


def _report(fields: dict) -> None:
    global _warned
    _counts["nonfinite_events"] += 1
    record = events.event("nonfinite", **fields)
    if not _warned:
        _warned = True
        log.warning("source-patch sentinels: first non-finite value at step %s, microbatch %s, phase %s, "
                    "layer %s, %s (rank %s)%s", record["step"], record["microbatch"], record["phase"],
                    record["layer"], record["name"], record["rank"],
                    f"; events in {events.folder()}" if events.folder() else "")
    for callback in tuple(_callbacks):
        try:
            callback(dict(record))
        except Exception as exc:  # noqa: BLE001 - BaseExceptions (SystemExit, ...) go on up: documented
            _counts["callback_errors"] += 1
            _fail_quietly(f"callback {getattr(callback, '__name__', callback)!r}", exc)


def _fail(where: str, exc: Exception) -> None:
    if not _counts["errors"]:
        log.warning("source-patch sentinels: %s failed (%s: %s); training continues", where, type(exc).__name__, exc)
    _counts["errors"] += 1
    _fail_quietly(where, exc)


def _fail_quietly(where: str, exc: Exception) -> None:
    global _error
    _error = f"nonfinite: {where}: {type(exc).__name__}: {exc}"
