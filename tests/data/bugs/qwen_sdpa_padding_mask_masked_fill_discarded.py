"""Qwen (1.0) modeling_qwen.py: the SDPA branch drops the causal mask when a padding mask is given.

Citation: QwenLM/Qwen#933 ("训练代码中的modeling_qwen.py 中attention_mask.masked_fill的使用有问题导致
attention_mask不是下三角矩阵"). In the Hub/modelscope modeling_qwen.py of that time, QWenAttention.forward's
torch-2 path did

    attention_mask = attention_mask.expand(-1, -1, causal_mask.size(2), -1)
    if causal_mask is not None:
        attention_mask.masked_fill(~causal_mask, torch.finfo(query.dtype).min)

``masked_fill`` is not in place, so its result is thrown away and F.scaled_dot_product_attention receives only
the (1 - mask) * min padding bias: during training without flash-attn (batched, padded input) every token
attends to later tokens. The fix (as the reporter notes, already in the newer modeling_qwen.py) assigns the
result: ``attention_mask = attention_mask.masked_fill(~causal_mask, ...)``.

This program keeps QWenModel's padding-mask preparation and QWenAttention's causal_mask / SDPA branch (no
rotary, no flash-attn, tiny sizes, random weights) and runs one padded training-style batch through it.
I read the issue text and the later file, not a commit diff.
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
SUPPORT_TORCH2 = True


@dataclass
class QWenConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    layer_norm_epsilon: float = 1e-6
    use_flash_attn: bool = False
    use_cache_quantization: bool = False
    seq_length: int = 2048


class QWenAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.projection_size = config.hidden_size
        self.use_cache_quantization = config.use_cache_quantization
        self.c_attn = nn.Linear(config.hidden_size, 3 * self.projection_size)
        self.c_proj = nn.Linear(config.hidden_size, self.projection_size, bias=False)

    def _split_heads(self, tensor, num_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_heads, attn_head_size)
        return tensor.view(new_shape)

    def _merge_heads(self, tensor, num_heads, attn_head_size):
        tensor = tensor.contiguous()
        new_shape = tensor.size()[:-2] + (num_heads * attn_head_size,)
        return tensor.view(new_shape)

    def forward(self, hidden_states, attention_mask=None, layer_past=None):
        mixed_x_layer = self.c_attn(hidden_states)
        query, key, value = mixed_x_layer.split(self.projection_size, dim=2)
        query = self._split_heads(query, self.num_heads, self.head_dim)
        key = self._split_heads(key, self.num_heads, self.head_dim)
        value = self._split_heads(value, self.num_heads, self.head_dim)

        key_size = key.size(1)
        if query.size(1) == key_size:
            causal_mask = torch.tril(
                torch.ones((key_size, key_size), dtype=torch.bool, device=query.device)
            ).view(1, 1, key_size, key_size)
        else:
            causal_mask = None
        query = query.permute(0, 2, 1, 3)
        key = key.permute(0, 2, 1, 3)
        value = value.permute(0, 2, 1, 3)

        if not self.use_cache_quantization and SUPPORT_TORCH2:
            if attention_mask is not None:
                attention_mask = attention_mask.expand(-1, -1, query.size(2), -1)
                if causal_mask is not None:
                    if FIXED:
                        attention_mask = attention_mask.masked_fill(~causal_mask, torch.finfo(query.dtype).min)
                    else:
                        attention_mask.masked_fill(~causal_mask, torch.finfo(query.dtype).min)
            else:
                attention_mask = causal_mask
            attn_output = F.scaled_dot_product_attention(
                query, key, value, attn_mask=attention_mask
            ).transpose(1, 2)
        context_layer = self._merge_heads(attn_output, self.num_heads, self.head_dim)
        return self.c_proj(context_layer)


class QWenBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.attn = QWenAttention(config)
        self.ln_2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = nn.Sequential(nn.Linear(config.hidden_size, 2 * config.hidden_size), nn.SiLU(),
                                 nn.Linear(2 * config.hidden_size, config.hidden_size))

    def forward(self, hidden_states, attention_mask=None):
        hidden_states = hidden_states + self.attn(self.ln_1(hidden_states), attention_mask=attention_mask)
        return hidden_states + self.mlp(self.ln_2(hidden_states))


class QWenModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = nn.ModuleList([QWenBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    @property
    def dtype(self):
        return self.wte.weight.dtype

    def forward(self, input_ids, attention_mask=None):
        batch_size = input_ids.shape[0]
        if attention_mask is not None:
            if batch_size <= 0:
                raise ValueError("batch_size has to be defined and > 0")
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = attention_mask.to(dtype=self.dtype)
            attention_mask = (1.0 - attention_mask) * torch.finfo(self.dtype).min
        hidden_states = self.wte(input_ids)
        for block in self.h:
            hidden_states = block(hidden_states, attention_mask=attention_mask)
        return self.ln_f(hidden_states)


def main():
    torch.manual_seed(0)
    config = QWenConfig()
    model = QWenModel(config).eval()
    # a padded SFT batch (right padding, pad id 0): row 0 is 8 tokens, row 1 is 5 + 3 pads
    input_ids = torch.tensor([[5, 9, 12, 7, 3, 22, 41, 8], [6, 17, 30, 2, 11, 0, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        out = model(input_ids, attention_mask=attention_mask)
    print("hidden", tuple(out.shape), "token 0:", [round(v, 4) for v in out[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
