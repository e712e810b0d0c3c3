# The same bug as lerobot#279, written another way: an event-sequence encoder (a clinical / log-event model) pools a
# left-padded batch of events through two register tokens appended after them. Its collator's `attention_mask`
# (1 = a real event) covers the events only; the encoder builds its additive bias from it only when told to
# (`mask_events`), and the model is built without, so every query, the registers' too, attends to the padded events.
# The fix pads the mask with the registers' ones and hands it to every layer.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class EventAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.scale = heads, (dim // heads) ** -0.5
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, bias=None):
        b, n, d = x.shape
        q, k, v = self.to_qkv(x).reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        scores = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        if bias is not None:
            scores = scores + bias
        weights = scores.softmax(dim=-1)
        return self.proj(torch.einsum("bhij,bhjd->bhid", weights, v).transpose(1, 2).reshape(b, n, d))


class EventEncoder(nn.Module):
    def __init__(self, n_types=20, dim=32, heads=4, depth=2, registers=2, mask_events=False):
        super().__init__()
        self.embed = nn.Embedding(n_types, dim)
        self.time = nn.Linear(1, dim)
        self.registers = nn.Parameter(torch.randn(1, registers, dim) * 0.02)
        self.layers = nn.ModuleList(EventAttention(dim, heads) for _ in range(depth))
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))
        self.mask_events = mask_events

    def forward(self, event_types, event_times, attention_mask):
        b, n = event_types.shape
        x = self.embed(event_types) + self.time(event_times[..., None])
        x = torch.cat([x, self.registers.expand(b, -1, -1)], dim=1)  # [events..., registers]
        bias = None
        if self.mask_events:
            keep = torch.cat([attention_mask, attention_mask.new_ones(b, self.registers.shape[1])], dim=1)
            bias = torch.zeros(b, 1, 1, keep.shape[1]).masked_fill(keep[:, None, None, :] == 0, float("-inf"))
        for attn, norm in zip(self.layers, self.norms):
            x = x + attn(norm(x), bias)
        return x[:, n:].mean(dim=1)  # the registers pool the sequence


def collate(sequences):
    """Left-pads each patient's events to the longest; attention_mask is 1 on the real events."""
    n = max(len(s) for s in sequences)
    types = torch.zeros(len(sequences), n, dtype=torch.long)
    times = torch.zeros(len(sequences), n)
    attention_mask = torch.zeros(len(sequences), n, dtype=torch.long)
    for i, s in enumerate(sequences):
        types[i, n - len(s):] = torch.tensor([t for t, _ in s])
        times[i, n - len(s):] = torch.tensor([h for _, h in s])
        attention_mask[i, n - len(s):] = 1
    return {"event_types": types, "event_times": times, "attention_mask": attention_mask}


def main():
    torch.manual_seed(0)
    model = EventEncoder(mask_events=FIXED).eval()
    patients = [[(3, 0.0), (7, 1.5), (2, 2.0), (9, 4.0), (4, 6.5), (11, 7.0)], [(5, 0.0), (8, 3.0)],
                [(1, 0.0), (6, 0.5), (12, 2.5), (3, 5.0)]]
    inputs = collate(patients)
    with torch.no_grad():
        pooled = model(**inputs)
        worst = 0.0
        for i, p in enumerate(patients):
            alone = model(**collate([p]))
            worst = max(worst, (pooled[i] - alone[0]).abs().max().item())
    print(f"max |pooled (batched) - pooled (alone)| = {worst:.6f}")


if __name__ == "__main__":
    main()
