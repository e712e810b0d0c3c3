"""Memformer (memory-augmented transformer): the memory-update attention's source padding mask.

Citation: lucidrains/memformer commit ab3530e ("fix memory update masking bug"),
memformer/memformer.py (``Memformer.forward``, ``Attention.forward``), read at ab3530e^ and ab3530e.

Memformer keeps ``num_memory_slots`` memory vectors per sample. After each segment the slots are
updated by attention: every slot queries [the memory slots ; the encoded segment], a slot may see
itself (an identity block) and the segment's real tokens (``src_mask`` padded with True over the
memory columns). Then a GRU cell gates the update and the result is carried to the next segment.

The bug: the update mask was built without a batch axis. ``mem_mask`` was (num_mem, num_mem + n)
and ``mem_mask &= mem_enc_mask`` combined it in place with the (batch, num_mem + n) source mask;
``Attention`` then read the mask as ``'i j -> () () i j'`` (one mask for every sample). When the
batch size equals the number of memory slots this broadcasts without complaint: memory slot i of
*every* sample is masked with sample i's padding, so a slot of a full-length sample is cut off from
that sample's last tokens and a slot of a padded sample can read its padding.

The fix: ``repeat(mem_mask, 'i j -> b i j', b = b)``, the source mask as ``'b j -> b () j'``, and
``Attention`` reads the mask as ``'b i j -> b () i j'``.

The file is ported at toy sizes (dim 32, 4 heads, depth 1, 4 memory slots, a batch of 4 right-padded
segments of 8 tokens), the full encoder / decoder as in the README, run over two segments with the
memory carried. einops is not installed here, so ``rearrange`` / ``repeat`` are written with torch
ops. The masked fills use ``-torch.finfo(dtype).max`` (the project's later commit c8f9a97, "remove
float(-inf) for extra stability") in both versions: with ``float('-inf')`` the encoder's padded query
rows, whose every key is masked, turn NaN and the NaN reaches every memory slot of a padded sample
through the update's values, with or without this fix.
"""

import sys
from inspect import isfunction

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

# helpers

def exists(val):
    return val is not None

def default(val, d):
    if exists(val):
        return val
    return d() if isfunction(d) else d

def max_neg_value(tensor):
    return -torch.finfo(tensor.dtype).max

# helper classes

class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(x, **kwargs) + x

class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        x = self.norm(x)
        return self.fn(x, **kwargs)

# positional embedding

def rel_shift(t):
    b, h, i, j, device, dtype = *t.shape, t.device, t.dtype
    zero_pad = torch.zeros((b, h, i, 1), device = device, dtype = dtype)
    concatted = torch.cat([zero_pad, t], dim = -1)
    shifted = concatted.view(b, h, j + 1, i)[:, :, 1:]
    return shifted.view_as(t)

class SinusoidalEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1. / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, x, context_len = 0):
        n, device = x.shape[1], x.device
        l = n + context_len
        t = torch.arange(l - 1, -1, -1, device = device).type_as(self.inv_freq)
        sinusoid_inp = einsum('i , j -> i j', t, self.inv_freq)
        emb = torch.cat((sinusoid_inp.sin(), sinusoid_inp.cos()), dim = -1)
        return emb

# main classes

class FeedForward(nn.Module):
    def __init__(self, dim, mult = 4):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(dim, dim * mult),
            nn.GELU(),
            nn.Linear(dim * mult, dim)
        )

    def forward(self, x):
        return self.net(x)

class Attention(nn.Module):
    def __init__(self, dim, heads = 8, causal = False, rel_pos_emb = False):
        super().__init__()
        assert (dim % heads) == 0, 'dimension must be divisible by number of heads'
        dim_head = dim // heads
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal

        self.to_pos = nn.Linear(dim, dim_head) if rel_pos_emb else None
        self.to_q = nn.Linear(dim, dim)
        self.to_kv = nn.Linear(dim, dim * 2)
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x, context = None, pos_emb = None, mask = None, query_mask = None, kv_mask = None, attend_self = False):
        b, n, _, h, scale, device = *x.shape, self.heads, self.scale, x.device

        if attend_self:
            kv_input = torch.cat((x, context), dim = 1)
        else:
            kv_input = default(context, x)

        q = self.to_q(x)
        kv = self.to_kv(kv_input).chunk(2, dim = -1)

        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, *kv))
        dots = einsum('b h i d, b h j d -> b h i j', q, k) * scale

        if exists(self.to_pos):
            p = self.to_pos(pos_emb)
            pos_attn = einsum('b h i d, j d -> b h i j', q, p) * scale
            pos_attn = rel_shift(pos_attn)
            dots += pos_attn

        mask_value = max_neg_value(dots)

        if self.causal:
            causal_mask = torch.ones((n, n), device = device).triu_(1).bool()
            dots.masked_fill_(causal_mask, mask_value)
            del causal_mask

        if any(map(exists, (query_mask, kv_mask))):
            query_mask = default(query_mask, lambda: torch.ones((b, n), device = device).bool())

            if exists(context):
                kv_mask = default(kv_mask, lambda: torch.ones((b, context.shape[1]), device = device).bool())
            else:
                kv_mask = default(kv_mask, query_mask)

            query_mask = query_mask[:, None, :, None]   # 'b i -> b () i ()'
            kv_mask = kv_mask[:, None, None, :]         # 'b j -> b () () j'
            seq_mask = query_mask * kv_mask
            dots.masked_fill_(~seq_mask, mask_value)
            del seq_mask

        if exists(mask):
            if FIXED:
                mask = mask[:, None, :, :]              # 'b i j -> b () i j'
            else:
                mask = mask[None, None, :, :]           # 'i j -> () () i j'
            dots.masked_fill_(~mask, mask_value)
            del mask

        attn = dots.softmax(dim = -1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(b, n, -1)     # 'b h n d -> b n (h d)'
        return self.to_out(out)

class Encoder(nn.Module):
    def __init__(self, dim, depth, heads = 8):
        super().__init__()
        self.sinu_emb = SinusoidalEmbedding(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Residual(PreNorm(dim, Attention(dim, heads = heads, rel_pos_emb = True))),
                Residual(PreNorm(dim, Attention(dim, heads = heads))),
                Residual(PreNorm(dim, FeedForward(dim)))
            ]))
    def forward(self, x, context = None, src_mask = None):
        pos_emb = self.sinu_emb(x)
        for (self_attn, cross_attn, ff) in self.layers:
            x = self_attn(x, pos_emb = pos_emb, query_mask = src_mask)
            x = cross_attn(x, context = context)
            x = ff(x)
        return x

class Decoder(nn.Module):
    def __init__(self, dim, depth, heads = 8):
        super().__init__()
        self.sinu_emb = SinusoidalEmbedding(dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Residual(PreNorm(dim, Attention(dim, heads = heads, causal = True, rel_pos_emb = True))),
                Residual(PreNorm(dim, Attention(dim, heads = heads))),
                Residual(PreNorm(dim, FeedForward(dim))),
            ]))
    def forward(self, x, context = None, src_mask = None, tgt_mask = None):
        pos_emb = self.sinu_emb(x)
        for (self_attn, cross_attn, ff) in self.layers:
            x = self_attn(x, pos_emb = pos_emb, query_mask = src_mask)
            x = cross_attn(x, context = context, query_mask = src_mask, kv_mask = tgt_mask)
            x = ff(x)
        return x

class TransformerWrapper(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len, dim, layer_blocks, heads = 8, return_logits = True):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.layer_blocks = layer_blocks
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens) if return_logits else nn.Identity()

    def forward(self, x, **kwargs):
        _, n, device = *x.shape, x.device
        x = self.token_emb(x)
        x = self.layer_blocks(x, **kwargs)
        x = self.norm(x)
        return self.to_logits(x)

class Memformer(nn.Module):
    def __init__(
        self,
        *,
        num_tokens,
        dim,
        depth,
        max_seq_len,
        num_memory_slots,
        num_mem_updates = 1,
        heads = 8,
        encoder_only = False):
        super().__init__()

        self.encoder = TransformerWrapper(
            num_tokens = num_tokens,
            dim = dim,
            max_seq_len = max_seq_len,
            layer_blocks = Encoder(dim, depth, heads),
            return_logits = False
        )

        self.decoder = TransformerWrapper(
            num_tokens = num_tokens,
            dim = dim,
            max_seq_len = max_seq_len,
            layer_blocks = Decoder(dim, depth, heads),
            return_logits = True
        ) if not encoder_only else None

        self.num_mem = num_memory_slots
        self.memory_slots = nn.Parameter(torch.randn(num_memory_slots, dim))

        self.num_mem_updates = num_mem_updates
        self.mem_updater = Attention(dim, heads = heads)
        self.gru = nn.GRUCell(dim, dim)
        self.mem_ff = Residual(PreNorm(dim, FeedForward(dim)))

    def forward(self, src, tgt = None, mems = None, src_mask = None, tgt_mask = None):
        b, n, num_mem, device = *src.shape, self.num_mem, src.device
        mems = default(mems, self.memory_slots)

        if mems.ndim == 2:
            mems = mems[None].repeat(b, 1, 1)         # repeat(mems, 'n d -> b n d', b = b)

        enc = self.encoder(src, context = mems, src_mask = src_mask)

        if exists(self.decoder):
            assert exists(tgt), 'target sequence must be given if using full encoder / decoder memformer'
            out = self.decoder(tgt, context = enc, src_mask = tgt_mask, tgt_mask = src_mask)
        else:
            out = enc

        # update memory with attention
        mem_mask = torch.eye(num_mem, num_mem, device = device).bool()
        if FIXED:
            mem_mask = mem_mask[None].repeat(b, 1, 1)   # repeat(mem_mask, 'i j -> b i j', b = b)
        mem_mask = F.pad(mem_mask, (0, n), value = True)

        if exists(src_mask):
            if FIXED:
                src_mask = src_mask[:, None, :]         # rearrange(src_mask, 'b j -> b () j')
            mem_enc_mask = F.pad(src_mask, (num_mem, 0), value = True)
            mem_mask &= mem_enc_mask

        for _ in range(self.num_mem_updates):
            prev_mems = mems
            updated_mems = self.mem_updater(mems, enc, mask = mem_mask, attend_self = True)

            next_mems = self.gru(
                updated_mems.reshape(-1, updated_mems.shape[-1]),   # 'b n d -> (b n) d'
                prev_mems.reshape(-1, prev_mems.shape[-1])
            )

            mems = next_mems.reshape(b, -1, next_mems.shape[-1])    # '(b n) d -> b n d'
            mems = self.mem_ff(mems)

        return out, mems


def main():
    torch.manual_seed(0)
    model = Memformer(
        num_tokens = 64,
        dim = 32,
        depth = 1,
        max_seq_len = 8,
        num_memory_slots = 4,
        num_mem_updates = 2,
        heads = 4,
    ).eval()

    batch, seg_len = 4, 8
    lengths = torch.tensor([8, 5, 8, 3])
    src_mask = torch.arange(seg_len)[None, :] < lengths[:, None]   # True = a real token (right padded)

    x1 = torch.randint(1, 64, (batch, seg_len)).masked_fill(~src_mask, 0)
    y1 = torch.randint(1, 64, (batch, seg_len))
    x2 = torch.randint(1, 64, (batch, seg_len)).masked_fill(~src_mask, 0)
    y2 = torch.randint(1, 64, (batch, seg_len))

    with torch.no_grad():
        tgt_out1, mems1 = model(x1, y1, src_mask = src_mask)
        tgt_out2, mems2 = model(x2, y2, mems = mems1, src_mask = src_mask)

    print("mems1", tuple(mems1.shape), "mems2", tuple(mems2.shape), "tgt_out2", tuple(tgt_out2.shape))
    for i in range(batch):
        print(f"sample {i} (length {lengths[i].item()}): mems1 slot norms",
              [round(v, 4) for v in mems1[i].norm(dim=-1).tolist()],
              "| segment-2 argmax", tgt_out2[i].argmax(-1).tolist())
    print("segment-2 logits checksum", round(tgt_out2.sum().item(), 4))


if __name__ == "__main__":
    main()
