"""Train examples/train_moe.py's model for a few steps and save what a test compares.

    python tests/e2e/dump_run.py OUT.safetensors [--hooks] [--steps N] [--micro-batches M]

Saves, with safetensors: the loss tensors of every step (`loss/<step>`), every
parameter's gradient after each step's forward-backward (`grad/<step>/<param>`), and
the final parameters (`param/<param>`).  With --hooks it also records, through plain
PyTorch module hooks (no source patch), the activations patches/dump.yaml dumps, keyed
`act/<name>/<step>/<microbatch>/<layer or ->`: the unpatched reference.
"""

import argparse
import sys

import torch
from safetensors.torch import save_file

from example import counting_forward_step, forward_backward, start_cpu, train_moe  # tests/e2e/example.py


class Recorder:
    """Module hooks that store what dump.yaml's call sites dump, with the same tags."""

    def __init__(self, gpt):
        self.out: dict[str, torch.Tensor] = {}
        self.step = self.microbatch = 0
        gpt.embedding.register_forward_hook(self.output("embedding_output"))
        gpt.output_layer.register_forward_pre_hook(self.input("final_hidden"))
        gpt.output_layer.register_forward_hook(self.output("logits"))
        for layer in gpt.decoder.layers:
            n = layer.layer_number
            layer.register_forward_pre_hook(self.input("layer_input", n), with_kwargs=True)
            layer.register_forward_hook(self.output("layer_output", n))
            layer.self_attention.register_forward_hook(self.output("attention_output", n))
            layer.pre_mlp_layernorm.register_forward_pre_hook(self.input("pre_mlp_residual", n))
            layer.mlp.register_forward_hook(self.output("mlp_output", n))
            layer.mlp.router.register_forward_hook(self.output("routing_map", n, index=1))  # (probs, map)

    def next_microbatch(self):
        self.microbatch += 1

    def key(self, name, layer):
        return f"act/{name}/{self.step}/{self.microbatch}/{'-' if layer is None else layer}"

    def keep(self, name, layer, tensor):
        self.out[self.key(name, layer)] = tensor.detach().clone()

    def input(self, name, layer=None):
        def hook(module, args, kwargs=None):
            self.keep(name, layer, args[0] if args else kwargs["hidden_states"])
        return hook

    def output(self, name, layer=None, index=0):
        def hook(module, args, output):
            self.keep(name, layer, output[index] if isinstance(output, (tuple, list)) else output)
        return hook


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--hooks", action="store_true")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2)
    cli = p.parse_args()
    args = start_cpu(["--steps", str(cli.steps), "--micro-batches", str(cli.micro_batches)])
    device = torch.device("cpu")
    torch.manual_seed(args.seed)
    model = train_moe.build_model(args, device)
    optimizer = train_moe.build_optimizer(model, args)
    dataset = train_moe.make_dataset(args, device)
    recorder = Recorder(model.module) if cli.hooks else None
    out = {}
    for step in range(args.steps):
        if recorder:
            recorder.step, recorder.microbatch = step, 0
        losses = forward_backward(model, optimizer, dataset, args, step,
                                  counting_forward_step(recorder.next_microbatch) if recorder
                                  else train_moe.forward_step)
        out[f"loss/{step}"] = torch.stack([x["lm loss"] for x in losses]).detach().clone()
        for name, param in model.module.named_parameters():
            out[f"grad/{step}/{name}"] = param.main_grad.detach().clone()
        success, _, _ = optimizer.step()
        assert success
    for name, param in model.module.named_parameters():
        out[f"param/{name}"] = param.detach().clone()
    if recorder:
        out.update(recorder.out)
    save_file({k: v.contiguous() for k, v in out.items()}, cli.out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
