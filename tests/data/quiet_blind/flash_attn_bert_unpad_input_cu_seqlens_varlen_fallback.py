"""flash-attn BERT path: unpad_input -> cu_seqlens -> varlen attention -> pad_input, with a torch varlen fallback.

Follows Dao-AILab/flash-attention flash_attn/bert_padding.py (unpad_input: seqlens_in_batch from
attention_mask.sum, indices from nonzero of the flattened mask, cu_seqlens = F.pad(cumsum, (1, 0)); pad_input
scatters back) and flash_attn/models/bert.py (BertEncoder with key_padding_mask: the hidden states are unpadded
once, every layer runs flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, causal=False), and the
output is padded again). No GPU here, so flash_attn_varlen_qkvpacked_func is replaced by a loop over the
cu_seqlens segments calling F.scaled_dot_product_attention without any mask.
Mask meant: bidirectional attention inside each sequence's real tokens; padded tokens do not exist in the packed
layout at all.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    flat = hidden_states.reshape(-1, *hidden_states.shape[2:])
    return flat[indices], indices, cu_seqlens, max_seqlen_in_batch


def pad_input(hidden_states, indices, batch, seqlen):
    output = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    output[indices] = hidden_states
    return output.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, causal=False):
    """CPU stand-in: qkv is (total, 3, nheads, headdim); one SDPA call per cu_seqlens segment."""
    out = torch.empty_like(qkv[:, 0])
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):  # per sequence, not per token
        q, k, v = qkv[start:end].permute(1, 2, 0, 3)  # each (nheads, len, headdim)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=causal)
        out[start:end] = o.transpose(0, 1)
    return out


class FlashSelfAttentionBlock(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.Wqkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.out_proj = nn.Linear(hidden_size, hidden_size)
        self.norm1 = nn.LayerNorm(hidden_size)
        self.mlp = nn.Sequential(nn.Linear(hidden_size, 4 * hidden_size), nn.GELU(), nn.Linear(4 * hidden_size, hidden_size))
        self.norm2 = nn.LayerNorm(hidden_size)

    def forward(self, hidden_states, cu_seqlens, max_seqlen):
        # hidden_states: (total_nnz, hidden) -- already unpadded
        qkv = self.Wqkv(hidden_states).view(-1, 3, self.num_heads, hidden_states.size(-1) // self.num_heads)
        ctx = flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, causal=False)
        hidden_states = self.norm1(hidden_states + self.out_proj(ctx.flatten(1)))
        return self.norm2(hidden_states + self.mlp(hidden_states))


class BertEncoder(nn.Module):
    def __init__(self, num_layers=2, hidden_size=32):
        super().__init__()
        self.layers = nn.ModuleList([FlashSelfAttentionBlock(hidden_size) for _ in range(num_layers)])

    def forward(self, hidden_states, key_padding_mask=None):
        batch, seqlen = hidden_states.shape[:2]
        hidden_states, indices, cu_seqlens, max_seqlen_in_batch = unpad_input(hidden_states, key_padding_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, cu_seqlens, max_seqlen_in_batch)
        return pad_input(hidden_states, indices, batch, seqlen)


def main():
    torch.manual_seed(0)
    emb = nn.Embedding(30, 32, padding_idx=0)
    input_ids = torch.randint(1, 30, (3, 8))
    lengths = [8, 3, 5]
    for b, n in enumerate(lengths):
        input_ids[b, n:] = 0
    attention_mask = (input_ids != 0)  # True = real token (the key_padding_mask of flash_attn's BertModel)
    encoder = BertEncoder().eval()
    with torch.no_grad():
        out = encoder(emb(input_ids), key_padding_mask=attention_mask)
        for b, n in enumerate(lengths):
            assert torch.all(out[b, n:] == 0)  # pad_input leaves padded slots zero
            alone = encoder(emb(input_ids[b:b + 1, :n]), key_padding_mask=attention_mask[b:b + 1, :n])
            assert torch.allclose(out[b, :n], alone[0], atol=1e-5)
    print("flash-attn unpad varlen ok", tuple(out.shape))


if __name__ == "__main__":
    main()
