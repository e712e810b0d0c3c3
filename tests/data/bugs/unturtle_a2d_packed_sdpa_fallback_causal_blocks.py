# nishide-dev/unturtle#44 (closes #39; generalised in #54): a packed batch reaching the A2D (diffusion LM) SDPA
# fallback without the collator's block_attention_mask fell through to run_attention's causal packed-block mask.
import sys
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn.functional import scaled_dot_product_attention

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
SDPA = "sdpa"


def build_sdpa_packed_attention_mask(seq_info, *, dtype, device, sliding_window=None):
    seq_lengths, _, _ = seq_info
    total = int(seq_lengths.sum().item())
    mask = torch.full((total, total), float("-inf"), dtype=dtype, device=device)
    offset = 0
    for length in seq_lengths.tolist():
        block = torch.zeros((length, length), dtype=dtype, device=device)
        upper = torch.triu(torch.ones((length, length), device=device), diagonal=1).bool()
        block = block.masked_fill(upper, float("-inf"))
        mask[offset : offset + length, offset : offset + length] = block
        offset += length
    return mask


def _build_bidirectional_packed_sdpa_mask(seq_lengths, total_len, device):
    """Bidirectional block-diagonal bool mask [1, 1, L, L] from per-sample lengths (B == 1)."""
    doc_ids = torch.repeat_interleave(torch.arange(len(seq_lengths), device=device), seq_lengths)
    keep = doc_ids[:, None] == doc_ids[None, :]
    assert keep.shape[-1] == total_len
    return keep[None, None]


@dataclass
class AttentionConfig:
    backend: str
    n_kv_heads: int
    n_groups: int
    sdpa_kwargs: Optional[dict] = None


@dataclass
class AttentionContext:
    bsz: int
    q_len: int
    kv_seq_len: int
    n_heads: int
    head_dim: int
    seq_info: Optional[Tuple[torch.Tensor, torch.Tensor, int]]
    attention_mask: Optional[torch.Tensor]
    causal_mask: Optional[Any]
    sliding_window: Optional[int] = None


def run_attention(*, config, context, Q, K, V):
    local_mask = context.attention_mask
    is_causal_local = False
    if context.seq_info is not None and local_mask is None:
        local_mask = build_sdpa_packed_attention_mask(
            context.seq_info, dtype=Q.dtype, device=Q.device, sliding_window=context.sliding_window
        )
    else:
        is_causal_local = local_mask is None and Q.shape[-2] == K.shape[-2]
    kwargs = dict(config.sdpa_kwargs or {})
    kwargs.setdefault("attn_mask", local_mask)
    kwargs.setdefault("is_causal", is_causal_local)
    out = scaled_dot_product_attention(Q, K, V, **kwargs)
    return out.transpose(1, 2)


class A2DLlamaAttention(nn.Module):
    """LlamaAttention with the A2D fast forward: causal=False everywhere."""

    def __init__(self, hidden=32, n_heads=4):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, hidden // n_heads
        self.q_proj = nn.Linear(hidden, hidden, bias=False)
        self.k_proj = nn.Linear(hidden, hidden, bias=False)
        self.v_proj = nn.Linear(hidden, hidden, bias=False)
        self.o_proj = nn.Linear(hidden, hidden, bias=False)

    def forward(self, hidden_states, attention_mask=None, seq_info=None, **kwargs):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, self.n_heads, self.head_dim)
        Q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        K = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        V = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        if seq_info is not None:
            # SDPA packed path: use block_attention_mask from the collator when present.
            # Do NOT fall back to build_sdpa_packed_attention_mask() -- it builds causal blocks.
            effective_mask = kwargs.get("block_attention_mask", None)
            if FIXED and effective_mask is None:
                effective_mask = _build_bidirectional_packed_sdpa_mask(seq_info[0], q_len, hidden_states.device)
        else:
            effective_mask = attention_mask
        config = AttentionConfig(backend=SDPA, n_kv_heads=self.n_heads, n_groups=1,
                                 sdpa_kwargs={"is_causal": False})
        context = AttentionContext(bsz=bsz, q_len=q_len, kv_seq_len=K.shape[-2], n_heads=self.n_heads,
                                   head_dim=self.head_dim, seq_info=seq_info, attention_mask=effective_mask,
                                   causal_mask=None)
        A = run_attention(config=config, context=context, Q=Q, K=K, V=V)
        return self.o_proj(A.reshape(bsz, q_len, -1))


class A2DLlamaModel(nn.Module):
    def __init__(self, vocab=50, hidden=32, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.embed_positions = nn.Embedding(32, hidden)
        self.layers = nn.ModuleList([A2DLlamaAttention(hidden) for _ in range(layers)])
        self.norms = nn.ModuleList([nn.LayerNorm(hidden) for _ in range(layers)])
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, position_ids, seq_info=None):
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for attn, norm in zip(self.layers, self.norms):
            h = h + attn(norm(h), seq_info=seq_info)
        return self.lm_head(h)


MASK_ID = 49
model = A2DLlamaModel().eval()
docs = [torch.randint(0, 48, (7,)), torch.randint(0, 48, (5,))]
for d in docs:  # masked-diffusion corruption: some tokens replaced by [MASK]
    d[torch.rand(d.shape) < 0.4] = MASK_ID
seq_lengths = torch.tensor([len(d) for d in docs])
cu_seqlens = torch.nn.functional.pad(seq_lengths.cumsum(0), (1, 0)).int()
seq_info = (seq_lengths, cu_seqlens, int(seq_lengths.max()))
packed = torch.cat(docs).unsqueeze(0)
position_ids = torch.cat([torch.arange(len(d)) for d in docs]).unsqueeze(0)

with torch.no_grad():
    packed_logits = model(packed, position_ids, seq_info=seq_info)
    ref = torch.cat([model(d.unsqueeze(0), torch.arange(len(d)).unsqueeze(0))[0] for d in docs])
print(f"fixed={FIXED} packed vs per-document bidirectional, max |logit diff| = "
      f"{(packed_logits[0] - ref).abs().max().item():.4f}")
