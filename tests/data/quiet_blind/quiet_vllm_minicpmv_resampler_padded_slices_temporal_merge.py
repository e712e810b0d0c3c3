"""Correct program (quiet batch quiet-r84a).

Ported from vllm-project/vllm vllm/model_executor/models/minicpmv.py @73fb7a47577a0f800c82355e0bb7f055fa748d17
(Resampler2_5.forward, Resampler4_5.forward with temporal_ids) and vllm/model_executor/layers/resampler.py
@298e4d79cb4f54cb5565e983402832bc0a420171 (BaseResampler, get_2d_sincos_pos_embed version (2, 5)).

MiniCPM-V's perceiver-style resampler: a fixed set of learned queries cross-attends (nn.MultiheadAttention,
sequence-first) the vision tower's patch features of each image slice. Slices have different patch grids
(tgt_sizes), so the batch is right-padded to the longest slice and `key_padding_mask[i, patch_len[i]:] = True`.
Resampler4_5 then merges the frames of a video (temporal_ids) into one key row per video, re-padding the
per-frame masks with True.  The program checks every image's / video's queries against a hand-written
per-item attention over only its real patches.
"""
from functools import partial
from itertools import chain

import numpy as np
import torch
from torch import nn
from torch.nn.init import trunc_normal_

DEFAULT_LN = partial(nn.LayerNorm, eps=1e-6)


def get_1d_sincos_pos_embed_from_grid(embed_dim, pos, version=(2, 0)):
    assert embed_dim % 2 == 0
    omega = np.arange(embed_dim // 2, dtype=np.float32)
    omega /= embed_dim / 2.0
    omega = 1.0 / 10000**omega
    if version == (2, 0):
        pos = pos.reshape(-1)
        out = np.einsum("m,d->md", pos, omega)
        emb = np.concatenate([np.sin(out), np.cos(out)], axis=1)
    else:
        out = np.einsum("hw,d->hwd", pos, omega)
        emb = np.concatenate([np.sin(out), np.cos(out)], axis=-1)
    return emb


def get_2d_sincos_pos_embed_from_grid(embed_dim, grid, version=(2, 0)):
    emb_h = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[0], version)
    emb_w = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, grid[1], version)
    if version == (2, 0):
        return np.concatenate([emb_h, emb_w], axis=1)
    return np.concatenate([emb_h, emb_w], axis=-1)


def get_2d_sincos_pos_embed(embed_dim, grid_size, cls_token=False, version=(2, 0)):
    if isinstance(grid_size, int):
        grid_h_size, grid_w_size = grid_size, grid_size
    else:
        grid_h_size, grid_w_size = grid_size[0], grid_size[1]
    grid_h = np.arange(grid_h_size, dtype=np.float32)
    grid_w = np.arange(grid_w_size, dtype=np.float32)
    grid = np.meshgrid(grid_w, grid_h)
    grid = np.stack(grid, axis=0)
    return get_2d_sincos_pos_embed_from_grid(embed_dim, grid, version)


class ReplicatedLinear(nn.Linear):
    """vLLM's ReplicatedLinear returns (output, bias)."""

    def forward(self, x):
        return super().forward(x), None


class BaseResampler(nn.Module):
    def __init__(self, num_queries, embed_dim, num_heads, kv_dim=None, norm_layer=DEFAULT_LN,
                 do_post_projection=True):
        super().__init__()
        self.num_queries = num_queries
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.query = nn.Parameter(torch.zeros(self.num_queries, embed_dim))
        trunc_normal_(self.query, std=0.02)
        if kv_dim is not None and kv_dim != embed_dim:
            self.kv_proj = ReplicatedLinear(kv_dim, embed_dim, bias=False)
        else:
            self.kv_proj = lambda *args, **kwargs: (nn.Identity()(*args, **kwargs), None)
        self.attn = nn.MultiheadAttention(embed_dim, num_heads)
        self.ln_q = norm_layer(embed_dim)
        self.ln_kv = norm_layer(embed_dim)
        self.do_post_projection = do_post_projection
        self.ln_post = norm_layer(embed_dim) if do_post_projection else None
        self.proj = nn.Parameter((embed_dim**-0.5) * torch.randn(embed_dim, embed_dim)) if do_post_projection else None

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            trunc_normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.constant_(m.bias, 0)
        elif isinstance(m, nn.LayerNorm):
            nn.init.constant_(m.bias, 0)
            nn.init.constant_(m.weight, 1.0)

    def _repeat(self, query, N):
        return query.unsqueeze(1).repeat(1, N, 1)


class Resampler2_5(BaseResampler):
    def __init__(self, num_queries, embed_dim, num_heads, kv_dim=None, norm_layer=DEFAULT_LN, max_size=(70, 70)):
        super().__init__(num_queries, embed_dim, num_heads, kv_dim, norm_layer)
        self.max_size = max_size
        self._set_2d_pos_cache(self.max_size)

    def _set_2d_pos_cache(self, max_size, device="cpu"):
        pos_embed_arr = get_2d_sincos_pos_embed(self.embed_dim, max_size, version=(2, 5))
        pos_embed = torch.from_numpy(pos_embed_arr).float().to(device)
        self.register_buffer("pos_embed", pos_embed, persistent=False)

    def _adjust_pos_cache(self, tgt_sizes, device):
        max_h = tgt_sizes[:, 0].max().item()
        max_w = tgt_sizes[:, 1].max().item()
        if max_h > self.max_size[0] or max_w > self.max_size[1]:
            self.max_size = (max(max_h, self.max_size[0]), max(max_w, self.max_size[1]))
            self._set_2d_pos_cache(self.max_size, device)

    def forward(self, x, tgt_sizes):
        assert x.shape[0] == tgt_sizes.shape[0]
        bs = x.shape[0]
        device = x.device
        dtype = x.dtype

        patch_len = tgt_sizes[:, 0] * tgt_sizes[:, 1]
        self._adjust_pos_cache(tgt_sizes, device=device)
        max_patch_len = patch_len.max().item()

        key_padding_mask = torch.zeros((bs, max_patch_len), dtype=torch.bool, device=device)

        pos_embed = []
        for i in range(bs):
            tgt_h, tgt_w = tgt_sizes[i].tolist()
            pos_embed.append(self.pos_embed[:tgt_h, :tgt_w, :].reshape((tgt_h * tgt_w, -1)).to(dtype))
            key_padding_mask[i, patch_len[i]:] = True
        pos_embed = torch.nn.utils.rnn.pad_sequence(pos_embed, batch_first=True, padding_value=0.0).permute(1, 0, 2)
        x, _ = self.kv_proj(x)  # B * L * D
        x = self.ln_kv(x).permute(1, 0, 2)  # L * B * D

        q = self.ln_q(self.query)  # Q * D

        out = self.attn(
            self._repeat(q, bs),  # Q * B * D
            x + pos_embed,
            x,
            key_padding_mask=key_padding_mask,
        )[0]
        x = out.permute(1, 0, 2)  # B * Q * D
        x = self.ln_post(x)
        x = x @ self.proj
        return x


class Resampler4_5(Resampler2_5):
    def __init__(self, num_queries, embed_dim, num_heads, kv_dim=None, norm_layer=DEFAULT_LN, max_size=(70, 70),
                 max_temporal_size=36000):
        super().__init__(num_queries, embed_dim, num_heads, kv_dim, norm_layer, max_size)
        trunc_normal_(self.query, std=0.02)
        self.max_temporal_size = max_temporal_size
        self._set_temporal_pos_cache(self.max_temporal_size)
        self.apply(self._init_weights)

    def get_1d_sincos_pos_embed_from_temporal_size(self, embed_dim, pos):
        omega = np.arange(embed_dim // 2, dtype=np.float32)
        omega /= embed_dim / 2.0
        omega = 1.0 / 10000**omega
        pos = pos.reshape(-1)
        out = np.einsum("m,d->md", pos, omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    def _set_temporal_pos_cache(self, max_temporal_size, device="cpu"):
        temporal_size = np.arange(max_temporal_size, dtype=np.float32)
        pos_embed = torch.from_numpy(
            self.get_1d_sincos_pos_embed_from_temporal_size(self.embed_dim, temporal_size)).float().to(device)
        self.register_buffer("temporal_pos_embed", pos_embed, persistent=False)

    def _adjust_temporal_pos_cache(self, max_temporal_size, device="cpu"):
        if max_temporal_size > self.max_temporal_size:
            self.max_temporal_size = max_temporal_size
            self._set_temporal_pos_cache(self.max_temporal_size, device)

    def forward(self, x, tgt_sizes, temporal_ids=None):
        assert x.shape[0] == tgt_sizes.shape[0]
        bs = x.shape[0]
        device = x.device
        dtype = x.dtype

        patch_len = tgt_sizes[:, 0] * tgt_sizes[:, 1]
        self._adjust_pos_cache(tgt_sizes, device=device)

        temporal_pos_emb = False
        temporal_ids_flatten = None
        if temporal_ids is not None:
            temporal_ids_flatten = list(chain.from_iterable(temporal_ids))
            max_temporal_size = max(temporal_ids_flatten, default=0)
            if max_temporal_size > -1:
                temporal_pos_emb = True
            if max_temporal_size > self.max_temporal_size:
                self._adjust_temporal_pos_cache(max_temporal_size, device)

        max_patch_len = patch_len.max().item()
        key_padding_mask = torch.zeros((bs, max_patch_len), dtype=torch.bool, device=device)

        x, _ = self.kv_proj(x)  # B * L * D
        x = self.ln_kv(x).permute(1, 0, 2)  # L * B * D
        q = self.ln_q(self.query)  # Q * D

        pos_embed_2d = []
        pos_embed_temporal = []
        for i in range(bs):
            tgt_h, tgt_w = tgt_sizes[i]
            if temporal_pos_emb:
                if temporal_ids_flatten[i] == -1:
                    pos_embed_temporal.append(torch.zeros(self.embed_dim, dtype=dtype, device=device))
                else:
                    pos_embed_temporal.append(self.temporal_pos_embed[temporal_ids_flatten[i]].to(dtype))
            pos_embed_2d.append(self.pos_embed[:tgt_h, :tgt_w, :].reshape((tgt_h * tgt_w, -1)).to(dtype))
            key_padding_mask[i, patch_len[i]:] = True

        pos_embed_2d = torch.nn.utils.rnn.pad_sequence(pos_embed_2d, batch_first=True, padding_value=0.0).permute(1, 0, 2)

        k = x
        v = x + pos_embed_2d
        if pos_embed_temporal:
            k += torch.stack(pos_embed_temporal, dim=0)
            bs = len(temporal_ids)
            merge_k = []
            merge_v = []
            merge_key_padding_mask = []

            start = 0
            for tp in temporal_ids:
                end = start + len(tp)
                merge_k.append(k[:, start:end, :].permute(1, 0, 2).reshape(-1, self.embed_dim))
                merge_v.append(v[:, start:end, :].permute(1, 0, 2).reshape(-1, self.embed_dim))
                merge_key_padding_mask.append(key_padding_mask[start:end, :].reshape(-1, 1))
                start = end

            k = torch.nn.utils.rnn.pad_sequence(merge_k, batch_first=True, padding_value=0.0).permute(1, 0, 2)
            v = torch.nn.utils.rnn.pad_sequence(merge_v, batch_first=True, padding_value=0.0).permute(1, 0, 2)
            key_padding_mask = torch.nn.utils.rnn.pad_sequence(
                merge_key_padding_mask, batch_first=True, padding_value=True).squeeze(-1)

        out = self.attn(
            self._repeat(q, bs),  # Q * B * D
            k,
            v,
            key_padding_mask=key_padding_mask,
        )[0]
        x = out.permute(1, 0, 2)  # B * Q * D
        x = self.ln_post(x)
        x = x @ self.proj
        return x


# ---------------------------------------------------------------- reference
def mha_reference(attn, q, k, v):
    """One item, no padding: q (Q, D), k / v (S, D) -> (Q, D), heads written out with loops."""
    D = attn.embed_dim
    H = attn.num_heads
    hd = D // H
    W, b = attn.in_proj_weight, attn.in_proj_bias
    qp = q @ W[:D].T + b[:D]
    kp = k @ W[D:2 * D].T + b[D:2 * D]
    vp = v @ W[2 * D:].T + b[2 * D:]
    out = torch.zeros(q.shape[0], D, dtype=torch.float64)
    for h in range(H):
        sl = slice(h * hd, (h + 1) * hd)
        for i in range(q.shape[0]):
            scores = torch.stack([(qp[i, sl] * kp[j, sl]).sum() / hd ** 0.5 for j in range(k.shape[0])])
            w = scores.softmax(-1)
            out[i, sl] = (w[:, None] * vp[:, sl]).sum(0)
    return attn.out_proj(out)


def reference_item(model, feats_list, sizes, tids):
    """feats_list: real patch features of each frame of one item (image: one frame)."""
    ks, vs = [], []
    for feats, (h, w), t in zip(feats_list, sizes, tids):
        xx = model.ln_kv(model.kv_proj(feats)[0])
        pos = model.pos_embed[:h, :w, :].reshape(h * w, -1).double()
        kk = xx.clone()
        if t is not None and t >= 0:
            kk = kk + model.temporal_pos_embed[t].double()
        if t is None:
            ks.append(xx + pos)  # Resampler2_5: key carries the 2-D position
            vs.append(xx)
        else:
            ks.append(kk)  # Resampler4_5: value carries the 2-D position
            vs.append(xx + pos)
    k = torch.cat(ks)
    v = torch.cat(vs)
    q = model.ln_q(model.query)
    out = mha_reference(model.attn, q, k, v)
    return model.ln_post(out) @ model.proj


def main():
    torch.manual_seed(0)
    kv_dim, embed_dim, heads, nq = 12, 16, 2, 4
    model = Resampler4_5(nq, embed_dim, heads, kv_dim=kv_dim, max_size=(4, 4)).double().eval()

    # slices from the vision tower, right-padded to the longest patch grid
    tgt_sizes = torch.tensor([[3, 4], [2, 2], [4, 5], [1, 3], [2, 3]])
    patch_len = (tgt_sizes[:, 0] * tgt_sizes[:, 1]).tolist()
    L = max(patch_len)
    real = [torch.randn(n, kv_dim, dtype=torch.float64) for n in patch_len]
    x = torch.zeros(len(real), L, kv_dim, dtype=torch.float64)
    for i, r in enumerate(real):
        x[i, :len(r)] = r
        x[i, len(r):] = 50.0 * torch.randn(L - len(r), kv_dim)  # junk where the slice is padded

    with torch.no_grad():
        # 1) images: one key row per slice (Resampler2_5's path)
        out_img = Resampler2_5.forward(model, x, tgt_sizes)
        for i in range(len(real)):
            ref = reference_item(model, [real[i]], [tgt_sizes[i].tolist()], [None])
            assert torch.allclose(out_img[i], ref, atol=1e-8), (i, (out_img[i] - ref).abs().max())

        # 2) an image (-1) and two videos whose frames merge into one key row each
        temporal_ids = [[-1], [0, 1, 2], [5]]
        out_vid = model(x, tgt_sizes, temporal_ids=temporal_ids)
        assert out_vid.shape == (3, nq, embed_dim)
        flat = list(chain.from_iterable(temporal_ids))
        start = 0
        for item, tp in enumerate(temporal_ids):
            idx = list(range(start, start + len(tp)))
            ref = reference_item(model, [real[j] for j in idx], [tgt_sizes[j].tolist() for j in idx],
                                 [flat[j] for j in idx])
            assert torch.allclose(out_vid[item], ref, atol=1e-8), (item, (out_vid[item] - ref).abs().max())
            start += len(tp)
    print("ok: resampled slices and merged videos match per-item attention over real patches")


if __name__ == "__main__":
    main()
