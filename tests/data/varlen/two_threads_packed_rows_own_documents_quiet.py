"""Two threads (context-parallel ranks run in one process) each run the same packed decoder over their own flattened
row: each model call is handed its row's position_ids, and builds the cu_seqlens it hands each layer by keyword from
them (where a position restarts at 0); each layer attends once, block-diagonal and causal within each document. A
barrier between the layers makes the two threads' attention calls interleave. Correct: each call is its own thread's
model call's, its documents those of that call's positions."""

import threading

import torch
import torch.nn.functional as F

BARRIER = threading.Barrier(2)


class Layer(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)

    def forward(self, x, cu_seqlens=None):
        t, d = x.shape
        q, k, v = self.qkv(x).view(1, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        document = torch.bucketize(torch.arange(t), cu_seqlens[1:], right=True)
        keep = (document[:, None] == document[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        BARRIER.wait()
        return x + out.transpose(1, 2).reshape(t, d)


class PackedLM(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.layers = torch.nn.ModuleList(Layer() for _ in range(2))

    def forward(self, input_ids, position_ids):
        starts = torch.nonzero(position_ids[0] == 0).flatten()
        cu_seqlens = F.pad(starts[1:], (1, 1), value=0).to(torch.int32)
        cu_seqlens[-1] = input_ids.shape[1]
        x = self.embed(input_ids[0])
        for layer in self.layers:
            x = layer(x, cu_seqlens=cu_seqlens)
        return x


torch.manual_seed(0)
model = PackedLM().eval()
rows = {0: [5, 3], 1: [2, 4, 2]}
results = {}


def rank(r):
    lengths = rows[r]
    ids = torch.randint(1, 50, (1, sum(lengths)))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    with torch.no_grad():
        results[r] = model(ids, positions).sum().item()


threads = [threading.Thread(target=rank, args=(r,)) for r in rows]
for t in threads:
    t.start()
for t in threads:
    t.join()
print({r: round(v, 4) for r, v in sorted(results.items())})
