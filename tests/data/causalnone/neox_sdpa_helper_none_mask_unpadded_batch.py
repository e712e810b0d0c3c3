# adapter-hub/adapters#722 written another way: a GPT-NeoX-style port whose model builds its causal mask only for a
# padded batch (None otherwise, as transformers' _ignore_causal_mask_sdpa does) and whose attention helper `_attn`
# hands it to SDPA positionally with no is_causal; an evaluation loop runs a left-padded batch (masked: fine) and an
# unpadded one (attends the future). The fix passes is_causal when the mask is None.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class NeoXAttention(nn.Module):
    def __init__(self, hidden=32, heads=4, rotary_pct=0.5):
        super().__init__()
        self.heads, self.head_size = heads, hidden // heads
        self.rotary_ndims = int(self.head_size * rotary_pct)
        self.query_key_value = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        inv_freq = 1.0 / (10000 ** (torch.arange(0, self.rotary_ndims, 2).float() / self.rotary_ndims))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rotary(self, x, position_ids):
        freqs = position_ids[:, None, :, None].float() * self.inv_freq
        cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
        rot, keep = x[..., : self.rotary_ndims], x[..., self.rotary_ndims:]
        return torch.cat((rot * cos + rotate_half(rot) * sin, keep), dim=-1)

    def _attn(self, query, key, value, causal_mask=None):
        if FIXED:
            return F.scaled_dot_product_attention(query, key, value, causal_mask, 0.0,
                                                  is_causal=causal_mask is None and query.shape[2] > 1)
        return F.scaled_dot_product_attention(query, key, value, causal_mask, 0.0)

    def forward(self, hidden_states, attention_mask, position_ids):
        b, n, _ = hidden_states.shape
        qkv = self.query_key_value(hidden_states).view(b, n, self.heads, 3 * self.head_size).transpose(1, 2)
        query, key, value = qkv.split(self.head_size, dim=-1)
        query, key = self._rotary(query, position_ids), self._rotary(key, position_ids)
        out = self._attn(query, key, value, attention_mask)
        return self.dense(out.transpose(1, 2).reshape(b, n, -1))


class NeoXLM(nn.Module):
    def __init__(self, vocab=48, hidden=32, layers=2):
        super().__init__()
        self.embed_in = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(NeoXAttention(hidden) for _ in range(layers))
        self.embed_out = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        if bool(attention_mask.all()):
            mask = None  # (no padding: SDPA's own causal path)
        else:
            keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
            keep |= ~keep.any(-1, keepdim=True)  # (fully padded query rows see everything: no NaN)
            mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        h = self.embed_in(input_ids)
        for layer in self.layers:
            h = h + layer(h, mask, position_ids)
        return self.embed_out(h)


model = NeoXLM().eval()
worst = 0.0
with torch.no_grad():
    for lengths in ([5, 8, 3], [7, 7]):  # a left-padded batch, then an unpadded one
        L = max(lengths)
        ids = torch.randint(1, 48, (len(lengths), L))
        mask = torch.zeros(len(lengths), L, dtype=torch.long)
        for row, n in enumerate(lengths):
            mask[row, L - n:] = 1
        logits = model(ids, mask)
        for row, n in enumerate(lengths):
            for t in range(n - 1):  # a causal LM: the logits at t must not change when later tokens are cut
                cut = model(ids[row:row + 1, L - n: L - n + t + 1], torch.ones(1, t + 1, dtype=torch.long))
                worst = max(worst, (logits[row, L - n + t] - cut[0, -1]).abs().max().item())
print("max |logits - logits of the prefix alone|:", f"{worst:.6f}")
