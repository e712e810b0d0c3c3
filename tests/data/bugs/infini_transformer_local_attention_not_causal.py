# dingo-actual/infini-transformer#4 (fixed in f2bf086 / f9fc7aa "added causal masking"): the
# Infini-attention layer's local dot-product attention inside each segment was computed with no
# causal mask, so a token of a decoder LM attended to later tokens of its own segment.
import sys
from typing import Optional

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class CompressiveMemory(nn.Module):
    """Implements the Compressive Transformer memory module."""

    def __init__(self, dim_input, dim_key, dim_value, num_heads, segment_len, update="linear"):
        super(CompressiveMemory, self).__init__()
        self.num_heads = num_heads
        self.segment_len = segment_len
        self.dim_input = dim_input
        self.dim_key = dim_key
        self.dim_value = dim_value
        self.update = update
        self.proj_k = nn.Linear(dim_input, num_heads * dim_key, bias=False)
        self.proj_v = nn.Linear(dim_input, num_heads * dim_value, bias=False)
        self.proj_q = nn.Linear(dim_input, num_heads * dim_key, bias=False)
        self.betas = nn.Parameter(torch.randn(1, num_heads, 1, dim_value))
        self.proj_out = nn.Linear(num_heads * dim_value, dim_input, bias=False)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        n_seq, rem = divmod(seq_len, self.segment_len)
        if rem != 0:
            raise ValueError("Sequence length must be divisible by segment length.")
        out = []
        mem = torch.zeros(1, self.num_heads, self.dim_key, self.dim_value)
        z = torch.zeros(1, self.num_heads, self.dim_value, 1).repeat(batch_size, 1, 1, 1)
        for ix in range(n_seq):
            ix_lo = ix * self.segment_len
            ix_hi = ix_lo + self.segment_len
            x_seg = x[:, ix_lo:ix_hi, :]
            k = self.proj_k(x_seg).view(batch_size, self.segment_len, self.num_heads, self.dim_key).transpose(1, 2)
            v = self.proj_v(x_seg).view(batch_size, self.segment_len, self.num_heads, self.dim_value).transpose(1, 2)
            q = self.proj_q(x_seg).view(batch_size, self.segment_len, self.num_heads, self.dim_key).transpose(1, 2)
            sigma_q = nn.functional.elu(q) + 1.0
            z = z + (nn.functional.elu(k) + 1.0).sum(dim=-2, keepdim=True).transpose(-2, -1)

            # Apply SDP attention
            scores = q @ k.transpose(-2, -1) / torch.sqrt(torch.tensor(float(self.dim_key)))
            if mask is not None:
                if mask.dtype == torch.bool:
                    m = mask.unsqueeze(0).unsqueeze(0).repeat((batch_size, self.num_heads, 1, 1))
                    scores = scores.masked_fill(torch.logical_not(m), float("-inf"))
                else:
                    scores = scores + mask
            att_dot = nn.functional.softmax(scores, dim=-1) @ v

            att_mem = (sigma_q @ mem) / (sigma_q @ z)
            sigma_k = nn.functional.elu(k) + 1.0
            mem = mem + sigma_k.transpose(-2, -1) @ v
            att = nn.functional.sigmoid(self.betas) * att_mem + (1 - nn.functional.sigmoid(self.betas)) * att_dot
            att = att.transpose(1, 2).reshape(batch_size, self.segment_len, self.num_heads * self.dim_value)
            out.append(self.proj_out(att))
        return torch.cat(out, dim=1)


class InfiniTransformer(nn.Module):
    """Transformer layer with compressive memory."""

    def __init__(self, dim_input, dim_hidden, dim_key, dim_value, num_heads, segment_len, update="linear"):
        super().__init__()
        self.attn = CompressiveMemory(dim_input, dim_key, dim_value, num_heads, segment_len, update)
        self.mlp = nn.Sequential(nn.Linear(dim_input, dim_hidden), nn.ReLU(), nn.Linear(dim_hidden, dim_input))
        self.layer_norm = nn.LayerNorm(dim_input)

    def forward(self, x, mask=None):
        if FIXED:
            x_ = self.attn(x, mask)
        else:
            x_ = self.attn(x)  # before the fix the layer took no mask at all
        x_ = self.mlp(x_)
        return self.layer_norm(x_ + x)


class InfiniLM(nn.Module):
    def __init__(self, vocab=50, dim=32, depth=2, segment_len=8):
        super().__init__()
        self.segment_len = segment_len
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            [InfiniTransformer(dim, 64, 8, 8, 4, segment_len) for _ in range(depth)])
        self.head = nn.Linear(dim, vocab)

    def forward(self, ids):
        x = self.emb(ids)
        causal = torch.tril(torch.ones(self.segment_len, self.segment_len, dtype=torch.bool))
        for layer in self.layers:
            x = layer(x, causal)
        return self.head(x)


torch.manual_seed(0)
model = InfiniLM().eval()
ids = torch.randint(0, 50, (2, 16))  # two segments of 8 tokens
ids2 = ids.clone()
ids2[:, 7] = (ids2[:, 7] + 1) % 50  # change the last token of the first segment

with torch.no_grad():
    a = model(ids)
    b = model(ids2)
# next-token logits at positions 0..6 must not depend on token 7
leak = (a[:, :7] - b[:, :7]).abs().max().item()
print(f"{'fixed' if FIXED else 'buggy'}: max change of logits at positions 0..6 when token 7 changes = {leak:.3e}")
