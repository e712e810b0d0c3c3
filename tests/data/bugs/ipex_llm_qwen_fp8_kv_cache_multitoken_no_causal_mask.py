# intel/ipex-llm PR #9968 (commit 2e84575), bigdl/llm/transformers/models/qwen.py qwen_attention_forward.
# With the fp8-quantized KV cache, a multi-token forward on top of an existing cache (layer_past != None) gets
# causal_mask = None (built only when key_size == kv_seq_len), so the new tokens attend to each other's future.
import sys
from types import SimpleNamespace
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
KV_CACHE_ALLOC_BLOCK_LENGTH = 256


def rotate_half(x):
    x1 = x[..., :x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    rot_dim = freqs[0].shape[-1]
    cos, sin = freqs
    t_, t_pass_ = t[..., :rot_dim], t[..., rot_dim:]
    t_ = t_.float()
    t_pass_ = t_pass_.float()
    t_ = (t_ * cos) + (rotate_half(t_) * sin)
    return torch.cat((t_, t_pass_), dim=-1).type_as(t)


def quantize_kv_cache(linear, x):
    return True  # BIGDL_QUANTIZE_KV_CACHE=1


def init_fp8_kv_cache(batch_size, num_heads, head_dim, current_length, max_length, device):
    k_cache_storage = torch.empty(batch_size, num_heads, max_length, head_dim, dtype=torch.uint8, device=device)
    v_cache_storage = torch.empty(batch_size, num_heads, head_dim, max_length, dtype=torch.uint8, device=device)
    k_cache = k_cache_storage.as_strided((batch_size, num_heads, current_length, head_dim),
                                         k_cache_storage.stride(), storage_offset=0)
    v_cache = v_cache_storage.as_strided((batch_size, num_heads, head_dim, current_length),
                                         v_cache_storage.stride(), storage_offset=0)
    return k_cache, v_cache.transpose(-1, -2)


def append_fp8_kv_cache(k_cache, v_cache, key, value):
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


class QWenAttention(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.split_size = hidden_size
        self.c_attn = nn.Linear(hidden_size, 3 * hidden_size)
        self.c_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.scale_attn_weights = True
        self.use_cache_quantization = False
        self.use_flash_attn = False
        self.softmax_in_fp32 = False
        self.use_logn_attn = False
        self.seq_length = 2048
        self.attn_dropout = nn.Dropout(0.0)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        return tensor.view(tensor.size()[:-1] + (num_heads, attn_head_size))

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.contiguous()
        return tensor.view(tensor.size()[:-2] + (num_heads * attn_head_size,))

    def _attn(self, query, key, value, causal_mask=None, attention_mask=None, head_mask=None):
        # QWen's original (unquantized) attention, used for the first token
        attn_weights = torch.matmul(query, key.transpose(-1, -2)) / (value.size(-1) ** 0.5)
        mask_value = torch.finfo(attn_weights.dtype).min
        if causal_mask is not None:
            attn_weights = torch.where(causal_mask, attn_weights, mask_value)
        if attention_mask is not None:
            attn_weights = attn_weights + attention_mask
        attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
        return torch.matmul(attn_weights, value).transpose(1, 2), attn_weights


def core_attn(self, query, key, value, causal_mask=None, attention_mask=None, head_mask=None):
    key, value = restore_fp8_kv_cache(key, value, query.dtype)
    attn_weights = torch.matmul(query, key.transpose(-1, -2))
    if self.scale_attn_weights:
        size_temp = value.size(-1)
        attn_weights = attn_weights / (size_temp ** 0.5)
    mask_value = torch.finfo(attn_weights.dtype).min
    if causal_mask is not None:
        attn_weights = torch.where(causal_mask, attn_weights.to(attn_weights.dtype), mask_value)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = torch.nn.functional.softmax(attn_weights, dim=-1)
    attn_weights = attn_weights.type(query.dtype)
    attn_output = torch.matmul(attn_weights, value)
    return attn_output.transpose(1, 2), attn_weights



def qwen_attention_forward(self, hidden_states, rotary_pos_emb_list=None, layer_past=None,
                           attention_mask=None, head_mask=None, use_cache=False):
    mixed_x_layer = self.c_attn(hidden_states)
    query, key, value = mixed_x_layer.split(self.split_size, dim=2)
    query = self._split_heads(query, self.num_heads, self.head_dim)
    key = self._split_heads(key, self.num_heads, self.head_dim)
    value = self._split_heads(value, self.num_heads, self.head_dim)

    cur_len = query.shape[1]
    rotary_pos_emb = rotary_pos_emb_list[0]
    rotary_pos_emb = [i[:, -cur_len:, :, :] for i in rotary_pos_emb]
    rotary_pos_emb = (rotary_pos_emb,) * 2
    q_pos_emb, k_pos_emb = rotary_pos_emb
    query = apply_rotary_pos_emb(query, q_pos_emb)
    key = apply_rotary_pos_emb(key, k_pos_emb)

    query_size, key_size = query.size(1), key.size(1)
    kv_seq_len = key_size if layer_past is None else key_size + layer_past[0].size(1)

    if FIXED:
        if query_size > 1:
            causal_mask = torch.tril(
                torch.ones((kv_seq_len, kv_seq_len), dtype=torch.bool, device=query.device)
            ).view(1, 1, kv_seq_len, kv_seq_len)
            causal_mask = causal_mask[:, :, kv_seq_len - query_size:kv_seq_len, :kv_seq_len]
        else:
            causal_mask = None
    else:
        if key_size == kv_seq_len:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=query.device)
            ).view(1, 1, key_size, key_size)
        else:
            causal_mask = None

    if quantize_kv_cache(self.c_attn, hidden_states):
        query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
        if layer_past is None:
            # For first token, use original attn
            attn_output, attn_weight = self._attn(query, key, value, causal_mask, attention_mask, head_mask)
            if use_cache:
                max_cache_length = kv_seq_len + KV_CACHE_ALLOC_BLOCK_LENGTH
                k_cache, v_cache = init_fp8_kv_cache(query.size(0), self.num_heads, self.head_dim,
                                                     0, max_cache_length, device=query.device)
                key, value = append_fp8_kv_cache(k_cache, v_cache, key, value)
        else:
            k_cache, v_cache = layer_past[0], layer_past[1]
            k_cache = k_cache.transpose(1, 2)
            v_cache = v_cache.transpose(1, 2)
            key, value = append_fp8_kv_cache(k_cache, v_cache, key, value)
            attn_output, attn_weight = core_attn(self, query, key, value, causal_mask, attention_mask, head_mask)

    context_layer = self._merge_heads(attn_output, self.num_heads, self.head_dim)
    attn_output = self.c_proj(context_layer)
    return attn_output, (key.transpose(1, 2), value.transpose(1, 2))


def rotary(seq_len, dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(seq_len).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return [(emb.cos()[None, :, None, :], emb.sin()[None, :, None, :])]


attn = QWenAttention().eval()
P, C = 8, 5  # cached prompt, then a second-turn chunk of C tokens over the fp8 cache
x = torch.randn(1, P + C, 32)
with torch.no_grad():
    _, past = qwen_attention_forward(attn, x[:, :P], rotary(P, attn.head_dim), use_cache=True)
    chunk, _ = qwen_attention_forward(attn, x[:, P:], rotary(P + C, attn.head_dim), layer_past=past, use_cache=True)

    _, past = qwen_attention_forward(attn, x[:, :P], rotary(P, attn.head_dim), use_cache=True)
    steps = []
    for t in range(P, P + C):
        out, past = qwen_attention_forward(attn, x[:, t:t + 1], rotary(t + 1, attn.head_dim),
                                           layer_past=past, use_cache=True)
        steps.append(out)
    ref = torch.cat(steps, dim=1)
print(f"max |multi-token chunk over fp8 cache - token-by-token decode| = {(chunk - ref).abs().max().item():.6f}")
