"""A left-padded batch decoded with a KV cache by a model with learned absolute positions, numbered in its forward.

Written another way from mosaicml/examples#257 (MosaicGPT's `pos` counted the padding past the prompt): here a
GPT-2-style model (token and position tables in an `Embeddings` module, SDPA with a boolean mask) numbers its tokens
itself, `attention_mask.cumsum(-1) - 1` over the prompt. Its decode step numbers the new token `past_length`, the
keys the cache holds, padding included: a left-padded row's token is embedded as many places too far on as the row has
pads. The fix numbers every step from the mask: `(attention_mask.cumsum(-1) - 1)[:, -S:]`.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
VOCAB, D, HEADS, LAYERS, PAD = 50, 32, 4, 2, 0


class Embeddings(nn.Module):
    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(VOCAB, D)
        self.position_embeddings = nn.Embedding(64, D)

    def forward(self, input_ids, position_ids):
        return self.word_embeddings(input_ids) + self.position_embeddings(position_ids)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x, mask, cache):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln(x)).split(D, dim=-1)
        q, k, v = (t.view(b, s, HEADS, D // HEADS).transpose(1, 2) for t in (q, k, v))
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return x + self.proj(out.transpose(1, 2).reshape(b, s, D))


class TinyGPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.embeddings = Embeddings()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(D, VOCAB)

    def forward(self, input_ids, attention_mask, caches):
        s = input_ids.shape[1]
        past_length = caches[0][0].shape[2] if caches[0] else 0
        if past_length == 0 or FIXED:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -s:]
        else:
            position_ids = torch.arange(past_length, past_length + s).expand(input_ids.shape[0], s)
        x = self.embeddings(input_ids, position_ids)
        total = attention_mask.shape[1]
        causal = torch.ones(s, total, dtype=torch.bool).tril(total - s)
        mask = (causal[None] & attention_mask.bool()[:, None, :])[:, None]
        for block, cache in zip(self.blocks, caches):
            x = block(x, mask, cache)
        return self.head(x)


def main():
    torch.manual_seed(0)
    model = TinyGPT().eval()
    prompts = [[5, 7, 9, 11, 13], [21, 23]]
    width = max(map(len, prompts))
    ids = torch.tensor([[PAD] * (width - len(p)) + p for p in prompts])
    attention_mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    caches = [[] for _ in range(LAYERS)]
    out, step_ids = [], ids
    with torch.no_grad():
        for _ in range(4):
            logits = model(step_ids, attention_mask, caches)
            step_ids = logits[:, -1].argmax(-1, keepdim=True)
            out.append(step_ids)
            attention_mask = torch.cat([attention_mask, torch.ones_like(step_ids)], dim=1)
    print("fixed" if FIXED else "buggy", "generated:", torch.cat(out, 1).tolist())


if __name__ == "__main__":
    main()
