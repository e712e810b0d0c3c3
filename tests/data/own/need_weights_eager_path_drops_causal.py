# Written another way (huggingface/transformers#30652's bug): a GPT-NeoX style decoder whose mask builder returns None
# for a batch without padding (SDPA's is_causal then does the causal part), but whose attention, asked for its weights
# (return_weights=True), runs its own softmax path, which reads only the mask it is handed: with None it masks nothing,
# though the module keeps causal = True. The fix keeps the mask whenever the weights are asked for.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DIM, HEADS, VOCAB = 48, 3, 64


class NeoXAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.causal = True
        self.query_key_value = nn.Linear(DIM, 3 * DIM)
        self.dense = nn.Linear(DIM, DIM)

    def forward(self, x, bias, return_weights):
        b, n, _ = x.shape
        q, k, v = self.query_key_value(x).view(b, n, HEADS, 3, DIM // HEADS).permute(3, 0, 2, 1, 4)
        if return_weights:  # the eager path: the weights are a result
            scores = q @ k.transpose(-1, -2) / (DIM // HEADS) ** 0.5
            if bias is not None:
                scores = scores + bias
            weights = scores.softmax(-1)
            out = weights @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=bias is None and n > 1)
            weights = None
        return self.dense(out.transpose(1, 2).reshape(b, n, DIM)), weights


def additive_bias(padding, n, return_weights):
    """(B, 1, n, n) float bias (0 = attend, min = hidden), or None where SDPA's is_causal suffices."""
    if padding.all() and not (FIXED and return_weights):
        return None
    keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & padding[:, None, None, :].bool()
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)


class NeoX(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed_in = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([NeoXAttention() for _ in range(2)])

    def forward(self, ids, padding, return_weights=False):
        x = self.embed_in(ids)
        bias = additive_bias(padding, ids.shape[1], return_weights)
        every = []
        for layer in self.layers:
            y, w = layer(x, bias, return_weights)
            x = x + y
            every.append(w)
        return x, every


model = NeoX().eval()
ids = torch.randint(0, VOCAB, (3, 10))
padding = torch.ones(3, 10, dtype=torch.long)
with torch.no_grad():
    plain, _ = model(ids, padding)
    weighed, weights = model(ids, padding, return_weights=True)
print(f"weight on later tokens = {weights[0].triu(1).sum(-1).max().item():.6f}")
print(f"max |hidden with weights - hidden| = {(weighed - plain).abs().max().item():.6f}")
