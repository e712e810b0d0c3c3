# Follows FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py H2OKVCache_LayerWise (__call__, _update_hh_score): after each
# attention the probabilities are summed per head into hh_score, and the cache keeps, per head, the top hh_size scored tokens
# outside the recent window plus the recent_size latest tokens. Checked against a no-eviction dense pass with a per-head mask.
import math
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, H, HH, RECENT, PROMPT, STEPS = 32, 4, 3, 3, 8, 10
hd = D // H


class H2OKVCache_LayerWise:
    def __init__(self, hh_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.hh_size, self.recent_size, self.cache_size = hh_size, recent_size, hh_size + recent_size
        self.k_seq_dim, self.v_seq_dim = k_seq_dim, v_seq_dim
        self.hh_score = None

    def __call__(self, past_key_values, attn_score_cache):
        self._update_hh_score(attn_score_cache)
        if past_key_values is None:
            return None
        seq_len = past_key_values[0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values
        bsz, num_heads, _, head_dim = past_key_values[0].shape
        select_hh_scores = self.hh_score[:, :seq_len - self.recent_size]
        _, keep_topk = torch.topk(select_hh_scores, self.hh_size, dim=-1)
        keep_topk = keep_topk.sort().values
        keep_recent = torch.arange(seq_len - self.recent_size, seq_len).repeat(keep_topk.shape[0], 1)
        keep_idx = torch.cat([keep_topk, keep_recent], dim=-1)
        mask = torch.zeros(self.hh_score.shape, dtype=torch.bool).scatter(-1, keep_idx, 1)
        k_hh_recent = past_key_values[0].squeeze()[mask].view(bsz, num_heads, -1, head_dim)
        v_hh_recent = past_key_values[1].squeeze()[mask].view(bsz, num_heads, -1, head_dim)
        self.hh_score = self.hh_score[mask].view(num_heads, self.cache_size)
        return (k_hh_recent, v_hh_recent)

    def _update_hh_score(self, attn_score_cache):
        num_new_tokens = attn_score_cache.shape[2]
        if self.hh_score is None:
            self.hh_score = attn_score_cache.sum(0).sum(1)
        else:
            attn_score_cache = attn_score_cache.sum(0).sum(1)
            attn_score_cache[:, :-num_new_tokens] += self.hh_score
            self.hh_score = attn_score_cache


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    f = torch.cat([pos[:, None] * inv, pos[:, None] * inv], -1)
    return x * f.cos() + torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1) * f.sin()


wq, wk, wv = (nn.Linear(D, D, bias=False) for _ in range(3))
T = PROMPT + STEPS
x = 3.0 * torch.randn(1, T, D)  # peaky attention so heads pick different heavy hitters
heads = lambda t: t.view(1, -1, H, hd).transpose(1, 2)
q_all = rope(heads(wq(x)), torch.arange(T, dtype=torch.float64))
k_all = rope(heads(wk(x)), torch.arange(T, dtype=torch.float64))  # keys cached after RoPE, original positions
v_all = heads(wv(x))
with torch.no_grad():
    # (a) H2O real-drop: prefill with a causal float mask, then decode one token at a time against the evicted cache
    cache = H2OKVCache_LayerWise(HH, RECENT)
    causal = torch.full((PROMPT, PROMPT), float("-inf")).triu(1)
    w = (q_all[:, :, :PROMPT] @ k_all[:, :, :PROMPT].transpose(-1, -2) / math.sqrt(hd) + causal).softmax(-1)
    outs = [w @ v_all[:, :, :PROMPT]]
    past = cache((k_all[:, :, :PROMPT], v_all[:, :, :PROMPT]), w)
    for t in range(PROMPT, T):
        k = torch.cat([past[0], k_all[:, :, t:t + 1]], 2)
        v = torch.cat([past[1], v_all[:, :, t:t + 1]], 2)
        w = (q_all[:, :, t:t + 1] @ k.transpose(-1, -2) / math.sqrt(hd)).softmax(-1)
        outs.append(w @ v)
        past = cache((k, v), w)
    out = torch.cat(outs, 2)
    # (b) reference: all T keys stay; a per-head boolean keep-mask over original positions stands in for eviction
    alive = torch.zeros(H, T, dtype=torch.bool)
    score = torch.zeros(H, T)
    ref = torch.zeros_like(out)
    keep = torch.ones(PROMPT, PROMPT, dtype=torch.bool).tril()
    s = q_all[0, :, :PROMPT] @ k_all[0, :, :PROMPT].transpose(-1, -2) / math.sqrt(hd)
    p = s.masked_fill(~keep, float("-inf")).softmax(-1)
    ref[0, :, :PROMPT] = p @ v_all[0, :, :PROMPT]
    score[:, :PROMPT] = p.sum(1)
    alive[:, :PROMPT] = True

    def evict(n):  # n = tokens seen so far; keep recent window + per-head top-HH among older alive tokens
        if int(alive[0, :n].sum()) <= HH + RECENT:
            return
        old = torch.arange(n) < n - RECENT
        cand = score[:, :n].masked_fill(~(alive[:, :n] & old), float("-inf"))
        top = cand.topk(HH, -1).indices
        alive[:, :n] = False
        alive.scatter_(1, top, True)
        alive[:, n - RECENT:n] = True

    evict(PROMPT)
    differs_per_head = bool((alive != alive[:1]).any())
    for t in range(PROMPT, T):
        m = alive[:, :t + 1].clone()
        m[:, t] = True
        s = (q_all[0, :, t:t + 1] @ k_all[0, :, :t + 1].transpose(-1, -2) / math.sqrt(hd)).squeeze(1)
        p = s.masked_fill(~m, float("-inf")).softmax(-1)
        ref[0, :, t] = (p[:, None] @ v_all[0, :, :t + 1]).squeeze(1)
        score[:, :t + 1] += p
        alive[:, t] = True
        evict(t + 1)
        differs_per_head |= bool((alive != alive[:1]).any())
    diff = (out - ref).abs().max().item()
print("heads kept different tokens at some step:", differs_per_head, "| max |evicting H2O cache - dense per-head masked pass| =", diff)
assert diff < 1e-10
assert differs_per_head
