"""The contract every trained backbone implements (DiT, SPRINT and each diffusers family): what training,
sampling, evaluation and the planner may ask of a model. The defaults are a class-conditioned image model's."""
from __future__ import annotations

import contextlib
from typing import Any, ClassVar, Iterator, Mapping, Optional

from tread.routing import RoutedBackbone


class Backbone(RoutedBackbone):
    """A routed backbone: (x, noise_level, labels, **cond) -> prediction, with these capabilities."""

    text_conditioned: ClassVar[bool] = False   # its conditioning is text (cond["text"], ...); else class labels only
    frames_axis: ClassVar[bool] = False        # inputs are (B, C, T, H, W) (video); images get T = 1
    frames: int = 1                            # latent frames of the default grid (model.frames; 1: images)
    i2v: bool = False                          # model.i2v: clips conditioned on their first frame
    kontext: bool = False                      # model.kontext: never-routed reference latents beside the target
    arch: str = ""                             # the display name (model.arch)
    analytic_flops: ClassVar[bool] = False     # forward_flops(routes, grid) counts analytically (DiT); else counted
    span: Optional[tuple[int, int]] = None     # SPRINT: the deep span path-drop guidance skips; None: no such path
    path_drop_prob: Optional[float] = None     # SPRINT: the training probability of dropping the deep path
    input_size: int                            # the default latent side (data.resolution)

    @contextlib.contextmanager
    def shape_only(self) -> Iterator[None]:
        """Around a FLOPs count on the meta device: what makes the forward computable without values."""
        yield

    def forward_flops(self, routes: Any = None, grid: Any = None) -> float:
        """Forward FLOPs per sample, analytically (where analytic_flops)."""
        raise NotImplementedError

    @property
    def i2v_frames(self) -> bool:
        """Whether given first frames replace the noisy ones (and are left out of the loss)."""
        return False

    def latent_patch(self) -> tuple[int, int, int]:
        """(pt, ph, pw): latent cells per token along T, H, W."""
        raise NotImplementedError

    def check_size(self, height: int, width: int, frames: int = 1) -> None:
        """Raise a one-line UserError for latents this backbone cannot take (called per bucket before training)."""

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        """Raise a one-line UserError when the data's text conditioning does not fit (class models ignore text)."""

    def repa_flops(self, routes: Any = None, grid: Any = None) -> float:
        """Forward FLOPs per sample of an alignment head (REPA; none by default)."""
        return 0.0
