"""A correct SFT step: each row is a prompt then its answer, unpadded and of one length, and the model call is given
a plain `mask` that is the LOSS mask (0 over each prompt, 1 over its answer), which the model uses only to weight
the loss; the attention is causal over every token, as it must be (the answer reads its prompt). The mask's 0s lead
each row, as left padding's would, but cover the prompts' varied ids, not one pad id: no padding is stated, no
finding."""
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads, self.qkv, self.proj = heads, nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, h):
        b, n, d = h.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(h).chunk(3, -1))
        return self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, n, d))


class SFTModel(nn.Module):
    def __init__(self, vocab=40, d=16):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, d), nn.Linear(d, vocab)
        self.blocks = nn.ModuleList(Block(d) for _ in range(2))

    def forward(self, tokens, mask=None):
        h = self.emb(tokens)
        for block in self.blocks:
            h = h + block(h)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].transpose(1, 2), tokens[:, 1:], reduction="none")
        return (loss * mask[:, 1:]).sum() / mask[:, 1:].sum()


torch.manual_seed(0)
prompts = [[3, 17, 8, 22, 5], [9, 4, 31], [12, 6, 27, 14]]
answers = [[11, 19, 2], [25, 7, 30, 16, 21], [13, 28, 10, 26]]
tokens = torch.tensor([p + a for p, a in zip(prompts, answers)])
mask = torch.tensor([[0] * len(p) + [1] * len(a) for p, a in zip(prompts, answers)], dtype=torch.float)
model = SFTModel()
loss = model(tokens, mask=mask)
loss.backward()
print("loss", round(loss.item(), 4))
