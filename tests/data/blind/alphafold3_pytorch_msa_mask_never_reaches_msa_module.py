# lucidrains/alphafold3-pytorch commit f0b8782 ("fix an issue with msa mask, add tests to make sure
# alphafold3 can work without msa and templates being passed in"), alphafold3_pytorch/alphafold3.py.
#
# The MSA module (Algorithm 8) takes an `msa_mask: Bool['b s']` marking the real MSA rows of each
# complex in a batch padded to the deepest MSA: it keeps padded rows out of the sampling without
# replacement (max_num_msa) and out of the outer-product mean over rows (Algorithm 9). Before the fix,
# Alphafold3.forward had no `msa_mask` argument at all and called
# `self.msa_module(msa = msa, single_repr = single, pairwise_repr = pairwise, mask = mask)`, so the
# module always ran with msa_mask = None: padded MSA rows were sampled and averaged into the pair
# representation of the shallower complexes. The fix adds `msa_mask` to Alphafold3.forward and hands it
# to the MSA module (and writes the masked mean with einx, here with plain torch in both runs).
#
# Ported trimmed (no einx/einops): OuterProductMean, MSAPairWeightedAveraging, MSAModule, and the part of
# Alphafold3.forward that embeds the inputs and runs the MSA module. Pairformer, diffusion and the rest of
# the model are left out.
import sys

import torch
from torch import nn
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv


def exists(v):
    return v is not None


def default(v, d):
    return v if exists(v) else d


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


def LinearNoBias(dim_in, dim_out):
    return nn.Linear(dim_in, dim_out, bias=False)


class Transition(Module):
    def __init__(self, *, dim, expansion_factor=4):
        super().__init__()
        dim_inner = int(dim * expansion_factor)
        self.ff = nn.Sequential(LinearNoBias(dim, dim_inner * 2))
        self.to_out = LinearNoBias(dim_inner, dim)

    def forward(self, x):
        x, gates = self.ff(x).chunk(2, dim=-1)
        return self.to_out(nn.functional.silu(gates) * x)


class PreLayerNorm(Module):
    def __init__(self, fn, *, dim):
        super().__init__()
        self.fn = fn
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return self.fn(self.norm(x), **kwargs)


class OuterProductMean(Module):
    """ Algorithm 9 """

    def __init__(self, *, dim_msa=64, dim_pairwise=128, dim_hidden=32, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.norm = nn.LayerNorm(dim_msa)
        self.to_hidden = LinearNoBias(dim_msa, dim_hidden * 2)
        self.to_pairwise_repr = nn.Linear(dim_hidden ** 2, dim_pairwise)

    def forward(self, msa, *, mask=None, msa_mask=None):
        msa = self.norm(msa)

        # line 2
        a, b = self.to_hidden(msa).chunk(2, dim=-1)

        # 'b s i d, b s j e -> b i j d e s'
        outer_product = torch.einsum('bsid,bsje->bijdes', a, b)

        # maybe masked mean for outer product
        if exists(msa_mask):
            outer_product = outer_product * msa_mask.float()[:, None, None, None, None, :]

            num = outer_product.sum(dim=-1)
            den = msa_mask.float().sum(dim=-1)

            outer_product_mean = num / den.clamp(min=self.eps)[:, None, None, None, None]
        else:
            outer_product_mean = outer_product.mean(dim=-1)

        # flatten
        outer_product_mean = outer_product_mean.flatten(-2)

        # masking for pairwise repr
        if exists(mask):
            mask = (mask[:, :, None] & mask[:, None, :])[..., None]
            outer_product_mean = outer_product_mean * mask

        pairwise_repr = self.to_pairwise_repr(outer_product_mean)
        return pairwise_repr


class MSAPairWeightedAveraging(Module):
    """ Algorithm 10 """

    def __init__(self, *, dim_msa=64, dim_pairwise=128, dim_head=32, heads=8):
        super().__init__()
        dim_inner = dim_head * heads
        self.heads = heads

        self.msa_norm = nn.LayerNorm(dim_msa)
        self.msa_to_values_and_gates = LinearNoBias(dim_msa, dim_inner * 2)

        self.pairwise_norm = nn.LayerNorm(dim_pairwise)
        self.pairwise_repr_to_attn = LinearNoBias(dim_pairwise, heads)

        self.to_out = LinearNoBias(dim_inner, dim_msa)

    def forward(self, *, msa, pairwise_repr, mask=None):
        b_, s, n, _ = msa.shape
        h = self.heads

        # 'b s n (gv h d) -> gv b h s n d'
        vg = self.msa_to_values_and_gates(self.msa_norm(msa))
        vg = vg.view(b_, s, n, 2, h, -1).permute(3, 0, 4, 1, 2, 5)
        values, gates = vg[0], vg[1]
        gates = gates.sigmoid()

        # line 3, 'b i j h -> b h i j'
        b = self.pairwise_repr_to_attn(self.pairwise_norm(pairwise_repr)).permute(0, 3, 1, 2)

        if exists(mask):
            mask = mask[:, None, None, :]
            b = b.masked_fill(~mask, max_neg_value(b))

        # line 5
        weights = b.softmax(dim=-1)

        # line 6
        out = torch.einsum('bhij,bhsjd->bhsid', weights, values)

        out = out * gates

        # combine heads, 'b h s n d -> b s n (h d)'
        out = out.permute(0, 2, 3, 1, 4).reshape(b_, s, n, -1)
        return self.to_out(out)


class MSAModule(Module):
    """ Algorithm 8 """

    def __init__(
        self,
        *,
        dim_single=384,
        dim_pairwise=128,
        depth=4,
        dim_msa=64,
        dim_msa_input=None,
        outer_product_mean_dim_hidden=32,
        msa_pwa_heads=8,
        msa_pwa_dim_head=32,
        max_num_msa=None,
    ):
        super().__init__()

        self.max_num_msa = default(max_num_msa, float('inf'))  # cap the number of MSAs, will do sample without replacement if exceeds

        self.msa_init_proj = LinearNoBias(dim_msa_input, dim_msa) if exists(dim_msa_input) else nn.Identity()

        self.single_to_msa_feats = LinearNoBias(dim_single, dim_msa)

        layers = ModuleList([])

        for _ in range(depth):
            outer_product_mean = OuterProductMean(
                dim_msa=dim_msa, dim_pairwise=dim_pairwise, dim_hidden=outer_product_mean_dim_hidden
            )

            msa_pair_weighted_avg = MSAPairWeightedAveraging(
                dim_msa=dim_msa, dim_pairwise=dim_pairwise, heads=msa_pwa_heads, dim_head=msa_pwa_dim_head
            )

            msa_transition = PreLayerNorm(Transition(dim=dim_msa), dim=dim_msa)

            pairwise_transition = PreLayerNorm(Transition(dim=dim_pairwise), dim=dim_pairwise)

            layers.append(ModuleList([outer_product_mean, msa_pair_weighted_avg, msa_transition, pairwise_transition]))

        self.layers = layers

    def forward(self, *, single_repr, pairwise_repr, msa, mask=None, msa_mask=None):
        batch, num_msa, device = *msa.shape[:2], msa.device

        # sample without replacement
        if num_msa > self.max_num_msa:
            rand = torch.randn((batch, num_msa), device=device)

            if exists(msa_mask):
                rand.masked_fill_(~msa_mask, max_neg_value(msa))

            indices = rand.topk(self.max_num_msa, dim=-1).indices

            # 'b [s] n dm, b sampled -> b sampled n dm'
            msa = msa.gather(1, indices[:, :, None, None].expand(-1, -1, *msa.shape[2:]))

            if exists(msa_mask):
                msa_mask = msa_mask.gather(1, indices)

        # process msa
        msa = self.msa_init_proj(msa)

        single_msa_feats = self.single_to_msa_feats(single_repr)

        msa = single_msa_feats[:, None] + msa

        for outer_product_mean, msa_pair_weighted_avg, msa_transition, pairwise_transition in self.layers:
            # communication between msa and pairwise rep
            pairwise_repr = outer_product_mean(msa, mask=mask, msa_mask=msa_mask) + pairwise_repr

            msa = msa_pair_weighted_avg(msa=msa, pairwise_repr=pairwise_repr, mask=mask) + msa
            msa = msa_transition(msa) + msa

            # pairwise block (trimmed to its transition)
            pairwise_repr = pairwise_transition(pairwise_repr) + pairwise_repr

        return pairwise_repr


class Alphafold3(Module):
    def __init__(self, *, dim_input=16, dim_msa_input=12, dim_single=32, dim_pairwise=16, msa_module_kwargs=dict()):
        super().__init__()
        self.single_init = LinearNoBias(dim_input, dim_single)
        self.to_pairwise_i = LinearNoBias(dim_single, dim_pairwise)
        self.to_pairwise_j = LinearNoBias(dim_single, dim_pairwise)

        self.msa_module = MSAModule(
            dim_single=dim_single, dim_pairwise=dim_pairwise, dim_msa_input=dim_msa_input, **msa_module_kwargs
        )

    if FIXED:
        def forward(self, *, residue_feats, mask, msa=None, msa_mask=None):
            single, pairwise = self.embed(residue_feats)

            # msa
            if exists(msa):
                embedded_msa = self.msa_module(
                    msa=msa, single_repr=single, pairwise_repr=pairwise, mask=mask, msa_mask=msa_mask
                )
                pairwise = embedded_msa + pairwise

            return pairwise
    else:
        def forward(self, *, residue_feats, mask, msa):
            single, pairwise = self.embed(residue_feats)

            # msa
            embedded_msa = self.msa_module(msa=msa, single_repr=single, pairwise_repr=pairwise, mask=mask)

            pairwise = embedded_msa + pairwise

            return pairwise

    def embed(self, residue_feats):
        single = self.single_init(residue_feats)
        pairwise = self.to_pairwise_i(single)[:, :, None] + self.to_pairwise_j(single)[:, None, :]
        return single, pairwise


def collate(examples, dim_input, dim_msa_input):
    # pad residues on the right to the longest chain, MSA rows on the bottom to the deepest MSA
    n = max(e['residue_feats'].shape[0] for e in examples)
    s = max(e['msa'].shape[0] for e in examples)
    b = len(examples)
    residue_feats = torch.zeros(b, n, dim_input)
    mask = torch.zeros(b, n, dtype=torch.bool)
    msa = torch.zeros(b, s, n, dim_msa_input)
    msa_mask = torch.zeros(b, s, dtype=torch.bool)
    for i, e in enumerate(examples):
        ni, si = e['residue_feats'].shape[0], e['msa'].shape[0]
        residue_feats[i, :ni] = e['residue_feats']
        mask[i, :ni] = True
        msa[i, :si, :ni] = e['msa']
        msa_mask[i, :si] = True
    return dict(residue_feats=residue_feats, mask=mask, msa=msa, msa_mask=msa_mask)


def main():
    torch.manual_seed(0)
    dim_input, dim_msa_input = 16, 12

    model = Alphafold3(
        dim_input=dim_input,
        dim_msa_input=dim_msa_input,
        msa_module_kwargs=dict(
            depth=2, dim_msa=16, outer_product_mean_dim_hidden=4, msa_pwa_heads=2, msa_pwa_dim_head=8, max_num_msa=6
        ),
    ).eval()

    examples = [
        dict(residue_feats=torch.randn(10, dim_input), msa=torch.randn(8, 10, dim_msa_input)),
        dict(residue_feats=torch.randn(7, dim_input), msa=torch.randn(3, 7, dim_msa_input)),
    ]
    batch = collate(examples, dim_input, dim_msa_input)

    torch.manual_seed(1)  # MSA subsampling
    with torch.no_grad():
        if FIXED:
            pairwise = model(**batch)
        else:
            # Alphafold3.forward takes no msa_mask before the fix
            pairwise = model(residue_feats=batch['residue_feats'], mask=batch['mask'], msa=batch['msa'])

    real = batch['mask'][:, :, None] & batch['mask'][:, None, :]
    for i in range(pairwise.shape[0]):
        p = pairwise[i][real[i]]
        print(f"complex {i}: pair repr over real residue pairs mean={p.mean().item():.6f} abs-sum={p.abs().sum().item():.4f}")


if __name__ == "__main__":
    main()
