"""Time-MoE batched autoregressive forecasting, shrunk to toy sizes (correct program).

Port of Time-MoE/Time-MoE as mirrored in mchikyt3/Time-MoE:
  time_moe/models/modeling_time_moe.py @0294cf4b40fc86f9af1de46be9974ebf451e218b
    (TimeMoeAttention eager path, TimeMoeModel.forward building the 4-D mask with
     transformers' _prepare_4d_causal_attention_mask, TimeMoeForPrediction horizon
     head choice, prepare_inputs_for_generation position ids from the 2-D mask)
  time_moe/models/ts_generation_mixin.py @13cd7aaa08affdb9ec691e6fab07a1d13f7d1979
    (_greedy_search appends a whole horizon of predicted values per step,
     _update_model_kwargs_for_generation extends the 2-D mask by horizon_length ones)

Series of different lengths are LEFT padded (value 0, attention_mask 0).  The prefill
runs 7 query positions; each later step feeds the horizon just predicted (4, then 2
values) as a multi-token chunk over the KV cache, so the causal part of the mask is
offset by the cache length.  Left-pad query rows are fully masked with finfo.min
(not -inf): softmax over them is uniform and finite, and their outputs are never
read.  Position ids come from cumsum(mask)-1 so every series starts at position 0.

Reference: each series alone, unpadded, recomputing the full history at every step
with a per-position loop (query i attends keys 0..i), no mask tensor at all.
"""
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)

HIDDEN = 16
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
LAYERS = 2
INTER = 24
NUM_EXPERTS = 4
TOP_K = 2
HORIZONS = [1, 2, 4]
ROPE_THETA = 10000.0


# ---- transformers.modeling_attn_mask_utils (AttentionMaskConverter), as Time-MoE calls it ----
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length=0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat(
            [torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1
        )
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask, dtype, tgt_len=None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    key_value_length = input_shape[-1] + past_key_values_length
    dtype = inputs_embeds.dtype
    if attention_mask is not None:
        query_length = input_shape[-1]
        causal_4d_mask = None
        if query_length > 1:
            causal_4d_mask = _make_causal_mask(
                (attention_mask.shape[0], query_length), dtype, attention_mask.device,
                past_key_values_length=key_value_length - query_length,
            )
        expanded = _expand_mask(attention_mask, dtype, tgt_len=query_length)
        if causal_4d_mask is not None:
            expanded = causal_4d_mask.masked_fill(expanded.bool(), torch.finfo(dtype).min)
        return expanded
    return _make_causal_mask((input_shape[0], input_shape[-1]), dtype, inputs_embeds.device,
                             past_key_values_length)


# ---- model pieces (modeling_time_moe.py) ----
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim=1):
    cos = cos[position_ids].unsqueeze(unsqueeze_dim)
    sin = sin[position_ids].unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, max_pos=64, base=ROPE_THETA):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
        t = torch.arange(max_pos).float()
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)

    def forward(self, seq_len):
        return self.cos_cached[:seq_len], self.sin_cached[:seq_len]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class TemporalBlock(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseExpertsLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(HIDDEN, NUM_EXPERTS, bias=False)
        self.experts = nn.ModuleList([TemporalBlock(HIDDEN, INTER // TOP_K) for _ in range(NUM_EXPERTS)])
        self.shared_expert = TemporalBlock(HIDDEN, INTER)
        self.shared_expert_gate = nn.Linear(HIDDEN, 1, bias=False)

    def forward(self, hidden_states):
        b, s, d = hidden_states.shape
        hidden_states = hidden_states.view(-1, d)
        router_logits = self.gate(hidden_states)
        routing_weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, TOP_K, dim=-1)
        final = torch.zeros((b * s, d), dtype=hidden_states.dtype)
        expert_mask = F.one_hot(selected_experts, num_classes=NUM_EXPERTS).permute(2, 1, 0)
        for e in range(NUM_EXPERTS):
            idx, top_x = torch.where(expert_mask[e])
            cur = hidden_states[None, top_x].reshape(-1, d)
            final.index_add_(0, top_x, self.experts[e](cur) * routing_weights[top_x, idx, None])
        shared = torch.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return (final + shared).reshape(b, s, d)


class TimeMoeAttention(nn.Module):
    """Eager path of TimeMoeAttention: additive 4-D mask, fp32 softmax."""

    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.q_proj = nn.Linear(HIDDEN, HEADS * HEAD_DIM, bias=True)
        self.k_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=True)
        self.v_proj = nn.Linear(HIDDEN, KV_HEADS * HEAD_DIM, bias=True)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.rotary_emb = RotaryEmbedding(HEAD_DIM)

    def qkv(self, hidden_states, position_ids):
        bsz, q_len, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(bsz, q_len, HEADS, HEAD_DIM).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, KV_HEADS, HEAD_DIM).transpose(1, 2)
        cos, sin = self.rotary_emb(64)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids)
        return q, k, v

    def forward(self, hidden_states, attention_mask, position_ids, cache):
        bsz, q_len, _ = hidden_states.shape
        query_states, key_states, value_states = self.qkv(hidden_states, position_ids)
        # DynamicCache.update: append along the sequence axis
        if cache[self.layer_idx] is not None:
            pk, pv = cache[self.layer_idx]
            key_states = torch.cat([pk, key_states], dim=2)
            value_states = torch.cat([pv, value_states], dim=2)
        cache[self.layer_idx] = (key_states, value_states)
        kv_seq_len = key_states.shape[-2]

        key_states = repeat_kv(key_states, HEADS // KV_HEADS)
        value_states = repeat_kv(value_states, HEADS // KV_HEADS)
        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(HEAD_DIM)
        assert attention_mask.size() == (bsz, 1, q_len, kv_seq_len)
        attn_weights = attn_weights + attention_mask
        attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)
        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, HIDDEN)
        return self.o_proj(attn_output)


class DecoderLayer(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.self_attn = TimeMoeAttention(layer_idx)
        self.ffn_layer = SparseExpertsLayer()
        self.input_layernorm = RMSNorm(HIDDEN)
        self.post_attention_layernorm = RMSNorm(HIDDEN)

    def forward(self, h, attention_mask, position_ids, cache):
        h = h + self.self_attn(self.input_layernorm(h), attention_mask, position_ids, cache)
        return h + self.ffn_layer(self.post_attention_layernorm(h))


class TimeMoeForPrediction(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb_layer = nn.Linear(1, HIDDEN, bias=False)
        self.gate_layer = nn.Linear(1, HIDDEN, bias=False)
        self.layers = nn.ModuleList([DecoderLayer(i) for i in range(LAYERS)])
        self.norm = RMSNorm(HIDDEN)
        self.lm_heads = nn.ModuleList([nn.Linear(HIDDEN, h, bias=False) for h in HORIZONS])

    def embed(self, x):
        return F.silu(self.gate_layer(x)) * self.emb_layer(x)

    def pick_head(self, max_horizon_length):
        horizon_length = HORIZONS[0]
        for h in HORIZONS[1:]:
            if h > max_horizon_length:
                break
            horizon_length = h
        return HORIZONS.index(horizon_length), horizon_length

    def forward(self, input_ids, attention_mask, position_ids, cache, past_len, max_horizon_length):
        batch_size, seq_length, _ = input_ids.shape
        inputs_embeds = self.embed(input_ids)
        mask4d = _prepare_4d_causal_attention_mask(attention_mask, (batch_size, seq_length), inputs_embeds, past_len)
        h = inputs_embeds
        for layer in self.layers:
            h = layer(h, mask4d, position_ids, cache)
        h = self.norm(h)
        head_idx, horizon_length = self.pick_head(max_horizon_length)
        preds = self.lm_heads[head_idx](h)
        if horizon_length > max_horizon_length:
            preds = preds[:, :, :max_horizon_length]
        return preds


def prepare_inputs_for_generation(input_ids, attention_mask, past_length):
    if past_length > 0:
        if attention_mask.shape[1] > input_ids.shape[1]:
            input_ids = input_ids[:, -(attention_mask.shape[1] - past_length):]
        elif past_length < input_ids.shape[1]:
            input_ids = input_ids[:, past_length:]
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    if past_length > 0:
        position_ids = position_ids[:, -input_ids.shape[1]:]
    return input_ids, position_ids


@torch.no_grad()
def generate(model, input_ids, attention_mask, max_length):
    """TSGenerationMixin._greedy_search: one forward per horizon chunk, KV cache kept."""
    cache = [None] * LAYERS
    past_length = 0
    while input_ids.shape[1] < max_length:
        step_ids, position_ids = prepare_inputs_for_generation(input_ids, attention_mask, past_length)
        input_length = input_ids.shape[1]
        preds = model(step_ids, attention_mask, position_ids, cache, past_length,
                      max_horizon_length=max_length - input_length)
        next_tokens = preds[:, -1, :].reshape(input_ids.shape[0], -1, 1)
        horizon_length = next_tokens.shape[1]
        past_length = cache[0][0].shape[2]
        input_ids = torch.cat([input_ids, next_tokens], dim=-2)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], horizon_length))], dim=-1)
    return input_ids[:, :max_length]


# ---- independent reference: one series, no padding, no cache, per-position loop ----
@torch.no_grad()
def reference_forward(model, series):
    x = series.view(1, -1, 1)
    L = x.shape[1]
    pos = torch.arange(L).view(1, L)
    h = model.embed(x)
    for layer in model.layers:
        attn = layer.self_attn
        hn = layer.input_layernorm(h)
        q, k, v = attn.qkv(hn, pos)
        k = repeat_kv(k, HEADS // KV_HEADS)
        v = repeat_kv(v, HEADS // KV_HEADS)
        out = torch.zeros(1, HEADS, L, HEAD_DIM)
        for i in range(L):
            s = (q[:, :, i:i + 1] @ k[:, :, : i + 1].transpose(2, 3)) / math.sqrt(HEAD_DIM)
            out[:, :, i] = (torch.softmax(s, dim=-1) @ v[:, :, : i + 1])[:, :, 0]
        out = attn.o_proj(out.transpose(1, 2).reshape(1, L, HIDDEN))
        h = h + out
        h = h + layer.ffn_layer(layer.post_attention_layernorm(h))
    return model.norm(h)


@torch.no_grad()
def reference_generate(model, series, new_values):
    seq = series.clone()
    while new_values > 0:
        head_idx, horizon = model.pick_head(new_values)
        h = reference_forward(model, seq)
        pred = model.lm_heads[head_idx](h)[0, -1, : min(horizon, new_values)]
        seq = torch.cat([seq, pred])
        new_values -= pred.numel()
    return seq


def main():
    model = TimeMoeForPrediction().eval()
    lengths = [7, 5, 4]
    series = [torch.sin(torch.arange(n).float() * (0.5 + 0.3 * b)) + 0.1 * b for b, n in enumerate(lengths)]
    T = max(lengths)
    new_values = 7
    input_ids = torch.zeros(len(lengths), T, 1)
    attention_mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, s in enumerate(series):
        input_ids[b, T - len(s):, 0] = s
        attention_mask[b, T - len(s):] = 1

    out = generate(model, input_ids, attention_mask, max_length=T + new_values)
    ok = True
    for b, s in enumerate(series):
        ref = reference_generate(model, s, new_values)
        got = out[b, T - len(s):, 0]
        diff = (got - ref).abs().max().item()
        print(f"series {b} (len {len(s)}): max |batched - alone| = {diff:.2e}")
        ok = ok and diff < 1e-5
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
