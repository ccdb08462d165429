"""The built-in offline datasets (data.builtin): toy_shapes and its text, bucketed and clip variants, each built
on first use into data.path from a seed, and the toy networks trained on them (the toy classifier, which is also
REPA's toy encoders' weights). They write the format of tread.data (meta, writer, bucketed) and import nothing
of tread.data.precompute."""
from __future__ import annotations

from .toy import TOY_CLASS_NAMES, ensure_toy_classifier, ensure_toy_dataset, generate_toy_shapes
from .toy_buckets import ensure_toy_buckets
from .toy_clips import ensure_toy_clips
from .toy_text import ensure_toy_text_dataset

BUILTINS = {"toy_shapes": ensure_toy_dataset,   # data.builtin name -> builder(path, **data.builtin_args)
            "toy_shapes_text": ensure_toy_text_dataset,
            "toy_shapes_buckets": ensure_toy_buckets,
            "toy_shapes_clips": ensure_toy_clips}

__all__ = ["BUILTINS", "TOY_CLASS_NAMES", "ensure_toy_buckets", "ensure_toy_classifier", "ensure_toy_clips",
           "ensure_toy_dataset", "ensure_toy_text_dataset", "generate_toy_shapes"]
