"""Correct program: transformers' FlexAttention integration on a packed + padded batch, Gemma2-style.

Ported (shrunk) from huggingface/transformers @2ccc6cae21faaf11631efa5fb9054687ae5dc931
src/transformers/integrations/flex_attention.py:
  * make_flex_block_causal_mask(attention_mask_2d, attention_chunk_size, query_length, key_length,
    offsets, is_causal): the 2D mask carries document ids (1, 2, 3, ... for packed documents, 0 for
    right padding); it is padded up to a multiple of 128 (flex_default_block_size) before the
    mask_mods index it; causal_mask_mod = causal & (doc[q] == doc[kv]) & (mask[q] > 0),
    default_mask_mod (is_causal=False) = (doc[q] == doc[kv]) & (mask[kv] > 0); offsets shift q/kv.
  * flex_attention_forward(module, q, k, v, attention_mask, scaling, softcap): score_mod applies
    Gemma2's logit soft-capping softcap * tanh(score / softcap); enable_gqa when the head count is
    a power of two; return_lse is False on CPU.

Sequence lengths here (45 tokens) are not multiples of 128.  Position ids restart at every packed
document (as a packing collator emits them).  Rows of right padding see nothing at all: FlexAttention
returns 0 for a fully masked row, which is what the upstream code relies on (those rows are never
read).  Stand-ins: flex_attention is called eagerly instead of through torch.compile, and
create_block_mask runs with _compile=False (the branch transformers takes on older torch); both give
the same values.

Reference: every document run alone (no packing, no padding) through plain eager attention with
the same soft-capping and its own causal (or full) mask.
"""
import warnings

import torch
from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE as flex_default_block_size
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

warnings.filterwarnings("ignore")
torch.manual_seed(0)
DT = torch.float64


# ---- transformers/integrations/flex_attention.py (ported) -------------------------------------
def make_flex_block_causal_mask(attention_mask_2d, attention_chunk_size=None, query_length=None,
                                key_length=None, offsets=None, is_causal=True):
    batch_size, total_seq_len = attention_mask_2d.shape
    if not key_length:
        key_length = total_seq_len
    if not query_length:
        query_length = total_seq_len
    # older torch (2.5.x) cannot handle sequences not in multiples of 128 (default block size)
    pad_len = ((key_length // flex_default_block_size) + 1) * flex_default_block_size
    attention_mask_2d = torch.nn.functional.pad(attention_mask_2d, value=0, pad=(0, pad_len - key_length))
    device = attention_mask_2d.device
    document_ids = attention_mask_2d.clone()

    if attention_chunk_size is not None:
        chunk_idxs = (document_ids.clone().fill_(1).cumsum(-1) - 1) // (attention_chunk_size)

    def causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        causal_mask = q_idx >= kv_idx  # not valid when decoding
        document_mask = document_ids[batch_idx, q_idx] == document_ids[batch_idx, kv_idx]
        padding_mask = attention_mask_2d[batch_idx, q_idx] > 0
        final_mask = causal_mask & padding_mask & document_mask
        return final_mask

    def chunk_causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        chunk_mask = chunk_idxs[batch_idx, q_idx] == chunk_idxs[batch_idx, kv_idx]
        causal_doc_mask = causal_mask_mod(batch_idx, head_idx, q_idx, kv_idx)
        return chunk_mask & causal_doc_mask

    def default_mask_mod(batch_idx, head_idx, q_idx, kv_idx):
        document_mask = document_ids[batch_idx, q_idx] == document_ids[batch_idx, kv_idx]
        # kv indexing is crucial in order to work correctly
        padding_mask = attention_mask_2d[batch_idx, kv_idx] > 0
        final_mask = padding_mask & document_mask
        return final_mask

    if not is_causal:
        mask_mod_maybe_combined = default_mask_mod
    else:
        mask_mod_maybe_combined = causal_mask_mod if attention_chunk_size is None else chunk_causal_mask_mod

    if offsets is not None:
        q_offset = offsets[0].to(device)
        kv_offset = offsets[1].to(device)

        def mask_mod(batch_idx, head_idx, q_idx, kv_idx):
            offset_q = q_idx + q_offset
            offset_kv = kv_idx + kv_offset
            return mask_mod_maybe_combined(batch_idx, head_idx, offset_q, offset_kv)
    else:
        mask_mod = mask_mod_maybe_combined

    return create_block_mask(
        mask_mod=mask_mod,
        B=batch_size,
        H=None,
        Q_LEN=query_length,
        KV_LEN=key_length,
        device=device,
        _compile=False,  # stand-in: upstream compiles on torch > 2.5.1; same mask
    )


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def flex_attention_forward(module, query, key, value, attention_mask, scaling=None, softcap=None, **kwargs):
    block_mask = None
    score_mask = None
    if isinstance(attention_mask, BlockMask):
        block_mask = attention_mask
    else:
        score_mask = attention_mask
    if score_mask is not None:
        score_mask = score_mask[:, :, :, : key.shape[-2]]

    def score_mod(score, batch_idx, head_idx, q_idx, kv_idx):
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        if score_mask is not None:
            score = score + score_mask[batch_idx][0][q_idx][kv_idx]
        return score

    enable_gqa = True
    num_local_query_heads = query.shape[1]
    if (num_local_query_heads & (num_local_query_heads - 1)) != 0:
        key = repeat_kv(key, query.shape[1] // key.shape[1])
        value = repeat_kv(value, query.shape[1] // value.shape[1])
        enable_gqa = False

    return_lse = query.device.type != "cpu"
    out = flex_attention(query, key, value, score_mod=score_mod, block_mask=block_mask,
                         enable_gqa=enable_gqa, scale=scaling, return_lse=return_lse)
    if return_lse:
        out, _ = out
    return out.transpose(1, 2).contiguous(), None


# ---- a tiny Gemma2-like attention layer (q/k/v projections + RoPE + GQA) -----------------------
HIDDEN, N_HEADS, N_KV, HEAD_DIM = 16, 4, 2, 8
QUERY_PRE_ATTN_SCALAR = 8
SOFTCAP = 5.0  # Gemma2 uses attn_logit_softcapping=50.0; smaller here so the cap bites at tiny size
SCALING = QUERY_PRE_ATTN_SCALAR ** -0.5

Wq = torch.randn(HIDDEN, N_HEADS * HEAD_DIM, dtype=DT) * 0.9
Wk = torch.randn(HIDDEN, N_KV * HEAD_DIM, dtype=DT) * 0.9
Wv = torch.randn(HIDDEN, N_KV * HEAD_DIM, dtype=DT)


def rope(x, pos):  # x (B, H, L, D), pos (B, L); rotate_half convention as in Gemma/Llama
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2, dtype=DT) / HEAD_DIM))
    f = pos[..., None].to(DT) * inv
    emb = torch.cat([f, f], -1)[:, None]
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * emb.cos() + torch.cat([-x2, x1], -1) * emb.sin()


def project(h, pos):
    B, L, _ = h.shape
    q = (h @ Wq).view(B, L, N_HEADS, HEAD_DIM).transpose(1, 2)
    k = (h @ Wk).view(B, L, N_KV, HEAD_DIM).transpose(1, 2)
    v = (h @ Wv).view(B, L, N_KV, HEAD_DIM).transpose(1, 2)
    return rope(q, pos), rope(k, pos), v


def eager_reference(h, causal, softcap=SOFTCAP):
    """One document alone: (1, n, HIDDEN); positions 0..n-1; plain softmax attention."""
    n = h.shape[1]
    q, k, v = project(h, torch.arange(n)[None])
    k, v = repeat_kv(k, N_HEADS // N_KV), repeat_kv(v, N_HEADS // N_KV)
    s = q @ k.transpose(-1, -2) * SCALING
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if causal:
        s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2)[0]  # (n, H, D)


# ---- packed batch: row 0 = docs of 13 and 20 tokens + 12 right pads; row 1 = 9 + 17 + 19 ----
L = 45
doc_lens = [[13, 20], [9, 17, 19]]
attention_mask_2d = torch.zeros(2, L, dtype=torch.long)
position_ids = torch.zeros(2, L, dtype=torch.long)
for b, lens in enumerate(doc_lens):
    start = 0
    for d, n in enumerate(lens):
        attention_mask_2d[b, start:start + n] = d + 1
        position_ids[b, start:start + n] = torch.arange(n)
        start += n
hidden = torch.randn(2, L, HIDDEN, dtype=DT)
q, k, v = project(hidden, position_ids)

worst = 0.0
for is_causal in (True, False):
    block_mask = make_flex_block_causal_mask(attention_mask_2d, is_causal=is_causal)
    out, _ = flex_attention_forward(None, q, k, v, block_mask, scaling=SCALING, softcap=SOFTCAP)
    for b, lens in enumerate(doc_lens):
        start = 0
        for n in lens:
            ref = eager_reference(hidden[b:b + 1, start:start + n], causal=is_causal)
            worst = max(worst, (out[b, start:start + n] - ref).abs().max().item())
            start += n
        if start < L:  # right-padding rows: fully masked on purpose, flex gives exactly 0
            assert out[b, start:].abs().max().item() == 0.0
    print(f"is_causal={is_causal}: packed flex vs per-document eager, running max diff {worst:.2e}")

# the offsets path: the last 7 queries of each row against all 45 keys (as a cached step would)
Q_NEW = 7
block_mask_off = make_flex_block_causal_mask(attention_mask_2d, query_length=Q_NEW, key_length=L,
                                             offsets=(torch.tensor(L - Q_NEW), torch.tensor(0)))
out_tail, _ = flex_attention_forward(None, q[:, :, L - Q_NEW:], k, v, block_mask_off,
                                     scaling=SCALING, softcap=SOFTCAP)
full_mask = make_flex_block_causal_mask(attention_mask_2d)
out_full, _ = flex_attention_forward(None, q, k, v, full_mask, scaling=SCALING, softcap=SOFTCAP)
d_off = (out_tail - out_full[:, L - Q_NEW:]).abs().max().item()
print(f"offset block mask (q_offset={L - Q_NEW}) vs rows of the full pass: max diff {d_off:.2e}")
worst = max(worst, d_off)

# the soft-cap really is applied: without it the per-document reference differs
no_cap = eager_reference(hidden[1:2, 9:26], causal=True, softcap=None)
cap_gap = (out_full[1, 9:26] - no_cap).abs().max().item()
print(f"(sanity) gap to an uncapped reference: {cap_gap:.2e}")
assert cap_gap > 1e-3

ok = worst < 1e-10
print("MATCH" if ok else "MISMATCH", f"max diff {worst:.2e}")
assert ok
