# titans-pytorch MemoryAsContextTransformer (MAC), flex attention path (titans_pytorch/mac_transformer.py).
# Citation: lucidrains/titans-pytorch commit 8902334 ("fix a silly user-error with flex attention, it all works now").
# Bug: create_mac_mask shifted the key index by `is_persist_mem` (a bool, 0 for every sequence key) instead of by
# `persist_mem_len`, so causal and segment tests ran on key indices still counting the persistent-memory prefix,
# and the forward built the block mask with window `self.segment_len`, not the segment length with its
# interleaved long-term memory tokens. Fix: subtract `persist_mem_len`; window `segment_len + num_longterm_mem_tokens`.
# Trimmed: NeuralMemory, hyper connections and the axial positional embedding are left out (none touches the mask);
# upstream only takes the flex path on CUDA (compiled), here flex_attention runs eagerly on CPU, forward only; einops calls written as reshapes.
import sys
from math import ceil
from functools import partial

import torch
from torch import nn, cat
import torch.nn.functional as F
from torch.nn import Module, ModuleList, Linear
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

FIXED = "--fixed" in sys.argv


def create_mac_block_mask(seq_len, window_size, persist_mem_len):

    def create_mac_mask(b, h, q_idx, kv_idx):
        is_persist_mem = kv_idx < persist_mem_len
        if FIXED:
            causal_mask = q_idx >= (kv_idx - persist_mem_len)
            block_diagonal = (q_idx // window_size) == ((kv_idx - persist_mem_len) // window_size)
        else:
            # upstream wrote `kv_idx - is_persist_mem`; the compiled mask_mod promotes the bool to 0 / 1, eager vmap
            # refuses int - bool, so the promotion is spelled out
            causal_mask = q_idx >= (kv_idx - is_persist_mem.long())
            block_diagonal = (q_idx // window_size) == ((kv_idx - is_persist_mem.long()) // window_size)
        return is_persist_mem | (~is_persist_mem & (causal_mask & block_diagonal))

    block_mask = create_block_mask(create_mac_mask, B = None, H = None, Q_LEN = seq_len, KV_LEN = seq_len + persist_mem_len, device = 'cpu', _compile = False)
    return block_mask


LinearNoBias = partial(Linear, bias = False)


def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


def identity(t):
    return t


def round_up_multiple(seq, mult):
    return ceil(seq / mult) * mult


def pad_and_segment_with_inverse(seq, segment_len):
    batch, seq_len = seq.shape[:2]

    need_segment = seq_len >= segment_len

    if not need_segment:
        return seq, identity

    next_seq_len_mult = round_up_multiple(seq_len, segment_len)

    padding = next_seq_len_mult - seq_len
    needs_pad = padding > 0

    if needs_pad:
        seq = F.pad(seq, (0, 0, 0, padding))

    seq = seq.reshape(-1, segment_len, seq.shape[-1])  # 'b (w n) d -> (b w) n d'

    def inverse(out):
        out = out.reshape(batch, -1, out.shape[-1])  # '(b w) n d -> b (w n) d'

        if needs_pad:
            out = out[:, :-padding]

        return out

    return seq, inverse


class RotaryEmbedding(Module):
    # rotary_embedding_torch.RotaryEmbedding, the part rotate_queries_with_cached_keys uses
    def __init__(self, dim, theta = 10000):
        super().__init__()
        self.register_buffer('freqs', 1. / (theta ** (torch.arange(0, dim, 2).float() / dim)), persistent = False)

    def rotate(self, t, offset = 0):
        seq_len = t.shape[-2]
        pos = torch.arange(seq_len, dtype = torch.float32) + offset
        freqs = torch.einsum('i,j->ij', pos, self.freqs).repeat_interleave(2, dim = -1)
        t1, t2 = t.unflatten(-1, (-1, 2)).unbind(-1)
        rotated = torch.stack((-t2, t1), dim = -1).flatten(-2)
        return t * freqs.cos() + rotated * freqs.sin()

    def rotate_queries_with_cached_keys(self, q, k):
        q_len, k_len = q.shape[-2], k.shape[-2]
        return self.rotate(q, offset = k_len - q_len), self.rotate(k)


class GEGLU(Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim = -1)
        return F.silu(gate) * x


def FeedForward(dim, mult = 4):
    dim_inner = int(dim * mult * 2 / 3)

    return nn.Sequential(
        nn.RMSNorm(dim),
        nn.Linear(dim, dim_inner * 2),
        GEGLU(),
        nn.Linear(dim_inner, dim)
    )


class SegmentedAttention(Module):
    def __init__(
        self,
        dim,
        segment_len,
        num_persist_mem_tokens = 0,
        num_longterm_mem_tokens = 0,
        dim_head = 64,
        heads = 8,
        accept_value_residual = False,
        use_flex_attn = False
    ):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.heads = heads

        dim_inner = dim_head * heads

        self.rotary_emb = RotaryEmbedding(dim_head)

        self.to_qkv = LinearNoBias(dim, dim_inner * 3)
        self.to_out = LinearNoBias(dim_inner, dim)

        self.to_learned_v_mix = nn.Sequential(
            nn.Linear(dim, heads),
            nn.Sigmoid()
        ) if accept_value_residual else None

        self.segment_len = segment_len
        self.num_longterm_mem_tokens = num_longterm_mem_tokens

        self.persistent_memory = nn.Parameter(torch.randn(2, heads, num_persist_mem_tokens, dim_head) * 0.02)

        self.use_flex_attn = use_flex_attn
        self.num_persist_mem_tokens = num_persist_mem_tokens

    def split_heads(self, t):  # 'b n (h d) -> b h n d'
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def merge_heads(self, t):  # 'b h n d -> b n (h d)'
        return t.transpose(1, 2).flatten(-2)

    def forward_flex(self, seq, value_residual = None, flex_attn_fn = None):

        assert not (exists(value_residual) ^ exists(self.to_learned_v_mix))

        batch, seq_len = seq.shape[:2]

        # attention

        seq = self.norm(seq)

        q, k, v = self.to_qkv(seq).chunk(3, dim = -1)
        q, k, v = map(self.split_heads, (q, k, v))

        # value residual

        orig_v = v

        if exists(self.to_learned_v_mix):
            mix = self.to_learned_v_mix(seq).transpose(1, 2).unsqueeze(-1)  # 'b n h -> b h n 1'
            v = v.lerp(value_residual, mix)

        # take care of persistent memory key / values

        pmk, pmv = self.persistent_memory.unsqueeze(1).expand(-1, batch, -1, -1, -1)  # 'kv h n d -> kv b h n d'

        # relative positions

        q, k = self.rotary_emb.rotate_queries_with_cached_keys(q, k)

        # persistent memory

        k = cat((pmk, k), dim = -2)
        v = cat((pmv, v), dim = -2)

        # prep flex attention

        if not exists(flex_attn_fn):
            block_mask = create_mac_block_mask(seq_len, self.segment_len, self.num_persist_mem_tokens)

            flex_attn_fn = partial(flex_attention, block_mask = block_mask)

        # attention

        out = flex_attn_fn(q, k, v)

        out = self.merge_heads(out)

        out = self.to_out(out)

        return out, orig_v

    def forward(self, seq, value_residual = None, flex_attn_fn = None, disable_flex_attn = False):
        assert self.use_flex_attn and not disable_flex_attn
        return self.forward_flex(seq, value_residual, flex_attn_fn)


class MemoryAsContextTransformer(Module):
    def __init__(
        self,
        *,
        num_tokens,
        dim,
        depth,
        segment_len,
        num_longterm_mem_tokens = 0,
        num_persist_mem_tokens = 0,
        dim_head = 64,
        heads = 8,
        ff_mult = 4,
        use_flex_attn = False
    ):
        super().__init__()

        self.token_emb = nn.Embedding(num_tokens, dim)

        # long term mem tokens

        self.segment_len = segment_len

        self.num_longterm_mem_tokens = num_longterm_mem_tokens

        self.longterm_mems = nn.Parameter(torch.randn(num_longterm_mem_tokens, dim) * 0.02)

        self.layers = ModuleList([])

        layers = tuple(range(1, depth + 1))

        for layer in layers:
            is_first = layer == 1

            attn = SegmentedAttention(
                dim = dim,
                dim_head = dim_head,
                heads = heads,
                segment_len = segment_len,
                use_flex_attn = use_flex_attn,
                accept_value_residual = not is_first,
                num_longterm_mem_tokens = num_longterm_mem_tokens,
                num_persist_mem_tokens = num_persist_mem_tokens
            )

            ff = FeedForward(dim = dim, mult = ff_mult)

            self.layers.append(ModuleList([attn, ff]))

        self.norm = nn.RMSNorm(dim)

        self.to_logits = LinearNoBias(dim, num_tokens)

        self.use_flex_attn = use_flex_attn

        self.segment_len = segment_len
        self.num_persist_mem_tokens = num_persist_mem_tokens

    def forward(self, x, return_loss = False, disable_flex_attn = False):

        if return_loss:
            x, labels = x[:, :-1], x[:, 1:]

        batch, seq_len, segment_len, num_longterm_mem_tokens = *x.shape, self.segment_len, self.num_longterm_mem_tokens

        # token embedding

        x = self.token_emb(x)

        # intersperse longterm memory

        x, inverse_segment = pad_and_segment_with_inverse(x, segment_len)

        mems = self.longterm_mems.unsqueeze(0).expand(x.shape[0], -1, -1)  # 'n d -> b n d'
        x = cat((x, mems), dim = -2)  # pack((x, mems), 'b * d')

        x = inverse_segment(x)

        seq_len_with_mem = x.shape[-2]

        # prep flex attention

        use_flex_attn = self.use_flex_attn and not disable_flex_attn

        flex_attn_fn = None

        if use_flex_attn:
            if FIXED:
                block_mask = create_mac_block_mask(seq_len_with_mem, segment_len + num_longterm_mem_tokens, self.num_persist_mem_tokens)
            else:
                block_mask = create_mac_block_mask(seq_len_with_mem, self.segment_len, self.num_persist_mem_tokens)
            flex_attn_fn = partial(flex_attention, block_mask = block_mask)

        # value residual

        value_residual = None

        for attn, ff in self.layers:

            attn_out, values = attn(
                x,
                value_residual = value_residual,
                disable_flex_attn = disable_flex_attn,
                flex_attn_fn = flex_attn_fn
            )

            x = x + attn_out

            value_residual = default(value_residual, values)

            x = x + ff(x)

        # excise out the memories

        x, inverse_segment = pad_and_segment_with_inverse(x, segment_len + num_longterm_mem_tokens)

        x = x[:, :segment_len]  # unpack(x, mem_ps, 'b * d')

        x = inverse_segment(x)

        # to logits

        x = self.norm(x)

        logits = self.to_logits(x)

        if not return_loss:
            return logits

        return F.cross_entropy(logits.transpose(1, 2), labels)


def main():
    torch.manual_seed(0)

    transformer = MemoryAsContextTransformer(
        num_tokens = 64,
        dim = 32,
        depth = 2,
        segment_len = 4,
        num_persist_mem_tokens = 4,
        num_longterm_mem_tokens = 2,
        dim_head = 16,
        heads = 2,
        use_flex_attn = True
    )

    ids = torch.randint(0, 64, (2, 17))

    # flex_attention has no backward on CPU: evaluate the training loss without gradients
    with torch.no_grad():
        loss = transformer(ids, return_loss = True)
        logits = transformer(ids[:, :-1])

    print('loss:', round(loss.item(), 6))
    print('logits[0, 1, :4]:', [round(v, 5) for v in logits[0, 1, :4].tolist()])
    print('argmax at first 6 positions:', logits[0, :6].argmax(-1).tolist())


if __name__ == '__main__':
    main()
