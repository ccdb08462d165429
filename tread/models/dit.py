"""DiT (Peebles & Xie 2023) with TREAD routing (Krause et al. 2025) inside its forward pass.

The backbone takes (x, noise_level, labels); the diffusion wrappers in `diffusion/` do the sigma algebra.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from tread.models.errors import ModelConfigError
from tread.models.repa import repa_head, repa_output, repa_tap
from tread.models.backbone import Backbone
from tread.routing import RoutePlan, RoutingController, run_blocks, tokens_per_block
from tread.routing.masks import token_keep_mask

#################################################################################
#                     Embedders: noise level, class label, positions            #
#################################################################################


class TimestepEmbedder(nn.Module):
    """Noise level (B,) -> (B, D): sinusoidal features, then a 2-layer MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]                                  # (B, half)
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)              # (B, dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels (B,) -> (B, D). Index `num_classes` is the null class used for CFG; label dropout is done by the
    training step, so the backbone stays deterministic given its inputs."""

    def __init__(self, num_classes: int, hidden_size: int):
        super().__init__()
        self.embedding_table = nn.Embedding(num_classes + 1, hidden_size)
        self.num_classes = num_classes

    def forward(self, labels: torch.Tensor) -> torch.Tensor:
        return self.embedding_table(labels)


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: Union[int, tuple[int, int]]) -> np.ndarray:
    """Fixed MAE-style 2-D sin-cos embedding (rows * cols, embed_dim) of a (rows, cols) grid (an int: square), tokens
    row-major; the first half of the features encodes the column, the second the row."""
    assert embed_dim % 4 == 0, "hidden size must be divisible by 4 for 2-D sin-cos embeddings"
    rows, cols = (grid_size, grid_size) if isinstance(grid_size, int) else grid_size
    grid_w, grid_h = np.meshgrid(np.arange(cols, dtype=np.float64), np.arange(rows, dtype=np.float64))  # (rows, cols)

    def embed_1d(pos: np.ndarray, dim: int) -> np.ndarray:
        omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
        out = np.einsum("m,d->md", pos.reshape(-1), omega)                       # (M, dim/2)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)                # (M, dim)

    return np.concatenate([embed_1d(grid_w, embed_dim // 2), embed_1d(grid_h, embed_dim // 2)], axis=1)


#################################################################################
#            Layers: patch embedding, attention, MLP (DiT's timm layers)        #
#################################################################################
# DiT builds these from timm; these are the same computations with the same parameter names (checkpoints and the
# paper's state dicts load unchanged) and the same construction order (the same seed gives the same weights).
# Importing timm would pull in torchvision and torch._dynamo, about 3 CPU-s of every launch (docs/design.md).


class PatchEmbed(nn.Module):
    """Latents (B, C, H, W) of whole patches -> tokens (B, N, D), row-major: a patch-strided convolution."""

    def __init__(self, input_size: int, patch_size: int, in_channels: int, hidden_size: int):
        super().__init__()
        self.num_patches = (input_size // patch_size) ** 2
        self.proj = nn.Conv2d(in_channels, hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention: one fused QKV projection, F.scaled_dot_product_attention, an output projection."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        if dim % num_heads:
            raise ModelConfigError(f"DiT: hidden size {dim} is not divisible by {num_heads} heads.")
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    context_parallel: Any = None   # a ContextParallel: x is this process's shard, keys and values the group's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        if self.context_parallel is None:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)                      # (B, H, N, Dh)
            out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)      # (B, N, H, Dh)
        else:
            out = self.context_parallel.attention(*qkv.unbind(2))              # (B, N, H, Dh) over the group's
        return self.proj(out.reshape(B, N, C))


class Mlp(nn.Module):
    """fc1, tanh-approximated GELU, fc2."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


#################################################################################
#                                 Core DiT block                                #
#################################################################################


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class DiTBlock(nn.Module):
    """Transformer block with adaLN-Zero conditioning on a per-sample vector c (B, D)."""

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(hidden_size, int(hidden_size * mlp_ratio))
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated projection of tokens back to patches."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size))

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


#################################################################################
#                                      DiT                                      #
#################################################################################


class DiT(Backbone):
    """Diffusion transformer over patchified latents, with optional TREAD routes."""

    def __init__(
        self,
        input_size: int = 32,          # the default latent height = width (other sizes: any multiple of patch_size)
        patch_size: int = 2,           # patch side; tokens = (input_size / patch_size)**2 at the default size
        in_channels: int = 4,          # latent channels (output has the same)
        hidden_size: int = 1152,       # token width D
        depth: int = 28,               # number of DiT blocks
        num_heads: int = 16,           # attention heads
        mlp_ratio: float = 4.0,        # MLP hidden = mlp_ratio * D
        num_classes: int = 1000,       # class count; index num_classes is the null class
        routing: Optional[Mapping[str, Any]] = None,  # `routing` config group ({enabled, routes, selection})
        gradient_checkpointing: bool = False,  # recompute blocks in backward (less memory, ~1/3 more compute)
        repa: Optional[Mapping[str, Any]] = None,  # model.repa: {block, encoder_dim, projector_dim, ...} (REPA head)
        init: str = "adaln_zero",      # adaln_zero (DiT's) | paper (CompVis/tread's: Xavier after the zeroing)
    ):
        super().__init__()
        if input_size % patch_size:
            raise ModelConfigError(f"input_size={input_size} must be divisible by patch_size={patch_size}.")
        if hidden_size % num_heads:
            raise ModelConfigError(f"hidden_size={hidden_size} must be divisible by num_heads={num_heads}.")
        self.in_channels = in_channels
        self.out_channels = in_channels
        self.patch_size = patch_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.depth = depth
        self.gradient_checkpointing = bool(gradient_checkpointing)
        if init not in INITS:
            raise ModelConfigError(f"model.init={init!r} is unknown; allowed: {', '.join(INITS)}.")
        self.init = init

        # The conv takes any size of whole patches (grid_of checks it first); num_patches is input_size's grid.
        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size)
        num_patches = self.x_embedder.num_patches
        pos = get_2d_sincos_pos_embed(hidden_size, int(num_patches ** 0.5))
        # A fixed buffer, not a parameter: it is recomputed on build and never saved. Other grids' tables: pos_embed_at.
        self.register_buffer("pos_embed", torch.from_numpy(pos).float().unsqueeze(0), persistent=False)
        self._pos_tables: dict[tuple[int, int], torch.Tensor] = {}
        self.blocks = nn.ModuleList([DiTBlock(hidden_size, num_heads, mlp_ratio) for _ in range(depth)])
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels)

        self.repa_head = repa_head(repa, hidden_size, depth)
        # Routes are validated here, against this depth, before any training work starts.
        self.routing = RoutingController.from_config(routing, depth)
        self.initialize_weights()

    @property
    def num_tokens(self) -> int:
        return self.x_embedder.num_patches

    def routable_blocks(self) -> list[nn.Module]:
        """The blocks route indices count over (as the families' routable_blocks(); tread/training/fsdp.py shards
        each)."""
        return list(self.blocks)

    @property
    def token_grid(self) -> tuple[int, int]:
        """(rows, cols) of the patch tokens at the default size (input_size square), ordered row-major by the patch
        embedding. A batch's own grid is grid_of(x)."""
        side = self.input_size // self.patch_size
        return side, side

    def grid_of(self, x: torch.Tensor) -> tuple[int, int]:
        """The (rows, cols) token grid of latents x (B, C, H, W): any H, W of whole patches (check_size)."""
        self.check_size(int(x.shape[-2]), int(x.shape[-1]))
        return x.shape[-2] // self.patch_size, x.shape[-1] // self.patch_size

    analytic_flops = True

    def latent_patch(self) -> tuple[int, int, int]:
        return 1, self.patch_size, self.patch_size

    def check_size(self, height: int, width: int, frames: int = 1) -> None:
        """Raise ModelConfigError (one line) for latents of height x width that are not whole patches."""
        p = self.patch_size
        if height < p or width < p or height % p or width % p:
            raise ModelConfigError(f"DiT (patch {p}): latents {height}x{width} are not whole patches; allowed: height "
                                   f"and width positive multiples of {p}.")

    def tokens_in(self, x: torch.Tensor) -> int:
        """Tokens of latents x: the keep counts of the routes follow them (RoutedBackbone.forward)."""
        h, w = self.grid_of(x)
        return h * w

    def pos_embed_at(self, grid: tuple[int, int]) -> torch.Tensor:
        """(1, h*w, D) sin-cos positions of an (h, w) token grid: the pos_embed buffer at the default grid, else a table
        computed once per grid and kept in a plain dict (never saved)."""
        if tuple(grid) == self.token_grid:
            return self.pos_embed
        like = self.pos_embed
        table = self._pos_tables.get(tuple(grid))
        if table is None or (table.device, table.dtype) != (like.device, like.dtype):
            pos = get_2d_sincos_pos_embed(like.shape[-1], tuple(grid))
            table = torch.from_numpy(pos).float().unsqueeze(0).to(device=like.device, dtype=like.dtype)
            self._pos_tables[tuple(grid)] = table
        return table

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """RoutedBackbone.forward; a new grid's position table is made here, eagerly, not in a compiled forward."""
        self.pos_embed_at(self.grid_of(x))
        return super().forward(x, *args, **kwargs)

    def tokens_from_mask(self, mask: torch.Tensor, size: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """A (B, 1, Hm, Wm) loss-mask coverage in [0, 1] -> (B, N) bool: tokens more than half covered, on the token
        grid of latents of size (H, W) (the batch's; default input_size square)."""
        grid = self.token_grid if size is None else self.grid_of(mask.new_empty(0, 0, *map(int, size)))
        return token_keep_mask(mask, grid)

    def _tokens(self, grid: Optional[tuple[int, int]]) -> int:
        """Tokens of latents of size grid = (H, W) (default: input_size square)."""
        if grid is None:
            return self.num_tokens
        self.check_size(int(grid[0]), int(grid[1]))
        return (int(grid[0]) // self.patch_size) * (int(grid[1]) // self.patch_size)

    def forward_flops(self, routes=None, grid: Optional[tuple[int, int]] = None) -> float:
        """Theoretical FLOPs of one forward pass per sample (multiply-add = 2), given routes, on latents of size
        grid = (H, W) (default: input_size square). Matmuls only: per block 2 n (4 D^2 + 2 D H) + 4 n^2 D."""
        N = self._tokens(grid)
        D = self.blocks[0].attn.qkv.in_features
        H = self.blocks[0].mlp.fc1.out_features
        n_per_block = tokens_per_block(routes if routes is not None else self.routing.routes, self.depth, N)
        block = sum(2 * n * (4 * D * D + 2 * D * H) + 4 * n * n * D for n in n_per_block)
        io = 2 * N * D * (self.patch_size ** 2 * self.in_channels) * 2
        return float(block + io)

    def repa_flops(self, routes=None, grid: Optional[tuple[int, int]] = None) -> float:
        """Forward FLOPs per sample of the REPA head (training only) on the tokens its block computes, given routes,
        on latents of size grid = (H, W) (default: input_size square; the frozen encoder's forward is not counted)."""
        if self.repa_head is None:
            return 0.0
        n = tokens_per_block(routes if routes is not None else self.routing.routes, self.depth, self._tokens(grid))
        return self.repa_head.flops(n[self.repa_head.block])

    def initialize_weights(self) -> None:
        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)
        w = self.x_embedder.proj.weight.data                       # init patch embed like a linear layer
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        # adaLN-Zero: every block starts as the identity and the output starts at zero.
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)
        if self.init == "paper":
            # CompVis/tread's DiT zeroes adaLN and the final layer in the blocks' constructors, then applies
            # Xavier-uniform to every Linear: as released, adaLN-Zero is undone (weights Xavier, biases zero).
            for module in [*(b.adaLN_modulation[-1] for b in self.blocks), self.final_layer.adaLN_modulation[-1],
                           self.final_layer.linear]:
                _basic_init(module)

    def unpatchify(self, x: torch.Tensor, grid: Optional[tuple[int, int]] = None) -> torch.Tensor:
        """(B, h*w, p*p*C) tokens of an (h, w) grid (None: a square one) -> (B, C, h*p, w*p)."""
        c, p = self.out_channels, self.patch_size
        h, w = grid if grid is not None else (int(x.shape[1] ** 0.5),) * 2
        x = x.reshape(x.shape[0], h, w, p, p, c)
        x = torch.einsum("nhwpqc->nchpwq", x)
        return x.reshape(x.shape[0], c, h * p, w * p)

    def attention_width(self) -> int:
        return self.blocks[0].attn.qkv.in_features

    def use_context_parallel(self, split: Any) -> None:
        """Blocks on this process's shard, attention over the group's (heads divide by the degree: Ulysses)."""
        if self.repa_head is not None:
            raise ModelConfigError(f"train.context_parallel.degree={split.degree} cannot be combined with model.repa "
                                   f"(the alignment loss reads one block's whole sequence); allowed: model.repa=null.")
        split.check_heads(self.blocks[0].attn.num_heads, self.arch or "DiT")
        self.context_split = split
        for block in self.blocks:
            block.attn.context_parallel = split

    def routed_forward(self, x: torch.Tensor, noise_level: torch.Tensor, labels: torch.Tensor, plan: RoutePlan,
                       force_keep: Optional[torch.Tensor] = None, return_aux: bool = False) -> Any:
        """x (B, C, H, W), noise_level (B,), labels (B,) in [0, num_classes]; force_keep (B, N) bool; `plan` from the
        routing controller. With return_aux, (x, aux): the REPA head's projected tokens and their ids."""
        grid = self.grid_of(x)
        x = self.x_embedder(x) + self.pos_embed_at(grid)                         # (B, N, D)
        c = self.t_embedder(noise_level) + self.y_embedder(labels)                # (B, D)
        blocks = [lambda h, blk=blk: blk(h, c) for blk in self.blocks]
        tap = repa_tap(self.repa_head, return_aux)
        x = run_blocks(blocks, x, plan, self.routing.router, force_keep,          # (B, N, D)
                       checkpoint=self.gradient_checkpointing and self.training, tap=tap)
        x = self.unpatchify(self.final_layer(x, c), grid)                         # (B, C, H, W)
        return repa_output(x, self.repa_head, tap, return_aux)


#################################################################################
#                                   Registry                                    #
#################################################################################

INITS = ("adaln_zero", "paper")   # model.init

# name -> (depth, hidden_size, num_heads); patch size comes from the "/p" suffix.
DIT_SIZES = {
    "T": (12, 96, 4),      # tiny, for CPU runs on the built-in data and tests
    "S": (12, 384, 6),
    "B": (12, 768, 12),
    "L": (24, 1024, 16),
    "XL": (28, 1152, 16),
}
PATCH_SIZES = (2, 4, 8)
DIT_ARCHS = [f"DiT-{s}/{p}" for s in DIT_SIZES for p in PATCH_SIZES]


def parse_arch(arch: str) -> tuple[int, int, int, int]:
    """'DiT-XL/2' -> (depth, hidden_size, num_heads, patch_size); the one parser of DiT names."""
    if arch not in DIT_ARCHS:
        raise ModelConfigError(f"model.arch={arch!r} is not a known DiT; allowed: {', '.join(DIT_ARCHS)}.")
    size, patch = arch[len("DiT-"):].split("/")
    depth, hidden, heads = DIT_SIZES[size]
    return depth, hidden, heads, int(patch)


def build_dit(arch: str, input_size: int, in_channels: int, num_classes: int,
              routing: Optional[Mapping[str, Any]] = None, cls: type = DiT, **overrides: Any) -> DiT:
    """Build a named DiT size, e.g. `DiT-XL/2`; `overrides` replace any DiT argument (or are `cls`'s own: a
    DiT subclass such as tread.models.sprint.SprintDiT)."""
    depth, hidden, heads, patch = parse_arch(arch)
    kwargs = dict(input_size=input_size, patch_size=patch, in_channels=in_channels, hidden_size=hidden,
                  depth=depth, num_heads=heads, num_classes=num_classes, routing=routing)
    kwargs.update({k: v for k, v in overrides.items() if v is not None})
    return cls(**kwargs)
