"""Meta lingua style transformer whose mask is a *string* ("causal") on the sdpa path and a
flex BlockMask built from document lengths on the flex path.

Follows facebookresearch/lingua lingua/transformer.py (Attention.forward with attn_impl in
{"sdpa", "flex_attention"}; `is_causal = (mask == "causal") if isinstance(mask, str) else False`)
and apps/main/transformer.py (LMTransformer.forward builds `create_causal_mask(seqlen, attn_impl,
sliding_window)`; "causal" for sdpa).  The flex path uses lingua's `generate_doc_mask_mod(causal_mask,
lengths)` so packed documents attend causally within themselves only.

Mask meant: sdpa path = plain causal (lower triangle) over the whole row; flex path = block-diagonal
causal over documents of lengths `lengths` (each doc sees only its own earlier tokens).
"""
from dataclasses import dataclass
from typing import Optional, Union

import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


@dataclass
class BaseTransformerArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    vocab_size: int = 97
    max_seqlen: int = 32


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def lengths_to_start_ids(lengths):
    doc_start = lengths.cumsum(0)
    doc_start = doc_start.roll(1)
    doc_start[0] = 0
    return doc_start


def lengths_to_local_ids(lengths):
    assert lengths.ndim == 1
    nb_seqs = lengths.size(0)
    total_seqlen = lengths.sum()
    doc_id = torch.repeat_interleave(lengths)
    doc_start = lengths_to_start_ids(lengths)
    doc_start = doc_start[doc_id]
    tok_id = torch.arange(total_seqlen, device=lengths.device) - doc_start
    return doc_id, tok_id


def generate_doc_mask_mod(mask_mod, lengths, kv_lengths=None):
    kv_lengths = kv_lengths if kv_lengths is not None else lengths
    q_document_id, q_token_id = lengths_to_local_ids(lengths)
    kv_document_id, kv_token_id = lengths_to_local_ids(kv_lengths)
    q_max_idx = lengths.sum() - 1
    kv_max_idx = kv_lengths.sum() - 1

    def doc_mask_mod(b, h, q_idx, kv_idx):
        q_idx_cap = torch.minimum(q_max_idx, q_idx)
        kv_idx_cap = torch.minimum(kv_max_idx, kv_idx)
        valid_idx = (q_idx <= q_max_idx) & (kv_idx <= kv_max_idx)
        same_doc = q_document_id[q_idx_cap] == kv_document_id[kv_idx_cap]
        q_logical = q_token_id[q_idx_cap]
        kv_logical = kv_token_id[kv_idx_cap]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask & valid_idx

    return doc_mask_mod


def create_causal_mask(seqlen, attn_impl, sliding_window=None, tokens=None, lengths=None):
    if attn_impl == "sdpa":
        return "causal"
    elif attn_impl == "flex_attention":
        return create_block_mask(generate_doc_mask_mod(causal_mask, lengths), None, None,
                                 seqlen, seqlen, device="cpu")
    raise NotImplementedError(f"Attention {attn_impl} with {sliding_window} sliding window not implemented")


class Attention(nn.Module):
    def __init__(self, dim, head_dim, n_heads):
        super().__init__()
        self.head_dim, self.n_heads = head_dim, n_heads
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=False)

    def forward(self, x, mask: Optional[Union[BlockMask, str]] = None, attn_impl: str = "sdpa"):
        bsz, seq_len, _ = x.shape
        xq = self.wq(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bsz, seq_len, self.n_heads, self.head_dim).transpose(1, 2)
        if attn_impl == "flex_attention":
            assert mask is None or isinstance(mask, BlockMask)
            output = flex_attention(xq, xk, xv, block_mask=mask)
        elif attn_impl == "sdpa":
            assert mask is None or isinstance(mask, (str, torch.Tensor))
            is_causal = (mask == "causal") if isinstance(mask, str) else False
            mask = mask if isinstance(mask, torch.Tensor) else None
            output = F.scaled_dot_product_attention(xq, xk, xv, is_causal=is_causal, attn_mask=mask)
        else:
            raise NotImplementedError(f"Attention implementation {attn_impl} not supported")
        return self.wo(output.transpose(1, 2).reshape(bsz, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.attention = Attention(args.dim, args.dim // args.n_heads, args.n_heads)
        self.attention_norm = nn.RMSNorm(args.dim)
        self.ffn_norm = nn.RMSNorm(args.dim)
        self.feed_forward = nn.Sequential(nn.Linear(args.dim, 4 * args.dim), nn.SiLU(), nn.Linear(4 * args.dim, args.dim))

    def forward(self, x, mask=None, attn_impl="sdpa"):
        h = x + self.attention(self.attention_norm(x), mask=mask, attn_impl=attn_impl)
        return h + self.feed_forward(self.ffn_norm(h))


class LMTransformer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.pos = nn.Embedding(args.max_seqlen, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args) for _ in range(args.n_layers))
        self.norm = nn.RMSNorm(args.dim)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, token_values, target=None, lengths=None, mask=None, attn_impl="sdpa"):
        bsz, seqlen = token_values.shape
        mask = mask if mask is not None else create_causal_mask(seqlen, attn_impl, lengths=lengths)
        if lengths is not None:
            # positions restart with each packed document, as lingua's doc-aware path does
            _, pos = lengths_to_local_ids(lengths)
        else:
            pos = torch.arange(seqlen)
        h = self.tok_embeddings(token_values) + self.pos(pos)[None]
        for layer in self.layers:
            h = layer(h, mask=mask, attn_impl=attn_impl)
        logits = self.output(self.norm(h))
        if target is not None:
            return F.cross_entropy(logits.flatten(0, 1), target.flatten())
        return logits


if __name__ == "__main__":
    warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
    torch.manual_seed(0)
    args = BaseTransformerArgs()
    model = LMTransformer(args).eval()
    tokens = torch.randint(0, args.vocab_size, (2, 17))
    with torch.no_grad():
        loss = model(tokens[:, :-1], target=tokens[:, 1:], attn_impl="sdpa")
        # packed batch of one row holding three documents
        lengths = torch.tensor([5, 7, 4])
        packed = torch.randint(0, args.vocab_size, (1, 16))
        logits_flex = model(packed, lengths=lengths, attn_impl="flex_attention")
        # the first document alone must give the same logits (its mask is self-contained)
        alone = model(packed[:, :5], attn_impl="sdpa", mask="causal")
    assert torch.allclose(logits_flex[:, :5], alone, atol=1e-4)
    print(f"sdpa loss {loss.item():.4f}; flex doc0 matches standalone")
