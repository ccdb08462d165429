"""Wan VACE (diffusers WanVACETransformer3DModel + WanVACEPipeline) with TREAD routing.

WanVACE is Wan (tread/models/families/wan.py: the same blocks, RoPE, modulation and head) plus VACE blocks: before the
main blocks they run on the FULL sequence of the embedded video tokens and the embedded VACE context (the control
video's latents + mask, vace_in_channels = 2 x 16 + 64 = 96 in the released models) and produce one hint per VACE
layer, (B, N, D): one row per video token. diffusers adds hint k (times conditioning_scale[k]) after main block
vace_layers[k]. Here the VACE blocks run in embed, never routed; their hints are per-token tensors, so inside a route
the kept tokens get the hints of their own positions (gathered with them) and the hints themselves are untouched by
routing. Only per-sample (B,) timesteps: WanVACETransformer3DModel has no per-token timestep path.

The VACE context is conditioning, never routed: cond["control"] (B, vace_in_channels, T, H, W) at the latents' grid,
as WanVACEPipeline builds it (prepare_video_latents + prepare_masks, concatenated). Without one (text-to-video data,
training and sampling alike), the family builds the context of the pipeline's call without a control video: video None
-> a blank video and mask None -> ones ("generate everything"), i.e. [latent(blank), latent(blank), ones(64)]; the
blank video's latent is taken as 0 (exact where the VAE maps the blank video to 0 after its normalisation; for the
released VAE it is a near-constant, not 0).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint as _checkpoint

from tread.models.families.base import Embedded, FamilyConfigError, cond32
from tread.models.families.wan import WAN_PRESETS, WanFamily

VAE_SPATIAL = 8            # WanVACEPipeline.vae_scale_factor_spatial (Wan 2.1 VAE): the mask's 8 x 8 = 64 channels
MASK_CHANNELS = VAE_SPATIAL * VAE_SPATIAL
CONTROL = "control"        # cond key of a given VACE context (B, vace_in_channels, T, H, W)


def _wan(name: str, **over: Any) -> dict[str, Any]:
    return {**WAN_PRESETS[name], **over}


def _released(num_heads: int, ffn: int, layers: int, vace_layers: list[int]) -> dict[str, Any]:
    """diffusers scripts/convert_wan_to_diffusers.py "Wan-VACE-1.3B" / "Wan-VACE-14B" diffusers_config."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=128, in_channels=16,
                out_channels=16, text_dim=4096, freq_dim=256, ffn_dim=ffn, num_layers=layers, cross_attn_norm=True,
                qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, image_dim=None,
                added_kv_proj_dim=None, vace_layers=vace_layers, vace_in_channels=96)


WAN_VACE_PRESETS: dict[str, dict[str, Any]] = {
    # CPU tests and the built-in data: Wan's tiny (8 blocks, width 64) + 4 VACE blocks after main blocks 0, 2, 4, 6;
    # vace_in_channels follows the data: 2 x data.channels + 64 (data_config).
    "tiny": _wan("tiny", vace_layers=[0, 2, 4, 6]),
    # GPU benchmarks: Wan's mid (16 blocks, width 1024) + 4 VACE blocks.
    "mid": _wan("mid", vace_layers=[0, 4, 8, 12]),
    # Wan2.1-VACE-1.3B / -14B (Wan 2.1 VAE: 16 channels, context 96): load the weights with model.pretrained.
    "wan2.1-vace-1.3b": _released(12, 8960, 30, list(range(0, 30, 2))),
    "wan2.1-vace-14b": _released(40, 13824, 40, list(range(0, 40, 5))),
}

Scale = Union[float, Sequence[float]]


class WanVACEFamily(WanFamily):
    family = "wan_vace"
    hub_hint = "Wan-AI/Wan2.1-VACE-1.3B-diffusers"
    diffusers_class = "WanVACETransformer3DModel"
    i2v_mode = ""                   # VACE conditions through its control context, not first frames

    def group_attention_modules(self) -> list[nn.Module]:
        """Context parallelism is refused (RoutedFamily's one line): Wan's split would leave the VACE blocks, which
        run on the full sequence inside embed, and their hints untested under a split."""
        return []

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        layers, depth = diffusers_config.get("vace_layers"), diffusers_config.get("num_layers")
        if layers is not None:
            layers = list(layers)
            if not layers or layers[0] != 0 or any(b <= a for a, b in zip(layers, layers[1:])) or \
                    (depth is not None and layers[-1] >= int(depth)):
                raise FamilyConfigError(
                    f"model.config.vace_layers={layers}: allowed: strictly increasing block indices starting at 0 "
                    f"and below model.config.num_layers={depth} (diffusers adds VACE hint k after block "
                    f"vace_layers[k]).")
        return {**super().data_config(in_channels, input_size, diffusers_config),
                "vace_in_channels": 2 * in_channels + MASK_CHANNELS}

    def __init__(self, transformer: nn.Module, *, conditioning_scale: Scale = 1.0, expand_timesteps: bool = False,
                 **kwargs: Any):
        if expand_timesteps:
            raise FamilyConfigError("model.expand_timesteps=true: WanVACETransformer3DModel takes per-sample (B,) "
                                    "timesteps only (no per-token path); allowed: false.")
        super().__init__(transformer, expand_timesteps=False, **kwargs)
        self.vace_layers = [int(i) for i in self.transformer.config.vace_layers]
        self.conditioning_scale = self._scales(conditioning_scale)

    def _scales(self, scale: Scale) -> list[float]:
        """WanVACEPipeline.__call__'s conditioning_scale: one number for every VACE layer, or one per layer."""
        n = len(self.vace_layers)
        values = [scale] * n if isinstance(scale, (int, float)) else scale
        try:
            values = [float(v) for v in values if not isinstance(v, bool)] if not isinstance(values, str) else []
        except (TypeError, ValueError):
            values = []
        if len(values) != n:
            raise FamilyConfigError(f"conditioning_scale={scale!r}: allowed: a number or a list of {n} numbers "
                                    f"(one per VACE layer, model.config.vace_layers={self.vace_layers}).")
        return values

    def check_shapes(self) -> None:
        super().check_shapes()
        c = self.transformer.config
        want = 2 * self.in_channels + MASK_CHANNELS
        if c.vace_in_channels != want:
            raise FamilyConfigError(
                f"model.config.vace_in_channels={c.vace_in_channels} must be 2 x data.channels + {MASK_CHANNELS} = "
                f"{want}: WanVACEPipeline's context is [inactive latents, reactive latents, the mask's {VAE_SPATIAL}x"
                f"{VAE_SPATIAL} pixel cells] (96 for the Wan 2.1 VAE's 16 channels).")

    def check_grid(self, grid) -> None:
        """Wan's RoPE-table limit, named for this family."""
        try:
            super().check_grid(grid)
        except FamilyConfigError as err:
            raise FamilyConfigError(str(err).replace("model.family=wan:", f"model.family={self.family}:", 1)) from None

    # -- the control context (never routed) -----------------------------------------------------
    def blank_control(self, x: torch.Tensor) -> torch.Tensor:
        """The context WanVACEPipeline builds without a control video or mask (video -> blank, mask -> ones), for
        latents x (B, C, T, H, W): [latent(blank) x 2 (taken as 0), mask ones (64)]."""
        B, C, T, H, W = x.shape
        return torch.cat([x.new_zeros(B, 2 * C, T, H, W), x.new_ones(B, MASK_CHANNELS, T, H, W)], dim=1)

    def control_of(self, cond: Mapping[str, Any], x: torch.Tensor) -> torch.Tensor:
        """The VACE context for latents x: cond["control"] when given (checked), else blank_control(x)."""
        ctrl = cond.get(CONTROL)
        if ctrl is None:
            return self.blank_control(x)
        ctrl = ctrl.unsqueeze(2) if ctrl.dim() == 4 else ctrl
        want = (x.shape[0], int(self.transformer.config.vace_in_channels), *x.shape[2:])
        if tuple(ctrl.shape) != want:
            raise FamilyConfigError(
                f"cond['control'] has shape {list(ctrl.shape)}; allowed: {list(want)} (B, vace_in_channels, T, H, W) "
                f"at the latents' grid, WanVACEPipeline's prepare_video_latents + prepare_masks concatenated.")
        return ctrl.to(x.dtype)

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """Text (label dropout zeroes text only) plus a given VACE context, which conditions both CFG branches (the
        pipeline passes its conditioning_latents to both)."""
        text = super().conditioning(labels, cond)
        ctrl = (cond or {}).get(CONTROL)
        return {**text, CONTROL: ctrl} if ctrl is not None else text

    def scale_tensor(self, like: torch.Tensor) -> torch.Tensor:
        return torch.tensor(self.conditioning_scale, dtype=like.dtype, device=like.device)

    def _per_sample(self, timestep: torch.Tensor) -> torch.Tensor:
        if timestep.dim() != 1:
            raise FamilyConfigError(f"model.family=wan_vace takes per-sample (B,) timesteps only; got shape "
                                    f"{list(timestep.shape)} (WanVACETransformer3DModel has no per-token timesteps).")
        return timestep

    # -- embed: Wan's, then the VACE blocks on the full sequence ---------------------------------
    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        emb = super().embed(x, self._per_sample(timestep), cond)
        tr = self.transformer
        ctrl = tr.vace_patch_embedding(self.control_of(cond, x)).flatten(2).transpose(1, 2)     # (B, N, D)
        rope, proj = (emb.per_token["rope_cos"], emb.per_token["rope_sin"]), emb.extra["timestep_proj"]
        ckpt = self.gradient_checkpointing and self.training and torch.is_grad_enabled()
        for k, block in enumerate(tr.vace_blocks):
            args = (emb.x, emb.context, ctrl, proj, rope)
            hint, ctrl = _checkpoint(block, *args, use_reentrant=False) if ckpt else block(*args)
            emb.per_token[f"vace_hint{k}"] = hint                                             # (B, N, D)
        return emb

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        fns = super().block_fns(emb)
        scales = self.scale_tensor(emb.per_token["vace_hint0"]).unbind()
        hinted = {layer: k for k, layer in enumerate(self.vace_layers)}

        def add_hint(fn: Callable[..., Any], k: int) -> Callable[..., Any]:
            def run(x: torch.Tensor, context: torch.Tensor, tok: Mapping[str, torch.Tensor]):
                h, context = fn(x, context, tok)
                return h + cond32(tok[f"vace_hint{k}"]) * cond32(scales[k]), context
            return run

        return [add_hint(fn, hinted[i]) if i in hinted else fn for i, fn in enumerate(fns)]

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        ctrl = self.control_of(cond, x)
        return transformer(hidden_states=x, timestep=self._per_sample(timestep), encoder_hidden_states=self._text(cond),
                           control_hidden_states=ctrl, control_hidden_states_scale=self.scale_tensor(ctrl),
                           return_dict=False)[0]


FAMILY = WanVACEFamily
PRESETS = WAN_VACE_PRESETS
