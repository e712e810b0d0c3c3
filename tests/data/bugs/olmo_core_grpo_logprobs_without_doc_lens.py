"""open-instruct GRPO on an OLMo-core model: packed rollouts recomputed without doc_lens.

Citation: allenai/open-instruct#1670 "Pass doc_lens to OLMo-core in forward_for_logprobs"
(merged 2026-05). Before the fix, ``grpo_utils.forward_for_logprobs`` called
``model(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids)``.
open-instruct packs several query+response rollouts into one row; ``attention_mask`` holds the
1-based index of the rollout each token belongs to (0 = padding). HF models turn that into
intra-document attention, but OLMo-core's ``Transformer.forward`` ignores ``attention_mask`` and
``position_ids`` and only does intra-document attention when it is given ``doc_lens`` /
``max_doc_lens`` (its flash varlen path). So every packed rollout attended to the rollouts packed
before it, and the recomputed logprobs were wrong.

Fix: a ``pass_olmo_core_doc_lens`` switch; the helper derives ``doc_lens`` / ``max_doc_lens`` from
the attention mask with ``torch.unique_consecutive`` (``olmo_core_utils.doc_lens_from_attention_mask``)
and passes them to the model, with ``attention_mask=None``.

This program: a small OLMo-core-style Transformer (block -> attention that uses a flash varlen
call when ``doc_lens`` is given, else a causal flash call; both rendered on CPU with
``F.scaled_dot_product_attention``), and the GRPO helper as written before/after the fix.
Two packed rows of rollouts; the buggy run lets the second rollout of each row see the first.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TransformerConfig:
    vocab_size: int = 64
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2


def flash_attn_func(q, k, v, causal=True):
    # CPU rendering of flash_attn.flash_attn_func: q, k, v are (B, T, H, D).
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return out.transpose(1, 2)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True):
    # CPU rendering of flash_attn.flash_attn_varlen_func: q, k, v are (total_tokens, H, D) and
    # every document [cu[i], cu[i+1]) is attended on its own.
    total = q.shape[0]
    doc = torch.searchsorted(cu_seqlens_q[1:], torch.arange(total), right=True)
    pos = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=allowed
    )
    return out[0].transpose(0, 1)


def get_cumulative_document_lengths(doc_lens: torch.Tensor) -> torch.Tensor:
    doc_lens = doc_lens.flatten()
    return torch.cat([torch.zeros(1, dtype=torch.int32), torch.cumsum(doc_lens[doc_lens != 0], 0, dtype=torch.int32)])


class Attention(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.w_q = nn.Linear(d_model, d_model, bias=False)
        self.w_k = nn.Linear(d_model, d_model, bias=False)
        self.w_v = nn.Linear(d_model, d_model, bias=False)
        self.w_out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x, max_doc_len=None, cu_doc_lens=None):
        B, T, _ = x.shape
        q = self.w_q(x).view(B, T, self.n_heads, self.head_dim)
        k = self.w_k(x).view(B, T, self.n_heads, self.head_dim)
        v = self.w_v(x).view(B, T, self.n_heads, self.head_dim)
        if max_doc_len is not None and cu_doc_lens is not None:
            att = flash_attn_varlen_func(
                q.view(B * T, self.n_heads, self.head_dim),
                k.view(B * T, self.n_heads, self.head_dim),
                v.view(B * T, self.n_heads, self.head_dim),
                cu_doc_lens,
                cu_doc_lens,
                max_doc_len,
                max_doc_len,
                causal=True,
            ).view(B, T, self.n_heads, self.head_dim)
        else:
            att = flash_attn_func(q, k, v, causal=True)
        return self.w_out(att.reshape(B, T, -1))


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attention_norm = nn.LayerNorm(cfg.d_model)
        self.attention = Attention(cfg.d_model, cfg.n_heads)
        self.feed_forward_norm = nn.LayerNorm(cfg.d_model)
        self.feed_forward = nn.Sequential(nn.Linear(cfg.d_model, 4 * cfg.d_model), nn.GELU(), nn.Linear(4 * cfg.d_model, cfg.d_model))

    def forward(self, x, **kwargs):
        h = x + self.attention(self.attention_norm(x), **kwargs)
        return h + self.feed_forward(self.feed_forward_norm(h))


class Transformer(nn.Module):
    """OLMo-core style: only ``doc_lens`` / ``max_doc_lens`` select intra-document attention."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, input_ids, *, doc_lens=None, max_doc_lens=None, **kwargs):
        # Like OLMo-core, any other keyword (attention_mask, position_ids) is accepted and unused.
        block_kwargs = {}
        if doc_lens is not None and max_doc_lens is not None:
            block_kwargs["max_doc_len"] = max(max_doc_lens)
            block_kwargs["cu_doc_lens"] = get_cumulative_document_lengths(doc_lens)
        h = self.embeddings(input_ids)
        for block in self.blocks:
            h = block(h, **block_kwargs)
        return self.lm_head(h)


def doc_lens_from_attention_mask(attention_mask: torch.Tensor):
    B = attention_mask.size(0)
    rows = []
    for i in range(B):
        vals, counts = torch.unique_consecutive(attention_mask[i], return_counts=True)
        rows.append(counts[vals > 0])
    max_docs = max((t.numel() for t in rows), default=0)
    doc_lens = torch.zeros((B, max_docs), dtype=torch.int32)
    for i, t in enumerate(rows):
        doc_lens[i, : t.numel()] = t.to(torch.int32)
    max_doc_lens = [int(t.max().item()) if t.numel() else 0 for t in rows]
    return doc_lens, max_doc_lens


def log_softmax_and_gather(logits, labels):
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def forward_for_logprobs(model, query_responses, attention_mask, position_ids, pad_token_id, temperature,
                         pass_olmo_core_doc_lens=False):
    """Forward pass to compute log probabilities."""
    extra_kwargs = {}
    if pass_olmo_core_doc_lens:
        doc_lens, max_doc_lens = doc_lens_from_attention_mask(attention_mask)
        extra_kwargs = {"doc_lens": doc_lens, "max_doc_lens": max_doc_lens}
        attention_mask = None
    output = model(input_ids=query_responses, attention_mask=attention_mask, position_ids=position_ids, **extra_kwargs)
    logits = getattr(output, "logits", output)
    logits = logits / temperature
    logits = logits[:, :-1]
    labels = query_responses[:, 1:].clone()
    labels[labels == pad_token_id] = 0
    return log_softmax_and_gather(logits, labels)


def main():
    torch.manual_seed(0)
    model = Transformer(TransformerConfig()).eval()
    # Two packed rows; attention_masks carry the rollout index of each token.
    attention_masks = torch.tensor([[1, 1, 1, 2, 2, 2, 2, 2], [1, 1, 1, 1, 2, 2, 3, 3]])
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4], [0, 1, 2, 3, 0, 1, 0, 1]])
    query_responses = torch.randint(1, 64, attention_masks.shape)
    with torch.no_grad():
        logprobs = forward_for_logprobs(model, query_responses, attention_masks, position_ids, pad_token_id=0,
                                        temperature=1.0,
                                        # The fix: the OLMo-core train module asks for doc_lens.
                                        pass_olmo_core_doc_lens=FIXED)
    print("new_logprobs row0:", [round(x, 3) for x in logprobs[0].tolist()])


if __name__ == "__main__":
    main()
