# lucidrains/compressive-transformer-pytorch commit 4b3ce19 ("fix bugs"): in SelfAttention the key
# padding mask was padded over the (compressed) memories with False, hiding them, and the causal
# mask was built with triu_(diagonal = 1 + kv_len), which masks nothing (future tokens visible).
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
Memory = namedtuple('Memory', ['mem', 'compressed_mem'])


def split_at_index(dim, index, t):
    pre_slices = (slice(None),) * dim
    return t[(*pre_slices, slice(None, index))], t[(*pre_slices, slice(index, None))]


class ConvCompress(nn.Module):
    def __init__(self, dim, ratio=4):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, ratio, stride=ratio)

    def forward(self, mem):
        return self.conv(mem.transpose(1, 2)).transpose(1, 2)


class SelfAttention(nn.Module):
    def __init__(self, dim, seq_len, mem_len, cmem_len, cmem_ratio=4, heads=4):
        super().__init__()
        self.heads = heads
        self.dim_head = dim // heads
        self.seq_len = seq_len
        self.mem_len = mem_len
        self.cmem_len = cmem_len
        self.cmem_ratio = cmem_ratio
        self.scale = self.dim_head ** (-0.5)
        self.compress_mem_fn = ConvCompress(dim, cmem_ratio)
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_kv = nn.Linear(dim, dim * 2, bias=False)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, memories=None, input_mask=None):
        b, t, e, h, dim_h = *x.shape, self.heads, self.dim_head
        mem, cmem = memories if memories is not None else (None, None)
        mem = mem if mem is not None else torch.empty(b, 0, e)
        cmem = cmem if cmem is not None else torch.empty(b, 0, e)
        mem_len, cmem_len = mem.shape[1], cmem.shape[1]

        q = self.to_q(x)
        kv_input = torch.cat((cmem, mem, x), dim=1)
        kv_len = kv_input.shape[1]
        k, v = self.to_kv(kv_input).chunk(2, dim=-1)
        merge_heads = lambda x: x.reshape(*x.shape[:2], -1, dim_h).transpose(1, 2)
        q, k, v = map(merge_heads, (q, k, v))

        dots = torch.einsum('bhid,bhjd->bhij', q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max

        if input_mask is not None:
            mask = input_mask[:, None, :, None] * input_mask[:, None, None, :]
            mask = F.pad(mask, (mem_len + cmem_len, 0), value=True if FIXED else False)
            dots.masked_fill_(~mask, mask_value)

        if FIXED:
            total_mem_len = mem_len + cmem_len
            mask = torch.ones(t, t + total_mem_len).triu_(diagonal=1 + total_mem_len).bool()
        else:
            mask = torch.ones(t, kv_len).triu_(diagonal=1 + kv_len).bool()
        dots.masked_fill_(mask[None, None, ...], mask_value)

        attn = dots.softmax(dim=-1)
        out = torch.einsum('bhij,bhjd->bhid', attn, v)
        logits = self.to_out(out.transpose(1, 2).reshape(b, t, -1))

        # calculate memory and compressed memory
        old_mem, new_mem = split_at_index(1, -self.mem_len, torch.cat((mem, x), dim=1))
        new_cmem = cmem
        if old_mem.shape[1] != 0:
            compressed_mem = self.compress_mem_fn(old_mem)
            _, new_cmem = split_at_index(1, -self.cmem_len, torch.cat((cmem, compressed_mem), dim=1))
        return logits, Memory(new_mem.detach(), new_cmem.detach())


class CompressiveTransformer(nn.Module):
    def __init__(self, num_tokens=64, dim=32, seq_len=8, depth=2, mem_len=8, cmem_len=4, cmem_ratio=4):
        super().__init__()
        self.seq_len = seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.norms = nn.ModuleList([nn.LayerNorm(dim) for _ in range(depth)])
        self.attn_layers = nn.ModuleList(
            [SelfAttention(dim, seq_len, mem_len, cmem_len, cmem_ratio) for _ in range(depth)])
        self.ff_layers = nn.ModuleList(
            [nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
             for _ in range(depth)])
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x, memories=None, mask=None):
        x = self.token_emb(x)
        next_mem, next_cmem = [], []
        for ind, (norm, attn, ff) in enumerate(zip(self.norms, self.attn_layers, self.ff_layers)):
            layer_mem = None if memories is None else (memories.mem[ind], memories.compressed_mem[ind])
            out, (m, cm) = attn(norm(x), memories=layer_mem, input_mask=mask)
            x = x + out
            x = x + ff(x)
            next_mem.append(m)
            next_cmem.append(cm)
        return self.to_logits(x), Memory(torch.stack(next_mem), torch.stack(next_cmem))


torch.manual_seed(0)
model = CompressiveTransformer().eval()
seq = torch.randint(0, 64, (2, 24))
mask = torch.ones(2, 24, dtype=torch.bool)
mask[1, 20:] = False  # second sample is right-padded

with torch.no_grad():
    mems = None
    outs = []
    for seg, seg_mask in zip(seq.split(8, dim=1), mask.split(8, dim=1)):
        logits, mems = model(seg, memories=mems, mask=seg_mask)
        outs.append(logits)
    # the third segment with a different first segment: sample 0's logits should change through the memories
    seq2 = seq.clone()
    seq2[:, :8] = torch.randint(0, 64, (2, 8))
    mems2 = None
    for seg, seg_mask in zip(seq2.split(8, dim=1), mask.split(8, dim=1)):
        logits2, mems2 = model(seg, memories=mems2, mask=seg_mask)
    # and the first token of segment 3 must not depend on the tokens after it
    seq3 = seq.clone()
    seq3[:, 17:] = torch.randint(0, 64, (2, 7))
    mems3 = None
    for seg, seg_mask in zip(seq3.split(8, dim=1), mask.split(8, dim=1)):
        logits3, mems3 = model(seg, memories=mems3, mask=seg_mask)

print(f"{'fixed' if FIXED else 'buggy'}: effect of older history on segment 3 = "
      f"{(outs[2][0] - logits2[0]).abs().max().item():.3e}; "
      f"effect of future tokens on position 16 = {(outs[2][:, 0] - logits3[:, 0]).abs().max().item():.3e}")
