"""Non-finite provenance (runtime/sentinels/nonfinite.py, issue 54 item 1).

In process: dump's call site and the watch hook (core/watch.py), the fold, the report
(first site in execution order, once per step, flags reset), callbacks, gradients, the
contract.  End to end (real processes, Megatron's own schedule and optimizer on CPU,
tests/e2e/sentinels_run.py): a NaN planted at a chosen (step, microbatch, layer), an Inf
planted in one gradient, and a clean run of 50 steps.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from source_patch.runtime.core import capability, tags, watch
from source_patch.runtime.dump import api as dump
from source_patch.runtime.sentinels import control, events, nonfinite

NAN, INF = float("nan"), float("inf")


@pytest.fixture
def armed(tmp_path):
    """The non-finite watch armed, writing to tmp_path; disarmed and cleared after."""
    control.configure(nonfinite=True, dir=str(tmp_path))
    control.reset()
    restore = tags.set_context(phase="fwd_bwd", microbatch=0)
    yield tmp_path
    restore.__exit__()
    nonfinite._callbacks.clear()
    control.close()
    control.configure_from_settings()
    control.reset()


def lines(folder: Path) -> list:
    path = folder / "rank-0" / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -------------------------------------------------------------- dump's call site, the hook


def test_the_disabled_path_is_one_flag_test_when_no_hook_is_set(monkeypatch):
    assert not dump.on and watch.tensor_hook is None and dump._gate is False
    x = torch.ones(3)
    seen = []
    # A hook put there without set_tensor_hook is never even looked at: the one test is _gate.
    monkeypatch.setattr(watch, "tensor_hook", lambda *a: seen.append(a))
    assert dump.dump("layer_output", x, layer=1) is x and seen == []
    monkeypatch.setattr(watch, "tensor_hook", None)
    state = dump.state()
    assert dump.dump("layer_output", x, layer=1) is x and dump.state()["counters"] == state["counters"]


def test_a_hook_sees_every_dump_call_dumping_off_and_is_cleared_again():
    seen = []
    watch.set_tensor_hook(lambda name, value, layer: seen.append((name, layer)))
    try:
        assert dump._gate is True and not dump.on
        x = torch.ones(2)
        assert dump.dump("mlp_output", x, layer=3) is x and dump.dump("logits", x) is x
        assert seen == [("mlp_output", 3), ("logits", None)]
    finally:
        watch.set_tensor_hook(None)
    assert dump._gate is False


# -------------------------------------------------------------- the fold and the report


def forward(step_nan=None, inf_at=None):
    """A toy forward through dump's call sites: 2 microbatches x 2 layers x 2 names, logits."""
    for mb in range(2):
        tags.set_context(microbatch=mb)
        for layer in (1, 2):
            for name in ("attention_output", "layer_output"):
                x = torch.ones(4, 3)
                if (mb, layer, name) == step_nan:
                    x[1, 2] = NAN
                if (mb, layer, name) == inf_at:
                    x[0, 0] = -INF
                dump.dump(name, x, layer=layer)
        dump.dump("logits", torch.ones(4, 8))
        dump.dump("routing_map", torch.ones(4, 8, dtype=torch.bool), layer=1)  # never a slot


def test_the_first_site_in_execution_order_is_reported_once_per_step(armed):
    forward()
    control.sentinels_step()
    assert lines(armed) == [] and control.state()["counters"]["sites_watched"] == 2 * (2 * 2 + 1)
    # a NaN at microbatch 0 layer 2; the Inf later (microbatch 1) is not the first
    forward(step_nan=(0, 2, "attention_output"), inf_at=(1, 1, "layer_output"))
    control.sentinels_step()
    (event,) = lines(armed)
    assert {k: event[k] for k in ("kind", "step", "microbatch", "phase", "layer", "name", "site", "rank")} == {
        "kind": "nonfinite", "step": 1, "microbatch": 0, "phase": "fwd_bwd", "layer": 2,
        "name": "attention_output", "site": "activation", "rank": 0}
    assert event["nonfinite_sites"] == 2 and event["first_of_run"] is True
    forward()  # the flags were reset after the read: a clean step says nothing
    control.sentinels_step()
    assert len(lines(armed)) == 1
    forward(inf_at=(1, 1, "layer_output"))
    control.sentinels_step()
    later = lines(armed)[-1]
    assert (later["step"], later["microbatch"], later["layer"], later["first_of_run"]) == (3, 1, 1, False)
    state = control.state()
    assert capability.state_violations(state) == [] and state["counters"]["nonfinite_events"] == 2
    assert state["last_error"] is None


def test_sites_first_seen_later_are_ordered_by_when_they_ran(armed):
    forward()
    control.sentinels_step()
    tags.set_context(phase="fwd_only", microbatch=0)   # an evaluation pass, its sites new
    dump.dump("layer_output", torch.full((2,), NAN), layer=1)
    tags.set_context(phase="fwd_bwd", microbatch=0)
    dump.dump("layer_output", torch.full((2,), NAN), layer=1)  # an older slot, but it ran later
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["phase"], event["layer"]) == ("fwd_only", 1)


def test_each_call_has_its_own_slot_so_a_site_run_twice_keeps_the_first_nan(armed):
    """An eager call writes its own slot (one kernel, nothing to zero): a site that runs
    twice in a step (an activation recompute) does not overwrite the first call's NaN."""
    dump.dump("layer_output", torch.full((2,), NAN), layer=1)
    dump.dump("layer_output", torch.ones(2), layer=1)
    assert nonfinite._calls == 2 and len(nonfinite._static_site) == 0
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["name"], event["layer"], event["nonfinite_sites"]) == ("layer_output", 1, 1)


def test_a_layers_calls_are_read_together_and_the_first_nan_is_still_its_own_site(armed):
    """One _foreach_norm a layer: the calls are held until another layer's call comes,
    and each still reports as itself."""
    dump.dump("attention_output", torch.ones(3), layer=1)
    dump.dump("mlp_output", torch.full((3,), NAN), layer=1)
    dump.dump("layer_output", torch.full((3,), INF), layer=1)
    assert len(nonfinite._batch) == 3  # held: one read for the layer
    dump.dump("attention_output", torch.ones(3), layer=2)
    assert [slot for _, _, slot in nonfinite._batch] == [nonfinite.STATIC + 3]  # layer 1 read, layer 2 held
    control.sentinels_step()
    assert nonfinite._batch == []  # read at the step's end: nothing held across steps
    (event,) = lines(armed)
    assert (event["name"], event["layer"], event["nonfinite_sites"]) == ("mlp_output", 1, 2)
    assert "read_after_change" not in event


def test_a_layers_output_handed_on_as_the_next_layers_input_is_read_once(armed):
    """Megatron hands a layer's output tensor to the next layer: its layer_input call sees
    the same tensor, unchanged, and takes no slot; changed in place, it is read again."""
    out = torch.ones(3)
    dump.dump("layer_output", out, layer=1)
    dump.dump("layer_input", out, layer=2)
    assert nonfinite._calls == 1 and nonfinite._batch == []  # layer 1 is done: its batch read
    out.add_(1)
    dump.dump("layer_input", out, layer=2)  # changed since its call: its own slot
    assert nonfinite._calls == 2
    dump.dump("layer_output", torch.full((3,), NAN), layer=2)
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["name"], event["layer"], event["nonfinite_sites"]) == ("layer_output", 2, 1)
    dump.dump("layer_output", out, layer=1)  # a new step reads it again
    assert nonfinite._calls == 1


def test_reads_are_written_into_their_slots_by_one_stack_at_the_step_end(armed, monkeypatch):
    """A read is one op (its _foreach_norm); its results are kept and the step end writes
    them all into their consecutive slots in one stack (or when KEPT_READS are kept)."""
    stacks, real = [], torch.stack
    monkeypatch.setattr(torch, "stack", lambda tensors, *a, **k: stacks.append(len(tensors)) or real(tensors, *a, **k))
    for layer in (1, 2, 3):
        dump.dump("attention_output", torch.ones(2), layer=layer)
        dump.dump("mlp_output", torch.full((2,), NAN) if layer == 2 else torch.ones(2), layer=layer)
    assert [len(norms) for _, norms in nonfinite._kept] == [2, 2] and stacks == []
    control.sentinels_step()
    assert stacks == [6] and nonfinite._kept == []
    (event,) = lines(armed)
    assert (event["name"], event["layer"]) == ("mlp_output", 2)
    monkeypatch.setattr(nonfinite, "KEPT_READS", 2)
    for layer in (1, 2, 3):
        dump.dump("attention_output", torch.ones(2), layer=layer)
        dump.dump("mlp_output", torch.full((2,), INF) if layer == 3 else torch.ones(2), layer=layer)
    assert stacks == [6, 2, 2]  # layers 1 and 2, each once two reads were kept
    control.sentinels_step()
    assert stacks == [6, 2, 2, 2]
    assert (lines(armed)[-1]["name"], lines(armed)[-1]["layer"]) == ("mlp_output", 3)


def test_a_batch_is_read_at_its_call_or_byte_limit_and_a_large_tensor_alone(armed, monkeypatch):
    for _ in range(nonfinite.BATCH_CALLS + 1):
        dump.dump("expert_output", torch.ones(2), layer=3)
    assert len(nonfinite._batch) == 1  # the 17th starts a new batch
    monkeypatch.setattr(nonfinite, "ALONE_BYTES", 64)
    dump.dump("logits", torch.full((16,), NAN))  # 64 bytes: read at once, never held
    assert nonfinite._batch == []
    monkeypatch.setattr(nonfinite, "BATCH_BYTES", 24)
    dump.dump("loss", torch.ones(4))
    dump.dump("loss_parts", torch.ones(4))  # 16 + 16 bytes > 24: the first read before the second is held
    assert [value.numel() for value, _, _ in nonfinite._batch] == [4]
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["name"], event["layer"]) == ("logits", None)


def test_disarming_mid_step_holds_no_tensor(armed):
    dump.dump("mlp_output", torch.ones(3), layer=1)
    assert len(nonfinite._batch) == 1
    control.configure(nonfinite=False)
    assert nonfinite._batch == [] and watch.tensor_hook is None
    control.configure(nonfinite=True)  # armed again: the next calls start the step afresh
    dump.dump("mlp_output", torch.full((3,), NAN), layer=1)
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["name"], event["layer"]) == ("mlp_output", 1) and control.state()["counters"]["errors"] == 0


def test_a_tensor_changed_in_place_before_its_read_is_said_in_the_event(armed):
    x = torch.ones(3)
    dump.dump("logits", x)
    x.sub_(float("inf"))  # e.g. a cross entropy that works in place on the logits
    control.sentinels_step()
    (event,) = lines(armed)
    assert event["name"] == "logits" and event["read_after_change"] is True


def test_float64_and_calls_past_the_per_call_slots_fold_into_static_slots(armed):
    dump.dump("layer_output", torch.ones(2), layer=1)
    dump.dump("loss", torch.tensor([1e300, 1.0], dtype=torch.float64))  # max |x| beyond float32: not a NaN
    control.sentinels_step()
    assert lines(armed) == [] and len(nonfinite._static_site) == 1
    dump.dump("loss", torch.tensor([NAN], dtype=torch.float64))
    control.sentinels_step()
    assert lines(armed)[-1]["name"] == "loss"
    nonfinite._calls = nonfinite.SLOTS - nonfinite.STATIC  # a step that used every per-call slot
    dump.dump("layer_output", torch.full((2,), INF), layer=4)
    assert nonfinite._calls == nonfinite.SLOTS - nonfinite.STATIC and len(nonfinite._static_site) == 2
    control.sentinels_step()
    assert (lines(armed)[-1]["name"], lines(armed)[-1]["layer"]) == ("layer_output", 4)


def test_callbacks_get_the_event_and_a_failing_one_never_stops_training(armed):
    got = []
    nonfinite.on_event(got.append)
    nonfinite.on_event(lambda event: 1 / 0)
    forward(step_nan=(1, 1, "layer_output"))
    control.sentinels_step()
    assert got and got[0]["name"] == "layer_output" and got[0]["microbatch"] == 1
    counters = control.state()["counters"]
    assert counters["callback_errors"] == 1 and "ZeroDivisionError" in control.state()["last_error"]

    def stop(event):
        raise SystemExit("non-finite: stopping")
    nonfinite.on_event(stop)
    forward(step_nan=(0, 1, "layer_output"))
    with pytest.raises(SystemExit, match="stopping"):
        control.sentinels_step()


def test_dump_after_asks_for_that_layer_in_the_event(armed):
    control.configure(dump_after=3)
    forward(step_nan=(0, 2, "layer_output"))
    control.sentinels_step(step=7)
    assert lines(armed)[0]["dump_request"] == {"enable": True, "layers": "2", "steps": "8-10"}


class Optimizer:
    """What sentinels_grads needs of a Megatron optimizer without a model attached."""

    def __init__(self, params):
        self.params = params

    def get_parameters(self):
        return self.params


def test_gradients_are_named_by_the_attached_model_and_ordered_as_backward_runs(armed):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model(torch.ones(2, 3)).sum().backward()
    optimizer = Optimizer(list(model.parameters()))
    control.sentinels_attach(optimizer, [model])
    model[0].weight.grad[0, 0] = INF
    model[1].bias.grad[0] = NAN   # later in the model, so earlier in backward: first
    control.sentinels_grads(optimizer)
    control.sentinels_step()
    (event,) = lines(armed)
    assert (event["name"], event["site"], event["phase"], event["nonfinite_sites"]) == ("grad:1.bias", "gradient",
                                                                                         "grad", 2)
    bare = Optimizer([torch.nn.Parameter(torch.ones(2))])
    bare.params[0].grad = torch.tensor([1.0, INF])
    control.sentinels_grads(bare)
    control.sentinels_step()
    assert lines(armed)[-1]["name"] == "grad:param0[2]"


def test_gradients_are_read_only_when_the_steps_grad_norm_does_not_say_they_are_finite(armed):
    """At the step's return Megatron has computed the grad norm (clip_grad > 0): finite,
    every gradient is finite and none is read; NaN or inf, a skipped step (fp16's found
    inf) or no norm at all (clip_grad 0): every gradient is read."""
    model = torch.nn.Linear(2, 1)
    model(torch.ones(1, 2)).sum().backward()
    optimizer = Optimizer(list(model.parameters()))
    control.sentinels_attach(optimizer, [model])
    model.bias.grad[0] = NAN
    for result, read in (((True, 1.5, 0), False), ((True, NAN, 0), True), ((True, INF, 0), True),
                         ((False, None, None), True), ((True, None, None), True),
                         ((True, torch.tensor(1.0), 0), True)):
        before = len(lines(armed))
        control.sentinels_grads(optimizer, result)
        control.sentinels_step()
        assert len(lines(armed)) == before + read, result
    assert lines(armed)[-1]["name"] == "grad:bias"


def test_an_unwritable_run_folder_is_counted_never_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    control.configure(nonfinite=True, dir=str(blocker / "runs"))
    try:
        dump.dump("layer_output", torch.full((2,), NAN), layer=1)
        control.sentinels_step()
        state = control.state()
        # two lines lost: the heartbeat (metrics.jsonl) and the event
        assert state["counters"]["nonfinite_events"] == 1 and state["counters"]["write_errors"] == 2
        assert "events.jsonl" in state["last_error"]
    finally:
        control.close()
        control.configure_from_settings()
        control.reset()


def test_disarmed_the_call_sites_do_nothing():
    control.configure(nonfinite=False)
    assert watch.tensor_hook is None and not control.enabled()
    before = control.state()["counters"]["sites_watched"]
    dump.dump("layer_output", torch.full((2,), NAN), layer=1)
    control.sentinels_grads(Optimizer([]))
    control.sentinels_step()
    assert control.state()["counters"]["sites_watched"] == before


# -------------------------------------------------------------- end to end, Megatron on CPU

RUN = Path(__file__).parent / "e2e" / "sentinels_run.py"
PLANT = Path(__file__).parent / "fixtures" / "plant_nan.yaml"
GRAD = "decoder.layers.1.mlp.router.weight"


def start(tmp: Path, cache: Path, tag: str, *args) -> tuple:
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("SOURCE_PATCH_DUMP", "SOURCE_PATCH_SENTINELS"))}
    environ.update(SOURCE_PATCH=f"megatron_cpu,dump,sentinels,{PLANT}", SOURCE_PATCH_CACHE=str(cache),
                   SOURCE_PATCH_DUMP_ENABLE="0", SOURCE_PATCH_SENTINELS_DIR=str(tmp / tag))
    return tmp / tag, subprocess.Popen([sys.executable, str(RUN), *args], env=environ, text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, shared_code_cache):
    """The three runs at once (each pays Megatron's import)."""
    pytest.importorskip("megatron.core")
    tmp = tmp_path_factory.mktemp("sentinels")
    started = {"nan": start(tmp, shared_code_cache, "nan", "--steps", "5", "--plant-nan", "2,1,2"),
               "grad": start(tmp, shared_code_cache, "grad", "--steps", "4", "--plant-inf-grad", f"1,{GRAD}"),
               "clean": start(tmp, shared_code_cache, "clean", "--steps", "50")}
    out = {}
    for tag, (folder, process) in started.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stdout + stderr
        out[tag] = folder, json.loads(stdout.strip().splitlines()[-1]), stderr
    return out


def test_a_planted_nan_is_named_by_its_step_microbatch_layer_and_site(runs):
    folder, result, stderr = runs["nan"]
    first = lines(folder)[0]
    # the MoE output of layer 2, microbatch 1, step 2: dump.yaml's mlp_output there; every
    # site after it (layer_output, logits, the next steps) is NaN too, and not reported first
    assert {k: first[k] for k in ("step", "microbatch", "phase", "layer", "name", "site", "rank")} == {
        "step": 2, "microbatch": 1, "phase": "fwd_bwd", "layer": 2, "name": "mlp_output", "site": "activation",
        "rank": 0}
    assert first["first_of_run"] and first["nonfinite_sites"] > 1
    assert stderr.count("first non-finite value at step 2, microbatch 1, phase fwd_bwd, layer 2, mlp_output") == 1
    assert result["state"]["counters"]["nonfinite_events"] == len(lines(folder)) == 3  # steps 2, 3, 4
    assert result["state"]["last_error"] is None


def test_an_inf_planted_in_a_gradient_names_that_gradient(runs):
    folder, result, _ = runs["grad"]
    first = lines(folder)[0]
    assert (first["step"], first["name"], first["site"], first["layer"], first["nonfinite_sites"]) == (
        1, f"grad:{GRAD}", "gradient", 2, 1)


def test_a_clean_run_reports_nothing(runs):
    folder, result, _ = runs["clean"]
    counters = result["state"]["counters"]
    assert counters["nonfinite_events"] == 0 and counters["errors"] == 0 and lines(folder) == []
    assert counters["sites_watched"] > 0 and result["state"]["last_error"] is None
    assert result["seconds"] < 40


# -------------------------------------------------------------- on a GPU, under CUDA graph capture


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_site_folded_inside_a_cuda_graph_is_reported_after_the_replay_that_saw_it(armed):
    """The fold is a device op on static flags: captured once, it runs at every replay;
    the read at the step's end is asynchronous (reported at that step's end or the
    next, or at flush), never a host sync inside the graph."""
    static = torch.ones(8, 16, device="cuda")
    out = torch.empty_like(static)

    def layer():
        out.copy_(static * 2)
        dump.dump("mlp_output", out, layer=3)

    layer()  # eager first, as Megatron's warm-up: the site gets its slot outside capture
    control.sentinels_step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer()
    control.sentinels_step()
    control.flush()
    assert lines(armed) == []  # clean replays and captures say nothing
    for step in range(3):
        if step == 1:
            static[2, 5] = NAN
        graph.replay()
        control.sentinels_step()
    control.flush()
    (event,) = [e for e in lines(armed) if e["kind"] == "nonfinite"][:1]
    assert (event["name"], event["layer"]) == ("mlp_output", 3), event


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_batch_made_on_a_side_stream_is_read_on_that_stream(armed):
    """A layer's calls are read on the stream they were made on, even when the read
    comes at a step end on another stream (no race with the flags' copy)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(10_000_000)  # the side stream busy: a read on another stream would see x early
        x[-1] = NAN
        dump.dump("mlp_output", x, layer=2)
    assert len(nonfinite._batch) == 1
    control.sentinels_step()
    control.flush()
    (event,) = lines(armed)
    assert (event["name"], event["layer"]) == ("mlp_output", 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_read_made_on_a_side_stream_is_waited_for_before_its_slot_is_written(armed):
    """A read made on a side stream (the layer after's call came there) is kept; the step
    end writes it into its slot on the current stream, which must wait for the side one."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        x = torch.ones(1 << 20, device="cuda")
        torch.cuda._sleep(10_000_000)
        x[-1] = NAN
        dump.dump("mlp_output", x, layer=2)
        dump.dump("mlp_output", torch.ones(4, device="cuda"), layer=3)  # layer 2 read here, on the side stream
    assert len(nonfinite._kept) == 1
    control.sentinels_step()
    control.flush()
    (event,) = lines(armed)
    assert (event["name"], event["layer"]) == ("mlp_output", 2)
