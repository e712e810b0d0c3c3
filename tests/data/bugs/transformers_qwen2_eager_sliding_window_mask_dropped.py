# huggingface/transformers#35924 (fixed by #36162): after the attention refactor, Qwen2's
# _prepare_4d_causal_attention_mask_with_cache_position no longer applied config.sliding_window,
# so eager attention on sliding layers attended to the whole causal prefix.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Qwen2Config:
    vocab_size = 64
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    use_sliding_window = True
    sliding_window = 4
    max_window_layers = 2


def _prepare_4d_causal_attention_mask_with_cache_position(
    attention_mask, sequence_length, target_length, dtype, cache_position, batch_size, config
):
    min_dtype = torch.finfo(dtype).min
    causal_mask = torch.full((sequence_length, target_length), fill_value=min_dtype, dtype=dtype)
    diagonal_attend_mask = torch.arange(target_length) > cache_position.reshape(-1, 1)
    if FIXED and config.sliding_window is not None:
        # the window is re-applied in the fix
        sliding_attend_mask = torch.arange(target_length) <= (cache_position.reshape(-1, 1) - config.sliding_window)
        diagonal_attend_mask.bitwise_or_(sliding_attend_mask)
    causal_mask *= diagonal_attend_mask
    causal_mask = causal_mask[None, None, :, :].expand(batch_size, 1, -1, -1)
    if attention_mask is not None:
        causal_mask = causal_mask.clone()
        mask_length = attention_mask.shape[-1]
        padding_mask = causal_mask[:, :, :, :mask_length] + attention_mask[:, None, None, :].to(dtype)
        padding_mask = padding_mask == 0
        causal_mask[:, :, :, :mask_length] = causal_mask[:, :, :, :mask_length].masked_fill(padding_mask, min_dtype)
    return causal_mask


def eager_attention_forward(module, query, key, value, attention_mask, scaling, sliding_window=None):
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask[:, :, :, : key.shape[-2]]
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(attn_weights, value).transpose(1, 2).contiguous()


class Qwen2Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.sliding_window = None
        if config.use_sliding_window and layer_idx < config.max_window_layers:
            self.sliding_window = config.sliding_window

    def forward(self, hidden_states, attention_mask):
        b, t, _ = hidden_states.shape
        shape = (b, t, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = eager_attention_forward(self, q, k, v, attention_mask, self.scaling, sliding_window=self.sliding_window)
        return self.o_proj(out.reshape(b, t, -1))


class Qwen2Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Qwen2Attention(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask):
        h = self.embed_tokens(input_ids)
        b, t = input_ids.shape
        cache_position = torch.arange(t)
        causal_mask = _prepare_4d_causal_attention_mask_with_cache_position(
            attention_mask, t, t, h.dtype, cache_position, b, self.config
        )
        for layer in self.layers:
            h = h + layer(h, causal_mask)
        return self.norm(h)


def reference(model, input_ids):
    # recompute with an explicit window: key j visible to query i iff i - W < j <= i
    t = input_ids.shape[1]
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    allowed = (j <= i) & (j > i - model.config.sliding_window)
    mask = torch.zeros(t, t).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    h = model.embed_tokens(input_ids)
    for layer in model.layers:
        h = h + layer(h, mask)
    return model.norm(h)


config = Qwen2Config()
model = Qwen2Model(config).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 12))
attention_mask = torch.ones_like(input_ids)
with torch.no_grad():
    out = model(input_ids, attention_mask)
    ref = reference(model, input_ids)
print(f"fixed={FIXED} max |out - windowed reference| = {(out - ref).abs().max().item():.4e}")
