# tokenspeed#271's slip written another way: a decoder caches a shared system prompt once (its prefill causal), then
# serves each request from that cached prefix (a prefix-cache hit): the request's own tokens are run as one extend over
# the cached keys, their new keys appended first. The extend is handed no mask (`mask = causal if no cache else None`:
# the prefill's rule), so each new token also sees the later tokens of its own request. The fix builds the causal part
# bottom-right for the extend, `tril(diagonal=k_len - q_len)`; each request's logits then equal the system prompt and
# the request run in one pass.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Layer(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln = nn.LayerNorm(d)
        self.k = self.v = None

    def forward(self, x, mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.ln(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        y = F.scaled_dot_product_attention(q, self.k, self.v, attn_mask=mask)
        return x + self.proj(y.transpose(1, 2).reshape(b, n, d))


class Decoder(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 32, heads: int = 4, layers: int = 2):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.layers = nn.ModuleList(Layer(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, vocab)

    def cache(self):
        return [(layer.k, layer.v) for layer in self.layers]

    def restore(self, cached):
        for layer, (k, v) in zip(self.layers, cached):
            layer.k, layer.v = k, v

    def forward(self, ids):
        """`ids` (1, q) at cache positions [start, start + q), start the keys cached already."""
        start = 0 if self.layers[0].k is None else self.layers[0].k.shape[2]
        q_len = ids.shape[1]
        k_len = start + q_len
        x = self.emb(ids) + self.pos(torch.arange(start, k_len))[None]
        mask = None
        if start == 0 or FIXED:
            mask = torch.ones(q_len, k_len, dtype=torch.bool).tril(diagonal=k_len - q_len)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(x)


def main():
    model = Decoder().eval()
    system = torch.tensor([[5, 9, 3, 7, 1, 8]])
    requests = [torch.tensor([[2, 6, 4, 11]]), torch.tensor([[12, 30, 2]])]
    with torch.no_grad():
        model.restore([(None, None)] * len(model.layers))
        model(system)
        cached = model.cache()
        served, alone = [], []
        for request in requests:
            model.restore(cached)
            served.append(model(request)[0])
            model.restore([(None, None)] * len(model.layers))
            alone.append(model(torch.cat([system, request], dim=1))[0, system.shape[1]:])
    same = all(torch.allclose(a, b, atol=1e-5) for a, b in zip(served, alone))
    print("next tokens", [s.argmax(-1).tolist() for s in served])
    print("each request as one pass over the system prompt and itself:", same)
    if FIXED:
        assert same


if __name__ == "__main__":
    main()
