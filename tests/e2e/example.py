"""What the end-to-end drivers share: examples/train_moe.py loaded as a module, a
single-process CPU start, a forward_step that reports each finished microbatch, and one
step's forward and backward through Megatron's own schedule."""

import importlib.util
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_moe.py"
_spec = importlib.util.spec_from_file_location("train_moe", EXAMPLE)
train_moe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(train_moe)


def counting_forward_step(on_microbatch_done):
    """train_moe.forward_step, calling ``on_microbatch_done()`` when a microbatch's loss
    is computed: Megatron runs the loss function right after the model's forward, so
    whatever runs next belongs to the next microbatch."""
    def forward_step(data_iterator, model):
        output, loss_func = train_moe.forward_step(data_iterator, model)

        def counted(*args, **kwargs):
            on_microbatch_done()
            return loss_func(*args, **kwargs)
        return output, counted
    return forward_step


def start_cpu(flags: list):
    """train_moe's arguments from ``flags`` on the CPU, one thread, the process group of
    one rank (gloo) and Megatron's parallel state initialised."""
    args = train_moe.parse_args([*flags, "--device", "cpu"])
    torch.set_num_threads(1)
    train_moe.init_distributed(torch.device("cpu"), args.ep)
    return args


def forward_backward(model, optimizer, dataset, args, step: int, forward_step):
    """Step ``step``'s micro-batches of the example's dataset through Megatron's own
    forward-backward schedule, gradients zeroed first; its losses.  The optimizer step
    is the caller's (what a driver does between backward and it differs)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    batches = [train_moe.make_batch(dataset, step * args.micro_batches + m, args) for m in range(args.micro_batches)]
    model.zero_grad_buffer()
    optimizer.zero_grad()
    return get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
        num_microbatches=args.micro_batches, seq_length=args.seq_len, micro_batch_size=args.micro_batch,
        forward_only=False)
