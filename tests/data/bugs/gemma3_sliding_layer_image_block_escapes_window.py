# huggingface/transformers#46850: Gemma3 sliding-attention layers OR-ed the bidirectional image-block mask
# on top of the sliding-window causal mask, so image tokens saw same-image tokens outside the window.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Gemma3TextConfig:
    hidden_size = 32
    num_attention_heads = 4
    head_dim = 8
    sliding_window = 3
    layer_types = ["sliding_attention", "full_attention"]
    vocab_size = 50


def and_masks(*fns):
    return lambda b, h, q, kv: all(f(b, h, q, kv) for f in fns)


def or_masks(*fns):
    return lambda b, h, q, kv: any(f(b, h, q, kv) for f in fns)


def causal_mask_function(b, h, q_idx, kv_idx):
    return kv_idx <= q_idx


def sliding_window_overlay(sliding_window):
    return lambda b, h, q_idx, kv_idx: kv_idx > q_idx - sliding_window


def token_type_ids_mask_function(token_type_ids):
    # image tokens of the same image attend to each other bidirectionally
    is_image = token_type_ids == 1
    prev = F.pad(is_image, (1, 0), value=False)[:, :-1]
    group = torch.cumsum((is_image & ~prev).int(), dim=1) - 1
    group = torch.where(is_image, group, torch.full_like(group, -1))

    def inner(b, h, q_idx, kv_idx):
        return bool(group[b, q_idx] == group[b, kv_idx] and group[b, q_idx] >= 0)

    return inner


def build_mask(fn, batch, length):
    m = torch.zeros(batch, 1, length, length, dtype=torch.bool)
    for b in range(batch):
        for q in range(length):
            for kv in range(length):
                m[b, 0, q, kv] = fn(b, 0, q, kv)
    return m


def create_causal_mask_mapping(config, token_type_ids):
    b, n = token_type_ids.shape
    image_fn = token_type_ids_mask_function(token_type_ids)
    full = build_mask(or_masks(causal_mask_function, image_fn), b, n)
    sliding_causal = and_masks(causal_mask_function, sliding_window_overlay(config.sliding_window))
    if FIXED:
        # AND(sliding_window, OR(causal, blockwise))
        sliding_fn = and_masks(or_masks(causal_mask_function, image_fn), sliding_window_overlay(config.sliding_window))
    else:
        # create_sliding_window_causal_mask(..., or_mask_function=token_type_ids_mask_function(...))
        sliding_fn = or_masks(sliding_causal, image_fn)
    return {"full_attention": full, "sliding_attention": build_mask(sliding_fn, b, n)}


class Gemma3Attention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        self.sliding_window = config.sliding_window if self.layer_type == "sliding_attention" else None
        self.h, self.d = config.num_attention_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, self.h * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, config.hidden_size, bias=False)

    def forward(self, x, attention_mask):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        k = self.k_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.h, self.d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, -1))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.attention_type = config.layer_types[layer_idx]
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.norm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 64), nn.GELU(), nn.Linear(64, config.hidden_size))

    def forward(self, x, attention_mask):
        x = x + self.self_attn(self.norm(x), attention_mask)
        return x + self.mlp(self.norm(x))


class Gemma3Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i) for i in range(len(config.layer_types)))

    def forward(self, input_ids, image_features, token_type_ids):
        x = self.embed_tokens(input_ids)
        x = x.masked_scatter((token_type_ids == 1)[..., None], image_features)
        mapping = create_causal_mask_mapping(self.config, token_type_ids)
        for layer in self.layers:
            x = layer(x, mapping[layer.attention_type])
        return x


config = Gemma3TextConfig()
model = Gemma3Model(config).eval()
# <bos> text <start_of_image> 8 image soft tokens <end_of_image> text
token_type_ids = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
input_ids = torch.randint(0, config.vocab_size, token_type_ids.shape)
image_features = torch.randn(int(token_type_ids.sum()), config.hidden_size)

layer0_out = {}
model.layers[0].register_forward_hook(lambda mod, args, out: layer0_out.__setitem__("h", out))

with torch.no_grad():
    model(input_ids, image_features, token_type_ids)
    ref = layer0_out["h"]
    # perturb the first image token: the last image token is 7 positions later, beyond the sliding window
    feats2 = image_features.clone()
    feats2[0] = torch.randn(config.hidden_size) * 3.0
    model(input_ids, feats2, token_type_ids)
    pert = layer0_out["h"]
    sl_mask = create_causal_mask_mapping(config, token_type_ids)["sliding_attention"][0, 0]
print("mode:", "fixed" if FIXED else "buggy")
print("sliding-layer keys visible to last image token:", sl_mask[10].nonzero().flatten().tolist())
print("sliding-layer change at last image token after perturbing first image token: %.4f" % (pert[0, 10] - ref[0, 10]).abs().max())
