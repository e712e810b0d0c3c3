# WorldCereal/presto-worldcereal commit 5ea0fc2 ("Correct mean over sequences with masked tokens", in PR #11, after
# #12 "Allow sequences with a variable number of masked tokens in a batch"): Presto's Encoder drops each pixel's
# masked tokens (missing / cloudy band groups, missing DynamicWorld), moves the kept ones to the front, cuts the batch
# to the longest kept length and marks the tail with `upd_mask`; attention gets `~upd_mask` as its key mask. For the
# eval embedding the encoder then returned `self.norm(x.mean(dim=1))`, averaging the padded tail slots too, so a
# pixel's embedding depended on how many tokens the other pixels in its batch kept. The fix zeroes the masked slots
# and divides by the number of kept tokens.
# Ported from src/presto.py (Attention, Block, Encoder.mask_tokens / forward) and src/dataops.py (band groups) at
# 5ea0fc2^, tiny sizes, CPU; the eval loop of src/eval.py feeds the embeddings to a fixed linear head.
import math
import sys
from collections import OrderedDict
from typing import Optional, Union, cast

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
device = torch.device("cpu")

S1_BANDS = ["VV", "VH"]
S2_BANDS = ["B1", "B2", "B3", "B4", "B5", "B6", "B7", "B8", "B8A", "B9", "B10", "B11", "B12"]
ERA5_BANDS = ["temperature_2m", "total_precipitation"]
SRTM_BANDS = ["elevation", "slope"]
DYNAMIC_BANDS = S1_BANDS + S2_BANDS + ERA5_BANDS
STATIC_BANDS = SRTM_BANDS
REMOVED_BANDS = ["B1", "B10"]
BANDS = [x for x in DYNAMIC_BANDS if x not in REMOVED_BANDS] + STATIC_BANDS + ["NDVI"]
NUM_TIMESTEPS = 12
NORMED_BANDS = [x for x in BANDS if x != "B9"]
NUM_BANDS = len(NORMED_BANDS)
BANDS_GROUPS_IDX = OrderedDict(
    {
        "S1": [NORMED_BANDS.index(b) for b in S1_BANDS],
        "S2_RGB": [NORMED_BANDS.index(b) for b in ["B2", "B3", "B4"]],
        "S2_Red_Edge": [NORMED_BANDS.index(b) for b in ["B5", "B6", "B7"]],
        "S2_NIR_10m": [NORMED_BANDS.index(b) for b in ["B8"]],
        "S2_NIR_20m": [NORMED_BANDS.index(b) for b in ["B8A"]],
        "S2_SWIR": [NORMED_BANDS.index(b) for b in ["B11", "B12"]],
        "ERA5": [NORMED_BANDS.index(b) for b in ERA5_BANDS],
        "SRTM": [NORMED_BANDS.index(b) for b in SRTM_BANDS],
        "NDVI": [NORMED_BANDS.index("NDVI")],
    }
)


class DynamicWorld2020_2021:
    class_amount = 9


class Attention(nn.Module):
    # https://github.com/huggingface/pytorch-image-models/blob/main/timm/models/vision_transformer.py
    def __init__(self, dim, num_heads=8, qkv_bias=False, qk_norm=False, attn_drop=0.0, proj_drop=0.0, norm_layer=nn.LayerNorm):
        super().__init__()
        assert dim % num_heads == 0, "dim should be divisible by num_heads"
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fast_attn = hasattr(torch.nn.functional, "scaled_dot_product_attention")  # FIXME

        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, attn_mask=None):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)

        if self.fast_attn:
            if attn_mask is not None:
                # todo check
                attn_mask = attn_mask[:, None, None].repeat((1, self.num_heads, N, 1))
            x = F.scaled_dot_product_attention(
                q,
                k,
                v,
                # a value of True indicates that the element should take part in attention
                attn_mask=attn_mask,
                dropout_p=self.attn_drop.p,
            )
        else:
            if attn_mask is not None:
                raise NotImplementedError
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v

        x = x.transpose(1, 2).reshape(B, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


class Mlp(nn.Module):
    def __init__(self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, bias=True, drop=0.0):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    def __init__(self, dim, num_heads, mlp_ratio=4.0, qkv_bias=False, qk_norm=False, drop=0.0, attn_drop=0.0, norm_layer=nn.LayerNorm):
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads=num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, attn_drop=attn_drop, proj_drop=drop, norm_layer=norm_layer)
        self.ls1 = nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(in_features=dim, hidden_features=int(dim * mlp_ratio), drop=drop)
        self.ls2 = nn.Identity()

    def forward(self, x, attn_mask=None):
        x = x + self.ls1(self.attn(self.norm1(x), attn_mask))
        x = x + self.ls2(self.mlp(self.norm2(x)))
        return x


def get_sinusoid_encoding_table(positions, d_hid, T=1000):
    if isinstance(positions, int):
        positions = list(range(positions))

    def cal_angle(position, hid_idx):
        return position / np.power(T, 2 * (hid_idx // 2) / d_hid)

    def get_posi_angle_vec(position):
        return [cal_angle(position, hid_j) for hid_j in range(d_hid)]

    sinusoid_table = np.array([get_posi_angle_vec(pos_i) for pos_i in positions])
    sinusoid_table[:, 0::2] = np.sin(sinusoid_table[:, 0::2])  # dim 2i
    sinusoid_table[:, 1::2] = np.cos(sinusoid_table[:, 1::2])  # dim 2i+1
    return torch.FloatTensor(sinusoid_table)


def get_month_encoding_table(d_hid):
    assert d_hid % 2 == 0
    angles = np.arange(0, 13) / (12 / (2 * np.pi))
    sin_table = np.sin(np.stack([angles for _ in range(d_hid // 2)], axis=-1))
    cos_table = np.cos(np.stack([angles for _ in range(d_hid // 2)], axis=-1))
    month_table = np.concatenate([sin_table[:-1], cos_table[:-1]], axis=-1)
    return torch.FloatTensor(month_table)


def month_to_tensor(month: Union[torch.Tensor, int], batch_size: int, seq_len: int, device: torch.device):
    if isinstance(month, int):
        assert cast(int, month) < 12
    else:
        assert max(cast(torch.Tensor, month.flatten())) < 12

    if isinstance(month, int):
        month = torch.fmod(torch.arange(month, month + seq_len, dtype=torch.long), 12).expand(batch_size, seq_len).to(device)
    elif len(month.shape) == 1:
        month = torch.stack([torch.fmod(torch.arange(m, m + seq_len, dtype=torch.long), 12) for m in month]).to(device)
    return month


def repeat_bt(t, b):
    return t.expand(b, *t.shape[1:])


class Encoder(nn.Module):
    def __init__(self, embedding_size: int = 128, channel_embed_ratio: float = 0.25, month_embed_ratio: float = 0.25,
                 depth=2, mlp_ratio=2, num_heads=8, max_sequence_length=24):
        super().__init__()

        self.band_groups = BANDS_GROUPS_IDX
        self.embedding_size = embedding_size

        self.band_group_to_idx = {group_name: idx for idx, (group_name, _) in enumerate(self.band_groups.items())}
        self.band_group_to_idx["dynamic_world"] = max(self.band_group_to_idx.values()) + 1

        self.eo_patch_embed = nn.ModuleDict(
            {group_name: nn.Linear(len(group), embedding_size) for group_name, group in self.band_groups.items()}
        )
        self.dw_embed = nn.Embedding(num_embeddings=DynamicWorld2020_2021.class_amount + 1, embedding_dim=embedding_size)
        self.latlon_embed = nn.Linear(3, embedding_size)

        self.blocks = nn.ModuleList(
            [Block(embedding_size, num_heads, mlp_ratio, qkv_bias=True, norm_layer=nn.LayerNorm) for _ in range(depth)]
        )
        self.norm = nn.LayerNorm(embedding_size)

        self.max_sequence_length = max_sequence_length
        pos_embedding_size = int(embedding_size * (1 - (channel_embed_ratio + month_embed_ratio)))
        channel_embedding_size = int(embedding_size * channel_embed_ratio)
        month_embedding_size = int(embedding_size * month_embed_ratio)
        self.pos_embed = nn.Parameter(torch.zeros(1, max_sequence_length, pos_embedding_size), requires_grad=False)
        month_tab = get_month_encoding_table(month_embedding_size)
        self.month_embed = nn.Embedding.from_pretrained(month_tab, freeze=True)
        self.channel_embed = nn.Embedding(num_embeddings=len(self.band_groups) + 1, embedding_dim=channel_embedding_size)

        self.initialize_weights()

    def initialize_weights(self):
        pos_embed = get_sinusoid_encoding_table(self.pos_embed.shape[1], self.pos_embed.shape[-1])
        self.pos_embed.data.copy_(pos_embed)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            torch.nn.init.xavier_uniform_(m.weight)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    @staticmethod
    def cartesian(latlons: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            latlon_radians = latlons * math.pi / 180
            lats, lons = latlon_radians[:, 0], latlon_radians[:, 1]
            x = torch.cos(lats) * torch.cos(lons)
            y = torch.cos(lats) * torch.sin(lons)
            z = torch.sin(lats)
        return torch.stack([x, y, z], dim=-1)

    @staticmethod
    def mask_tokens(x, mask):
        mask = mask.bool()

        # https://stackoverflow.com/a/68621610/2332296
        # move all non-masked values to the front of their rows
        sorted_mask, indices = torch.sort((~mask).int(), dim=1, descending=True, stable=True)
        x = x.gather(1, indices[:, :, None].expand_as(x))
        # set masked values to 0 (not really necessary since we'll ignore them anyway)
        x = x * sorted_mask.unsqueeze(-1)

        # cut off to the length of the longest sequence
        max_length = sorted_mask.sum(-1).max()
        x = x[:, :max_length]
        updated_mask = 1 - sorted_mask[:, :max_length]

        return x, indices, updated_mask

    def forward(self, x: torch.Tensor, dynamic_world: torch.Tensor, latlons: torch.Tensor,
                mask: Optional[torch.Tensor] = None, month: Union[torch.Tensor, int] = 0, eval_task: bool = True):
        device = x.device

        if mask is None:
            mask = torch.zeros_like(x, device=x.device)

        months = month_to_tensor(month, x.shape[0], x.shape[1], device)
        month_embedding = self.month_embed(months)
        positional_embedding = repeat_bt(self.pos_embed[:, : x.shape[1], :], x.shape[0])

        all_tokens, all_masks = [], []

        for channel_group, channel_idxs in self.band_groups.items():
            tokens = self.eo_patch_embed[channel_group](x[:, :, channel_idxs])
            channel_embedding = self.channel_embed(torch.tensor(self.band_group_to_idx[channel_group]).long().to(device))
            channel_embedding = channel_embedding.expand(x.shape[0], x.shape[1], -1)
            if channel_group == "SRTM":
                # for SRTM, we reduce it to a single token instead of a token per timestep
                channel_wise_positional_embedding = torch.cat(
                    (
                        torch.zeros_like(month_embedding[:, 0:1]),
                        channel_embedding[:, 0:1],
                        torch.zeros_like(positional_embedding[:, 0:1]),
                    ),
                    dim=-1,
                )
                indices = slice(0, 1)
            else:
                channel_wise_positional_embedding = torch.cat((month_embedding, channel_embedding, positional_embedding), dim=-1)
                indices = slice(None)

            tokens = tokens[:, indices]
            tokens += channel_wise_positional_embedding
            all_tokens.append(tokens)
            group_mask = torch.max(mask[:, indices, channel_idxs], dim=-1)[0]
            all_masks.append(group_mask)

        # then, dynamic world
        tokens = self.dw_embed(dynamic_world)
        channel_embedding = self.channel_embed(torch.tensor(self.band_group_to_idx["dynamic_world"]).long().to(device))
        channel_embedding = channel_embedding.expand(x.shape[0], x.shape[1], -1)
        positional_embedding = torch.cat((month_embedding, channel_embedding, positional_embedding), dim=-1)
        tokens += positional_embedding
        all_tokens.append(tokens)

        # now we calculate the mask for these [b, t] tokens
        group_mask = dynamic_world == DynamicWorld2020_2021.class_amount
        all_masks.append(group_mask)

        x = torch.cat(all_tokens, dim=1)  # [batch, timesteps, embedding_dim]
        mask = torch.cat(all_masks, dim=1)  # [batch, timesteps]
        x, orig_indices, upd_mask = self.mask_tokens(x, mask)

        # append latlon tokens
        latlon_tokens = self.latlon_embed(self.cartesian(latlons)).unsqueeze(1)
        x = torch.cat((latlon_tokens, x), dim=1)
        upd_mask = torch.cat((torch.zeros(x.shape[0])[:, None].to(device), upd_mask), dim=1)
        orig_indices = torch.cat((torch.zeros(x.shape[0])[:, None].to(device).int(), orig_indices + 1), dim=1)

        # apply Transformer blocks
        for blk in self.blocks:
            x = blk(x, attn_mask=~upd_mask.bool())

        # mask will be a boolean of shape [batch, total_num_tokens]
        if eval_task:
            if FIXED:
                # set masked tokens to 0
                x_for_mean = x * (1 - upd_mask.unsqueeze(-1))
                x_mean = x_for_mean.sum(dim=1) / torch.sum(1 - upd_mask, -1, keepdim=True)
                return self.norm(x_mean)
            return self.norm(x.mean(dim=1))
        return self.norm(x), orig_indices, upd_mask


def main():
    torch.manual_seed(0)
    encoder = Encoder(embedding_size=16, depth=2, mlp_ratio=2, num_heads=2, max_sequence_length=NUM_TIMESTEPS)
    head = nn.Linear(16, 1)
    encoder.eval()

    b = 3
    x = torch.rand(b, NUM_TIMESTEPS, NUM_BANDS)
    dw = torch.randint(0, DynamicWorld2020_2021.class_amount, (b, NUM_TIMESTEPS))
    latlons = torch.tensor([[50.8, 4.3], [51.0, 3.7], [50.4, 5.1]])
    month = torch.tensor([0, 3, 6])

    # variable mask per pixel (1 = value missing): pixel 0 fully observed; pixel 1 lost its S2 bands for six
    # cloudy months; pixel 2 has no DynamicWorld label for half the year
    variable_mask = torch.zeros(b, NUM_TIMESTEPS, NUM_BANDS)
    s2_idx = [NORMED_BANDS.index(band) for band in S2_BANDS if band in NORMED_BANDS]
    for t in range(3, 9):
        variable_mask[1, t, s2_idx] = 1
    dw[2, :6] = DynamicWorld2020_2021.class_amount

    with torch.no_grad():
        encodings = encoder(x, dynamic_world=dw.long(), mask=variable_mask, latlons=latlons, month=month)
        crop_logit = head(encodings).squeeze(-1)

    print("embedding[:, :4]:", [[round(v, 4) for v in row] for row in encodings[:, :4].tolist()])
    print("crop logits:", [round(v, 4) for v in crop_logit.tolist()])


if __name__ == "__main__":
    main()
