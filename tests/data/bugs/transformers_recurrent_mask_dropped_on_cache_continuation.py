# huggingface/transformers issue #47086, fixed by PR huggingface/transformers#47087 (masking_utils.create_recurrent_attention_mask).
# Bug: the 2D padding mask for the conv / linear-attention layers of hybrid models (LFM2, Bamba, Jamba, Qwen3-Next, ...) was
# returned as None whenever the cache already held a previous state, so padding in a multi-token continued forward leaked into the recurrent/conv state.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Config:
    vocab_size = 40
    hidden_size = 32
    num_attention_heads = 4
    conv_L_cache = 3
    layer_types = ["conv", "full_attention", "conv", "conv"]
    pad_token_id = 0


class HybridCache:
    """Per-layer KV cache for attention layers and conv_states for conv layers."""

    def __init__(self, config):
        self.layer_types = config.layer_types
        self.key_cache = {}
        self.value_cache = {}
        self.conv_states = {}

    def has_previous_state(self):
        return len(self.conv_states) > 0

    def get_seq_length(self):
        for i, t in enumerate(self.layer_types):
            if t == "full_attention" and i in self.key_cache:
                return self.key_cache[i].shape[-2]
        return 0

    def update(self, k, v, layer_idx):
        if layer_idx in self.key_cache:
            k = torch.cat([self.key_cache[layer_idx], k], dim=-2)
            v = torch.cat([self.value_cache[layer_idx], v], dim=-2)
        self.key_cache[layer_idx], self.value_cache[layer_idx] = k, v
        return k, v

    def update_conv_state(self, hidden_states, layer_idx, conv_kernel_size):
        # prepend the cached context so the causal conv sees the previous tokens
        if layer_idx in self.conv_states:
            full = torch.cat([self.conv_states[layer_idx], hidden_states], dim=-1)
        else:
            full = F.pad(hidden_states, (conv_kernel_size - 1, 0))
        self.conv_states[layer_idx] = full[..., -(conv_kernel_size - 1):]
        return full


def create_causal_mask(config, inputs_embeds, attention_mask, past_key_values=None):
    q_len = inputs_embeds.shape[1]
    past = past_key_values.get_seq_length() if past_key_values is not None else 0
    kv_len = past + q_len
    q_idx = torch.arange(past, kv_len)[:, None]
    kv_idx = torch.arange(kv_len)[None, :]
    causal = kv_idx <= q_idx
    return causal[None, None] & attention_mask[:, None, None, :kv_len].bool()


def create_recurrent_attention_mask(config, inputs_embeds, attention_mask, past_key_values=None):
    """Return the 2D padding mask for mamba / linear-attention / conv layers."""
    if attention_mask is None or attention_mask.ndim != 2:
        return None
    if FIXED:
        # Single-token decode never contains padding
        if inputs_embeds.shape[1] == 1:
            return None
        if torch.all(attention_mask == 1):
            return None
        return attention_mask[:, -inputs_embeds.shape[1]:].contiguous()
    else:
        if past_key_values is not None and past_key_values.has_previous_state():
            return None
        if torch.all(attention_mask == 1):
            return None
        return attention_mask


def apply_mask_to_padding_states(hidden_states, attention_mask):
    if attention_mask is not None:
        dtype = hidden_states.dtype
        hidden_states = (hidden_states * attention_mask[:, :, None]).to(dtype)
    return hidden_states


class ShortConv(nn.Module):
    """Lfm2ShortConv (torch fallback path)."""

    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.conv_kernel_size = config.conv_L_cache
        self.conv = nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size=self.conv_kernel_size,
                              groups=config.hidden_size, bias=False, padding=self.conv_kernel_size - 1)
        self.in_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None):
        seq_len = hidden_states.shape[1]
        hidden_states = apply_mask_to_padding_states(hidden_states, attention_mask)
        BCx = self.in_proj(hidden_states).transpose(-1, -2)
        B, C, x = BCx.chunk(3, dim=-2)
        hidden_states = B * x
        full = past_key_values.update_conv_state(hidden_states, self.layer_idx, self.conv_kernel_size)
        out = F.conv1d(full, self.conv.weight, None, padding=0, groups=full.shape[1])[..., -seq_len:]
        y = C * out
        return self.out_proj(y.transpose(-1, -2).contiguous())


class Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.heads = config.num_attention_heads
        self.qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=False)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, past_key_values=None, attention_mask=None):
        b, t, d = hidden_states.shape
        q, k, v = [z.view(b, t, self.heads, -1).transpose(1, 2) for z in self.qkv(hidden_states).chunk(3, -1)]
        k, v = past_key_values.update(k, v, self.layer_idx)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.out_proj(o.transpose(1, 2).reshape(b, t, d))


class HybridModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.norms = nn.ModuleList([nn.LayerNorm(config.hidden_size) for _ in config.layer_types])
        self.layers = nn.ModuleList(
            [Attention(config, i) if t == "full_attention" else ShortConv(config, i)
             for i, t in enumerate(config.layer_types)]
        )
        self.final_norm = nn.LayerNorm(config.hidden_size)

    def forward(self, input_ids, attention_mask, past_key_values):
        inputs_embeds = self.embed_tokens(input_ids)
        mask_kwargs = dict(config=self.config, inputs_embeds=inputs_embeds, attention_mask=attention_mask,
                           past_key_values=past_key_values)
        causal_mask_mapping = {
            "full_attention": create_causal_mask(**mask_kwargs),
            "conv": create_recurrent_attention_mask(**mask_kwargs),
        }
        h = inputs_embeds
        for i, layer in enumerate(self.layers):
            h = h + layer(self.norms[i](h), past_key_values=past_key_values,
                          attention_mask=causal_mask_mapping[self.config.layer_types[i]])
        return self.final_norm(h)


config = Config()
model = HybridModel(config).eval()
PAD = config.pad_token_id

# multi-turn chat: turn 1 is shared, turn 2 is left-padded because the replies differ in length
turn1 = torch.tensor([[5, 9, 13, 2, 7, 11], [5, 9, 13, 2, 7, 11]])
mask1 = torch.ones_like(turn1)
n0 = torch.tensor([3, 8, 12, 4, 6, 21, 17])
n1 = torch.tensor([14, 22, 19])
pad2 = n0.numel() - n1.numel()
turn2 = torch.stack([n0, torch.cat([torch.full((pad2,), PAD), n1])])
mask2 = torch.stack([torch.ones_like(n0), torch.cat([torch.zeros(pad2, dtype=torch.long), torch.ones_like(n1)])])

with torch.no_grad():
    # reference: one forward over the same padded batch
    full = model(torch.cat([turn1, turn2], 1), torch.cat([mask1, mask2], 1), HybridCache(config))
    # continued forward: turn 1, then turn 2 on top of the cache (mask passed for the whole sequence)
    cache = HybridCache(config)
    model(turn1, mask1, cache)
    split = model(turn2, torch.cat([mask1, mask2], 1), cache)

T1 = turn1.shape[1]
real = mask2.bool()
diff = (split - full[:, T1:]).abs().amax(-1)[real].max().item()
print(f"max |continued-forward - single-forward| on real turn-2 tokens: {diff:.3e}")
