"""transformers GPT-2: FlashAttention-2 generation with left padding runs the prompt non-causally.

Citation: huggingface/transformers PR #41966 ("Fix GPT-2 Flash Attention 2 generation with
left-padding", merged; description and review read): "the original code incorrectly disabled causal
masking when any attention mask was present". The GPT2Attention / `_flash_attention_forward` code below
is written from the transformers code of that period as known (names kept), simplified; the varlen
kernel is a torch reference (`flash_attn_varlen_func` -> per-sequence SDPA with a bottom-right causal mask).

Bug: `GPT2Attention.forward` sets `is_causal = attention_mask is None and query_states.shape[-2] > 1 and
not is_cross_attention`. With FlashAttention-2 the 2-D padding mask is only used to unpad the batch
(`cu_seqlens`), and causality comes from `causal=is_causal`; a left-padded batch always has a mask, so the
prompt pass runs with `causal=False` and every prompt token attends to later prompt tokens.

Fix: causality is a property of the module (`self.is_causal = not is_cross_attention`), passed to the
kernel whatever the padding mask is.

Reproduction: a 2-layer GPT-2-style model (`c_attn`, learned `wpe` with position_ids from the mask,
`attn_implementation = "flash_attention_2"` emulated), batch of two prompts left-padded to 6 (lengths 6
and 4), prefill then 3 cached greedy steps.
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
    """Torch reference of the varlen kernel: q/k/v are (total_tokens, heads, dim); causal is bottom-right."""
    out = torch.empty_like(q)
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        lq, lk = qe - qs, ke - ks
        mask = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq) if causal else None
        o = F.scaled_dot_product_attention(q[qs:qe].transpose(0, 1), k[ks:ke].transpose(0, 1),
                                           v[ks:ke].transpose(0, 1), attn_mask=mask)
        out[qs:qe] = o.transpose(0, 1)
    return out


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, int(seqlens_in_batch.max())


def _flash_attention_forward(query_states, key_states, value_states, attention_mask, query_length, is_causal):
    """(batch, seq, heads, dim) inputs; the 2-D padding mask only drives unpadding."""
    batch_size, kv_seq_len = key_states.shape[:2]
    indices_k, cu_seqlens_k, max_seqlen_k = _get_unpad_data(attention_mask)
    k = key_states.reshape(batch_size * kv_seq_len, *key_states.shape[2:])[indices_k]
    v = value_states.reshape(batch_size * kv_seq_len, *value_states.shape[2:])[indices_k]
    if query_length == kv_seq_len:
        q = query_states.reshape(batch_size * kv_seq_len, *query_states.shape[2:])[indices_k]
        indices_q, cu_seqlens_q, max_seqlen_q = indices_k, cu_seqlens_k, max_seqlen_k
    else:  # decode: one query per sequence
        q = query_states.squeeze(1)
        cu_seqlens_q = torch.arange(batch_size + 1, dtype=torch.int32)
        indices_q, max_seqlen_q = cu_seqlens_q[:-1], 1
    out_unpad = flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                       causal=is_causal)
    out = torch.zeros(batch_size * query_length, *out_unpad.shape[1:])
    out[indices_q] = out_unpad
    return out.view(batch_size, query_length, *out_unpad.shape[1:])


class GPT2Attention(nn.Module):
    def __init__(self, config, is_cross_attention=False):
        super().__init__()
        self.num_heads, self.head_dim = config.n_head, config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.is_cross_attention = is_cross_attention
        self.is_causal = not is_cross_attention

    def forward(self, hidden_states, layer_past=None, attention_mask=None):
        B, T, C = hidden_states.shape
        query_states, key_states, value_states = self.c_attn(hidden_states).split(C, dim=2)
        shape = (B, T, self.num_heads, self.head_dim)
        query_states, key_states, value_states = (x.view(shape) for x in (query_states, key_states, value_states))
        if layer_past is not None:
            key_states = torch.cat([layer_past[0], key_states], dim=1)
            value_states = torch.cat([layer_past[1], value_states], dim=1)
        present = (key_states, value_states)
        if FIXED:
            is_causal = self.is_causal
        else:
            is_causal = attention_mask is None and query_states.shape[1] > 1 and not self.is_cross_attention
        attn_output = _flash_attention_forward(query_states, key_states, value_states, attention_mask,
                                               query_length=T, is_causal=is_causal)
        return self.c_proj(attn_output.reshape(B, T, C)), present


class GPT2LMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.h = nn.ModuleList([GPT2Attention(config) for _ in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        hidden_states = self.wte(input_ids) + self.wpe(position_ids)
        presents = []
        for i, block in enumerate(self.h):
            out, present = block(F.layer_norm(hidden_states, hidden_states.shape[-1:]),
                                 past_key_values[i] if past_key_values is not None else None, attention_mask)
            hidden_states = hidden_states + out
            presents.append(present)
        return self.lm_head(hidden_states), presents


def main():
    torch.manual_seed(0)
    config = SimpleNamespace(vocab_size=50, n_embd=32, n_head=4, n_layer=2, n_positions=32,
                             _attn_implementation="flash_attention_2")
    model = GPT2LMHeadModel(config).eval()
    pad = 0
    input_ids = torch.tensor([[7, 3, 19, 4, 33, 12], [pad, pad, 25, 8, 41, 16]])
    attention_mask = (input_ids != pad).long()
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    generated = []
    with torch.no_grad():
        logits, past = model(input_ids, attention_mask, position_ids)
        for _ in range(3):
            nxt = logits[:, -1:].argmax(-1)
            generated.append(nxt[:, 0].tolist())
            attention_mask = torch.cat([attention_mask, torch.ones_like(nxt)], dim=1)
            position_ids = position_ids[:, -1:] + 1
            logits, past = model(nxt, attention_mask, position_ids, past)
    print("generated per step:", generated)


if __name__ == "__main__":
    main()
