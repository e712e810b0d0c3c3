"""LongT5 local attention: a window in the encoder's self-attention only, computed in 3-block form.

Follows huggingface/transformers src/transformers/models/longt5/modeling_longt5.py (LongT5LocalAttention:
block_len = local_radius + 1, _split_into_blocks, _concatenate_3_blocks, _get_local_attention_mask =
blocked mask AND 3-blocked mask AND |relative position| < block_len; LongT5Stack uses local attention
only when the stack is the encoder, the decoder keeps causal self-attention and full cross-attention).

Mask meant: encoder token i sees encoder tokens j with |i - j| <= local_radius that are not padding
(both directions); decoder is causal over its own tokens; cross-attention sees every real encoder token.
Right-padded encoder inputs; pad query rows are never read.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)


class LongT5Config:
    d_model = 16
    num_heads = 2
    local_radius = 2
    encoder_attention_type = "local"


def _split_into_blocks(x, block_len, dim):
    n = x.shape[dim]
    pad = (-n) % block_len
    if pad:
        pad_shape = list(x.shape)
        pad_shape[dim] = pad
        x = torch.cat([x, torch.zeros(pad_shape, dtype=x.dtype)], dim)
    shape = list(x.shape)
    shape[dim:dim + 1] = [x.shape[dim] // block_len, block_len]
    return x.reshape(shape)


def _concatenate_3_blocks(x, block_dim, seq_dim):
    num_blocks = x.shape[block_dim]
    pad = [0] * (2 * x.ndim)
    pad[2 * (x.ndim - block_dim - 1)] = 1
    pad[2 * (x.ndim - block_dim - 1) + 1] = 1
    x = F.pad(x, pad)  # one empty block on each side
    blocks = [x.narrow(block_dim, i, num_blocks) for i in range(3)]
    return torch.cat(blocks, dim=seq_dim)


def _get_local_attention_mask(attention_mask, block_len):
    blocked = _split_into_blocks(attention_mask, block_len, dim=1)  # [b, nb, bl]
    three = _concatenate_3_blocks(blocked, block_dim=1, seq_dim=2)  # [b, nb, 3bl]
    local = blocked.unsqueeze(-1).bool() & three.unsqueeze(-2).bool()
    rel = torch.arange(3 * block_len)[None, :] - (torch.arange(block_len)[:, None] + block_len)
    return local & (rel.abs() < block_len)  # [b, nb, bl, 3bl]


class LongT5LocalAttention(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h = config.num_heads
        self.block_len = config.local_radius + 1
        self.qkv = torch.nn.Linear(config.d_model, 3 * config.d_model, bias=False)

    def forward(self, hidden, mask):
        b, n, d = hidden.shape
        q, k, v = self.qkv(hidden).view(b, n, 3, self.h, -1).unbind(2)
        q = _split_into_blocks(q, self.block_len, dim=1)
        k = _concatenate_3_blocks(_split_into_blocks(k, self.block_len, dim=1), 1, 2)
        v = _concatenate_3_blocks(_split_into_blocks(v, self.block_len, dim=1), 1, 2)
        scores = torch.einsum("bnqhd,bnkhd->bnhqk", q, k)  # T5: no 1/sqrt(d) scaling
        local_mask = _get_local_attention_mask(mask, self.block_len)
        scores = scores + torch.where(local_mask, 0.0, -1e10).unsqueeze(2)
        out = torch.einsum("bnhqk,bnkhd->bnqhd", scores.softmax(-1), v)
        return out.reshape(b, -1, d)[:, :n]


class LongT5Attention(torch.nn.Module):
    """Full attention for the decoder (causal self, and cross over the encoder)."""

    def __init__(self, config):
        super().__init__()
        self.h = config.num_heads
        self.q = torch.nn.Linear(config.d_model, config.d_model, bias=False)
        self.kv = torch.nn.Linear(config.d_model, 2 * config.d_model, bias=False)

    def forward(self, hidden, key_value_states=None, mask=None):
        b, n, d = hidden.shape
        src = hidden if key_value_states is None else key_value_states
        q = self.q(hidden).view(b, n, self.h, -1).transpose(1, 2)
        k, v = self.kv(src).view(b, src.shape[1], 2, self.h, -1).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
        return o.transpose(1, 2).reshape(b, n, d)


def main():
    cfg = LongT5Config()
    enc_attn, self_attn, cross_attn = LongT5LocalAttention(cfg), LongT5Attention(cfg), LongT5Attention(cfg)
    lens = [11, 7]
    n, m = max(lens), 5
    attention_mask = torch.tensor([[1] * l + [0] * (n - l) for l in lens])
    x = torch.randn(2, n, cfg.d_model)
    y = torch.randn(2, m, cfg.d_model)
    with torch.no_grad():
        enc = x + enc_attn(x, attention_mask)
        causal = torch.ones(m, m, dtype=torch.bool).tril()
        dec = y + self_attn(y, mask=causal)
        enc_keys = attention_mask.bool()[:, None, None, :]
        dec = dec + cross_attn(dec, key_value_states=enc, mask=enc_keys)

        # reference encoder: dense scores, window + padding by a double loop over positions
        q, k, v = enc_attn.qkv(x).view(2, n, 3, 2, -1).permute(2, 0, 3, 1, 4)
        allowed = torch.zeros(2, 1, n, n, dtype=torch.bool)
        for bi in range(2):
            for i in range(n):
                for j in range(n):
                    allowed[bi, 0, i, j] = abs(i - j) <= cfg.local_radius and j < lens[bi]
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=1.0).transpose(1, 2).reshape(2, n, -1)
        for bi in range(2):
            assert torch.allclose(enc[bi, :lens[bi]], (x + ref)[bi, :lens[bi]], atol=1e-5)
    print("encoder local radius", cfg.local_radius, "lens", lens, "decoder out", tuple(dec.shape))


if __name__ == "__main__":
    main()
