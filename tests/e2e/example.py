"""What the end-to-end drivers share: examples/train_moe.py loaded as a module, and a
forward_step that reports each finished microbatch."""

import importlib.util
from pathlib import Path

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
