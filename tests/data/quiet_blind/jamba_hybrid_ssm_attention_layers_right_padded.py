"""Jamba-style hybrid: SSM mixer layers with an attention layer every attn_layer_period, right-padded batch.

Follows transformers, src/transformers/models/jamba/modeling_jamba.py (JambaConfig.attn_layer_period /
attn_layer_offset decide which layers are attention; JambaAttentionDecoderLayer gets the 4-D causal mask built
from attention_mask; JambaMambaMixer multiplies hidden_states by attention_mask so padded steps do not feed the
scan). Commit: not pinned. Plain torch: a diagonal linear recurrence stands in for the Mamba scan, attention is
SDPA with is_causal=True for the unpadded reference and a bool causal&padding mask for the batch.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, NL, V = 32, 4, 4, 50
ATTN_PERIOD, ATTN_OFFSET = 2, 1  # layers 1 and 3 are attention
PAD = 0


class SSMMixer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(D, 2 * D)
        self.log_a = torch.nn.Parameter(torch.rand(D) * -1.0)
        self.out = torch.nn.Linear(D, D)

    def forward(self, x, attention_mask=None):
        if attention_mask is not None:
            x = x * attention_mask.unsqueeze(-1)
        u, gate = self.inp(x).chunk(2, -1)
        a = torch.sigmoid(self.log_a)
        h = torch.zeros(x.shape[0], D, dtype=x.dtype)
        ys = []
        for t in range(x.shape[1]):  # causal scan, left to right
            h = a * h + (1 - a) * u[:, t]
            ys.append(h)
        return self.out(torch.stack(ys, 1) * F.silu(gate))


class Attn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Linear(D, 3 * D)
        self.o = torch.nn.Linear(D, D)

    def forward(self, x, mask4d=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if mask4d is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask4d)
        return self.o(y.transpose(1, 2).reshape(B, T, D))


class Hybrid(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(V, D)
        self.is_attn = [i % ATTN_PERIOD == ATTN_OFFSET for i in range(NL)]
        self.mixers = torch.nn.ModuleList(Attn() if a else SSMMixer() for a in self.is_attn)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(D) for _ in range(NL))
        self.head = torch.nn.Linear(D, V)

    def forward(self, ids, attention_mask=None):
        T = ids.shape[1]
        mask4d = None
        if attention_mask is not None:
            causal = torch.ones(T, T, dtype=torch.bool).tril()
            mask4d = causal[None, None] & attention_mask.bool()[:, None, None, :]
            # right padding: every query row keeps its own key, so no row is empty
        x = self.emb(ids)
        for a, mixer, norm in zip(self.is_attn, self.mixers, self.norms):
            if a:
                x = x + mixer(norm(x), mask4d)
            else:
                x = x + mixer(norm(x), attention_mask)
        return self.head(x)


model = Hybrid().eval().double()
seqs = [[4, 8, 15, 16, 23, 42], [7, 3], [9, 9, 1, 2]]
T = max(map(len, seqs))
ids = torch.full((len(seqs), T), PAD)
att = torch.zeros(len(seqs), T, dtype=torch.long)
for i, s in enumerate(seqs):
    ids[i, : len(s)] = torch.tensor(s)
    att[i, : len(s)] = 1

with torch.no_grad():
    logits = model(ids, att)
    worst = 0.0
    for i, s in enumerate(seqs):
        ref = model(torch.tensor([s]))  # unpadded, no mask tensor at all
        worst = max(worst, (logits[i, : len(s)] - ref[0]).abs().max().item())
print("attention layers:", [i for i, a in enumerate(model.is_attn) if a])
print("max |right-padded batch - one at a time| =", worst)
assert worst < 1e-10, worst
