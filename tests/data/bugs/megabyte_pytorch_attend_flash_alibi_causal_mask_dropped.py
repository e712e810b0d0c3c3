# lucidrains/MEGABYTE-pytorch, commit 4c3ec34 ("fix alibi with flash attention"), MEGABYTE_pytorch/attend.py.
# On the flash path with ALiBi, Attend.flash_attn folds the causal mask into attn_bias and sets causal = False, but
# still hands SDPA the (None) `mask`: the global and local transformers attend to future patches / bytes.
import sys
import math
import functools
import warnings

import torch
import torch.nn.functional as F
from torch import nn, einsum
from collections import namedtuple

FIXED = "--fixed" in sys.argv
warnings.filterwarnings("ignore", category=FutureWarning)

# constants

EfficientAttentionConfig = namedtuple('EfficientAttentionConfig', ['enable_flash', 'enable_math', 'enable_mem_efficient'])

# helpers

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def remainder_to_mult(num, mult):
    return (mult - num % mult) % mult

def reduce_mult(nums):
    return functools.reduce(lambda x, y: x * y, nums, 1)

# einops pack / unpack with pattern '* n d', written with reshape (einops is not installed here)

def pack_one(t, pattern):
    ps = t.shape[:-2]
    return t.reshape(-1, *t.shape[-2:]), ps

def unpack_one(t, ps, pattern):
    return t.reshape(*ps, *t.shape[-2:])

# attend.py

class Attend(nn.Module):
    def __init__(
        self,
        causal = False,
        dropout = 0.,
        flash = False
    ):
        super().__init__()
        self.dropout = dropout
        self.attn_dropout = nn.Dropout(dropout)

        self.causal = causal
        self.flash = flash

        self.cpu_config = EfficientAttentionConfig(True, True, True)
        self.cuda_config = None

    def get_mask(self, i, j, device):
        return torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

    def flash_attn(self, q, k, v, mask = None, attn_bias = None):
        _, heads, q_len, _, k_len, is_cuda, device = *q.shape, k.shape[-2], q.is_cuda, q.device

        # single headed key / values

        if k.ndim == 3:
            k = k.unsqueeze(1)      # rearrange(k, 'b n d -> b 1 n d')

        if v.ndim == 3:
            v = v.unsqueeze(1)      # rearrange(v, 'b n d -> b 1 n d')

        # Check if mask exists and expand to compatible shape
        # The mask is B L, so it would have to be expanded to B H N L

        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :]
            mask = mask.expand(-1, heads, q_len, -1)

        # Check if there is a compatible device for flash attention

        config = self.cuda_config if is_cuda else self.cpu_config

        causal = self.causal

        # handle attention bias

        if exists(attn_bias):
            mask_value = -torch.finfo(q.dtype).max // 2
            causal_mask = self.get_mask(q_len, k_len, device)
            attn_bias = attn_bias.masked_fill(causal_mask, mask_value)

            if exists(mask):
                attn_bias = attn_bias.masked_fill(~mask, mask_value)

            if FIXED:
                mask = attn_bias
            causal = False

        # pytorch 2.0 flash attn: q, k, v, mask, dropout, causal, softmax_scale

        with torch.backends.cuda.sdp_kernel(**config._asdict()):
            out = F.scaled_dot_product_attention(
                q, k, v,
                attn_mask = mask,
                dropout_p = self.dropout if self.training else 0.,
                is_causal = causal
            )

        return out

    def forward(self, q, k, v, mask = None, attn_bias = None):
        q_len, k_len, device = q.shape[-2], k.shape[-2], q.device

        scale = q.shape[-1] ** -0.5

        kv_einsum_eq = 'b j d' if k.ndim == 3 else 'b h j d'

        if self.flash:
            return self.flash_attn(q, k, v, mask = mask, attn_bias = attn_bias)

        # similarity

        sim = einsum(f"b h i d, {kv_einsum_eq} -> b h i j", q, k) * scale

        # attention bias

        if exists(attn_bias):
            sim = sim + attn_bias

        # causal mask

        if self.causal:
            causal_mask = self.get_mask(q_len, k_len, device)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        # attention

        attn = sim.softmax(dim=-1)
        attn = self.attn_dropout(attn)

        # aggregate values

        out = einsum(f"b h i j, {kv_einsum_eq} -> b h i d", attn, v)

        return out

# megabyte.py

class Alibi(nn.Module):
    def __init__(self, heads, **kwargs):
        super().__init__()
        self.heads = heads
        slopes = torch.Tensor(self._get_slopes(heads))
        slopes = slopes.reshape(heads, 1, 1)
        self.register_buffer('slopes', slopes, persistent = False)
        self.register_buffer('bias', None, persistent = False)

    @staticmethod
    def _get_slopes(heads):
        def get_slopes_power_of_2(n):
            start = (2**(-2**-(math.log2(n)-3)))
            ratio = start
            return [start*ratio**i for i in range(n)]

        if math.log2(heads).is_integer():
            return get_slopes_power_of_2(heads)

        closest_power_of_2 = 2 ** math.floor(math.log2(heads))
        return get_slopes_power_of_2(closest_power_of_2) + get_slopes_power_of_2(2 * closest_power_of_2)[0::2][:heads-closest_power_of_2]

    def forward(self, i, j, device):
        if exists(self.bias) and self.bias.shape[-1] >= j:
            return self.bias[..., :j]

        bias = torch.arange(j, device = device)
        bias = bias.reshape(1, 1, j)
        bias = bias * self.slopes

        self.register_buffer('bias', bias, persistent = False)
        return self.bias

class RMSNorm(nn.Module):
    def __init__(self, dim, eps = 1e-8):
        super().__init__()
        self.scale = dim ** -0.5
        self.eps = eps
        self.g = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        norm = torch.norm(x, dim = -1, keepdim = True) * self.scale
        return x / norm.clamp(min = self.eps) * self.g

def FeedForward(*, dim, mult = 4, dropout = 0.):
    return nn.Sequential(
        RMSNorm(dim),
        nn.Linear(dim, dim * mult),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(dim * mult, dim)
    )

class Attention(nn.Module):
    def __init__(self, *, dim, dim_head = 64, heads = 8, dropout = 0., flash = False):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        inner_dim = dim_head * heads

        self.attend = Attend(causal = True, flash = flash, dropout = dropout)

        self.dropout = nn.Dropout(dropout)
        self.norm = RMSNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias = False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias = False)
        self.to_out = nn.Linear(inner_dim, dim, bias = False)

    def forward(self, x, attn_bias = None):
        h, device = self.heads, x.device

        x = self.norm(x)
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim = -1))
        b, n, _ = q.shape
        q = q.reshape(b, n, h, -1).transpose(1, 2)      # 'b n (h d) -> b h n d'

        out = self.attend(q, k, v, attn_bias = attn_bias)

        out = out.transpose(1, 2).reshape(b, n, -1)     # 'b h n d -> b n (h d)'
        return self.to_out(out)

class Transformer(nn.Module):
    def __init__(self, *, dim, layers, dim_head = 64, heads = 8, attn_dropout = 0., ff_dropout = 0., ff_mult = 4,
                 rel_pos_bias = True, flash_attn = False):
        super().__init__()
        self.alibi = Alibi(heads = heads) if rel_pos_bias else None
        self.layers = nn.ModuleList([])

        for _ in range(layers):
            self.layers.append(nn.ModuleList([
                Attention(dim = dim, dim_head = dim_head, heads = heads, dropout = attn_dropout, flash = flash_attn),
                FeedForward(dim = dim, mult = ff_mult, dropout = ff_dropout)
            ]))

        self.norm = RMSNorm(dim)

    def forward(self, x):
        n = x.shape[-2]
        attn_bias = self.alibi(n, n, device = x.device) if exists(self.alibi) else None

        for attn, ff in self.layers:
            x = attn(x, attn_bias = attn_bias) + x
            x = ff(x) + x

        return self.norm(x)

class PatchEmbed(nn.Module):
    # nn.Sequential(Rearrange('... r d -> ... (r d)'), LayerNorm, Linear, LayerNorm)
    def __init__(self, seq_len, dim):
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(seq_len * dim), nn.Linear(seq_len * dim, dim), nn.LayerNorm(dim))

    def forward(self, x):
        return self.net(x.reshape(*x.shape[:-2], -1))

class MEGABYTE(nn.Module):
    def __init__(self, *, num_tokens, dim, depth, max_seq_len, dim_head = 64, heads = 8, attn_dropout = 0.,
                 ff_mult = 4, ff_dropout = 0., pad_id = 0, rel_pos_bias = True, flash_attn = False):
        super().__init__()
        assert isinstance(depth, tuple) and isinstance(max_seq_len, tuple)
        assert len(depth) == len(max_seq_len)

        self.stages = len(depth)

        self.token_emb = nn.Embedding(num_tokens, dim)
        self.start_tokens = nn.Parameter(torch.randn(dim))

        self.max_seq_len = max_seq_len

        self.pos_embs = nn.ModuleList([nn.Embedding(seq_len, dim) for seq_len in max_seq_len])

        self.patch_embedders = nn.ModuleList([PatchEmbed(seq_len, dim) for seq_len in self.max_seq_len[1:]])

        self.transformers = nn.ModuleList([])

        for stage_depth in depth:
            self.transformers.append(Transformer(
                dim = dim, layers = stage_depth, dim_head = dim_head, heads = heads, attn_dropout = attn_dropout,
                ff_dropout = ff_dropout, ff_mult = ff_mult, rel_pos_bias = rel_pos_bias, flash_attn = flash_attn
            ))

        self.to_logits = nn.Linear(dim, num_tokens)
        self.pad_id = pad_id

    def forward(self, ids, return_loss = False):
        batch = ids.shape[0]

        assert ids.ndim in {2, self.stages + 1}
        flattened_dims = ids.ndim == 2

        if flattened_dims:
            # allow for ids to be given in the shape of (batch, seq)
            # in which case it will be auto-padded to the next nearest multiple of depth seq len
            seq_len = ids.shape[-1]
            multiple_of = reduce_mult(self.max_seq_len[1:])
            padding = remainder_to_mult(seq_len, multiple_of)
            ids = F.pad(ids, (0, padding), value = self.pad_id)
            ids = ids.reshape(batch, -1, *self.max_seq_len[1:])

        b, *prec_dims, device = *ids.shape, ids.device

        assert prec_dims[0] <= self.max_seq_len[0]
        assert tuple(prec_dims[1:]) == tuple(self.max_seq_len[1:])

        # get token embeddings

        tokens = self.token_emb(ids)

        # get tokens for all hierarchical stages, reducing by appropriate dimensions
        # and adding the absolute positional embeddings

        tokens_at_stages = []
        reduced_tokens = tokens

        for ind, pos_emb, patch_emb in zip(range(len(prec_dims)), reversed(self.pos_embs), reversed((*self.patch_embedders, None))):
            is_first = ind == 0

            if not is_first:
                reduced_tokens = patch_emb(reduced_tokens)

            positions = pos_emb(torch.arange(reduced_tokens.shape[-2], device = device))
            tokens_with_position = reduced_tokens + positions
            tokens_at_stages.insert(0, tokens_with_position)

        # get start tokens and append to the coarsest stage

        start_tokens = self.start_tokens.reshape(1, 1, -1).expand(b, 1, -1)   # repeat 'f -> b 1 f'

        for ind, (stage_tokens, transformer) in enumerate(zip(tokens_at_stages, self.transformers)):
            stage_tokens = torch.cat((
                start_tokens,
                stage_tokens,
            ), dim = -2)

            stage_tokens, ps = pack_one(stage_tokens, '* n d')
            attended = transformer(stage_tokens)
            attended = unpack_one(attended, ps, '* n d')

            start_tokens = attended[..., :-1, :].unsqueeze(-2)    # rearrange '... n d -> ... n 1 d'

        logits = self.to_logits(attended)

        logits = logits[..., 1:, :]

        if flattened_dims:
            logits = logits.reshape(b, -1, logits.shape[-1])       # rearrange 'b ... n -> b (...) n'
            logits = logits[:, :seq_len]

        return logits


def set_flash(model, flash):
    for m in model.modules():
        if isinstance(m, Attend):
            m.flash = flash


torch.manual_seed(0)
model = MEGABYTE(num_tokens = 256, dim = 32, depth = (2, 2), max_seq_len = (8, 4), dim_head = 8, heads = 4,
                 flash_attn = True).eval()

ids = torch.randint(0, 256, (2, 32))
with torch.no_grad():
    logits = model(ids)

    # reference: the same weights through Attend's einsum path (sim + alibi, then causal mask)
    set_flash(model, False)
    ref = model(ids)
    set_flash(model, True)

    # causality: change the bytes from position 20 on; logits for positions < 20 must not move
    ids2 = ids.clone()
    ids2[:, 20:] = torch.randint(0, 256, (2, 12))
    logits2 = model(ids2)

diff_ref = (logits - ref).abs().max().item()
leak = (logits[:, :20] - logits2[:, :20]).abs().max().item()
print(f"fixed={FIXED}")
print(f"max |flash logits - einsum-path logits| = {diff_ref:.6f}")
print(f"max change of logits[:, :20] when bytes 20.. change (future leak) = {leak:.6f}")
