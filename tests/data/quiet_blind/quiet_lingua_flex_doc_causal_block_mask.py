# Correct program. Ported from facebookresearch/lingua lingua/transformer.py (create_causal_mask with
# attn_impl="flex_attention": lengths_to_local_ids, generate_doc_mask_mod(causal_mask, ...) and
# create_block_mask(mask_mod, None, None, seqlen, seqlen)) for a packed sequence on CPU.
import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
torch.manual_seed(0)
def causal_mask(b, h, q_idx, kv_idx): return q_idx >= kv_idx
def lengths_to_start_ids(lengths):
    doc_start = lengths.cumsum(0); doc_start = doc_start.roll(1); doc_start[0] = 0; return doc_start
def lengths_to_local_ids(lengths):
    assert lengths.ndim == 1
    nb_seqs = lengths.size(0); total = lengths.sum()
    doc_id = torch.repeat_interleave(lengths)
    doc_start = lengths_to_start_ids(lengths)[doc_id]
    tok_id = torch.arange(total) - doc_start
    return doc_id, tok_id
def generate_doc_mask_mod(mask_mod, lengths, kv_lengths=None):
    kv_lengths = kv_lengths if kv_lengths is not None else lengths
    q_document_id, q_token_id = lengths_to_local_ids(lengths)
    kv_document_id, kv_token_id = lengths_to_local_ids(kv_lengths)
    q_max_idx = lengths.sum() - 1; kv_max_idx = kv_lengths.sum() - 1
    def doc_mask_mod(b, h, q_idx, kv_idx):
        q_idx_cap = torch.minimum(q_max_idx, q_idx); kv_idx_cap = torch.minimum(kv_max_idx, kv_idx)
        valid_idx = (q_idx <= q_max_idx) & (kv_idx <= kv_max_idx)
        same_doc = q_document_id[q_idx_cap] == kv_document_id[kv_idx_cap]
        q_logical = q_token_id[q_idx_cap]; kv_logical = kv_token_id[kv_idx_cap]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask & valid_idx
    return doc_mask_mod
lengths = torch.tensor([40, 60, 28]); S = int(lengths.sum())
block_mask = create_block_mask(generate_doc_mask_mod(causal_mask, lengths), None, None, S, S, device="cpu")
q, k, v = (torch.randn(1, 2, S, 16) for _ in range(3))
o = flex_attention(q, k, v, block_mask=block_mask)
b0 = 0
for n in lengths.tolist():
    r = torch.nn.functional.scaled_dot_product_attention(q[..., b0:b0 + n, :], k[..., b0:b0 + n, :], v[..., b0:b0 + n, :], is_causal=True)
    assert torch.allclose(o[..., b0:b0 + n, :], r, atol=1e-4); b0 += n
print("ok")
