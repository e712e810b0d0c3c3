# Citation: nishide-dev/unturtle#56 "fix(mdlm-dit): additive 4-D mask inversion, flash/SDPA dtype guards
#   (#48 follow-ups)" (merged 2026-07-12; refs #48). The post-#48 source was not readable here, so the
#   module below is reconstructed from the PR description on top of the kuleshov-group/mdlm DiT backbone
#   (models/dit.py: TimestepEmbedder, EmbeddingLayer, Rotary, DDiTBlock, DDitFinalLayer, DIT) that
#   unturtle's MDLM-DiT ports, with the attention_mask plumbing unturtle added (HF-style `attention_mask`
#   accepted as 2-D [B, L] or 4-D [B, 1, Lq, Lk], normalised by `_normalize_attention_mask`, SDPA path).
# Bug: `_normalize_attention_mask` treated every 4-D mask as a keep-mask (`mask.bool()`), so an
#   HF-additive float mask (0.0 = keep, finfo.min / -inf = masked, e.g. from `_prepare_4d_attention_mask`)
#   was read exactly inverted: real tokens became "masked" and only the padding keys stayed visible.
# Fix: float masks are converted with `keep = mask >= 0` (handles finfo.min, -inf and legacy -1e4);
#   bool/int masks keep their keep-mask semantics.
# CPU, torch only, tiny random model; flash_attn is not used (SDPA path, fp32).
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------------------
# HF-style mask helper a caller uses (as transformers.modeling_attn_mask_utils._prepare_4d_attention_mask)
# ---------------------------------------------------------------------------
def _prepare_4d_attention_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


# ---------------------------------------------------------------------------
# mask plumbing (unturtle MDLM-DiT)
# ---------------------------------------------------------------------------
def _normalize_attention_mask(attention_mask, batch_size, seq_len):
    """Return a bool keep-mask [B, 1, Lq, Lk] (True = attend) or None."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask.to(torch.bool)[:, None, None, :].expand(batch_size, 1, seq_len, seq_len)
    if attention_mask.dim() == 4:
        if FIXED and attention_mask.is_floating_point():
            # HF-additive convention: 0.0 keep, finfo.min / -inf / -1e4 masked.
            return attention_mask >= 0
        return attention_mask.to(torch.bool)
    raise ValueError(f"unsupported attention_mask shape {tuple(attention_mask.shape)}")


def _keep_mask_to_sdpa_bias(keep, dtype):
    # additive bias with finfo.min (not -inf) so a fully masked row stays finite
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill(~keep, torch.finfo(dtype).min)


# ---------------------------------------------------------------------------
# kuleshov-group/mdlm models/dit.py (shrunk), attention via SDPA
# ---------------------------------------------------------------------------
def modulate(x, shift, scale):
    return x * (1 + scale) + shift


def bias_dropout_add_scale(x, bias, scale, residual, prob, training):
    if bias is not None:
        out = scale * F.dropout(x + bias, p=prob, training=training)
    else:
        out = scale * F.dropout(x, p=prob, training=training)
    return residual + out


class Rotary(nn.Module):
    def __init__(self, dim, base=10_000):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))

    def forward(self, x, seq_dim=1):
        seq_len = x.shape[seq_dim]
        t = torch.arange(seq_len).type_as(self.inv_freq)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq.clone())
        emb = torch.cat((freqs, freqs), dim=-1)
        # dims: batch, seq_len, qkv, head, dim
        cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
        sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
        # the "v" part is not rotated
        cos[:, :, 2, :, :].fill_(1.0)
        sin[:, :, 2, :, :].fill_(0.0)
        return cos, sin


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(qkv, cos, sin):
    return (qkv * cos) + (rotate_half(qkv) * sin)


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.ones([dim]))
        self.dim = dim

    def forward(self, x):
        x = F.layer_norm(x.float(), [self.dim])
        return x * self.weight[None, None, :]


class TimestepEmbedder(nn.Module):
    def __init__(self, hidden_size, frequency_embedding_size=256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t, dim, max_period=10000):
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(start=0, end=half, dtype=torch.float32) / half)
        args = t[:, None].float() * freqs[None]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t):
        return self.mlp(self.timestep_embedding(t, self.frequency_embedding_size))


class EmbeddingLayer(nn.Module):
    def __init__(self, dim, vocab_dim):
        super().__init__()
        self.embedding = nn.Parameter(torch.empty((vocab_dim, dim)))
        torch.nn.init.kaiming_uniform_(self.embedding, a=math.sqrt(5))

    def forward(self, x):
        return self.embedding[x]


class DDiTBlock(nn.Module):
    def __init__(self, dim, n_heads, cond_dim, mlp_ratio=4, dropout=0.1):
        super().__init__()
        self.n_heads = n_heads
        self.norm1 = LayerNorm(dim)
        self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.attn_out = nn.Linear(dim, dim, bias=False)
        self.dropout1 = nn.Dropout(dropout)
        self.norm2 = LayerNorm(dim)
        self.mlp = nn.Sequential(
            nn.Linear(dim, mlp_ratio * dim, bias=True),
            nn.GELU(approximate="tanh"),
            nn.Linear(mlp_ratio * dim, dim, bias=True),
        )
        self.dropout2 = nn.Dropout(dropout)
        self.dropout = dropout
        self.adaLN_modulation = nn.Linear(cond_dim, 6 * dim, bias=True)
        # (upstream zero-inits adaLN; small random here so the tiny untrained model is not an identity)
        nn.init.normal_(self.adaLN_modulation.weight, std=0.02)
        self.adaLN_modulation.bias.data.zero_()

    def forward(self, x, rotary_cos_sin, c, attn_keep=None):
        batch_size, seq_len = x.shape[0], x.shape[1]
        (shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp) = \
            self.adaLN_modulation(c)[:, None].chunk(6, dim=2)

        x_skip = x
        x = modulate(self.norm1(x), shift_msa, scale_msa)

        qkv = self.attn_qkv(x)
        qkv = qkv.view(batch_size, seq_len, 3, self.n_heads, -1)  # b s three h d
        cos, sin = rotary_cos_sin
        qkv = apply_rotary_pos_emb(qkv, cos.to(qkv.dtype), sin.to(qkv.dtype))
        q, k, v = qkv.unbind(dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # b h s d

        attn_bias = None if attn_keep is None else _keep_mask_to_sdpa_bias(attn_keep, q.dtype)
        x = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias, dropout_p=0.0, is_causal=False)
        x = x.transpose(1, 2).reshape(batch_size, seq_len, -1)

        x = bias_dropout_add_scale(self.attn_out(x), None, gate_msa, x_skip, self.dropout, self.training)
        x = bias_dropout_add_scale(self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp)), None, gate_mlp, x,
                                   self.dropout, self.training)
        return x


class DDitFinalLayer(nn.Module):
    def __init__(self, hidden_size, out_channels, cond_dim):
        super().__init__()
        self.norm_final = LayerNorm(hidden_size)
        self.linear = nn.Linear(hidden_size, out_channels)
        self.adaLN_modulation = nn.Linear(cond_dim, 2 * hidden_size, bias=True)
        self.adaLN_modulation.weight.data.zero_()
        self.adaLN_modulation.bias.data.zero_()

    def forward(self, x, c):
        shift, scale = self.adaLN_modulation(c)[:, None].chunk(2, dim=2)
        return self.linear(modulate(self.norm_final(x), shift, scale))


class DIT(nn.Module):
    def __init__(self, vocab_size, hidden_size=32, cond_dim=16, n_heads=4, n_blocks=2, dropout=0.0):
        super().__init__()
        self.vocab_embed = EmbeddingLayer(hidden_size, vocab_size)
        self.sigma_map = TimestepEmbedder(cond_dim)
        self.rotary_emb = Rotary(hidden_size // n_heads)
        self.blocks = nn.ModuleList([DDiTBlock(hidden_size, n_heads, cond_dim, dropout=dropout)
                                     for _ in range(n_blocks)])
        self.output_layer = DDitFinalLayer(hidden_size, vocab_size, cond_dim)

    def forward(self, indices, sigma, attention_mask=None):
        x = self.vocab_embed(indices)
        c = F.silu(self.sigma_map(sigma))
        rotary_cos_sin = self.rotary_emb(x)
        attn_keep = _normalize_attention_mask(attention_mask, x.shape[0], x.shape[1])
        for block in self.blocks:
            x = block(x, rotary_cos_sin, c, attn_keep=attn_keep)
        return self.output_layer(x, c)


# ---------------------------------------------------------------------------
# MDLM training step (diffusion.py: q_xt, _subs_parameterization, log-linear schedule)
# ---------------------------------------------------------------------------
NEG_INFINITY = -1e6


def loglinear_noise(t, eps=1e-3):
    sigma = -torch.log1p(-(1 - eps) * t)
    dsigma = (1 - eps) / (1 - (1 - eps) * t)
    return sigma, dsigma


def q_xt(x, move_chance, mask_index):
    move_indices = torch.rand(*x.shape) < move_chance
    return torch.where(move_indices, mask_index, x)


def _subs_parameterization(logits, xt, mask_index):
    logits[:, :, mask_index] += NEG_INFINITY
    logits = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    unmasked_indices = xt != mask_index
    logits[unmasked_indices] = NEG_INFINITY
    logits[unmasked_indices, xt[unmasked_indices]] = 0
    return logits


def main():
    vocab_size, pad_id = 40, 0
    mask_index = vocab_size - 1
    model = DIT(vocab_size).eval()

    # padded batch of three sequences (right padding), lengths 12, 7, 4
    lengths = [12, 7, 4]
    L = max(lengths)
    x0 = torch.full((len(lengths), L), pad_id, dtype=torch.long)
    attention_mask_2d = torch.zeros(len(lengths), L, dtype=torch.long)
    for i, n in enumerate(lengths):
        x0[i, :n] = torch.randint(1, vocab_size - 1, (n,))
        attention_mask_2d[i, :n] = 1

    # caller hands the model an HF-style 4-D additive mask
    attention_mask = _prepare_4d_attention_mask(attention_mask_2d, torch.float32)

    t = torch.tensor([0.3, 0.5, 0.7])
    sigma, dsigma = loglinear_noise(t)
    move_chance = 1 - torch.exp(-sigma[:, None])
    xt = q_xt(x0, move_chance, mask_index)

    with torch.no_grad():
        logits = model(xt, sigma, attention_mask=attention_mask)
        log_p = _subs_parameterization(logits.float(), xt, mask_index)
        log_p_theta = torch.gather(log_p, -1, x0[:, :, None]).squeeze(-1)
        loss = -log_p_theta * (dsigma / torch.expm1(sigma))[:, None]
        loss = (loss * attention_mask_2d).sum() / attention_mask_2d.sum()

    print("xt:\n", xt)
    print("per-row mean log p(x0) on real tokens:",
          [round(((log_p_theta[i] * attention_mask_2d[i]).sum() / attention_mask_2d[i].sum()).item(), 4)
           for i in range(len(lengths))])
    print("logits[1, 0, :5]:", [round(v, 4) for v in logits[1, 0, :5].tolist()])
    print(f"MDLM loss: {loss.item():.6f}")


if __name__ == "__main__":
    main()
