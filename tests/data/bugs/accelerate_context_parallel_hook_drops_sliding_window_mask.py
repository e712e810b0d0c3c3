"""accelerate context parallelism: the self_attn pre-hook swaps every layer's mask for ``is_causal=True``.

Citation: huggingface/accelerate#4177 ("Refuse context parallelism for models with sliding-window or chunked
attention layers", merged).

Bug: ``_attach_context_parallel_hooks`` registers on every ``self_attn`` module

    def _self_attn_pre_forward_hook(_module, module_args, module_kwargs):
        if "attention_mask" in module_kwargs:
            module_kwargs["attention_mask"] = None
            module_kwargs["is_causal"] = True
        return module_args, module_kwargs

whose docstring promised to check that the mask is causal and raise otherwise; it discards whatever mask the
layer was given.  For a model whose config declares sliding-window layers (gpt-oss, Gemma 3/4, Mistral...)
those layers silently train with full causal attention.

Fix (#4177): context parallelism is refused (a ValueError naming the sliding / chunked layers) for such
models.  This program's ``--fixed`` run follows the fix the way a user meets it: preparing CP raises, the
program reports it in one line and runs the step without the hook, so each layer keeps its own mask.

The model is written like a transformers decoder (a config with ``sliding_window`` and ``layer_types``, a
mask per layer type handed to ``self_attn`` as ``attention_mask``, an SDPA attention function that uses
``is_causal`` when no mask is given).  Sequence 16, window 4: buggy, the sliding layers see 16 causal keys.
Only the PR description was read, not the diff.
"""
import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class GptOssConfig:
    model_type: str = "gpt_oss"
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 4
    sliding_window: int = 4
    layer_types: list = field(default_factory=lambda: ["sliding_attention", "full_attention"] * 2)


def sdpa_attention_forward(module, query, key, value, attention_mask, is_causal=None, **kwargs):
    if is_causal is None:
        is_causal = query.shape[2] > 1 and attention_mask is None
    return F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask, is_causal=is_causal)


class GptOssAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.sliding_window = config.sliding_window if config.layer_types[layer_idx] == "sliding_attention" else None

    def forward(self, hidden_states, attention_mask=None, is_causal=None, **kwargs):
        B, L, _ = hidden_states.shape
        shape = (B, L, self.num_heads, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        out = sdpa_attention_forward(self, q, k, v, attention_mask, is_causal=is_causal)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class GptOssDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = GptOssAttention(config, layer_idx)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.SiLU(), nn.Linear(64, config.hidden_size))
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size)
        self.attention_type = config.layer_types[layer_idx]

    def forward(self, hidden_states, attention_mask=None):
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states), attention_mask=attention_mask)
        return h + self.mlp(self.post_attention_layernorm(h))


def create_causal_mask(seq_len):
    idx = torch.arange(seq_len)
    return (idx[None, :] <= idx[:, None])[None, None]


def create_sliding_window_causal_mask(seq_len, sliding_window):
    idx = torch.arange(seq_len)
    return ((idx[None, :] <= idx[:, None]) & (idx[:, None] - idx[None, :] < sliding_window))[None, None]


class GptOssForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GptOssDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, labels=None):
        h = self.embed_tokens(input_ids)
        L = input_ids.shape[1]
        causal_mask_mapping = {
            "full_attention": create_causal_mask(L),
            "sliding_attention": create_sliding_window_causal_mask(L, self.config.sliding_window),
        }
        for layer in self.layers:
            h = layer(h, attention_mask=causal_mask_mapping[layer.attention_type])
        logits = self.lm_head(h)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))


def _self_attn_pre_forward_hook(_module, module_args, module_kwargs):
    """Check if the attention mask is causal: if so add ``is_causal=True``, otherwise raise an error."""
    if "attention_mask" in module_kwargs:
        module_kwargs["attention_mask"] = None
        module_kwargs["is_causal"] = True
    return module_args, module_kwargs


def _attach_context_parallel_hooks(model):
    if FIXED:
        config = getattr(model, "config", None)
        layer_types = getattr(config, "layer_types", None) or []
        bad = sorted({t for t in layer_types if t in ("sliding_attention", "chunked_attention")})
        if bad or getattr(config, "sliding_window", None) and not layer_types:
            raise ValueError(
                f"Context parallelism does not support models with {', '.join(bad) or 'sliding_window'} layers: "
                "their masks would be replaced by full causal attention."
            )
    for name, module in model.named_modules():
        if name.endswith("self_attn"):
            module.register_forward_pre_hook(_self_attn_pre_forward_hook, with_kwargs=True, prepend=True)


def main():
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig())
    try:
        _attach_context_parallel_hooks(model)
    except ValueError as err:
        print(f"context parallelism refused: {err}")
    input_ids = torch.randint(0, 64, (2, 16))
    loss = model(input_ids, labels=input_ids)
    loss.backward()
    print(f"{'fixed' if FIXED else 'buggy'} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
