# Quiet: the same shape of model, correct. The 2-D padding mask is kept 2-D until each kind's mask is built from it,
# so the full layers get causal + padding and the sliding ones causal + window + padding. A dict config lists each
# layer's type; a left-padded batch (position 0 of each row's real tokens where its padding ends); SDPA with a bool
# keep mask (no --fixed: both runs are the same program).
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

CONFIG = {"hidden_size": 16, "num_attention_heads": 2, "sliding_window": 3,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}


def keep_4d(mask, length, window=None):
    """(b, 1, t, t) bool keep mask: causal, within `window` keys where one is given, real keys only; a 4-D mask is
    returned as given."""
    if mask.dim() == 4:
        return mask
    i = torch.arange(length)
    allowed = i[None, :] <= i[:, None]
    if window is not None:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return allowed[None, None] & mask[:, None, None, :].bool()


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = CONFIG["num_attention_heads"]
        self.qkv = nn.Linear(CONFIG["hidden_size"], 3 * CONFIG["hidden_size"], bias=False)

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + out.transpose(1, 2).reshape(b, t, d)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = CONFIG
        self.blocks = nn.ModuleList(Block() for _ in CONFIG["layer_types"])

    def forward(self, x, attention_mask):
        t = x.shape[1]
        local = keep_4d(attention_mask, t, self.config["sliding_window"])
        full = keep_4d(attention_mask, t, None)
        for kind, block in zip(self.config["layer_types"], self.blocks):
            x = block(x, local if kind == "sliding_attention" else full)
        return x


model = Model().eval()
x = torch.randn(2, 9, CONFIG["hidden_size"])
attention_mask = torch.tensor([[1] * 9, [0] * 3 + [1] * 6])
with torch.no_grad():
    y = model(x, attention_mask=attention_mask)
print(f"out[1, -1, :3]={[round(v, 4) for v in y[1, -1, :3].tolist()]}")
