# lucidrains/alphafold2 commit c85682e ("properly mask for structure module"): the structure module called
# IPABlock without mask=mask, so invariant point attention of real residues attended to padded residues.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class InvariantPointAttention(nn.Module):
    def __init__(self, dim, heads=4, scalar_key_dim=8, scalar_value_dim=8, point_key_dim=4, point_value_dim=4):
        super().__init__()
        self.heads = heads
        num_attn_logits = 3
        self.scalar_attn_logits_scale = (num_attn_logits * scalar_key_dim) ** -0.5
        self.to_scalar_q = nn.Linear(dim, scalar_key_dim * heads, bias=False)
        self.to_scalar_k = nn.Linear(dim, scalar_key_dim * heads, bias=False)
        self.to_scalar_v = nn.Linear(dim, scalar_value_dim * heads, bias=False)
        self.point_weights = nn.Parameter(torch.log(torch.exp(torch.full((heads,), 1.0)) - 1.0))
        self.point_attn_logits_scale = ((num_attn_logits * point_key_dim) * (9 / 2)) ** -0.5
        self.to_point_q = nn.Linear(dim, point_key_dim * heads * 3, bias=False)
        self.to_point_k = nn.Linear(dim, point_key_dim * heads * 3, bias=False)
        self.to_point_v = nn.Linear(dim, point_value_dim * heads * 3, bias=False)
        self.pairwise_attn_logits_scale = num_attn_logits ** -0.5
        self.to_pairwise_attn_bias = nn.Linear(dim, heads)
        self.to_out = nn.Linear(heads * (scalar_value_dim + dim + point_value_dim * 4), dim)

    def forward(self, single_repr, pairwise_repr, *, rotations, translations, mask=None):
        x, b, n, h = single_repr, single_repr.shape[0], single_repr.shape[1], self.heads

        def heads_first(t, c=None):
            t = t.view(b, n, h, -1) if c is None else t.view(b, n, h, -1, c)
            return t.transpose(1, 2).reshape(b * h, n, *t.shape[3:])

        q_s, k_s, v_s = (heads_first(f(x)) for f in (self.to_scalar_q, self.to_scalar_k, self.to_scalar_v))
        q_p, k_p, v_p = (heads_first(f(x), 3) for f in (self.to_point_q, self.to_point_k, self.to_point_v))
        rot = rotations.repeat_interleave(h, dim=0)
        trans = translations.repeat_interleave(h, dim=0)[:, :, None, :]
        q_p, k_p, v_p = (torch.einsum("bndc,bncr->bndr", t, rot) + trans for t in (q_p, k_p, v_p))

        attn_logits_scalar = torch.einsum("bid,bjd->bij", q_s, k_s) * self.scalar_attn_logits_scale
        bias = self.to_pairwise_attn_bias(pairwise_repr).permute(0, 3, 1, 2).reshape(b * h, n, n)
        attn_logits_pairwise = bias * self.pairwise_attn_logits_scale
        point_dist = ((q_p[:, :, None] - k_p[:, None]) ** 2).sum(dim=-1)
        point_weights = F.softplus(self.point_weights).repeat(b)[:, None, None, None]
        attn_logits_points = -0.5 * (point_dist * point_weights * self.point_attn_logits_scale).sum(dim=-1)
        attn_logits = attn_logits_scalar + attn_logits_points + attn_logits_pairwise

        if mask is not None:
            mask = mask[:, :, None] * mask[:, None, :]
            mask = mask.repeat_interleave(h, dim=0)
            attn_logits = attn_logits.masked_fill(~mask, max_neg_value(attn_logits))

        attn = attn_logits.softmax(dim=-1)
        results_scalar = torch.einsum("bij,bjd->bid", attn, v_s)
        attn_with_heads = attn.view(b, h, n, n)
        results_pairwise = torch.einsum("bhij,bijd->bhid", attn_with_heads, pairwise_repr)
        results_points = torch.einsum("bij,bjdc->bidc", attn, v_p)
        results_points = torch.einsum("bndc,bncr->bndr", results_points - trans, rot.transpose(-1, -2))
        results_points_norm = torch.sqrt(results_points.square().sum(-1) + 1e-8)

        def merge(t):
            return t.reshape(b, h, n, -1).transpose(1, 2).reshape(b, n, -1)

        results = torch.cat([merge(results_scalar), merge(results_points), merge(results_points_norm),
                             results_pairwise.transpose(1, 2).reshape(b, n, -1)], dim=-1)
        return self.to_out(results)


class IPABlock(nn.Module):
    def __init__(self, *, dim, **kwargs):
        super().__init__()
        self.attn_norm = nn.LayerNorm(dim)
        self.attn = InvariantPointAttention(dim, **kwargs)
        self.ff_norm = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, dim), nn.ReLU(), nn.Linear(dim, dim))

    def forward(self, x, **kwargs):
        x = self.attn_norm(self.attn(x, **kwargs) + x)
        return self.ff_norm(self.ff(x) + x)


class StructureModule(nn.Module):
    def __init__(self, dim, structure_module_depth=2):
        super().__init__()
        self.structure_module_depth = structure_module_depth
        self.ipa_block = IPABlock(dim=dim, heads=4)
        self.to_points = nn.Linear(dim, 3)

    def forward(self, single_repr, pairwise_repr, mask):
        b, n, _ = single_repr.shape
        rotations = torch.eye(3).expand(b, n, 3, 3)
        translations = torch.zeros(b, n, 3)
        for _ in range(self.structure_module_depth):
            if FIXED:
                single_repr = self.ipa_block(single_repr, mask=mask, pairwise_repr=pairwise_repr,
                                             rotations=rotations, translations=translations)
            else:
                single_repr = self.ipa_block(single_repr, pairwise_repr=pairwise_repr,
                                             rotations=rotations, translations=translations)
            translations = translations + self.to_points(single_repr)
        return translations


dim, n = 16, 12
model = StructureModule(dim).eval()
lengths = [12, 8]
single = torch.randn(2, n, dim)
pair = torch.randn(2, n, n, dim)
mask = torch.arange(n)[None, :] < torch.tensor(lengths)[:, None]

with torch.no_grad():
    coords = model(single, pair, mask)
    L = lengths[1]
    alone = model(single[1:, :L], pair[1:, :L, :L], mask[1:, :L])
diff = (coords[1, :L] - alone[0]).abs().max().item()
print(f"fixed={FIXED} max |coords(padded batch) - coords(alone)| for the 8-residue protein = {diff:.4e}")
