"""The diffusers families' part of context parallelism (train.context_parallel; docs/scaling.md): which attention
modules attend across the context group, and how a family whose text and image tokens attend jointly splits its
text with them. RoutedFamily (base.py) is a SplitSequence; routing's own part is tread/routing/shards.py."""
from __future__ import annotations

from typing import Any, ClassVar

import torch.nn as nn

from tread.models.backbone import Backbone
from tread.models.errors import FamilyConfigError


class SplitSequence(Backbone):
    """A backbone over a diffusers transformer that may run on its shard of every sequence of a context group."""

    # Whether text and image tokens attend jointly (then the text is split over the group with them), and which
    # emb.extra entries are per text token: one row each (text_rows, (L, ...)) or batched (text_columns, (B, L, ...)).
    joint_text: ClassVar[bool] = False
    text_rows: ClassVar[tuple[str, ...]] = ()
    text_columns: ClassVar[tuple[str, ...]] = ()
    family: ClassVar[str] = ""
    transformer: nn.Module

    def attention_width(self) -> int:
        c = self.transformer.config
        return int(c.num_attention_heads * c.attention_head_dim)

    def group_attention_modules(self) -> list[nn.Module]:
        """The attention modules that mix the routable tokens: under context parallelism their processors get
        diffusers' parallel config and attend across the group. None: the family cannot split its sequence."""
        return []

    def use_context_parallel(self, split: Any) -> None:
        """Each process runs its shard of the routable tokens (run_blocks splits them after the embedding and
        gathers them before the head); the group attention modules attend across the group by diffusers'
        templated Ulysses or ring attention. Cross-attended text stays whole on every process; jointly attended
        text (joint_text) is split too, or the all-to-all would count it once per process (split_text)."""
        modules = self.group_attention_modules()
        if not modules:
            super().use_context_parallel(split)
        if self.kontext:
            raise FamilyConfigError(f"train.context_parallel.degree={split.degree} cannot be combined with "
                                    f"model.kontext=true (the reference tokens travel whole with the text); "
                                    f"allowed: model.kontext=false, or train.context_parallel.degree=1.")
        split.check_heads(int(modules[0].heads), f"model.family={self.family}")
        for module in modules:
            module.processor._parallel_config = split.parallel_config
        self.context_split = split

    def split_text(self, emb: Any, split: Any) -> None:
        """Joint attention under a split: this process's contiguous share of the text tokens and of their
        per-token entries (text_rows: one row per token; text_columns: (B, L, ...)), in place."""
        length = emb.context.shape[1]
        if length % split.degree:
            raise FamilyConfigError(f"train.context_parallel.degree={split.degree}: model.family={self.family} "
                                    f"attends text and image jointly, so its {length} text tokens are split over "
                                    f"the group too and must divide by the degree; allowed: a degree dividing "
                                    f"{length}, or text padded to a multiple of {split.degree}.")
        emb.context = split.local(emb.context)
        for key in self.text_rows:
            emb.extra[key] = split.local(emb.extra[key].unsqueeze(0))[0]
        for key in self.text_columns:
            if emb.extra.get(key) is not None:
                emb.extra[key] = split.local(emb.extra[key])
