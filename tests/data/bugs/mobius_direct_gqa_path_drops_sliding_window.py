# onnxruntime/mobius#371: uniformly sliding-window decoders take the direct GQA path in TextModel.forward, which built
# a global GQAContext that never set local_window_size, so every layer ran full causal attention instead of the window.
import sys
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ArchitectureConfig:
    vocab_size: int = 50
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    num_hidden_layers: int = 2
    sliding_window: int = 4
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "sliding_attention"])


@dataclass
class GQAContext:
    local_window_size: int = -1  # -1: disabled (full causal)


def group_query_attention(q, k, v, past_k, past_v, ctx):
    """Eager stand-in for com.microsoft.GroupQueryAttention: append k/v to the cache, causal + local window."""
    k = torch.cat([past_k, k], dim=2)
    v = torch.cat([past_v, v], dim=2)
    s_q, total = q.shape[2], k.shape[2]
    q_pos = torch.arange(total - s_q, total).view(-1, 1)
    k_pos = torch.arange(total).view(1, -1)
    mask = k_pos <= q_pos
    if ctx.local_window_size > 0:
        mask = mask & (k_pos > q_pos - ctx.local_window_size)
    rep = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask)
    return out, k, v


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.kvh = config.num_attention_heads, config.num_key_value_heads
        self.d = config.hidden_size // self.h
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.kvh * self.d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.kvh * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, config.hidden_size, bias=False)

    def forward(self, x, past_k, past_v, gqa_ctx):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.kvh, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.kvh, self.d).transpose(1, 2)
        out, present_k, present_v = group_query_attention(q, k, v, past_k, past_v, gqa_ctx)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1)), present_k, present_v


class TextModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Attention(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _gqa_local_window_size(self):
        cfg = self.config
        if cfg.sliding_window is None or any(t != "sliding_attention" for t in cfg.layer_types):
            return -1
        return cfg.sliding_window

    def forward(self, input_ids, past_key_values):
        if FIXED:
            gqa_ctx = GQAContext(local_window_size=self._gqa_local_window_size())
        else:
            gqa_ctx = GQAContext()
        h = self.embed_tokens(input_ids)
        presents = []
        for layer, (pk, pv) in zip(self.layers, past_key_values):
            a, k, v = layer(h, pk, pv, gqa_ctx)
            h = h + a
            presents.append((k, v))
        return self.lm_head(h), presents


def reference_logits(model, ids):
    """Full-sequence eager pass with the intended window (no cache)."""
    w = model.config.sliding_window
    n = ids.shape[1]
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    mask = (j <= i) & (j > i - w)
    h = model.embed_tokens(ids)
    for layer in model.layers:
        b, s, _ = h.shape
        q = layer.q_proj(h).view(b, s, layer.h, layer.d).transpose(1, 2)
        k = layer.k_proj(h).view(b, s, layer.kvh, layer.d).transpose(1, 2).repeat_interleave(layer.h // layer.kvh, 1)
        v = layer.v_proj(h).view(b, s, layer.kvh, layer.d).transpose(1, 2).repeat_interleave(layer.h // layer.kvh, 1)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        h = h + layer.o_proj(a.transpose(1, 2).reshape(b, s, -1))
    return model.lm_head(h)


def main():
    config = ArchitectureConfig()
    model = TextModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (1, 12))
    d = config.hidden_size // config.num_attention_heads
    empty = [(torch.zeros(1, config.num_key_value_heads, 0, d),) * 2 for _ in range(config.num_hidden_layers)]
    with torch.no_grad():
        logits, past = model(ids[:, :8], empty)  # prefill
        step_logits = [logits[:, -1]]
        for t in range(8, 12):  # decode with the KV cache
            logits, past = model(ids[:, t : t + 1], past)
            step_logits.append(logits[:, -1])
        ref = reference_logits(model, ids)
    got = torch.stack(step_logits, 1)
    diff = (got - ref[:, 7:12]).abs().max().item()
    print(f"fixed={FIXED} max |decode logits - sliding-window reference| = {diff:.6f}")


if __name__ == "__main__":
    main()
