# Written another way (the bug of bigscience-workshop/Megatron-DeepSpeed#167): a right-padded prefix-LM batch as
# Hugging Face code writes it, the prefix read both ways through a (batch, 1, q, k) keep mask handed to SDPA, and the
# loss through `labels` at -100, shifted inside the model. The labels are ignored up to and including the first target
# token (`labels[:prefix + 1] = -100`), so the token just after each prefix is neither in the prefix nor learnt. The
# fix ignores the prefix only (`labels[:prefix] = -100`): the last prefix position predicts the first target.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD, VOCAB, DIM, HEADS = 0, 40, 32, 4


class PrefixLM(nn.Module):
    def __init__(self, depth=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(32, DIM)
        self.qkv = nn.ModuleList(nn.Linear(DIM, 3 * DIM) for _ in range(depth))
        self.out = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(depth))
        self.lm_head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask, prefix_lengths, labels=None):
        b, n = input_ids.shape
        x = self.embed(input_ids) + self.pos(torch.arange(n))[None]
        i = torch.arange(n)
        keep = (i[None, :, None] >= i[None, None, :]) | (i[None, None, :] < prefix_lengths[:, None, None])
        keep = keep & attention_mask.bool()[:, None, :]
        keep = keep | torch.eye(n, dtype=torch.bool)[None]  # (a padded query sees itself: no NaN row)
        for qkv, out in zip(self.qkv, self.out):
            q, k, v = qkv(x).view(b, n, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
            h = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None])
            x = x + out(h.transpose(1, 2).reshape(b, n, DIM))
        logits = self.lm_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=-100)
        return logits, loss


def collate(examples, length=12):
    input_ids = torch.full((len(examples), length), PAD)
    attention_mask = torch.zeros(len(examples), length, dtype=torch.long)
    labels = torch.full((len(examples), length), -100)
    prefix_lengths = torch.zeros(len(examples), dtype=torch.long)
    for row, (prompt, answer) in enumerate(examples):
        ids = prompt + answer
        input_ids[row, :len(ids)] = torch.tensor(ids)
        attention_mask[row, :len(ids)] = 1
        labels[row, :len(ids)] = torch.tensor(ids)
        ignored = len(prompt) if FIXED else len(prompt) + 1
        labels[row, :ignored] = -100
        prefix_lengths[row] = len(prompt)
    return input_ids, attention_mask, prefix_lengths, labels


examples = [(torch.randint(1, VOCAB, (n,)).tolist(), torch.randint(1, VOCAB, (m,)).tolist())
            for n, m in ((5, 7), (3, 4), (7, 2))]
input_ids, attention_mask, prefix_lengths, labels = collate(examples)
model = PrefixLM()
logits, loss = model(input_ids, attention_mask, prefix_lengths, labels=labels)
loss.backward()
trained = int((labels[:, 1:] != -100).sum())
print(f"answer tokens trained: {trained} of {sum(len(a) for _, a in examples)}  loss: {loss.item():.4f}")
