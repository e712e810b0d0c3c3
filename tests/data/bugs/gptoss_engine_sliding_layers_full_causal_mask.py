"""GPT-OSS engine builder: every layer gets the full causal mask, the sliding_attention layers lose their window.

Citation: NVIDIA/TensorRT-Model-Connect#400 "fix(gpt-oss): apply YaRN scaling and sliding-window attention"
(merged, fixes #399). GPT-OSS engines produced garbage for prompts longer than 128 tokens. One of the two
defects: the HF config's ``layer_types`` alternates ``sliding_attention`` (window 128) and ``full_attention``,
but every layer received the same full causal mask. The fix reads ``sliding_window`` / ``layer_types`` from the
config and gives the sliding layers a banded causal mask.

The PR builds TensorRT engines; I could read its description, not the builder's code, so this is a torch port of
the pattern it describes: an attention-with-sinks block written like the openai/gpt-oss torch reference
(``sdpa`` concatenates the per-head sink logit before the softmax), a per-layer mask built from the HF-style
config dict, and a prompt longer than the (scaled-down) window so the sliding layers would drop early keys.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

HF_CONFIG = {
    "model_type": "gpt_oss",
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 4,
    "sliding_window": 4,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "vocab_size": 97,
    "rope_theta": 150000.0,
}


def build_layer_mask(config, layer_idx, n_tokens):
    """Additive mask for one layer's prefill (0 = attend, -inf = blocked)."""
    mask = torch.triu(torch.full((n_tokens, n_tokens), -float("inf")), diagonal=1)
    if FIXED:
        if config["layer_types"][layer_idx] == "sliding_attention":
            sliding_window = config["sliding_window"]
            mask += torch.tril(torch.full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    return mask


def sdpa(Q, K, V, S, sm_scale, mask):
    # Q: [n_tokens, n_kv_heads, q_mult, d_head]; K, V: [n_tokens, n_kv_heads, d_head]
    n_tokens, n_heads, q_mult, d_head = Q.shape
    K = K[:, :, None, :].expand(-1, -1, q_mult, -1)
    V = V[:, :, None, :].expand(-1, -1, q_mult, -1)
    S = S.reshape(n_heads, q_mult, 1, 1).expand(-1, -1, n_tokens, -1)
    QK = torch.einsum("qhmd,khmd->hmqk", Q, K)
    QK *= sm_scale
    QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]
    attn = torch.einsum("hmqk,khmd->qhmd", W, V)
    return attn.reshape(n_tokens, -1)


def rope(x, positions, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2).float() / d))
    ang = positions[:, None].float() * inv[None, :]
    cos, sin = ang.cos(), ang.sin()
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class AttentionBlock(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = config["head_dim"]
        self.num_attention_heads = config["num_attention_heads"]
        self.num_key_value_heads = config["num_key_value_heads"]
        self.sinks = nn.Parameter(torch.randn(config["num_attention_heads"]))
        self.norm = nn.RMSNorm(config["hidden_size"], eps=1e-5)
        qkv_dim = self.head_dim * (self.num_attention_heads + 2 * self.num_key_value_heads)
        self.qkv = nn.Linear(config["hidden_size"], qkv_dim)
        self.out = nn.Linear(self.head_dim * self.num_attention_heads, config["hidden_size"])
        self.sm_scale = 1 / math.sqrt(self.head_dim)
        self.theta = config["rope_theta"]

    def forward(self, x, mask):
        n_tokens = x.shape[0]
        t = self.norm(x)
        qkv = self.qkv(t)
        q_end = self.num_attention_heads * self.head_dim
        k_end = q_end + self.num_key_value_heads * self.head_dim
        q = qkv[:, :q_end].view(n_tokens, self.num_key_value_heads,
                                self.num_attention_heads // self.num_key_value_heads, self.head_dim)
        k = qkv[:, q_end:k_end].view(n_tokens, self.num_key_value_heads, self.head_dim)
        v = qkv[:, k_end:].view(n_tokens, self.num_key_value_heads, self.head_dim)
        positions = torch.arange(n_tokens)
        q, k = rope(q, positions, self.theta), rope(k, positions, self.theta)
        t = sdpa(q, k, v, self.sinks, self.sm_scale, mask)
        return x + self.out(t)


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.block = nn.ModuleList([AttentionBlock(config, i) for i in range(config["num_hidden_layers"])])
        self.norm = nn.RMSNorm(config["hidden_size"], eps=1e-5)
        self.unembedding = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)

    def forward(self, tokens):
        x = self.embedding(tokens)
        n_tokens = tokens.shape[0]
        for i, block in enumerate(self.block):
            x = block(x, build_layer_mask(self.config, i, n_tokens))
        return self.unembedding(self.norm(x))


def main():
    torch.manual_seed(0)
    model = Transformer(HF_CONFIG).eval()
    tokens = torch.randint(0, HF_CONFIG["vocab_size"], (12,))
    with torch.no_grad():
        logits = model(tokens)
    print("next token", int(logits[-1].argmax()), "logit", round(float(logits[-1].max()), 4))


if __name__ == "__main__":
    main()
