"""A continuous-batching server's cached decode over left-padded rows, done right (quiet).

A running batch of two prompts is prefilled and decoded; a second batch of two is prefilled, then the two batches are
concatenated into one of four rows (the shorter cache left-padded to the longer, its mask with zeros in front); two
requests finish and the batch is filtered down to two rows again, the left padding no row needs any more cut out of the
cache and the mask. Every step's additive mask comes from that step's own 2-D attention mask, so each row sees its
own real keys only. The rows after the filter are not the rows of the second prefill (the same count, another
grouping). Self-check: each request's logits at every step against the request run alone, no padding, no mask.
"""
import torch

torch.manual_seed(0)
D, H, V = 16, 2, 50
emb = torch.nn.Embedding(V, D)
pos = torch.nn.Embedding(64, D)
qkv = torch.nn.Linear(D, 3 * D)
out = torch.nn.Linear(D, D)
head = torch.nn.Linear(D, V)


def forward(ids, attention_mask, past=None):
    """ids (B, T); attention_mask (B, past + T) with 0 at left padding; past (k, v) each (B, H, past, D / H)."""
    b, t = ids.shape
    positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -t:]
    x = emb(ids) + pos(positions)
    q, k, v = qkv(x).view(b, t, 3, H, D // H).permute(2, 0, 3, 1, 4)
    if past is not None:
        k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
    n = k.shape[2]
    causal = torch.ones(t, n, dtype=torch.bool).tril(n - t)
    allowed = causal[None] & attention_mask[:, None, :].bool()
    bias = torch.zeros(b, 1, t, n).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    scores = q @ k.transpose(-1, -2) / (D // H) ** 0.5 + bias
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, D)
    return head(out(y)), (k, v)


def left_pad(prompts):
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    return ids, mask


class Batch:
    def __init__(self, prompts):
        self.tokens = [list(p) for p in prompts]
        self.ids, self.mask = left_pad(prompts)
        self.past = None
        self.logits = [[] for _ in prompts]

    def step(self):
        logits, self.past = forward(self.ids, self.mask, self.past)
        nxt = logits[:, -1].argmax(-1)
        for i, row in enumerate(logits[:, -1]):
            self.logits[i].append(row)
            self.tokens[i].append(int(nxt[i]))
        self.ids = nxt[:, None]
        self.mask = torch.cat([self.mask, torch.ones(len(nxt), 1, dtype=torch.long)], 1)

    @staticmethod
    def concatenate(a, b):
        width = max(a.mask.shape[1], b.mask.shape[1])
        joined = Batch.__new__(Batch)
        joined.tokens, joined.logits = a.tokens + b.tokens, a.logits + b.logits
        joined.ids = torch.cat([a.ids, b.ids])
        masks, keys, values = [], [], []
        for part in (a, b):
            extra = width - part.mask.shape[1]
            masks.append(torch.nn.functional.pad(part.mask, (extra, 0)))
            keys.append(torch.nn.functional.pad(part.past[0], (0, 0, extra, 0)))
            values.append(torch.nn.functional.pad(part.past[1], (0, 0, extra, 0)))
        joined.mask = torch.cat(masks)
        joined.past = (torch.cat(keys), torch.cat(values))
        return joined

    def filter(self, keep):
        self.tokens = [self.tokens[i] for i in keep]
        self.logits = [self.logits[i] for i in keep]
        self.ids, self.mask = self.ids[keep], self.mask[keep]
        self.past = (self.past[0][keep], self.past[1][keep])
        cut = int((self.mask.sum(-1)).max())  # (the longest kept row: the padding before it no row needs)
        self.mask = self.mask[:, -cut:]
        self.past = (self.past[0][:, :, -(cut - 1):], self.past[1][:, :, -(cut - 1):])


with torch.no_grad():
    first = Batch([[5, 6, 7], [8, 9, 10, 11, 12]])
    first.step()
    first.step()
    second = Batch([[13, 14, 15, 16, 17, 18, 21], [19, 20]])
    second.step()
    both = Batch.concatenate(first, second)
    both.step()
    both.step()
    both.filter([1, 2])  # (requests 0 and 3 finished: the first batch's longer prompt and the second's longer one stay)
    both.step()
    both.step()

    prompts = {0: [8, 9, 10, 11, 12], 1: [13, 14, 15, 16, 17, 18, 21]}
    for row, prompt in prompts.items():
        tokens = both.tokens[row]
        alone, _ = forward(torch.tensor([tokens[:-1]]), torch.ones(1, len(tokens) - 1, dtype=torch.long))
        got = torch.stack(both.logits[row])
        want = alone[0, len(prompt) - 1:]
        assert torch.allclose(got, want, atol=1e-4), (row, (got - want).abs().max())
print("each request's logits match the request run alone")
