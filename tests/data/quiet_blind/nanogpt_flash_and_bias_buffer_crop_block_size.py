"""nanoGPT (karpathy/nanoGPT model.py): CausalSelfAttention with and without flash, then crop_block_size.

Follows karpathy/nanoGPT model.py: GPTConfig dataclass, `self.flash = hasattr(F, 'scaled_dot_product_attention')`,
the flash path calls SDPA with `is_causal=True`; the slow path registers a `bias` buffer
(tril(block_size, block_size) viewed as 1x1xTxT) and masks `att[:, :, :T, :T] == 0` with -inf.
`crop_block_size` is the model surgery nanoGPT does when a checkpoint is loaded with a smaller block_size:
the `bias` buffer is sliced to the new block size.

Mask meant: plain causal (row i sees keys 0..i) over the T tokens of the batch, in both paths, before and after
cropping the block size from 16 to 8.
"""
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F


@dataclass
class GPTConfig:
    block_size: int = 16
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = hasattr(torch.nn.functional, 'scaled_dot_product_attention')
        # nanoGPT registers this only when flash is missing; here it is always kept so that one model can be
        # run through both paths (as on a torch without SDPA) and compared
        self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                             .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx, targets=None):
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}, block size is only {self.config.block_size}"
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        if targets is not None:
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        else:
            logits = self.lm_head(x[:, [-1], :])
            loss = None
        return logits, loss

    def crop_block_size(self, block_size):
        # model surgery: a checkpoint trained at a larger block size used at a smaller one
        assert block_size <= self.config.block_size
        self.config.block_size = block_size
        self.transformer.wpe.weight = nn.Parameter(self.transformer.wpe.weight[:block_size])
        for block in self.transformer.h:
            if hasattr(block.attn, 'bias'):
                block.attn.bias = block.attn.bias[:, :, :block_size, :block_size]


def main():
    torch.manual_seed(1337)
    config = GPTConfig()
    model = GPT(config)
    model.train()
    data = torch.randint(0, config.vocab_size, (3, config.block_size + 1))
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()

    _, loss_flash = model(x, y)
    for block in model.transformer.h:
        block.attn.flash = False
    _, loss_slow = model(x, y)
    assert torch.allclose(loss_flash, loss_slow, atol=1e-5), (loss_flash, loss_slow)

    model.eval()
    model.crop_block_size(8)
    with torch.no_grad():
        _, loss_cropped = model(x[:, :8].contiguous(), y[:, :8].contiguous())
        for block in model.transformer.h:
            block.attn.flash = True
        _, loss_cropped_flash = model(x[:, :8].contiguous(), y[:, :8].contiguous())
    assert torch.allclose(loss_cropped, loss_cropped_flash, atol=1e-5)
    print(f"loss flash {loss_flash.item():.4f} slow {loss_slow.item():.4f} cropped {loss_cropped.item():.4f}")


if __name__ == "__main__":
    main()
