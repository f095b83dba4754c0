"""MoE routing capture and replay (docs/routing.md): the record both sides share, one
package per framework, and the way between them:

    manifest.py  its declaration: settings, control modules, call sites, specs, docs page
    records/   the routing record: the type, its file format, SGLang's routed_experts
               field, slices for Megatron's CP/SP ranks, Megatron's RouterReplay
    megatron/  capture and replay in Megatron-Core's routers (patches/routing.yaml)
    sglang/    capture and replay in SGLang's select_experts (patches/routing.yaml)
    align.py   lay rollout routes out as the training batch; routing diffs

Each package lists its modules in its docstring and imports none of them.
"""
