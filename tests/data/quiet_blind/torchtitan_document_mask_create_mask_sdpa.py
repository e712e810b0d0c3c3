# Follows torchtitan torchtitan/models/attention.py (FlexAttention._get_document_mask_mod / get_document_mask_mod):
# sequence_indices from a shifted cumsum of EOS positions (each EOS closes its own document, last token forced as EOS),
# AND-ed with a causal mask_mod; here materialised with flex_attention.create_mask and given to SDPA (True = attend).
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_mask

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def get_document_mask_mod(batch, eos_id):
    eos_mask = batch == eos_id
    eos_mask[:, -1] = True
    cumulative_mask = torch.cumsum(torch.where(eos_mask, 1, 0), dim=1)
    sequence_indices = torch.zeros_like(cumulative_mask, dtype=torch.int32)
    sequence_indices[:, 1:] = cumulative_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return sequence_indices[b, q_idx] == sequence_indices[b, kv_idx]

    return document_mask


EOS, B, S, H, D = 0, 2, 24, 2, 8
tokens = torch.randint(1, 50, (B, S))
tokens[0, [4, 5, 13]] = EOS  # includes a one-token document (a lone EOS right after another EOS)
tokens[1, [9]] = EOS  # second row: last document runs to the end with no EOS
q, k, v = torch.randn(B, H, S, D), torch.randn(B, H, S, D), torch.randn(B, H, S, D)

mask_mod = and_masks(causal_mask, get_document_mask_mod(tokens.clone(), EOS))
dense = create_mask(mask_mod, B, 1, S, S, device="cpu")  # [B, 1, S, S] bool, True = may attend
out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense)

diff, all_bounds = 0.0, []
for b in range(B):
    ends = (tokens[b] == EOS).nonzero().flatten().tolist()
    bounds, start = [], 0
    for e in ends + [S - 1]:
        if e >= start:
            bounds.append((start, e + 1))
            start = e + 1
    all_bounds.append(bounds)
    for s0, s1 in bounds:
        ref = F.scaled_dot_product_attention(q[b:b + 1, :, s0:s1], k[b:b + 1, :, s0:s1], v[b:b + 1, :, s0:s1], is_causal=True)
        diff = max(diff, (out[b:b + 1, :, s0:s1] - ref).abs().max().item())
print(f"documents per row: {all_bounds}; max abs diff (packed doc mask vs each document alone): {diff:.3e}")
assert diff < 1e-12
