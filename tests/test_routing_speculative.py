"""Speculative decoding and SGLang routing capture (issue 31, build item 6).

A draft model's forwards never enter a target request's record; a target verify pass
scores every draft token, and only the accepted ones reach the record: rows are keyed
by KV slot, rejected tokens' slots are freed and never read back through
``req_to_token`` (SGLang's own capturer works the same way).

A real engine with speculative decoding cannot start on CPU with sglang 0.5.23 as
installed here; ``test_why_speculative_decoding_cannot_start_on_cpu`` checks each reason
on the real modules, so it fails (and the real-engine test must be written) the day one
stops holding.  The rest drives the real patched ``select_experts`` with real SGLang
objects (``ForwardBatch``, ``NgramVerifyInput``, ``EagleDraftInput``, ``Req``,
``ReqToTokenPool``) through the same call sites a serving engine runs.
"""

import importlib.util
import inspect
import warnings

import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("sglang") is None:
    pytest.skip("sglang is not installed", allow_module_level=True)

from source_patch.runtime.core.adapters.sglang_batch import DRAFT, BatchRows, Unattributed, batch_rows  # noqa: E402
from source_patch.runtime.routing.sglang import batch as rs_batch, call_sites as rs_sites  # noqa: E402
from source_patch.runtime.routing.sglang import capture as rs_capture, control as rs  # noqa: E402
from source_patch.runtime.routing.records.record import load  # noqa: E402

E, K = 8, 2


@pytest.fixture(autouse=True)
def _fresh():
    rs.reset()
    yield
    rs.reset()


def _select(topk_mod, logits, layer, allow=True):
    cfg = topk_mod.TopKConfig(top_k=K, renormalize=True, torch_native=True)
    cfg.allow_routed_experts_capture = allow
    topk_mod.select_experts(hidden_states=torch.zeros(logits.shape[0], 4), router_logits=logits,
                            layer_id=layer, topk_config=cfg)
    return torch.topk(torch.softmax(logits, -1), K).indices


def _forward_batch(mode: str, rids, seq_lens, slots, spec_info=None):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = len(slots)
    fb = ForwardBatch(forward_mode=getattr(ForwardMode, mode), batch_size=len(rids),
                      input_ids=torch.zeros(n, dtype=torch.int64), req_pool_indices=torch.arange(len(rids)),
                      seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.tensor(slots),
                      seq_lens_sum=sum(seq_lens), spec_info=spec_info)
    fb.rids, fb.seq_lens_cpu = list(rids), torch.tensor(seq_lens)
    return fb


def _verify_input(draft_tokens: int):
    from sglang.srt.speculative.ngram_info import NgramVerifyInput

    return NgramVerifyInput(draft_token_num=draft_tokens, new_seq_lens=torch.zeros(1, dtype=torch.int64))


def _draft_input():
    from sglang.srt.speculative.eagle_info import EagleDraftInput

    return EagleDraftInput(hidden_states=torch.zeros(1, 4), bonus_tokens=torch.zeros(1, dtype=torch.int64))


def test_why_speculative_decoding_cannot_start_on_cpu(sglang_cpu):
    from sglang.srt.mem_cache import kv_cache_configurator, memory_pool
    from sglang.srt.speculative import spec_info

    # NGRAM: its worker imports sgl_kernel's tree op on every platform but CUDA / HIP / XPU
    assert "from sglang.srt.speculative.ngram_worker import NGRAMWorker" in inspect.getsource(spec_info)
    assert importlib.util.find_spec("sgl_kernel") is None
    with pytest.raises(ModuleNotFoundError, match="sgl_kernel"):
        import sglang.srt.speculative.ngram_worker  # noqa: F401
    # EAGLE / STANDALONE (and NGRAM after it): any speculative algorithm gives the KV pools
    # a tiled KV copy, a Triton kernel warmed up at construction; Triton has no CPU driver
    assert "enable_kv_cache_copy=(get_spec().speculative_algorithm is not None)" in \
        inspect.getsource(kv_cache_configurator)
    with pytest.raises(RuntimeError, match="0 active drivers"):
        memory_pool.MHATokenToKVPool(size=16, page_size=1, dtype=torch.float32, head_num=1, head_dim=8,
                                     layer_num=1, device="cpu", enable_memory_saver=False,
                                     enable_kv_cache_copy=True)


def test_forwards_of_speculative_decoding_are_told_apart(sglang_cpu):
    verify = _forward_batch("TARGET_VERIFY", ["a", "b"], [5, 9], list(range(8)), _verify_input(4))
    assert batch_rows(verify, verify=True) == BatchRows("verify", ["a", "b"], [4, 4], [5, 9])
    assert isinstance(batch_rows(verify), Unattributed)  # only a consumer keyed by KV slot takes them
    assert isinstance(batch_rows(_forward_batch("TARGET_VERIFY", ["a"], [5], list(range(3)), _verify_input(4)),
                                 verify=True), Unattributed)  # 3 rows are not 4 draft tokens: no guess
    draft = _forward_batch("DECODE", ["a"], [5], [7], _draft_input())
    assert batch_rows(draft) is DRAFT and batch_rows(draft, verify=True) is DRAFT
    assert batch_rows(_forward_batch("DRAFT_EXTEND_V2", ["a"], [5], [7, 8])) is DRAFT
    plain = _forward_batch("DECODE", ["a"], [5], [7])
    assert batch_rows(plain) == BatchRows("decode", ["a"], [1], [4])

    class DraftRunner:  # only the flag SGLang's ModelRunner sets for its draft worker
        is_draft_worker = True

    assert batch_rows(plain, DraftRunner()) is DRAFT


def test_draft_forwards_are_neither_captured_nor_replayed_nor_are_unattributed_ones(sglang_topk, sglang_cpu):
    rs.configure(mode="capture")
    rs_batch.set_batch(["a"], [3], [0])
    _select(sglang_topk, torch.randn(3, E), layer=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a draft forward is expected: no "no ambient batch" warning
        rs_sites.routing_sglang_batch(_forward_batch("DECODE", ["a"], [4], [3], _draft_input()))
        _select(sglang_topk, torch.randn(1, E), layer=0)  # a draft TopK SGLang did not opt out
    rec = rs_capture.records()["a"]
    assert rec.seq_lens == [3] and rec.indices[0].shape[0] == 3

    rs.reset()
    rs.configure(mode="replay", replay=rec)  # one record: an unattributed batch would be replayed from it
    cfg = sglang_topk.TopKConfig(top_k=K, renormalize=True, torch_native=True)
    for fb in (_forward_batch("DECODE", ["a"], [4], [3], _draft_input()),
               _forward_batch("TARGET_VERIFY", ["a"], [4], [3, 4, 5], _verify_input(3))):  # replay: unattributed
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            rs_sites.routing_sglang_batch(fb)
        logits = torch.randn(3, E)
        out = sglang_topk.select_experts(hidden_states=torch.zeros(3, 4), router_logits=logits, layer_id=0,
                                         topk_config=cfg)
        assert torch.equal(out.topk_ids.long(), torch.topk(torch.softmax(logits, -1), K).indices)


def test_verify_passes_give_exactly_the_accepted_tokens_rows(sglang_topk, sglang_cpu, tmp_path):
    """Prompt of 4 tokens, then two verify passes of 3 draft tokens: 2 accepted of the
    first (its third slot is freed and reused by the second pass), 1 of the second.
    The record written at release has the prompt's rows, then exactly the accepted
    tokens' rows, from position 0, in both layers."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    rs.configure(mode="capture", dir=str(tmp_path))
    pool = ReqToTokenPool(size=2, max_context_len=32, device="cpu", enable_memory_saver=False)
    req = Req("a", "", [11, 12, 13, 14], SamplingParams(max_new_tokens=4))
    req.kv.req_pool_idx = 0
    torch.manual_seed(0)
    want = {0: [], 1: []}

    def forward(slots, keep, *, verify):
        rows = len(slots)
        if verify:
            fb = _forward_batch("TARGET_VERIFY", ["a"], [pool_len[0]], slots, _verify_input(rows))
        else:
            fb = _forward_batch("EXTEND", ["a"], [rows], slots)
            fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = [rows], [0]
        rs_sites.routing_sglang_batch(fb, runner)
        for layer in (0, 1):
            ids = _select(sglang_topk, torch.randn(rows + 1, E), layer=layer)  # + a padding row
            want[layer].append(ids[keep])
        accepted = [slots[i] for i in keep]
        pool.req_to_token[0, pool_len[0]:pool_len[0] + len(accepted)] = torch.tensor(accepted)
        pool_len[0] += len(accepted)

    class Runner:  # what the call site reads of a ModelRunner: its draft flag and its real pool
        is_draft_worker, req_to_token_pool = False, pool

    runner, pool_len = Runner(), [0]
    forward([10, 11, 12, 13], [0, 1, 2, 3], verify=False)
    forward([20, 21, 22], [0, 1], verify=True)
    forward([22, 23, 24], [0], verify=True)  # slot 22 was rejected above and is reused here
    req.output_ids.extend([15, 16, 17, 18])
    req.finished_reason = FINISH_LENGTH(length=4)
    rs_sites.routing_sglang_release(req)
    assert rs.state()["last_error"] is None
    rec = load(tmp_path / "rank0" / "a.safetensors")
    assert rec.seq_lens == [7] and rec.extra["start_pos"] == 0
    for layer in (0, 1):
        assert torch.equal(rec.indices[layer].long(), torch.cat(want[layer]).long())


def test_dumps_tag_a_draft_models_forward_as_draft(dumper, sglang_cpu):
    """dump_sglang_forward (patches/dump.yaml's model-forward entry) with a draft
    forward and then a target verify pass: the first's records say "draft", never a
    target mode; the second's say the mode SGLang runs it in."""
    from source_patch.runtime.dump import reader
    from source_patch.runtime.dump import sglang as dump_sglang

    model = torch.nn.Linear(2, 2)
    for fb in (_forward_batch("DECODE", ["a"], [4], [3], _draft_input()),
               _forward_batch("TARGET_VERIFY", ["a"], [4], [3, 4, 5], _verify_input(3))):
        dump_sglang.dump_sglang_forward(model, fb.input_ids, fb.input_ids, fb)
        dump_sglang.dump_sglang_forward_end()
    dumper.flush(10)
    modes = {(r.name, r.step): r.tags.get("forward_mode") for r in reader.load(dumper.state()["exp_dir"])}
    assert dumper.state()["counters"]["errors"] == 0
    first, second = sorted({step for _, step in modes})
    assert {mode for (_, step), mode in modes.items() if step == first} == {"draft"}
    assert {mode for (_, step), mode in modes.items() if step == second} == {"target_verify"}
