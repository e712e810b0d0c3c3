"""recurrent-memory-transformer-pytorch: custom causal mask padded with True for read and write memories.

Citation: lucidrains/recurrent-memory-transformer-pytorch commit
cdff28aa7e9a60f26adfaf3c47187b4666ac50c2 ("fix custom causal mask for memories and main sequence",
version 0.1.7 -> 0.1.8). Read in the upstream git history (parent and fix commit); no issue thread.

Bug: with `causal=True` and `memory_not_causal=True` the model packs `[read_memories, tokens,
write_memories]` and builds its own mask: `tril(ones(n, n))` padded with
`F.pad(causal_mask, (read_mem_length, mem_length) * 2, value=True)`. That pads rows AND columns
with True on both sides, so every token also attends to all write-memory slots (which attend to
the whole segment, leaking future tokens back into earlier positions) and the read memories attend
to every token. Intended: read memories see only read memories, tokens see read memories plus
causal tokens, write memories see everything.
Fix: `F.pad(causal_mask, (0, mem_length, read_mem_length, 0), value=False)` then
`F.pad(causal_mask, (read_mem_length, 0, 0, mem_length), value=True)`.

This program: the pre-fix module with `use_flash_attn=True` (the `Attend.flash_attn` path, which
is the one that accepts the 4-D custom mask: `F.scaled_dot_product_attention(attn_mask=mask,
is_causal=False)`; the `sdp_kernel` backend-selection context is left out), einops pack/unpack as
cat/split; two segments of 6 tokens with 2 memory tokens, the second reading the first's memories.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def token_shift_fn(t, ps):
    read_len, n = ps
    read_mem, t, write_mem = t[:, :read_len], t[:, read_len:read_len + n], t[:, read_len + n:]
    t, t_shift = t.chunk(2, dim=-1)
    t_shift = F.pad(t_shift, (0, 0, 1, -1), value=0.)
    t = torch.cat((t, t_shift), dim=-1)
    return torch.cat((read_mem, t, write_mem), dim=-2)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim=-1) * self.scale * self.gamma


class GEGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return x * F.gelu(gate)


def FeedForward(dim, mult=4):
    dim_inner = int(dim * mult * 2 / 3)
    return nn.Sequential(RMSNorm(dim), nn.Linear(dim, dim_inner * 2), GEGLU(), nn.Linear(dim_inner, dim))


class Attend(nn.Module):
    def __init__(self, dropout=0., causal=False, use_flash=False):
        super().__init__()
        self.dropout = dropout
        self.causal = causal
        self.use_flash = use_flash

    def flash_attn(self, q, k, v, mask=None):
        _, heads, q_len, _, k_len = *q.shape, k.shape[-2]
        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :].expand(-1, heads, q_len, -1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                              dropout_p=self.dropout if self.training else 0.,
                                              is_causal=self.causal)

    def forward(self, q, k, v, mask=None):
        return self.flash_attn(q, k, v, mask=mask)


class Attention(nn.Module):
    def __init__(self, *, dim, causal=False, dim_head=64, heads=8, dropout=0., use_flash_attn=False,
                 use_custom_causal_attn_mask=False):
        super().__init__()
        dim_inner = dim_head * heads
        self.heads = heads
        self.attend = Attend(causal=causal and not use_custom_causal_attn_mask, dropout=dropout, use_flash=use_flash_attn)
        self.norm = RMSNorm(dim)
        self.to_q = nn.Linear(dim, dim_inner, bias=False)
        self.to_kv = nn.Linear(dim, dim_inner * 2, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)

    def forward(self, x, rotary_emb=None, mask=None):
        h = self.heads
        b, n, _ = x.shape
        x = self.norm(x)
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(lambda t: t.view(b, n, h, -1).transpose(1, 2), (q, k, v))
        out = self.attend(q, k, v, mask=mask)
        out = out.transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class RecurrentMemoryTransformer(nn.Module):
    def __init__(self, dim, *, num_tokens, depth, num_memory_tokens, seq_len, causal=True, dim_head=64,
                 heads=8, ff_mult=4, use_flash_attn=False, token_shift=True, memory_not_causal=True):
        super().__init__()
        self.causal = causal
        self.seq_len = seq_len
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.pos_emb = nn.Embedding(seq_len, dim)
        self.maybe_token_shift = token_shift_fn if token_shift else (lambda t, ps: t)
        self.num_memory_tokens = num_memory_tokens
        self.read_memory_emb = nn.Parameter(torch.zeros(dim))
        nn.init.normal_(self.read_memory_emb, std=0.02)
        self.memory_tokens = nn.Parameter(torch.randn(num_memory_tokens, dim))
        nn.init.normal_(self.memory_tokens, std=0.02)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim=dim, dim_head=dim_head, causal=causal, heads=heads, use_flash_attn=use_flash_attn,
                          use_custom_causal_attn_mask=memory_not_causal),
                FeedForward(dim=dim, mult=ff_mult),
            ]))
        self.to_logits = nn.Sequential(RMSNorm(dim), nn.Linear(dim, num_tokens, bias=False))
        # whether to use custom attention mask if causal and memory should not be causal
        self.use_custom_causal_attn_mask = causal and memory_not_causal

    def init_memory(self, batch):
        return self.memory_tokens[None].expand(batch, -1, -1)

    def forward(self, x, read_memories=None, *, mask=None):
        b, n, device, mem_length = *x.shape, x.device, self.num_memory_tokens
        pos = torch.arange(n, device=device)
        x = self.token_emb(x) + self.pos_emb(pos)
        write_memories = self.init_memory(b)
        if exists(read_memories):
            read_mem_length = mem_length
            read_memories = read_memories + self.read_memory_emb
        else:
            read_mem_length = 0
            read_memories = x[:, 0:0]
        x = torch.cat((read_memories, x, write_memories), dim=1)
        ps = (read_mem_length, n)
        if exists(mask):
            mask = F.pad(mask, (read_mem_length, mem_length), value=True)
        # custom causal mask, if needed
        if self.use_custom_causal_attn_mask:
            causal_mask = torch.ones((n, n), device=device, dtype=torch.bool).tril()
            if FIXED:
                causal_mask = F.pad(causal_mask, (0, mem_length, read_mem_length, 0), value=False)
                causal_mask = F.pad(causal_mask, (read_mem_length, 0, 0, mem_length), value=True)
            else:
                causal_mask = F.pad(causal_mask, (read_mem_length, mem_length) * 2, value=True)
            assert not exists(mask)
            mask = causal_mask[None, None]
        for attn, ff in self.layers:
            x = attn(self.maybe_token_shift(x, ps), mask=mask) + x
            x = ff(self.maybe_token_shift(x, ps)) + x
        read_memories, x, write_memories = x[:, :read_mem_length], x[:, read_mem_length:read_mem_length + n], x[:, read_mem_length + n:]
        logits = self.to_logits(x)
        return logits, write_memories


def main():
    torch.manual_seed(0)
    model = RecurrentMemoryTransformer(32, num_tokens=40, depth=2, num_memory_tokens=2, seq_len=6,
                                       dim_head=8, heads=4, use_flash_attn=True).eval()
    tokens = torch.randint(0, 40, (1, 12))
    with torch.no_grad():
        logits1, memories = model(tokens[:, :6])
        logits2, _ = model(tokens[:, 6:], read_memories=memories)
    print("segment 1 first-token logits[:4]:", [round(v, 4) for v in logits1[0, 0, :4].tolist()])
    print("segment 2 first-token logits[:4]:", [round(v, 4) for v in logits2[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
