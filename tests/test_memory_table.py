"""tread/perf/memory.py's memory-per-GPU estimate: counts against real built models, the formula on a hand case."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from tread.cli.memory_table import main
from tread.models.dit import build_dit
from tread.models.families import FAMILIES, build_family, family_module
from tread.perf.memory import (LinearShape, ParamCounts, adam_bytes, build_on_meta, count_params, data_channels,
                               markdown_table, memory_per_gpu, memory_rows, unique_bytes)
from tread.utils.optim import adamw8bit


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
    Lumina2 on FLUX's VAE: 16; LTX-Video's: 128; Cosmos-Predict2 on the Wan 2.1 VAE: 16; Qwen-Image 2.1: 64;
    Kandinsky 5 and Krea 2: 16; LTX-2: 128; FLUX.3 and ERNIE-Image on the FLUX.2 VAE: 32; MiniMax-H3: 24; WanVACE on Wan 2.1's: 16)."""
    got = {f: data_channels(f, "mid") for f in FAMILIES}
    assert got == {"flux": 16, "sd3": 16, "wan": 16, "auraflow": 4, "pixart": 4, "flux2": 32, "qwen_image": 16,
                   "chroma": 16, "sana": 32, "hidream": 16, "z_image": 16, "lumina2": 16, "ltx_video": 128,
                   "cosmos": 16, "hunyuan_video": 32, "qwen_image21": 64, "kandinsky5": 16, "ltx2": 128,
                   "krea2": 16, "flux3": 32, "ernie_image": 32, "minimax_h3": 24, "wan_vace": 16}
    assert data_channels("flux", "dev") == 16 and data_channels("wan", "wan2.2-5b") == 48
    for family in FAMILIES:                # the meta build takes exactly the channels its preset states
        for preset, config in family_module(family).PRESETS.items():
            if family_module(family).FAMILY.channel_keys[0] in config and preset != "tiny":
                assert build_on_meta(family, preset).in_channels == data_channels(family, preset)


def test_lora_count_equals_peft_trainable_params():
    targets = ("to_q", "to_k", "to_v", "to_out.0")
    plain = build_family("flux", input_size=8, in_channels=4, num_classes=0, preset="tiny")
    adapted = build_family("flux", input_size=8, in_channels=4, num_classes=0, preset="tiny",
                           lora={"rank": 4, "target_modules": list(targets)})
    trainable = sum(p.numel() for p in adapted.parameters() if p.requires_grad)
    assert count_params(plain, 4, targets).lora == trainable > 0


def test_formula_on_a_hand_computed_case():
    c = ParamCounts(total=1000, largest_block=100, root=200, lora=10, linears=(LinearShape(10, 64),))
    # AdamW: two fp32 moments and a 4-byte step count per parameter tensor (one here: no sizes given).
    assert memory_per_gpu(c, "ddp", 1, False)["total"] == 4000 + 4000 + 8004 + 4000
    fsdp = memory_per_gpu(c, "fsdp", 4, False)
    assert fsdp["total"] == 1000 + 1000 + 2001 + 1000 + 4 * (200 + 2 * 100) and fsdp["gathered"] == 1600
    assert memory_per_gpu(c, "ddp", 1, True)["total"] == 4040 + 40 + 84 + 4040
    # nf4: 640 Linear values at 4 bits (320 B) + one fp32 scale per 64 (40 B); the other 360 values fp32 (1440 B).
    # The EMA shares the quantized base: it holds the 10 adapter values only (the table counted the base twice).
    nf4 = 320 + 40 + 1440
    assert memory_per_gpu(c, "ddp", 1, True, "nf4")["total"] == (nf4 + 40) + 40 + 84 + 40
    int8 = 640 + 4 * 10 + 1440          # one fp32 scale per output row
    assert memory_per_gpu(c, "ddp", 1, True, "int8")["weights"] == int8 + 40
    # A Linear outside the routable blocks stays fp32 under model.quantize (quantize_base quantizes the blocks').
    outside = dataclasses.replace(c, linears=(LinearShape(10, 64, in_block=False),))
    assert memory_per_gpu(outside, "ddp", 1, True, "nf4")["weights"] == 4000 + 40


def test_memory_options_on_a_hand_computed_case():
    """model.base_dtype, ema.mode and optimizer=adamw8bit, each term by hand: one block Linear 64 x 128 with a bias
    (8256 values) in a model of 10000; LoRA rank 4 on it (A 4 x 128 = 512, B 64 x 4 = 256 values)."""
    c = ParamCounts(total=10000, largest_block=9000, root=1000, lora=768, linears=(LinearShape(64, 128, True),),
                    sizes=(8192, 64, 1744), lora_sizes=(512, 256))
    rest = 4 * (10000 - 8256)
    bf16 = memory_per_gpu(c, "ddp", 1, True, base_dtype="bf16")
    assert bf16["weights"] == 2 * 8256 + rest + 4 * 768 and bf16["ema"] == bf16["weights"]    # EMA full: a copy
    fp8 = memory_per_gpu(c, "ddp", 1, True, base_dtype="fp8", ema="full")
    assert fp8["weights"] == 8192 + 4 * 64 + 2 * 64 + rest + 4 * 768 and fp8["ema"] == 4 * 768      # shared base
    for ema, held in (("full", 40000), ("trained", 40000), ("cpu", 0), ("off", 0)):   # full fine-tuning
        assert memory_per_gpu(c, "ddp", 1, False, ema=ema)["ema"] == held
    assert memory_per_gpu(c, "ddp", 1, True, ema="trained")["ema"] == 4 * 768
    # adamw8bit: the 8192-value weight (>= 4096, a multiple of 256) gets 1-byte codes, 32 fp32 scales and a
    # 256-entry fp32 code table per moment; the 64- and 1744-value tensors keep two fp32 moments; so do the adapters.
    steps = 4 * 3                                      # one fp32 step count per parameter tensor
    assert memory_per_gpu(c, "ddp", 1, False, adam_block=256)["adam"] == 2 * (8192 + 4 * 32 + 4 * 256) + 8 * 1808 \
        + steps
    assert memory_per_gpu(c, "ddp", 1, True, adam_block=256)["adam"] == 8 * 768 + 4 * 2
    assert memory_per_gpu(c, "ddp", 1, False, adam_block=3000)["adam"] == 8 * 10000 + steps   # 8192 % 3000: fp32


def test_adam8bit_estimate_equals_torchao_state():
    """adam_bytes against the state torchao.optim.AdamW8bit really allocates (codes, scales, code tables), for
    tensors above and below its 4096-value threshold and of a size that is not a multiple of the block."""
    params = [torch.nn.Parameter(torch.randn(n)) for n in (8192, 4096, 4095, 4352, 100)]
    opt = adamw8bit(params, lr=1e-3, block_size=256)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    state = [t for p in params for t in opt.state[p].values()]
    assert unique_bytes(state) == adam_bytes([p.numel() for p in params], 256)
    moments = [t for p in params for k, t in opt.state[p].items() if k != "step"]
    assert sum(type(t).__name__ == "OptimState8bit" for t in moments) == 6        # 8192, 4096 and 4352 = 17 x 256


def test_table_and_cli(capsys):
    rows = memory_rows((8,), presets=[("flux", "dev")])
    assert 11.8e9 < rows[0]["params"] < 12.0e9            # FLUX.1-dev: 12B
    assert rows[0]["full fsdp8"] < rows[0]["full ddp"] / 6
    assert markdown_table(rows).splitlines()[2].startswith("| flux dev | 11,901.4 |")
    with pytest.raises(SystemExit, match="--preset 'flux:nope' is not a preset of the table; allowed: DiT-B/2"):
        main(["--preset", "flux:nope"])
    main(["--preset", "DiT-XL/2", "--world", "8"])
    assert "| DiT-XL/2 | 674.8 |" in capsys.readouterr().out
