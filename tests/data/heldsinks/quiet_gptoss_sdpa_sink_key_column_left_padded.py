# Correct (quiet): attention with learned sinks through SDPA, the sink handed to the kernel as one extra key. A
# GPT-OSS-style decoder layer (a dict config, GQA, `self.sinks` one logit per query head) runs a left-padded batch of
# two prompts and one decode step with a KV cache. SDPA has no sink argument, so the layer prepends a zero key and a
# zero value and puts sinks[h] in that column of a finfo.min additive mask: softmax([s_h, q.k_0, ..., q.k_n]) with
# the sink's weight multiplying a zero value, exactly the reference's torch.cat([QK, S], dim=-1) then dropping S.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)

CONFIG = {"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "num_hidden_layers": 2, "vocab_size": 50}


class SinkAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.h, self.kv, self.d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
        self.q_proj = nn.Linear(config["hidden_size"], self.h * self.d)
        self.k_proj = nn.Linear(config["hidden_size"], self.kv * self.d)
        self.v_proj = nn.Linear(config["hidden_size"], self.kv * self.d)
        self.o_proj = nn.Linear(self.h * self.d, config["hidden_size"])
        self.sinks = nn.Parameter(torch.randn(self.h))

    def forward(self, x, keep, cache):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.kv, self.d).transpose(1, 2)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        new_cache = (k, v)
        k = k.repeat_interleave(self.h // self.kv, dim=1)
        v = v.repeat_interleave(self.h // self.kv, dim=1)
        zero = torch.zeros(b, self.h, 1, self.d)
        k_sink, v_sink = torch.cat([zero, k], dim=2), torch.cat([zero, v], dim=2)
        low = torch.finfo(q.dtype).min
        bias = torch.zeros(b, 1, n, keep.shape[-1]).masked_fill(~keep[:, None], low).expand(b, self.h, n, -1)
        sink_col = self.sinks.view(1, self.h, 1, 1).expand(b, self.h, n, 1)
        attn_mask = torch.cat([sink_col, bias], dim=-1)  # (b, h, n, 1 + keys): the sink first, never masked
        out = F.scaled_dot_product_attention(q, k_sink, v_sink, attn_mask=attn_mask, scale=self.d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, -1)), new_cache


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(SinkAttention(config) for _ in range(config["num_hidden_layers"]))

    def forward(self, input_ids, attention_mask, caches=None):
        b, n = input_ids.shape
        total = attention_mask.shape[1]
        past = total - n
        q_pos = past + torch.arange(n)
        causal = torch.arange(total)[None, :] <= q_pos[:, None]  # (n, total)
        keep = causal[None] & attention_mask[:, None, :].bool()  # left padding: the pad keys masked
        x = self.embed(input_ids)
        new = []
        for i, layer in enumerate(self.layers):
            y, c = layer(x, keep, None if caches is None else caches[i])
            x = x + y
            new.append(c)
        return x, new


model = Decoder(CONFIG).eval()
input_ids = torch.tensor([[0, 0, 5, 6, 7, 8], [11, 12, 13, 14, 15, 16]])
attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    x, caches = model(input_ids, attention_mask)
    step_ids = torch.tensor([[9], [17]])
    attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
    y, _ = model(step_ids, attention_mask, caches)
print("quiet", tuple(x.shape), tuple(y.shape), "checksum %.5f" % y.sum().item())
