"""A causal LM trained on a left-padded batch (labels -100 on the pads, as a collator masks them): its SDPA mask is
causal AND the padding, and rows that keep no key (the left pads' own queries) are opened to every key so that SDPA
gives them no NaN, as transformers' _unmask_unattended does. The last pad's logits predict the first real token (the
shifted labels count it), and its row, opened, sees that token. Correct: a padding query's output is the program's to
drop; no real query sees its target."""

import torch
import torch.nn.functional as F


class LM(torch.nn.Module):
    def __init__(self, vocab=32, dim=16, heads=2):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, dim)
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, input_ids, attention_mask, labels):
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        keep = keep | ~keep.any(dim=-1, keepdim=True)  # (rows with no key opened to all: no NaN)
        x = x + F.scaled_dot_product_attention(q, k, v, attn_mask=keep).transpose(1, 2).reshape(b, t, -1)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)


torch.manual_seed(0)
ids = torch.tensor([[0, 0, 0, 5, 9, 11, 3], [4, 8, 15, 6, 2, 7, 12]])
mask = (ids != 0).long()
mask[1] = 1
labels = ids.masked_fill(mask == 0, -100)
loss = LM()(ids, mask, labels)
loss.backward()
print("loss:", round(loss.item(), 4))
