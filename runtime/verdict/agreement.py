"""The figures of a comparison that are not a difference of values: routing agreement
per MoE layer, and the next-token log-prob mismatch from both sides' logits.

    agreement.routing(report, index_a, index_b, pairing)
    agreement.next_token_logprobs(report, index_a, index_b, pairing)

Routing: a token's set of experts on each side, from SGLang's ``topk_ids`` (``[tokens,
k]`` expert ids; a negative id is no expert) or Megatron's ``routing_map`` (``[tokens,
experts]`` bool), whichever that side dumped for the layer: the same routing when the
sets are equal.  Log-probs: wherever both sides hold the logits at (request, p) and A
holds the token at p + 1, each side's log-prob of it, and the RL mismatch figures with A
as the behaviour policy (SGLang keeps one logits row per request and pass, so these
are the generated tokens and the first after the prompt).
"""

from __future__ import annotations

from . import rows
from .records import DumpError

ROUTING = ("topk_ids", "routing_map")


def _experts(pieces, at, name: str, experts: int):
    """[tokens, experts] bool: each token's set of experts."""
    import torch

    t = rows.take(pieces, at)
    if name == "routing_map":
        return t.bool()
    ids = t.long()
    mask = torch.zeros((len(ids), experts + 1), dtype=torch.bool)
    mask.scatter_(1, torch.where((ids >= 0) & (ids < experts), ids, experts), True)
    return mask[:, :experts]


def routing(report, a, b, pairing) -> None:
    """Per layer both sides routed: the fraction of tokens with the same experts; and
    the fraction of tokens routed differently in at least one layer."""
    import torch

    layers = sorted({layer for side in (a, b) for name, layer in side.rows if name in ROUTING and layer is not None})
    differ = torch.zeros(pairing.size, dtype=torch.bool)
    seen = torch.zeros(pairing.size, dtype=torch.bool)
    for layer in layers:
        found = [next(((n, s.rows[(n, layer)]) for n in ROUTING if (n, layer) in s.rows), None) for s in (a, b)]
        if None in found or not pairing.size:
            continue
        at = [rows.locate(pieces, slot, pairing.size) for (_, pieces), slot in zip(found, (pairing.slot_a,
                                                                                             pairing.slot_b))]
        slots = ((at[0] >= 0) & (at[1] >= 0)).nonzero().reshape(-1)
        if not len(slots):
            continue
        widths = [int(rows.take(p, i[slots]).max()) + 1 if n == "topk_ids" else rows.widths(p).pop()
                  for (n, p), i in zip(found, at)]
        experts = max(widths)
        masks = [_experts(p, i[slots], n, experts) for (n, p), i in zip(found, at)]
        if masks[0].shape != masks[1].shape:
            continue  # different expert counts: no routing to compare (the rows' widths say it)
        same = (masks[0] == masks[1]).all(1)
        differ[slots] |= ~same
        seen[slots] = True
        report.routing.append({"layer": layer, "tokens": len(slots), "agreement": float(same.float().mean())})
    if bool(seen.any()):
        report.routing_any_differ = float(differ[seen].float().mean())


def next_token_logprobs(report, a, b, pairing) -> None:
    """The RL mismatch figures of the next tokens (module docstring)."""
    import torch

    from .logprobs import mismatch, token_logprobs

    if ("logits", None) not in a.rows or ("logits", None) not in b.rows or not pairing.size:
        return
    at = [rows.locate(s.rows[("logits", None)], slot, pairing.size) for s, slot in ((a, pairing.slot_a),
                                                                                       (b, pairing.slot_b))]
    ids = a.rows[("input_ids", None)]
    names = a.key_list()
    token_of = {}
    for t, key_ids in ids:
        for key_id, token in zip(key_ids.tolist(), t.reshape(-1).tolist()):
            if key_id >= 0:
                token_of[names[key_id]] = token
    both = ((at[0] >= 0) & (at[1] >= 0)).nonzero().reshape(-1).tolist()
    picked = [(i, token_of[(pairing.keys[i][0], pairing.keys[i][1] + 1)]) for i in both
              if (pairing.keys[i][0], pairing.keys[i][1] + 1) in token_of]
    if not picked:
        return
    slots = torch.tensor([i for i, _ in picked])
    targets = torch.tensor([t for _, t in picked])
    logits = [rows.take(s.rows[("logits", None)], i[slots], torch.float32) for s, i in zip((a, b), at)]
    vocab = logits[0].shape[1]
    if not 0 <= int(targets.min()) <= int(targets.max()) < vocab:
        raise DumpError(f"next-token log-probs: token ids {int(targets.min())}..{int(targets.max())} outside "
                        f"the logits' vocabulary of {vocab}")
    m = mismatch(token_logprobs(logits[0], targets), token_logprobs(logits[1], targets))
    report.logprobs = {**m.to_json(), "line": m.line()}
