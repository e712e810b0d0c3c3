"""A Qwen-style model written by hand (a ModelArgs dataclass: use_sliding_window, sliding_window, max_window_layers) whose
blocks keep their own `self.sliding_window`, set on the layers below max_window_layers (as Qwen's own docs read it: the
bottom layers slide), run on a left-padded batch. The mask builder applies causal + key padding only, so the sliding
blocks attend to the whole prefix; --fixed: each block whose `self.sliding_window` is set cuts keys W or more back."""

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ModelArgs:
    dim: int = 16
    n_heads: int = 2
    n_layers: int = 3
    vocab_size: int = 32
    use_sliding_window: bool = True
    sliding_window: int = 3
    max_window_layers: int = 2


class Block(torch.nn.Module):
    def __init__(self, args: ModelArgs, layer_id: int):
        super().__init__()
        self.n_heads = args.n_heads
        self.qkv = torch.nn.Linear(args.dim, 3 * args.dim)
        self.out = torch.nn.Linear(args.dim, args.dim)
        self.sliding_window = args.sliding_window if args.use_sliding_window and layer_id < args.max_window_layers else None

    def forward(self, x, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        if FIXED and self.sliding_window is not None:
            i = torch.arange(t)[:, None]
            j = torch.arange(t)[None, :]
            keep = keep & (i - j < self.sliding_window)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, t, d))


class Model(torch.nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok = torch.nn.Embedding(args.vocab_size, args.dim)
        self.blocks = torch.nn.ModuleList(Block(args, i) for i in range(args.n_layers))

    def forward(self, tokens, attention_mask):
        t = tokens.shape[1]
        real = attention_mask.bool()
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        keep = causal[None, None] & real[:, None, None, :]
        keep = keep | ~real[:, None, :, None]  # a padding query sees every key (its output is never read)
        x = self.tok(tokens)
        for block in self.blocks:
            x = block(x, keep)
        return x


args = ModelArgs()
model = Model(args).eval()
tokens = torch.randint(1, args.vocab_size, (2, 9))
attention_mask = torch.ones(2, 9, dtype=torch.long)
attention_mask[1, :4] = 0  # left-padded
tokens[1, :4] = 0
with torch.no_grad():
    out = model(tokens, attention_mask)
print("fixed" if FIXED else "buggy", tuple(out.shape))
