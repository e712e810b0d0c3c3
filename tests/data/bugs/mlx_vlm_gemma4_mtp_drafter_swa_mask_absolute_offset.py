"""mlx-vlm Gemma 4 assistant (MTP drafter) sliding-window mask uses absolute offsets on a rotating cache.

Citation: Blaizzy/mlx-vlm#1138 (issue, confirmed) fixed by Blaizzy/mlx-vlm#1139 ("Use local
rotating-cache offsets for Gemma assistant MTP masks", merged). I read the pre-fix
mlx_vlm/speculative/drafters/gemma4_assistant/masks.py (make_drafter_masks,
bidirectional_swa_mask, bidirectional_full_mask) and the issue / PR descriptions; the fix's
`_local_window_offset` (min(query_offset, kv_len)) is as it appears in a later version of the
drafter code. This is a torch port (mx -> torch) of those functions plus a minimal drafter layer.

Bug: the drafter's queries sit just past the end of the target's KV cache and attend over the
target's last-layer K/V, which for sliding-window layers live in a RotatingKVCache holding only the
last `sliding_window` keys, indexed 0..kv_len-1. make_drafter_masks passed the ABSOLUTE decode
position (query_offset = tokens seen so far) into bidirectional_swa_mask and used it as
kv_valid_len, so on prompts longer than the window every query was "more than a window away" from
every local key: the valid window was masked out (long-prompt MTP produced corrupt output).

Fix: map absolute positions onto the local window, `_local_window_offset(query_offset, kv_len) =
min(query_offset, kv_len)`, for both the query offset and kv_valid_len of sliding layers.

Reproduction: sliding_window 8, a 20-token target context (the rotating sliding cache holds 8 keys,
the full-attention cache 20), a 3-token draft block. Attention is F.scaled_dot_product_attention
with the additive masks.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def bidirectional_full_mask(query_len, kv_len, kv_valid_len=None, dtype=torch.float32):
    del query_len
    if kv_valid_len is None or kv_valid_len >= kv_len:
        return None
    k_idx = torch.arange(kv_len)
    inside = k_idx < kv_valid_len
    bias = torch.where(inside, torch.tensor(0.0, dtype=dtype), torch.tensor(float("-inf"), dtype=dtype))
    return bias[None, None, None, :]


def bidirectional_swa_mask(query_len, query_offset, kv_len, window, kv_valid_len=None, dtype=torch.float32):
    """Allow keys k in (q - window, q + window) for q in [query_offset, query_offset + query_len)."""
    if (kv_valid_len is None and kv_len <= window and query_offset + query_len <= kv_len + window):
        return None
    q_idx = torch.arange(query_offset, query_offset + query_len)[:, None]
    k_idx = torch.arange(kv_len)[None, :]
    dist = q_idx - k_idx
    inside = (dist > -window) & (dist < window)
    if kv_valid_len is not None:
        inside = inside & (k_idx < int(kv_valid_len))
    bias = torch.where(inside, torch.tensor(0.0, dtype=dtype), torch.tensor(float("-inf"), dtype=dtype))
    return bias[None, None, :, :]


def _local_window_offset(query_offset, kv_len):
    """Map absolute decode positions onto the local rotating/shared-KV window."""
    return min(int(query_offset), int(kv_len))


def make_drafter_masks(shared_kv_states, query_len, query_offset, sliding_window, dtype=torch.float32):
    masks = {}
    for layer_type, kv in shared_kv_states.items():
        kv_len = kv[0].shape[-2]
        kv_valid_len = query_offset
        if layer_type == "sliding_attention":
            if FIXED:
                local_query_offset = _local_window_offset(query_offset, kv_len)
                local_valid_len = _local_window_offset(kv_valid_len, kv_len)
            else:
                local_query_offset, local_valid_len = query_offset, kv_valid_len
            masks[layer_type] = bidirectional_swa_mask(
                query_len, local_query_offset, kv_len, sliding_window, local_valid_len, dtype
            )
        else:
            masks[layer_type] = bidirectional_full_mask(query_len, kv_len, kv_valid_len, dtype)
    return masks


class DrafterAttention(nn.Module):
    """Query-only attention over the target's shared K/V (the drafter has no K/V of its own)."""

    def __init__(self, hidden_size, n_heads, layer_type):
        super().__init__()
        self.layer_type = layer_type
        self.n_heads = n_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, x, shared_kv, mask):
        b, l, d = x.shape
        q = self.q_proj(x).view(b, l, self.n_heads, -1).transpose(1, 2)
        k, v = shared_kv
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, l, d))


class Gemma4AssistantDrafter(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = nn.ModuleList(
            DrafterAttention(config["hidden_size"], config["num_attention_heads"], t) for t in config["layer_types"]
        )
        self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def forward(self, draft_ids, shared_kv_states, query_offset):
        h = self.embed_tokens(draft_ids)
        masks = make_drafter_masks(shared_kv_states, draft_ids.shape[1], query_offset, self.config["sliding_window"], h.dtype)
        for layer in self.layers:
            h = h + layer(h, shared_kv_states[layer.layer_type], masks[layer.layer_type])
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    config = {
        "vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4, "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention"],
    }
    drafter = Gemma4AssistantDrafter(config).eval()
    n_heads, head_dim, context_len = 4, 8, 20
    full_k = torch.randn(1, n_heads, context_len, head_dim)
    full_v = torch.randn(1, n_heads, context_len, head_dim)
    # the target's RotatingKVCache for sliding layers keeps only the last `sliding_window` keys
    w = config["sliding_window"]
    shared_kv_states = {
        "sliding_attention": (full_k[:, :, -w:].clone(), full_v[:, :, -w:].clone()),
        "full_attention": (full_k, full_v),
    }
    draft_ids = torch.randint(0, config["vocab_size"], (1, 3))
    with torch.no_grad():
        logits = drafter(draft_ids, shared_kv_states, query_offset=context_len)
    print("draft argmax:", logits.argmax(-1).tolist(), "finite:", bool(torch.isfinite(logits).all()))


if __name__ == "__main__":
    main()
