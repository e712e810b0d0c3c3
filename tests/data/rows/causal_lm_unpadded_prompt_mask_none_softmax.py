"""A ...ForCausalLM that builds its mask only where the batch is padded (None otherwise, as a flash path does), handed
to an eager softmax that adds a mask only where one is given: the unpadded prompt attends both ways, then decodes over
its cache (--fixed: the causal mask is always built).

Written for maskcli's tests (checks/causal_lm.py on a softmax site that masks nowhere): a GPT-NeoX-style fused qkv,
a tuple cache kept per layer, one unpadded prompt of 5 tokens and three decode steps.
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class NeoXAttention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.query_key_value = nn.Linear(dim, 3 * dim)

    def forward(self, x, mask, past):
        b, n, d = x.shape
        q, k, v = self.query_key_value(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        if mask is not None:
            scores = scores + mask
        out = torch.nn.functional.softmax(scores, dim=-1) @ v
        return out.transpose(1, 2).reshape(b, n, d), (k, v)


class NeoXForCausalLM(nn.Module):
    def __init__(self, vocab=40, dim=16, layers=2):
        super().__init__()
        self.embed_in = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(NeoXAttention(dim) for _ in range(layers))
        self.embed_out = nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        n = input_ids.shape[1]
        total = attention_mask.shape[1]
        mask = None
        if FIXED or not bool(attention_mask.all()):
            allowed = torch.ones(total, total, dtype=torch.bool).tril()[total - n:] & attention_mask[:, None, None, :].bool()
            mask = torch.zeros(allowed.shape).masked_fill(~allowed, float("-inf"))
        x, cache = self.embed_in(input_ids), []
        for i, layer in enumerate(self.layers):
            out, kv = layer(x, mask, None if past_key_values is None else past_key_values[i])
            x = x + out
            cache.append(kv)
        return self.embed_out(x), cache


def main():
    torch.manual_seed(0)
    model = NeoXForCausalLM().eval()
    ids = torch.tensor([[3, 17, 8, 29, 11]])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        logits, cache = model(ids, mask)
        out = []
        for _ in range(3):
            tok = logits[:, -1:].argmax(-1)
            out.append(tok.item())
            mask = torch.cat([mask, torch.ones_like(tok)], dim=1)
            logits, cache = model(tok, mask, cache)
    print("fixed" if FIXED else "buggy", out)


if __name__ == "__main__":
    main()
