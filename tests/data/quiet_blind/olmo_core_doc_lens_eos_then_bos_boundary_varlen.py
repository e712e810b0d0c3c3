"""OLMo-core intra-document masking where the EOS id also occurs inside documents.

Follows allenai/OLMo-core src/olmo_core/data/utils.py (get_document_lengths with bos_token_id: a boundary is
an EOS immediately followed by a BOS; get_cumulative_document_lengths: zero-padded doc_lens of the whole batch
flattened into one cu_doc_lens) and the collator / attention path that feeds cu_doc_lens + max_doc_len to a
varlen flash attention (utils.py read at the stored version; here: a varlen loop fallback over the flattened batch, each segment causal).

Mask meant: causal attention inside each document, nothing across documents, also across instance rows of the
batch (cu_doc_lens runs over the flattened batch). The tokenizer uses the EOS id to end chat turns too, so an
EOS that is NOT followed by BOS is ordinary data inside a document and must not split it.
"""
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
BOS, EOS = 1, 2


def get_document_lengths(input_ids: torch.Tensor, eos_token_id: int, bos_token_id: Optional[int] = None):
    """Document lengths of one instance; with bos_token_id only EOS followed by BOS ends a document."""
    if bos_token_id is None:
        ends = (input_ids == eos_token_id).nonzero(as_tuple=True)[0].to(torch.int32)
        tail = [] if input_ids[-1] == eos_token_id else [input_ids.shape[0] - 1]
    else:
        ends = torch.logical_and(input_ids[:-1] == eos_token_id, input_ids[1:] == bos_token_id)
        ends = ends.nonzero(as_tuple=True)[0].to(torch.int32)
        tail = [input_ids.shape[0] - 1]
    boundaries = torch.cat([torch.tensor([-1], dtype=torch.int32), ends, torch.tensor(tail, dtype=torch.int32)])
    return boundaries[1:] - boundaries[:-1]


def get_cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([torch.tensor([0], dtype=torch.int32),
                      torch.cumsum(doc_lens.masked_select(doc_lens != 0), 0, dtype=torch.int32)])


def collate(instances):
    doc_lens = [get_document_lengths(x, EOS, BOS) for x in instances]
    width = max(len(d) for d in doc_lens)
    doc_lens = torch.stack([F.pad(d, (0, width - len(d))) for d in doc_lens])
    return {"input_ids": torch.stack(instances), "doc_lens": doc_lens, "max_doc_lens": doc_lens.max(1).values}


class Attention(nn.Module):
    def __init__(self, d_model=32, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.w_q, self.w_k, self.w_v = (nn.Linear(d_model, d_model, bias=False) for _ in range(3))
        self.w_out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, cu_doc_lens=None, max_doc_len=None):
        b, t, d = x.shape
        q, k, v = (w(x).view(b * t, self.n_heads, d // self.n_heads) for w in (self.w_q, self.w_k, self.w_v))
        out = torch.empty_like(q)
        # varlen fallback: the flattened batch split at cu_doc_lens, each segment causal on its own
        bounds = cu_doc_lens.tolist()
        for s, e in zip(bounds[:-1], bounds[1:]):
            assert e - s <= max_doc_len
            seg = F.scaled_dot_product_attention(q[s:e].transpose(0, 1), k[s:e].transpose(0, 1),
                                                 v[s:e].transpose(0, 1), is_causal=True)
            out[s:e] = seg.transpose(0, 1)
        return self.w_out(out.reshape(b, t, d))


row0 = torch.tensor([BOS, 5, 6, EOS, 7, 8, EOS, BOS, 9, 10, 11, EOS, BOS, 12, 13, 14])   # EOS at 3 ends a turn
row1 = torch.tensor([BOS, 20, 21, 22, 23, EOS, BOS, 24, EOS, 25, 26, 27, 28, 29, 30, 31])
batch = collate([row0, row1])
cu_doc_lens = get_cumulative_document_lengths(batch["doc_lens"])
assert cu_doc_lens.tolist() == [0, 7, 12, 16, 22, 32]
embed = nn.Embedding(40, 32)
attn = Attention().eval()
with torch.no_grad():
    x = embed(batch["input_ids"])
    out = attn(x, cu_doc_lens=cu_doc_lens, max_doc_len=int(batch["max_doc_lens"].max()))
    # reference: explicit mask from a double loop over absolute positions of the flattened batch
    flat = x.reshape(32, 32)
    doc_of = torch.zeros(32, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu_doc_lens[:-1].tolist(), cu_doc_lens[1:].tolist())):
        doc_of[s:e] = i
    allowed = torch.zeros(32, 32, dtype=torch.bool)
    for i in range(32):
        for j in range(32):
            allowed[i, j] = j <= i and doc_of[i] == doc_of[j]
    q, k, v = (w(flat).view(32, 4, 8).transpose(0, 1) for w in (attn.w_q, attn.w_k, attn.w_v))
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    ref = attn.w_out(ref.transpose(0, 1).reshape(2, 16, 32))
    assert torch.allclose(out, ref, atol=1e-5)
print(f"doc_lens={batch['doc_lens'].tolist()} cu_doc_lens={cu_doc_lens.tolist()} ok")
