"""TREAD routing for diffusers transformer families: the shared loop and the family contract.

A family wraps the diffusers transformer unchanged (`self.transformer`) and re-implements only the top-level
forward as `embed` -> `block_fns` -> `head`; `routing.run_blocks` routes between them, gathering image tokens
only. docs/families.md describes the contract and what each family routes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional, Sequence

import torch
import torch.nn as nn

from tread.models.errors import FamilyConfigError
from tread.models.families.first_frame import FIRST_FRAME, condition_inputs, conditioned
from tread.models.families.norms import norms_follow_input
from tread.models.families.split import SplitSequence
from tread.routing import RoutePlan, RoutingController, run_blocks
from tread.routing.masks import token_keep_mask


Grid = tuple[int, int, int]   # a token grid (t, h, w): frames, rows, columns of tokens


@dataclass
class Embedded:
    """What a family's embed step hands to the block loop and the head."""

    x: torch.Tensor                                   # (B, N, D) routable image/video tokens
    context: Any = None                               # never routed: text stream, registers, ...
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)  # (B, N, ...) gathered with the tokens
    extra: dict[str, Any] = field(default_factory=dict)               # per-sample conditioning, ...
    grid: Optional[Grid] = None                       # this batch's token grid (t, h, w), N = t * h * w: grid_of


class ClassTextEmbedder(nn.Module):
    """Class label -> (text sequence (B, L, D), pooled (B, P)): a learned table, so class-conditional
    data trains text-conditioned families offline. Row `num_classes` is the null class (CFG)."""

    def __init__(self, num_classes: int, seq_len: int, text_dim: int, pooled_dim: Optional[int] = None,
                 init_std: float = 1.0):
        super().__init__()
        self.num_classes, self.seq_len, self.text_dim = num_classes, seq_len, text_dim
        self.text = nn.Embedding(num_classes + 1, seq_len * text_dim)
        self.pooled = nn.Embedding(num_classes + 1, pooled_dim) if pooled_dim else None
        nn.init.normal_(self.text.weight, std=init_std)
        if self.pooled is not None:
            nn.init.normal_(self.pooled.weight, std=init_std)

    def forward(self, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = {"text": self.text(labels).view(labels.shape[0], self.seq_len, self.text_dim)}
        if self.pooled is not None:
            out["pooled"] = self.pooled(labels)
        return out


def null_text(cond: Mapping[str, torch.Tensor], drop: torch.Tensor) -> dict[str, torch.Tensor]:
    """Text data under CFG: samples with drop (B,) True get zero embeddings (the unconditional branch)."""
    out = dict(cond)
    for key in ("text", "pooled"):
        if key in out and out[key] is not None:
            keep = (~drop).to(out[key].dtype).view(-1, *([1] * (out[key].dim() - 1)))
            out[key] = out[key] * keep
    return out


class RoutedFamily(SplitSequence):
    """Base class of the diffusers families: config checks, conditioning, routing and the forward loop."""

    family: ClassVar[str] = ""
    hub_hint: ClassVar[str] = ""          # a hub repo to name in "how to get the weights" errors
    text_conditioned: ClassVar[bool] = True
    diffusers_class: ClassVar[str] = ""   # the diffusers transformer class, e.g. "FluxTransformer2DModel"
    text_dim_key: ClassVar[str] = ""      # the transformer config key holding the text embedding width
    channel_keys: ClassVar[tuple[str, str]] = ("in_channels", "out_channels")   # the config's latent channel keys
    pooled_dim_key: ClassVar[Optional[str]] = None   # ... the pooled text width (None: no pooled embedding)
    # How the absolute position table (config pos_embed_max_size) is sized from the data's token grid:
    # "side" (SD3: the grid side), "area" (AuraFlow: side^2 positions) or "" (no such table).
    pos_table: ClassVar[str] = ""
    # The attention projections a LoRA usually targets (the memory table's LoRA rows count these).
    lora_targets: ClassVar[tuple[str, ...]] = ("to_q", "to_k", "to_v", "to_out.0")
    # Reference latents (edit pairs: the data's reference_latents.npy, cond["reference"]): the families that take
    # them (FLUX Kontext, FLUX.2, Qwen-Image-Edit) set takes_references and self.kontext (model.kontext), and
    # say how to use such data (reference_advice).
    takes_references: ClassVar[bool] = False
    takes_llama: ClassVar[bool] = False   # the data's Llama hidden states (cond["llama"]): HiDream only
    llama_dim: Optional[int] = None       # their width (HiDream)
    use_t5: bool = True                   # model.use_t5 (SD3: false zeroes the T5 part of the text)
    reference_advice: ClassVar[str] = "set model.kontext=true"
    # How a family takes image-to-video conditioning frames (model.i2v, cond["first_frame"]: first_frame.py): "frames"
    # (the clean frames in place at timestep 0, force-kept, left out of the loss, put back after sampling: the families
    # whose embed takes (B, N) timesteps), "channels" (the family's embed builds its pipeline's condition channels
    # itself: HunyuanVideo 1.5), "" (none). "frames": the given frames' noise level, and whether the levels go to
    # the model per latent frame (B, T) instead of per token (Cosmos-Predict2 Video2World: sigma_conditioning, per frame).
    i2v_mode: ClassVar[str] = ""
    i2v_given_level: ClassVar[float] = 0.0
    i2v_per_frame: ClassVar[bool] = False

    def __init__(self, transformer: nn.Module, *, input_size: int, in_channels: int, num_classes: int,
                 routing: Optional[Mapping[str, Any]] = None, text_len: int = 8, arch: str = "",
                 gradient_checkpointing: bool = False, frames: int = 1, i2v: bool = False):
        super().__init__()
        self.transformer = norms_follow_input(transformer)   # fused RMS norms under autocast (norms.py)
        self.arch = arch or self.family
        self.input_size, self.in_channels, self.out_channels = int(input_size), int(in_channels), int(in_channels)
        self.num_classes, self.frames = int(num_classes), int(frames)
        self.gradient_checkpointing = bool(gradient_checkpointing)
        self.i2v = bool(i2v)
        if self.i2v and not (self.frames_axis and self.i2v_mode):
            raise FamilyConfigError(f"model.i2v=true: model.family={self.family} takes no image-to-video conditioning "
                                    f"frames; allowed: false (model.i2v is for wan, ltx_video, cosmos and "
                                    f"hunyuan_video).")
        self.check_shapes()
        self.conditioner = ClassTextEmbedder(num_classes, text_len, self.text_dim, self.pooled_dim) \
            if num_classes else None
        self.text_len = text_len
        self.install_processors()
        depth = len(self.routable_blocks())
        self.routing = RoutingController.from_config(routing, depth)

    # -- what a family provides ---------------------------------------------------------------
    @classmethod
    def transformer_class(cls) -> type:
        """The diffusers class (imported lazily: diffusers is only needed for these families)."""
        import diffusers  # deferred: a heavy optional dependency, only the families need it

        return getattr(diffusers, cls.diffusers_class)

    @classmethod
    def data_config(cls, in_channels: int, input_size: int, diffusers_config: Mapping[str, Any]) -> dict[str, Any]:
        """diffusers diffusers_config keys that follow from the data (channels, sample size) and from `diffusers_config`; explicit
        preset/override keys win."""
        out = {"in_channels": in_channels, "out_channels": in_channels, "sample_size": input_size}
        if cls.pos_table:
            side = max(1, input_size // int(diffusers_config.get("patch_size", 2)))
            out["pos_embed_max_size"] = side if cls.pos_table == "side" else side * side
        return out

    @classmethod
    def init_fresh(cls, transformer: nn.Module) -> None:
        """build_family's hook for a transformer built from a preset (fresh weights, never pretrained ones): redo what
        the diffusers constructor leaves degenerate (ERNIE-Image's zeroed layers). Default: diffusers' init as it is."""

    @property
    def text_dim(self) -> int:
        return int(getattr(self.transformer.config, self.text_dim_key))

    @property
    def pooled_dim(self) -> Optional[int]:
        return int(getattr(self.transformer.config, self.pooled_dim_key)) if self.pooled_dim_key else None

    def latent_patch(self) -> tuple[int, int, int]:
        """(pt, ph, pw): latent cells per token along T, H, W (default: the transformer's square patch_size)."""
        p = int(self.transformer.config.patch_size)
        return 1, p, p

    def check_shapes(self) -> None:
        """Raise FamilyConfigError when the data does not fit the transformer config."""

    def _check_packed_io(self, transformer_config: Any, name: str) -> None:
        """check_shapes' part for families whose pipeline packs 2x2 latent cells into one token (FLUX, FLUX.2, Chroma):
        patch_size 1, in_channels = 4 x data.channels, out_channels null or equal, even resolution."""
        c, channels = transformer_config, self.in_channels
        if c.patch_size != 1:
            raise FamilyConfigError(f"model.config.patch_size={c.patch_size}: {name}'s pipeline packs 2x2 latent cells "
                                    f"into tokens itself and needs the transformer's patch_size 1.")
        if c.in_channels != channels * 4:
            raise FamilyConfigError(
                f"{name} packs 2x2 latent cells into one token, so its transformer needs in_channels = 4 x data "
                f"channels = {channels * 4}, but model.config.in_channels={c.in_channels} (data.channels={channels}). "
                f"Match them, or use data with {c.in_channels // 4} channels.")
        if c.out_channels is not None and c.out_channels != c.in_channels:
            raise FamilyConfigError(f"model.config.out_channels={c.out_channels} must be null or equal in_channels="
                                    f"{c.in_channels}: the model predicts a latent of the input's shape.")
        if self.input_size % 2:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be even: {name} packs 2x2 latent cells.")

    def _check_patch_io(self, transformer_config: Any, note: str, *, learned_sigma: bool = False,
                        width_key: Optional[str] = "caption_projection_dim",
                        width_note: str = "the text stream enters the joint blocks") -> None:
        """check_shapes' part for families that patchify the latents as they are: in/out channels, resolution a
        multiple of patch_size and (when `width_key` is given) the width; each error names key, value and rule."""
        c, channels = transformer_config, self.in_channels
        if c.in_channels != channels:
            raise FamilyConfigError(f"model.config.in_channels={c.in_channels} must equal data.channels="
                                    f"{channels} ({note}).")
        out = c.out_channels if c.out_channels is not None else c.in_channels
        if out not in ((channels, 2 * channels) if learned_sigma else (channels,)):
            sigma = f" or 2 x data.channels = {2 * channels} (learned sigma)" if learned_sigma else ""
            raise FamilyConfigError(f"model.config.out_channels={out} must equal data.channels={channels}{sigma}: "
                                    f"the model predicts a latent of the input's shape.")
        if self.input_size % c.patch_size:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be a multiple of model.config."
                                    f"patch_size={c.patch_size}.")
        inner = c.num_attention_heads * c.attention_head_dim
        if width_key is not None and getattr(c, width_key) != inner:
            raise FamilyConfigError(
                f"model.config.{width_key}={getattr(c, width_key)} must equal the width "
                f"num_attention_heads x attention_head_dim = {inner}: {width_note}.")

    def _check_video_patch(self) -> None:
        """check_shapes' part shared by the video families: data.resolution and model.frames are whole tokens."""
        pt, ph, pw = self.latent_patch()
        if self.input_size % ph or self.input_size % pw:
            raise FamilyConfigError(f"data.resolution={self.input_size} must be whole patches of {ph}x{pw} "
                                    f"(model.config.patch_size).")
        if self.frames < 1 or self.frames % pt:
            raise FamilyConfigError(f"model.frames={self.frames} must be a positive multiple of the time patch {pt}.")

    def install_processors(self) -> None:
        """Swap in attention processors that accept per-sample (batched) RoPE, where the family needs it."""

    def blocks_of(self, transformer: nn.Module) -> list[nn.Module]:
        """The blocks of a transformer of this family, in route-index order (also for a pipeline's copy)."""
        raise NotImplementedError

    def routable_blocks(self) -> list[nn.Module]:
        """The blocks route indices count over: this model's transformer's blocks_of."""
        return self.blocks_of(self.transformer)

    def embed(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor]) -> Embedded:
        raise NotImplementedError

    def block_fns(self, emb: Embedded) -> list[Callable[..., Any]]:
        raise NotImplementedError

    def head(self, x: torch.Tensor, emb: Embedded) -> torch.Tensor:
        raise NotImplementedError

    def diffusers_forward(self, x: torch.Tensor, timestep: torch.Tensor, cond: Mapping[str, torch.Tensor],
                          transformer: nn.Module) -> torch.Tensor:
        """`transformer(...)` (diffusers' own forward) on the same inputs, in our output layout (for tests)."""
        raise NotImplementedError

    def timestep(self, noise_level: torch.Tensor) -> torch.Tensor:
        """noise_level (t * 1000) -> the family's timestep convention (default: t * 1000 as given)."""
        return noise_level

    def token_timestep(self, timestep: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """A video family's timestep for N = num_tokens tokens: (B,) per sample, or (B, N) per token (checked);
        model.expand_timesteps (self.expand_timesteps) turns (B,) into (B, N), as Wan 2.2 TI2V's pipeline does."""
        if timestep.dim() == 1 and getattr(self, "expand_timesteps", False):
            return timestep[:, None].expand(-1, num_tokens)
        if timestep.dim() == 2 and timestep.shape[1] != num_tokens:
            raise FamilyConfigError(f"a per-token timestep must be (B, N) with N = {num_tokens} video tokens; "
                                    f"got {tuple(timestep.shape)}.")
        return timestep

    # -- shared --------------------------------------------------------------------------------
    @property
    def depth(self) -> int:
        return self.routing.depth

    @property
    def token_grid(self) -> Grid:
        """The default token grid (t, h, w): data.resolution square latents (model.frames for video), what sampling,
        the FLOPs count and the memory table use by default. A batch's own grid is grid_of(x)."""
        pt, ph, pw = self.latent_patch()
        return self.frames // pt, self.input_size // ph, self.input_size // pw

    @property
    def num_tokens(self) -> int:
        """Routable tokens at the default grid (a batch of another size has tokens_in(x))."""
        t, h, w = self.token_grid
        return t * h * w

    def grid_of(self, x: torch.Tensor) -> Grid:
        """The token grid (t, h, w) of latents x (B, C, H, W), or (B, C, T, H, W) for a video family (images: T = 1),
        read from x's shape: any size the family takes (check_size refuses the others)."""
        frames = int(x.shape[2]) if x.dim() == 5 else 1
        height, width = int(x.shape[-2]), int(x.shape[-1])
        self.check_size(height, width, frames)
        pt, ph, pw = self.latent_patch()
        return frames // pt, height // ph, width // pw

    def tokens_in(self, x: torch.Tensor) -> int:
        """Routable tokens of latents x (RoutedBackbone.forward plans the routes' keep counts with it)."""
        t, h, w = self.grid_of(x)
        return t * h * w

    def check_size(self, height: int, width: int, frames: int = 1) -> None:
        """Raise FamilyConfigError (one line: family, size, what is allowed) for latents of height x width (x frames)
        this family cannot take. Cheap: call it for every bucket before training starts."""
        pt, ph, pw = self.latent_patch()
        if height < ph or width < pw or height % ph or width % pw or frames < 1 or frames % pt:
            what = f"{height}x{width}" + (f" x {frames} frames" if frames != 1 or pt != 1 else "")
            frame_rule = f", frames a multiple of {pt}" if pt != 1 else ""
            raise FamilyConfigError(
                f"model.family={self.family}: latents {what} are not whole tokens; allowed: height a positive "
                f"multiple of {ph} and width of {pw} (latent cells per token){frame_rule}.")
        self.check_grid((frames // pt, height // ph, width // pw))

    def check_grid(self, grid: Grid) -> None:
        """A family's limits on a (t, h, w) token grid (its position table or RoPE table); none by default."""

    def conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """This batch's conditioning: its text (label dropout zeroes text only) plus, with model.kontext, the
        reference latents cond["reference"], which condition both CFG branches."""
        text = self.text_conditioning(labels, cond)
        if not self.kontext:
            return text
        ref = (cond or {}).get("reference")
        if ref is None:
            raise FamilyConfigError(self._reference_error("(B, data.channels, H, W), the target latents' shape",
                                                          "none"))
        return {**text, "reference": ref}

    def check_reference(self, conditioning: Mapping[str, Any], x: torch.Tensor) -> None:
        """With model.kontext, the reference latents conditioning["reference"] must have the shape of the target
        latents x (B, C, H, W) of this batch (any bucket's)."""
        ref = conditioning.get("reference") if self.kontext else None
        if ref is not None and tuple(ref.shape) != tuple(x.shape):
            raise FamilyConfigError(self._reference_error(list(x.shape), f"shape {list(ref.shape)}"))

    @staticmethod
    def _reference_error(want: Any, got: str) -> str:
        return (f"model.kontext=true needs the reference image's latents cond['reference'] of the target's shape "
                f"{want}, got {got}: train on data with reference_latents.npy (precompute --reference-images DIR), "
                f"or set model.kontext=false.")

    def text_conditioning(self, labels: torch.Tensor, cond: Optional[Mapping[str, torch.Tensor]]) -> dict:
        """Text conditioning for this batch: the dataset's (cond) or the class table's (labels)."""
        if cond and cond.get("text") is not None:
            text = {k: v for k, v in cond.items() if k in ("text", "text_mask", "pooled")}
            if self.pooled_dim and text.get("pooled") is None:
                raise FamilyConfigError(f"model.family={self.family} needs pooled text embeddings "
                                        f"(pooled_embeds.npy) but the data has none.")
            return null_text(text, labels == self.num_classes) if self.num_classes else text
        if self.conditioner is None:
            raise FamilyConfigError(f"model.family={self.family} needs text conditioning: the data has no text "
                                    f"embeddings and num_classes=0, so there is no class table to use.")
        return self.conditioner(labels)

    def check_text_data(self, conditioning: Mapping[str, Any], where: str) -> None:
        """The data's text embeddings (a reader's `conditioning`: {"text": (L, D) or None, "pooled": P or None})
        against this transformer's text widths, before any work; `where` names the data."""
        text, pooled = conditioning.get("text"), conditioning.get("pooled")
        if text is not None and int(text[1]) != self.text_dim:
            raise FamilyConfigError(
                f"the text embeddings of the data at {where} are {text[1]} wide, but model.config.{self.text_dim_key}="
                f"{self.text_dim} ({self.family}): encode the captions with this model's text encoders, or set "
                f"model.config.{self.text_dim_key}={text[1]} for a fresh model.")
        if text is not None and self.pooled_dim and pooled is not None and int(pooled) != self.pooled_dim:
            raise FamilyConfigError(
                f"the pooled text embeddings of the data at {where} are {pooled} wide, but model.config."
                f"{self.pooled_dim_key}={self.pooled_dim} ({self.family}): encode the captions with this model's "
                f"text encoders, or set model.config.{self.pooled_dim_key}={pooled} for a fresh model.")
        if conditioning.get("llama") is not None and not self.takes_llama:
            raise FamilyConfigError(
                f"the data at {where} has Llama hidden states (llama_embeds.npy: HiDream's text), which "
                f"model.family={self.family} would ignore: use model=hidream, or data whose captions were encoded "
                f"for {self.family} (scripts/precompute_latents.py --text-family {self.family}).")
        self.check_references(conditioning.get("reference") is not None, where)

    def check_references(self, has_ref: bool, where: str) -> None:
        """The data has reference latents exactly when this model conditions on them: references the model would
        not read mean a different task (text-to-image) learnt silently."""
        if self.kontext and not has_ref:
            raise FamilyConfigError(
                f"model.kontext=true but the data at data.path={where} has no reference latents (missing "
                f"reference_latents.npy, meta.json files.reference_latents): build the dataset with "
                f"scripts/precompute_latents.py --reference-images DIR, or set model.kontext=false.")
        if has_ref and not self.kontext:
            how = self.reference_advice if self.takes_references else \
                f"model.family={self.family} takes none; use model=flux_kontext, flux2 or qwen_image with model.kontext=true"
            raise FamilyConfigError(
                f"the data at data.path={where} has reference latents (reference_latents.npy, edit pairs) but "
                f"model.kontext=false would ignore them: {how}, or use data without reference_latents.npy.")

    def to_model_layout(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, H, W) image latents -> (B, C, 1, H, W) for video families; identity otherwise."""
        return x.unsqueeze(2) if self.frames_axis and x.dim() == 4 else x

    def from_model_layout(self, out: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return out.squeeze(2) if self.frames_axis and like.dim() == 4 else out

    def forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor,
                force_keep: Optional[torch.Tensor] = None, *, return_aux: bool = False, **kwargs: Any) -> Any:
        """RoutedBackbone.forward; with model.i2v ("frames" mode) and cond["first_frame"], first the image-to-video
        inputs (first_frame.py)."""
        use = conditioned(kwargs.get("cond"), x.shape[0], x.device) if self.i2v_frames else None
        if use is not None:
            pt, ph, pw = self.latent_patch()
            t, h, w = self.grid_of(x)
            x, noise_level, given = condition_inputs(self.to_model_layout(x), noise_level, kwargs["cond"][FIRST_FRAME],
                                                     use, h * w, pt, self.i2v_given_level, self.i2v_per_frame)
            force_keep = given if force_keep is None else force_keep | given
        return super().forward(x, noise_level, labels, force_keep, return_aux=return_aux, **kwargs)

    @property
    def i2v_frames(self) -> bool:
        """model.i2v in the "frames" mode: the given frames replace the noisy ones (and are kept out of the loss)."""
        return self.i2v and self.i2v_mode == "frames"

    def routed_forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor, plan: RoutePlan,
                       force_keep: Optional[torch.Tensor] = None, cond: Optional[Mapping[str, torch.Tensor]] = None
                       ) -> torch.Tensor:
        """x (B, C, H, W) or (B, C, T, H, W), noise_level (B,) = t * 1000, labels (B,); force_keep (B, N) bool over
        image tokens; cond: the data's text embeddings (optional); `plan` from the routing controller."""
        text = self.conditioning(labels, cond)
        self.check_reference(text, x)
        xm = self.to_model_layout(x)
        emb = self.embed(xm, self.timestep(noise_level), text)                   # emb.grid: this batch's grid
        if self.joint_text and self.context_split is not None:
            self.split_text(emb, self.context_split)
        h, emb.context = run_blocks(self.block_fns(emb), emb.x, plan, self.routing.router, force_keep,
                                    context=emb.context, per_token=emb.per_token,
                                    checkpoint=self.gradient_checkpointing and self.training)
        return self.from_model_layout(self.head(h, emb), x)

    def save_pretrained(self, folder: str) -> None:
        """The diffusers pipeline folder model.pretrained loads back: transformer/ (a family whose model holds other
        parts of its pipeline, such as LTX-2's text connectors, writes those too)."""
        self.transformer.save_pretrained(f"{folder}/transformer")

    def pristine_transformer(self) -> nn.Module:
        """A fresh diffusers transformer (diffusers' default attention processors) with our weights."""
        fresh = type(self.transformer).from_config(self.transformer.config)
        fresh.load_state_dict(self.transformer.state_dict())
        return fresh.to(next(self.transformer.parameters()).device)

    def reference_forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor,
                          cond: Optional[Mapping[str, torch.Tensor]] = None,
                          transformer: Optional[nn.Module] = None) -> torch.Tensor:
        """diffusers' own forward (of `transformer`, default: a pristine copy) on the same conditioning."""
        text = self.conditioning(labels, cond)
        self.check_reference(text, x)
        transformer = transformer if transformer is not None else self.pristine_transformer()
        out = self.diffusers_forward(self.to_model_layout(x), self.timestep(noise_level), text, transformer)
        return self.from_model_layout(out, x)

    def tokens_from_mask(self, mask: torch.Tensor, size: Optional[Sequence[int]] = None) -> torch.Tensor:
        """A (B, 1, Hm, Wm) coverage mask in [0, 1] -> (B, N) bool: tokens more than half covered, on the token grid
        of `size` (x.shape[2:]; default: the default grid)."""
        t, h, w = self.token_grid if size is None else self.grid_of(mask.new_empty(0, 0, *map(int, size)))
        keep = token_keep_mask(mask, (h, w))                                    # (B, h*w)
        return keep.repeat(1, t) if t > 1 else keep


def cond32(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """Per-sample conditioning that block closures hold, as float32 when autocast is off (inside a
    routing.fp32_after_route block), to match the block's float32 inputs and weights."""
    if t is None or not t.is_floating_point() or (t.device.type != "meta" and torch.is_autocast_enabled(t.device.type)):
        return t
    return t.float()


def mask_bias(mask: Optional[torch.Tensor], dtype: torch.dtype) -> Optional[torch.Tensor]:
    """(B, L) keep-mask -> (B, 1, L) additive bias of -10000 at the padding, as PixArt's and Sana's forward convert
    their encoder attention mask (None: no mask)."""
    if mask is None:
        return None
    return ((1 - mask.to(dtype)) * -10000.0).unsqueeze(1)


def pack_cells(x: torch.Tensor, p: int) -> torch.Tensor:
    """(B, C, H, W) latents -> (B, H/p * W/p, C*p*p) tokens, row-major, features ordered (C, p, p): the packing of
    the FLUX, FLUX.2 and Qwen-Image pipelines."""
    B, C, H, W = x.shape
    x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(B, (H // p) * (W // p), C * p * p)


def unpack_cells(tokens: torch.Tensor, h: int, w: int, p: int) -> torch.Tensor:
    """(B, h*w, C*p*p) tokens with features ordered (C, p, p) -> (B, C, h*p, w*p): the inverse of pack_cells."""
    B = tokens.shape[0]
    x = tokens.reshape(B, h, w, -1, p, p).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(B, -1, h * p, w * p)


def unpack_patches(x: torch.Tensor, grid: Sequence[int], patch: Sequence[int], channels: int) -> torch.Tensor:
    """Tokens (B, T*H*W, pt*ph*pw*C) in (t, h, w) order with features (pt, ph, pw, C) -> (B, C, T*pt, H*ph, W*pw)."""
    B = x.shape[0]
    t, h, w = grid
    pt, ph, pw = patch
    x = x.reshape(B, t, h, w, pt, ph, pw, channels)
    return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(B, channels, t * pt, h * ph, w * pw)
