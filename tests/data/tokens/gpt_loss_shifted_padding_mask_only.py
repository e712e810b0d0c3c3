"""A batch-first GPT trained on a right-padded batch: the loss is the next token (labels shifted by one, -100 on
the padding), but the attention is handed only the padding mask and no causal part, so every token sees the word
it is asked to predict (python FILE; --fixed: padding and causal together)."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class GPT(nn.Module):
    def __init__(self, vocab=24, dim=16, heads=2):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.head = nn.Linear(dim, vocab)
        self.heads = heads

    def forward(self, input_ids, attention_mask):
        x = self.wte(input_ids)
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        allowed = attention_mask.bool()[:, None, None, :].expand(b, 1, n, n)
        if FIXED:
            allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.head(y.transpose(1, 2).reshape(b, n, d))


def main():
    torch.manual_seed(0)
    model = GPT()
    input_ids = torch.tensor([[5, 9, 3, 14, 7, 2], [8, 11, 6, 2, 0, 0]])
    attention_mask = (input_ids != 0).long()
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    logits = model(input_ids, attention_mask)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss.backward()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
