# Boltz-1 (jwohlwend/boltz commit 3ad510a "Bug on non-chunking!"), src/boltz/model/layers/outer_product_mean.py.
# Bug: the un-chunked OuterProductMean path (training, and inference for <=512 tokens) divides by mask.sum(1), the valid MSA rows of
# column j only, instead of the pair mask mask[:, :, None, :] * mask[:, :, :, None] that the chunked path sums. (MSALayer trimmed to it.)
import sys

import torch
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv

NUM_TOKENS = 33  # boltz.data.const.num_tokens


def final_init_(weights):  # boltz.model.layers.initialize
    with torch.no_grad():
        weights.fill_(0.0)


class OuterProductMean(nn.Module):
    """Outer product mean layer."""

    def __init__(self, c_in: int, c_hidden: int, c_out: int) -> None:
        super().__init__()
        self.c_hidden = c_hidden
        self.norm = nn.LayerNorm(c_in)
        self.proj_a = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_b = nn.Linear(c_in, c_hidden, bias=False)
        self.proj_o = nn.Linear(c_hidden * c_hidden, c_out)
        final_init_(self.proj_o.weight)
        final_init_(self.proj_o.bias)

    def forward(self, m: Tensor, mask: Tensor, chunk_size: int = None) -> Tensor:
        # Expand mask
        mask = mask.unsqueeze(-1).to(m)

        # Compute projections
        m = self.norm(m)
        a = self.proj_a(m) * mask
        b = self.proj_b(m) * mask

        # Compute outer product mean
        if chunk_size is not None and not self.training:
            # Compute pairwise mask
            for i in range(0, mask.shape[1], 64):
                if i == 0:
                    num_mask = (
                        mask[:, i : i + 64, None, :] * mask[:, i : i + 64, :, None]
                    ).sum(1)
                else:
                    num_mask += (
                        mask[:, i : i + 64, None, :] * mask[:, i : i + 64, :, None]
                    ).sum(1)
            num_mask = num_mask.clamp(min=1)

            # Compute squentially in chunks
            for i in range(0, self.c_hidden, chunk_size):
                a_chunk = a[:, :, :, i : i + chunk_size]
                sliced_weight_proj_o = self.proj_o.weight[
                    :, i * self.c_hidden : (i + chunk_size) * self.c_hidden
                ]

                z = torch.einsum("bsic,bsjd->bijcd", a_chunk, b)
                z = z.reshape(*z.shape[:3], -1)
                z = z / num_mask

                # Project to output
                if i == 0:
                    z_out = z.to(m) @ sliced_weight_proj_o.T
                else:
                    z_out = z_out + z.to(m) @ sliced_weight_proj_o.T
            return z_out
        else:
            if FIXED:
                mask = mask[:, :, None, :] * mask[:, :, :, None]
            num_mask = mask.sum(1).clamp(min=1)
            z = torch.einsum("bsic,bsjd->bijcd", a.float(), b.float())
            z = z.reshape(*z.shape[:3], -1)
            z = z / num_mask

            # Project to output
            z = self.proj_o(z.to(m))
            return z


class MSALayer(nn.Module):
    """MSA layer, trimmed to the outer product mean update of the pair representation."""

    def __init__(self, msa_s: int, token_z: int) -> None:
        super().__init__()
        self.outer_product_mean = OuterProductMean(c_in=msa_s, c_hidden=8, c_out=token_z)

    def forward(self, z, m, token_mask, msa_mask, chunk_size_outer_product=None):
        z = z + self.outer_product_mean(m, msa_mask, chunk_size_outer_product)
        return z, m


class MSAModule(nn.Module):
    def __init__(self, msa_s=16, token_z=16, s_input_dim=16, msa_blocks=1):
        super().__init__()
        self.msa_blocks = msa_blocks
        self.s_proj = nn.Linear(s_input_dim, msa_s, bias=False)
        self.msa_proj = nn.Linear(NUM_TOKENS + 2, msa_s, bias=False)
        self.layers = nn.ModuleList([MSALayer(msa_s, token_z) for _ in range(msa_blocks)])

    def forward(self, z, emb, feats, force_large=False):
        # Set chunk sizes (trunk.py: only complexes with > 512 tokens use the chunked outer product)
        if not self.training and (z.shape[1] > 512 or force_large):
            chunk_size_outer_product = 4
        else:
            chunk_size_outer_product = None

        msa = feats["msa"]
        has_deletion = feats["has_deletion"].unsqueeze(-1)
        deletion_value = feats["deletion_value"].unsqueeze(-1)
        msa_mask = feats["msa_mask"]
        token_mask = feats["token_pad_mask"].float()
        token_mask = token_mask[:, :, None] * token_mask[:, None, :]

        m = torch.cat([msa, has_deletion, deletion_value], dim=-1)
        m = self.msa_proj(m)
        m = m + self.s_proj(emb).unsqueeze(1)
        for i in range(self.msa_blocks):
            z, m = self.layers[i](z, m, token_mask, msa_mask, chunk_size_outer_product)
        return z


def main():
    torch.manual_seed(0)
    B, S, N_A, N_B = 1, 8, 10, 8
    N = N_A + N_B
    module = MSAModule()
    # random weights (proj_o.weight is zero-initialised in Boltz; a trained checkpoint's is not). The bias stays 0:
    # the chunked path never adds proj_o.bias, so only the mask normalisation separates the two paths.
    for layer in module.layers:
        nn.init.normal_(layer.outer_product_mean.proj_o.weight, std=0.2)
    module.eval()

    # heteromer: chain A has 8 MSA rows, chain B only 3 unpaired rows -> the rest of B's columns are padding rows
    msa_mask = torch.ones(B, S, N)
    msa_mask[:, 3:, N_A:] = 0
    feats = {
        "msa": nn.functional.one_hot(torch.randint(0, NUM_TOKENS, (B, S, N)), NUM_TOKENS).float(),
        "has_deletion": torch.zeros(B, S, N),
        "deletion_value": torch.zeros(B, S, N),
        "msa_mask": msa_mask,
        "token_pad_mask": torch.ones(B, N),
    }
    z = torch.randn(B, N, N, 16)
    emb = torch.randn(B, N, 16)
    with torch.no_grad():
        out_small = module(z, emb, feats)                  # the path every complex <= 512 tokens takes
        out_chunked = module(z, emb, feats, force_large=True)  # the chunked path (> 512 tokens), pair-count mask
    diff = (out_small - out_chunked).abs().max().item()
    print(f"max |z_unchunked - z_chunked|: {diff:.6e}")


if __name__ == "__main__":
    main()
