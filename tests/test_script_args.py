"""Every script's command line parsed one way (tread/cli/args.py, issue 43): an unknown flag, a missing argument or a
number out of its range (non-ASCII digits, huge, negative, nan) is one `error:` line naming the flag and the value,
raised before the script does anything (no model built, no file written), never argparse's usage text. Each case
runs the script's main in this process: the refusal comes from parsing, before any import of the work."""
from __future__ import annotations

import argparse
from typing import Callable, Sequence

import pytest

from tread.cli import (ablation_report, benchmark, compare_paper, diffusers_pipeline, example_assets, gpu_check,
                       memory_table, tiny_text_encoders, toy_classifier, video_memory_gpu)
from tread.cli.args import Parser, int_in, number_in, parse_int, parse_number
from tread.utils.errors import UserError

MAINS: dict[str, Callable[[Sequence[str]], object]] = {
    "benchmark": benchmark.main, "compare_paper": lambda a: compare_paper.main(["/nowhere", *a]),
    "memory_table": memory_table.main, "gpu_check": gpu_check.main, "video_memory_gpu": video_memory_gpu.main,
    "toy_classifier": toy_classifier.main, "ablation_report": lambda a: ablation_report.main(["/nowhere", *a]),
    "diffusers_pipeline": lambda a: diffusers_pipeline.main(["/nowhere", "--prompts", "x", *a]),
    "toy_images": lambda a: example_assets.toy_images(["/nowhere", *a]),
    "tiny_vae": lambda a: example_assets.tiny_vae(["/nowhere", *a]),
    "tiny_text_encoders": lambda a: tiny_text_encoders.main(["flux", "/nowhere", *a]),
}
CASES = [
    ("benchmark", ["--bogus"], "unrecognized arguments: --bogus"),
    ("benchmark", ["--batch", "0"], "--batch: '0'"),
    ("benchmark", ["--tokens", "4096²"], "--tokens: '4096²'"),
    ("benchmark", ["--tokens", "１２"], "--tokens: '１２'"),               # int() would take fullwidth digits
    ("benchmark", ["--resolution", str(10 ** 9)], f"--resolution: '{10 ** 9}'"),
    ("benchmark", ["--channels", "-4"], "--channels: '-4'"),
    ("benchmark", ["--fit-batch", "8", "x"], "--fit-batch: 'x'"),
    ("benchmark", ["--steps", str(10 ** 12)], f"--steps: '{10 ** 12}'"),
    ("benchmark", ["--threads", "0"], "--threads: '0'"),
    ("benchmark", ["--loader-workers", "-1"], "--loader-workers: '-1'"),
    ("benchmark", ["--device", "tpu"], "--device: invalid choice: 'tpu'"),
    ("benchmark", ["--grids", "8by12"], "--grids '8by12' is not a latent grid"),
    ("benchmark", ["--grids", "８x12"], "--grids '８x12' is not a latent grid"),
    ("benchmark", ["--grids", "8x99999"], "--grids '8x99999' is not a latent grid"),
    ("benchmark", ["--grids", "8x12", "--one-at-a-time"], "--grids steps each built config"),
    ("compare_paper", ["--rounds", "0"], "--rounds: '0'"),
    ("compare_paper", ["--sizes", "DiT-S/2:16:³"], "--sizes 'DiT-S/2:16:³'"),
    ("memory_table", ["--world", "1"], "--world: '1'"),
    ("memory_table", ["--lora-rank", "0"], "--lora-rank: '0'"),
    ("memory_table", ["--measure", "flux:nope"], "--measure 'flux:nope' is not a family preset"),
    ("memory_table", ["--measure", "DiT-XL/2"], "--measure 'DiT-XL/2' is not a family preset"),
    ("memory_table", ["--measure", "flux:tiny", "--resolution", "0"], "--resolution: '0'"),
    ("memory_table", ["--measure", "flux:tiny", "--set", "train.batch_size=4"], "train.batch_size"),
    ("memory_table", ["--video", "wan:tiny", "--frames", "0", "2"], "--frames: '0'"),
    ("gpu_check", ["--budget", "inf"], "--budget: 'inf'"),
    ("gpu_check", ["--xl-batches", "-8"], "--xl-batches: '-8'"),
    ("video_memory_gpu", ["--frames", "5", "100000"], "--frames: '100000'"),
    ("toy_classifier", ["--resolution", "4"], "--resolution: '4'"),
    ("toy_classifier", ["--seed", str(2 ** 32)], f"--seed: '{2 ** 32}'"),
    ("ablation_report", ["--at-step", "-1"], "--at-step: '-1'"),
    ("diffusers_pipeline", ["--num-steps", "0"], "--num-steps: '0'"),
    ("diffusers_pipeline", ["--seeds", "1", "-2"], "--seeds: '-2'"),
    ("toy_images", ["--per-class", "10**9"], "--per-class: '10**9'"),
    ("tiny_vae", ["--steps", "3.5"], "--steps: '3.5'"),
    ("tiny_text_encoders", ["--seed", "nan"], "--seed: 'nan'"),
]


def refusal(script: str, args: list[str]) -> str:
    """The one line a refused command prints (SystemExit's message, or the UserError a script's caller prints)."""
    try:
        MAINS[script](args)
    except SystemExit as exit:
        return str(exit.code)
    except UserError as err:
        return f"error: {err}"
    raise AssertionError(f"{script} {args} was not refused")


@pytest.mark.parametrize("script, args, needle", CASES, ids=[f"{c[0]}-{'_'.join(c[1])}" for c in CASES])
def test_a_bad_argument_is_one_line_naming_the_flag_and_value(script, args, needle, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                          # nothing is written here either
    line = refusal(script, args)
    assert line.startswith("error: ") and "\n" not in line and needle in line, line
    assert "usage:" not in line, line
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("text, low, high, value", [("7", 1, 9, 7), (" 3 ", 0, 9, 3), ("0", 0, 0, 0)])
def test_integers_in_range_are_read(text, low, high, value):
    assert parse_int(text, low, high) == value


@pytest.mark.parametrize("text", ["", "1.0", "1e3", "٣", "²", "0x10", "1_000", "10", "nan", "-1", "+1"])
def test_anything_but_ascii_digits_in_range_is_refused(text):
    with pytest.raises(ValueError, match=r"is not allowed: an integer in \[0, 9\]"):
        parse_int(text, 0, 9)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf", "0", "2.5", "abc", "1e-3"])
def test_numbers_are_finite_and_in_range(text):
    with pytest.raises(ValueError, match=r"is not allowed: a number in \(0, 2\]"):
        parse_number(text, 0, 2, low_open=True)
    assert parse_number("2", 0, 2, low_open=True) == 2.0


def test_the_parser_raises_its_error_type_and_keeps_help(capsys):
    class Mine(UserError):
        pass

    p = Parser(prog="x.py", error_type=Mine)
    p.add_argument("--n", type=int_in(1, 3))
    p.add_argument("--f", type=number_in(0, 1))
    with pytest.raises(Mine, match=r"^argument --n: '4' is not allowed: an integer in \[1, 3\] \(python x.py"):
        p.parse_args(["--n", "4"])
    with pytest.raises(SystemExit) as exit:
        p.parse_args(["--help"])
    assert exit.value.code == 0 and "--n" in capsys.readouterr().out
    assert isinstance(p, argparse.ArgumentParser)
