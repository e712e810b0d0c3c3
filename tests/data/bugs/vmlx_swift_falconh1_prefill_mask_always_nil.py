"""vmlx-swift FalconH1: a private createAttentionMask returns nil, so prefill is bidirectional.

Citation: osaurus-ai/vmlx-swift PR #185 "FalconH1: build a causal attention mask for
prefill (fixes degenerate/never-stopping generation)" (merged; description read, which
quotes the buggy helper):
    private func createAttentionMask(h: MLXArray, cache: [KVCache]?) -> MLXArray? {
        let N = h.dim(1)
        if N == 1 { return nil }
        return nil  // "Will be handled by SDPA internally when nil"  <- not true
    }
"`scaledDotProductAttention` does not apply causal masking for a nil MLXArray mask --
nil means no mask (full, bidirectional attention). So every multi-token prefill, and
every teacher-forced logprob pass, ran bidirectional attention."
Fix: "makes the local helper do the same" as the shared one: `createCausalMask(...)`
for t > 1 (offset by the cache), nil only for single-token decode.

Reproduction: a Swift/MLX -> torch port of FalconH1's attention path (the Mamba-2 mixer
of the hybrid block is left out), `createAttentionMask(h, cache)` feeding the layers,
SDPA given the mask or None, a KV cache; a 5-token prompt prefilled then 2 decode
steps, compared with a plain causal forward over all 7 tokens.
"""
import sys
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class KVCacheSimple:
    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset += keys.shape[2]
        return self.keys, self.values


def createCausalMask(n: int, offset: int) -> torch.Tensor:
    rinds = torch.arange(offset + n)
    linds = torch.arange(offset, offset + n)
    return linds[:, None] >= rinds[None, :]


def createAttentionMask(h: torch.Tensor, cache: Optional[List[KVCacheSimple]]) -> Optional[torch.Tensor]:
    N = h.shape[1]
    if N == 1:
        return None
    if FIXED:
        offset = cache[0].offset if cache else 0
        return createCausalMask(N, offset)
    return None  # "Will be handled by SDPA internally when nil"


class FalconH1Attention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x, mask, cache: Optional[KVCacheSimple]):
        B, L, D = x.shape
        q = self.q_proj(x).view(B, L, self.num_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_heads, -1).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, D))


class FalconH1DecoderLayer(nn.Module):
    def __init__(self, hidden_size=32):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden_size)
        self.self_attn = FalconH1Attention(hidden_size)
        self.pre_ff_layernorm = nn.RMSNorm(hidden_size)
        self.feed_forward = nn.Sequential(nn.Linear(hidden_size, 64), nn.SiLU(), nn.Linear(64, hidden_size))

    def forward(self, h, mask, cache):
        h = h + self.self_attn(self.input_layernorm(h), mask, cache)
        return h + self.feed_forward(self.pre_ff_layernorm(h))


class FalconH1Model(nn.Module):
    def __init__(self, vocab_size=50, hidden_size=32, num_layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.layers = nn.ModuleList([FalconH1DecoderLayer(hidden_size) for _ in range(num_layers)])
        self.final_layernorm = nn.RMSNorm(hidden_size)

    def forward(self, inputs, cache: Optional[List[KVCacheSimple]] = None, mask=None):
        h = self.embed_tokens(inputs)
        if mask is None:
            mask = createAttentionMask(h, cache)
        for i, layer in enumerate(self.layers):
            h = layer(h, mask, cache[i] if cache is not None else None)
        return self.final_layernorm(h)


def main():
    torch.manual_seed(0)
    model = FalconH1Model().eval()
    tokens = torch.tensor([[4, 19, 33, 7, 12, 40, 2]])
    with torch.no_grad():
        reference = model(tokens, mask=torch.tril(torch.ones(7, 7, dtype=torch.bool)))
        cache = [KVCacheSimple() for _ in model.layers]
        prefill = model(tokens[:, :5], cache=cache)
        steps = [model(tokens[:, t:t + 1], cache=cache) for t in (5, 6)]
    generated = torch.cat([prefill] + steps, dim=1)
    diff = (generated - reference).abs().max().item()
    print("fixed" if FIXED else "buggy", "prefill+decode vs causal reference max diff:", f"{diff:.2e}")


if __name__ == "__main__":
    main()
