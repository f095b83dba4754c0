"""Megatron-Core model chunks -> full parameters under global names (trainer side
of weight sync).

    finish_param_gather(chunks)          # params current, also with overlap_param_gather
    params = MegatronParams(chunks)
    params.shapes()    # (name, full shape, dtype): what the sender plans with, no communication
    params.tensors()   # (name, full tensor): tensor-parallel shards gathered, experts global

Tensor-parallel shards are all-gathered in Megatron's own tensor-parallel group
(expert-tensor-parallel for experts), along each parameter's ``partition_dim``;
a gated ``linear_fc1`` is re-ordered from per-rank ``[gate_r; up_r]`` to
``[gate; up]``.  Expert-parallel ranks' experts are all-gathered in the expert
group, local index i of EP rank r becoming global expert ``r * local + i``.  Where
the parameters lie in DDP's buffers, a window of the buffer is gathered at a time
(``_Windows``: one collective for many parameters) over TP for the dense shards, and
for the experts over EP, expert TP, or both at once (Megatron's expert-tensor-and-
model-parallel group); otherwise parameter by parameter.
The ranks that take part are those whose groups hold global rank 0 (the
sender); everyone else returns at once.  Each participant walks the parameters
in the same order, so the gathers pair up.

Not supported (a clear error): pipeline parallelism and virtual pipeline
chunks, Megatron-FSDP.
"""

from __future__ import annotations

import functools
import hashlib
import re
import struct
import weakref

import torch
import torch.distributed as dist

from .names import strip_wrappers

_EXPERT = re.compile(r"(\.mlp\.experts\.local_experts\.)(\d+)(\.)|(\.mlp\.experts\.linear_fc[12]\.(?:weight|bias))(\d+)\Z")
_expert = functools.lru_cache(maxsize=1 << 18)(_EXPERT.search)  # the same names every push
_FC1 = re.compile(r"\.linear_fc1\.(?:weight|bias)\d*\Z")


class UnsupportedParallelism(RuntimeError):
    pass


# Walking named_parameters() costs ~2 us per parameter (75 ms for a 36k-parameter MoE),
# more than a 4 GiB NVLink transfer, and a model's parameters do not change between
# steps.  So each chunk's walk is kept until torch's global hooks see a parameter or
# module registered anywhere (assigned, added, replaced); `del` is not seen.
_registrations = 0
_walks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> (registrations, [(name, param)])


def _registered(*_) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
torch.nn.modules.module.register_module_module_registration_hook(_registered)


def named_params(chunk) -> list:
    """``chunk.named_parameters()`` without the wrappers' ``module.`` prefixes, walked
    again only after a parameter or module was registered since the last walk."""
    cached = _walks.get(chunk)
    if cached is not None and cached[0] == _registrations:
        return cached[1]
    walked = _registrations
    params = [(strip_wrappers(n), p) for n, p in chunk.named_parameters()]
    _walks[chunk] = (walked, params)
    return params


def finish_param_gather(chunks) -> None:
    """Make the model parameters current.  With the distributed optimizer and
    ``overlap_param_gather``, ``optimizer.step()`` only updates each rank's shard;
    the all-gather of the new values runs lazily in the next forward's pre-hooks.
    Run it now, synchronously, the way Megatron's ``disable_forward_pre_hook(
    param_sync=True)`` does before a checkpoint: ``start_param_sync(force_sync=True)``
    waits for a dispatched gather or gathers at once, and marks the buckets done so
    the next forward's hooks do not gather again.  Collective: every data-parallel
    rank must call it."""
    for chunk in chunks:
        ddp_config = getattr(chunk, "ddp_config", None)
        if ddp_config is None:
            continue
        if getattr(ddp_config, "use_megatron_fsdp", False):
            raise UnsupportedParallelism("weight sync does not support Megatron-FSDP")
        if ddp_config.use_distributed_optimizer and ddp_config.overlap_param_gather:
            chunk.start_param_sync(force_sync=True)


class MegatronParams:
    """The parameters of one model chunk, seen as full tensors with global names."""

    def __init__(self, chunks):
        from megatron.core import parallel_state as ps

        if len(chunks) != 1 or ps.get_pipeline_model_parallel_world_size() > 1:
            raise UnsupportedParallelism("weight sync supports one model chunk without pipeline "
                                         f"parallelism (got {len(chunks)} chunks, pp="
                                         f"{ps.get_pipeline_model_parallel_world_size()})")
        model = self.chunk = chunks[0]
        self.config = model.config
        self.params = named_params(model)  # the same list while the model is unchanged
        self.sender = dist.get_rank() == 0
        self.tp = self._group(ps.get_tensor_model_parallel_group())
        self.etp = self._group(ps.get_expert_tensor_parallel_group(check_initialized=False))
        self.ep = self._group(ps.get_expert_model_parallel_group(check_initialized=False))
        self.expert_grid = self._group(ps.get_expert_tensor_and_model_parallel_group(check_initialized=False))
        experts = self.config.num_moe_experts or 0
        self.local_experts = experts // self.ep[1] if experts else 0
        self.in_dense = 0 in dist.get_process_group_ranks(self.tp[0]) if self.tp[0] else self.sender
        self.in_expert = ps.get_expert_data_parallel_rank() == 0 if self.ep[0] else self.in_dense
        self.gated = bool(self.config.gated_linear_unit)
        self._gathers, self._windows = 0, {}  # of the last tensors(); windows by expert (bool)
        self._checked = False  # check_windows() ran (once a push)

    @staticmethod
    def _group(group):
        return (group, dist.get_world_size(group)) if group is not None else (None, 1)

    @property
    def gathers(self) -> bool:
        """Whether full tensors are gathered (tensor or expert parallel): else each
        parameter is its own full tensor."""
        return max(self.tp[1], self.etp[1], self.ep[1]) > 1

    @property
    def participates(self) -> bool:
        return self.in_dense or self.in_expert

    def shapes(self):
        """(global name, full shape, dtype) of every parameter, in ``tensors()`` order."""
        for name, param in self.params:
            shape = list(param.shape)
            expert = _expert(name) is not None
            size = (self.etp if expert else self.tp)[1]
            if getattr(param, "tensor_model_parallel", False) and size > 1:
                shape[param.partition_dim] *= size
            for global_name in self._global_names(name, expert):
                yield global_name, tuple(shape), param.dtype

    def tensors(self):
        """(global name, full tensor), in ``shapes()`` order.  Collective over the
        tensor- and expert-parallel groups of rank 0: every participant iterates it.
        ``collectives`` then counts the gathers it ran."""
        if not self._checked:
            self.check_windows()
        try:
            yield from self._full_tensors()
        finally:  # the windows are kept for the next push: not their last gathered bytes
            for windows in self._windows.values():
                if windows is not None:
                    windows[0].current = (None, None)

    def check_windows(self) -> dict:
        """This push's buffer windows by expert flag (collective: the layout check,
        once per push: ``tensors()`` then takes these)."""
        self._gathers, self._windows, self._checked = 0, {}, True
        for expert in (False, True):
            self._windows[expert] = self._windowed(expert)
        return self._windows

    def gather_only(self) -> None:
        """A participant other than the sender: ``tensors()``'s gathers, in its order,
        without joining shards (no one reads them here)."""
        self.check_windows()
        current = {False: None, True: None}
        for name, param, expert, windows, _ in self._walk():
            if windows is not None and id(param) in windows.where:
                index = windows.where[id(param)][0]
                if current[expert] != index:
                    current[expert] = index
                    windows._gather(index)
                continue
            group, size = self.etp if expert else self.tp
            if len(self._global_names(name, expert)) == 1:  # this rank's shard is all the others read
                if size > 1 and getattr(param, "tensor_model_parallel", False):
                    tensor = param.detach().contiguous()
                    dist.all_gather([torch.empty_like(tensor) for _ in range(size)], tensor, group=group)
                    self._gathers += 1
                continue
            full = self._gather_tp(name, param, group, size)  # the expert-parallel peers read it whole
            dist.all_gather([torch.empty_like(full) for _ in range(self.ep[1])], full.contiguous(), group=self.ep[0])
            self._gathers += 1

    def ops(self, layout) -> "list | None":
        """The sender's push as operations over memory that stays put, in ``shapes()``
        order, for program.py to plan once: ("gather", call) a buffer window into one
        of two kept slots, ("copy", dst, src) a shard into its place in a joined full
        tensor (kept staging memory), ("out", view, stable) an engine tensor as a view
        (names.to_hf_views; ``stable``: of the parameter itself, unchanged during the
        push).  None where a parameter is gathered on its own (no buffer windows):
        then the push takes ``tensors()``.  Run after ``check_windows()``."""
        from .names import to_hf_views
        from .program import Slots

        ops, current, slots = [], {False: None, True: None}, {}
        for name, param, expert, windows, mode in self._walk():
            names = self._global_names(name, expert)
            if windows is None or id(param) not in windows.where:
                if len(names) > 1 or ((self.etp if expert else self.tp)[1] > 1
                                      and getattr(param, "tensor_model_parallel", False)):
                    return None
                fulls, stable = [(names[0], param.detach())], True
            else:
                memory = slots.get(expert) or slots.setdefault(expert, Slots(windows))
                index = windows.where[id(param)][0]
                if current[expert] != index:
                    current[expert] = index
                    ops.append(("gather", functools.partial(windows.gather_into, index, memory.rows(index))))
                fulls, stable = self._slot_fulls(name, param, names, mode, windows, memory, ops), False
            for global_name, full in fulls:
                ops.extend(("out", view, stable) for _, view in to_hf_views(global_name, full, layout))
        return ops

    def _slot_fulls(self, name, param, names, mode, windows, memory, ops) -> list:
        """(global name, full tensor) of a windowed parameter, from its window's slot;
        a join's shard copies appended to ``ops``."""
        index = windows.where[id(param)][0]
        parts = memory.parts(param)
        if mode == "experts":
            return list(zip(names, parts))
        if mode == "shards":
            groups = [parts]
        elif getattr(param, "tensor_model_parallel", False):  # both
            groups = [[parts[m] for m in members] for members in windows.grid]
        else:  # both, not split by expert TP: each EP rank's first copy
            return list(zip(names, (parts[members[0]] for members in windows.grid)))
        fulls = []
        for global_name, shards in zip(names, groups):
            full = memory.staging(index, self._joined_shape(param, len(shards)), param.dtype)
            ops.extend(("copy", dst, src) for dst, src in self._join_pairs(name, param, shards, full))
            fulls.append((global_name, full))
        return fulls

    @staticmethod
    def _joined_shape(param, size: int) -> tuple:
        shape = list(param.shape)
        shape[param.partition_dim] *= size
        return tuple(shape)

    def _join_pairs(self, name: str, param: torch.Tensor, shards: list, full: torch.Tensor) -> list:
        """``_join`` as copies into ``full``: (destination view, shard piece)."""
        if self.gated and _FC1.search(name):
            halves = [shard.chunk(2, dim=0) for shard in shards]
            pieces, dim = [h[0] for h in halves] + [h[1] for h in halves], 0
        else:
            pieces, dim = shards, param.partition_dim
        pairs, at = [], 0
        for piece in pieces:
            pairs.append((full.narrow(dim, at, piece.shape[dim]), piece))
            at += piece.shape[dim]
        return pairs

    def _walk(self):
        """(name, param, expert, windows, mode) of each parameter this push sends, in
        order; ``windows`` / ``mode``: its kind's buffer windows (None without)."""
        for name, param in self.params:
            expert = _expert(name) is not None
            if self.in_expert if expert else self.in_dense:
                yield (name, param, expert, *(self._windows[expert] or (None, None)))

    def _full_tensors(self):
        for name, param, expert, windows, mode in self._walk():
            names = self._global_names(name, expert)
            if windows is not None and id(param) in windows.where:
                parts = windows.parts(param)
                if mode == "shards":  # tensor-parallel shards of one parameter
                    yield names[0], self._join(name, param, parts)
                elif mode == "experts":  # every expert-parallel rank's own expert
                    yield from zip(names, parts)
                elif getattr(param, "tensor_model_parallel", False):  # both: each EP rank's expert from its shards
                    for global_name, members in zip(names, windows.grid):
                        yield global_name, self._join(name, param, [parts[m] for m in members])
                else:  # both, a parameter expert TP does not split: each EP rank's first copy
                    yield from zip(names, (parts[members[0]] for members in windows.grid))
                continue
            full = self._gather_tp(name, param, *(self.etp if expert else self.tp))
            if len(names) == 1:
                yield names[0], full
                continue
            parts = [torch.empty_like(full) for _ in names]
            dist.all_gather(parts, full.contiguous(), group=self.ep[0])
            self._gathers += 1
            yield from zip(names, parts)

    @property
    def collectives(self) -> int:
        """The gathers the last ``tensors()`` ran (the buffer windows' included)."""
        return self._gathers + sum(w[0].gathers for w in self._windows.values() if w is not None)

    def _windowed(self, expert: bool) -> "tuple[_Windows, str] | None":
        """(windows, mode) for the dense or the expert parameters that need gathering,
        gathered a window of their DDP buffer at a time (one collective for many
        parameters instead of one each), when every rank of the group lays its buffers
        out alike (checked with one small gather); None: parameter by parameter.
        Modes: "shards", the tensor-parallel shards over TP (dense) or expert TP (EP 1);
        "experts", other ranks' experts over EP (expert TP 1); "both", over the group
        of EP x expert TP ranks, whose (EP rank, expert TP rank) come with the check
        (``windows.grid[ep rank]``: the group ranks of that EP rank's shards, in order)."""
        tp = self.etp if expert else self.tp
        if expert and self.ep[1] > 1:
            mode, group = ("experts", self.ep) if tp[1] == 1 else ("both", self.expert_grid)
        elif tp[1] > 1:
            mode, group = "shards", tp
        else:
            return None
        if not (self.in_expert if expert else self.in_dense) or group[0] is None:
            return None
        windows, digest = self._local_windows(expert, mode)
        if windows is None:
            return None  # (every rank sees the same structure, so all decide alike)
        place = [dist.get_rank(self.ep[0]), dist.get_rank(self.etp[0])] if mode == "both" else [0, 0]
        mine = torch.tensor([*digest, *place], dtype=torch.int64, device=windows.spans[0][0].device)
        every = [torch.empty_like(mine) for _ in range(group[1])]
        dist.all_gather(every, mine, group=group[0])
        self._gathers += 1
        if not all(torch.equal(other[:4], mine[:4]) for other in every):
            return None
        if mode == "both":
            places = sorted((int(o[4]), int(o[5]), member) for member, o in enumerate(every))
            windows.grid = [[member for ep, _, member in places if ep == r] for r in range(self.ep[1])]
            if any(len(members) != self.etp[1] for members in windows.grid):
                return None  # not an EP x expert-TP grid (every rank gathered the same places: all agree)
        windows.group = group[0]
        return windows, mode

    def _local_windows(self, expert: bool, mode: str) -> tuple:
        """(_Windows, layout digest as 4 int64) of this rank's parameters to gather,
        or (None, None) where windows would not help; built once per walk and mode
        and kept while the buffers stay where they were (~15 ms per push on 12k
        parameters otherwise).  The layout check across ranks still runs each push."""
        key = (expert, mode, WINDOW_BYTES)
        plans = _window_plans.setdefault(self.chunk, {})
        cached = plans.get(key)
        if cached is not None and cached[0] is self.params and (cached[1] is None or unmoved(cached[1].storages)):
            if cached[1] is not None:
                cached[1].reset()
            return cached[1], cached[2]
        params = [param for name, param in self.params if (_expert(name) is not None) == expert
                  and (mode != "shards" or getattr(param, "tensor_model_parallel", False))]
        windows = digest = None
        if params and all(param.is_contiguous() for param in params):
            windows = _Windows(params, WINDOW_BYTES)
            if len(windows.spans) == len(params):  # a storage per parameter (no DDP buffers): no gain
                windows = None
            else:  # a fixed size to gather
                digest = struct.unpack("<4q", hashlib.sha256(repr(windows.layout()).encode()).digest())
        plans[key] = (self.params, windows, digest)
        return windows, digest

    def _global_names(self, name: str, expert: bool) -> list:
        if not expert or self.ep[1] == 1:
            return [name]
        match = _expert(name)
        local = int(match.group(2) or match.group(5))
        names = []
        for rank in range(self.ep[1]):
            index = rank * self.local_experts + local
            if match.group(1):
                new = f"{match.group(1)}{index}{match.group(3)}"
            else:
                new = f"{match.group(4)}{index}"
            names.append(name[: match.start()] + new + name[match.end():])
        return names

    def _gather_tp(self, name: str, param: torch.Tensor, group, size: int) -> torch.Tensor:
        tensor = param.detach()
        if size == 1 or not getattr(param, "tensor_model_parallel", False):
            return tensor
        shards = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(shards, tensor.contiguous(), group=group)
        self._gathers += 1
        return self._join(name, param, shards)

    def _join(self, name: str, param: torch.Tensor, shards: list) -> torch.Tensor:
        """The full parameter from its tensor-parallel shards, in group rank order."""
        if self.gated and _FC1.search(name):
            # Each rank holds [gate_r; up_r]: gather the gates, then the ups.
            halves = [shard.chunk(2, dim=0) for shard in shards]
            return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
        return torch.cat(shards, dim=param.partition_dim)


def storage_anchors(tensors) -> list:
    """One tensor per storage, and where that storage was: ``unmoved`` tells later
    whether the buffers are still there (DDP's stay put)."""
    seen: dict = {}
    for tensor in tensors:
        seen.setdefault(tensor.untyped_storage().data_ptr(), tensor)
    return [(tensor, ptr) for ptr, tensor in seen.items()]


def unmoved(anchors: list) -> bool:
    return all(tensor.untyped_storage().data_ptr() == ptr for tensor, ptr in anchors)


WINDOW_BYTES = 256 << 20  # per rank of the group: the gathered window is the group's size times this
_window_plans: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # chunk -> {(expert, mode, bytes): windows}


class _Windows:
    """Consecutive parameters (in walk order) that lie in one storage, within
    WINDOW_BYTES of each other: each such window is gathered from every rank of the
    group in one all_gather of its bytes, on first need, and dropped for the next."""

    def __init__(self, params: list, limit: int):
        self.group, self.gathers, self.grid = None, 0, None
        self.where: dict = {}   # id(param) -> (window index, first byte in the storage, bytes)
        self.spans: list = []   # window -> (a parameter of its storage, first byte, bytes)
        for param in params:
            start = param.data_ptr() - param.untyped_storage().data_ptr()
            end = start + param.numel() * param.element_size()
            span = (param, start, end - start)  # a new window, unless it widens the last
            if self.spans:
                anchor, low, size = self.spans[-1]
                low, high = min(low, start), max(low + size, end)
                if anchor.untyped_storage().data_ptr() == param.untyped_storage().data_ptr() and high - low <= limit:
                    self.spans.pop()
                    span = (anchor, low, high - low)
            self.spans.append(span)
            self.where[id(param)] = (len(self.spans) - 1, start, end - start)
        self.current = (None, None)  # (window index, its gathered bytes per rank)
        # Where the windows' storages were (a parameter replaced by assignment makes a
        # new walk, so new windows).
        self.storages = storage_anchors(anchor for anchor, _, _ in self.spans)

    def reset(self) -> None:
        """For the next push: no gathered bytes, no gathers counted, group and grid anew."""
        self.group, self.gathers, self.grid, self.current = None, 0, None, (None, None)

    def layout(self) -> list:
        """What every rank must agree on: each window's first byte and size, and each
        parameter's window and offset (the buffers' layout, not their addresses)."""
        out = [len(self.spans)]
        for _, low, size in self.spans:
            out += [low, size]
        for index, start, nbytes in self.where.values():
            out += [index, start, nbytes]
        return out

    def parts(self, param) -> list:
        """The parameter as every rank of the group holds it, in group rank order."""
        index, start, nbytes = self.where[id(param)]
        if self.current[0] != index:
            self.current = (index, self._gather(index))
        offset = start - self.spans[index][1]
        return [rank[offset: offset + nbytes].view(param.dtype).view(param.shape) for rank in self.current[1]]

    def gather_into(self, index: int, gathered: list) -> None:
        """Window ``index`` gathered into ``gathered`` (kept memory: _Slots)."""
        anchor, low, size = self.spans[index]
        local = torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(anchor.untyped_storage(), low, (size,))
        dist.all_gather(gathered, local, group=self.group)
        self.gathers += 1

    def _gather(self, index: int) -> list:
        anchor, low, size = self.spans[index]
        local = torch.empty(0, dtype=torch.uint8, device=anchor.device).set_(anchor.untyped_storage(), low, (size,))
        rows = torch.empty((dist.get_world_size(self.group), -(-size // 16) * 16), dtype=torch.uint8,
                           device=anchor.device)  # rows 16-byte aligned, so every dtype view holds
        gathered = [row[:size] for row in rows]
        dist.all_gather(gathered, local, group=self.group)
        self.gathers += 1
        return gathered

