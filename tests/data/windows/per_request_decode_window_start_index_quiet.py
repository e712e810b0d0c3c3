# Correct (must stay quiet): a hybrid model (CONFIG, a plain dict: layer_types and sliding_window = 3, HF's count with
# the query) served from one KV pool by a decode kernel written per request, keys laid out (H, n, D) and scored with
# einsum("hd,hnd->hn"). A sliding layer's decode gathers the request's keys from seq_len - sliding_window on (its
# window's start index), a full layer's from 0; the prefill masks each request's causal window with masked_fill over
# a (H, L, L) score tensor. Sliding layers at decode see the last 3 keys, full layers every key of their request.
import torch
from torch import nn

torch.manual_seed(0)
CONFIG = {"hidden_size": 24, "num_attention_heads": 3, "head_dim": 8, "vocab_size": 50, "sliding_window": 3,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}


class Pool:
    def __init__(self, layers, size):
        self.k = [torch.zeros(CONFIG["num_attention_heads"], size, CONFIG["head_dim"]) for _ in range(layers)]
        self.v = [torch.zeros_like(self.k[0]) for _ in range(layers)]


class SelfAttention(nn.Module):
    def __init__(self, idx):
        super().__init__()
        self.idx, self.num_heads, self.head_dim = idx, CONFIG["num_attention_heads"], CONFIG["head_dim"]
        self.window = CONFIG["sliding_window"] if CONFIG["layer_types"][idx] == "sliding_attention" else None
        self.qkv = nn.Linear(CONFIG["hidden_size"], 3 * self.num_heads * self.head_dim)
        self.proj = nn.Linear(self.num_heads * self.head_dim, CONFIG["hidden_size"])

    def forward(self, x, batch, pool):
        q, k, v = self.qkv(x).view(x.shape[0], 3, self.num_heads, self.head_dim).unbind(1)
        pool.k[self.idx][:, batch["loc"]] = k.transpose(0, 1)
        pool.v[self.idx][:, batch["loc"]] = v.transpose(0, 1)
        outs = []
        if batch["decode"]:
            for i, (req_slots, length) in enumerate(zip(batch["req_slots"], batch["lens"].tolist())):
                start = 0 if self.window is None else max(length - self.window, 0)
                idx = req_slots[start:length]
                keys, values = pool.k[self.idx][:, idx], pool.v[self.idx][:, idx]
                w = (torch.einsum("hd,hnd->hn", q[i], keys) * self.head_dim ** -0.5).softmax(-1)
                outs.append(torch.einsum("hn,hnd->hd", w, values))
        else:
            start = 0
            for length in batch["lens"].tolist():
                qi, ki = torch.arange(length)[:, None], torch.arange(length)[None, :]
                blocked = ki > qi
                if self.window is not None:
                    blocked |= ki <= qi - self.window
                sl = slice(start, start + length)
                s = torch.einsum("qhd,khd->hqk", q[sl], k[sl]) * self.head_dim ** -0.5
                w = s.masked_fill(blocked, float("-inf")).softmax(-1)
                outs.append(torch.einsum("hqk,khd->qhd", w, v[sl]))
                start += length
        return self.proj(torch.cat([o.reshape(-1, self.num_heads * self.head_dim) for o in outs]))


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = CONFIG
        self.embed = nn.Embedding(CONFIG["vocab_size"], CONFIG["hidden_size"])
        self.layers = nn.ModuleList([SelfAttention(i) for i in range(len(CONFIG["layer_types"]))])
        self.head = nn.Linear(CONFIG["hidden_size"], CONFIG["vocab_size"])

    def forward(self, input_ids, batch, pool):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = h + layer(h, batch, pool)
        return self.head(h)


model = Model().eval()
pool = Pool(len(CONFIG["layer_types"]), 64)
prompts = [torch.randint(0, 50, (5,)), torch.randint(0, 50, (8,))]
req_slots = [list(range(0, 5)) + [20, 21, 22], list(range(5, 13)) + [30, 31, 32]]
lens = torch.tensor([5, 8])
with torch.no_grad():
    batch = {"decode": False, "lens": lens, "loc": torch.arange(13)}
    logits = model(torch.cat(prompts), batch, pool)
    nxt = logits[torch.cumsum(lens, 0) - 1].argmax(-1)
    for step in range(3):
        loc = torch.tensor([req_slots[0][int(lens[0])], req_slots[1][int(lens[1])]])
        lens = lens + 1
        batch = {"decode": True, "lens": lens, "loc": loc, "req_slots": [torch.tensor(s) for s in req_slots]}
        nxt = model(nxt, batch, pool).argmax(-1)
print("last tokens:", nxt.tolist())
