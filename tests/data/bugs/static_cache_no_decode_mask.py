"""onnxruntime/mobius#340 (and onnx/onnx#8068): with a static, preallocated KV cache every step attends over all
max_seq_len slots, so the mask must hide the slots not yet written; a decode path that passed no mask (or is_causal,
top-left) let the new token attend to the empty slots' zeros. Written gpt-fast style: the fix indexes the causal mask
by input_pos, causal_mask[None, None, input_pos]."""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
MAX_SEQ = 8


class Attention(nn.Module):
    def __init__(self, dim=8):
        super().__init__()
        self.wqkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("k_cache", torch.zeros(1, 1, MAX_SEQ, dim))
        self.register_buffer("v_cache", torch.zeros(1, 1, MAX_SEQ, dim))

    def forward(self, x, mask, input_pos):
        q, k, v = self.wqkv(x)[:, None].chunk(3, dim=-1)
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        return F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=mask)


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.attention = Attention()
        self.register_buffer("causal_mask", torch.tril(torch.ones(MAX_SEQ, MAX_SEQ, dtype=torch.bool)))

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]
        if not FIXED and len(input_pos) == 1:
            mask = None  # decoding one token: "no mask needed"
        return self.attention(self.embed(idx), mask, input_pos)


torch.manual_seed(0)
model = Transformer().eval()
with torch.no_grad():
    model(torch.tensor([[1, 2, 3]]), torch.arange(3))
    model(torch.tensor([[4]]), torch.tensor([3]))
    model(torch.tensor([[5]]), torch.tensor([4]))
