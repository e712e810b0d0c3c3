# lucidrains/native-sparse-attention-pytorch commit 36837b2: "when doing interpolation of importance score, remask to 0 for illegal positions"
# With interpolated_importance_score=True (compress_block_size != selection_block_size), the compressed-branch
# attention (exactly 0 on causally illegal compressed blocks) was bilinearly interpolated to token resolution, which
# smears non-zero importance into the first half of the next, still-future compressed block. The fine branch keeps a
# selected block whenever its importance is > 1e-10 and has no causal mask on selected blocks, so queries attended
# future keys. The fix records `importance_scores > 1e-10` before interpolating and masks the interpolated scores back to 0.
# Ported from native_sparse_attention_pytorch/native_sparse_attention.py @ 36837b2^ (non-flex fine path) and
# transformer.py; einops / einx / local_attention / rotary_embedding_torch calls are written out in plain torch.
import sys
from copy import deepcopy
from math import ceil

import torch
import torch.nn.functional as F
from torch import nn, arange, stack, cat, tensor
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv

# helpers

def exists(v):
    return v is not None

def default(v, d):
    return v if exists(v) else d

def round_down_mult(n, mult):
    return n // mult * mult

def round_up_mult(n, mult):
    return ceil(n / mult) * mult

def divisible_by(num, den):
    return (num % den) == 0

def pad_at_dim(t, pad, dim = -1, value = 0.):
    dims_from_right = (- dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = ((0, 0) * dims_from_right)
    return F.pad(t, (*zeros, *pad), value = value)

def interpolate_1d(x, length, mode = 'bilinear'):
    shape = x.shape
    x = x.reshape(-1, shape[-1])                     # pack '* n'
    x = x[:, None, :, None]                          # 'b n -> b 1 n 1'
    x = F.interpolate(x, (length, 1), mode = mode)
    x = x[:, 0, :, 0]                                # 'b 1 n 1 -> b n'
    return x.reshape(*shape[:-1], length)

def straight_through(t, target):
    return t + (target - t).detach()

# rotary (rotary_embedding_torch.RotaryEmbedding.rotate_queries_with_cached_keys, no cache offset)

class RotaryEmbedding(Module):
    def __init__(self, dim, theta = 10000):
        super().__init__()
        self.register_buffer('inv_freq', 1. / (theta ** (arange(0, dim, 2).float() / dim)), persistent = False)

    def rotate(self, t):
        seq = arange(t.shape[-2], device = t.device).float()
        freqs = torch.einsum('n, f -> n f', seq, self.inv_freq)
        freqs = freqs.repeat_interleave(2, dim = -1)
        x = t.unflatten(-1, (-1, 2))
        x1, x2 = x.unbind(-1)
        rotated_half = stack((-x2, x1), dim = -1).flatten(-2)
        return t * freqs.cos() + rotated_half * freqs.sin()

    def rotate_queries_with_cached_keys(self, q, k):
        return self.rotate(q), self.rotate(k)

# attend function

def attend(
    q, k, v,
    mask = None,
    return_attn = False,
    scale = None
):
    scale = default(scale, q.shape[-1] ** -0.5)

    q_heads, k_heads = q.shape[1], k.shape[1]
    num_grouped_queries = q_heads // k_heads

    q = q.unflatten(1, (k_heads, num_grouped_queries))          # 'b (h qh) ... -> b h qh ...'

    sim = torch.einsum('bhgid, bhjd -> bhgij', q, k) * scale

    mask_value = -torch.finfo(sim.dtype).max

    if exists(mask):
        sim = sim.masked_fill(~mask, mask_value)

    attn = sim.softmax(dim = -1)

    attn_out = torch.einsum('bhgij, bhjd -> bhgid', attn, v)

    attn_out = attn_out.flatten(1, 2)

    if not return_attn:
        return attn_out

    attn = attn.flatten(1, 2)

    return attn_out, attn

class LocalAttention(Module):
    # stands in for local_attention.LocalAttention(causal = True, exact_windowsize = True, autopad = True)
    def __init__(self, dim, window_size, causal = True, exact_windowsize = True, autopad = True, use_rotary_pos_emb = False):
        super().__init__()
        self.window_size = window_size

    def forward(self, q, k, v):
        n = q.shape[-2]
        i = arange(n)[:, None]
        j = arange(n)[None, :]
        mask = (j <= i) & ((i - j) <= self.window_size)
        return attend(q, k, v, mask = mask)

# classes

class SparseAttention(Module):
    def __init__(
        self,
        dim,
        dim_head,
        heads,
        sliding_window_size,
        compress_block_size,
        selection_block_size,
        num_selected_blocks,
        kv_heads = None,
        num_compressed_mem_kv = 1,
        norm = True,
        use_diff_topk = False,
        interpolated_importance_score = False,
        query_heads_share_selected_kv = True,
        compress_mlp: Module | None = None,
        compress_mlp_expand_factor = 1.,
        strategy_combine_mlp: Module | None = None
    ):
        super().__init__()

        kv_heads = default(kv_heads, heads)
        assert kv_heads <= heads and divisible_by(heads, kv_heads)

        self.heads = heads
        self.kv_heads = kv_heads
        self.num_grouped_queries = heads // kv_heads

        self.scale = dim_head ** -0.5

        dim_inner = dim_head * heads
        dim_kv_inner = dim_head * kv_heads

        self.norm = nn.RMSNorm(dim) if norm else nn.Identity()

        self.rotary_emb = RotaryEmbedding(dim_head)

        qkv_split = (dim_inner, dim_kv_inner, dim_kv_inner)
        self.to_qkv = nn.Linear(dim, sum(qkv_split), bias = False)
        self.qkv_split = qkv_split
        self.dim_head = dim_head

        # sliding window strategy

        self.sliding_window = LocalAttention(
            dim = dim_head,
            window_size = sliding_window_size,
            causal = True,
            exact_windowsize = True,
            autopad = True,
            use_rotary_pos_emb = False
        )

        self.sliding_window_size = sliding_window_size

        # compress strategy

        self.compress_block_size = compress_block_size

        assert num_compressed_mem_kv > 0

        self.compress_mem_kv = nn.Parameter(torch.zeros(2, kv_heads, num_compressed_mem_kv, dim_head))

        self.k_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))
        self.v_intrablock_positions = nn.Parameter(torch.zeros(kv_heads, compress_block_size, dim_head))

        if not exists(compress_mlp):
            compress_dim = compress_block_size * dim_head
            compress_mlp_dim_hidden = int(compress_mlp_expand_factor * compress_dim)

            compress_mlp = nn.Sequential(
                nn.Flatten(-2),                                   # 'b h w n d -> b h w (n d)'
                nn.Linear(compress_dim, compress_mlp_dim_hidden),
                nn.ReLU(),
                nn.Linear(compress_mlp_dim_hidden, dim_head),
            )

        self.k_compress = deepcopy(compress_mlp)
        self.v_compress = deepcopy(compress_mlp)

        # selection related

        self.use_diff_topk = use_diff_topk

        self.interpolated_importance_score = interpolated_importance_score # in the case fine block size < compressed block size, will weigh space better when selecting

        self.query_heads_share_selected_kv = query_heads_share_selected_kv

        self.selection_block_size = selection_block_size

        assert num_selected_blocks >= 0

        self.num_selected_blocks = num_selected_blocks

        if not exists(strategy_combine_mlp):
            strategy_combine_mlp = nn.Linear(dim, 3 * heads)

            nn.init.zeros_(strategy_combine_mlp.weight)
            strategy_combine_mlp.bias.data.copy_(tensor([-2., -2., 2.] * heads))

        self.to_strategy_combine = nn.Sequential(
            strategy_combine_mlp,
            nn.Sigmoid()
        )

        self.combine_heads = nn.Linear(dim_inner, dim, bias = False)

    def split_heads(self, t):
        return t.unflatten(-1, (-1, self.dim_head)).transpose(1, 2)      # 'b n (h d) -> b h n d'

    def merge_heads(self, t):
        return t.transpose(1, 2).flatten(-2)                              # 'b h n d -> b n (h d)'

    def split_compress_window(self, t):
        return t.unflatten(-2, (-1, self.compress_block_size))            # 'b h (w n) d -> b h w n d'

    def forward(
        self,
        inp
    ):
        batch, seq_len, scale, heads, device = *inp.shape[:2], self.scale, self.heads, inp.device

        compress_divisible_seq_len = round_down_mult(seq_len, self.compress_block_size)
        num_compress_blocks = compress_divisible_seq_len // self.compress_block_size

        fine_divisible_seq_len = round_up_mult(seq_len, self.selection_block_size)
        num_fine_blocks = fine_divisible_seq_len // self.selection_block_size

        inp = self.norm(inp)

        q, k, v = self.to_qkv(inp).split(self.qkv_split, dim = -1)

        q, k, v = map(self.split_heads, (q, k, v))

        # compressed key / values

        k_pos = self.k_intrablock_positions.repeat(1, num_compress_blocks, 1)
        v_pos = self.v_intrablock_positions.repeat(1, num_compress_blocks, 1)

        k_compress_input = self.split_compress_window(k[..., :compress_divisible_seq_len, :] + k_pos)
        v_compress_input = self.split_compress_window(v[..., :compress_divisible_seq_len, :] + v_pos)

        cq = q
        ck = self.k_compress(k_compress_input)   # Equation (7) of the Native Sparse Attention paper
        cv = self.v_compress(v_compress_input)

        # 1. coarse attention over compressed

        mem_ck, mem_cv = self.compress_mem_kv[:, None].expand(-1, batch, -1, -1, -1)

        num_mem_compress_kv = mem_ck.shape[-2]

        ck = cat((mem_ck, ck), dim = -2)
        cv = cat((mem_cv, cv), dim = -2)

        cq_seq = arange(seq_len, device = device)
        ck_seq = ((arange(num_compress_blocks, device = device) + 1) * self.compress_block_size) - 1
        ck_seq = F.pad(ck_seq, (num_mem_compress_kv, 0), value = -1)

        cmask = ck_seq[None, :] < cq_seq[:, None]          # einx.less('j, i -> i j', ck_seq, cq_seq)

        compressed_attn_out, cattn = attend(cq, ck, cv, mask = cmask, return_attn = True)

        rotated_q, rotated_k = self.rotary_emb.rotate_queries_with_cached_keys(q, k)

        # 2. fine attention over selected based on compressed attention logits

        importance_scores = cattn[..., num_mem_compress_kv:]

        if self.query_heads_share_selected_kv:
            importance_scores = importance_scores.unflatten(1, (-1, self.num_grouped_queries)).mean(dim = 2)

            fine_num_grouped_queries = self.num_grouped_queries
        else:
            fine_num_grouped_queries = 1

        # handle if compress block size does not equal to the fine block size

        if self.compress_block_size != self.selection_block_size:

            score_len = importance_scores.shape[-1]
            compress_seq_len = score_len * self.compress_block_size

            if self.interpolated_importance_score:
                if FIXED:
                    mask = importance_scores > 1e-10
                    mask = mask.repeat_interleave(self.compress_block_size, dim = -1)
                importance_scores = interpolate_1d(importance_scores, compress_seq_len)
                if FIXED:
                    importance_scores = importance_scores.masked_fill(~mask, 0.)
            else:
                importance_scores = importance_scores.repeat_interleave(self.compress_block_size, dim = -1)

            padding = fine_divisible_seq_len - compress_seq_len
            importance_scores = F.pad(importance_scores, (0, padding))

            importance_scores = importance_scores.unflatten(-1, (-1, self.selection_block_size)).mean(dim = -1)

        num_selected = min(self.num_selected_blocks, importance_scores.shape[-1])

        fq = rotated_q
        fk = rotated_k
        fv = v

        if num_selected > 0:
            selected_importance_values, selected_block_indices = importance_scores.topk(num_selected, dim = -1)

            if self.use_diff_topk:
                gates = straight_through(selected_importance_values, 1.)
                gates = gates.cumprod(dim = -1)[..., -1]
                gates = gates.repeat_interleave(fine_num_grouped_queries, dim = 1)

            fmask = selected_importance_values > 1e-10

            if seq_len < fine_divisible_seq_len:
                remainder = fine_divisible_seq_len - seq_len
                fk = pad_at_dim(fk, (0, remainder), value = 0., dim = -2)
                fv = pad_at_dim(fv, (0, remainder), value = 0., dim = -2)
                fq = pad_at_dim(fq, (0, remainder), value = 0., dim = -2)

                fmask = pad_at_dim(fmask, (0, remainder), value = False, dim = -2)

                selected_block_indices = pad_at_dim(selected_block_indices, (0, remainder), value = 0, dim = -2)

                if self.use_diff_topk:
                    gates = pad_at_dim(gates, (0, remainder), value = 1.)

            # handle block causal diagonal in the diagram

            sel_heads = selected_block_indices.shape[1]

            fine_window_seq = arange(fine_divisible_seq_len, device = device) // self.selection_block_size
            fine_window_seq = fine_window_seq[None, None, :, None].expand(batch, sel_heads, -1, 1)
            selected_block_indices = cat((selected_block_indices, fine_window_seq), dim = -1) # for the block causal diagonal in fig2

            fmask = fmask[..., None].expand(*fmask.shape, self.selection_block_size)          # 'b h i w -> b h i w j'

            causal_mask = torch.ones((self.selection_block_size,) * 2, device = device, dtype = torch.bool).tril()
            causal_mask = causal_mask.repeat(num_fine_blocks, 1)[None, None, :, None, :].expand(batch, sel_heads, -1, 1, -1)

            fmask = cat((fmask, causal_mask), dim = -2)
            fmask = fmask.flatten(-2)                                                         # 'b h i w j -> b h i (w j)'

            # select out the spatial crops of keys / values for fine attention

            fk = fk.unflatten(-2, (num_fine_blocks, -1))                                      # 'b h (w n) d -> b h w n d'
            fv = fv.unflatten(-2, (num_fine_blocks, -1))

            n_q = selected_block_indices.shape[2]

            if self.query_heads_share_selected_kv:
                fk = fk[:, :, None].expand(-1, -1, n_q, -1, -1, -1)                             # 'b h w j d -> b h i w j d'
                fv = fv[:, :, None].expand(-1, -1, n_q, -1, -1, -1)
            else:
                fk = fk[:, :, None].repeat_interleave(self.num_grouped_queries, dim = 1).expand(-1, -1, n_q, -1, -1, -1)
                fv = fv[:, :, None].repeat_interleave(self.num_grouped_queries, dim = 1).expand(-1, -1, n_q, -1, -1, -1)

            selected_block_indices = selected_block_indices[..., None, None].expand(*selected_block_indices.shape, fk.shape[-2], fk.shape[-1])

            fk = fk.gather(3, selected_block_indices)
            fv = fv.gather(3, selected_block_indices)

            fk, fv = tuple(t.flatten(3, 4) for t in (fk, fv))                                   # 'b h i w j d -> b h i (w j) d'

            # fine attention

            fmask = fmask[:, :, None]                                                           # 'b h ... -> b h 1 ...'

            fq = fq.unflatten(1, (-1, fine_num_grouped_queries))                                # 'b (h qh) ... -> b h qh ...'

            fsim = torch.einsum('bhgid, bhijd -> bhgij', fq, fk) * self.scale

            mask_value = -torch.finfo(fsim.dtype).max

            fsim = fsim.masked_fill(~fmask, mask_value)

            fattn = fsim.softmax(dim = -1)

            fine_attn_out = torch.einsum('bhgij, bhijd -> bhgid', fattn, fv)

            fine_attn_out = fine_attn_out.flatten(1, 2)

            fine_attn_out = fine_attn_out[..., :seq_len, :]

            if self.use_diff_topk:
                gates = gates[..., :seq_len]
                fine_attn_out = gates[..., None] * fine_attn_out

        else:
            seq_len = fk.shape[-2]
            fmask = causal_mask = torch.ones((seq_len, seq_len), device = device, dtype = torch.bool).tril()

            fine_attn_out = attend(fq, fk, fv, mask = fmask)

        # 3. overlapping sliding window

        sq = rotated_q
        sk = rotated_k
        sv = v

        sk, sv = tuple(t.repeat_interleave(self.num_grouped_queries, dim = 1) for t in (sk, sv))

        sliding_window_attn_out = self.sliding_window(sq, sk, sv)

        # combine strategies

        strategy_weighted_combine = self.to_strategy_combine(inp).unflatten(-1, (heads, 3)).transpose(1, 2)  # 'b n (h s) -> b h n s'

        out = torch.einsum('bhns, sbhnd -> bhnd', strategy_weighted_combine, stack([compressed_attn_out, fine_attn_out, sliding_window_attn_out]))

        out = self.merge_heads(out)

        return self.combine_heads(out)

# transformer.py

def FeedForward(dim, expansion_factor = 4.):
    dim_hidden = int(dim * expansion_factor)

    return nn.Sequential(
        nn.RMSNorm(dim),
        nn.Linear(dim, dim_hidden),
        nn.GELU(),
        nn.Linear(dim_hidden, dim)
    )

class Transformer(Module):
    def __init__(
        self,
        num_tokens,
        dim,
        depth,
        dim_head = 64,
        heads = 8,
        kv_heads = None,
        ff_expansion_factor = 4.,
        sparse_attn_kwargs: dict = dict(
            sliding_window_size = 32,
            compress_block_size = 4,
            selection_block_size = 4,
            num_selected_blocks = 4,
        )
    ):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)

        layers = []
        for _ in range(depth):
            attn = SparseAttention(
                dim = dim,
                dim_head = dim_head,
                heads = heads,
                kv_heads = kv_heads,
                **sparse_attn_kwargs
            )

            ff = FeedForward(dim = dim, expansion_factor = ff_expansion_factor)

            layers.append(ModuleList([attn, ff]))

        self.layers = ModuleList(layers)

        self.norm = nn.RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias = False)

    def forward(
        self,
        ids,
        return_loss = False
    ):
        if return_loss:
            ids, labels = ids[:, :-1], ids[:, 1:]

        tokens = self.token_emb(ids)

        for attn, ff in self.layers:
            tokens = attn(tokens) + tokens
            tokens = ff(tokens) + tokens

        embed = self.norm(tokens)

        logits = self.to_logits(embed)

        if not return_loss:
            return logits

        return F.cross_entropy(logits.transpose(1, 2), labels)

if __name__ == '__main__':
    torch.manual_seed(0)

    model = Transformer(
        num_tokens = 64,
        dim = 32,
        depth = 2,
        dim_head = 8,
        heads = 4,
        kv_heads = 2,
        sparse_attn_kwargs = dict(
            sliding_window_size = 4,
            compress_block_size = 8,
            selection_block_size = 2,
            num_selected_blocks = 6,
            interpolated_importance_score = True,
            query_heads_share_selected_kv = True,
        )
    )

    optim = torch.optim.Adam(model.parameters(), lr = 1e-3)

    # train.py: one training step on a batch of token sequences

    data = torch.randint(0, 64, (2, 21))

    loss = model(data, return_loss = True)
    loss.backward()
    optim.step()
    optim.zero_grad()
    print(f'training loss: {loss.item():.4f}')

    # causality check: change a later token, see whether earlier positions' logits move

    model.eval()
    with torch.no_grad():
        ids = data[:, :-1]
        logits = model(ids)
        t = 11
        changed_ids = ids.clone()
        changed_ids[:, t] = (changed_ids[:, t] + 1) % 64
        changed_logits = model(changed_ids)
        diff = (logits - changed_logits).abs().amax(dim = -1)[:, :t]
        moved = (diff > 1e-6).nonzero().tolist()
    print(f'positions before {t} whose logits change when token {t} changes: {moved}')
