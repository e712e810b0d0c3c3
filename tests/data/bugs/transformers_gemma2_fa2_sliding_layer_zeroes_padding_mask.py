# huggingface/transformers#31670: Gemma2DecoderLayer applied its sliding-window tril to the attention mask
# for every backend; under flash_attention_2 that mask is the 2D [batch, seq] padding mask, so real tokens
# were zeroed out (treated as padding) on sliding layers. Fix: skip it for FA2, which gets sliding_window.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Gemma2Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    sliding_window = 8
    query_pre_attn_scalar = 8
    _attn_implementation = "flash_attention_2"


def _flash_attention_forward(query, key, value, attention_mask, query_length, is_causal, sliding_window=None,
                             softmax_scale=None):
    # CPU stand-in for flash_attn_varlen_func: tokens with attention_mask == 0 are unpadded away,
    # causal attention among the kept tokens, window_size=(sliding_window - 1, 0).
    b, t = attention_mask.shape
    keep = attention_mask.bool()
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = (j <= i) if is_causal else torch.ones(t, t, dtype=torch.bool)
    if sliding_window is not None:
        allowed = allowed & (i - j < sliding_window)
    mask = allowed[None, None] & keep[:, None, None, :] & keep[:, None, :, None]
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=softmax_scale)
    out = out.transpose(1, 2)
    return out.masked_fill(~keep[:, :, None, None], 0.0)  # pad_input puts zeros at unpadded positions


class Gemma2FlashAttention2(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = config.query_pre_attn_scalar**-0.5
        self.is_causal = True
        self.sliding_window = config.sliding_window if not bool(layer_idx % 2) else None
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask):
        bsz, q_len, _ = hidden_states.shape
        shape = (bsz, q_len, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        attn_output = _flash_attention_forward(q, k, v, attention_mask, q_len, is_causal=self.is_causal,
                                               sliding_window=self.sliding_window, softmax_scale=self.scaling)
        return self.o_proj(attn_output.reshape(bsz, q_len, -1))


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.is_sliding = not bool(layer_idx % 2)
        self.sliding_window = config.sliding_window
        self.self_attn = Gemma2FlashAttention2(config, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, hidden_states, attention_mask, cache_position):
        if self.is_sliding and attention_mask is not None and (
            not FIXED or self.config._attn_implementation != "flash_attention_2"
        ):  # efficient SDPA and no padding
            attention_mask = attention_mask * torch.tril(
                torch.ones_like(attention_mask), diagonal=(self.sliding_window - cache_position[-1])
            )
            if cache_position[0] > 0:
                attention_mask = attention_mask[:, -self.sliding_window:]
        hidden_states = hidden_states + self.self_attn(hidden_states, attention_mask)
        return hidden_states + self.mlp(hidden_states)


class Gemma2ForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma2DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask, labels):
        h = self.embed_tokens(input_ids)
        cache_position = torch.arange(input_ids.shape[1])
        for layer in self.layers:
            h = layer(h, attention_mask, cache_position)
        logits = self.lm_head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return loss, logits


config = Gemma2Config()
model = Gemma2ForCausalLM(config)
input_ids = torch.randint(0, config.vocab_size, (3, 10))
attention_mask = torch.ones_like(input_ids)  # no padding at all
loss, logits = model(input_ids, attention_mask, labels=input_ids)
loss.backward()

# reference: same weights, the 2D mask left untouched (FA2 applies the window itself)
with torch.no_grad():
    h = model.embed_tokens(input_ids)
    for layer in model.layers:
        h = h + layer.self_attn(h, attention_mask)
        h = h + layer.mlp(h)
    ref = model.lm_head(h)
print(f"fixed={FIXED} train loss={loss.item():.4f} max |logits - reference| = {(logits - ref).abs().max().item():.4e}")
