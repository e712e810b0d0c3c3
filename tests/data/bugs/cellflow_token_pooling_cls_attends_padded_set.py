# theislab/CellFlow#226 (fixed by theislab/CellFlow#241): TokenAttentionPooling prepends a learned [CLS] token and
# builds token_mask = ones, copying the set mask only into [1:, 1:]; the CLS row stays all ones, so the pooled
# embedding attends to padded set elements and the mask has no effect. (Flax code ported to torch.)
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def dot_product_attention(query, key, value, mask):
    """flax.linen.dot_product_attention: mask True = attend, masked logits set to finfo.min."""
    depth = query.shape[-1]
    logits = torch.einsum("bqhd,bkhd->bhqk", query / depth**0.5, key)
    logits = torch.where(mask.bool(), logits, torch.finfo(logits.dtype).min)
    weights = torch.softmax(logits, dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", weights, value)


class MultiHeadDotProductAttention(nn.Module):
    def __init__(self, in_dim, num_heads, qkv_features):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, qkv_features // num_heads
        self.query = nn.Linear(in_dim, qkv_features)
        self.key = nn.Linear(in_dim, qkv_features)
        self.value = nn.Linear(in_dim, qkv_features)
        self.out = nn.Linear(qkv_features, in_dim)

    def forward(self, x, mask):
        b, n, _ = x.shape
        q = self.query(x).view(b, n, self.num_heads, self.head_dim)
        k = self.key(x).view(b, n, self.num_heads, self.head_dim)
        v = self.value(x).view(b, n, self.num_heads, self.head_dim)
        return self.out(dot_product_attention(q, k, v, mask).reshape(b, n, -1))


class TokenAttentionPooling(nn.Module):
    """Multi-head attention which aggregates sets by learning a token."""

    def __init__(self, input_dim, num_heads=4, qkv_dim=32):
        super().__init__()
        self.class_token = nn.Embedding(1, input_dim)
        self.attention = MultiHeadDotProductAttention(input_dim, num_heads, qkv_dim)

    def forward(self, x, mask):
        # add token
        token_shape = (len(x), 1)
        class_token = self.class_token(torch.zeros(token_shape, dtype=torch.long))
        z = torch.cat((class_token, x), dim=-2)
        token_mask = torch.ones((x.shape[0], 1, x.shape[1] + 1, x.shape[1] + 1))
        token_mask[:, :, 1:, 1:] = mask
        if FIXED:
            cls_token_to_data = mask[0, 0, :, :].sum(dim=0) > 0
            token_mask[:, :, 0, 1:] = cls_token_to_data.float()
            token_mask[:, :, 1:, 0] = cls_token_to_data.float()
        z = self.attention(z, token_mask)
        # only continue with the CLS token (position 0)
        return z[:, 0, :]


# a batch of condition sets (e.g. drug combinations) padded to max_combination_length=4, 2 real elements each
input_dim, max_len = 16, 4
conditions = torch.randn(2, max_len, input_dim)
valid = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
conditions[~valid] = 0.0  # padded elements are filled with 0s, as in the data loader
mask = (valid[:, None, :, None] & valid[:, None, None, :]).float()  # (batch, 1, set, set)

pool = TokenAttentionPooling(input_dim).eval()
with torch.no_grad():
    pooled = pool(conditions, mask)
    # reference: the same module over the unpadded sets only
    ref = pool(conditions[:, :2], torch.ones(2, 1, 2, 2))

print("fixed" if FIXED else "buggy", "pooled[0,:4]", [round(v, 4) for v in pooled[0, :4].tolist()])
print("max |pooled - pooled over unpadded sets| =", (pooled - ref).abs().max().item())
