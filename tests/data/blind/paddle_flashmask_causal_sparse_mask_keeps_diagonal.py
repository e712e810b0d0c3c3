"""PaddlePaddle FlashMask (column-wise sparse mask in flash-attention): the diagonal was never masked.

Citation: PaddlePaddle/flash-attention#48 (commit c9515ed, "fix bug in apply_sparse_mask at diagonal"),
csrc/flash_attn/src/softmax.h ``apply_sparse_mask_causal`` / ``apply_sparse_mask_causal_withend``.

FlashMask describes a sparse causal mask by columns: for every key column ``col`` the kernel reads
``flashmask_downstart[col]`` (LTS, the first row from which that key is masked) and, with two values,
``flashmask_downend[col]`` (LTE, the row where the masked span ends). Inside each score tile the kernel
masks ``col >= min(seqlen_k, row + 1)`` (causal) and otherwise masks ``row >= start_row`` (and
``row < end_row``) -- but the bug wrote the second test as ``col < col_idx_limit - 1``, so the element on
the diagonal (``col == row``) was skipped: a key whose masked span starts at its own row still
attended to itself.

The fix: ``else if (col_idx < col_idx_limit && row_idx >= start_row ...)``.

This program ports the forward kernel's tiling (kBlockM x kBlockN tiles, the causal n_block bound, the
per-element mask of softmax.h and the online softmax that writes zeros for a row with no key left) to
torch, and calls it the way ``paddle.nn.functional.flashmask_attention(query, key, value,
startend_row_indices, causal=True)`` is called: BSHD tensors and ``startend_row_indices`` of shape
``[batch, heads, seqlen_k, 1 or 2]`` (int32). The mask is FlashMask's random-eviction mask (each key is
evicted from the KV cache at some row at or after its own; a token evicted at its own row is never
cached, so no query sees it, itself included), used in a tiny two-layer decoder trained one step.
"""

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

kBlockM = 8
kBlockN = 8


# ---- csrc/flash_attn/src/softmax.h -----------------------------------------------------------------
def apply_sparse_mask_causal(tensor, flashmask_downstart, col_idx_offset, max_seqlen_k, row_idx_offset):
    # tensor: (kBlockM, kBlockN) scores of one tile; flashmask_downstart: (kBlockN,) for this tile's cols
    nrow, ncol = tensor.shape
    for i in range(nrow):
        row_idx = row_idx_offset + i
        col_idx_limit = min(max_seqlen_k, row_idx + 1)
        for j in range(ncol):
            col_idx = col_idx_offset + j
            start_row = int(flashmask_downstart[j])
            if col_idx >= col_idx_limit:
                tensor[i, j] = -math.inf
            elif FIXED and (col_idx < col_idx_limit and row_idx >= start_row):
                tensor[i, j] = -math.inf
            elif not FIXED and (col_idx < col_idx_limit - 1 and row_idx >= start_row):
                tensor[i, j] = -math.inf
    return tensor


def apply_sparse_mask_causal_withend(tensor, flashmask_downstart, flashmask_downend, col_idx_offset,
                                     max_seqlen_k, row_idx_offset):
    nrow, ncol = tensor.shape
    for i in range(nrow):
        row_idx = row_idx_offset + i
        col_idx_limit = min(max_seqlen_k, row_idx + 1)
        for j in range(ncol):
            col_idx = col_idx_offset + j
            start_row = int(flashmask_downstart[j])
            end_row = int(flashmask_downend[j])
            if col_idx >= col_idx_limit:
                tensor[i, j] = -math.inf
            elif FIXED and (col_idx < col_idx_limit and row_idx >= start_row and row_idx < end_row):
                tensor[i, j] = -math.inf
            elif not FIXED and (col_idx < col_idx_limit - 1 and row_idx >= start_row and row_idx < end_row):
                tensor[i, j] = -math.inf
    return tensor


# ---- csrc/flash_attn/src/flash_fwd_kernel.h (compute_attn_1rowblock), one (batch, head) ------------
def compute_attn_1rowblock(q, k, v, downstart, downend, m_block, softmax_scale):
    seqlen_q, seqlen_k = q.shape[0], k.shape[0]
    row0 = m_block * kBlockM
    rows = min(kBlockM, seqlen_q - row0)
    q_tile = q[row0:row0 + rows]
    acc_o = torch.zeros(rows, v.shape[-1])
    row_max = torch.full((rows,), -math.inf)
    row_sum = torch.zeros(rows)
    # causal: n_block_max = ceil((m_block + 1) * kBlockM / kBlockN)
    n_block_max = min(math.ceil(seqlen_k / kBlockN), math.ceil((m_block + 1) * kBlockM / kBlockN))
    for n_block in range(n_block_max):
        col0 = n_block * kBlockN
        cols = min(kBlockN, seqlen_k - col0)
        scores = (q_tile @ k[col0:col0 + cols].T) * softmax_scale
        sSparseMask = downstart[col0:col0 + cols]
        if downend is not None:
            sSparseMaskDownEnd = downend[col0:col0 + cols]
            scores = apply_sparse_mask_causal_withend(scores, sSparseMask, sSparseMaskDownEnd, col0, seqlen_k, row0)
        else:
            scores = apply_sparse_mask_causal(scores, sSparseMask, col0, seqlen_k, row0)
        # softmax_rescale_o
        new_max = torch.maximum(row_max, scores.max(dim=-1).values)
        max_scaled = torch.where(new_max == -math.inf, torch.zeros_like(new_max), new_max)
        p = torch.exp(scores - max_scaled[:, None])
        scale_old = torch.exp(row_max - max_scaled)
        row_sum = row_sum * scale_old + p.sum(-1)
        acc_o = acc_o * scale_old[:, None] + p @ v[col0:col0 + cols]
        row_max = new_max
    # normalize_softmax_lse: a row with no key left (sum == 0 or NaN) is written as zeros
    inv_sum = torch.where((row_sum == 0) | torch.isnan(row_sum), torch.ones_like(row_sum), 1.0 / row_sum)
    return acc_o * inv_sum[:, None]


def flash_attn_fwd_flashmask(q, k, v, startend_row_indices, softmax_scale):
    # q, k, v: (batch, seqlen, heads, head_dim); startend_row_indices: (batch, heads, seqlen_k, 1 or 2)
    b, s, h, _ = q.shape
    out = torch.zeros_like(q)
    has_end = startend_row_indices.shape[-1] == 2
    for bidb in range(b):
        for bidh in range(h):
            downstart = startend_row_indices[bidb, bidh, :, 0]
            downend = startend_row_indices[bidb, bidh, :, 1] if has_end else None
            for m_block in range(math.ceil(s / kBlockM)):
                row0 = m_block * kBlockM
                o = compute_attn_1rowblock(q[bidb, :, bidh], k[bidb, :, bidh], v[bidb, :, bidh],
                                           downstart, downend, m_block, softmax_scale)
                out[bidb, row0:row0 + o.shape[0], bidh] = o
    return out


# ---- paddle.nn.functional.flashmask_attention --------------------------------------------------------
def flashmask_attention(query, key, value, startend_row_indices=None, dropout=0.0, causal=False):
    assert causal, "this port covers the causal kernels (apply_sparse_mask_causal*)"
    assert startend_row_indices.dtype == torch.int32
    softmax_scale = 1.0 / math.sqrt(query.shape[-1])
    return flash_attn_fwd_flashmask(query, key, value, startend_row_indices, softmax_scale)


# ---- the random-eviction mask of FlashMask's mask gallery ------------------------------------------
def generate_random_eviction_mask(batch_size, seqlen, num_heads, generator):
    """Key ``j`` is evicted from the KV cache at row ``start_rows[j]`` (>= j); ``seqlen`` = never."""
    start_rows = torch.full((batch_size, num_heads, seqlen, 1), seqlen, dtype=torch.int32)
    for bz in range(batch_size):
        for hd in range(num_heads):
            for j in range(1, seqlen):
                draw = torch.rand((), generator=generator).item()
                if draw < 0.35:
                    # evicted at a random later step, possibly its own (never cached)
                    start_rows[bz, hd, j, 0] = int(torch.randint(j, seqlen, (), generator=generator))
    return start_rows


class Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 2
    num_hidden_layers = 2
    max_position_embeddings = 64


class FlashMaskAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, attn_mask_startend_row_indices):
        b, s, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(2)
        out = flashmask_attention(q, k, v, startend_row_indices=attn_mask_startend_row_indices, causal=True)
        return self.o_proj(out.reshape(b, s, -1))


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden_size)
        self.self_attn = FlashMaskAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
                                 nn.Linear(4 * config.hidden_size, config.hidden_size))

    def forward(self, x, attn_mask_startend_row_indices):
        x = x + self.self_attn(self.ln1(x), attn_mask_startend_row_indices)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attn_mask_startend_row_indices, labels=None):
        pos = torch.arange(input_ids.shape[1])
        h = self.embed_tokens(input_ids) + self.embed_positions(pos)[None]
        for layer in self.layers:
            h = layer(h, attn_mask_startend_row_indices)
        logits = self.lm_head(self.norm(h))
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return loss, logits


def main():
    torch.manual_seed(0)
    config = Config()
    model = TinyLM(config)
    gen = torch.Generator().manual_seed(3)
    batch_size, seqlen = 2, 20
    input_ids = torch.randint(0, config.vocab_size, (batch_size, seqlen), generator=gen)
    startend_row_indices = generate_random_eviction_mask(batch_size, seqlen, config.num_attention_heads, gen)
    print("startend_row_indices[0, 0, :, 0]:", startend_row_indices[0, 0, :, 0].tolist())

    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    loss, logits = model(input_ids, startend_row_indices, labels=input_ids)
    loss.backward()
    optim.step()
    print(f"train loss: {loss.item():.6f}")
    with torch.no_grad():
        _, logits = model(input_ids, startend_row_indices)
    print("next-token predictions (row 0):", logits[0].argmax(-1).tolist())
    print(f"logits[0, -1, :4]: {[round(x, 4) for x in logits[0, -1, :4].tolist()]}")


if __name__ == "__main__":
    main()
