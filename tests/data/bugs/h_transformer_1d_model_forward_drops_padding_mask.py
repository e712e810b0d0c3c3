# lucidrains/h-transformer-1d commit 4e7f4fc ("make sure mask is passed"): HTransformer1D.forward accepts a
# padding mask but calls self.layers(x) without it, so the hierarchical attention (HAttention1D) never masks
# padding tokens at any level of the hierarchy.
import sys
from math import log2, ceil
import torch
from torch import nn, einsum
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def masked_aggregate(tensor, mask=None, dim=-1, average=True):
    if not exists(mask):
        fn = torch.sum if not average else torch.mean
        return fn(tensor, dim=dim)
    diff_len = len(tensor.shape) - len(mask.shape)
    mask = mask[(..., *((None,) * diff_len))]
    tensor = tensor.masked_fill(~mask, 0.)
    total_el = mask.sum(dim=dim)
    agg = tensor.sum(dim=dim)
    if average:
        agg = agg / total_el.clamp(min=1.)
    agg.masked_fill_(total_el == 0, 0.)
    return agg


def flip_every_two(t):
    s = t.shape
    t = t.reshape(s[0], s[1] // 2, 2, *s[2:])   # 'b (n r) ... -> b n r ...'
    t = torch.flip(t, dims=(2,))
    return t.reshape(s)


class PreNorm(nn.Module):
    def __init__(self, dim, fn):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class FeedForward(nn.Module):
    def __init__(self, dim, *, mult=4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class HAttention1D(nn.Module):
    def __init__(self, dim, *, heads=2, dim_head=16, block_size=2, pos_emb=None, eps=1e-8):
        super().__init__()
        self.eps = eps
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.block_size = block_size
        inner_dim = heads * dim_head
        self.pos_emb = pos_emb  # rotary embedding omitted (None) in this trimmed copy
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)

    def forward(self, x, mask=None):
        b, n, h, bsz, eps = *x.shape[:2], self.heads, self.block_size, self.eps

        pad_to_len = 2 ** ceil(log2(n))
        padding = pad_to_len - n
        if padding != 0:
            x = F.pad(x, (0, 0, 0, padding), value=0.)
            if exists(mask):
                mask = F.pad(mask, (0, padding), value=False)

        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        # 'b n (h d) -> (b h) n d'
        q, k, v = map(lambda t: t.view(b, pad_to_len, h, -1).transpose(1, 2).reshape(b * h, pad_to_len, -1), (q, k, v))
        if exists(mask):
            mask = mask.repeat_interleave(h, dim=0)  # 'b n -> (b h) n'

        q = q * self.scale

        num_levels = int(log2(pad_to_len // bsz)) - 2
        assert num_levels >= 0

        qkvs = [(q, k, v, mask)]
        for level in range(num_levels):
            q, k, v = map(lambda t: t.reshape(t.shape[0], -1, 2, t.shape[-1]), (q, k, v))
            if exists(mask):
                mask = mask.reshape(mask.shape[0], -1, 2)
            q = masked_aggregate(q, mask, dim=2)
            k = masked_aggregate(k, mask, dim=2)
            v = masked_aggregate(v, mask, dim=2, average=False)
            if exists(mask):
                mask = torch.any(mask, dim=2)
            qkvs.append((q, k, v, mask))

        qkvs = [qkvs[0], *qkvs]

        def calculate_Y_and_A(q, k, v, mask=None):
            S = einsum('... i d, ... j d -> ... i j', q, k)
            if exists(mask):
                mask_value = -torch.finfo(S.dtype).max
                S = S.masked_fill(~mask, mask_value)
            S = S - torch.max(S, dim=-1, keepdim=True).values
            A = S.exp()
            y = einsum('... i j, ... j d -> ... i d', A, v)
            A = A.sum(dim=-1)
            y = y.reshape(y.shape[0], -1, y.shape[-1])   # 'b ... n d -> b (... n) d'
            A = A.reshape(A.shape[0], -1)
            return y, A

        to_blocks = lambda t: t.reshape(t.shape[0], -1, bsz, *t.shape[2:])  # 'b (n z) ... -> b n z ...'

        Ys = []
        for ind, (q, k, v, mask) in enumerate(reversed(qkvs)):
            is_last = ind == (len(qkvs) - 1)
            q, k, v = map(to_blocks, (q, k, v))
            S_mask = None
            if exists(mask):
                mask = to_blocks(mask)
                q_mask = mask
                k_mask = flip_every_two(mask) if not is_last else mask
                S_mask = q_mask[..., :, None] * k_mask[..., None, :]
            if not is_last:
                k, v = map(flip_every_two, (k, v))
            Ys.append(calculate_Y_and_A(q, k, v, mask=S_mask))

        Y = 0
        A = 0
        for ind, (Y_level, A_level) in enumerate(Ys):
            is_last = ind == (len(Ys) - 1)
            if not is_last and torch.is_tensor(Y):
                Y = Y.repeat_interleave(2, dim=1)
            if not is_last and torch.is_tensor(A):
                A = A.repeat_interleave(2, dim=1)
            Y = Y_level + Y
            A = A_level + A

        out = Y / (A + eps)[..., None]
        out = out.view(b, h, pad_to_len, -1).transpose(1, 2).reshape(b, pad_to_len, -1)  # '(b h) n d -> b n (h d)'
        return self.to_out(out[:, :n])


class SequentialSequence(nn.Module):
    # h_transformer_1d/reversible.py, with route_args: 'mask' goes to the attention (f) only
    def __init__(self, layers, args_route={}):
        super().__init__()
        self.layers = layers
        self.args_route = args_route

    def forward(self, x, **kwargs):
        args = [(dict(), dict()) for _ in range(len(self.layers))]
        for key in [k for k in kwargs if k in self.args_route]:
            for d, routes in enumerate(self.args_route[key]):
                f_args, g_args = args[d]
                args[d] = ({**f_args, **({key: kwargs[key]} if routes[0] else {})},
                           {**g_args, **({key: kwargs[key]} if routes[1] else {})})
        for (f, g), (f_args, g_args) in zip(self.layers, args):
            x = x + f(x, **f_args)
            x = x + g(x, **g_args)
        return x


class HTransformer1D(nn.Module):
    def __init__(self, *, num_tokens, dim, depth, max_seq_len, heads=2, dim_head=16, ff_mult=4, block_size=2):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.max_seq_len = max_seq_len
        layers = nn.ModuleList([])
        for ind in range(depth):
            attn = HAttention1D(dim, dim_head=dim_head, heads=heads, block_size=block_size)
            ff = FeedForward(dim, mult=ff_mult)
            attn, ff = map(lambda t: PreNorm(dim, t), (attn, ff))
            layers.append(nn.ModuleList([attn, ff]))
        route_attn = ((True, False),) * depth
        self.layers = SequentialSequence(layers, args_route={'mask': route_attn})
        self.to_logits = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, num_tokens))

    def forward(self, x, mask=None):
        b, n = x.shape
        assert n <= self.max_seq_len
        x = self.token_emb(x)
        if FIXED:
            x = self.layers(x, mask=mask)
        else:
            x = self.layers(x)
        return self.to_logits(x)


model = HTransformer1D(num_tokens=50, dim=32, depth=2, max_seq_len=16, block_size=2).eval()

pad_id = 0
lengths = [16, 11]
tokens = torch.randint(1, 50, (2, 16))
tokens[1, lengths[1]:] = pad_id
mask = tokens != pad_id

with torch.no_grad():
    logits = model(tokens, mask=mask)
    # reference: the padded row alone, without its padding tokens
    alone = model(tokens[1:2, :lengths[1]], mask=mask[1:2, :lengths[1]])

print("max |logits(row 1 in padded batch) - logits(row 1 alone)| over real tokens: %.6f"
      % (logits[1, :lengths[1]] - alone[0]).abs().max().item())
