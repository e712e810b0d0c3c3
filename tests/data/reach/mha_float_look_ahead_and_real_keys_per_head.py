# Written another way than mindee/doctr#546 (MASTER's `~eq(target, PAD) & look_ahead` bool tgt_mask): a decoder-only
# stack of nn.MultiheadAttention layers (batch_first) handed one float (B * heads, L, L) attn_mask, built fairseq-style
# from a key padding mask turned round (`real = tokens != pad`) and combined with the future mask by `&`: a cell is
# -inf only where the key is later *and* real, so every query reads the trailing pad keys, whose rows read the whole
# sentence. The fix blocks `future | is_pad`.
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
PAD = 0


class Decoder(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, heads: int, layers: int):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=PAD)
        self.layers = torch.nn.ModuleList(torch.nn.MultiheadAttention(dim, heads, batch_first=True) for _ in range(layers))

    def attn_bias(self, tokens: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        future = torch.ones(length, length, dtype=torch.bool).triu(1)[None]  # (1, L, L): True = a later key
        is_pad = (tokens == PAD)[:, None, :]  # (B, 1, L)
        blocked = future | is_pad if FIXED else future & ~is_pad
        if FIXED:
            blocked = blocked & ~torch.eye(length, dtype=torch.bool)[None]  # (a pad query keeps its own key: no NaN)
        bias = torch.zeros(blocked.shape).masked_fill(blocked, float("-inf"))
        return bias.repeat_interleave(self.heads, dim=0)  # (B * heads, L, L)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x, bias = self.embed(tokens), self.attn_bias(tokens)
        for layer in self.layers:
            x = x + layer(x, x, x, attn_mask=bias, need_weights=False)[0]
        return x


lengths, L = [8, 5, 6], 8
tokens = torch.full((len(lengths), L), PAD)
for row, n in enumerate(lengths):
    tokens[row, :n] = torch.randint(1, 50, (n,))
model = Decoder(50, 16, heads=2, layers=2).eval()
with torch.no_grad():
    out = model(tokens)
    alone = model(tokens[1:2, :lengths[1]])
print(f"max |row 1 padded - row 1 alone| over its real tokens: {(out[1, :lengths[1]] - alone[0]).abs().max().item():.6f}")
