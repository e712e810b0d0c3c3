"""SnapKV: the prompt's KV cache is compressed per head after prefill, then decoding attends to the kept keys.

Follows FasterDecoding/SnapKV snapkv/monkeypatch/snapkv_utils.py (SnapKVCluster.update_kv) as called from
snapkv/monkeypatch/llama_hijack_4_37.py (llama_flash_attn2_forward): prefill runs full causal attention over
the whole prompt; only the cache that is stored is compressed.  The observation window (the last window_size
prompt queries) votes, with its own causal mask inside the window, for max_capacity_prompt - window_size past
keys per head (avg-pooled scores, topk); the window's own keys are always kept.  Decoding then attends, with
no mask at all, to [kept keys, window keys, new keys]: fewer keys than the prompt had, different per head.

Reference: the uncompressed full cache with an explicit per-head boolean mask that keeps exactly the selected
positions, the window and every decoded key.  Both must agree to ~0.
"""
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
B, H, D, E = 1, 4, 8, 32
PROMPT, WINDOW, CAPACITY, KERNEL, STEPS = 24, 4, 12, 5, 5

wq, wk, wv, wo = (torch.randn(E, E) / math.sqrt(E) for _ in range(4))


def heads(x):
    return x.view(x.shape[0], x.shape[1], H, D).transpose(1, 2)


def update_kv(key_states, query_states, value_states):
    """SnapKVCluster.update_kv (no GQA): keep topk pooled-vote keys + the observation window."""
    q_len = key_states.shape[-2]
    if q_len < CAPACITY:
        return key_states, value_states, None
    attn = query_states[..., -WINDOW:, :] @ key_states.transpose(2, 3) / math.sqrt(D)
    mask = torch.full((WINDOW, WINDOW), torch.finfo(attn.dtype).min)
    cond = torch.arange(WINDOW)
    mask.masked_fill_(cond < (cond + 1).view(WINDOW, 1), 0)  # causal inside the window
    attn[:, :, -WINDOW:, -WINDOW:] += mask[None, None]
    attn = torch.softmax(attn, dim=-1)
    vote = attn[..., -WINDOW:, :-WINDOW].sum(dim=-2)
    vote = F.avg_pool1d(vote, kernel_size=KERNEL, padding=KERNEL // 2, stride=1)
    idx = vote.topk(CAPACITY - WINDOW, dim=-1).indices  # (B, H, CAPACITY-WINDOW)
    gidx = idx.unsqueeze(-1).expand(-1, -1, -1, D)
    k = torch.cat([key_states[:, :, :-WINDOW].gather(2, gidx), key_states[:, :, -WINDOW:]], dim=2)
    v = torch.cat([value_states[:, :, :-WINDOW].gather(2, gidx), value_states[:, :, -WINDOW:]], dim=2)
    return k, v, idx


x = torch.randn(B, PROMPT, E)
q, k, v = heads(x @ wq), heads(x @ wk), heads(x @ wv)
# prefill: full causal attention over the whole prompt (compression only touches what is cached)
prefill = F.scaled_dot_product_attention(q, k, v, is_causal=True)
h = prefill.transpose(1, 2).reshape(B, PROMPT, E) @ wo
ck, cv, idx = update_kv(k, q, v)
full_k, full_v = k, v  # reference keeps everything
keep = torch.zeros(B, H, PROMPT, dtype=torch.bool)
keep.scatter_(2, idx, True)
keep[..., -WINDOW:] = True
assert int(keep.sum(-1).min()) == CAPACITY and ck.shape[2] == CAPACITY

tok = h[:, -1:]
max_diff = 0.0
for step in range(STEPS):
    q1, k1, v1 = heads(tok @ wq), heads(tok @ wk), heads(tok @ wv)
    ck, cv = torch.cat([ck, k1], 2), torch.cat([cv, v1], 2)
    out = F.scaled_dot_product_attention(q1, ck, cv)  # one query, every cached key: no mask needed
    full_k, full_v = torch.cat([full_k, k1], 2), torch.cat([full_v, v1], 2)
    keep = torch.cat([keep, torch.ones(B, H, 1, dtype=torch.bool)], dim=2)
    ref = F.scaled_dot_product_attention(q1, full_k, full_v, attn_mask=keep[:, :, None, :])
    max_diff = max(max_diff, (out - ref).abs().max().item())
    # explicit loop reference for the first head of this step
    kept = [j for j in range(full_k.shape[2]) if keep[0, 0, j]]
    s = torch.stack([q1[0, 0, 0] @ full_k[0, 0, j] for j in kept]) / math.sqrt(D)
    loop = (torch.softmax(s, 0)[:, None] * full_v[0, 0, kept]).sum(0)
    max_diff = max(max_diff, (out[0, 0, 0] - loop).abs().max().item())
    tok = torch.tanh(out.transpose(1, 2).reshape(B, 1, E) @ wo)

print("cache keys per head after decode:", ck.shape[2], "of", full_k.shape[2])
print("max |compressed - masked full|:", max_diff)
assert max_diff < 1e-12
