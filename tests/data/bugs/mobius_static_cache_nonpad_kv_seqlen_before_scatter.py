"""mobius static-cache generation example: `nonpad_kv_seqlen` is fed as the KV count before the
current chunk is scattered into the cache, so the prefill sees no valid key and every decode step
misses its own key.

Citation: onnxruntime/mobius PR #365 ("Fix nonpad_kv_seqlen in static-cache generation example
(before-scatter -> after-scatter)"), commit a49e0f83, examples/static_cache_generation.py (diff
read); the graph side is src/mobius/components/_attention.py (TensorScatter at write_indices,
then a maskless `Attention(is_causal=1, nonpad_kv_seqlen)` over the whole cache), with the
bottom-right causal contract of onnx/onnx#8068.

Bug: the example kept a `nonpad_kv_seqlen` counter equal to `write_indices` (both start at 0 and
advance after `session.run`). The model scatters K/V first and then reads `nonpad_kv_seqlen` as
the number of valid cache entries, so the prefill passed 0 (no key valid) and each decode step
passed one less than the entries written (the new token's own key is hidden).

Fix: feed `nonpad_kv_seqlen = write_indices + cur_seq_len`.

Reproduction: the ONNX graph is written in torch (no onnxruntime): a 2-layer llama with
3-D static caches [batch, max_seq_len, kv_hidden], `tensor_scatter` at `write_indices`, and the
ONNX `Attention` semantics (keys at or past nonpad_kv_seqlen invalid, causal aligned bottom-right
at nonpad_kv_seqlen - q_len) computed with F.scaled_dot_product_attention. A 5-token prompt, then
3 greedy decode steps, as the example's loop.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

NUM_HIDDEN_LAYERS, HIDDEN, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, VOCAB = 2, 32, 4, 2, 8, 64
MAX_SEQ_LEN = 16


def tensor_scatter(cache, update, write_indices):
    """ONNX TensorScatter(axis=1): cache[b, write_indices[b] + t] = update[b, t]."""
    out = cache.clone()
    for b in range(cache.shape[0]):
        start = int(write_indices[b])
        out[b, start : start + update.shape[1]] = update[b]
    return out


def onnx_attention(query, key, value, nonpad_kv_seqlen, q_num_heads, kv_num_heads, is_causal=1):
    """ONNX Attention (3-D inputs, external cache): padding from nonpad_kv_seqlen, causal
    bottom-right (query i of q_len attends key j iff j <= i + nonpad - q_len)."""
    b, q_len, _ = query.shape
    kv_len = key.shape[1]
    q = query.view(b, q_len, q_num_heads, -1).transpose(1, 2)
    k = key.view(b, kv_len, kv_num_heads, -1).transpose(1, 2)
    v = value.view(b, kv_len, kv_num_heads, -1).transpose(1, 2)
    j = torch.arange(kv_len)[None, None, :]
    i = torch.arange(q_len)[None, :, None]
    nonpad = nonpad_kv_seqlen[:, None, None]
    mask = j < nonpad
    if is_causal:
        mask = mask & (j <= i + (nonpad - q_len))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    return out.transpose(1, 2).reshape(b, q_len, -1)


def rope(x, position_ids, n_heads):
    b, s, _ = x.shape
    x = x.view(b, s, n_heads, HEAD_DIM)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ang = position_ids[..., None].float() * inv
    cos, sin = torch.cat((ang, ang), -1)[:, :, None].cos(), torch.cat((ang, ang), -1)[:, :, None].sin()
    x1, x2 = x.chunk(2, -1)
    return (x * cos + torch.cat((-x2, x1), -1) * sin).view(b, s, -1)


class DecoderLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(HIDDEN)
        self.q_proj = nn.Linear(HIDDEN, NUM_HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(HIDDEN, NUM_KV_HEADS * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(NUM_HEADS * HEAD_DIM, HIDDEN, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 64, bias=False), nn.SiLU(), nn.Linear(64, HIDDEN, bias=False))

    def forward(self, h, position_ids, key_cache, value_cache, write_indices, nonpad_kv_seqlen):
        x = self.input_layernorm(h)
        query = rope(self.q_proj(x), position_ids, NUM_HEADS)
        key = rope(self.k_proj(x), position_ids, NUM_KV_HEADS)  # RoPE baked in before caching
        value = self.v_proj(x)
        updated_k = tensor_scatter(key_cache, key, write_indices)
        updated_v = tensor_scatter(value_cache, value, write_indices)
        attn = onnx_attention(query, updated_k, updated_v, nonpad_kv_seqlen, NUM_HEADS, NUM_KV_HEADS)
        h = h + self.o_proj(attn)
        return h + self.mlp(self.post_attention_layernorm(h)), updated_k, updated_v


class StaticCacheCausalLM(nn.Module):
    """Stands in for the ONNX session built by CausalLMTask(static_cache=True)."""

    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(DecoderLayer() for _ in range(NUM_HIDDEN_LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.lm_head = nn.Linear(HIDDEN, VOCAB, bias=False)

    @torch.no_grad()
    def run(self, feeds):
        h = self.embed_tokens(feeds["input_ids"])
        outputs = {}
        for i, layer in enumerate(self.layers):
            h, k, v = layer(h, feeds["position_ids"], feeds[f"key_cache.{i}"], feeds[f"value_cache.{i}"],
                            feeds["write_indices"], feeds["nonpad_kv_seqlen"])
            outputs[f"updated_key_cache.{i}"] = k
            outputs[f"updated_value_cache.{i}"] = v
        outputs["logits"] = self.lm_head(self.norm(h))
        return outputs


def generate(session, input_ids, max_new_tokens):
    batch_size = 1
    kv_hidden = NUM_KV_HEADS * HEAD_DIM
    cache = {}
    for i in range(NUM_HIDDEN_LAYERS):
        cache[f"key_cache.{i}"] = torch.zeros(batch_size, MAX_SEQ_LEN, kv_hidden)
        cache[f"value_cache.{i}"] = torch.zeros(batch_size, MAX_SEQ_LEN, kv_hidden)
    cur_input_ids = input_ids
    write_indices = torch.zeros(batch_size, dtype=torch.long)
    # nonpad_kv_seqlen: number of valid (non-padding) entries in the cache so far.
    nonpad_kv_seqlen = torch.zeros(batch_size, dtype=torch.long)
    generated_ids = []
    for _step in range(max_new_tokens):
        cur_seq_len = cur_input_ids.shape[1]
        start_pos = int(write_indices[0])
        position_ids = torch.arange(start_pos, start_pos + cur_seq_len)[None, :]
        feeds = {
            "input_ids": cur_input_ids,
            "position_ids": position_ids,
            "write_indices": write_indices,
            "nonpad_kv_seqlen": write_indices + cur_seq_len if FIXED else nonpad_kv_seqlen,
            **cache,
        }
        outputs = session.run(feeds)
        next_token = outputs["logits"][:, -1, :].argmax(-1, keepdim=True)
        generated_ids.append(int(next_token[0, 0]))
        for i in range(NUM_HIDDEN_LAYERS):
            cache[f"key_cache.{i}"] = outputs[f"updated_key_cache.{i}"]
            cache[f"value_cache.{i}"] = outputs[f"updated_value_cache.{i}"]
        # Advance write position and valid-length counters
        write_indices = write_indices + cur_seq_len
        nonpad_kv_seqlen = nonpad_kv_seqlen + cur_seq_len
        cur_input_ids = next_token
    return generated_ids


if __name__ == "__main__":
    torch.manual_seed(0)
    session = StaticCacheCausalLM().eval()
    prompt = torch.tensor([[11, 5, 42, 7, 30]])
    print("fixed" if FIXED else "buggy", generate(session, prompt, max_new_tokens=4))
