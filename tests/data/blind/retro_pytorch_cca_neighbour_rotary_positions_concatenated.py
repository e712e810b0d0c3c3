# lucidrains/RETRO-pytorch commit e33fed8 ("fix RPE in cross chunked attention when there are multiple retrieved
# neighbors"). In the decoder's chunked cross-attention each sequence chunk attends to its retrieved neighbours
# concatenated along the key axis, context 'b k r n d -> (b k) (r n) d'. The rotary (relative) positions of the keys
# were built for num_neighbors * chunk_size positions, so neighbour 2 sat at positions chunk_size..2*chunk_size-1,
# as if it continued neighbour 1, and its relative distance to the (shifted) queries changed with its rank.
# The fix builds key positions for one chunk (chunk_size) and repeats them per neighbour, '(r n)'.
# Ported from retro_pytorch/retro_pytorch.py at e33fed8^ (einops rearrange/repeat written with reshape; encoder trimmed:
# the retrieved neighbour tokens are embedded and handed to the decoder as its context).
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv

MIN_DIM_HEAD = 32

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def cast_tuple(val, num = 1):
    return val if isinstance(val, tuple) else ((val,) * num)

class RMSNorm(nn.Module):
    def __init__(self, dim, eps = 1e-8):
        super().__init__()
        self.eps = eps
        self.scale = dim ** -0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = x.norm(keepdim = True, dim = -1) * self.scale
        return (x / norm.clamp(min = self.eps)) * self.gamma

class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1. / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, max_seq_len, device):
        seq = torch.arange(max_seq_len, device = device)
        freqs = einsum('i , j -> i j', seq.type_as(self.inv_freq), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim = -1)
        return emb[None, None]                                  # 'n d -> 1 1 n d'

def rotate_half(x):
    x1, x2 = x.reshape(*x.shape[:-1], 2, x.shape[-1] // 2).unbind(dim = -2)
    return torch.cat((-x2, x1), dim = -1)

def apply_rotary_pos_emb(t, freqs):
    seq_len = t.shape[-2]
    freqs = freqs[:, :, :seq_len]
    return (t * freqs.cos()) + (rotate_half(t) * freqs.sin())

def FeedForward(dim, mult = 4, dropout = 0.):
    inner_dim = int(mult * dim)
    return nn.Sequential(RMSNorm(dim), nn.Linear(dim, inner_dim), nn.GELU(), nn.Dropout(dropout), nn.Linear(inner_dim, dim))

class Attention(nn.Module):
    def __init__(self, dim, *, dim_head = 64, heads = 8, causal = False, dropout = 0.):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal
        inner_dim = dim_head * heads
        self.norm = RMSNorm(dim)
        self.dropout = nn.Dropout(dropout)
        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, context = None, pos_emb = None):
        device, h, scale = x.device, self.heads, self.scale
        x = self.norm(x)
        kv_input = default(context, x)

        q = self.to_q(x)
        k, v = self.to_kv(kv_input).chunk(2, dim = -1)
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))
        q = q * scale

        if exists(pos_emb):
            q_pos_emb, k_pos_emb = cast_tuple(pos_emb, num = 2)
            q = apply_rotary_pos_emb(q, q_pos_emb)
            k = apply_rotary_pos_emb(k, k_pos_emb)

        sim = einsum('b h i d, b h j d -> b h i j', q, k)

        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones(i, j, device = device, dtype = torch.bool).triu(j - i + 1)
            mask_value = -torch.finfo(sim.dtype).max
            sim = sim.masked_fill(causal_mask, mask_value)

        attn = sim.softmax(dim = -1)
        attn = self.dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)
        return self.to_out(out)

class ChunkedCrossAttention(nn.Module):
    def __init__(self, chunk_size, **kwargs):
        super().__init__()
        self.chunk_size = chunk_size
        self.cross_attn = Attention(**kwargs)

    def forward(self, x, *, context, pos_emb = None):
        chunk_size = self.chunk_size
        b, n, num_chunks, num_retrieved = x.shape[0], x.shape[-2], *context.shape[-4:-2]
        causal_padding = chunk_size - 1

        # causal padding
        x = F.pad(x, (0, 0, -causal_padding, causal_padding), value = 0.)

        # make sure queries positions are properly shifted to the future
        q_pos_emb, k_pos_emb = pos_emb
        q_pos_emb = F.pad(q_pos_emb, (0, 0, -causal_padding, causal_padding), value = 0.)
        if FIXED:
            k_pos_emb = k_pos_emb.repeat(1, 1, num_retrieved, 1)   # 'b h n d -> b h (r n) d'
        pos_emb = (q_pos_emb, k_pos_emb)

        # reshape so we have chunk to chunk attention, without breaking causality
        x = x.reshape(b * num_chunks, -1, x.shape[-1])                          # 'b (k n) d -> (b k) n d'
        context = context.reshape(b * num_chunks, -1, context.shape[-1])        # 'b k r n d -> (b k) (r n) d'

        out = self.cross_attn(x, context = context, pos_emb = pos_emb)
        out = out.reshape(b, -1, out.shape[-1])                                 # '(b k) n d -> b (k n) d'

        # pad back to original, with 0s at the beginning
        out = F.pad(out, (0, 0, causal_padding, -causal_padding), value = 0.)
        return out

class Decoder(nn.Module):
    def __init__(self, dim, *, depth, heads = 8, dim_head = 64, attn_dropout = 0., ff_mult = 4, ff_dropout = 0.,
                 final_norm = True, cross_attn_layers = None, chunk_size = 64):
        super().__init__()
        self.layers = nn.ModuleList([])
        rotary_emb_dim = max(default(dim_head, dim_head // 2), MIN_DIM_HEAD)
        self.rotary_pos_emb = RotaryEmbedding(rotary_emb_dim)
        for layer_num in range(1, depth + 1):
            has_cross_attn = not exists(cross_attn_layers) or layer_num in cross_attn_layers
            self.layers.append(nn.ModuleList([
                Attention(dim = dim, dim_head = dim_head, heads = heads, dropout = attn_dropout, causal = True),
                ChunkedCrossAttention(chunk_size = chunk_size, dim = dim, dim_head = dim_head, heads = heads, dropout = attn_dropout) if has_cross_attn else None,
                FeedForward(dim = dim, mult = ff_mult, dropout = ff_dropout),
            ]))
        self.norm_out = RMSNorm(dim) if final_norm else nn.Identity()

    def forward(self, x, *, retrieved):
        device, seq_len, num_chunks, num_neighbors, chunk_size = x.device, x.shape[-2], *retrieved.shape[-4:-1]
        self_attn_pos_emb = self.rotary_pos_emb(seq_len, device = device)

        if FIXED:
            seq_chunk_size = seq_len // num_chunks
            cross_attn_q_pos_emb = self.rotary_pos_emb(seq_chunk_size + chunk_size, device = device)
            cross_attn_k_pos_emb = self.rotary_pos_emb(chunk_size, device = device)
        else:
            cross_attn_q_pos_emb = self.rotary_pos_emb(seq_len // num_chunks + chunk_size, device = device)  # need to add extra chunk size, since it will be shifted
            cross_attn_k_pos_emb = self.rotary_pos_emb(num_neighbors * chunk_size, device = device)
        cross_attn_pos_emb = (cross_attn_q_pos_emb, cross_attn_k_pos_emb)

        for attn, cross_attn, ff in self.layers:
            x = attn(x, pos_emb = self_attn_pos_emb) + x
            if exists(cross_attn):
                x = cross_attn(x, context = retrieved, pos_emb = cross_attn_pos_emb) + x
            x = ff(x) + x
        return self.norm_out(x)

class RETRO(nn.Module):
    def __init__(self, *, num_tokens, max_seq_len = 2048, dec_dim = 64, dec_depth = 2, dec_cross_attn_layers = (1,),
                 heads = 2, dim_head = 32, chunk_size = 4):
        super().__init__()
        self.chunk_size = chunk_size
        self.token_emb = nn.Embedding(num_tokens, dec_dim)
        self.pos_emb = nn.Embedding(max_seq_len, dec_dim)
        self.decoder = Decoder(dim = dec_dim, depth = dec_depth, heads = heads, dim_head = dim_head,
                               cross_attn_layers = dec_cross_attn_layers, chunk_size = chunk_size)
        self.to_logits = nn.Linear(dec_dim, num_tokens)

    def forward(self, seq, retrieved):
        # seq: (b, n); retrieved: (b, k, r, chunk_size) neighbour tokens for each of the k chunks
        n, device = seq.shape[-1], seq.device
        embed = self.token_emb(seq) + self.pos_emb(torch.arange(n, device = device))[None]
        retrieved = self.token_emb(retrieved)
        embed = self.decoder(embed, retrieved = retrieved)
        return self.to_logits(embed)

torch.manual_seed(0)
chunk_size, num_chunks, num_neighbors = 4, 3, 2
model = RETRO(num_tokens = 50, chunk_size = chunk_size).eval()
seq = torch.randint(0, 50, (2, num_chunks * chunk_size))
retrieved = torch.randint(0, 50, (2, num_chunks, num_neighbors, chunk_size))

with torch.no_grad():
    logits = model(seq, retrieved)

print("fixed" if FIXED else "buggy", "logits[0, -1, :5]:", [round(v, 4) for v in logits[0, -1, :5].tolist()])
print("next token per sequence:", logits[:, -1].argmax(-1).tolist())
