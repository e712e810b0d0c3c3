# karpathy/nanochat commit 8b4849d ("fix bug in chat_sft, the attention window must be preserved"): scripts/chat_sft.py
# saves model_config without window_pattern, so a model trained with full-context layers (window_pattern="L") is rebuilt
# from the SFT checkpoint with the default "SSSL" and its S layers silently get a sliding window of sequence_len // 2.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class GPTConfig:
    sequence_len: int = 2048
    vocab_size: int = 32768
    n_layer: int = 12
    n_head: int = 6
    n_kv_head: int = 6
    n_embd: int = 768
    # Sliding window attention pattern string, tiled across layers. Final layer always L.
    window_pattern: str = "SSSL"


def norm(x):
    return F.rms_norm(x, (x.size(-1),))


# nanochat/flash_attention.py, SDPA fallback
def _sdpa_attention(q, k, v, window_size, enable_gqa):
    Tq = q.size(2)
    Tk = k.size(2)
    window = window_size[0]
    if (window < 0 or window >= Tq) and Tq == Tk:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    if Tq == 1:
        if window >= 0 and window < Tk:
            start = max(0, Tk - (window + 1))
            k = k[:, :, start:, :]
            v = v[:, :, start:, :]
        return F.scaled_dot_product_attention(q, k, v, is_causal=False, enable_gqa=enable_gqa)
    device = q.device
    row_idx = (Tk - Tq) + torch.arange(Tq, device=device).unsqueeze(1)
    col_idx = torch.arange(Tk, device=device).unsqueeze(0)
    mask = col_idx <= row_idx
    if window >= 0 and window < Tk:
        mask = mask & ((row_idx - col_idx) <= window)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=enable_gqa)


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    enable_gqa = q.size(1) != k.size(1)
    y = _sdpa_attention(q, k, v, window_size, enable_gqa)
    return y.transpose(1, 2)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head, self.n_kv_head = config.n_head, config.n_kv_head
        self.head_dim = config.n_embd // config.n_head
        self.c_q = nn.Linear(config.n_embd, self.n_head * self.head_dim, bias=False)
        self.c_k = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_v = nn.Linear(config.n_embd, self.n_kv_head * self.head_dim, bias=False)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, window_size):
        B, T, C = x.size()
        q = self.c_q(x).view(B, T, self.n_head, self.head_dim)
        k = self.c_k(x).view(B, T, self.n_kv_head, self.head_dim)
        v = self.c_v(x).view(B, T, self.n_kv_head, self.head_dim)
        q, k = norm(q), norm(k)
        y = flash_attn_func(q, k, v, causal=True, window_size=window_size)
        return self.c_proj(y.contiguous().view(B, T, -1))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attn = CausalSelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.n_embd, 4 * config.n_embd, bias=False), nn.ReLU(),
                                 nn.Linear(4 * config.n_embd, config.n_embd, bias=False))

    def forward(self, x, window_size):
        x = x + self.attn(norm(x), window_size)
        x = x + self.mlp(norm(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.window_sizes = self._compute_window_sizes(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.sequence_len, config.n_embd)  # stands in for rotary (not mask-relevant)
        self.h = nn.ModuleList([Block(config) for _ in range(config.n_layer)])
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def _compute_window_sizes(self, config):
        pattern = config.window_pattern.upper()
        assert all(c in "SL" for c in pattern), f"Invalid window_pattern: {pattern}. Use only S and L."
        long_window = config.sequence_len
        short_window = long_window // 2
        char_to_window = {"L": (long_window, 0), "S": (short_window, 0)}
        window_sizes = []
        for layer_idx in range(config.n_layer):
            char = pattern[layer_idx % len(pattern)]
            window_sizes.append(char_to_window[char])
        window_sizes[-1] = (long_window, 0)
        return window_sizes

    def forward(self, idx):
        T = idx.size(1)
        x = norm(self.wte(idx) + self.wpe(torch.arange(T)))
        for i, block in enumerate(self.h):
            x = block(x, self.window_sizes[i])
        return self.lm_head(norm(x))


# base model trained with full-context attention in every layer (--window-pattern L)
depth, max_seq_len, vocab = 4, 32, 64
model = GPT(GPTConfig(sequence_len=max_seq_len, vocab_size=vocab, n_layer=depth, n_head=4, n_kv_head=4,
                      n_embd=32, window_pattern="L")).eval()

# scripts/chat_sft.py: checkpoint meta_data written with save_checkpoint(...)
model_config = {
    "sequence_len": max_seq_len,
    "vocab_size": vocab,
    "n_layer": depth,
    "n_head": model.config.n_head,
    "n_kv_head": model.config.n_kv_head,
    "n_embd": model.config.n_embd,
}
if FIXED:
    model_config["window_pattern"] = model.config.window_pattern
meta_data = {"step": 0, "model_config": model_config}
state_dict = {k: v.clone() for k, v in model.state_dict().items()}

# checkpoint_manager.build_model: GPTConfig(**meta_data["model_config"]) then load_state_dict
reloaded = GPT(GPTConfig(**meta_data["model_config"])).eval()
reloaded.load_state_dict(state_dict)

idx = torch.randint(0, vocab, (2, max_seq_len))
with torch.no_grad():
    diff = (reloaded(idx) - model(idx)).abs().max().item()
print(f"reloaded window_sizes = {reloaded.window_sizes}")
print(f"max |logits(reloaded SFT checkpoint) - logits(trained model)|: {diff:.3e}")
