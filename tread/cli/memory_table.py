"""Memory per GPU of full fine-tuning and LoRA under DDP and FSDP for the model presets (tread/perf/memory.py): a
markdown table from parameter counts of models built on the meta device (nothing is allocated or downloaded).

    python scripts/memory_table.py                          # every DiT / family preset, FSDP over 2 and 8 GPUs
    python scripts/memory_table.py --world 4 16 --lora-rank 32
    python scripts/memory_table.py --preset flux:dev --preset DiT-XL/2
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from tread.cli.errors import user_errors
from tread.perf.memory import markdown_table, memory_rows, table_presets
from tread.utils.errors import UserError


class MemoryTableError(UserError):
    """A --preset that names no known model preset."""


def parse_presets(names: Optional[Sequence[str]]) -> Optional[list[tuple[str, str]]]:
    """--preset FAMILY:PRESET or a DiT name -> (family, preset) pairs; None: all."""
    if not names:
        return None
    known = table_presets()
    chosen = []
    for name in names:
        pair = ("dit", name) if name.startswith("DiT-") else tuple(name.split(":", 1))
        if pair not in known:
            allowed = ", ".join(p if f == "dit" else f"{f}:{p}" for f, p in known)
            raise MemoryTableError(f"--preset {name!r} is not a preset of the table; allowed: {allowed}.")
        chosen.append(pair)
    return chosen


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, nargs="+", default=[2, 8], help="FSDP world sizes (GPUs)")
    parser.add_argument("--lora-rank", type=int, default=16, help="LoRA rank on the attention projections")
    parser.add_argument("--preset", action="append", help="FAMILY:PRESET (flux:dev) or a DiT (DiT-XL/2); repeatable")
    args = parser.parse_args(argv)
    with user_errors():
        if any(w < 2 for w in args.world) or args.lora_rank < 1:
            raise MemoryTableError(f"--world {args.world} must all be >= 2 (FSDP shards over several GPUs) and "
                                   f"--lora-rank={args.lora_rank} >= 1.")
        rows = memory_rows(args.world, args.lora_rank, parse_presets(args.preset))
    print(markdown_table(rows))
    print("\nStatic bytes per GPU: fp32 weights, fp32 gradients of the trained parameters, AdamW's two fp32 "
          "moments and the EMA copy;\nFSDP divides them by the world size and adds the all-gathered root group "
          "and two blocks. Activations are not counted.\nbf16 mixed precision (autocast) keeps the fp32 master "
          "weights, so these figures hold for it too.\nLoRA: rank x (in + out) per attention projection; int8/int4/"
          "nf4: the frozen base's Linear weights stored at 8/4/4 bits\n+ one fp32 scale per output row (int8) or "
          "per 64 values (int4, nf4), replicated on every GPU (DDP).")
