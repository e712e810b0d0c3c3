# d2l.ai, d2l-ai/d2l-en#2423 ("masked_softmax function fixed bugs when valid length is 0"): with valid_len == 0 every
# score is filled with -1e6, so softmax returns uniform weights over padded keys instead of zeros (PR closed unmerged;
# --fixed zeroes those rows after the softmax as the PR describes).
import math
import sys
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def sequence_mask(X, valid_len, value=0):
    """Mask irrelevant entries in sequences."""
    maxlen = X.size(1)
    mask = torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
    X[~mask] = value
    return X


def masked_softmax(X, valid_lens):
    """Perform softmax operation by masking elements on the last axis."""
    # X: 3D tensor, valid_lens: 1D or 2D tensor
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    else:
        shape = X.shape
        if valid_lens.dim() == 1:
            valid_lens = torch.repeat_interleave(valid_lens, shape[1])
        else:
            valid_lens = valid_lens.reshape(-1)
        # On the last axis, replace masked elements with a very large negative value, whose exponentiation outputs 0
        X = sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
        X = nn.functional.softmax(X.reshape(shape), dim=-1)
        if FIXED:
            # rows whose valid length is 0 get all-zero attention weights
            X = X * (valid_lens.reshape(shape[:-1]) > 0).unsqueeze(-1).to(X.dtype)
        return X


class DotProductAttention(nn.Module):
    """Scaled dot product attention."""

    def __init__(self, dropout):
        super().__init__()
        self.dropout = nn.Dropout(dropout)

    # Shape of queries: (batch_size, no. of queries, d)
    # Shape of keys: (batch_size, no. of key-value pairs, d)
    # Shape of values: (batch_size, no. of key-value pairs, value dimension)
    # Shape of valid_lens: (batch_size,) or (batch_size, no. of queries)
    def forward(self, queries, keys, values, valid_lens=None):
        d = queries.shape[-1]
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(d)
        self.attention_weights = masked_softmax(scores, valid_lens)
        return torch.bmm(self.dropout(self.attention_weights), values)


batch, num_q, num_kv, d = 3, 4, 6, 8
queries = torch.randn(batch, num_q, d)
keys = torch.randn(batch, num_kv, d)
values = torch.randn(batch, num_kv, d)
valid_lens = torch.tensor([6, 3, 0])  # the last sequence in the batch is empty (all keys are padding)

attention = DotProductAttention(dropout=0.0)
attention.eval()
out = attention(queries, keys, values, valid_lens)
print("attention weight mass on padded keys of the empty sequence:",
      attention.attention_weights[2].sum().item())
print("max |output| of the empty sequence (expected 0):", out[2].abs().max().item())
