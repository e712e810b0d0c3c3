"""FlexAttention packed prefix-LM batch built from attention-gym mask_mods with and_masks / or_masks.

Follows pytorch-labs/attention-gym attn_gym/masks/prefix_lm.py (generate_prefix_lm_mask:
`or_masks(causal_mask, prefix_mask)`), attn_gym/masks/document_mask.py (_offsets_to_doc_ids_tensor,
generate_doc_mask_mod: same-document AND'ed with the inner mask in document coordinates) and attn_gym/mods/softcapping.py
(generate_tanh_softcap score_mod). Three (prefix, completion) examples of different lengths are packed
into one row of 64 tokens, with a trailing pad document. Mask: a token sees keys of its own document
only, and inside it sees the whole prefix (bidirectional) plus causal completion tokens. The pad
tail is its own document (causal among pads), whose outputs the loss ignores.
"""
import torch
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention, or_masks


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def _offsets_to_doc_ids_tensor(offsets):
    device = offsets.device
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(torch.arange(len(counts), device=device, dtype=torch.int32), counts)


def generate_tanh_softcap(soft_cap, approx=False):
    def tanh_softcap(score, b, h, q_idx, kv_idx):
        return soft_cap * torch.tanh(score / soft_cap)

    tanh_softcap.__name__ = f"tanh_softcap_{soft_cap}"
    return tanh_softcap


def main():
    torch.manual_seed(0)
    examples = [(6, 14), (10, 8), (4, 18)]  # (prefix_len, completion_len)
    seq_len = 64
    lengths = [p + c for p, c in examples]
    lengths.append(seq_len - sum(lengths))  # pad document
    offsets = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    prefix_lengths = torch.tensor([p for p, _ in examples] + [0], dtype=torch.int32)
    document_id = _offsets_to_doc_ids_tensor(offsets)

    # prefix_lm.py's prefix_mask with a per-document prefix length, in document coordinates
    # (document_mask.py's `kv_idx - offsets[document_id[kv_idx]]`).
    def prefix_lm_in_document(b, h, q_idx, kv_idx):
        doc = document_id[q_idx]
        kv_local = kv_idx - offsets[doc]
        return kv_local < prefix_lengths[doc]

    def same_document(b, h, q_idx, kv_idx):
        return document_id[q_idx] == document_id[kv_idx]

    mask_mod = and_masks(same_document, or_masks(causal_mask, prefix_lm_in_document))
    block_mask = create_block_mask(mask_mod, B=None, H=None, Q_LEN=seq_len, KV_LEN=seq_len, device="cpu", BLOCK_SIZE=16)
    B, H, D = 1, 4, 16
    q, k, v = (torch.randn(B, H, seq_len, D) for _ in range(3))
    out = flex_attention(q, k, v, score_mod=generate_tanh_softcap(30.0), block_mask=block_mask)
    print("packed prefix-LM output", tuple(out.shape), f"{out.abs().mean().item():.4f}")


if __name__ == "__main__":
    main()
