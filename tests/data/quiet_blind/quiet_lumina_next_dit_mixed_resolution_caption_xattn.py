"""Correct program: Lumina-Next's Next-DiT (Alpha-VLLM/Lumina-T2X) over a batch of images of
DIFFERENT resolutions, shrunk to tiny sizes.

Ported from Alpha-VLLM/Lumina-T2X @1ef2b6692a3056611714cbce53aa4729efd0e164,
lumina_next_t2i/models/model.py (NextDiT.patchify_and_embed, NextDiT.forward,
NextDiT.precompute_freqs_cis, TransformerBlock.forward, Attention.forward / _upad_input).

Masking, as in the project:
  * patchify_and_embed: each image is patchified on its own, the token sequences are
    right-padded with a learned `pad_token` up to the longest one, the 2-D RoPE table of a
    padded slot repeats the image's last entry, and `mask[i][:item_seq_len] = 1` (int32);
  * self-attention, fp16/bf16 path: `_upad_input` (indices / cu_seqlens from the int mask)
    and `flash_attn_varlen_func(causal=False)`, `pad_input` back (padded query rows -> 0);
    fp32 path: SDPA with `x_mask.bool().view(bsz, 1, 1, seqlen).expand(-1, heads, seqlen, -1)`;
  * cross-attention to the (right-padded) caption features: SDPA with the bool
    `y_mask.view(bsz, 1, 1, -1).expand(bsz, heads, seqlen, -1)`, scaled by tanh(gate);
  * caption pooling for adaLN: `(cap_feats * cap_mask).sum(1) / cap_mask.sum(1)`.
flash_attn_varlen_func / unpad_input / pad_input / index_first_axis are plain-torch stand-ins
with flash-attn's semantics.

Checked: each image run alone (unpadded, with its own unpadded caption, the 4-D tensor path)
gives the same output, in fp32 (SDPA path) and in bf16 (varlen path, looser tolerance).
"""
import math
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ------------------------------------------------------------------ flash-attn stand-ins
def index_first_axis(x, indices):
    return x[indices]


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    out = torch.zeros(batch * seqlen, *hidden_states.shape[1:], dtype=hidden_states.dtype)
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, causal=False, softmax_scale=None):
    """q: (total_q, H, D), k/v: (total_k, Hk, D). Each sequence attends only its own keys."""
    out = torch.empty_like(q)
    rep = q.shape[1] // k.shape[1]
    for i in range(cu_seqlens_q.numel() - 1):
        qs, qe = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        ks, ke = cu_seqlens_k[i].item(), cu_seqlens_k[i + 1].item()
        qi = q[qs:qe].transpose(0, 1).float()
        ki = k[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        vi = v[ks:ke].repeat_interleave(rep, dim=1).transpose(0, 1).float()
        s = (qi @ ki.transpose(-1, -2)) * softmax_scale
        if causal:
            lq, lk = qe - qs, ke - ks
            s = s.masked_fill(
                torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq).logical_not(), float("-inf")
            )
        out[qs:qe] = (s.softmax(-1) @ vi).transpose(0, 1).to(q.dtype)
    return out


# ------------------------------------------------------------------ model
class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim) + 0.1 * torch.randn(dim))

    def forward(self, x):
        out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return out.type_as(x) * self.weight


def modulate(x, shift, scale):
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=32):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)

    def forward(self, t):
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, qk_norm, y_dim):
        super().__init__()
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_local_heads = n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wk_y = nn.Linear(y_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv_y = nn.Linear(y_dim, self.n_kv_heads * self.head_dim, bias=False)
        self.gate = nn.Parameter(0.5 * torch.randn([self.n_local_heads]))
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)
        if qk_norm:
            self.q_norm = nn.LayerNorm(self.n_local_heads * self.head_dim)
            self.k_norm = nn.LayerNorm(self.n_local_kv_heads * self.head_dim)
            self.ky_norm = nn.LayerNorm(self.n_local_kv_heads * self.head_dim)
        else:
            self.q_norm = self.k_norm = self.ky_norm = nn.Identity()
        self.base_seqlen = None
        self.proportional_attn = False

    @staticmethod
    def apply_rotary_emb(x_in, freqs_cis):
        x = torch.view_as_complex(x_in.float().reshape(*x_in.shape[:-1], -1, 2))
        freqs_cis = freqs_cis.unsqueeze(2)
        x_out = torch.view_as_real(x * freqs_cis).flatten(3)
        return x_out.type_as(x_in)

    def _upad_input(self, query_layer, key_layer, value_layer, attention_mask, query_length):
        def _get_unpad_data(attention_mask):
            seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
            indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
            max_seqlen_in_batch = seqlens_in_batch.max().item()
            cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
            return indices, cu_seqlens, max_seqlen_in_batch

        indices_k, cu_seqlens_k, max_seqlen_in_batch_k = _get_unpad_data(attention_mask)
        batch_size, kv_seq_len, num_key_value_heads, head_dim = key_layer.shape
        key_layer = index_first_axis(key_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim), indices_k)
        value_layer = index_first_axis(value_layer.reshape(batch_size * kv_seq_len, num_key_value_heads, head_dim), indices_k)
        if query_length == kv_seq_len:
            query_layer = index_first_axis(
                query_layer.reshape(batch_size * kv_seq_len, self.n_local_heads, head_dim), indices_k
            )
            cu_seqlens_q = cu_seqlens_k
            max_seqlen_in_batch_q = max_seqlen_in_batch_k
            indices_q = indices_k
        else:
            raise NotImplementedError("self-attention only: query_length == kv_seq_len")
        return (query_layer, key_layer, value_layer, indices_q,
                (cu_seqlens_q, cu_seqlens_k), (max_seqlen_in_batch_q, max_seqlen_in_batch_k))

    def forward(self, x, x_mask, freqs_cis, y, y_mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        dtype = xq.dtype
        xq = self.q_norm(xq)
        xk = self.k_norm(xk)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq = Attention.apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = Attention.apply_rotary_emb(xk, freqs_cis=freqs_cis)
        xq, xk = xq.to(dtype), xk.to(dtype)

        if self.proportional_attn:
            softmax_scale = math.sqrt(math.log(seqlen, self.base_seqlen) / self.head_dim)
        else:
            softmax_scale = math.sqrt(1 / self.head_dim)

        if dtype in [torch.float16, torch.bfloat16]:
            (query_states, key_states, value_states, indices_q, cu_seq_lens, max_seq_lens) = self._upad_input(
                xq, xk, xv, x_mask, seqlen
            )
            cu_seqlens_q, cu_seqlens_k = cu_seq_lens
            max_seqlen_in_batch_q, max_seqlen_in_batch_k = max_seq_lens
            attn_output_unpad = flash_attn_varlen_func(
                query_states, key_states, value_states,
                cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_in_batch_q, max_seqlen_k=max_seqlen_in_batch_k,
                dropout_p=0.0, causal=False, softmax_scale=softmax_scale,
            )
            output = pad_input(attn_output_unpad, indices_q, bsz, seqlen)
        else:
            # (as upstream, the fp32 path hands SDPA the un-repeated K/V: n_kv_heads == n_heads here)
            output = (
                F.scaled_dot_product_attention(
                    xq.permute(0, 2, 1, 3), xk.permute(0, 2, 1, 3), xv.permute(0, 2, 1, 3),
                    attn_mask=x_mask.bool().view(bsz, 1, 1, seqlen).expand(-1, self.n_local_heads, seqlen, -1),
                    scale=softmax_scale,
                )
                .permute(0, 2, 1, 3)
                .to(dtype)
            )

        yk = self.ky_norm(self.wk_y(y)).view(bsz, -1, self.n_local_kv_heads, self.head_dim)
        yv = self.wv_y(y).view(bsz, -1, self.n_local_kv_heads, self.head_dim)
        n_rep = self.n_local_heads // self.n_local_kv_heads
        if n_rep >= 1:
            yk = yk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
            yv = yv.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
        output_y = F.scaled_dot_product_attention(
            xq.permute(0, 2, 1, 3), yk.permute(0, 2, 1, 3), yv.permute(0, 2, 1, 3),
            y_mask.view(bsz, 1, 1, -1).expand(bsz, self.n_local_heads, seqlen, -1),
        ).permute(0, 2, 1, 3)
        output_y = output_y * self.gate.tanh().view(1, 1, -1, 1)
        output = output + output_y
        output = output.flatten(-2)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, multiple_of, norm_eps, qk_norm, y_dim):
        super().__init__()
        self.attention = Attention(dim, n_heads, n_kv_heads, qk_norm, y_dim)
        self.feed_forward = FeedForward(dim=dim, hidden_dim=4 * dim, multiple_of=multiple_of)
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention_norm1 = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm = RMSNorm(dim, eps=norm_eps)
        self.ffn_norm1 = RMSNorm(dim, eps=norm_eps)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, 1024), 6 * dim, bias=True))
        self.attention_y_norm = RMSNorm(y_dim, eps=norm_eps)

    def forward(self, x, x_mask, freqs_cis, y, y_mask, adaln_input):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).chunk(6, dim=1)
        x = x + self.attention_norm1(
            gate_msa.unsqueeze(1)
            * self.attention(modulate(self.attention_norm(x), shift_msa, scale_msa), x_mask, freqs_cis,
                             self.attention_y_norm(y), y_mask)
        )
        x = x + self.ffn_norm1(gate_mlp.unsqueeze(1) * self.feed_forward(modulate(self.ffn_norm(x), shift_mlp, scale_mlp)))
        return x


class FinalLayer(nn.Module):
    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(hidden_size, 1024), 2 * hidden_size, bias=True))

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class NextDiT(nn.Module):
    def __init__(self, patch_size=2, in_channels=4, dim=32, n_layers=2, n_heads=4, n_kv_heads=None,
                 multiple_of=16, norm_eps=1e-5, learn_sigma=True, qk_norm=True, cap_feat_dim=24,
                 scale_factor=1.0):
        super().__init__()
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.x_embedder = nn.Linear(patch_size * patch_size * in_channels, dim, bias=True)
        self.t_embedder = TimestepEmbedder(min(dim, 1024))
        self.cap_embedder = nn.Sequential(nn.LayerNorm(cap_feat_dim), nn.Linear(cap_feat_dim, min(dim, 1024), bias=True))
        self.layers = nn.ModuleList(
            [TransformerBlock(dim, n_heads, n_kv_heads, multiple_of, norm_eps, qk_norm, cap_feat_dim)
             for _ in range(n_layers)]
        )
        self.final_layer = FinalLayer(dim, patch_size, self.out_channels)
        assert (dim // n_heads) % 4 == 0, "2d rope needs head dim to be divisible by 4"
        self.freqs_cis = NextDiT.precompute_freqs_cis(dim // n_heads, 16, scale_factor=scale_factor)
        self.dim = dim
        self.n_heads = n_heads
        self.pad_token = nn.Parameter(torch.empty(dim))
        nn.init.normal_(self.pad_token, std=0.02)

    def unpatchify(self, x, img_size, return_tensor=False):
        pH = pW = self.patch_size
        if return_tensor:
            H, W = img_size[0]
            B = x.size(0)
            L = (H // pH) * (W // pW)
            x = x[:, :L].view(B, H // pH, W // pW, pH, pW, self.out_channels)
            return x.permute(0, 5, 1, 3, 2, 4).flatten(4, 5).flatten(2, 3)
        imgs = []
        for i in range(x.size(0)):
            H, W = img_size[i]
            L = (H // pH) * (W // pW)
            imgs.append(x[i][:L].view(H // pH, W // pW, pH, pW, self.out_channels)
                        .permute(4, 0, 2, 1, 3).flatten(3, 4).flatten(1, 2))
        return imgs

    def patchify_and_embed(self, x):
        if isinstance(x, torch.Tensor):
            pH = pW = self.patch_size
            B, C, H, W = x.size()
            x = x.view(B, C, H // pH, pH, W // pW, pW).permute(0, 2, 4, 1, 3, 5).flatten(3)
            x = self.x_embedder(x)
            x = x.flatten(1, 2)
            mask = torch.ones(x.shape[0], x.shape[1], dtype=torch.int32, device=x.device)
            return x, mask, [(H, W)] * B, self.freqs_cis[: H // pH, : W // pW].flatten(0, 1).unsqueeze(0)
        pH = pW = self.patch_size
        x_embed, freqs_cis, img_size, l_effective_seq_len = [], [], [], []
        for img in x:
            C, H, W = img.size()
            item_freqs_cis = self.freqs_cis[: H // pH, : W // pW]
            freqs_cis.append(item_freqs_cis.flatten(0, 1))
            img_size.append((H, W))
            img = img.view(C, H // pH, pH, W // pW, pW).permute(1, 3, 0, 2, 4).flatten(2)
            img = self.x_embedder(img)
            img = img.flatten(0, 1)
            l_effective_seq_len.append(len(img))
            x_embed.append(img)
        max_seq_len = max(l_effective_seq_len)
        mask = torch.zeros(len(x), max_seq_len, dtype=torch.int32, device=x[0].device)
        padded_x_embed, padded_freqs_cis = [], []
        for i, (item_embed, item_freqs_cis, item_seq_len) in enumerate(zip(x_embed, freqs_cis, l_effective_seq_len)):
            item_embed = torch.cat(
                [item_embed, self.pad_token.view(1, -1).expand(max_seq_len - item_seq_len, -1).to(item_embed.dtype)], dim=0
            )
            item_freqs_cis = torch.cat([item_freqs_cis, item_freqs_cis[-1:].expand(max_seq_len - item_seq_len, -1)], dim=0)
            padded_x_embed.append(item_embed)
            padded_freqs_cis.append(item_freqs_cis)
            mask[i][:item_seq_len] = 1
        return torch.stack(padded_x_embed, dim=0), mask, img_size, torch.stack(padded_freqs_cis, dim=0)

    def forward(self, x, t, cap_feats, cap_mask):
        x_is_tensor = isinstance(x, torch.Tensor)
        x, mask, img_size, freqs_cis = self.patchify_and_embed(x)
        t = self.t_embedder(t)
        cap_mask_float = cap_mask.float().unsqueeze(-1)
        cap_feats_pool = (cap_feats * cap_mask_float).sum(dim=1) / cap_mask_float.sum(dim=1)
        cap_feats_pool = cap_feats_pool.to(cap_feats)
        cap_emb = self.cap_embedder(cap_feats_pool)
        adaln_input = t + cap_emb
        cap_mask = cap_mask.bool()
        for layer in self.layers:
            x = layer(x, mask, freqs_cis, cap_feats, cap_mask, adaln_input=adaln_input)
        x = self.final_layer(x, adaln_input)
        x = self.unpatchify(x, img_size, return_tensor=x_is_tensor)
        if self.learn_sigma:
            if x_is_tensor:
                x, _ = x.chunk(2, dim=1)
            else:
                x = [_.chunk(2, dim=0)[0] for _ in x]
        return x

    @staticmethod
    def precompute_freqs_cis(dim, end, theta=10000.0, scale_factor=1.0, timestep=1.0):
        freqs_inter = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim)) / scale_factor
        target_dim = timestep * dim + 1
        scale_factor = scale_factor ** (dim / target_dim)
        theta = theta * scale_factor
        freqs_time_scaled = 1.0 / (theta ** (torch.arange(0, dim, 4)[: (dim // 4)].float() / dim))
        freqs = torch.max(freqs_inter, freqs_time_scaled)
        timestep = torch.arange(end, device=freqs.device, dtype=torch.float)
        freqs = torch.outer(timestep, freqs).float()
        freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
        freqs_cis_h = freqs_cis.view(end, 1, dim // 4, 1).repeat(1, end, 1, 1)
        freqs_cis_w = freqs_cis.view(1, end, dim // 4, 1).repeat(end, 1, 1, 1)
        return torch.cat([freqs_cis_h, freqs_cis_w], dim=-1).flatten(2)


def main():
    model = NextDiT().eval()
    # init the zero-init'ed projections randomly so every path matters
    with torch.no_grad():
        for p in model.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.2)

    sizes = [(8, 8), (4, 6), (6, 4)]  # latent H, W (patch 2): 16, 6 and 6 tokens
    cap_lens = [5, 3, 7]
    imgs = [torch.randn(4, H, W) for H, W in sizes]
    Lc = max(cap_lens)
    cap_feats = torch.zeros(len(sizes), Lc, 24)
    cap_mask = torch.zeros(len(sizes), Lc, dtype=torch.int64)
    for i, n in enumerate(cap_lens):
        cap_feats[i, :n] = torch.randn(n, 24)
        cap_feats[i, n:] = 7.0  # padding features must not leak in
        cap_mask[i, :n] = 1
    t = torch.tensor([0.3, 0.7, 0.9])

    ok = True
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 6e-2)]:
        m = model.to(dtype)
        with torch.no_grad():
            out = m([im.to(dtype) for im in imgs], t, cap_feats.to(dtype), cap_mask)
            errs = []
            for i in range(len(sizes)):
                n = cap_lens[i]
                # reference: the image alone (4-D tensor path, all-ones mask), caption unpadded, in fp32
                ref = model.float()(imgs[i][None], t[i : i + 1], cap_feats[i : i + 1, :n], cap_mask[i : i + 1, :n])[0]
                m = model.to(dtype)
                errs.append((out[i].float() - ref).abs().max().item())
        good = max(errs) < tol
        ok &= good
        path = "SDPA bool mask" if dtype == torch.float32 else "varlen unpadded"
        print(f"{str(dtype):15s} ({path}) batch of mixed resolutions vs each alone: max abs err "
              f"{max(errs):.2e} (tol {tol}) -> {'match' if good else 'MISMATCH'}")
    print("ALL MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
