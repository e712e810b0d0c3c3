# Correct program (quiet batch quiet-zw).
# Ported from meta-pytorch/attention-gym @7fdb85d0b96668397adee48de54b6f1036497717:
#   attn_gym/mods/alibi.py (generate_alibi_bias: score + (kv_idx - q_idx) * exp2(-(h + 1) * 8 / H)),
#   attn_gym/masks/sliding_window.py (generate_sliding_window: and_masks(q_idx - kv_idx <= window, causal_mask)),
#   attn_gym/masks/causal.py (causal_mask),
#   attn_gym/masks/document_mask.py (length_to_offsets, _offsets_to_doc_ids_tensor, generate_doc_mask_mod).
# Three documents of lengths 5, 9 and 6 are packed into one row of 20 tokens (the "sequence stacked" format of
# document_mask.py). The sliding-window causal mask_mod is wrapped by generate_doc_mask_mod, so each query sees
# only keys of its own document, at most `window` positions back; the ALiBi score_mod adds a per-head linear
# distance bias. Inside a document the physical distance kv_idx - q_idx equals the logical one, so the bias needs
# no document offset. FlexAttention runs eagerly on CPU; a tiny multi-head self-attention layer (q/k/v/o
# projections) wraps it. Self-check: each document alone, unpacked, through a double loop over (query, key) that
# applies the window and the ALiBi bias by hand; outputs must agree on every token.
import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import (
    and_masks,
    create_block_mask,
    flex_attention,
)

torch.manual_seed(0)


# --- attn_gym/masks/causal.py ---
def causal_mask(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


# --- attn_gym/masks/sliding_window.py ---
def generate_sliding_window(window_size: int):
    def sliding_window(b, h, q_idx, kv_idx):
        return q_idx - kv_idx <= window_size

    sliding_window_mask = and_masks(sliding_window, causal_mask)
    sliding_window_mask.__name__ = f"sliding_window_{window_size}"
    return sliding_window_mask


# --- attn_gym/mods/alibi.py ---
def generate_alibi_bias(H: int):
    def alibi_mod(score, b, h, q_idx, kv_idx):
        scale = torch.exp2(-((h + 1) * 8.0 / H))
        bias = (kv_idx - q_idx) * scale
        return score + bias

    return alibi_mod


# --- attn_gym/masks/document_mask.py ---
def _offsets_to_doc_ids_tensor(offsets):
    device = offsets.device
    counts = offsets[1:] - offsets[:-1]
    return torch.repeat_interleave(
        torch.arange(len(counts), device=device, dtype=torch.int32), counts
    )


def length_to_offsets(lengths, device):
    offsets = [0]
    offsets.extend(lengths)
    offsets = torch.tensor(offsets, device=device, dtype=torch.int32)
    offsets = torch.cumsum(offsets, dim=-1)
    return offsets


def generate_doc_mask_mod(mask_mod, offsets):
    document_id = _offsets_to_doc_ids_tensor(offsets)

    def doc_mask_mod(b, h, q_idx, kv_idx):
        same_doc = document_id[q_idx] == document_id[kv_idx]
        q_logical = q_idx - offsets[document_id[q_idx]]
        kv_logical = kv_idx - offsets[document_id[kv_idx]]
        inner_mask = mask_mod(b, h, q_logical, kv_logical)
        return same_doc & inner_mask

    return doc_mask_mod


class FlexSelfAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def split(self, x):
        B, S, _ = x.shape
        return x.view(B, S, self.n_heads, self.head_dim).transpose(1, 2)

    def forward(self, x, score_mod, block_mask):
        q, k, v = self.split(self.wq(x)), self.split(self.wk(x)), self.split(self.wv(x))
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
        B, H, S, D = out.shape
        return self.wo(out.transpose(1, 2).reshape(B, S, H * D))


def reference_document(attn, x_doc, window):
    # one document alone, no packing: explicit double loop over (query, key)
    H, D = attn.n_heads, attn.head_dim
    q, k, v = attn.split(attn.wq(x_doc)), attn.split(attn.wk(x_doc)), attn.split(attn.wv(x_doc))
    L = x_doc.shape[1]
    out = torch.zeros(1, H, L, D)
    for h in range(H):
        slope = 2.0 ** (-((h + 1) * 8.0 / H))
        for i in range(L):
            scores, values = [], []
            for j in range(L):
                if j > i or i - j > window:
                    continue
                s = (q[0, h, i] @ k[0, h, j]) / D ** 0.5 + (j - i) * slope
                scores.append(s)
                values.append(v[0, h, j])
            p = torch.softmax(torch.stack(scores), dim=0)
            out[0, h, i] = (p[:, None] * torch.stack(values)).sum(0)
    return attn.wo(out.transpose(1, 2).reshape(1, L, H * D))


def main():
    dim, H, window = 32, 4, 3
    lengths = [5, 9, 6]
    S = sum(lengths)
    device = "cpu"

    attn = FlexSelfAttention(dim, H).eval()
    docs = [torch.randn(1, n, dim) for n in lengths]
    packed = torch.cat(docs, dim=1)  # (1, S, dim)

    offsets = length_to_offsets(lengths, device)
    doc_sliding = generate_doc_mask_mod(generate_sliding_window(window), offsets)
    block_mask = create_block_mask(doc_sliding, B=None, H=None, Q_LEN=S, KV_LEN=S, device=device)
    alibi = generate_alibi_bias(H)

    with torch.no_grad():
        out = attn(packed, score_mod=alibi, block_mask=block_mask)
        start = 0
        for n, x_doc in zip(lengths, docs):
            ref = reference_document(attn, x_doc, window)
            got = out[:, start:start + n]
            err = (got - ref).abs().max().item()
            assert torch.allclose(got, ref, atol=1e-5), (start, n, err)
            start += n
    print("packed flex (doc x sliding window, ALiBi) matches per-document double loop on all", S, "tokens")


if __name__ == "__main__":
    main()
