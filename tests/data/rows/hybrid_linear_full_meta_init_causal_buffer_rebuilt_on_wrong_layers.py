# The executorch#18380 bug written another way: a hybrid model whose layers are of two kinds (config.layer_types:
# three linear-attention layers, then one full-attention layer, as Qwen3-Next / Qwen3.5 interleave them) is built on
# the meta device, materialised with to_empty() and its buffers zero-filled, and the runner then rebuilds the causal
# mask buffers of the full-attention layers only. It picks them by `i % full_attention_interval == 0`, which names the
# first linear-attention layer of each group instead (the full ones are at (i + 1) % interval == 0): the full-attention
# layers keep an all-False bool mask, and their eager softmax over the static cache sees no slot at all.
# The fix reads the layer's own kind (config.layer_types[i]), as executorch 07b7c7e reads hasattr(layer.attn, "mask").
import math
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class HybridConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_heads: int = 4
    max_cache_len: int = 12
    full_attention_interval: int = 4
    layer_types: list = field(default_factory=lambda: ["linear_attention"] * 3 + ["full_attention"]
                              + ["linear_attention"] * 3 + ["full_attention"])


class LinearAttention(nn.Module):
    """A gated linear recurrence (no softmax, no mask): state = decay * state + k v^T, out = q state."""

    def __init__(self, c):
        super().__init__()
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.decay = nn.Parameter(torch.full((c.hidden_size,), 0.9))
        self.register_buffer("state", torch.zeros(2, c.hidden_size, c.hidden_size), persistent=False)
        self.o = nn.Linear(c.hidden_size, c.hidden_size, bias=False)

    def forward(self, x, input_pos):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        outs = []
        for t in range(x.shape[1]):
            self.state = self.decay[:, None] * self.state + k[:, t, :, None] * v[:, t, None, :]
            outs.append(torch.einsum("bd,bde->be", q[:, t], self.state))
        return self.o(torch.stack(outs, 1))


class FullAttention(nn.Module):
    """Eager softmax attention over a static KV cache; the causal bool mask is a buffer indexed by input_pos."""

    def __init__(self, c):
        super().__init__()
        self.h, self.d = c.num_heads, c.hidden_size // c.num_heads
        self.qkv = nn.Linear(c.hidden_size, 3 * c.hidden_size, bias=False)
        self.o = nn.Linear(c.hidden_size, c.hidden_size, bias=False)
        self.register_buffer("k_cache", torch.zeros(2, self.h, c.max_cache_len, self.d), persistent=False)
        self.register_buffer("v_cache", torch.zeros(2, self.h, c.max_cache_len, self.d), persistent=False)
        self.register_buffer("causal_mask", torch.ones(c.max_cache_len, c.max_cache_len, dtype=torch.bool).tril(),
                             persistent=False)

    def forward(self, x, input_pos):
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.h, self.d).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        self.k_cache[:, :, input_pos] = k
        self.v_cache[:, :, input_pos] = v
        scores = q @ self.k_cache.transpose(-1, -2) / math.sqrt(self.d)  # (B, H, T, max_cache_len)
        allowed = self.causal_mask[input_pos][None, None]  # (1, 1, T, max_cache_len)
        weights = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
        return self.o((weights @ self.v_cache).transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, c, kind):
        super().__init__()
        self.kind = kind
        self.norm1, self.norm2 = nn.LayerNorm(c.hidden_size), nn.LayerNorm(c.hidden_size)
        self.mixer = FullAttention(c) if kind == "full_attention" else LinearAttention(c)
        self.mlp = nn.Sequential(nn.Linear(c.hidden_size, 64), nn.GELU(), nn.Linear(64, c.hidden_size))

    def forward(self, x, input_pos):
        x = x + self.mixer(self.norm1(x), input_pos)
        return x + self.mlp(self.norm2(x))


class HybridLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c, kind) for kind in c.layer_types)
        self.head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, tokens, input_pos):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x, input_pos)
        return self.head(x)


def materialize(model, c):
    """Meta-device model to CPU for export: to_empty, zero every buffer, rebuild the full-attention causal masks."""
    model.to_empty(device="cpu")
    for _, buf in model.named_buffers():
        buf.zero_()
    for i, layer in enumerate(model.layers):
        full = c.layer_types[i] == "full_attention" if FIXED else i % c.full_attention_interval == 0
        if full and hasattr(layer.mixer, "causal_mask"):
            layer.mixer.causal_mask.copy_(torch.ones(c.max_cache_len, c.max_cache_len, dtype=torch.bool).tril())
    return model


config = HybridConfig()
reference = HybridLM(config).eval()
weights = {k: v.clone() for k, v in reference.state_dict().items()}
with torch.device("meta"):
    model = HybridLM(config)
model = materialize(model, config)
model.load_state_dict(weights, strict=True)
model.eval()


def generate(m, prompt, steps):
    out = []
    with torch.no_grad():
        logits = m(prompt, torch.arange(prompt.shape[1]))
        tok = logits[:, -1:].argmax(-1)
        for i in range(steps):
            out.append(tok)
            logits = m(tok, torch.tensor([prompt.shape[1] + i]))
            tok = logits[:, -1:].argmax(-1)
    return torch.cat(out, 1)


prompt = torch.tensor([[4, 9, 21, 7, 33], [12, 5, 5, 40, 18]])
print("reference:", generate(reference, prompt, 4).tolist())
print("exported: ", generate(model, prompt, 4).tolist())
print("full-attention mask all False:", [bool((~l.mixer.causal_mask).all()) for l in model.layers
                                         if l.kind == "full_attention"])
