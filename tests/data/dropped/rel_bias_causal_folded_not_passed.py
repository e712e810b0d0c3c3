"""A decoder with T5-style relative position buckets, on a left-padded batch: its attention folds the causal and
padding mask (`attention_mask`, additive) into the position bias and clears is_causal ("the bias carries it"), then
its SDPA path is handed neither: every query attends later tokens and the padding (python FILE; --fixed: the folded
bias reaches SDPA). The same bug as MEGABYTE-pytorch 4c3ec34, written as a T5/GPT port writes it."""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def relative_bucket(relative, buckets=8, max_distance=16):
    """T5's unidirectional buckets: exact for small distances back, logarithmic beyond (0 for keys ahead)."""
    n = torch.clamp(-relative, min=0)
    exact = buckets // 2
    far = exact + (torch.log(n.float().clamp(min=1) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).long()
    return torch.where(n < exact, n, far.clamp(max=buckets - 1))


class SelfAttention(nn.Module):
    def __init__(self, d_model=32, n_heads=4, buckets=8):
        super().__init__()
        self.n_heads, self.d_head = n_heads, d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.o = nn.Linear(d_model, d_model, bias=False)
        self.rel = nn.Embedding(buckets, n_heads)

    def position_bias(self, length):
        pos = torch.arange(length)
        return self.rel(relative_bucket(pos[None, :] - pos[:, None])).permute(2, 0, 1)[None]  # (1, H, L, L)

    def _attn(self, q, k, v, attention_mask, position_bias):
        is_causal = attention_mask is None
        if attention_mask is not None:
            position_bias = position_bias + attention_mask  # causal and padding now live in the bias
            is_causal = False
        if FIXED:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=position_bias, is_causal=is_causal)
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)

    def forward(self, hidden, attention_mask):
        b, n, _ = hidden.shape
        q, k, v = (t.reshape(b, n, self.n_heads, self.d_head).permute(0, 2, 1, 3)
                   for t in self.qkv(hidden).split(self.n_heads * self.d_head, dim=-1))
        out = self._attn(q, k, v, attention_mask, self.position_bias(n))
        return self.o(out.permute(0, 2, 1, 3).reshape(b, n, -1))


class Decoder(nn.Module):
    def __init__(self, vocab=50, d_model=32, layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(SelfAttention(d_model) for _ in range(layers))
        self.head = nn.Linear(d_model, vocab)

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        keep = torch.tril(torch.ones(n, n, dtype=torch.bool))[None, None] & attention_mask[:, None, None, :].bool()
        extended = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        h = self.embed(input_ids)
        for block in self.blocks:
            h = h + block(h, extended)
        return self.head(h)


def main():
    torch.manual_seed(0)
    model = Decoder().eval()
    lengths = [6, 4, 5]  # left-padded to 6
    ids = torch.randint(1, 50, (3, 6))
    attention_mask = torch.zeros(3, 6, dtype=torch.long)
    for row, n in enumerate(lengths):
        attention_mask[row, 6 - n:] = 1
        ids[row, :6 - n] = 0
    with torch.no_grad():
        logits = model(ids, attention_mask)
        later = ids.clone()
        later[:, -1] = (later[:, -1] + 1) % 50
        moved = (model(later, attention_mask) - logits).abs().amax(-1)[:, :-1]
    leak = moved[attention_mask[:, :-1].bool()].max().item()  # (real tokens only: a padding query sees no key)
    print(f"fixed={FIXED} change of earlier real tokens' logits when the last token changes = {leak:.6f}")


main()
