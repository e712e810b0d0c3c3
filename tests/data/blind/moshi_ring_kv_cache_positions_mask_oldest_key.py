# kyutai-labs/moshi#148 (commit 4a40e26, "fixing bug in KV Cache"): RingKVCache.complete gave the slot at
# end_offset % capacity the position end_offset, so once the ring is full the oldest in-context key looks like a future key and is masked.
import math
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def apply_rope(q, k, offset, max_period=10_000):
    B, H, T, D = q.shape
    ds = torch.arange(D // 2, dtype=torch.float32)
    freqs = torch.exp(ds * (-math.log(max_period) * 2 / D))
    ts = (offset.float() + torch.arange(T, dtype=torch.float32)).view(1, -1, 1)
    q, k = q.view(B, H, T, D // 2, 2), k.view(B, H, T, D // 2, 2)
    rotr, roti = torch.cos(freqs * ts), torch.sin(freqs * ts)
    qo = torch.stack([q[..., 0] * rotr - q[..., 1] * roti, q[..., 0] * roti + q[..., 1] * rotr], dim=-1)
    ko = torch.stack([k[..., 0] * rotr - k[..., 1] * roti, k[..., 0] * roti + k[..., 1] * rotr], dim=-1)
    return qo.view(B, H, T, D), ko.view(B, H, T, D)


class RingKVCache:
    def __init__(self, batch_size, num_heads, dim_per_head, capacity, dtype=torch.float32):
        self.capacity = capacity
        self.cache = torch.zeros((2, batch_size, num_heads, capacity, dim_per_head), dtype=dtype)
        self.end_offset = torch.zeros(1, dtype=torch.long)

    def complete(self, k, v):
        B, H, T, D = k.shape
        indexes = torch.arange(T, dtype=self.end_offset.dtype) + self.end_offset
        indexes = indexes % self.capacity
        self.cache[0].index_copy_(2, indexes, k)
        self.cache[1].index_copy_(2, indexes, v)
        keys, values = self.cache[0], self.cache[1]
        indexes = torch.arange(self.capacity, dtype=torch.long)
        if FIXED:
            # end_index correspond to the actual index where the last value was written.
            last_offset = self.end_offset + T - 1
            end_index = last_offset % self.capacity
            delta = indexes - end_index
            positions = torch.where(delta <= 0, last_offset + delta, last_offset + delta - self.capacity)
            self.end_offset.add_(T)
            invalid = indexes >= self.end_offset
        else:
            self.end_offset.add_(T)
            invalid = indexes >= self.end_offset
            end_index = self.end_offset % self.capacity
            delta = indexes - end_index
            positions = torch.where(delta <= 0, self.end_offset + delta, self.end_offset + delta - self.capacity)
        positions = torch.where(invalid, torch.full_like(positions, -1), positions)
        return keys, values, positions


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, causal=True, context=None):
        super().__init__()
        self.embed_dim, self.num_heads, self.causal, self.context = embed_dim, num_heads, causal, context
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self._streaming_state = None

    def streaming(self, batch_size):
        kv_cache = RingKVCache(batch_size, self.num_heads, self.embed_dim // self.num_heads, self.context)
        self._streaming_state = {"kv_cache": kv_cache, "offset": torch.zeros(1, dtype=torch.long)}

    def forward(self, query):
        state = self._streaming_state
        B, T, _ = query.shape
        offset = torch.zeros(1, dtype=torch.long) if state is None else state["offset"]
        q, k, v = self.in_proj(query).view(B, T, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)  # p b h t d
        q, k = apply_rope(q, k, offset)
        if state is None:
            pos_k = torch.arange(T, dtype=torch.long)
        else:
            k, v, pos_k = state["kv_cache"].complete(k, v)
        pos_k = pos_k.view(1, -1)
        pos_q = offset + torch.arange(T, dtype=torch.long).view(-1, 1)
        delta = pos_q - pos_k
        attn_bias = (pos_k >= 0) & (delta >= 0)
        if self.context is not None:
            attn_bias = attn_bias & (delta < self.context)
        x = F.scaled_dot_product_attention(q, k, v, attn_bias, dropout_p=0.0)
        x = self.out_proj(x.transpose(1, 2).reshape(B, T, -1))
        if state is not None:
            state["offset"].add_(T)
        return x


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model, num_heads, dim_feedforward, context):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads, causal=True, context=context)
        self.gating = nn.Sequential(nn.Linear(d_model, dim_feedforward), nn.GELU(), nn.Linear(dim_feedforward, d_model))

    def forward(self, x):
        x = x + self.self_attn(self.norm1(x))
        return x + self.gating(self.norm2(x))


class LMModel(nn.Module):
    """Temporal transformer over the sum of the text and audio codebook embeddings of each step."""

    def __init__(self, n_q=2, card=64, text_card=40, dim=32, num_heads=4, num_layers=2, context=4):
        super().__init__()
        self.emb = nn.ModuleList(nn.Embedding(card + 1, dim) for _ in range(n_q))
        self.text_emb = nn.Embedding(text_card + 1, dim)
        self.layers = nn.ModuleList(StreamingTransformerLayer(dim, num_heads, 2 * dim, context) for _ in range(num_layers))
        self.text_linear = nn.Linear(dim, text_card)

    def streaming(self, batch_size):
        for layer in self.layers:
            layer.self_attn.streaming(batch_size)

    def forward(self, codes):
        # codes: (B, 1 + n_q, T), text stream first
        x = self.text_emb(codes[:, 0]) + sum(emb(codes[:, 1 + i]) for i, emb in enumerate(self.emb))
        for layer in self.layers:
            x = layer(x)
        return self.text_linear(x)


def main():
    torch.manual_seed(0)
    lm = LMModel(context=4).eval()
    T = 10
    codes = torch.cat([torch.randint(0, 40, (1, 1, T)), torch.randint(0, 64, (1, 2, T))], dim=1)
    with torch.no_grad():
        reference = lm(codes)  # whole sequence at once, same causal context window of 4 steps
        lm.streaming(batch_size=1)
        steps = [lm(codes[:, :, t : t + 1]) for t in range(T)]  # streaming, one step at a time
    streamed = torch.cat(steps, dim=1)
    per_step = (streamed - reference).abs().amax(dim=(0, 2))
    print(f"{'fixed' if FIXED else 'buggy'}: max |streaming - full| per step = "
          + " ".join(f"{d:.1e}" for d in per_step.tolist()))


if __name__ == "__main__":
    main()
