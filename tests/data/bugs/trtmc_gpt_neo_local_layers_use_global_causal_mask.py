# NVIDIA/TensorRT-Model-Connect commit 78c8085f1 ("fix(gpt-neo): honor local attention layers").
# The GPT-Neo plugin ignored the Hugging Face local/global attention pattern ("our causal mask handles it"): every
# decoder layer got the plain causal mask, so the local layers attended past their window_size. The fix expands the
# pattern per layer and adds a sliding-window penalty (add_local_attention_mask_2d) to the mask of the local layers.
# Ported from the TensorRT graph builder to torch; a static KV cache of max_cache_length, prefill then decode.
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

RAW_CONFIG = {
    "hidden_size": 64,
    "num_heads": 4,
    "num_layers": 4,
    "vocab_size": 97,
    "max_position_embeddings": 64,
    "window_size": 4,
    "attention_types": [[["global", "local"], 2]],
}


def resolve_attention_layer_types(raw_config, *, num_layers):
    """Return one validated attention type for every decoder layer."""
    configured = raw_config.get("attention_layers")
    if configured is not None:
        layer_types = list(configured)
    else:
        layer_types = []
        for entry in raw_config.get("attention_types") or []:
            pattern, repeats = entry
            layer_types.extend(list(pattern) * int(repeats))
    if not layer_types:
        layer_types = ["global"] * num_layers
    return tuple(str(layer_type).lower() for layer_type in layer_types)


def resolve_local_attention_window(raw_config, layer_types):
    window = int(raw_config.get("window_size") or 0)
    if "local" in layer_types and window <= 0:
        raise ValueError("GPT-Neo local attention layers require a positive window_size")
    return window


def add_local_attention_mask_2d(attention_mask, position_id, *, max_cache_length, window_size):
    """Add GPT-Neo's local-window restriction to a runtime causal mask."""
    cache_positions = torch.arange(max_cache_length, dtype=torch.int32)
    key_positions = torch.cat([cache_positions, position_id])
    key_2d = key_positions.reshape(1, -1)
    query_2d = position_id.reshape(-1, 1)
    oldest_visible = query_2d - (window_size - 1)
    out_of_window = key_2d < oldest_visible
    local_penalty = torch.where(out_of_window, torch.tensor(-1e9), torch.tensor(0.0)).to(attention_mask.dtype)
    return attention_mask + local_penalty


def make_weights(cfg):
    h = cfg["hidden_size"]
    g = lambda *s: torch.randn(*s) * 0.1
    w = {"wte": g(cfg["vocab_size"], h), "wpe": g(cfg["max_position_embeddings"], h)}
    for i in range(cfg["num_layers"]):
        p = f"layer.{i}"
        for n in ("q", "k", "v"):
            w[f"{p}.attn.{n}.weight"] = g(h, h)
        w[f"{p}.attn.o.weight"], w[f"{p}.attn.o.bias"] = g(h, h), g(h)
        w[f"{p}.mlp.fc.weight"], w[f"{p}.mlp.fc.bias"] = g(4 * h, h), g(4 * h)
        w[f"{p}.mlp.proj.weight"], w[f"{p}.mlp.proj.bias"] = g(h, 4 * h), g(h)
    return w


def _add_decoder_layer(hidden, cache_k, cache_v, attention_mask, position_id, weights, prefix, num_heads):
    seq, h = hidden.shape
    hd = h // num_heads
    x = F.layer_norm(hidden, (h,))
    q = (x @ weights[f"{prefix}.attn.q.weight"].T).reshape(seq, num_heads, hd).transpose(0, 1)
    k = (x @ weights[f"{prefix}.attn.k.weight"].T).reshape(seq, num_heads, hd).transpose(0, 1)
    v = (x @ weights[f"{prefix}.attn.v.weight"].T).reshape(seq, num_heads, hd).transpose(0, 1)
    keys = torch.cat([cache_k, k], dim=1)
    values = torch.cat([cache_v, v], dim=1)
    scores = q @ keys.transpose(-1, -2)  # scale_attn_weights=False
    scores = scores + attention_mask[None]
    ctx = scores.softmax(-1) @ values
    attn = ctx.transpose(0, 1).reshape(seq, h) @ weights[f"{prefix}.attn.o.weight"].T + weights[f"{prefix}.attn.o.bias"]
    hidden = hidden + attn
    y = F.layer_norm(hidden, (h,))
    y = F.gelu(y @ weights[f"{prefix}.mlp.fc.weight"].T + weights[f"{prefix}.mlp.fc.bias"], approximate="tanh")
    hidden = hidden + y @ weights[f"{prefix}.mlp.proj.weight"].T + weights[f"{prefix}.mlp.proj.bias"]
    # write the new keys/values into the static cache slots of their positions
    new_k, new_v = cache_k.clone(), cache_v.clone()
    new_k[:, position_id.long()] = k
    new_v[:, position_id.long()] = v
    return hidden, new_k, new_v


def runtime_attention_mask(position_id, past_length, max_cache_length):
    """Additive mask the runtime feeds the engine: valid cache slots plus a causal block for the new tokens."""
    seq = position_id.shape[0]
    cache_part = torch.where(torch.arange(max_cache_length) < past_length, 0.0, -1e9).expand(seq, -1)
    causal = torch.triu(torch.full((seq, seq), -1e9), diagonal=1)
    return torch.cat([cache_part, causal], dim=1)


def decoder_step(input_ids, position_id, past_length, caches, weights, cfg, attention_layer_types,
                 local_attention_window, max_cache_length):
    hidden_state = weights["wte"][input_ids] + weights["wpe"][position_id.long()]
    attention_mask = runtime_attention_mask(position_id, past_length, max_cache_length)
    local_attention_mask = None
    if FIXED and attention_layer_types and "local" in attention_layer_types and local_attention_window > 0:
        local_attention_mask = add_local_attention_mask_2d(
            attention_mask, position_id, max_cache_length=max_cache_length, window_size=local_attention_window)
    new_caches = []
    for layer_idx in range(cfg["num_layers"]):
        prefix = f"layer.{layer_idx}"
        layer_attention_mask = (
            local_attention_mask
            if (local_attention_mask is not None
                and layer_idx < len(attention_layer_types or ())
                and attention_layer_types[layer_idx] == "local")
            else attention_mask
        )
        hidden_state, ck, cv = _add_decoder_layer(hidden_state, *caches[layer_idx], layer_attention_mask,
                                                  position_id, weights, prefix, cfg["num_heads"])
        new_caches.append((ck, cv))
    hidden_state = F.layer_norm(hidden_state, (cfg["hidden_size"],))
    return hidden_state @ weights["wte"].T, new_caches


cfg = RAW_CONFIG
weights = make_weights(cfg)
attention_layer_types = resolve_attention_layer_types(cfg, num_layers=cfg["num_layers"])
local_attention_window = resolve_local_attention_window(cfg, attention_layer_types)
max_cache_length = 32
hd = cfg["hidden_size"] // cfg["num_heads"]
caches = [(torch.zeros(cfg["num_heads"], max_cache_length, hd), torch.zeros(cfg["num_heads"], max_cache_length, hd))
          for _ in range(cfg["num_layers"])]

prompt = torch.randint(0, cfg["vocab_size"], (10,))
positions = torch.arange(10, dtype=torch.int32)
logits, caches = decoder_step(prompt, positions, 0, caches, weights, cfg, attention_layer_types,
                              local_attention_window, max_cache_length)
generated = []
past = 10
token = logits[-1].argmax()
for _ in range(6):
    generated.append(int(token))
    logits, caches = decoder_step(token[None], torch.tensor([past], dtype=torch.int32), past, caches, weights, cfg,
                                  attention_layer_types, local_attention_window, max_cache_length)
    past += 1
    token = logits[-1].argmax()
print("generated", generated, f"last logit norm {logits.norm().item():.6f}")
