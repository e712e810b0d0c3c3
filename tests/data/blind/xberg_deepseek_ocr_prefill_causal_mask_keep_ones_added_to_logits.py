# xberg-io/xberg#1707 ("fix(candle-ocr): mask the DeepSeek-OCR prefill and resize its rel-pos table", GH#1701);
# pre-fix utils.rs as vendored from jhqxxx/aha, post-fix utils.rs read; Rust/candle ported to torch.
# DeepSeek-OCR's `prepare_causal_attention_mask` built a U32 0/1 keep-mask (1 = visible, 0 = future), but
# `eager_attention_forward` adds the mask straight onto the logits after casting it, so future tokens were only
# 1.0 lower than visible ones: the single prefill over image + prompt tokens (and the KV cache it seeds) ran
# without causal masking. The fix builds an additive mask, 0 for visible and -inf above the diagonal.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DeepseekV2Config:
    vocab_size = 96
    hidden_size = 64
    intermediate_size = 128
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rms_norm_eps = 1e-6
    image_token_id = 95
    eos_token_id = 1
    bos_token_id = 0


def prepare_causal_attention_mask(bs, seq_len, _offset, device):
    if FIXED:
        data = torch.zeros(seq_len * seq_len, dtype=torch.float32)
        for i in range(seq_len):
            for j in range(i + 1, seq_len):
                data[i * seq_len + j] = float("-inf")
        mask = data.reshape(seq_len, seq_len).to(device).unsqueeze(0).unsqueeze(0)
        return mask.expand(bs, 1, seq_len, seq_len)
    mask = torch.ones((seq_len, seq_len), dtype=torch.int32, device=device)
    for i in range(seq_len):
        for j in range(i + 1, seq_len):
            mask[i:i + 1, j:j + 1] = torch.zeros((1, 1), dtype=torch.int32, device=device)
    return mask.expand(bs, 1, seq_len, seq_len)


def repeat_kv(xs, n_rep):
    if n_rep == 1:
        return xs
    b_sz, n_kv_head, seq_len, head_dim = xs.shape
    return xs.unsqueeze(2).expand(b_sz, n_kv_head, n_rep, seq_len, head_dim).reshape(
        b_sz, n_kv_head * n_rep, seq_len, head_dim)


def eager_attention_forward(query_states, key_states, value_states, num_key_value_groups, attention_mask, scaling):
    if num_key_value_groups is not None:
        key_states = repeat_kv(key_states, num_key_value_groups)
        value_states = repeat_kv(value_states, num_key_value_groups)
    attn_weights = query_states.contiguous() @ key_states.transpose(-2, -1).contiguous()
    attn_weights = attn_weights * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask.to(attn_weights.dtype)
    attn_weights = torch.softmax(attn_weights, dim=-1)
    attn_output = attn_weights @ value_states
    return attn_output.transpose(1, 2).contiguous()


class RoPE(nn.Module):
    def __init__(self, head_dim, theta):
        super().__init__()
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))

    def forward(self, seqlen_offset, seq_len):
        t = torch.arange(seqlen_offset, seqlen_offset + seq_len).float()
        freqs = torch.outer(t, self.inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin):
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


class NaiveAttention(nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_key_value_heads):
        super().__init__()
        self.num_heads = num_attention_heads
        self.num_kv_heads = num_key_value_heads
        self.num_kv_groups = num_attention_heads // num_key_value_heads
        self.head_dim = hidden_size // num_attention_heads
        self.middle_size = num_attention_heads * self.head_dim
        self.q_proj = nn.Linear(hidden_size, num_attention_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden_size, num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(num_attention_heads * self.head_dim, hidden_size, bias=False)
        self.kv_cache = None

    def forward_with_cache(self, xs, cos, sin, attention_mask):
        b_sz, q_len, _ = xs.shape
        query_states = self.q_proj(xs).reshape(b_sz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(xs).reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(xs).reshape(b_sz, q_len, self.num_kv_heads, self.head_dim).transpose(1, 2)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if self.kv_cache is not None:
            prev_k, prev_v = self.kv_cache
            key_states = torch.cat([prev_k, key_states], dim=2)
            value_states = torch.cat([prev_v, value_states], dim=2)
        self.kv_cache = (key_states, value_states)
        scale = 1.0 / self.head_dim ** 0.5
        attn_output = eager_attention_forward(query_states, key_states, value_states, self.num_kv_groups,
                                              attention_mask, scale)
        return self.o_proj(attn_output.reshape(b_sz, q_len, self.middle_size))

    def clear_kv_cache(self):
        self.kv_cache = None


class GateUpDownMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, xs):
        return self.down_proj(F.silu(self.gate_proj(xs)) * self.up_proj(xs))


class DeepseekV2DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = NaiveAttention(config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
        self.mlp = GateUpDownMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, xs, cos, sin, attention_mask):
        residual = xs
        xs = self.input_layernorm(xs)
        xs = self.self_attn.forward_with_cache(xs, cos, sin, attention_mask)
        residual = residual + xs
        xs = self.post_attention_layernorm(residual)
        xs = self.mlp(xs)
        return residual + xs


class DeepseekV2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DeepseekV2DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.rope = RoPE(config.hidden_size // config.num_attention_heads, 10000.0)
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, xs, seqlen_offset):
        bs, seq_len, _ = xs.shape
        cos, sin = self.rope(seqlen_offset, seq_len)
        if seq_len <= 1:
            attention_mask = None
        else:
            attention_mask = prepare_causal_attention_mask(bs, seq_len, 0, xs.device)
        for layer in self.layers:
            xs = layer(xs, cos, sin, attention_mask)
        return self.norm(xs)

    def clear_kv_cache(self):
        for layer in self.layers:
            layer.self_attn.clear_kv_cache()


def masked_scatter_dim0(dst, src, mask):
    out = dst.squeeze(0).clone()
    out[mask.flatten().bool()] = src[: int(mask.sum())]
    return out.unsqueeze(0)


class DeepseekOCRModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.language_model = DeepseekV2Model(config)
        self.projector = nn.Linear(32, config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.stop_token_ids = [config.eos_token_id, config.bos_token_id]

    def forward(self, input_ids, image_features, images_seq_mask, seqlen_offset):
        input_embeds = self.language_model.embed_tokens(input_ids)
        if input_ids.shape[1] > 1 and image_features is not None:
            input_embeds = masked_scatter_dim0(input_embeds, self.projector(image_features), images_seq_mask)
        xs = self.language_model(input_embeds, seqlen_offset)
        return self.lm_head(xs)

    @torch.no_grad()
    def generate(self, input_ids, image_features, images_seq_mask, max_new_tokens):
        self.language_model.clear_kv_cache()
        seqlen_offset = 0
        logits = self.forward(input_ids, image_features, images_seq_mask, seqlen_offset)
        seqlen_offset += input_ids.shape[1]
        tokens, first_logits = [], logits
        for _ in range(max_new_tokens):
            next_token = int(logits[0, -1].argmax())
            tokens.append(next_token)
            logits = self.forward(torch.tensor([[next_token]]), None, None, seqlen_offset)
            seqlen_offset += 1
        return tokens, first_logits


config = DeepseekV2Config()
model = DeepseekOCRModel(config).eval()
n_image_tokens = 24
prompt = [config.bos_token_id] + [config.image_token_id] * n_image_tokens + [7, 12, 33, 5, 18, 2]
input_ids = torch.tensor([prompt])
images_seq_mask = (input_ids == config.image_token_id).to(torch.int32)
image_features = torch.randn(n_image_tokens, 32)
tokens, prefill_logits = model.generate(input_ids, image_features, images_seq_mask, max_new_tokens=8)
print("prefill logits norm %.4f" % prefill_logits.norm().item())
print("generated", tokens)
