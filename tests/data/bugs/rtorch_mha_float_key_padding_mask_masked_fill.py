# mlverse/torch#1205, fixed by mlverse/torch#1208 (commit 6d277a82e, "fix key_padding_mask bug in
# `nnf_multi_head_attention_forward`"). R torch ports torch.nn.functional.multi_head_attention_forward;
# attn_mask is checked for its dtype (bool -> masked_fill -Inf, float -> added), but key_padding_mask
# is always handed to masked_fill. A float (additive 0 / -Inf) key padding mask is thereby ignored
# (#1205: "float key padding masks are ignored"): padded keys keep their weight. Ported here to Python;
# masked_fill on a float mask is written as R torch behaved for it (the positions equal to TRUE = 1).
# Fix: if key_padding_mask is bool, masked_fill -Inf; else add it to the weights.
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def nnf_multi_head_attention_forward(query, key, value, embed_dim_to_check, num_heads, in_proj_weight,
                                     in_proj_bias, out_proj_weight, out_proj_bias, key_padding_mask=None,
                                     need_weights=True, attn_mask=None):
    tgt_len, bsz, embed_dim = query.size()
    head_dim = embed_dim // num_heads
    scaling = float(head_dim) ** -0.5
    q, k, v = F.linear(query, in_proj_weight, in_proj_bias).chunk(3, dim=-1)
    q = q * scaling
    q = q.contiguous().view(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
    v = v.contiguous().view(-1, bsz * num_heads, head_dim).transpose(0, 1)
    src_len = k.size(1)

    attn_output_weights = torch.bmm(q, k.transpose(1, 2))

    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            attn_output_weights.masked_fill_(attn_mask, float("-inf"))
        else:
            attn_output_weights = attn_output_weights + attn_mask

    if key_padding_mask is not None:
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        if FIXED:
            if key_padding_mask.dtype == torch.bool:
                attn_output_weights = attn_output_weights.masked_fill(
                    key_padding_mask.unsqueeze(1).unsqueeze(2), float("-inf"))
            else:
                attn_output_weights = attn_output_weights + key_padding_mask.unsqueeze(1).unsqueeze(2)
        else:
            attn_output_weights = attn_output_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2) == True, float("-inf"))  # noqa: E712
        attn_output_weights = attn_output_weights.view(bsz * num_heads, tgt_len, src_len)

    attn_output_weights = F.softmax(attn_output_weights, dim=-1)
    attn_output = torch.bmm(attn_output_weights, v)
    attn_output = attn_output.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
    attn_output = F.linear(attn_output, out_proj_weight, out_proj_bias)
    if need_weights:
        attn_output_weights = attn_output_weights.view(bsz, num_heads, tgt_len, src_len)
        return attn_output, attn_output_weights.sum(dim=1) / num_heads
    return attn_output, None


class nn_multihead_attention(torch.nn.Module):
    def __init__(self, embed_dim, num_heads):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.in_proj_weight = torch.nn.Parameter(torch.randn(3 * embed_dim, embed_dim) * 0.3)
        self.in_proj_bias = torch.nn.Parameter(torch.zeros(3 * embed_dim))
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None):
        return nnf_multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight, self.in_proj_bias,
            self.out_proj.weight, self.out_proj.bias, key_padding_mask=key_padding_mask,
            need_weights=need_weights, attn_mask=attn_mask)


def main():
    torch.manual_seed(0)
    # a batch of 3 sequences of lengths 6, 4, 2, time-major (S, N, E) as nn_multihead_attention takes it
    lengths = torch.tensor([6, 4, 2])
    S, N, E = 6, 3, 8
    src = torch.randn(S, N, E)
    pad = torch.arange(S)[None, :] >= lengths[:, None]
    # the float key padding mask of the docs: -Inf where padded, 0 elsewhere
    key_padding_mask = torch.zeros(N, S).masked_fill(pad, float("-inf"))
    satt = nn_multihead_attention(E, num_heads=2)
    with torch.no_grad():
        out, weights = satt(src, src, src, key_padding_mask=key_padding_mask)
    # mean-pool each sequence over its real frames
    keep = (~pad).t().unsqueeze(-1).float()
    pooled = (out * keep).sum(0) / keep.sum(0)
    print("pooled:", pooled[:, :3])
    print("weight on padded keys, row 2:", weights[2][:2, 2:].sum().item())


if __name__ == "__main__":
    main()
