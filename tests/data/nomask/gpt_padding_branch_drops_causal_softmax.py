"""A small GPT written by hand (nanoGPT style, scores and softmax by hand): with no attention_mask it applies its causal
`tril` buffer; handed a (batch, tokens) attention_mask it builds the padding mask alone and forgets the triangle, so
an all-ones mask makes every token see the ones after it. --fixed: the padding mask and-ed with the triangle.
Called on the same ids without a mask and with an all-ones one, as an eval harness does."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd=16, n_head=2, block_size=8):
        super().__init__()
        self.n_head = n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x, attention_mask=None):
        B, T, C = x.shape
        q, k, v = (z.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for z in self.c_attn(x).split(C, dim=2))
        att = (q @ k.transpose(-2, -1)) * (k.size(-1) ** -0.5)
        if attention_mask is None:
            keep = self.bias[:, :, :T, :T] == 1
        else:
            keep = attention_mask[:, None, None, :].bool()
            if FIXED:
                keep = keep & (self.bias[:, :, :T, :T] == 1)
        att = att.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        return (att @ v).transpose(1, 2).reshape(B, T, C)


class GPT(nn.Module):
    def __init__(self, vocab=40, n_embd=16, n_layer=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, n_embd)
        self.h = nn.ModuleList([CausalSelfAttention(n_embd) for _ in range(n_layer)])
        self.lm_head = nn.Linear(n_embd, vocab)

    def forward(self, idx, attention_mask=None):
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x, attention_mask)
        return self.lm_head(x)


def main():
    torch.manual_seed(0)
    model = GPT().eval()
    idx = torch.randint(0, 40, (2, 6))
    with torch.no_grad():
        plain = model(idx)
        masked = model(idx, attention_mask=torch.ones_like(idx))
    print("max |logits(no mask) - logits(all-ones mask)| =", (plain - masked).abs().max().item())


if __name__ == "__main__":
    main()
