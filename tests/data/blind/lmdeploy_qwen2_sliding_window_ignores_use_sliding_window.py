# InternLM/lmdeploy#3614: lmdeploy's pytorch Qwen2Attention passed `config.sliding_window` to its Attention layer
# unconditionally, so Qwen2 checkpoints with "use_sliding_window": false still got windowed attention on long prompts.
import sys

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Qwen2Config:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    use_sliding_window = False
    sliding_window = 4
    max_window_layers = 2
    rms_norm_eps = 1e-6


class AttentionMetadata:
    def __init__(self, is_decoding, q_start_loc, q_seqlens, kv_seqlens):
        self.is_decoding = is_decoding
        self.q_start_loc = q_start_loc
        self.q_seqlens = q_seqlens
        self.kv_seqlens = kv_seqlens


class Attention(nn.Module):
    """Reference (torch) attention backend: writes k/v to the cache, attends with a causal/window mask."""

    def __init__(self, num_heads, head_size, num_kv_heads, v_head_size, sliding_window=None):
        super().__init__()
        self.num_heads, self.head_size, self.num_kv_heads = num_heads, head_size, num_kv_heads
        self.sliding_window = sliding_window

    def forward(self, query, key, value, k_cache, v_cache, attn_metadata):
        outputs, q_start = [], 0
        for b, (q_len, kv_len) in enumerate(zip(attn_metadata.q_seqlens.tolist(), attn_metadata.kv_seqlens.tolist())):
            history = kv_len - q_len
            k_cache[b, history:kv_len] = key[q_start:q_start + q_len]
            v_cache[b, history:kv_len] = value[q_start:q_start + q_len]
            q = query[q_start:q_start + q_len].transpose(0, 1)
            k = k_cache[b, :kv_len].transpose(0, 1).repeat_interleave(self.num_heads // self.num_kv_heads, 0)
            v = v_cache[b, :kv_len].transpose(0, 1).repeat_interleave(self.num_heads // self.num_kv_heads, 0)
            q_pos = torch.arange(history, kv_len)[:, None]
            k_pos = torch.arange(kv_len)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None and self.sliding_window > 0:
                mask = mask & (k_pos > q_pos - self.sliding_window)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            outputs.append(out.transpose(0, 1))
            q_start += q_len
        return torch.cat(outputs)


class Qwen2Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        num_heads, num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = config.hidden_size // num_heads
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.qkv_proj = nn.Linear(config.hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, bias=True)
        if FIXED:
            sliding_window = config.sliding_window if getattr(config, "use_sliding_window", False) else None
        else:
            sliding_window = config.sliding_window
        self.attn_fwd = Attention(num_heads, head_dim, num_kv_heads=num_kv_heads, v_head_size=head_dim,
                                  sliding_window=sliding_window)
        self.o_proj = nn.Linear(num_heads * head_dim, config.hidden_size, bias=False)

    def forward(self, hidden_states, past_key_value, attn_metadata):
        qkv = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim,
                             self.num_kv_heads * self.head_dim], dim=-1)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = v.unflatten(-1, (self.num_kv_heads, self.head_dim))
        out = self.attn_fwd(q, k, v, past_key_value[0], past_key_value[1], attn_metadata)
        return self.o_proj(out.flatten(-2))


class Qwen2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen2Attention(config) for _ in range(config.num_hidden_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(config.hidden_size, config.rms_norm_eps)
                                    for _ in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values, attn_metadata):
        hidden_states = self.embed_tokens(input_ids)
        for norm, layer, cache in zip(self.norms, self.layers, past_key_values):
            hidden_states = hidden_states + layer(norm(hidden_states), cache, attn_metadata)
        return self.lm_head(hidden_states)


config = Qwen2Config()
model = Qwen2Model(config).eval()
head_dim = config.hidden_size // config.num_attention_heads


def new_cache():
    return [(torch.zeros(1, 32, config.num_key_value_heads, head_dim), torch.zeros(1, 32, config.num_key_value_heads, head_dim))
            for _ in range(config.num_hidden_layers)]


prompt = torch.randint(0, config.vocab_size, (12,))
with torch.no_grad():
    cache = new_cache()
    prefill = AttentionMetadata(False, torch.tensor([0]), torch.tensor([12]), torch.tensor([12]))
    logits = model(prompt, cache, prefill)
    next_token = logits[-1:].argmax(-1)
    decode = AttentionMetadata(True, torch.tensor([0]), torch.tensor([1]), torch.tensor([13]))
    step_logits = model(next_token, cache, decode)
    # reference: full causal attention over the whole sequence (use_sliding_window is false)
    ref_model_input = torch.cat([prompt, next_token])
    saved_windows = [l.attn_fwd.sliding_window for l in model.layers]
    for l in model.layers:
        l.attn_fwd.sliding_window = None
    ref_logits = model(ref_model_input, new_cache(), AttentionMetadata(False, torch.tensor([0]), torch.tensor([13]),
                                                                        torch.tensor([13])))
    for l, w in zip(model.layers, saved_windows):
        l.attn_fwd.sliding_window = w
print(f"fixed={FIXED} decode-step logits vs full-causal reference: max diff "
      f"{(step_logits[-1] - ref_logits[-1]).abs().max().item():.4f}")
