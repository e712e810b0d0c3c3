# Citation: NVIDIA/Megatron-LM#2771 ("Align gpt-oss window-size with 128-token sliding window", merged;
#   question NVIDIA/Megatron-LM#3690). PR description read, not the diff.
# Upstream: examples/gptoss/02_train.sh and examples/post_training/modelopt/conf/openai/gpt-oss-{20b,120b}.sh
#   pass `--window-size 128,0 --window-attn-skip-freq 2`; megatron/training/arguments.py parses it with
#   tuple_type into TransformerConfig.window_size; megatron/core/transformer/utils.py
#   is_layer_window_attention picks the sliding layers; the attention kernel (TE / flash-attn) takes
#   window_size=(left, right) with the inclusive bounds [i - left, i + right]
#   (megatron's get_sliding_window_causal_mask builds the same band as a dense mask, used here as a
#   plain-torch stand-in for the kernel).
# Bug: GPT-OSS's sliding_window = 128 counts the current token; with (left, right) = (128, 0) every
#   query on a sliding layer sees 129 keys (itself and 128 earlier ones), one key more than the model.
# Fix: the scripts pass `--window-size 127,0`.
#
# Tiny CPU model: 4 layers, hidden 32, 2 heads, sequences of 160 tokens (past the 128 window),
# window on every layer whose 1-indexed number is not a multiple of 2; one LM loss is printed.
import argparse
import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import List, Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# the two flags as the example script writes them
SCRIPT_ARGS = ["--window-size", "127,0" if FIXED else "128,0", "--window-attn-skip-freq", "2"]


def tuple_type(x):
    if x is None or isinstance(x, tuple):
        return x
    assert isinstance(x, str)
    return tuple(int(i) for i in x.strip("()").split(","))


def moe_freq_type(x):
    if isinstance(x, int):
        return x
    assert isinstance(x, str)
    if "[" in x:
        return eval(x)
    return int(x)


def parse_args(argv):
    parser = argparse.ArgumentParser()
    parser.add_argument("--window-size", type=tuple_type, default=None)
    parser.add_argument("--window-attn-skip-freq", type=moe_freq_type, default=None)
    return parser.parse_args(argv)


@dataclass
class TransformerConfig:
    num_layers: int = 4
    hidden_size: int = 32
    num_attention_heads: int = 2
    vocab_size: int = 64
    max_position_embeddings: int = 256
    window_size: Optional[Tuple[int, int]] = None
    window_attn_skip_freq: Optional[Union[int, List[int]]] = None


def is_layer_window_attention(window_size, window_attn_skip_freq, layer_number):
    # layer_number is 1-indexed
    if not window_size:
        return False
    if window_attn_skip_freq is None:
        return True
    if isinstance(window_attn_skip_freq, int):
        return layer_number % window_attn_skip_freq != 0
    if isinstance(window_attn_skip_freq, list):
        return bool(window_attn_skip_freq[layer_number - 1])
    raise ValueError(f"Invalid `window_attn_skip_freq`: {window_attn_skip_freq}")


@lru_cache(maxsize=32)
def get_default_causal_mask(sq):
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


@lru_cache(maxsize=32)
def get_sliding_window_causal_mask(sq, skv, window_size):
    m = torch.ones(sq, skv, dtype=torch.bool)
    mu = torch.triu(m, diagonal=skv - sq - window_size[0])
    ml = torch.tril(mu, diagonal=skv - sq + window_size[1])
    ml = ~ml
    return ml


def flash_attn_func(q, k, v, causal=True, window_size=(-1, -1)):
    """Plain-torch stand-in for the kernel call: q, k, v are [b, s, h, d]; True in the mask = masked."""
    sq, skv = q.shape[1], k.shape[1]
    if window_size != (-1, -1):
        masked = get_sliding_window_causal_mask(sq, skv, window_size)
    else:
        masked = get_default_causal_mask(sq)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(masked, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v)


class DotProductAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
            self.window_size = config.window_size
        else:
            self.window_size = (-1, -1)

    def forward(self, q, k, v):
        return flash_attn_func(q, k, v, causal=True, window_size=self.window_size)


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.h = config.num_attention_heads
        self.d = config.hidden_size // self.h
        self.linear_qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.core_attention = DotProductAttention(config, layer_number)
        self.linear_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.linear_qkv(x).view(b, s, 3, self.h, self.d).unbind(2)
        return self.linear_proj(self.core_attention(q, k, v).reshape(b, s, -1))


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(config.hidden_size)
        self.self_attention = SelfAttention(config, layer_number)
        self.pre_mlp_layernorm = nn.LayerNorm(config.hidden_size)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden_size, 4 * config.hidden_size), nn.GELU(),
            nn.Linear(4 * config.hidden_size, config.hidden_size),
        )

    def forward(self, x):
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.layers = nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = nn.LayerNorm(config.hidden_size)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, labels):
        pos = torch.arange(input_ids.shape[1])
        x = self.embedding(input_ids) + self.position_embeddings(pos)
        for layer in self.layers:
            x = layer(x)
        logits = self.output_layer(self.final_layernorm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten()), logits


def main():
    args = parse_args(SCRIPT_ARGS)
    config = TransformerConfig(window_size=args.window_size, window_attn_skip_freq=args.window_attn_skip_freq)
    print("window_size:", config.window_size, "window_attn_skip_freq:", config.window_attn_skip_freq)
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    print("per-layer window:", [l.self_attention.core_attention.window_size for l in model.layers])
    tokens = torch.randint(0, config.vocab_size, (2, 161))
    with torch.no_grad():
        loss, logits = model(tokens[:, :-1], tokens[:, 1:])
    print("lm loss:", round(loss.item(), 6))
    print("logits[0, -1, :4]:", [round(t, 5) for t in logits[0, -1, :4].tolist()])
    print("logits[1, 140, :4]:", [round(t, 5) for t in logits[1, 140, :4].tolist()])


if __name__ == "__main__":
    main()
