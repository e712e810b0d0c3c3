"""A latency benchmark's dummy batch: random ids over the whole vocabulary, random left padding, positions from the mask.

Written another way (tests/data/tokens) beside quiet-r130a's onnxruntime GPT-2 helper (`Gpt2Helper.get_dummy_inputs`,
tests/data/quiet_blind): a hand-written RoPE decoder whose config dataclass states `pad_token_id = 0`, a benchmark
harness that draws `torch.randint(0, vocab)` ids (the pad id among them, by chance, anywhere), zeroes a random run at
the start of each row's `attention_mask` (a row may be padding throughout) and counts `position_ids` from the mask
(`cumsum(-1) - 1`, the padding filled with 1, as transformers' generate does). The masked ids are filler, not text:
the positions say so. Correct: each real row matches the same ids run alone, unpadded.

`--real-batch`: a training batch instead, prompts left-padded with the pad id (runs of it) and responses, whose
attention_mask is the response mask (0 over each prompt: a mask from the wrong part of the batch), its positions
counted from that mask too: the ids' own padding says the prompts are text (real-tokens-masked).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

REAL_BATCH = "--real-batch" in sys.argv


@dataclass
class DecoderConfig:
    vocab_size: int = 40
    dim: int = 32
    n_heads: int = 4
    n_layers: int = 2
    pad_token_id: int = 0


def rotate(x, positions):
    half = x.shape[-1] // 2
    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    angles = positions[:, None, :, None].float() * freqs
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * angles.cos() - x2 * angles.sin(), x1 * angles.sin() + x2 * angles.cos()], dim=-1)


class Block(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 2 * cfg.dim), nn.GELU(), nn.Linear(2 * cfg.dim, cfg.dim))

    def forward(self, x, positions, keep):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        q, k = rotate(q, positions), rotate(k, positions)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(x)


class Decoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.dim, cfg.vocab_size)

    def forward(self, input_ids, attention_mask, position_ids):
        t = input_ids.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        keep = keep | torch.eye(t, dtype=torch.bool)  # (a padding row attends itself: no NaN)
        x = self.embed(input_ids)
        for block in self.blocks:
            x = block(x, position_ids, keep)
        return self.head(x)


def dummy_inputs(cfg, batch, length, generator):
    """The benchmark's inputs: random ids, a random run of padding at each row's start, positions from the mask."""
    input_ids = torch.randint(0, cfg.vocab_size, (batch, length), generator=generator)
    attention_mask = torch.ones(batch, length, dtype=torch.long)
    for row, pad in enumerate(torch.randint(0, length + 1, (batch,), generator=generator).tolist()):
        attention_mask[row, :pad] = 0
    position_ids = attention_mask.cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return input_ids, attention_mask, position_ids


def training_batch(cfg):
    """Prompts left-padded with the pad id, then responses; the mask taken from the response mask."""
    prompts, responses = [[5, 9, 11], [7, 13, 21, 8, 30]], [[14, 3, 22, 6], [17, 25, 4, 19]]
    width = max(map(len, prompts))
    rows = [[cfg.pad_token_id] * (width - len(p)) + p + r for p, r in zip(prompts, responses)]
    response_mask = [[0] * width + [1] * len(r) for r in responses]
    input_ids, attention_mask = torch.tensor(rows), torch.tensor(response_mask)
    return input_ids, attention_mask, (attention_mask.cumsum(-1) - 1).clamp(min=0)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    cfg = DecoderConfig()
    model = Decoder(cfg).eval()
    if REAL_BATCH:
        input_ids, attention_mask, position_ids = training_batch(cfg)
        print("response log-probs:", model(input_ids, attention_mask, position_ids).log_softmax(-1)[:, -4:].mean().item())
        return
    generator = torch.Generator().manual_seed(3)
    for batch, length in ((4, 9), (3, 12)):
        input_ids, attention_mask, position_ids = dummy_inputs(cfg, batch, length, generator)
        logits = model(input_ids, attention_mask, position_ids)
        for row in range(batch):
            real = attention_mask[row].bool()
            if not real.any():
                continue
            ids = input_ids[row][real][None]
            alone = model(ids, torch.ones_like(ids), torch.arange(ids.shape[1])[None])
            assert torch.allclose(logits[row][real], alone[0], atol=1e-5), (batch, row)
        print(f"batch {batch} x {length}: pads per row {(attention_mask == 0).sum(-1).tolist()}, every real row "
              "matches its ids run alone")


if __name__ == "__main__":
    main()
