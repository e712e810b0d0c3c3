# rasbt/LLMs-from-scratch#1013 ("Fix SWA", ch04/06_swa/gpt_with_kv_swa.py): MultiHeadAttentionWithSWA trims the KV cache
# to sliding_window_size BEFORE the current chunk attends, so in a multi-token (chunked) prefill the earliest queries of
# the chunk lose keys that are inside their window (or every key, giving NaN rows when the prompt exceeds the window).
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(123)


class MultiHeadAttentionWithSWA(nn.Module):
    def __init__(self, d_in, d_out, dropout, num_heads, qkv_bias=False, sliding_window_size=None):
        super().__init__()
        assert d_out % num_heads == 0, "d_out must be divisible by num_heads"
        self.d_out = d_out
        self.num_heads = num_heads
        self.head_dim = d_out // num_heads
        self.W_query = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_key = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.W_value = nn.Linear(d_in, d_out, bias=qkv_bias)
        self.out_proj = nn.Linear(d_out, d_out)
        self.dropout = nn.Dropout(dropout)
        self.sliding_window_size = sliding_window_size
        self.register_buffer("cache_k", None, persistent=False)
        self.register_buffer("cache_v", None, persistent=False)
        self.ptr_current_pos = 0

    def forward(self, x, use_cache=False):
        b, num_tokens, d_in = x.shape
        keys_new = self.W_key(x)
        values_new = self.W_value(x)
        queries = self.W_query(x)
        keys_new = keys_new.view(b, num_tokens, self.num_heads, self.head_dim)
        values_new = values_new.view(b, num_tokens, self.num_heads, self.head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim)

        if use_cache:
            if not FIXED:
                old_len = 0 if self.cache_k is None else self.cache_k.size(1)
                if self.cache_k is None:
                    self.cache_k, self.cache_v = keys_new, values_new
                else:
                    self.cache_k = torch.cat([self.cache_k, keys_new], dim=1)
                    self.cache_v = torch.cat([self.cache_v, values_new], dim=1)
                # Left-trim to sliding window if configured
                if self.sliding_window_size is not None:
                    if self.cache_k.size(1) > self.sliding_window_size:
                        self.cache_k = self.cache_k[:, -self.sliding_window_size:, :, :]
                        self.cache_v = self.cache_v[:, -self.sliding_window_size:, :, :]
                # Compute absolute start positions for mask
                total_len = old_len + num_tokens
                k_len_now = self.cache_k.size(1)
                dropped = max(0, total_len - k_len_now)
                k_start_pos_abs = (self.ptr_current_pos - old_len) + dropped
                q_start_pos_abs = self.ptr_current_pos
                keys, values = self.cache_k, self.cache_v
            else:
                old_cache_k, old_cache_v = self.cache_k, self.cache_v
                old_len = 0 if old_cache_k is None else old_cache_k.size(1)
                if old_cache_k is None:
                    combined_k, combined_v = keys_new, values_new
                else:
                    combined_k = torch.cat([old_cache_k, keys_new], dim=1)
                    combined_v = torch.cat([old_cache_v, values_new], dim=1)
                keys, values = combined_k, combined_v
                if self.sliding_window_size is not None:
                    attn_keep = min(keys.size(1), self.sliding_window_size + num_tokens - 1)
                    keys = keys[:, -attn_keep:, :, :]
                    values = values[:, -attn_keep:, :, :]
                    cache_keep = min(combined_k.size(1), self.sliding_window_size)
                    self.cache_k = combined_k[:, -cache_keep:, :, :]
                    self.cache_v = combined_v[:, -cache_keep:, :, :]
                else:
                    self.cache_k, self.cache_v = combined_k, combined_v
                dropped = combined_k.size(1) - keys.size(1)
                k_start_pos_abs = (self.ptr_current_pos - old_len) + dropped
                q_start_pos_abs = self.ptr_current_pos
        else:
            keys, values = keys_new, values_new

        keys = keys.transpose(1, 2)
        queries = queries.transpose(1, 2)
        values = values.transpose(1, 2)
        attn_scores = queries @ keys.transpose(2, 3)

        # causal + sliding-window mask
        num_tokens_Q = queries.shape[-2]
        num_tokens_K = keys.shape[-2]
        device = queries.device
        if use_cache:
            q_start = q_start_pos_abs
            k_start = k_start_pos_abs
        else:
            q_start = 0
            k_start = 0
        q_positions = torch.arange(q_start, q_start + num_tokens_Q, device=device, dtype=torch.long)
        k_positions = torch.arange(k_start, k_start + num_tokens_K, device=device, dtype=torch.long)
        W = num_tokens_K + 1 if self.sliding_window_size is None else int(self.sliding_window_size)
        diff = q_positions.unsqueeze(-1) - k_positions.unsqueeze(0)
        mask_bool = (diff < 0) | (diff >= W)
        if use_cache:
            self.ptr_current_pos += num_tokens_Q
        else:
            self.ptr_current_pos = 0

        attn_scores.masked_fill_(mask_bool, -torch.inf)
        attn_weights = torch.softmax(attn_scores / keys.shape[-1]**0.5, dim=-1)
        attn_weights = self.dropout(attn_weights)
        context_vec = (attn_weights @ values).transpose(1, 2)
        context_vec = context_vec.contiguous().view(b, num_tokens, self.d_out)
        context_vec = self.out_proj(context_vec)
        return context_vec

    def reset_cache(self):
        self.cache_k, self.cache_v = None, None
        self.ptr_current_pos = 0


att = MultiHeadAttentionWithSWA(d_in=32, d_out=32, dropout=0.0, num_heads=4, sliding_window_size=4).eval()
x = torch.randn(2, 12, 32)

with torch.no_grad():
    expected = att(x, use_cache=False)          # uncached reference, window mask on absolute positions

    att.reset_cache()
    chunked = torch.cat([att(x[:, i:i + 3], use_cache=True) for i in range(0, 12, 3)], dim=1)  # chunked prefill

    att.reset_cache()
    whole = att(x, use_cache=True)              # one cached prefill longer than the window

print(f"chunked prefill (chunks of 3, window 4) max |cached - uncached|: {(chunked - expected).abs().max().item():.3e}")
print(f"single cached prefill of 12 > window: NaN query rows = {int(torch.isnan(whole).any(-1).sum())}")
