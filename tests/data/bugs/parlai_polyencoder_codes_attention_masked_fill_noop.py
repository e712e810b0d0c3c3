"""ParlAI poly-encoder: the codes attention over the context never masks the context padding.

Citation: facebookresearch/ParlAI PR #3068 "Fix masked_fill no-op" (commit 84351e54b, 2020-09-10),
parlai/agents/transformer/modules.py, `BasicAttention.forward`. Read from the repository history.

Bug: `BasicAttention.forward` built `attn_mask = (mask_ys == 0).view(bsz, 1, y_len).repeat(1, x_len, 1)`
and called `l1.masked_fill(attn_mask, neginf(l1.dtype))`, the out-of-place variant, dropping its result.
The poly-encoder (`--polyencoder-type codes`, `--codes-attention-type basic`) reduces the context
encoder's output with this attention, `n_codes` learned codes as queries over the context tokens, so
every code attended to the padded positions of shorter contexts in a batch.
Fix: `l1.masked_fill_(attn_mask, neginf(l1.dtype))`.

This program keeps `PolyencoderModule.encode` / `attend` / `score` and `PolyBasicAttention` with the
options in an `opt` dict as ParlAI holds them; the ParlAI `TransformerEncoder` is stood in for by a
`nn.TransformerEncoder` that returns `(ctxt_out, ctxt_mask)` the same way. Two contexts of 7 and 3
tokens (pad index 0), 2 candidates each. `--fixed` uses the in-place fill.
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def neginf(dtype):
    return -1e20 if dtype is torch.float32 else -65504


class BasicAttention(nn.Module):
    """
    Implements simple/classical attention.
    """

    def __init__(self, dim=1, attn='cosine', residual=False, get_weights=True):
        super().__init__()
        if attn == 'cosine':
            self.cosine = nn.CosineSimilarity(dim=dim)
        self.attn = attn
        self.dim = dim
        self.get_weights = get_weights
        self.residual = residual

    def forward(self, xs, ys, mask_ys=None, values=None):
        bsz = xs.size(0)
        y_len = ys.size(1)
        x_len = xs.size(1)
        if self.attn == 'cosine':
            l1 = self.cosine(xs, ys).unsqueeze(self.dim - 1)
        else:
            l1 = torch.bmm(xs, ys.transpose(1, 2))
            if self.attn == 'sqrt':
                d_k = ys.size(-1)
                l1 = l1 / math.sqrt(d_k)
        if mask_ys is not None:
            attn_mask = (mask_ys == 0).view(bsz, 1, y_len)
            attn_mask = attn_mask.repeat(1, x_len, 1)
            if FIXED:
                l1.masked_fill_(attn_mask, neginf(l1.dtype))
            else:
                l1.masked_fill(attn_mask, neginf(l1.dtype))
        l2 = F.softmax(l1, dim=self.dim, dtype=torch.float).type_as(l1)
        if values is None:
            values = ys
        lhs_emb = torch.bmm(l2, values)
        if self.residual:
            lhs_emb = lhs_emb.add(xs)
        if self.get_weights:
            return lhs_emb.squeeze(self.dim - 1), l2
        else:
            return lhs_emb.squeeze(self.dim - 1)


class PolyBasicAttention(BasicAttention):
    """
    Override basic attention to account for edge case for polyencoder.
    """

    def __init__(self, poly_type, n_codes, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.poly_type = poly_type
        self.n_codes = n_codes

    def forward(self, *args, **kwargs):
        lhs_emb = super().forward(*args, **kwargs)
        if self.poly_type == 'codes' and self.n_codes == 1 and len(lhs_emb.shape) == 2:
            lhs_emb = lhs_emb.unsqueeze(self.dim - 1)
        return lhs_emb


class TransformerEncoder(nn.Module):
    """Stand-in for parlai's TransformerEncoder(reduction_type=None): returns (tensor, mask)."""

    def __init__(self, embeddings, null_idx, dim, n_heads, n_layers):
        super().__init__()
        self.embeddings = embeddings
        self.padding_idx = null_idx
        layer = nn.TransformerEncoderLayer(dim, n_heads, 2 * dim, dropout=0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, n_layers, enable_nested_tensor=False)

    def forward(self, input):
        mask = input != self.padding_idx
        tensor = self.layers(self.embeddings(input), src_key_padding_mask=~mask)
        tensor = tensor * mask.unsqueeze(-1).type_as(tensor)
        return tensor, mask


class PolyencoderModule(nn.Module):

    def __init__(self, opt, null_idx):
        super().__init__()
        self.null_idx = null_idx
        self.type = opt['polyencoder_type']
        self.n_codes = opt['poly_n_codes']
        self.attention_type = opt['poly_attention_type']
        self.codes_attention_type = opt['codes_attention_type']
        embed_dim = opt['embedding_size']
        embeddings = nn.Embedding(opt['vocab_size'], embed_dim, padding_idx=null_idx)
        self.encoder_ctxt = TransformerEncoder(embeddings, null_idx, embed_dim, opt['n_heads'], opt['n_layers'])
        self.encoder_cand = TransformerEncoder(embeddings, null_idx, embed_dim, opt['n_heads'], opt['n_layers'])
        if self.type == 'codes':
            codes = torch.empty(self.n_codes, embed_dim)
            codes = torch.nn.init.uniform_(codes)
            self.codes = torch.nn.Parameter(codes)
            if self.codes_attention_type == 'basic':
                self.code_attention = PolyBasicAttention(
                    self.type, self.n_codes, dim=2, attn='basic', get_weights=False
                )
        self.attention = PolyBasicAttention(
            self.type, self.n_codes, dim=2, attn=self.attention_type, get_weights=False
        )

    def attend(self, attention_layer, queries, keys, values, mask):
        if keys is None:
            keys = values
        return attention_layer(queries, keys, mask_ys=mask, values=values)

    def encode(self, cand_tokens, ctxt_tokens):
        bsz, num_cands = cand_tokens.size(0), cand_tokens.size(1)
        cand_out, cand_mask = self.encoder_cand(cand_tokens.view(bsz * num_cands, -1))
        # reduction_type 'mean' for candidates
        cand_embed = (cand_out.sum(1) / cand_mask.sum(1, keepdim=True)).view(bsz, num_cands, -1)
        ctxt_out, ctxt_mask = self.encoder_ctxt(ctxt_tokens)
        ctxt_rep = self.attend(
            self.code_attention,
            queries=self.codes.repeat(bsz, 1, 1),
            keys=ctxt_out,
            values=ctxt_out,
            mask=ctxt_mask,
        )
        ctxt_rep_mask = ctxt_rep.new_ones(bsz, self.n_codes).byte()
        return ctxt_rep, ctxt_rep_mask, cand_embed

    def score(self, ctxt_rep, ctxt_rep_mask, cand_embed):
        ctxt_final_rep = self.attend(self.attention, cand_embed, ctxt_rep, ctxt_rep, ctxt_rep_mask)
        return torch.sum(ctxt_final_rep * cand_embed, 2)


def main():
    torch.manual_seed(0)
    opt = {'polyencoder_type': 'codes', 'poly_n_codes': 4, 'poly_attention_type': 'basic',
           'codes_attention_type': 'basic', 'embedding_size': 16, 'n_heads': 2, 'n_layers': 1,
           'vocab_size': 30}
    model = PolyencoderModule(opt, null_idx=0).eval()
    ctxt_tokens = torch.tensor([[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 0, 0, 0, 0]])
    cand_tokens = torch.tensor([[[15, 16, 0], [17, 18, 19]], [[20, 21, 22], [23, 0, 0]]])
    with torch.no_grad():
        ctxt_rep, ctxt_rep_mask, cand_embed = model.encode(cand_tokens, ctxt_tokens)
        scores = model.score(ctxt_rep, ctxt_rep_mask, cand_embed)
    print("fixed" if FIXED else "buggy", [[round(float(s), 4) for s in row] for row in scores])


if __name__ == "__main__":
    main()
