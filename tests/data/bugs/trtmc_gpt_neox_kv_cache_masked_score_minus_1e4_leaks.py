# TensorRT-Model-Connect (NVIDIA/TensorRT-Model-Connect#695, commit 9dd6b38): the GPT-NeoX runtime's GptNeoxKvCache
# filled masked cells of its additive attention mask (batched prefill and decode) with kMaskedScore = -1e4, which is
# not large enough against GPT-NeoX/Pythia attention logits, so future prompt tokens and stale cache slots leak in.
import sys
import math
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# ---- runtime side: src/runtime/models/gpt_neox/kv_cache.cpp (mask construction), transcribed ----
kMaskedScore = -1.0e9 if FIXED else -1.0e4


class GptNeoxKvCache:
    def __init__(self, num_layers, max_length, kv_dim):
        self.num_layers_ = num_layers
        self.max_length_ = max_length
        self.kv_dim_ = kv_dim
        self.cache_k_ = [torch.zeros(max_length, kv_dim) for _ in range(num_layers)]
        self.cache_v_ = [torch.zeros(max_length, kv_dim) for _ in range(num_layers)]
        self.position_ = 0

    def write_position_input(self, inputs, seq_len):
        inputs["position_id"] = torch.arange(self.position_, self.position_ + seq_len, dtype=torch.int32)

    def write_batched_mask(self, inputs, seq_len):
        # Batched prefill mask: (seq_len, max_length + seq_len). Columns [0, valid) are visible cache,
        # [valid, max_length) are stale slots, [max_length, max_length+seq_len) are the new tokens (causal).
        valid = max(0, min(self.position_, self.max_length_))
        kv_len = self.max_length_ + seq_len
        mask_buf = torch.full((seq_len * kv_len,), kMaskedScore, dtype=torch.float32)
        for i in range(seq_len):
            row = i * kv_len
            for j in range(valid):
                mask_buf[row + j] = 0.0
            for j in range(i + 1):
                mask_buf[row + self.max_length_ + j] = 0.0
        inputs["attention_mask"] = mask_buf.view(seq_len, kv_len)

    def write_decode_mask(self, inputs):
        valid = max(0, min(self.position_, self.max_length_))
        mask_width = self.max_length_ + 1
        mask_buf = torch.full((mask_width,), kMaskedScore, dtype=torch.float32)
        mask_buf[:valid] = 0.0
        mask_buf[mask_width - 1] = 0.0
        inputs["attention_mask"] = mask_buf  # static engine: shape [max_length + 1]

    def prepare_step(self, inputs, seq_len):
        if seq_len <= 0:
            seq_len = 1
        self.write_position_input(inputs, seq_len)
        if seq_len > 1:
            self.write_batched_mask(inputs, seq_len)
        else:
            self.write_decode_mask(inputs)
        for i in range(self.num_layers_):
            inputs[f"cache_k_{i}"] = self.cache_k_[i]
            inputs[f"cache_v_{i}"] = self.cache_v_[i]

    def write_prefill_kv(self, prefill_k, prefill_v, seq_len):
        for i in range(self.num_layers_):
            self.cache_k_[i][:seq_len] = prefill_k[i]
            self.cache_v_[i][:seq_len] = prefill_v[i]
        self.position_ = seq_len

    def append_prefill_kv(self, prefill_k, prefill_v, seq_len):
        p = self.position_
        for i in range(self.num_layers_):
            self.cache_k_[i][p:p + seq_len] = prefill_k[i]
            self.cache_v_[i][p:p + seq_len] = prefill_v[i]
        self.position_ += seq_len


# ---- engine side: graph_blocks.add_attention_block (pre-norm -> QKV -> RoPE -> cache concat -> attention) ----
HIDDEN, HEADS, LAYERS, VOCAB, ROTARY_PCT = 32, 4, 2, 64, 0.25
HEAD_DIM = HIDDEN // HEADS
ROPE_DIM = int(HEAD_DIM * ROTARY_PCT)


def add_2d_mask_to_4d(mask_2d):
    """Reshape additive attention mask [Sq, K] to [1, 1, Sq, K]."""
    return mask_2d.reshape(1, 1, *mask_2d.shape[-2:]) if mask_2d.dim() == 2 else mask_2d.reshape(1, 1, 1, -1)


def apply_rope(x, pos):  # x: [S, H, D], GPT-NeoX partial rotary (rotate_half on the first ROPE_DIM dims)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, ROPE_DIM, 2).float() / ROPE_DIM))
    freqs = pos.float()[:, None] * inv_freq[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    xr, xp = x[..., :ROPE_DIM], x[..., ROPE_DIM:]
    x1, x2 = xr[..., : ROPE_DIM // 2], xr[..., ROPE_DIM // 2:]
    rot = torch.cat([-x2, x1], -1)
    return torch.cat([xr * cos + rot * sin, xp], -1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_norm = nn.LayerNorm(HIDDEN)
        self.post_norm = nn.LayerNorm(HIDDEN)
        self.w_q = nn.Linear(HIDDEN, HIDDEN)
        self.w_k = nn.Linear(HIDDEN, HIDDEN)
        self.w_v = nn.Linear(HIDDEN, HIDDEN)
        self.w_o = nn.Linear(HIDDEN, HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, 4 * HIDDEN)
        self.fc2 = nn.Linear(4 * HIDDEN, HIDDEN)
        # Pythia checkpoints have very large attention logits; scale q/k projections to that regime
        nn.init.normal_(self.w_q.weight, std=20.0)
        nn.init.normal_(self.w_k.weight, std=20.0)

    def forward(self, hidden, cache_k, cache_v, attention_mask, position_id):
        S = hidden.shape[0]
        normed = self.input_norm(hidden)
        q = apply_rope(self.w_q(normed).view(S, HEADS, HEAD_DIM), position_id)
        k = apply_rope(self.w_k(normed).view(S, HEADS, HEAD_DIM), position_id)
        v = self.w_v(normed).view(S, HEADS, HEAD_DIM)
        present_k, present_v = k.reshape(S, HIDDEN), v.reshape(S, HIDDEN)
        all_k = torch.cat([cache_k, present_k], 0).view(-1, HEADS, HEAD_DIM).transpose(0, 1)[None]
        all_v = torch.cat([cache_v, present_v], 0).view(-1, HEADS, HEAD_DIM).transpose(0, 1)[None]
        mask_4d = add_2d_mask_to_4d(attention_mask)
        ctx = F.scaled_dot_product_attention(q.transpose(0, 1)[None], all_k, all_v, attn_mask=mask_4d,
                                             is_causal=False, scale=1.0 / math.sqrt(HEAD_DIM))
        attn_out = self.w_o(ctx[0].transpose(0, 1).reshape(S, HIDDEN))
        mlp_out = self.fc2(F.gelu(self.fc1(self.post_norm(hidden))))
        return hidden + attn_out + mlp_out, present_k, present_v  # GPT-NeoX parallel residual


class Engine(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.final_norm = nn.LayerNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, inputs):
        h = self.embed(inputs["input_ids"])
        pk, pv = [], []
        for i, layer in enumerate(self.layers):
            h, k, v = layer(h, inputs[f"cache_k_{i}"], inputs[f"cache_v_{i}"], inputs["attention_mask"], inputs["position_id"])
            pk.append(k)
            pv.append(v)
        return self.lm_head(self.final_norm(h)), pk, pv

    def reference(self, ids):  # plain causal forward, no cache, boolean mask
        h = self.embed(ids)
        pos = torch.arange(ids.shape[0])
        causal = torch.ones(ids.shape[0], ids.shape[0], dtype=torch.bool).tril()
        for layer in self.layers:
            S = h.shape[0]
            normed = layer.input_norm(h)
            q = apply_rope(layer.w_q(normed).view(S, HEADS, HEAD_DIM), pos).transpose(0, 1)[None]
            k = apply_rope(layer.w_k(normed).view(S, HEADS, HEAD_DIM), pos).transpose(0, 1)[None]
            v = layer.w_v(normed).view(S, HEADS, HEAD_DIM).transpose(0, 1)[None]
            ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
            h = h + layer.w_o(ctx[0].transpose(0, 1).reshape(S, HIDDEN)) + layer.fc2(F.gelu(layer.fc1(layer.post_norm(h))))
        return self.lm_head(self.final_norm(h))


MAX_LENGTH = 24
engine = Engine().eval()
cache = GptNeoxKvCache(LAYERS, MAX_LENGTH, HIDDEN)
prompt = torch.randint(0, VOCAB, (10,))

with torch.no_grad():
    tokens = prompt.clone()
    inputs = {"input_ids": prompt}
    cache.prepare_step(inputs, prompt.shape[0])
    logits, pk, pv = engine(inputs)
    cache.write_prefill_kv(pk, pv, prompt.shape[0])
    step_logits = [logits[-1]]
    next_tok = logits[-1].argmax().view(1)
    for _ in range(6):  # greedy decode, one token per engine call
        tokens = torch.cat([tokens, next_tok])
        inputs = {"input_ids": next_tok}
        cache.prepare_step(inputs, 1)
        logits, pk, pv = engine(inputs)
        cache.append_prefill_kv(pk, pv, 1)
        step_logits.append(logits[-1])
        next_tok = logits[-1].argmax().view(1)
    ref = engine.reference(tokens)[prompt.shape[0] - 1:]

diff = (torch.stack(step_logits) - ref).abs().max().item()
print(f"max |runtime logits (prefill + 6 decode steps) - causal reference logits| = {diff:.6f}")
