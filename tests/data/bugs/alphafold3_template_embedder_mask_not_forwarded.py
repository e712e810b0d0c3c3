"""AlphaFold3 (lucidrains) TemplateEmbedder runs its pairformer stack without the residue mask.

Citation: lucidrains/alphafold3-pytorch commit 43ccb98 ("forward mask in template embedder", v0.4.8);
diff read upstream.

Bug: ``TemplateEmbedder.forward`` takes ``mask: Bool['b n']`` (real residues / tokens), repeats it per
template (``'b n -> (b t) n'``) and then calls ``templates = to_layers_fn(templates)`` without it. The
pairformer blocks' triangle attention therefore attends over padded residues of every template pair
representation, so a shorter complex in the batch mixes in its padding.
Fix: ``templates = to_layers_fn(templates, mask = mask)``.

This program keeps the TemplateEmbedder's structure (input projections, per-template packing, the mask
repeat, ``to_layers`` over ``PairwiseBlock``s, masked mean over templates) with the pairwise block reduced
to its two triangle attentions (starting / ending node) written as lucidrains' ``Attention`` does them
(``q @ k`` similarity + pair bias, ``masked_fill(~mask, -max)``, softmax). Plain torch instead of
einops/einx. A batch of two complexes of 5 and 3 residues, padded to 5, each with 2 templates.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


def exists(v):
    return v is not None


def LinearNoBias(dim_in, dim_out):
    return nn.Linear(dim_in, dim_out, bias=False)


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=8):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        self.to_q = LinearNoBias(dim, heads * dim_head)
        self.to_kv = LinearNoBias(dim, 2 * heads * dim_head)
        self.to_out = LinearNoBias(heads * dim_head, dim)

    def forward(self, seq, mask=None, attn_bias=None):
        b, n, _ = seq.shape
        q = self.to_q(seq).view(b, n, self.heads, -1).transpose(1, 2)
        k, v = self.to_kv(seq).view(b, n, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        sim = (q @ k.transpose(-1, -2)) * self.scale
        if exists(attn_bias):
            sim = sim + attn_bias
        if exists(mask):
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = (attn @ v).transpose(1, 2).reshape(b, n, -1)
        return self.to_out(out)


class TriangleAttention(nn.Module):
    def __init__(self, *, dim, heads, node_type):
        super().__init__()
        self.need_transpose = node_type == 'ending'
        self.attn = Attention(dim=dim, heads=heads)
        self.to_attn_bias = LinearNoBias(dim, heads)

    def forward(self, pairwise_repr, mask=None):
        if self.need_transpose:
            pairwise_repr = pairwise_repr.transpose(1, 2)

        b, n = pairwise_repr.shape[:2]
        attn_bias = self.to_attn_bias(pairwise_repr).permute(0, 3, 1, 2)  # b h i j
        attn_bias = attn_bias.repeat_interleave(n, dim=0)                 # (b repeat) h i j

        if exists(mask):
            mask = mask.repeat_interleave(n, dim=0)                        # (b repeat) n

        out = self.attn(pairwise_repr.reshape(b * n, n, -1), mask=mask, attn_bias=attn_bias)
        out = out.reshape(b, n, n, -1)

        if self.need_transpose:
            out = out.transpose(1, 2)
        return out


class PairwiseBlock(nn.Module):
    def __init__(self, *, dim_pairwise=16, tri_attn_heads=2):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim_pairwise)
        self.norm2 = nn.LayerNorm(dim_pairwise)
        self.tri_attn_starting = TriangleAttention(dim=dim_pairwise, heads=tri_attn_heads, node_type='starting')
        self.tri_attn_ending = TriangleAttention(dim=dim_pairwise, heads=tri_attn_heads, node_type='ending')

    def forward(self, *, pairwise_repr, mask=None):
        pairwise_repr = self.tri_attn_starting(self.norm1(pairwise_repr), mask=mask) + pairwise_repr
        pairwise_repr = self.tri_attn_ending(self.norm2(pairwise_repr), mask=mask) + pairwise_repr
        return pairwise_repr


class TemplateEmbedder(nn.Module):
    def __init__(self, *, dim_template_feats=8, dim=16, dim_pairwise=12, pairformer_stack_depth=2, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.template_feats_to_embed_input = LinearNoBias(dim_template_feats, dim)
        self.pairwise_to_embed_input = nn.Sequential(nn.LayerNorm(dim_pairwise), LinearNoBias(dim_pairwise, dim))
        self.pairformer_stack = nn.ModuleList([PairwiseBlock(dim_pairwise=dim) for _ in range(pairformer_stack_depth)])
        self.final_norm = nn.LayerNorm(dim)
        self.to_out = nn.Sequential(nn.ReLU(), LinearNoBias(dim, dim_pairwise))

    def to_layers(self, templates, *, mask=None):
        for block in self.pairformer_stack:
            templates = block(pairwise_repr=templates, mask=mask) + templates
        return templates

    def forward(self, *, templates, template_mask, pairwise_repr, mask=None):
        num_templates = templates.shape[1]

        pairwise_repr = self.pairwise_to_embed_input(pairwise_repr)
        pairwise_repr = pairwise_repr.unsqueeze(1)  # 'b i j d -> b 1 i j d'

        templates = self.template_feats_to_embed_input(templates) + pairwise_repr

        b, t, n = templates.shape[:3]
        templates = templates.reshape(b * t, n, n, -1)  # pack_one '* i j d'

        if exists(mask):
            mask = mask.repeat_interleave(num_templates, dim=0)  # 'b n -> (b t) n'

        # layers

        if FIXED:
            templates = self.to_layers(templates, mask=mask)
        else:
            templates = self.to_layers(templates)

        # final norm

        templates = self.final_norm(templates)
        templates = templates.reshape(b, t, n, n, -1)

        # masked mean pool template repr

        templates = torch.where(template_mask[:, :, None, None, None], templates, 0.)
        num = templates.sum(dim=1)
        den = template_mask.float().sum(dim=1)
        avg_template_repr = num / den.clamp(min=self.eps)[:, None, None, None]
        return self.to_out(avg_template_repr)


def main():
    torch.manual_seed(0)
    embedder = TemplateEmbedder().eval()
    residue_lens = torch.tensor([5, 3])
    n = int(residue_lens.max())
    mask = torch.arange(n)[None, :] < residue_lens[:, None]  # Bool['b n']
    templates = torch.randn(2, 2, n, n, 8)
    template_mask = torch.tensor([[True, True], [True, False]])
    pairwise_repr = torch.randn(2, n, n, 12)
    with torch.no_grad():
        out = embedder(templates=templates, template_mask=template_mask, pairwise_repr=pairwise_repr, mask=mask)
    print("template embedding", tuple(out.shape), "out[1,0,0,:3]", [round(v, 4) for v in out[1, 0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
