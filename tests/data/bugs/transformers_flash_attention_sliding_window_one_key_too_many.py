# huggingface/transformers#40163 (fixes #39408): _flash_attention_forward passed
# window_size=(sliding_window, sliding_window), letting each query see sliding_window + 1 keys; fixed to sliding_window - 1.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MistralConfig:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    sliding_window = 4


def flash_attn_func(q, k, v, softmax_scale, causal, window_size=(-1, -1)):
    # flash_attn semantics on (b, s, h, d): query i sees keys j with i - left <= j <= i + right
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    L, S = q.shape[-2], k.shape[-2]
    i = torch.arange(L)[:, None] + (S - L)
    j = torch.arange(S)[None, :]
    allowed = torch.ones(L, S, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    left, right = window_size
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=softmax_scale)
    return out.transpose(1, 2)


def _flash_attention_forward(query_states, key_states, value_states, is_causal, sliding_window=None,
                             softmax_scale=None):
    use_sliding_windows = sliding_window is not None and key_states.shape[1] > sliding_window
    flash_kwargs = {}
    if use_sliding_windows:
        if FIXED:
            flash_kwargs["window_size"] = (sliding_window - 1, sliding_window - 1)
        else:
            flash_kwargs["window_size"] = (sliding_window, sliding_window)
    return flash_attn_func(query_states, key_states, value_states, softmax_scale=softmax_scale,
                           causal=is_causal, **flash_kwargs)


def sdpa_attention_forward(q, k, v, sliding_window, scale):
    # the sdpa path's mask: causal and q_idx - kv_idx < sliding_window
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    L = q.shape[-2]
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    mask = (j <= i) & (i - j < sliding_window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).transpose(1, 2)


class MistralAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.attn_implementation = "flash_attention_2"

    def forward(self, hidden_states):
        b, L, _ = hidden_states.shape
        shape = (b, L, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape)
        k = self.k_proj(hidden_states).view(shape)
        v = self.v_proj(hidden_states).view(shape)
        scale = self.head_dim ** -0.5
        if self.attn_implementation == "flash_attention_2":
            out = _flash_attention_forward(q, k, v, is_causal=True, sliding_window=self.config.sliding_window,
                                           softmax_scale=scale)
        else:
            out = sdpa_attention_forward(q, k, v, self.config.sliding_window, scale)
        return self.o_proj(out.reshape(b, L, -1))


class MistralForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([MistralAttention(config) for _ in range(config.num_hidden_layers)])
        self.norm = nn.LayerNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def set_attn_implementation(self, impl):
        for layer in self.layers:
            layer.attn_implementation = impl

    def forward(self, input_ids):
        h = self.embed_tokens(input_ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.lm_head(self.norm(h))


config = MistralConfig()
model = MistralForCausalLM(config).eval()
input_ids = torch.randint(0, config.vocab_size, (1, 12))  # prefill longer than the window

with torch.no_grad():
    model.set_attn_implementation("sdpa")
    logits_sdpa = model(input_ids)
    model.set_attn_implementation("flash_attention_2")
    logits_fa = model(input_ids)

print(f"fixed={FIXED} max |flash - sdpa| prefill logits: {(logits_fa - logits_sdpa).abs().max().item():.3e}")
