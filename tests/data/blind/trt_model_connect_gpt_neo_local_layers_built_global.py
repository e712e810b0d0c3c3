# NVIDIA/TensorRT-Model-Connect#653: the GPT-Neo engine builder gave every decoder layer the plain causal mask,
# ignoring config.attention_types, so "local" layers attended past window_size. Fix: expand attention_types per
# layer and add the sliding-window mask only to local layers.
import sys

import torch
import torch.nn.functional as F
from transformers import GPTNeoConfig, GPTNeoModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def expand_attention_types(config):
    layer_types = []
    for types, repeat in config.attention_types:
        for _ in range(repeat):
            layer_types.extend(types)
    if len(layer_types) != config.num_layers:
        raise ValueError(f"attention_types expands to {len(layer_types)} layers, expected {config.num_layers}")
    return layer_types


def build_causal_mask(seq_len, window_size=None):
    q = torch.arange(seq_len)[:, None]
    k = torch.arange(seq_len)[None, :]
    allowed = k <= q
    if window_size is not None:
        allowed = allowed & (q - k < window_size)
    mask = torch.zeros(seq_len, seq_len)
    return mask.masked_fill(~allowed, torch.finfo(torch.float32).min)


class GPTNeoEngine:
    """Eager reference of the network the builder emits (weights taken from the HF checkpoint)."""

    def __init__(self, hf_model, config):
        self.m = hf_model
        self.config = config
        if FIXED:
            self.layer_types = expand_attention_types(config)
        else:
            self.layer_types = ["global"] * config.num_layers

    def attention_mask_for_layer(self, layer_idx, seq_len):
        if self.layer_types[layer_idx] == "local":
            return build_causal_mask(seq_len, window_size=self.config.window_size)
        return build_causal_mask(seq_len)

    def forward(self, input_ids):
        cfg = self.config
        B, T = input_ids.shape
        nh, hd = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        h = self.m.wte(input_ids) + self.m.wpe(torch.arange(T))[None]
        for i, block in enumerate(self.m.h):
            x = block.ln_1(h)
            att = block.attn.attention
            q = att.q_proj(x).view(B, T, nh, hd).transpose(1, 2)
            k = att.k_proj(x).view(B, T, nh, hd).transpose(1, 2)
            v = att.v_proj(x).view(B, T, nh, hd).transpose(1, 2)
            mask = self.attention_mask_for_layer(i, T)
            # GPT-Neo does not scale the attention scores
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0)
            h = h + att.out_proj(o.transpose(1, 2).reshape(B, T, -1))
            h = h + block.mlp(block.ln_2(h))
        return self.m.ln_f(h)


config = GPTNeoConfig(vocab_size=64, max_position_embeddings=32, hidden_size=32, num_layers=4, num_heads=4,
                      attention_types=[[["global", "local"], 2]], window_size=4, intermediate_size=64,
                      bos_token_id=0, eos_token_id=0)
hf = GPTNeoModel(config).eval()
engine = GPTNeoEngine(hf, config)

input_ids = torch.randint(1, 64, (2, 12))
with torch.no_grad():
    out = engine.forward(input_ids)
    ref = hf(input_ids).last_hidden_state
print(f"fixed={FIXED} layer types={engine.layer_types} max |engine - HF GPTNeoModel| = {(out - ref).abs().max().item():.3e}")
