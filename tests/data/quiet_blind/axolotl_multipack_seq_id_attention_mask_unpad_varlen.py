"""axolotl sample packing: the collator's attention_mask holds a *sequence id* per token (1, 1, 2, 2,
2, 3, ..., 0 for padding) instead of 0/1, and the flash-attn patch turns it into cu_seqlens.

Follows axolotl-ai-cloud/axolotl src/axolotl/utils/collators/batching.py
(V2BatchSamplerDataCollatorForSeq2Seq: `attention_mask` entries are `i + 1` for the i-th packed sample,
position_ids restart per sample) and src/axolotl/monkeypatch/utils.py (`get_max_seqlen_in_batch`,
`get_unpad_data` -> indices, cu_seqlens, max_seqlen_in_batch), which replaces transformers'
`_get_unpad_data` so flash_attn_varlen_func attends within each sample.  On CPU the varlen call is
done the way flash-attn's reference does it: causal SDPA per cu_seqlens segment.

Mask meant: causal within each packed sample (same id, key position <= query position); padding
(id 0) is removed before attention and its output rows are zeros, later ignored by labels = -100.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


@torch.jit.script
def get_max_seqlen_in_batch(attention_mask: torch.Tensor) -> torch.Tensor:
    max_num = int(torch.max(attention_mask).item())
    batch_size, _ = attention_mask.shape
    counts = torch.zeros((batch_size, max_num), dtype=torch.int32)
    for i in range(1, max_num + 1):
        mask = attention_mask == i
        counts[:, i - 1] = torch.sum(mask, dim=-1).to(dtype=torch.int32)
    result = counts.flatten()
    nonzero_indices = torch.nonzero(result).squeeze(-1)
    return result[nonzero_indices]


def get_unpad_data(attention_mask: torch.Tensor):
    seqlens_in_batch = get_max_seqlen_in_batch(attention_mask)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def collate_packed(features, pad_token_id=0):
    """V2BatchSamplerDataCollatorForSeq2Seq: concatenate each bin's samples, ids i+1, pad to longest."""
    rows = []
    for bin_ in features:
        input_ids, labels, attn, pos = [], [], [], []
        for i, sample in enumerate(bin_):
            input_ids += sample
            labels += sample
            attn += [i + 1] * len(sample)
            pos += list(range(len(sample)))
        rows.append((input_ids, labels, attn, pos))
    longest = max(len(r[0]) for r in rows)
    out = {k: [] for k in ("input_ids", "labels", "attention_mask", "position_ids")}
    for input_ids, labels, attn, pos in rows:
        pad = longest - len(input_ids)
        out["input_ids"].append(input_ids + [pad_token_id] * pad)
        out["labels"].append(labels + [-100] * pad)
        out["attention_mask"].append(attn + [0] * pad)
        out["position_ids"].append(pos + [0] * pad)
    return {k: torch.tensor(v) for k, v in out.items()}


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    """CPU stand-in for flash_attn_varlen_func: q, k, v are (total_tokens, nheads, headdim)."""
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()):
        qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
        out[start:end] = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1)
    return out


class LlamaLikeFlashAttention2(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, max_position_embeddings=64):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.pos = nn.Embedding(max_position_embeddings, self.head_dim)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, q_len, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(bsz, q_len, 3, self.num_heads, self.head_dim).unbind(2)
        pe = self.pos(position_ids)[:, :, None]
        q, k = q + pe, k + pe
        indices, cu_seqlens, max_seqlen = get_unpad_data(attention_mask)
        q_u, k_u, v_u = (t.reshape(bsz * q_len, self.num_heads, self.head_dim)[indices] for t in (q, k, v))
        attn_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
        attn = torch.zeros(bsz * q_len, self.num_heads, self.head_dim)
        attn[indices] = attn_u  # pad_input: padded positions come back as zeros
        return self.o_proj(attn.view(bsz, q_len, -1))


if __name__ == "__main__":
    torch.manual_seed(0)
    bins = [
        [[4, 8, 15, 16], [23, 42, 7], [9, 9, 1, 2, 3, 5]],
        [[31, 41, 59, 26, 53, 58, 9, 7, 9, 3, 2, 3, 8]],
        [[12]],  # a single one-token sample: the rest of the row is padding
    ]
    batch = collate_packed(bins)
    emb = nn.Embedding(64, 32)
    attn = LlamaLikeFlashAttention2()
    head = nn.Linear(32, 64)
    with torch.no_grad():
        h = emb(batch["input_ids"])
        h = h + attn(h, batch["attention_mask"], batch["position_ids"])
        logits = head(h)
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        # the second sample of row 0 (tokens 4..6) alone must match
        h2 = emb(batch["input_ids"][:1, 4:7])
        alone = h2 + attn(h2, torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None])
    assert torch.allclose(h[0, 4:7], alone[0], atol=1e-5)
    print(f"packed loss {loss.item():.4f}")
