# The onnxscript#2479 bug written another way: a backend without a fused attention kernel registers its own
# decomposition of scaled_dot_product_attention (as torch._decomp / a TensorRT or TVM converter table does), run here
# eagerly in bfloat16 on a (batch, time, heads, dim) model: the bool mask becomes where(mask, 0, -inf) added to the
# scores before a plain softmax. A left-padded prompt's pad queries see no key under causal & padding, so their rows
# are NaN (aten's SDPA gives them 0), and the next layer's real queries read those NaN keys and values.
# The fix: the decomposition zeroes the NaN rows after the softmax (nan_to_num), matching aten.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
CONFIG = {"vocab": 48, "hidden": 48, "heads": 3, "layers": 3, "dtype": torch.bfloat16, "pad_token_id": 0}

DECOMPOSITIONS = {}


def register(op):
    def wrap(fn):
        DECOMPOSITIONS[op] = fn
        return fn
    return wrap


@register("aten::scaled_dot_product_attention")
def sdpa_decomposed(query, key, value, attn_mask=None, scale=None):
    """query/key/value (B, H, L, D); attn_mask bool (B, 1, Lq, Lk), True = attend."""
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key) * scale
    if attn_mask is not None:
        bias = torch.where(attn_mask, torch.tensor(0.0, dtype=logits.dtype),
                           torch.tensor(float("-inf"), dtype=logits.dtype))
        logits = logits + bias
    probs = torch.softmax(logits, dim=-1)
    if FIXED:
        probs = torch.nan_to_num(probs, nan=0.0)  # rows with no key: 0, as aten's kernel gives them
    return torch.einsum("bhqk,bhkd->bhqd", probs, value)


class SelfAttention(nn.Module):
    def __init__(self, hidden, heads, attention_fn):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.wqkv = nn.Linear(hidden, 3 * hidden, bias=False)
        self.wo = nn.Linear(hidden, hidden, bias=False)
        self.attention_fn = attention_fn

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.wqkv(x).view(B, T, 3, self.heads, self.head_dim).unbind(2)  # each (B, T, H, D)
        out = self.attention_fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, C))


class Layer(nn.Module):
    def __init__(self, hidden, heads, attention_fn):
        super().__init__()
        self.attn = SelfAttention(hidden, heads, attention_fn)
        self.norm1, self.norm2 = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x), mask)
        return x + self.mlp(self.norm2(x))


class LM(nn.Module):
    def __init__(self, config, attention_fn):
        super().__init__()
        self.config = config
        self.tok = nn.Embedding(config["vocab"], config["hidden"])
        self.layers = nn.ModuleList(Layer(config["hidden"], config["heads"], attention_fn)
                                    for _ in range(config["layers"]))

    def forward(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        x = self.tok(input_ids)
        keep = torch.tril(torch.ones(T, T, dtype=torch.bool)) & attention_mask.bool()[:, None, :]  # (B, T, T)
        mask = keep[:, None]
        for layer in self.layers:
            x = layer(x, mask)
        return x


ids = torch.tensor([[0, 0, 0, 11, 7, 30, 2],
                    [0, 19, 4, 4, 22, 9, 17],
                    [13, 5, 8, 41, 3, 6, 10]])  # left-padded with the pad id
attention_mask = ids.ne(CONFIG["pad_token_id"]).long()
eager = LM(CONFIG, F.scaled_dot_product_attention).to(CONFIG["dtype"]).eval()
lowered = LM(CONFIG, DECOMPOSITIONS["aten::scaled_dot_product_attention"]).to(CONFIG["dtype"]).eval()
lowered.load_state_dict(eager.state_dict())
with torch.no_grad():
    ref = eager(ids, attention_mask)
    out = lowered(ids, attention_mask)
real = attention_mask.bool()
print("NaN hidden states at real tokens:", int(torch.isnan(out[real]).any(-1).sum()))
print(f"max |lowered - aten| at real tokens: {(out[real].float() - ref[real].float()).abs().max().item():.4f}")
