# Follows facebookresearch/fairseq fairseq/models/transformer/transformer_decoder.py (extract_features_scriptable with
# incremental_state, buffered_future_mask) and modules/multihead_attention.py (prev_key cache, key_padding_mask True = pad).
# Sources are LEFT-padded (left_pad_source=True); positions come from utils.make_positions, so pads take no position.
import math
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
D, H, PAD = 32, 4, 1
V = 20


def make_positions(tokens, padding_idx):
    mask = tokens.ne(padding_idx).int()
    return (torch.cumsum(mask, dim=1).type_as(mask) * mask).long() + padding_idx


def sinusoidal(positions):
    half = D // 2
    emb = math.log(10000) / (half - 1)
    freqs = torch.exp(torch.arange(half, dtype=torch.float64) * -emb)
    ang = positions.double()[..., None] * freqs
    return torch.cat([ang.sin(), ang.cos()], -1) * positions.ne(PAD)[..., None]


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D).double() for _ in range(4))

    def forward(self, query, key, key_padding_mask=None, attn_mask=None, incremental_state=None, name=None, static_kv=False):
        b, tq, _ = query.shape
        q = self.q(query).view(b, tq, H, -1).transpose(1, 2) * (D // H) ** -0.5
        saved = incremental_state.get(name) if incremental_state is not None else None
        if saved is not None and static_kv:
            k, v = saved["prev_key"], saved["prev_value"]
        else:
            k = self.k(key).view(b, -1, H, D // H).transpose(1, 2)
            v = self.v(key).view(b, -1, H, D // H).transpose(1, 2)
            if saved is not None:
                k = torch.cat([saved["prev_key"], k], 2)
                v = torch.cat([saved["prev_value"], v], 2)
        if incremental_state is not None:
            incremental_state[name] = {"prev_key": k, "prev_value": v}
        s = q @ k.transpose(-1, -2)
        if attn_mask is not None:
            s = s + attn_mask  # float future mask, -inf above the diagonal
        if key_padding_mask is not None:
            s = s.masked_fill(key_padding_mask[:, None, None, :], float("-inf"))
        return self.o((F.softmax(s, -1) @ v).transpose(1, 2).reshape(b, tq, D))


emb = nn.Embedding(V, D, padding_idx=PAD).double()
enc_attn, self_attn, cross_attn = MHA(), MHA(), MHA()
out_proj = nn.Linear(D, V).double()


def encode(src):
    x = emb(src) + sinusoidal(make_positions(src, PAD))
    pad = src.eq(PAD)
    x = x + enc_attn(x, x, key_padding_mask=pad)
    return x, pad


def buffered_future_mask(t):
    return torch.triu(torch.full((t, t), float("-inf"), dtype=torch.float64), 1)


def decode(prev, enc_out, enc_pad, incremental_state=None):
    positions = make_positions(prev, PAD)
    if incremental_state is not None:
        prev, positions = prev[:, -1:], positions[:, -1:]
    x = emb(prev) + sinusoidal(positions)
    mask = buffered_future_mask(x.shape[1]) if incremental_state is None else None
    x = x + self_attn(x, x, attn_mask=mask, incremental_state=incremental_state, name="self")
    x = x + cross_attn(x, enc_out, key_padding_mask=enc_pad, incremental_state=incremental_state, name="cross", static_kv=True)
    return out_proj(x)


srcs = [torch.tensor([5, 6, 7, 8, 9, 10, 2]), torch.tensor([11, 12, 2]), torch.tensor([13, 14, 15, 2])]
S = max(len(s) for s in srcs)
src = torch.full((len(srcs), S), PAD)
for i, s in enumerate(srcs):
    src[i, S - len(s):] = s  # left padding
steps = 6
prev = torch.full((len(srcs), 1), 2)  # EOS as BOS, as fairseq does
with torch.no_grad():
    enc_out, enc_pad = encode(src)
    state = {}
    logits = []
    for t in range(steps):
        lp = decode(prev, enc_out, enc_pad, state)[:, -1]
        logits.append(lp)
        prev = torch.cat([prev, lp.argmax(-1, keepdim=True).clamp_min(3)], 1)
    logits = torch.stack(logits, 1)
    diff = 0.0
    for i, s in enumerate(srcs):
        e, p = encode(s[None])
        ref = decode(prev[i:i + 1, :steps], e, p)  # full teacher-forced pass, no cache, no padding
        diff = max(diff, (logits[i] - ref[0]).abs().max().item())
print("max |incremental left-padded batch - full unpadded pass| =", diff)
assert diff < 1e-12
