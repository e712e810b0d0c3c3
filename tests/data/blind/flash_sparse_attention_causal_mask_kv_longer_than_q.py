# HKUSTDial/flash-sparse-attention#213: with is_causal and a KV cache longer than the query chunk, the causal
# mask was aligned top-left (key j visible iff j <= i) instead of bottom-right (j <= i + seqlen_k - seqlen_q).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def prepare_causal_mask(seqlen_q, seqlen_k, device):
    q_idx = torch.arange(seqlen_q, device=device)[:, None]
    k_idx = torch.arange(seqlen_k, device=device)[None, :]
    if FIXED:
        # causal offset aligns the last query with the last key
        return k_idx <= q_idx + (seqlen_k - seqlen_q)
    return k_idx <= q_idx


def flash_sparse_attn_func(query, key, value, attn_bias=None, is_causal=True, softmax_scale=None):
    # query: (b, seqlen_q, h, d); key/value: (b, seqlen_k, h, d)
    b, sq, h, d = query.shape
    sk = key.shape[1]
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    q = query.transpose(1, 2)
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    if attn_bias is not None:
        scores = scores + attn_bias
    if is_causal:
        causal = prepare_causal_mask(sq, sk, q.device)
        scores = scores + torch.zeros(sq, sk).masked_fill(~causal, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs, v).transpose(1, 2)


class DogeAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, past_key_value=None):
        b, t, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(b, t, self.num_heads, self.head_dim)
        if past_key_value is not None:
            pk, pv = past_key_value
            k = torch.cat([pk, k], dim=1)
            v = torch.cat([pv, v], dim=1)
        out = flash_sparse_attn_func(q, k, v, is_causal=True)
        return self.o_proj(out.reshape(b, t, -1)), (k, v)


class TinyModel(nn.Module):
    def __init__(self, vocab=50, hidden=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([DogeAttention(hidden) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None):
        h = self.embed(input_ids)
        new_cache = []
        for i, layer in enumerate(self.layers):
            past = None if past_key_values is None else past_key_values[i]
            a, kv = layer(h, past)
            h = h + a
            new_cache.append(kv)
        return self.lm_head(h), new_cache


def main():
    torch.manual_seed(0)
    model = TinyModel().eval()
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        # one-shot prefill of the whole prompt (seqlen_q == seqlen_k: both alignments agree)
        full_logits, _ = model(ids)
        # chunked prefill: first 8 tokens, then the last 4 against the 12-key cache (seqlen_k > seqlen_q)
        _, cache = model(ids[:, :8])
        chunk_logits, _ = model(ids[:, 8:], past_key_values=cache)
    diff = (chunk_logits - full_logits[:, 8:]).abs().max().item()
    print(f"fixed={FIXED} chunked-prefill vs full-prefill logits max diff: {diff:.4e}")


if __name__ == "__main__":
    main()
