"""Uni-Mol2 in unimol_tools: batched molecules attend each other's padding atoms.

Citation: deepmodeling/Uni-Mol#364 ("Inconsistent representations between batch and single
inference in Uni-Mol2 (Suspected Self-Attention Mask Issue)", open). The reporter traced it to
`TransformerEncoderLayerV2`'s `self_attn_mask`, which "remains a matrix of all zeros" for a padded
batch. Source read at deepmodeling/Uni-Mol 90f52c4: `UniMolV2Model.batch_collate_fn`
(unimol_tools/models/unimolv2.py) pads every per-molecule `attn_bias` (zeros of (N+1, N+1),
built in data/conformer.py) with `pad_2d(..., pad_idx=self.padding_idx)` where
`self.padding_idx = 0`, and `forward` uses `attn_mask = attn_bias.clone()` repeated per head as
the additive mask of `softmax_dropout(attn, mask=attn_mask, bias=...)`. Padding with 0 leaves
the padding atoms' key columns open. The fix used by `--fixed` is the one the project's own
Uni-Mol2 training pipeline applies (unimol2/unimol2/data/unimol2_dataset.py `pad_attn_bias`):
fill with -inf, then zero the padding rows' real-key columns. The maintainers' answer to the
issue was not read; the issue is open in the stored thread.

The program batches two molecules of 6 and 3 atoms (7 and 4 tokens with the CLS slot), keeps the
collate's `atom_mask` and `src_tokens` padding as the project has them, and runs one
`TransformerEncoderLayerV2`-style self-attention with the mask added to q @ k.T before the softmax.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def pad_1d_tokens(values, pad_idx):
    size = max(v.size(0) for v in values)
    res = values[0].new(len(values), size).fill_(pad_idx)
    for i, v in enumerate(values):
        res[i][: len(v)].copy_(v)
    return res


def pad_2d(values, pad_idx, dim=1):
    size = max(v.size(0) for v in values)
    if dim == 1:
        res = values[0].new(len(values), size, size).fill_(pad_idx)
    else:
        res = values[0].new(len(values), size, size, dim).fill_(pad_idx)
    for i, v in enumerate(values):
        res[i][: len(v), : len(v)].copy_(v)
    return res


def pad_attn_bias(samples, pad_len):
    batch_size = len(samples)
    tensor = torch.full([batch_size, pad_len, pad_len], float("-inf"), dtype=samples[0].dtype)
    for i in range(batch_size):
        tensor[i, : samples[i].shape[0], : samples[i].shape[1]] = samples[i]
        tensor[i, samples[i].shape[0]:, : samples[i].shape[1]] = 0
    return tensor


def softmax_dropout(input, dropout_prob, is_training=True, mask=None, bias=None):
    input = input.contiguous().clone()
    if mask is not None:
        input += mask
    if bias is not None:
        input += bias
    return F.dropout(F.softmax(input, dim=-1), p=dropout_prob, training=is_training)


class Args:
    encoder_embed_dim = 32
    encoder_attention_heads = 4
    pair_embed_dim = 8


class SelfMultiheadAttentionV2(nn.Module):
    def __init__(self, embed_dim, pair_dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.scaling = (embed_dim // num_heads) ** -0.5
        self.q_proj = nn.Linear(embed_dim, embed_dim)
        self.k_proj = nn.Linear(embed_dim, embed_dim)
        self.v_proj = nn.Linear(embed_dim, embed_dim)
        self.linear_bias = nn.Linear(pair_dim, num_heads)
        self.out_proj = nn.Linear(embed_dim, embed_dim)

    def forward(self, query, pair, mask=None):
        bsz, n, _ = query.size()
        q = self.q_proj(query).view(bsz, n, self.num_heads, -1).transpose(1, 2) * self.scaling
        k = self.k_proj(query).view(bsz, n, self.num_heads, -1).transpose(1, 2)
        v = self.v_proj(query).view(bsz, n, self.num_heads, -1).transpose(1, 2)
        attn = q @ k.transpose(-1, -2)
        bias = self.linear_bias(pair).permute(0, 3, 1, 2).contiguous()
        probs = softmax_dropout(attn, 0.1, self.training, mask=mask, bias=bias)
        return self.out_proj((probs @ v).transpose(1, 2).reshape(bsz, n, -1))


class UniMolV2Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.args = Args()
        self.padding_idx = 0
        self.embed_tokens = nn.Embedding(16, self.args.encoder_embed_dim, self.padding_idx)
        self.edge_embed = nn.Embedding(8, self.args.pair_embed_dim, padding_idx=0)
        self.self_attn = SelfMultiheadAttentionV2(
            self.args.encoder_embed_dim, self.args.pair_embed_dim, self.args.encoder_attention_heads
        )
        self.dtype = torch.float32

    def forward(self, atom_mask, shortest_path, attn_bias, src_tokens):
        n_mol, n_atom = atom_mask.shape[:2]
        x = self.embed_tokens(src_tokens).type(self.dtype)
        attn_mask = attn_bias.clone()
        attn_mask = attn_mask.unsqueeze(1).repeat(1, self.args.encoder_attention_heads, 1, 1)
        attn_mask = attn_mask.type(self.dtype)
        pair = torch.zeros(n_mol, n_atom + 1, n_atom + 1, self.args.pair_embed_dim)
        pair[:, 1:, 1:, :] = self.edge_embed(shortest_path)
        x = x + self.self_attn(x, pair, mask=attn_mask)
        return x[:, 0, :]  # CLS token repr

    def batch_collate_fn(self, samples):
        batch = {}
        for k in samples[0][0].keys():
            if k == "atom_mask":
                v = pad_1d_tokens([torch.tensor(s[0][k]) for s in samples], pad_idx=self.padding_idx)
            elif k == "shortest_path":
                v = pad_2d([torch.tensor(s[0][k]) for s in samples], pad_idx=self.padding_idx)
            elif k == "attn_bias":
                if FIXED:
                    vals = [torch.tensor(s[0][k]) for s in samples]
                    v = pad_attn_bias(vals, max(t.size(0) for t in vals))
                else:
                    v = pad_2d([torch.tensor(s[0][k]) for s in samples], pad_idx=self.padding_idx)
            elif k == "src_tokens":
                v = pad_1d_tokens([torch.tensor(s[0][k]) for s in samples], pad_idx=self.padding_idx)
            batch[k] = v
        label = torch.tensor([s[1] for s in samples])
        return batch, label


def molecule_features(n_atoms, gen):
    """As data/conformer.py builds them: one CLS slot in front of the atoms."""
    return {
        "atom_mask": [1] * n_atoms,
        "shortest_path": torch.randint(1, 8, (n_atoms, n_atoms), generator=gen).tolist(),
        "attn_bias": [[0.0] * (n_atoms + 1) for _ in range(n_atoms + 1)],
        "src_tokens": [1] + torch.randint(2, 16, (n_atoms,), generator=gen).tolist(),
    }


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = UniMolV2Model().eval()
    samples = [(molecule_features(6, gen), 0.5), (molecule_features(3, gen), 1.5)]
    batch, label = model.batch_collate_fn(samples)
    with torch.no_grad():
        cls_repr = model(**batch)
    print("cls_repr", tuple(cls_repr.shape), "mol 1 norm %.4f" % cls_repr[1].norm().item())


if __name__ == "__main__":
    main()
