"""tread/perf/memory.py's memory-per-GPU estimate: counts against real built models, the formula on a hand case."""
from __future__ import annotations

import pytest
import torch

from tread.cli.memory_table import main
from tread.models.dit import build_dit
from tread.models.families import FAMILIES, build_family, family_module
from tread.perf.memory import (ParamCounts, build_on_meta, count_params, data_channels, markdown_table, memory_per_gpu,
                               memory_rows)


def test_counts_match_a_real_model_and_its_meta_build():
    real = build_dit("DiT-T/4", input_size=16, in_channels=3, num_classes=10)
    counts = count_params(real)
    assert counts.total == sum(p.numel() for p in real.parameters())
    assert counts.largest_block == sum(p.numel() for p in real.blocks[0].parameters())
    assert counts.root == counts.total - 12 * counts.largest_block
    with torch.device("meta"):
        meta = build_dit("DiT-T/4", input_size=16, in_channels=3, num_classes=10)
    assert count_params(meta) == counts
    assert 674e6 < count_params(build_on_meta("dit", "DiT-XL/2")).total < 676e6     # DiT paper: 675M


def test_data_channels_come_from_the_family_modules():
    """No table of channels per family: a preset's own geometry (FLUX: 4 transformer channels per latent channel,
    packed 2x2), else the family's first released one; the VAEs' latent channels (FLUX, SD3, Wan 2.1: 16;
    AuraFlow and PixArt, SD-VAE: 4; Wan 2.2: 48; FLUX.2, Sana's DC-AE: 32; Qwen-Image, and Chroma, HiDream, Z-Image,
    Lumina2 on FLUX's VAE: 16)."""
    got = {f: data_channels(f, "mid") for f in FAMILIES}
    assert got == {"flux": 16, "sd3": 16, "wan": 16, "auraflow": 4, "pixart": 4, "flux2": 32, "qwen_image": 16,
                   "chroma": 16, "sana": 32, "hidream": 16, "z_image": 16, "lumina2": 16}
    assert data_channels("flux", "dev") == 16 and data_channels("wan", "wan2.2-5b") == 48
    for family in FAMILIES:                # the meta build takes exactly the channels its preset states
        for preset, config in family_module(family).PRESETS.items():
            if "in_channels" in config and preset != "tiny":
                assert build_on_meta(family, preset).in_channels == data_channels(family, preset)


def test_lora_count_equals_peft_trainable_params():
    targets = ("to_q", "to_k", "to_v", "to_out.0")
    plain = build_family("flux", input_size=8, in_channels=4, num_classes=0, preset="tiny")
    adapted = build_family("flux", input_size=8, in_channels=4, num_classes=0, preset="tiny",
                           lora={"rank": 4, "target_modules": list(targets)})
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert count_params(plain, 4, targets).lora == trainable > 0


def test_formula_on_a_hand_computed_case():
    c = ParamCounts(total=1000, largest_block=100, root=200, lora=10, linear_weights=((10, 64),))
    assert memory_per_gpu(c, "ddp", 1, False)["total"] == 4000 + 4000 + 8000 + 4000
    fsdp = memory_per_gpu(c, "fsdp", 4, False)
    assert fsdp["total"] == 20000 // 4 + 4 * (200 + 2 * 100) and fsdp["gathered"] == 1600
    assert memory_per_gpu(c, "ddp", 1, True)["total"] == 4040 + 40 + 80 + 4040
    # nf4: 640 Linear values at 4 bits (320 B) + one fp32 scale per 64 (40 B); the other 360 values fp32 (1440 B).
    nf4 = 320 + 40 + 1440
    assert memory_per_gpu(c, "ddp", 1, True, "nf4")["total"] == 2 * (nf4 + 40) + 40 + 80
    int8 = 640 + 4 * 10 + 1440          # one fp32 scale per output row
    assert memory_per_gpu(c, "ddp", 1, True, "int8")["weights"] == int8 + 40


def test_table_and_cli(capsys):
    rows = memory_rows((8,), presets=[("flux", "dev")])
    assert 11.8e9 < rows[0]["params"] < 12.0e9            # FLUX.1-dev: 12B
    assert rows[0]["full fsdp8"] < rows[0]["full ddp"] / 6
    assert markdown_table(rows).splitlines()[2].startswith("| flux dev | 11,901.4 |")
    with pytest.raises(SystemExit, match="--preset 'flux:nope' is not a preset of the table; allowed: DiT-B/2"):
        main(["--preset", "flux:nope"])
    main(["--preset", "DiT-XL/2", "--world", "8"])
    assert "| DiT-XL/2 | 674.8 |" in capsys.readouterr().out
