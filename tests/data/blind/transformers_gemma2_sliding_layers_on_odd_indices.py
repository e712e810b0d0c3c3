# huggingface/transformers#31775: Gemma2 put its sliding-window (local) attention on layers 1, 3, 5, ... and global
# attention on 0, 2, 4, ...; the reference gemma_pytorch uses sliding attention on layers 0, 2, 4, ... .
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Gemma2Config:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 2
    head_dim = 16
    query_pre_attn_scalar = 16
    attn_logit_softcapping = 50.0
    final_logit_softcapping = 30.0
    sliding_window = 3


class Gemma2RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


class Gemma2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = config.query_pre_attn_scalar ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        if FIXED:
            self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else None
        else:
            self.sliding_window = config.sliding_window if layer_idx % 2 else None

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        attn_weights = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.config.attn_logit_softcapping is not None:
            attn_weights = attn_weights / self.config.attn_logit_softcapping
            attn_weights = torch.tanh(attn_weights)
            attn_weights = attn_weights * self.config.attn_logit_softcapping
        if attention_mask is not None:
            causal_mask = attention_mask[:, :, :, : k.shape[-2]]
            attn_weights = attn_weights + causal_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(q.dtype)
        attn_output = torch.matmul(attn_weights, v)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, -1)
        return self.o_proj(attn_output)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Gemma2Attention(config, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, config.intermediate_size), nn.GELU(approximate="tanh"),
                                 nn.Linear(config.intermediate_size, config.hidden_size))
        self.input_layernorm = Gemma2RMSNorm(config.hidden_size)
        self.post_attention_layernorm = Gemma2RMSNorm(config.hidden_size)
        self.is_sliding = (not bool(layer_idx % 2)) if FIXED else bool(layer_idx % 2)
        self.sliding_window = config.sliding_window

    def forward(self, hidden_states, attention_mask):
        if self.is_sliding and attention_mask is not None:
            min_dtype = torch.finfo(hidden_states.dtype).min
            sliding_window_mask = torch.tril(
                torch.ones_like(attention_mask, dtype=torch.bool), diagonal=-self.sliding_window
            )
            attention_mask = torch.where(sliding_window_mask, min_dtype, attention_mask)
        residual = hidden_states
        hidden_states = residual + self.self_attn(self.input_layernorm(hidden_states), attention_mask)
        residual = hidden_states
        return residual + self.mlp(self.post_attention_layernorm(hidden_states))


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = Gemma2RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids):
        hidden_states = self.embed_tokens(input_ids) * math.sqrt(self.config.hidden_size)
        seq_len = input_ids.shape[1]
        min_dtype = torch.finfo(hidden_states.dtype).min
        causal_mask = torch.triu(torch.full((seq_len, seq_len), min_dtype), diagonal=1)[None, None]
        causal_mask = causal_mask.expand(input_ids.shape[0], 1, -1, -1)
        for layer in self.layers:
            hidden_states = layer(hidden_states, causal_mask)
        logits = self.lm_head(self.norm(hidden_states))
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap


config = Gemma2Config()
model = Gemma2ForCausalLM(config).eval()
input_ids = torch.randint(0, config.vocab_size, (1, 10))
with torch.no_grad():
    logits = model(input_ids)
    perturbed = input_ids.clone()
    perturbed[0, 0] = (perturbed[0, 0] + 7) % config.vocab_size
    logits2 = model(perturbed)
print(f"fixed={FIXED} last logits[:3]={[round(x, 4) for x in logits[0, -1, :3].tolist()]} "
      f"effect of token 0 on last token: {(logits[0, -1] - logits2[0, -1]).abs().max().item():.4f}")
