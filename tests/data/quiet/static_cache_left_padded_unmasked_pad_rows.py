"""A static-cache decoder over a left-padded batch whose padding query rows are unmasked whole, as transformers does.

gpt-fast style: the model call takes `input_pos`, the cache is preallocated to 12 slots and every layer attends all
of them; the float mask is causal over the slots AND the padding mask, which the program keeps as wide as the
cache (the prompt's mask, then ones for the tokens it generates). A padding query (left padding of the short prompt)
would see no key; its row is opened on every key instead (transformers' sdpa path does this so that no row gives
NaN), so it sees the unwritten slots: nothing reads its output. Prefill of 5 tokens, then 2 decode steps. Correct.
With `--offsets` the model call is handed each row's left-padding count instead of the mask and builds the mask
itself: the call then states no padding, and the unwritten slots' zero K and V are all the data says.
"""
import sys

import torch
import torch.nn.functional as F

SLOTS, DIM, HEADS, PAD = 12, 16, 2, 0


class Cache:
    def __init__(self, batch):
        self.k = torch.zeros(batch, HEADS, SLOTS, DIM // HEADS)
        self.v = torch.zeros(batch, HEADS, SLOTS, DIM // HEADS)

    def write(self, pos, k, v):
        self.k[:, :, pos] = k
        self.v[:, :, pos] = v
        return self.k, self.v


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, DIM)
        self.qkv = torch.nn.Linear(DIM, 3 * DIM)
        self.head = torch.nn.Linear(DIM, 32)

    def forward(self, idx, input_pos, cache, attention_mask=None, offsets=None):
        b, t = idx.shape
        if offsets is not None:
            attention_mask = (torch.arange(SLOTS)[None, :] >= offsets[:, None]).long()
        x = self.embed(idx)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        k, v = cache.write(input_pos, k, v)
        allowed = (torch.arange(SLOTS)[None, :] <= input_pos[:, None])[None] & attention_mask.bool()[:, None, :]
        allowed = allowed | ~allowed.any(dim=-1, keepdim=True)  # (a row that sees nothing sees everything: no NaN)
        bias = torch.zeros(b, 1, t, SLOTS).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.head(out.transpose(1, 2).reshape(b, t, DIM))


torch.manual_seed(0)
model = Decoder().eval()
prompts = torch.tensor([[5, 6, 7, 8, 9], [PAD, PAD, PAD, 11, 12]])
pad_mask = torch.ones(2, SLOTS, dtype=torch.long)
pad_mask[:, :5] = (prompts != PAD).long()
cache, pos, idx, out = Cache(2), torch.arange(5), prompts, []
with torch.no_grad():
    for _ in range(3):
        given = {"offsets": (prompts == PAD).sum(-1)} if "--offsets" in sys.argv else {"attention_mask": pad_mask}
        nxt = model(idx, pos, cache, **given)[:, -1].argmax(-1) % 30 + 1  # (never the pad id)
        out.append(nxt.tolist())
        idx, pos = nxt[:, None], pos[-1:] + 1
print("generated", out)
