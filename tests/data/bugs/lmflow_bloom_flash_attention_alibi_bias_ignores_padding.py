# LMFlow (OptimalScale/LMFlow commit 9f668252, "fix support for attention_mask"): the Bloom flash-attention patch
# passed alibi * beta as the attention bias without masking padded keys, so left-padded batches attended to pad tokens.
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def build_alibi_tensor(attention_mask, num_heads, dtype):
    """transformers.models.bloom.modeling_bloom.build_alibi_tensor"""
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def flash_attn_qkvpacked_func(qkv, bias=None, causal=False, softmax_scale=None):
    """Reference semantics of LMFlow's triton_flash_attention.flash_attn_qkvpacked_func:
    qkv [b, s, 3, h, d], bias [b, h, 1 or s, s]; qk * softmax_scale + bias, causal, softmax."""
    q, k, v = qkv.unbind(dim=2)
    softmax_scale = softmax_scale or 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bshd,bthd->bhst", q, k) * softmax_scale
    if bias is not None:
        scores = scores + bias
    if causal:
        s = scores.shape[-1]
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    return torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)


def dropout_add(x, residual, prob, training):
    return residual + F.dropout(x, p=prob, training=training)


class BloomAttention(nn.Module):
    def __init__(self, hidden_size=32, n_head=4):
        super().__init__()
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, n_head, hidden_size // n_head
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.pretraining_tp, self.slow_but_exact, self.hidden_dropout = 1, False, 0.0
        self.query_key_value = nn.Linear(hidden_size, 3 * hidden_size)
        self.dense = nn.Linear(hidden_size, hidden_size)

    def _split_heads(self, fused_qkv):
        b, s, _ = fused_qkv.shape
        fused_qkv = fused_qkv.view(b, s, self.num_heads, 3, self.head_dim)
        return fused_qkv[..., 0, :], fused_qkv[..., 1, :], fused_qkv[..., 2, :]

    def _merge_heads(self, x):
        bh, s, d = x.shape
        b = bh // self.num_heads
        return x.view(b, self.num_heads, s, d).permute(0, 2, 1, 3).reshape(b, s, self.num_heads * d)

    # LMFlow's replacement BloomAttention.forward (flash attention), trimmed (no cache, tp == 1)
    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, head_mask=None,
                use_cache=False, output_attentions=False):
        fused_qkv = self.query_key_value(hidden_states)
        (query_layer, key_layer, value_layer) = self._split_heads(fused_qkv)
        batch_size, q_length, _, _ = query_layer.shape
        present = None

        reshaped_alibi = alibi.view(batch_size, self.num_heads, 1, -1)  # '(b h) one s -> b h one s'
        if FIXED:
            reshaped_alibi = reshaped_alibi * self.beta
            attention_mask = (1.0 - attention_mask)
            attention_mask = attention_mask[:, None, None, :].bool()
            reshaped_alibi_masked = reshaped_alibi.masked_fill(attention_mask, -1e9)
        else:
            reshaped_alibi_masked = reshaped_alibi * self.beta

        qkv = torch.concat([query_layer.unsqueeze(2), key_layer.unsqueeze(2), value_layer.unsqueeze(2)], dim=2)
        output = flash_attn_qkvpacked_func(qkv, reshaped_alibi_masked, True, self.inv_norm_factor)
        output = output.permute(0, 2, 1, 3).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        context_layer = self._merge_heads(output)
        output_tensor = self.dense(context_layer)
        output_tensor = dropout_add(output_tensor, residual, self.hidden_dropout, self.training)
        return (output_tensor, present)


class BloomBlock(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.self_attention = BloomAttention(d, h)
        self.post_attention_layernorm = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, hidden_states, alibi, attention_mask):
        ln = self.input_layernorm(hidden_states)
        attn = self.self_attention(ln, hidden_states, alibi, attention_mask)[0]
        return attn + self.mlp(self.post_attention_layernorm(attn))


class BloomModel(nn.Module):
    def __init__(self, vocab=64, d=32, h=4, layers=2):
        super().__init__()
        self.num_heads = h
        self.word_embeddings = nn.Embedding(vocab, d)
        self.word_embeddings_layernorm = nn.LayerNorm(d)
        self.h = nn.ModuleList(BloomBlock(d, h) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)

    def _prepare_attn_mask(self, attention_mask, input_shape, past_key_values_length):
        return attention_mask  # LMFlow patch: keep the 2d key padding mask

    def forward(self, input_ids, attention_mask):
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        alibi = build_alibi_tensor(attention_mask, self.num_heads, hidden_states.dtype)
        causal_mask = self._prepare_attn_mask(attention_mask, input_ids.shape, 0)
        for block in self.h:
            hidden_states = block(hidden_states, alibi, causal_mask)
        return self.ln_f(hidden_states)


model = BloomModel().eval()
lengths = [10, 6]  # Bloom tokenizer pads on the left
T = max(lengths)
input_ids = torch.randint(1, 64, (2, T))
attention_mask = torch.zeros(2, T)
for b, n in enumerate(lengths):
    attention_mask[b, T - n:] = 1
with torch.no_grad():
    batched = model(input_ids, attention_mask)
    diff = 0.0
    for b, n in enumerate(lengths):
        alone = model(input_ids[b:b + 1, T - n:], torch.ones(1, n))
        diff = max(diff, (batched[b, T - n:] - alone[0]).abs().max().item())
print("max |left-padded batch - each sequence alone| on real tokens:", f"{diff:.6f}")
