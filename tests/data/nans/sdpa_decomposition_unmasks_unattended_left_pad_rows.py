# Correct (quiet): the same kind of SDPA decomposition (where(mask, 0, -inf) added to the scores, a plain softmax, no
# NaN guard), run on a left-padded batch whose 4-D mask has its unattended rows unmasked before it is handed on, as
# Hugging Face's AttentionMaskConverter._unmask_unattended does for SDPA: a pad query with no key attends to every
# key instead, its output is never read, and no row's softmax is over all -inf, so no NaN exists to spread.
import torch
import torch.nn as nn

torch.manual_seed(0)
CONFIG = {"vocab": 48, "hidden": 48, "heads": 3, "layers": 3, "pad_token_id": 0}


def sdpa_decomposed(query, key, value, attn_mask=None):
    logits = torch.einsum("bhqd,bhkd->bhqk", query, key) * query.shape[-1] ** -0.5
    if attn_mask is not None:
        logits = logits + torch.where(attn_mask, torch.tensor(0.0), torch.tensor(float("-inf")))
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(logits, dim=-1), value)


class Layer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.wqkv, self.wo = nn.Linear(hidden, 3 * hidden, bias=False), nn.Linear(hidden, hidden, bias=False)
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.SiLU(), nn.Linear(2 * hidden, hidden))

    def forward(self, x, mask):
        B, T, C = x.shape
        q, k, v = self.wqkv(self.norm1(x)).view(B, T, 3, self.heads, C // self.heads).unbind(2)
        out = sdpa_decomposed(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
        x = x + self.wo(out.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.norm2(x))


def unmask_unattended(keep):
    """Rows that see no key (left padding's first queries under causal) attend to every key instead."""
    return keep | ~keep.any(dim=-1, keepdim=True)


class LM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.tok = nn.Embedding(c["vocab"], c["hidden"])
        self.layers = nn.ModuleList(Layer(c["hidden"], c["heads"]) for _ in range(c["layers"]))

    def forward(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        keep = torch.tril(torch.ones(T, T, dtype=torch.bool)) & attention_mask.bool()[:, None, :]
        mask = unmask_unattended(keep)[:, None]
        x = self.tok(input_ids)
        for layer in self.layers:
            x = layer(x, mask)
        return x


ids = torch.tensor([[0, 0, 0, 11, 7, 30, 2],
                    [0, 19, 4, 4, 22, 9, 17],
                    [13, 5, 8, 41, 3, 6, 10]])
attention_mask = ids.ne(CONFIG["pad_token_id"]).long()
with torch.no_grad():
    out = LM(CONFIG).eval()(ids, attention_mask)
print("NaN hidden states:", int(torch.isnan(out).any(-1).sum()))
