# ROCm/hip-ep#144: in the GQA op the causal/sliding-window mask kernel was launched only when sq > 1 (prefill), so
# during decode (sq == 1) GPT-OSS sliding-attention layers attended to keys older than local_window_size.
# Ported from C++/HIP to torch (hand-written softmax with gpt-oss attention-sink logits); tiny sizes.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class GptOssConfig:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_key_value_heads = 2
    head_dim = 8
    sliding_window = 3
    layer_types = ["sliding_attention", "full_attention"]


def gqa_causal_mask(scores, past_len, local_window_size):
    # scores: (B, H, sq, total_seq); mirrors hip_gqa_causal_mask_f32 (honours past_len and the window)
    sq, total = scores.shape[-2:]
    q_pos = past_len + torch.arange(sq)[:, None]
    k_pos = torch.arange(total)[None]
    masked = k_pos > q_pos
    if local_window_size > 0:
        masked = masked | (k_pos <= q_pos - local_window_size)
    return scores.masked_fill(masked, float("-inf"))


def gqa_forward(q, k_cache, v_cache, sinks, past_len, local_window_size, scale):
    B, H, sq, D = q.shape
    rep = H // k_cache.shape[1]
    k = k_cache.repeat_interleave(rep, 1)
    v = v_cache.repeat_interleave(rep, 1)
    scores = (q @ k.transpose(-1, -2)) * scale
    if FIXED:
        apply_mask = sq > 1 or local_window_size > 0
    else:
        apply_mask = sq > 1
    if apply_mask:
        scores = gqa_causal_mask(scores, past_len, local_window_size)
    sink = sinks.view(1, H, 1, 1).expand(B, H, sq, 1)
    probs = torch.cat([scores, sink], -1).softmax(-1)[..., :-1]  # sink column takes mass, carries no value
    return probs @ v


class GptOssAttention(nn.Module):
    def __init__(self, c, layer_idx):
        super().__init__()
        self.h, self.kv, self.d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.sliding_window = c.sliding_window if c.layer_types[layer_idx] == "sliding_attention" else 0
        self.q_proj = nn.Linear(c.hidden_size, self.h * self.d)
        self.k_proj = nn.Linear(c.hidden_size, self.kv * self.d)
        self.v_proj = nn.Linear(c.hidden_size, self.kv * self.d)
        self.o_proj = nn.Linear(self.h * self.d, c.hidden_size)
        self.sinks = nn.Parameter(torch.randn(self.h))

    def forward(self, x, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.kv, self.d).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.kv, self.d).transpose(1, 2)
        past_len = 0 if cache.get("k") is None else cache["k"].shape[2]
        if past_len:
            k, v = torch.cat([cache["k"], k], 2), torch.cat([cache["v"], v], 2)
        cache["k"], cache["v"] = k, v
        out = gqa_forward(q, k, v, self.sinks, past_len, self.sliding_window, self.d ** -0.5)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class GptOssModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(GptOssAttention(c, i) for i in range(len(c.layer_types)))
        self.norms = nn.ModuleList(nn.RMSNorm(c.hidden_size) for _ in c.layer_types)
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)

    def forward(self, ids, caches):
        h = self.embed(ids)
        for layer, norm, cache in zip(self.layers, self.norms, caches):
            h = h + layer(norm(h), cache)
        return self.lm_head(h)


def main():
    torch.manual_seed(0)
    c = GptOssConfig()
    model = GptOssModel(c).eval()
    ids = torch.randint(0, c.vocab_size, (1, 4))
    worst = 0.0
    with torch.no_grad():
        caches = [{} for _ in c.layer_types]
        logits = model(ids, caches)  # prefill (sq > 1)
        for _ in range(6):  # greedy decode with the KV cache (sq == 1)
            nxt = logits[:, -1:].argmax(-1)
            ids = torch.cat([ids, nxt], 1)
            logits = model(nxt, caches)
            ref = model(ids, [{} for _ in c.layer_types])[:, -1:]  # whole sequence as one prefill
            worst = max(worst, (logits - ref).abs().max().item())
    print(f"mode={'fixed' if FIXED else 'buggy'} max|decode logits - full-prefill logits| = {worst:.4e}")


if __name__ == "__main__":
    main()
