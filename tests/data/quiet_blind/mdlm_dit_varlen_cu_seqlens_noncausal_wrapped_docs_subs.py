"""MDLM (masked diffusion LM) DiT backbone: non-causal attention through a varlen cu_seqlens call over wrapped text.

Follows kuleshov-group/mdlm (https://github.com/kuleshov-group/mdlm: models/dit.py ``DDiTBlock.forward``, which
packs qkv to ``(b s) three h d``, builds ``cu_seqlens = torch.arange(0, (batch_size + 1) * seq_len, step=seq_len)``
and calls ``flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, seq_len, 0., causal=False)``; diffusion.py
``_subs_parameterization``, ``q_xt`` and the log-linear noise; dataloader.py ``wrap`` mode that concatenates
documents as [BOS] doc [EOS] and chunks them into fixed blocks). flash-attn is not available on CPU, so
``flash_attn_varlen_qkvpacked_func`` is provided by a torch fallback with the same signature and meaning.

Mask meant: each sequence of the batch (one cu_seqlens segment, always full length in wrap mode) attends to all of
its own positions in both directions, and never to another sequence. Wrapped blocks hold pieces of several
documents separated by [EOS][BOS]; MDLM attends across those separators on purpose (wrap mode trades document
isolation for zero padding), so there is no padding and no per-document mask.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

NEG_INFINITY = -1_000_000.0


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, causal=False):
    """qkv: (total, 3, h, d). Each [cu_seqlens[i], cu_seqlens[i+1]) segment is one independent sequence."""
    out = torch.empty_like(qkv[:, 0])
    for start, end in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # 3 x h x s x d
        out[start:end] = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal).transpose(0, 1)
    return out


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, dim, base=10_000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim)), persistent=False)

    def forward(self, seq_len):
        t = torch.arange(seq_len).float()
        emb = torch.cat([torch.outer(t, self.inv_freq)] * 2, dim=-1)
        return emb.cos()[None, :, None, :], emb.sin()[None, :, None, :]


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=32):
        super().__init__()
        self.frequency_embedding_size = frequency_embedding_size
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size), nn.SiLU(),
                                 nn.Linear(hidden_size, hidden_size))

    def forward(self, t):
        half = self.frequency_embedding_size // 2
        freqs = torch.exp(-math.log(10000) * torch.arange(half).float() / half)
        args = t[:, None].float() * freqs[None]
        return self.mlp(torch.cat([torch.cos(args), torch.sin(args)], dim=-1))


class DDiTBlock(nn.Module):
    def __init__(self, dim, n_heads, cond_dim, mlp_ratio=4):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(approximate="tanh"),
                                 nn.Linear(mlp_ratio * dim, dim))
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * dim)

    def qkv(self, x, rotary_cos_sin):
        batch_size, seq_len = x.shape[0], x.shape[1]
        qkv = self.attn_qkv(x).view(batch_size, seq_len, 3, self.n_heads, -1)
        cos, sin = rotary_cos_sin
        q, k, v = qkv.unbind(2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        return torch.stack([q, k, v], dim=2)

    def forward(self, x, rotary_cos_sin, c, seqlens=None):
        batch_size, seq_len = x.shape[0], x.shape[1]
        modulation = self.adaLN_modulation(c)[:, None].chunk(6, dim=2)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = modulation
        x_skip = x
        x = self.norm1(x) * (1 + scale_msa) + shift_msa
        qkv = self.qkv(x, rotary_cos_sin).reshape(batch_size * seq_len, 3, self.n_heads, -1)  # (b s) three h d
        if seqlens is None:
            cu_seqlens = torch.arange(0, (batch_size + 1) * seq_len, step=seq_len, dtype=torch.int32)
        else:
            cu_seqlens = seqlens.cumsum(-1)
        x = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, seq_len, 0.0, causal=False)
        x = x.reshape(batch_size, seq_len, -1)
        x = x_skip + gate_msa * self.attn_out(x)
        return x + gate_mlp * self.mlp(self.norm2(x) * (1 + scale_mlp) + shift_mlp)


class DIT(nn.Module):
    def __init__(self, vocab_size, hidden_size=32, n_heads=4, n_blocks=2, cond_dim=32):
        super().__init__()
        self.vocab_embed = nn.Embedding(vocab_size, hidden_size)
        self.sigma_map = TimestepEmbedder(cond_dim)
        self.rotary_emb = Rotary(hidden_size // n_heads)
        self.blocks = nn.ModuleList(DDiTBlock(hidden_size, n_heads, cond_dim) for _ in range(n_blocks))
        self.output_layer = nn.Linear(hidden_size, vocab_size)

    def forward(self, indices, sigma):
        x = self.vocab_embed(indices)
        c = F.silu(self.sigma_map(sigma))
        rotary_cos_sin = self.rotary_emb(x.shape[1])
        for block in self.blocks:
            x = block(x, rotary_cos_sin, c, seqlens=None)
        return self.output_layer(x)


class LogLinearNoise:
    def __init__(self, eps=1e-3):
        self.eps = eps

    def __call__(self, t):
        total = -torch.log1p(-(1 - self.eps) * t)
        rate = (1 - self.eps) / (1 - (1 - self.eps) * t)
        return total, rate


def _subs_parameterization(logits, xt, mask_index):
    logits[:, :, mask_index] += NEG_INFINITY  # never predict [MASK]
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked_indices = xt != mask_index  # carry-over: unmasked tokens stay as they are
    logits[unmasked_indices] = NEG_INFINITY
    logits[unmasked_indices, xt[unmasked_indices]] = 0
    return logits


def q_xt(x, move_chance, mask_index):
    move_indices = torch.rand(*x.shape) < move_chance
    return torch.where(move_indices, mask_index, x)


def wrap(docs, bos, eos, block_size):
    flat = []
    for d in docs:
        flat += [bos] + d + [eos]
    n_blocks = len(flat) // block_size  # remainder dropped, as in the wrapped loader
    return torch.tensor(flat[: n_blocks * block_size]).view(n_blocks, block_size)


def main():
    torch.manual_seed(0)
    vocab_size, bos, eos = 40, 1, 2
    mask_index = vocab_size  # MDLM appends [MASK] after the tokenizer's vocabulary
    backbone = DIT(vocab_size + 1).eval()
    noise = LogLinearNoise()

    docs = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19], [20, 21], [22, 23, 24, 25, 26, 27]]
    x0 = wrap(docs, bos, eos, block_size=8)  # blocks start and end mid-document
    t = torch.rand(x0.shape[0])
    sigma, dsigma = noise(t)
    move_chance = 1 - torch.exp(-sigma[:, None])
    xt = q_xt(x0, move_chance, mask_index)

    with torch.no_grad():
        logits = _subs_parameterization(backbone(xt, sigma), xt, mask_index)
        log_p_theta = torch.gather(logits, -1, x0[:, :, None]).squeeze(-1)
        loss = (-log_p_theta * (dsigma / torch.expm1(sigma))[:, None]).mean()
        assert torch.isfinite(loss)

        # Reference for one block: the varlen packed call equals plain full (non-causal) SDPA per sequence.
        block = backbone.blocks[0]
        x = backbone.vocab_embed(xt)
        qkv = block.qkv(x, backbone.rotary_emb(x.shape[1]))  # b s 3 h d
        b, s = x.shape[:2]
        cu = torch.arange(0, (b + 1) * s, step=s, dtype=torch.int32)
        packed = flash_attn_varlen_qkvpacked_func(qkv.reshape(b * s, 3, block.n_heads, -1), cu, s, causal=False)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # 3 b h s d
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        ref = (torch.softmax(scores, dim=-1) @ v).transpose(1, 2).reshape(b * s, block.n_heads, -1)
        assert torch.allclose(packed, ref, atol=1e-5)
    print(f"blocks {tuple(x0.shape)}, masked {(xt == mask_index).sum().item()}, loss {loss.item():.3f}")


if __name__ == "__main__":
    main()
