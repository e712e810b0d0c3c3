"""Hiera (facebookresearch/hiera), video: MAE-style dropping of whole mask units
before the encoder, and mask unit (windowed) attention in the first two stages,
global attention after.

Ported from facebookresearch/hiera @b12b842542ee5c757fcfec8c41f6b56fcbe89b65:
  hiera/hiera.py        MaskUnitAttention (windows by reshape into
                        num_windows = N // (q_stride * window_size), SDPA, no
                        mask tensor; q max-pooling), HieraBlock, PatchEmbed,
                        Hiera.__init__ (window_size per stage, q_pool blocks),
                        Hiera.get_random_mask (1 = keep, per mask unit),
                        Hiera.forward (masked conv, unroll, discard masked
                        tokens with mask[..., None].tile(1, mu_size, C))
  hiera/hiera_utils.py  do_pool, get_resized_mask, do_masked_conv, Unroll,
                        Reroll (mask given -> [B, #MUs, MUt, MUy, MUx, C])
  timm Mlp as used by HieraBlock.
A tiny hiera_base_16x224-style video model (input (4, 32, 32), patch stride
(2, 4, 4), q_stride (1, 2, 2), mask unit (1, 4, 4), stages (1, 2, 1)), random
weights, CPU.

Checked against an unmasked run of the whole clip (its dropped mask units'
pixels zeroed, as do_masked_conv does): in the mask-unit-attention stages the
kept units' features, rerolled to space, must equal the full run's features
cut out at those units; the global stage's output must equal the full run's
stage-1 tokens gathered at the kept units and pushed through the global blocks;
and each clip run alone (batch of one, its own mask) must give its row.
"""
import math
from functools import partial
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class Mlp(nn.Module):
    """timm.layers.Mlp as HieraBlock builds it."""

    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.drop1(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.norm(x)))


def conv_nd(n: int):
    return [nn.Identity, nn.Conv1d, nn.Conv2d, nn.Conv3d][n]


def do_pool(x: torch.Tensor, stride: int) -> torch.Tensor:
    # Refer to `Unroll` to see how this performs a maxpool-Nd
    return x.view(x.shape[0], stride, -1, x.shape[-1]).max(dim=1).values


def get_resized_mask(target_size: torch.Size, mask: torch.Tensor) -> torch.Tensor:
    if mask is None:
        return mask
    assert len(mask.shape[2:]) == len(target_size)
    if mask.shape[2:] != target_size:
        return F.interpolate(mask.float(), size=target_size)
    return mask


def do_masked_conv(x: torch.Tensor, conv: nn.Module, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Zero-out the masked regions of the input before conv."""
    if conv is None:
        return x
    if mask is None:
        return conv(x)
    mask = get_resized_mask(target_size=x.shape[2:], mask=mask)
    return conv(x * mask.bool())


def undo_windowing(x: torch.Tensor, shape: List[int], mu_shape: List[int]) -> torch.Tensor:
    D = len(shape)
    B, C = x.shape[0], x.shape[-1]
    num_MUs = [s // mu for s, mu in zip(shape, mu_shape)]
    x = x.view(B, *num_MUs, *mu_shape, C)
    permute = (
        [0]
        + sum([list(p) for p in zip(range(1, 1 + D), range(1 + D, 1 + 2 * D))], [])
        + [len(x.shape) - 1]
    )
    x = x.permute(permute).reshape(B, *shape, C)
    return x


class Unroll(nn.Module):
    def __init__(self, input_size, patch_stride, unroll_schedule):
        super().__init__()
        self.size = [i // s for i, s in zip(input_size, patch_stride)]
        self.schedule = unroll_schedule

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, _, C = x.shape
        cur_size = self.size
        x = x.view(*([B] + cur_size + [C]))
        for strides in self.schedule:
            cur_size = [i // s for i, s in zip(cur_size, strides)]
            new_shape = [B] + sum([[i, s] for i, s in zip(cur_size, strides)], []) + [C]
            x = x.view(new_shape)
            L = len(new_shape)
            permute = [0] + list(range(2, L - 1, 2)) + list(range(1, L - 1, 2)) + [L - 1]
            x = x.permute(permute)
            x = x.flatten(0, len(strides))
            B *= math.prod(strides)
        x = x.reshape(-1, math.prod(self.size), C)
        return x


class Reroll(nn.Module):
    def __init__(self, input_size, patch_stride, unroll_schedule, stage_ends, q_pool):
        super().__init__()
        self.size = [i // s for i, s in zip(input_size, patch_stride)]
        self.schedule = {}
        size = self.size
        for i in range(stage_ends[-1] + 1):
            self.schedule[i] = unroll_schedule, size
            if i in stage_ends[:q_pool]:
                if len(unroll_schedule) > 0:
                    size = [n // s for n, s in zip(size, unroll_schedule[0])]
                unroll_schedule = unroll_schedule[1:]

    def forward(self, x: torch.Tensor, block_idx: int, mask: torch.Tensor = None) -> torch.Tensor:
        schedule, size = self.schedule[block_idx]
        B, N, C = x.shape
        D = len(size)
        cur_mu_shape = [1] * D
        for strides in schedule:
            x = x.view(B, *strides, N // math.prod(strides), *cur_mu_shape, C)
            L = len(x.shape)
            permute = (
                [0, 1 + D]
                + sum([list(p) for p in zip(range(1, 1 + D), range(1 + D + 1, L - 1))], [])
                + [L - 1]
            )
            x = x.permute(permute)
            for i in range(D):
                cur_mu_shape[i] *= strides[i]
            x = x.reshape(B, -1, *cur_mu_shape, C)
            N = x.shape[1]
        x = x.view(B, N, *cur_mu_shape, C)
        if mask is not None:
            return x
        x = undo_windowing(x, size, cur_mu_shape)
        return x


class MaskUnitAttention(nn.Module):
    def __init__(self, dim, dim_out, heads, q_stride=1, window_size=0, use_mask_unit_attn=False):
        super().__init__()
        self.dim = dim
        self.dim_out = dim_out
        self.heads = heads
        self.q_stride = q_stride
        self.head_dim = dim_out // heads
        self.scale = (self.head_dim) ** -0.5
        self.qkv = nn.Linear(dim, 3 * dim_out)
        self.proj = nn.Linear(dim_out, dim_out)
        self.window_size = window_size
        self.use_mask_unit_attn = use_mask_unit_attn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """ Input should be of shape [batch, tokens, channels]. """
        B, N, _ = x.shape
        num_windows = (N // (self.q_stride * self.window_size)) if self.use_mask_unit_attn else 1

        qkv = self.qkv(x).reshape(B, -1, num_windows, 3, self.heads, self.head_dim).permute(3, 0, 4, 2, 1, 5)
        q, k, v = qkv[0], qkv[1], qkv[2]

        if self.q_stride > 1:
            # Refer to Unroll to see how this performs a maxpool-Nd
            q = q.view(B, self.heads, num_windows, self.q_stride, -1, self.head_dim).max(dim=3).values

        if hasattr(F, "scaled_dot_product_attention"):
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            attn = (q * self.scale) @ k.transpose(-1, -2)
            attn = attn.softmax(dim=-1)
            x = attn @ v

        x = x.transpose(1, 3).reshape(B, -1, self.dim_out)
        x = self.proj(x)
        return x


class HieraBlock(nn.Module):
    def __init__(self, dim, dim_out, heads, mlp_ratio=4.0, drop_path=0.0, norm_layer=nn.LayerNorm,
                 act_layer=nn.GELU, q_stride=1, window_size=0, use_mask_unit_attn=False):
        super().__init__()
        self.dim = dim
        self.dim_out = dim_out
        self.norm1 = norm_layer(dim)
        self.attn = MaskUnitAttention(dim, dim_out, heads, q_stride, window_size, use_mask_unit_attn)
        self.norm2 = norm_layer(dim_out)
        self.mlp = Mlp(dim_out, int(dim_out * mlp_ratio), act_layer=act_layer)
        self.drop_path = nn.Identity()
        if dim != dim_out:
            self.proj = nn.Linear(dim, dim_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_norm = self.norm1(x)
        if self.dim != self.dim_out:
            x = do_pool(self.proj(x_norm), stride=self.attn.q_stride)
        x = x + self.drop_path(self.attn(x_norm))
        x = x + self.drop_path(self.mlp(self.norm2(x)))
        return x


class PatchEmbed(nn.Module):
    def __init__(self, dim_in, dim_out, kernel, stride, padding):
        super().__init__()
        self.spatial_dims = len(kernel)
        self.proj = conv_nd(self.spatial_dims)(dim_in, dim_out, kernel_size=kernel, stride=stride, padding=padding)

    def forward(self, x, mask=None):
        x = do_masked_conv(x, self.proj, mask)
        x = x.reshape(x.shape[0], x.shape[1], -1).transpose(2, 1)
        return x


class Hiera(nn.Module):
    def __init__(
        self,
        input_size: Tuple[int, ...] = (224, 224),
        in_chans: int = 3,
        embed_dim: int = 96,
        num_heads: int = 1,
        stages: Tuple[int, ...] = (2, 3, 16, 3),
        q_pool: int = 3,
        q_stride: Tuple[int, ...] = (2, 2),
        mask_unit_size: Tuple[int, ...] = (8, 8),
        mask_unit_attn: Tuple[bool, ...] = (True, True, False, False),
        dim_mul: float = 2.0,
        head_mul: float = 2.0,
        patch_kernel: Tuple[int, ...] = (7, 7),
        patch_stride: Tuple[int, ...] = (4, 4),
        patch_padding: Tuple[int, ...] = (3, 3),
        mlp_ratio: float = 4.0,
        sep_pos_embed: bool = False,
    ):
        super().__init__()
        norm_layer = partial(nn.LayerNorm, eps=1e-6)
        depth = sum(stages)
        self.patch_stride = patch_stride
        self.tokens_spatial_shape = [i // s for i, s in zip(input_size, patch_stride)]
        num_tokens = math.prod(self.tokens_spatial_shape)
        flat_mu_size = math.prod(mask_unit_size)
        flat_q_stride = math.prod(q_stride)

        assert q_pool < len(stages)
        self.q_pool, self.q_stride = q_pool, q_stride
        self.mu_size, self.mask_unit_size = flat_mu_size, mask_unit_size
        self.mask_spatial_shape = [i // s for i, s in zip(self.tokens_spatial_shape, self.mask_unit_size)]
        self.stage_ends = [sum(stages[:i]) - 1 for i in range(1, len(stages) + 1)]

        self.patch_embed = PatchEmbed(in_chans, embed_dim, patch_kernel, patch_stride, patch_padding)

        self.sep_pos_embed = sep_pos_embed
        if sep_pos_embed:
            self.pos_embed_spatial = nn.Parameter(
                torch.zeros(1, self.tokens_spatial_shape[1] * self.tokens_spatial_shape[2], embed_dim)
            )
            self.pos_embed_temporal = nn.Parameter(torch.zeros(1, self.tokens_spatial_shape[0], embed_dim))
        else:
            self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, embed_dim))

        self.unroll = Unroll(input_size, patch_stride, [q_stride] * len(self.stage_ends[:-1]))
        self.reroll = Reroll(input_size, patch_stride, [q_stride] * len(self.stage_ends[:-1]), self.stage_ends, q_pool)
        q_pool_blocks = [x + 1 for x in self.stage_ends[:q_pool]]

        cur_stage = 0
        self.blocks = nn.ModuleList()
        for i in range(depth):
            dim_out = embed_dim
            use_mask_unit_attn = mask_unit_attn[cur_stage]
            if i - 1 in self.stage_ends:
                dim_out = int(embed_dim * dim_mul)
                num_heads = int(num_heads * head_mul)
                cur_stage += 1
                if i in q_pool_blocks:
                    flat_mu_size //= flat_q_stride
            block = HieraBlock(
                dim=embed_dim, dim_out=dim_out, heads=num_heads, mlp_ratio=mlp_ratio, norm_layer=norm_layer,
                q_stride=(flat_q_stride if i in q_pool_blocks else 1), window_size=flat_mu_size,
                use_mask_unit_attn=use_mask_unit_attn,
            )
            embed_dim = dim_out
            self.blocks.append(block)
        self.norm = norm_layer(embed_dim)

        if sep_pos_embed:
            nn.init.trunc_normal_(self.pos_embed_spatial, std=0.02)
            nn.init.trunc_normal_(self.pos_embed_temporal, std=0.02)
        else:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)

    def get_random_mask(self, x: torch.Tensor, mask_ratio: float) -> torch.Tensor:
        """1 is *keep*, 0 is *remove*."""
        B = x.shape[0]
        num_windows = math.prod(self.mask_spatial_shape)  # num_mask_units
        len_keep = int(num_windows * (1 - mask_ratio))
        noise = torch.rand(B, num_windows, device=x.device)
        ids_shuffle = torch.argsort(noise, dim=1)
        ids_restore = torch.argsort(ids_shuffle, dim=1)
        mask = torch.zeros([B, num_windows], device=x.device)
        mask[:, :len_keep] = 1
        mask = torch.gather(mask, dim=1, index=ids_restore)
        return mask.bool()

    def get_pos_embed(self) -> torch.Tensor:
        if self.sep_pos_embed:
            return self.pos_embed_spatial.repeat(1, self.tokens_spatial_shape[0], 1) + torch.repeat_interleave(
                self.pos_embed_temporal, self.tokens_spatial_shape[1] * self.tokens_spatial_shape[2], dim=1
            )
        return self.pos_embed

    def forward(self, x: torch.Tensor, mask: torch.Tensor = None, return_intermediates: bool = False):
        """mask: [B, #MUt*#MUy*#MUx], 1 is *keep*; mask.sum(dim=-1) equal across the batch."""
        intermediates = []
        x = self.patch_embed(
            x, mask=mask.view(x.shape[0], 1, *self.mask_spatial_shape) if mask is not None else None
        )
        x = x + self.get_pos_embed()
        x = self.unroll(x)

        # Discard masked tokens
        if mask is not None:
            x = x[mask[..., None].tile(1, self.mu_size, x.shape[2])].view(x.shape[0], -1, x.shape[-1])

        for i, blk in enumerate(self.blocks):
            x = blk(x)
            if return_intermediates and i in self.stage_ends:
                intermediates.append(self.reroll(x, i, mask=mask))

        if mask is None:
            x = x.mean(dim=1)
            x = self.norm(x)

        if return_intermediates:
            return x, intermediates
        return x


model = Hiera(
    input_size=(4, 32, 32), embed_dim=16, num_heads=1, stages=(1, 2, 1), q_pool=2,
    q_stride=(1, 2, 2), mask_unit_size=(1, 4, 4), mask_unit_attn=(True, True, False),
    patch_kernel=(3, 7, 7), patch_stride=(2, 4, 4), patch_padding=(1, 3, 3), sep_pos_embed=True,
).eval()

B = 3
video = torch.randn(B, 3, 4, 32, 32)
mask = model.get_random_mask(video, mask_ratio=0.5)  # 4 of 8 mask units kept per clip
assert mask.sum(-1).tolist() == [4] * B
ATOL = 1e-5

with torch.no_grad():
    out, inter = model(video, mask=mask, return_intermediates=True)

    # reference 1: the whole clip, unmasked, with the dropped units' pixels zeroed
    pix_keep = get_resized_mask(video.shape[2:], mask.view(B, 1, *model.mask_spatial_shape)).bool()
    captured = {}
    last_mu_block = model.stage_ends[1]
    hook = model.blocks[last_mu_block].register_forward_hook(lambda m, a, o: captured.__setitem__("x", o))
    _, full_inter = model(video * pix_keep, mask=None, return_intermediates=True)
    hook.remove()

    mt, my, mx = model.mask_spatial_shape
    for stage in (0, 1):
        got = inter[stage]  # [B, #kept MUs, MUt, MUy, MUx, C]
        full = full_inter[stage]  # [B, T, H, W, C]
        ut, uy, ux = got.shape[2:5]
        assert full.shape[1:4] == (mt * ut, my * uy, mx * ux)
        for b in range(B):
            kept_units = mask[b].nonzero().flatten().tolist()
            assert got.shape[1] == len(kept_units)
            for j, u in enumerate(kept_units):
                t, y, xx = u // (my * mx), (u // mx) % my, u % mx
                cut = full[b, t * ut:(t + 1) * ut, y * uy:(y + 1) * uy, xx * ux:(xx + 1) * ux]
                assert torch.allclose(got[b, j], cut, atol=ATOL), (stage, b, u)

    # reference 2: the global stage over the full run's stage-1 tokens at the kept units
    x_full = captured["x"]  # unrolled, mask unit index innermost
    per_mu = x_full.shape[1] // math.prod(model.mask_spatial_shape)
    x_kept = x_full[mask[..., None].tile(1, per_mu, x_full.shape[2])].view(B, -1, x_full.shape[-1])
    for blk in model.blocks[last_mu_block + 1:]:
        x_kept = blk(x_kept)
    assert torch.allclose(out, x_kept, atol=ATOL)

    # reference 3: each clip alone with its own mask
    for b in range(B):
        one, one_inter = model(video[b:b + 1], mask=mask[b:b + 1], return_intermediates=True)
        assert torch.allclose(out[b], one[0], atol=ATOL)
        for s in range(3):
            assert torch.allclose(inter[s][b], one_inter[s][0], atol=ATOL)

    # the unmasked classifier path stays usable on the same clips
    pooled = model(video)
    for b in range(B):
        assert torch.allclose(pooled[b], model(video[b:b + 1])[0], atol=ATOL)

print("ok: Hiera mask-unit dropping matches the full clip in the windowed stages and per clip overall")
