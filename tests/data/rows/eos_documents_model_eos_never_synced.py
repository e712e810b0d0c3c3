"""Two packed rows, documents ended by the tokenizer's EOS, masked by a model whose own eos id was never set from it.

Bug: the model's config dict keeps its default `eos_token_id = 0`; its attention (mask_type "block_causal": causal
within each document) cuts the rows at token 0, which the byte tokenizer never emits, so each document attends to the
documents packed before it. Fix: the config takes the tokenizer's `eos_token_id` (257) before the model is built.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class ByteTokenizer:
    eos_token_id = 257  # no pad id: packed rows are never padded

    def encode(self, text):
        return list(text.encode()) + [self.eos_token_id]


class DocumentAttention(nn.Module):
    mask_type = "block_causal"

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, h, documents):
        b, t, w = h.shape
        q, k, v = self.qkv(h).view(b, t, 3, self.heads, w // self.heads).permute(2, 0, 3, 1, 4)
        allowed = torch.ones(t, t, dtype=torch.bool).tril() & (documents[:, :, None] == documents[:, None, :])
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return h + out.transpose(1, 2).reshape(b, t, w)


class PackedModel(nn.Module):
    def __init__(self, config: dict):
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(config["vocab_size"], config["width"])
        self.attention = DocumentAttention(config["width"], 2)

    def forward(self, input_ids):
        ends = (input_ids == self.config["eos_token_id"]).long()
        documents = torch.cumsum(ends, dim=1) - ends  # (an EOS ends its own document)
        return self.attention(self.embed(input_ids), documents)


tokenizer = ByteTokenizer()
config = {"vocab_size": 258, "width": 16, "eos_token_id": 0}
if FIXED:
    config["eos_token_id"] = tokenizer.eos_token_id
model = PackedModel(config)
rows = [tokenizer.encode("abc") + tokenizer.encode("de") + tokenizer.encode("f"),
        tokenizer.encode("ghij") + tokenizer.encode("klm")]
ids = torch.tensor(rows)
torch.manual_seed(0)
with torch.no_grad():
    print("out", round(float(model(ids)[1, -1, 0]), 4))
