"""GPT-J-style generation whose model forward numbers each call's tokens from 0, whatever the cache holds.

The same bug as transformers#22416 (RoFormer's cached decoding restarted its rotary positions at 0 on every step),
written another way: the config kept as a dict, a rotary module with an `inv_freq` buffer that hands the attention a
joined `sincos` table (sin then cos on the last axis, as GPT-J's and CodeGen's embed_positions hold it) rotated onto
pairs interleaved every two, a (B, H, T, D) cache grown by torch.cat with its keys stored rotated,
F.scaled_dot_product_attention behind a bool mask (fully masked pad rows unmasked, as transformers does), and two
prompts left-padded (row 0 by 3, row 1 by 0). Before the fix `position_ids = torch.arange(seq_len)`: each decode
step's query and new key are rotated at position 0 while the cache holds the prompt's. The fix counts the real tokens
before each one: `attention_mask.cumsum(-1) - 1`, its last seq_len columns.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONFIG = {"vocab_size": 80, "n_embd": 64, "n_head": 4, "n_layer": 2, "rotary_dim": 16, "pad_token_id": 0}


class SinCos(nn.Module):
    def __init__(self, dim, base=10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2).float() / dim), persistent=False)

    def forward(self, position_ids):  # (B, T) -> (B, T, dim): sin | cos
        angles = position_ids[..., None].float() * self.inv_freq
        return torch.cat([angles.sin(), angles.cos()], dim=-1)


def rotate_every_two(x):
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


def apply_rotary(x, sincos):  # x (B, H, T, D), sincos (B, T, D)
    sin, cos = torch.split(sincos, sincos.shape[-1] // 2, dim=-1)
    sin = sin.repeat_interleave(2, dim=-1)[:, None]
    cos = cos.repeat_interleave(2, dim=-1)[:, None]
    return x * cos + rotate_every_two(x) * sin


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h = cfg["n_head"]
        self.d = cfg["n_embd"] // cfg["n_head"]
        self.qkv = nn.Linear(cfg["n_embd"], 3 * cfg["n_embd"], bias=False)
        self.out = nn.Linear(cfg["n_embd"], cfg["n_embd"], bias=False)

    def forward(self, x, sincos, allowed, layer_past=None):
        b, t, _ = x.shape
        q, k, v = (y.view(b, t, self.h, self.d).transpose(1, 2) for y in self.qkv(x).chunk(3, dim=-1))
        q, k = apply_rotary(q, sincos), apply_rotary(k, sincos)
        if layer_past is not None:
            k = torch.cat([layer_past[0], k], dim=2)
            v = torch.cat([layer_past[1], v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        return self.out(y.transpose(1, 2).reshape(b, t, -1)), (k, v)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln = nn.LayerNorm(cfg["n_embd"])
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg["n_embd"], 4 * cfg["n_embd"]), nn.GELU(),
                                 nn.Linear(4 * cfg["n_embd"], cfg["n_embd"]))

    def forward(self, x, sincos, allowed, layer_past=None):
        h = self.ln(x)
        a, present = self.attn(h, sincos, allowed, layer_past)
        return x + a + self.mlp(h), present


class GPTJ(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg["vocab_size"], cfg["n_embd"])
        self.rotary = SinCos(cfg["rotary_dim"])
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layer"]))
        self.ln_f = nn.LayerNorm(cfg["n_embd"])
        self.head = nn.Linear(cfg["n_embd"], cfg["vocab_size"], bias=False)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        b, t = input_ids.shape
        past = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if FIXED:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        else:
            position_ids = torch.arange(t).expand(b, t)
        sincos = self.rotary(position_ids)
        s = past + t
        causal = torch.ones(t, s, dtype=torch.bool).tril(diagonal=past)
        allowed = causal[None] & attention_mask.bool()[:, None, :]
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # (a pad row that sees nothing sees everything)
        x = self.wte(input_ids)
        presents = []
        for i, block in enumerate(self.blocks):
            x, present = block(x, sincos, allowed, past_key_values[i] if past_key_values is not None else None)
            presents.append(present)
        return self.head(self.ln_f(x)), presents


@torch.no_grad()
def generate(model, input_ids, attention_mask, steps):
    logits, past = model(input_ids, attention_mask)
    out = input_ids
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], dim=-1)
        attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=-1)
        logits, past = model(nxt, attention_mask, past)
    return out


model = GPTJ(CONFIG).eval()
prompts = [torch.randint(1, CONFIG["vocab_size"], (n,)) for n in (5, 8)]
width = max(len(p) for p in prompts)
input_ids = torch.full((2, width), CONFIG["pad_token_id"])
attention_mask = torch.zeros(2, width, dtype=torch.long)
for row, prompt in enumerate(prompts):
    input_ids[row, width - len(prompt):] = prompt
    attention_mask[row, width - len(prompt):] = 1
print(generate(model, input_ids, attention_mask, steps=4)[:, width:].tolist())
