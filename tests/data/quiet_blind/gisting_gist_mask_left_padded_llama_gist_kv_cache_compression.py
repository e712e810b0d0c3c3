"""Gist tokens (Mu, Li & Goodman 2023), as jayelm/gisting writes them: src/gist.py
make_gist_mask / make_mask_pre_first_gist / make_mask_post_last_gist (the 4D mask, ANDed with
`inputs != pad_token`), src/gist_llama.py (the 4D gist mask combined with the causal mask; position
ids from the padding mask here, as transformers' generate computes them), and gist caching (GistActivations: keep only the gist
tokens' keys/values, then decode the input + completion against them at their own positions).

Sequence: [instruction ..., G, G, input ..., completion ...], left padded with pad_token.
By design tokens after the last gist cannot see the instruction before the first gist: the
instruction is compressed into the gist tokens. Left-pad query rows see no key at all (the pad
key is masked and causality hides the rest); the additive finfo.min mask makes them uniform
garbage that nothing reads.

Checks: (1) each row of the padded batch equals the example alone, unpadded; (2) the logits
after the gist equal a run that caches only the gist tokens' K/V (instruction dropped), as
gist caching does; (3) changing the instruction changes post-gist logits only through the
gist activations (so the check in (2) is not vacuous).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, D, H, NL = 40, 32, 4, 2
PAD, GIST = 0, 1


def reverse_cumsum(x):
    return x + torch.sum(x, dim=-1, keepdims=True) - torch.cumsum(x, dim=-1)


def make_mask_pre_first_gist(inputs, gist_token, dtype=torch.int64):
    return ((inputs == gist_token).cumsum(-1) >= 1).type(dtype)


def make_mask_post_last_gist(inputs, gist_token, dtype=torch.int64):
    return (reverse_cumsum(inputs == gist_token) >= 1).type(dtype)


def make_gist_mask(inputs, gist_token, pad_token=None, dtype=torch.int64):
    pre_gist_mask = make_mask_post_last_gist(inputs, gist_token, dtype=torch.bool)[:, None, None]
    post_gist_mask = make_mask_pre_first_gist(inputs, gist_token, dtype=torch.bool)[:, None, None]
    pre_gist_time_mask = pre_gist_mask.permute((0, 1, 3, 2))
    mask = torch.where(pre_gist_time_mask, pre_gist_mask, post_gist_mask)
    has_gist = (inputs == gist_token).any(-1)[:, None, None, None]
    mask = torch.where(has_gist, mask, True)
    if pad_token is not None:
        mask = mask & (inputs != pad_token)[:, None, None]
    return mask.type(dtype)


def rope(x, pos):  # x (B,H,T,d), pos (B,T)
    d = x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).double() / d))
    ang = pos[:, None, :, None].double() * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.o = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, D, bias=False)
        self.mlp = nn.Sequential(nn.Linear(D, 64), nn.SiLU(), nn.Linear(64, D))

    def forward(self, x, pos, bias, past=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, H, D // H).permute(2, 0, 3, 1, 4)
        q, k = rope(q, pos), rope(k, pos)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        a = torch.softmax(q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias, -1) @ v
        x = x + self.o(a.transpose(1, 2).reshape(B, T, D))
        return x + self.mlp(self.n2(x)), (k, v)


class GistLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(V, D), nn.ModuleList([Layer() for _ in range(NL)]), nn.Linear(D, V)

    def forward(self, ids, pos, allowed, past=None):  # allowed: (B,1,T,S) bool
        bias = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float64).min)
        x, kv = self.emb(ids), []
        for i, layer in enumerate(self.layers):
            x, c = layer(x, pos, bias, None if past is None else past[i])
            kv.append(c)
        return self.head(x), kv


model = GistLM().eval()
examples = []
for n_instr, n_rest in [(7, 6), (3, 4), (5, 2)]:
    examples.append(torch.cat([torch.randint(2, V, (n_instr,)), torch.tensor([GIST, GIST]), torch.randint(2, V, (n_rest,))]))
L = max(len(e) for e in examples)
ids = torch.full((3, L), PAD)
for b, e in enumerate(examples):
    ids[b, L - len(e):] = e                                   # left padded
attention_mask = (ids != PAD).long()
position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)


def full_mask(ids):
    T = ids.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    return make_gist_mask(ids, GIST, PAD).bool() & causal


with torch.no_grad():
    logits, _ = model(ids, position_ids, full_mask(ids))
    d1 = d2 = 0.0
    moved = 0.0
    for b, e in enumerate(examples):
        T = len(e)
        alone, _ = model(e[None], torch.arange(T)[None], full_mask(e[None]))
        d1 = max(d1, (alone[0] - logits[b, L - T:]).abs().max().item())
        # gist caching: run instruction + gists, keep the gist K/V only, decode the rest
        g0 = (e == GIST).nonzero()[0].item()
        g1 = g0 + 2
        _, kv = model(e[None, :g1], torch.arange(g1)[None], full_mask(e[None, :g1]))
        gist_kv = [(k[:, :, g0:g1], v[:, :, g0:g1]) for k, v in kv]
        rest = e[None, g1:]
        R = rest.shape[1]
        allowed = torch.cat([torch.ones(R, 2, dtype=torch.bool), torch.ones(R, R, dtype=torch.bool).tril()], 1)
        cached, _ = model(rest, torch.arange(g1, T)[None], allowed[None, None], past=gist_kv)
        d2 = max(d2, (cached[0] - alone[0, g1:]).abs().max().item())
        # (3) another instruction changes the post-gist logits (through the gists only)
        e2 = e.clone()
        e2[:g0] = torch.randint(2, V, (g0,))
        other, _ = model(e2[None], torch.arange(T)[None], full_mask(e2[None]))
        moved = max(moved, (other[0, g1:] - alone[0, g1:]).abs().max().item())

print(f"left-padded batch vs each example alone: max diff = {d1:.3e}")
print(f"post-gist logits vs gist-only KV cache: max diff = {d2:.3e}")
print(f"post-gist logits move when the instruction changes: {moved:.3e}")
assert d1 < 1e-12 and d2 < 1e-12 and moved > 1e-3
