# qwopqwop200/GPTQ-for-LLaMa#183, fixed by #187: the fused QuantLlamaAttention called
# F.scaled_dot_product_attention with no mask and no is_causal, so the prompt pass was bidirectional.
import sys
import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=64, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        t = torch.arange(max_position_embeddings).float()
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :], persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :], persistent=False)

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len], self.sin_cached[:, :, :seq_len]


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids):
    cos = cos.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    sin = sin.squeeze(1).squeeze(0)[position_ids].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class QuantLlamaAttention(nn.Module):
    """Multi-headed attention from 'Attention Is All You Need' paper"""

    def __init__(self, hidden_size, num_heads, qkv_proj, o_proj, rotary_emb):
        super().__init__()
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = qkv_proj
        self.o_proj = o_proj
        self.rotary_emb = rotary_emb

    def forward(self, hidden_states, past_key_value=None, attention_mask=None, position_ids=None,
                output_attentions=False, use_cache=False):
        bsz, q_len, _ = hidden_states.size()
        qkv_states = self.qkv_proj(hidden_states)
        query_states, key_states, value_states = torch.split(qkv_states, self.hidden_size, dim=2)
        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]
        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, position_ids)

        is_causal = past_key_value is None
        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        past_key_value = (key_states, value_states) if use_cache else None

        # upstream wraps this in torch.backends.cuda.sdp_kernel(enable_math=False) on the GPU
        if FIXED:
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states,
                                                         is_causal=is_causal)
        else:
            attn_output = F.scaled_dot_product_attention(query_states, key_states, value_states)

        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), None, past_key_value


class DecoderLayer(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.post_attention_layernorm = nn.LayerNorm(hidden)
        self.self_attn = QuantLlamaAttention(hidden, heads, nn.Linear(hidden, 3 * hidden, bias=False),
                                             nn.Linear(hidden, hidden, bias=False),
                                             LlamaRotaryEmbedding(hidden // heads))
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.SiLU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, past_key_value, position_ids, use_cache):
        h, _, present = self.self_attn(self.input_layernorm(x), past_key_value=past_key_value,
                                       position_ids=position_ids, use_cache=use_cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), present


class TinyLlama(nn.Module):
    def __init__(self, vocab=50, hidden=32, heads=4, layers=2):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList([DecoderLayer(hidden, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, past_key_values=None, use_cache=True):
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[-2]
        position_ids = torch.arange(past_len, past_len + input_ids.shape[1])[None]
        x = self.embed_tokens(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            x, present = layer(x, None if past_key_values is None else past_key_values[i], position_ids, use_cache)
            presents.append(present)
        return self.lm_head(self.norm(x)), presents


def reference_logits(model, ids):
    # the same weights, run token by token through the cache: each token sees only its past
    past, out = None, []
    for t in range(ids.shape[1]):
        logits, past = model(ids[:, t:t + 1], past_key_values=past)
        out.append(logits)
    return torch.cat(out, dim=1)


model = TinyLlama().eval()
prompt = torch.randint(0, 50, (1, 9))
with torch.no_grad():
    logits, past = model(prompt)  # prefill with use_cache, as generate() does
    generated = []
    tok = logits[:, -1:].argmax(-1)
    for _ in range(4):
        generated.append(tok.item())
        logits_step, past = model(tok, past_key_values=past)
        tok = logits_step[:, -1:].argmax(-1)
    ref = reference_logits(model, prompt)

print("fixed" if FIXED else "buggy", "prompt logits max |diff| vs token-by-token:",
      f"{(logits - ref).abs().max().item():.4f}", "generated:", generated)
