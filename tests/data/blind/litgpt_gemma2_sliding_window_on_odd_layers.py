# Lightning-AI/litgpt#1545 ("Gemma 2: `9b` and `27b` versions"), fixed inside the PR by commit d3bf8a4b
# ("Sliding window attention is applied on 0, 2, 4, ... layers").
#
# Gemma 2 alternates local (sliding window) and global attention, starting with a local layer: blocks 0, 2, 4, ...
# use the window. LitGPT's CausalSelfAttention chose the windowed blocks with `self.block_idx % 2`, so the window
# landed on blocks 1, 3, 5, ... and blocks 0, 2, 4, ... attended the whole causal context. The fix tests
# `not self.block_idx % 2`.
#
# Ported from litgpt/model.py and litgpt/config.py at the parent of d3bf8a4b (GPT, Block, CausalSelfAttention with
# its softcapping branch, build_rope_cache / apply_rope), shrunk to a tiny Gemma-2-shaped config and one training
# forward (no KV cache, so GPT.forward passes mask=None).
import math
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class Config:
    name: str = "gemma-2-tiny"
    block_size: int = 16
    vocab_size: int = 64
    padded_vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    head_size: int = 8
    n_embd: int = 32
    n_query_groups: int = 2
    rotary_percentage: float = 1.0
    rope_base: int = 10000
    rope_condense_ratio: int = 1
    bias: bool = False
    lm_head_bias: bool = False
    norm_eps: float = 1e-6
    intermediate_size: int = 64
    attention_scores_scalar: Optional[int] = 8
    sliding_window_size: Optional[int] = 4
    scale_embeddings: bool = True
    post_attention_norm: bool = True
    post_mlp_norm: bool = True
    attention_logit_softcapping: Optional[float] = 50.0
    final_logit_softcapping: Optional[float] = 30.0

    @property
    def rope_n_elem(self) -> int:
        return int(self.rotary_percentage * self.head_size)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        x_normed = x * torch.rsqrt(norm_x + self.eps)
        return (x_normed * (1 + self.weight.float())).to(dtype=dtype)


class GemmaMLP(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=config.bias)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_fc_1 = self.fc_1(x)
        x_fc_2 = self.fc_2(x)
        x = torch.nn.functional.gelu(x_fc_1, approximate="tanh") * x_fc_2
        return self.proj(x)


def build_rope_cache(seq_len: int, n_elem: int, base: int = 10000, condense_ratio: int = 1) -> Tuple[torch.Tensor, torch.Tensor]:
    theta = 1.0 / (base ** (torch.arange(0, n_elem, 2).float() / n_elem))
    seq_idx = torch.arange(seq_len) / condense_ratio
    idx_theta = torch.outer(seq_idx, theta).repeat(1, 2)
    return torch.cos(idx_theta), torch.sin(idx_theta)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    head_size = x.size(-1)
    x1 = x[..., : head_size // 2]
    x2 = x[..., head_size // 2 :]
    rotated = torch.cat((-x2, x1), dim=-1)
    roped = (x * cos) + (rotated * sin)
    return roped.to(dtype=x.dtype)


class GPT(nn.Module):
    def __init__(self, config: Config) -> None:
        super().__init__()
        self.config = config
        self.lm_head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=config.lm_head_bias)
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.padded_vocab_size, config.n_embd),
                h=nn.ModuleList(Block(config, block_idx) for block_idx in range(config.n_layer)),
                ln_f=RMSNorm(config.n_embd, eps=config.norm_eps),
            )
        )
        self.max_seq_length = config.block_size
        cos, sin = build_rope_cache(self.max_seq_length, config.rope_n_elem, config.rope_base, config.rope_condense_ratio)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, idx: torch.Tensor, input_pos: Optional[torch.Tensor] = None) -> torch.Tensor:
        T = idx.size(1)
        if self.max_seq_length < T:
            raise ValueError(f"Cannot forward sequence of length {T}, max seq length is only {self.max_seq_length}.")
        cos = self.cos[:T]
        sin = self.sin[:T]
        mask = None

        x = self.transformer.wte(idx)
        if self.config.scale_embeddings:
            x = x * torch.tensor(self.config.n_embd**0.5, dtype=x.dtype)

        for block in self.transformer.h:
            x = block(x, cos, sin, mask, input_pos)
        x = self.transformer.ln_f(x)
        x = self.lm_head(x)
        if self.config.final_logit_softcapping is not None and self.train:
            x = x / self.config.final_logit_softcapping
            x = torch.tanh(x)
            x = x * self.config.final_logit_softcapping
        return x


class Block(nn.Module):
    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        self.norm_1 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.attn = CausalSelfAttention(config, block_idx)
        self.norm_2 = RMSNorm(config.n_embd, eps=config.norm_eps)
        self.mlp = GemmaMLP(config)
        self.post_attention_norm = RMSNorm(config.n_embd, eps=config.norm_eps) if config.post_attention_norm else nn.Identity()
        self.post_mlp_norm = RMSNorm(config.n_embd, eps=config.norm_eps) if config.post_mlp_norm else nn.Identity()
        self.config = config

    def forward(self, x, cos, sin, mask=None, input_pos=None):
        x_normed = self.norm_1(x)
        attention_output = self.attn(x_normed, cos, sin, mask, input_pos)
        attention_output = self.post_attention_norm(attention_output)
        x = attention_output + x
        x = self.post_mlp_norm(self.mlp(self.norm_2(x))) + x
        return x


class CausalSelfAttention(nn.Module):
    def __init__(self, config: Config, block_idx: int) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.attn = nn.Linear(config.n_embd, shape, bias=config.bias)
        self.proj = nn.Linear(config.head_size * config.n_head, config.n_embd, bias=config.bias)
        self.kv_cache = None
        self.config = config
        self.block_idx = block_idx

    def forward(self, x, cos, sin, mask=None, input_pos=None):
        B, T, C = x.size()

        qkv = self.attn(x)

        q_per_kv = self.config.n_head // self.config.n_query_groups
        total_qkv = q_per_kv + 2
        qkv = qkv.view(B, T, self.config.n_query_groups, total_qkv, self.config.head_size)
        qkv = qkv.permute(0, 2, 3, 1, 4)

        q, k, v = qkv.split((q_per_kv, 1, 1), dim=2)

        if self.config.n_query_groups != self.config.n_head and (input_pos is None or self.config.n_query_groups != 1):
            k = k.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)
            v = v.expand(B, self.config.n_query_groups, q_per_kv, T, self.config.head_size)

        q = q.reshape(B, -1, T, self.config.head_size)
        k = k.reshape(B, -1, T, self.config.head_size)
        v = v.reshape(B, -1, T, self.config.head_size)

        q_roped = apply_rope(q[..., : self.config.rope_n_elem], cos, sin)
        k_roped = apply_rope(k[..., : self.config.rope_n_elem], cos, sin)
        q = torch.cat((q_roped, q[..., self.config.rope_n_elem :]), dim=-1)
        k = torch.cat((k_roped, k[..., self.config.rope_n_elem :]), dim=-1)

        # In Gemma every other layer has a sliding window attention
        if FIXED:
            use_window = self.config.sliding_window_size is not None and not self.block_idx % 2
        else:
            use_window = self.config.sliding_window_size is not None and self.block_idx % 2
        if use_window:
            if mask is None:
                min_dtype = torch.finfo(q.dtype).min
                mask = torch.tril(torch.ones(self.config.block_size, self.config.block_size))
                mask = mask.masked_fill(mask == 0, min_dtype)

            min_dtype = torch.finfo(q.dtype).min
            sliding_window_mask = torch.tril(
                torch.ones_like(mask, dtype=torch.bool), diagonal=-self.config.sliding_window_size
            )
            mask = torch.where(sliding_window_mask, min_dtype, mask)
            mask = mask.to(q.device)

        # softcapping is really needed only during training
        if self.config.attention_logit_softcapping is not None and self.train:
            if mask is None:
                mask = torch.tril(torch.ones(T, T))
                mask = mask.masked_fill(mask == 0, float("-inf")).to(q.dtype)
                mask = mask.to(q.device)

            scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size)
            scores = q @ k.mT * scale
            scores = scores / self.config.attention_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.config.attention_logit_softcapping
            scores = scores + mask
            scores = torch.nn.functional.softmax(scores, dim=-1, dtype=torch.float).to(dtype=q.dtype)
            y = scores @ v
            y = y.transpose(1, 2)
        else:
            scale = 1.0 / math.sqrt(self.config.attention_scores_scalar or self.config.head_size)
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale, is_causal=mask is None
            ).transpose(1, 2)

        y = y.reshape(B, T, self.config.head_size * self.config.n_head)
        return self.proj(y)


def main() -> None:
    torch.manual_seed(0)
    config = Config()
    model = GPT(config)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.2)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.2)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    # a pretraining batch: block_size + 1 tokens per row, inputs and shifted targets
    data = torch.randint(0, config.vocab_size, (2, config.block_size + 1), generator=torch.Generator().manual_seed(1))
    input_ids, targets = data[:, :-1], data[:, 1:]

    for step in range(3):
        logits = model(input_ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        logits = model(input_ids)
    print("last-token logits[0, :4]:", [round(v, 5) for v in logits[0, -1, :4].tolist()])
    print("next token for row 0:", int(logits[0, -1].argmax()))


if __name__ == "__main__":
    main()
