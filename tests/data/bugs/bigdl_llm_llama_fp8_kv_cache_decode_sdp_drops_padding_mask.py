# intel/ipex-llm (bigdl-llm) PR #10433 (commit bd64488), bigdl/llm/transformers/models/llama.py
# llama_attention_forward_4_31_quantized: the fp8-KV-cache decode kernel linear_q4_0.sdp_fp8 is called without
# attention_mask, so in a left-padded batch each decode step attends to the padded slots of the quantized cache.
import sys, math
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
FP8_KV_ALLOC_LENGTH = 512
DEVICE_TYPE = "xpu"  # the decode kernel below is the XPU path; emulated on CPU in torch


def init_fp8_kv_cache(batch_size, num_heads, current_length, head_dim, device, new_layout=False):
    max_length = current_length + FP8_KV_ALLOC_LENGTH
    k_cache_storage = torch.empty(batch_size, num_heads, max_length, head_dim, dtype=torch.uint8, device=device)
    k_cache = k_cache_storage.as_strided((batch_size, num_heads, 0, head_dim), k_cache_storage.stride(), storage_offset=0)
    v_cache_storage = torch.empty(batch_size, num_heads, max_length, head_dim, dtype=torch.uint8, device=device)
    v_cache = v_cache_storage.as_strided((batch_size, num_heads, 0, head_dim), v_cache_storage.stride(), storage_offset=0)
    return k_cache, v_cache


def append_fp8_kv_cache(k_cache, v_cache, key, value, new_layout=False):
    batch_size, num_heads, cur_length, head_dim = k_cache.shape
    new_length = cur_length + key.size(2)
    new_size = (batch_size, num_heads, new_length, head_dim)
    new_k_cache = k_cache.as_strided(new_size, k_cache.stride(), storage_offset=0)
    new_v_cache = v_cache.as_strided(new_size, v_cache.stride(), storage_offset=0)
    fp8_key = key.half().view(torch.uint8)[:, :, :, 1::2]
    new_k_cache[:, :, cur_length:new_length, :] = fp8_key
    fp8_value = value.half().view(torch.uint8)[:, :, :, 1::2]
    new_v_cache[:, :, cur_length:new_length, :] = fp8_value
    return new_k_cache, new_v_cache


def restore_fp8_kv_cache(k_cache, v_cache, dtype):
    new_k_cache = torch.full(k_cache.shape, 128, dtype=torch.int16, device=k_cache.device)
    new_k_cache.view(torch.uint8)[:, :, :, 1::2] = k_cache
    new_k_cache = new_k_cache.view(torch.half)
    new_v_cache = torch.full(v_cache.shape, 128, dtype=torch.int16, device=v_cache.device)
    new_v_cache.view(torch.uint8)[:, :, :, 1::2] = v_cache
    new_v_cache = new_v_cache.view(torch.half)
    return new_k_cache.to(dtype=dtype), new_v_cache.to(dtype=dtype)


class linear_q4_0:  # torch stand-in for the fused fp8 SDP kernel: additive mask if given
    @staticmethod
    def sdp_fp8(query, key, value, mask=None):
        key, value = restore_fp8_kv_cache(key, value, query.dtype)
        scores = torch.matmul(query, key.transpose(2, 3)) / math.sqrt(query.size(-1))
        if mask is not None:
            scores = scores + mask
        return torch.matmul(torch.softmax(scores, dim=-1), value)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, position_ids, head_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]
    cos, sin = emb.cos(), emb.sin()
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def native_sdp(query, key, value, attention_mask, bsz, q_len, kv_seq_len, head_dim, num_heads):
    attn_weights = torch.matmul(query.to(key.dtype), key.transpose(2, 3)) / math.sqrt(head_dim)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(value.dtype)
    return torch.matmul(attn_weights, value), attn_weights


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, hidden_size // num_heads
        self.q_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)


def llama_attention_forward_4_31_quantized(self, hidden_states, attention_mask=None, position_ids=None,
                                           past_key_value=None, use_cache=False):
    bsz, q_len, _ = hidden_states.size()
    query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
    query_states, key_states = apply_rotary_pos_emb(query_states, key_states, position_ids, self.head_dim)

    if past_key_value is None:
        kv_seq_len = key_states.shape[-2]
        attn_output, attn_weights = native_sdp(query_states, key_states, value_states, attention_mask,
                                               bsz, q_len, kv_seq_len, self.head_dim, self.num_heads)
        if use_cache:
            k_cache, v_cache = init_fp8_kv_cache(bsz, self.num_heads, kv_seq_len, self.head_dim,
                                                 device=query_states.device, new_layout=True)
            key_states, value_states = append_fp8_kv_cache(k_cache, v_cache, key_states, value_states)
            past_key_value = (key_states, value_states)
    else:
        k_cache, v_cache = past_key_value
        key_states, value_states = append_fp8_kv_cache(k_cache, v_cache, key_states, value_states, new_layout=True)
        kv_seq_len = key_states.shape[-2]
        past_key_value = (key_states, value_states)
        if query_states.size(2) != 1 or DEVICE_TYPE != 'xpu':
            key_states, value_states = restore_fp8_kv_cache(key_states, value_states, query_states.dtype)
            attn_output, attn_weights = native_sdp(query_states, key_states, value_states, attention_mask,
                                                   bsz, q_len, kv_seq_len, self.head_dim, self.num_heads)
        else:
            if FIXED:
                attn_output = linear_q4_0.sdp_fp8(query_states, key_states, value_states, attention_mask)
            else:
                attn_output = linear_q4_0.sdp_fp8(query_states, key_states, value_states)

    attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
    return self.o_proj(attn_output), past_key_value


def additive_mask(mask_2d, q_len):
    # LlamaModel._prepare_decoder_attention_mask: causal (bottom-right) + padding, min-value fill
    bsz, kv = mask_2d.shape
    minv = torch.finfo(torch.float32).min
    causal = torch.full((q_len, kv), minv).triu(kv - q_len + 1)
    pad = (1.0 - mask_2d[:, None, None, :].float()) * minv
    return (causal[None, None] + pad).clamp(min=minv)


def generate(attn, x, mask_2d, new_tokens):
    with torch.no_grad():
        pos = (mask_2d.long().cumsum(-1) - 1).clamp(min=0)
        out, past = llama_attention_forward_4_31_quantized(attn, x, additive_mask(mask_2d, x.shape[1]), pos,
                                                           use_cache=True)
        outs = []
        for step in range(new_tokens.shape[1]):
            mask_2d = torch.cat([mask_2d, mask_2d.new_ones(mask_2d.shape[0], 1)], dim=-1)
            pos = (mask_2d.long().sum(-1, keepdim=True) - 1)
            out, past = llama_attention_forward_4_31_quantized(attn, new_tokens[:, step:step + 1],
                                                               additive_mask(mask_2d, 1), pos, past, use_cache=True)
            outs.append(out)
    return torch.cat(outs, dim=1)


attn = LlamaAttention().eval()
lens = [5, 9]
T = max(lens)
prompts = [torch.randn(1, n, 32) for n in lens]
new = torch.randn(2, 3, 32)
x = torch.zeros(2, T, 32)
mask = torch.zeros(2, T, dtype=torch.long)
for b, n in enumerate(lens):  # left padding
    x[b, T - n:] = prompts[b][0]
    mask[b, T - n:] = 1
batched = generate(attn, x, mask, new)
diff = 0.0
for b, n in enumerate(lens):
    alone = generate(attn, prompts[b], torch.ones(1, n, dtype=torch.long), new[b:b + 1])
    diff = max(diff, (batched[b] - alone[0]).abs().max().item())
print(f"max |left-padded batched fp8-cache decode - each sequence alone| = {diff:.6f}")
