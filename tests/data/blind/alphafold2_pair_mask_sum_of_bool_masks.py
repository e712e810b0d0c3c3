"""alphafold2-pytorch: the pairwise residue mask is built with `+` of two boolean masks (logical OR).

Citation: lucidrains/alphafold2 commit dda22b5885caa814f2dfa5b51f2e05083756cfb5 ("make sure
outermean can be masked for padding in msa rows, and also fix a bug with mask"). Read in the
upstream git history of alphafold2_pytorch/alphafold2.py (parent and fix commit); no issue thread.

Bug: `Alphafold2.forward` derives the pair mask from the residue mask `mask` (b, n) as
`x_mask = rearrange(mask, 'b i -> b i ()') + rearrange(mask, 'b j -> b () j')`. For bool tensors
`+` is logical OR, so pair (i, j) is valid when EITHER residue is real. The pairwise block's
triangle attentions (`AxialAttention` row / column over the pair map, `Attention` with
`mask[:, None, :, None] * context_mask[:, None, None, :]`) then let every real residue pair
(i, j) attend to pairs (i, k) / (k, j) with k a padded residue.
Fix: `*` (logical AND).

This program: the pre-fix `Attention`, `AxialAttention`, `TriangleMultiplicativeModule` and
`PairwiseAttentionBlock` (einops calls written as permute/reshape), the sequence embedding and
`to_pairwise_repr` of `Alphafold2.forward`, no MSA (outer mean off); two proteins of 6 and 4
residues padded to 6.
"""
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    if exists(val):
        return val
    return d() if callable(d) else d


class Attention(nn.Module):
    def __init__(self, dim, seq_len=None, heads=8, dim_head=64, dropout=0., gating=True):
        super().__init__()
        inner_dim = dim_head * heads
        self.seq_len = seq_len
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, inner_dim * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim)
        self.gating = nn.Linear(dim, inner_dim)
        nn.init.constant_(self.gating.weight, 0.)
        nn.init.constant_(self.gating.bias, 1.)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None, attn_bias=None, context=None, context_mask=None, tie_dim=None):
        device, orig_shape, h, has_context = x.device, x.shape, self.heads, exists(context)
        context = default(context, x)
        q, k, v = (self.to_q(x), *self.to_kv(context).chunk(2, dim=-1))
        i, j = q.shape[-2], k.shape[-2]
        # 'b n (h d) -> b h n d'
        q, k, v = map(lambda t: t.view(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))
        q = q * self.scale
        dots = einsum('b h i d, b h j d -> b h i j', q, k)
        if exists(attn_bias):
            dots = dots + attn_bias
        if exists(mask):
            mask = default(mask, lambda: torch.ones(1, i, device=device).bool())
            context_mask = mask if not has_context else default(context_mask, lambda: torch.ones(1, k.shape[-2], device=device).bool())
            mask_value = -torch.finfo(dots.dtype).max
            mask = mask[:, None, :, None] * context_mask[:, None, None, :]
            dots = dots.masked_fill(~mask, mask_value)
        dots = dots - dots.max(dim=-1, keepdims=True).values
        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        out = out.transpose(1, 2).reshape(out.shape[0], out.shape[2], -1)  # 'b h n d -> b n (h d)'
        gates = self.gating(x)
        out = out * gates.sigmoid()
        return self.to_out(out)


class AxialAttention(nn.Module):
    def __init__(self, dim, heads, row_attn=True, col_attn=True, accept_edges=False, global_query_attn=False, **kwargs):
        super().__init__()
        self.row_attn = row_attn
        self.col_attn = col_attn
        self.global_query_attn = global_query_attn
        self.norm = nn.LayerNorm(dim)
        self.attn = Attention(dim=dim, heads=heads, **kwargs)
        self.edges_to_attn_bias = nn.Linear(dim, heads, bias=False) if accept_edges else None

    def forward(self, x, edges=None, mask=None):
        b, h, w, d = x.shape
        x = self.norm(x)
        if self.col_attn:
            axial_dim = w
            x = x.permute(0, 2, 1, 3).reshape(b * w, h, d)  # 'b h w d -> (b w) h d'
            if exists(mask):
                mask = mask.permute(0, 2, 1).reshape(b * w, h)  # 'b h w -> (b w) h'
        elif self.row_attn:
            axial_dim = h
            x = x.reshape(b * h, w, d)  # 'b h w d -> (b h) w d'
            if exists(mask):
                mask = mask.reshape(b * h, w)  # 'b h w -> (b h) w'
        attn_bias = None
        if exists(self.edges_to_attn_bias) and exists(edges):
            attn_bias = self.edges_to_attn_bias(edges).permute(0, 3, 1, 2)  # 'b i j h -> b h i j'
            attn_bias = attn_bias.repeat_interleave(axial_dim, dim=0)  # 'b h i j -> (b x) h i j'
        out = self.attn(x, mask=mask, attn_bias=attn_bias, tie_dim=None)
        if self.col_attn:
            return out.view(b, w, h, d).permute(0, 2, 1, 3)  # '(b w) h d -> b h w d'
        return out.view(b, h, w, d)  # '(b h) w d -> b h w d'


class TriangleMultiplicativeModule(nn.Module):
    def __init__(self, *, dim, hidden_dim=None, mix='ingoing'):
        super().__init__()
        hidden_dim = default(hidden_dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.left_proj = nn.Linear(dim, hidden_dim)
        self.right_proj = nn.Linear(dim, hidden_dim)
        self.left_gate = nn.Linear(dim, hidden_dim)
        self.right_gate = nn.Linear(dim, hidden_dim)
        self.out_gate = nn.Linear(dim, hidden_dim)
        for gate in (self.left_gate, self.right_gate, self.out_gate):
            nn.init.constant_(gate.weight, 0.)
            nn.init.constant_(gate.bias, 1.)
        if mix == 'outgoing':
            self.mix_einsum_eq = '... i k d, ... j k d -> ... i j d'
        elif mix == 'ingoing':
            self.mix_einsum_eq = '... k j d, ... k i d -> ... i j d'
        self.to_out_norm = nn.LayerNorm(hidden_dim)
        self.to_out = nn.Linear(hidden_dim, dim)

    def forward(self, x, mask=None):
        if exists(mask):
            mask = mask[..., None]
        x = self.norm(x)
        left = self.left_proj(x)
        right = self.right_proj(x)
        if exists(mask):
            left = left * mask
            right = right * mask
        left = left * self.left_gate(x).sigmoid()
        right = right * self.right_gate(x).sigmoid()
        out = einsum(self.mix_einsum_eq, left, right)
        out = self.to_out_norm(out)
        out = out * self.out_gate(x).sigmoid()
        return self.to_out(out)


class PairwiseAttentionBlock(nn.Module):
    def __init__(self, dim, seq_len, heads, dim_head, dropout=0., global_column_attn=False):
        super().__init__()
        self.triangle_attention_outgoing = AxialAttention(dim=dim, heads=heads, dim_head=dim_head, row_attn=True, col_attn=False, accept_edges=True)
        self.triangle_attention_ingoing = AxialAttention(dim=dim, heads=heads, dim_head=dim_head, row_attn=False, col_attn=True, accept_edges=True, global_query_attn=global_column_attn)
        self.triangle_multiply_outgoing = TriangleMultiplicativeModule(dim=dim, mix='outgoing')
        self.triangle_multiply_ingoing = TriangleMultiplicativeModule(dim=dim, mix='ingoing')

    def forward(self, x, mask=None, msa_repr=None):
        x = self.triangle_multiply_outgoing(x, mask=mask) + x
        x = self.triangle_multiply_ingoing(x, mask=mask) + x
        x = self.triangle_attention_outgoing(x, edges=x, mask=mask) + x
        x = self.triangle_attention_ingoing(x, edges=x, mask=mask) + x
        return x


def main():
    torch.manual_seed(0)
    dim, num_tokens, max_seq_len = 32, 21, 6
    token_emb = nn.Embedding(num_tokens + 1, dim)
    to_pairwise_repr = nn.Linear(dim, dim * 2)
    block = PairwiseAttentionBlock(dim=dim, seq_len=max_seq_len, heads=4, dim_head=8).eval()

    seq = torch.randint(0, num_tokens, (2, max_seq_len))
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        x = token_emb(seq)
        x_left, x_right = to_pairwise_repr(x).chunk(2, dim=-1)
        x = x_left[:, :, None, :] + x_right[:, None, :, :]  # create pair-wise residue embeds
        if FIXED:
            x_mask = mask[:, :, None] * mask[:, None, :]
        else:
            x_mask = mask[:, :, None] + mask[:, None, :]
        x = block(x, mask=x_mask)
    print("valid pairs in protein 1:", int(x_mask[1].sum()), "of", max_seq_len ** 2)
    print("pair (0, 1) of protein 1 [:4]:", [round(v, 4) for v in x[1, 0, 1, :4].tolist()])


if __name__ == "__main__":
    main()
