"""Per-process figures of a context-parallel video step (memory_table.py --video ... --context-parallel D): each
process of a group of D holds N / D of every sequence, so its saved activations follow the measured per-token law
at N / D tokens (video_memory.per_token_fit; Ulysses' gathered query, key and value of 1/D of the heads over all N
tokens are the same bytes as all heads over N / D), and it sends query, key, value and output shards to the
others at every self-attention: forward, backward, and the checkpointed forward again (docs/scaling.md)."""
from __future__ import annotations

from typing import Any, Sequence

from tread.perf.memory import build_on_meta
from tread.perf.video_memory import GPU_FRAMES, GPU_LATENTS, extrapolate, static_parts, tokens_at
from tread.runtime.context_parallel import ulysses_bytes

BF16 = 2
PASSES = 3          # all-to-alls per attention and step with gradient checkpointing: forward, recompute, backward


def route_stats(routes: Sequence[Any], tokens: int) -> list[tuple[int, int, int, int]]:
    """(start, end, kept, total) of resolved routes at `tokens` (as a route plan's stats)."""
    return [(r.start_layer_idx, r.end_layer_idx, r.num_keep(tokens), tokens) for r in routes]


def block_tokens(stats: Sequence[tuple[int, int, int, int]], depth: int, tokens: int) -> list[float]:
    """Tokens each block processes at `tokens`: the measured routes' kept shares (start, end, kept, total)."""
    n = [float(tokens)] * depth
    for start, end, kept, total in stats:
        for i in range(start, end + 1):
            n[i] = tokens * kept / total
    return n


def exchange_per_step(stats: Sequence[tuple[int, int, int, int]], depth: int, tokens: int, width: int,
                      degree: int) -> float:
    """Bytes one process sends in a step (batch 1, bf16) by Ulysses all-to-all over the blocks' self-attentions."""
    return PASSES * sum(ulysses_bytes(1, n, width, degree, BF16) for n in block_tokens(stats, depth, tokens))


def context_table(rows: Sequence[dict], degree: int, frames: Sequence[int] = GPU_FRAMES,
                  latents: Sequence[int] = GPU_LATENTS) -> str:
    """Markdown: per process of a context group of `degree` at `frames` x `latents` (GiB; all-to-all in GB): its
    tokens, saved activations and sent bytes per route; static bytes as DDP holds them (FSDP divides them by the
    world size: memory_table.py's FSDP columns)."""
    family, preset = rows[0]["family"], rows[0]["preset"]
    model, static = build_on_meta(family, preset), static_parts(family, preset)
    width, depth = model.attention_width(), model.routing.depth
    routes = list(dict.fromkeys(r["route"] for r in rows))
    stats = {r["route"]: r["routes"] for r in rows}
    g = 2 ** 30
    head = (["model", "degree", "T", "tokens", "tokens / process", "static DDP"]
            + [f"activations {r} / process" for r in routes] + [f"all-to-all {r} / step (GB)" for r in routes])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in frames:
        n = tokens_at(model, t, latents)
        if n % degree:
            continue
        acts = [extrapolate(rows, n // degree, r)[0] for r in routes]
        sent = [exchange_per_step(stats[r], depth, n, width, degree) for r in routes]
        cells = ([f"{family} {preset}", str(degree), str(t), f"{n:,}", f"{n // degree:,}",
                  f"{static['total'] / g:.2f}"] + [f"{a / g:.2f}" for a in acts] + [f"{s / 1e9:.1f}" for s in sent])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
