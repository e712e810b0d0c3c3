# The bug of pno-ai 316faa3 written another way: a decoder-only char model on SDPA whose blocks apply the causal mask
# only when the caller hands one (`attn_mask=None` by default). Training builds it (generate_square_subsequent_mask
# & the key padding of a right-padded batch); the sampler calls `model(ids)` with no mask, so every prompt token
# attends to the tokens after it while sampling. Config kept as a dataclass. --fixed: the block builds the causal
# mask on every call and ands the caller's padding into it.
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class DecoderConfig:
    vocab: int = 30
    width: int = 32
    heads: int = 4
    depth: int = 2
    pad: int = 0


def generate_square_subsequent_mask(n: int) -> torch.Tensor:
    """Bool (n, n), True = may attend: each position sees itself and the positions before it."""
    return torch.ones(n, n, dtype=torch.bool).tril()


class DecoderBlock(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln1, self.ln2 = nn.LayerNorm(cfg.width), nn.LayerNorm(cfg.width)
        self.mlp = nn.Sequential(nn.Linear(cfg.width, 4 * cfg.width), nn.GELU(), nn.Linear(4 * cfg.width, cfg.width))

    def forward(self, x, attn_mask=None):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if FIXED:
            causal = generate_square_subsequent_mask(T).to(x.device)[None, None]
            attn_mask = causal if attn_mask is None else causal & attn_mask
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class CharDecoder(nn.Module):
    def __init__(self, cfg: DecoderConfig):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab, cfg.width, padding_idx=cfg.pad)
        self.pos = nn.Embedding(64, cfg.width)
        self.blocks = nn.ModuleList(DecoderBlock(cfg) for _ in range(cfg.depth))
        self.head = nn.Linear(cfg.width, cfg.vocab)

    def forward(self, ids, attn_mask=None):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x, attn_mask)
        return self.head(x)


def training_mask(ids: torch.Tensor, pad: int) -> torch.Tensor:
    """(B, 1, T, T): the subsequent mask and the keys that are not padding."""
    keys = (ids != pad)[:, None, None, :]
    return generate_square_subsequent_mask(ids.shape[1])[None, None] & keys


@torch.no_grad()
def sample(model, prompt, steps):
    ids = torch.tensor([prompt])
    for _ in range(steps):
        logits = model(ids)  # no mask: the blocks apply none
        nxt = torch.multinomial(logits[:, -1].softmax(-1), 1)
        ids = torch.cat([ids, nxt], dim=1)
    return ids[0].tolist()


if __name__ == "__main__":
    cfg = DecoderConfig()
    model = CharDecoder(cfg)
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(1, cfg.vocab, (n,), generator=g) for n in (9, 7)]
    batch = torch.stack([F.pad(r, (0, 9 - len(r)), value=cfg.pad) for r in rows])
    x, y = batch[:, :-1], batch[:, 1:]
    logits = model(x, training_mask(x, cfg.pad))
    loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), y.reshape(-1), ignore_index=cfg.pad)
    loss.backward()
    model.eval()
    out = sample(model, [3, 7, 11, 2], 3)
    print(f"loss {loss.item():.4f}; sampled {out}")
