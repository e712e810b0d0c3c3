"""An SFT collator that builds the attention_mask from the labels (`labels != -100`), so the prompt tokens, whose
labels are -100, are masked as if they were padding: answer tokens never see the question (python FILE; --fixed:
the mask from the tokenizer's pad id)."""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.heads = heads

    def forward(self, x, keep):
        b, n, d = x.shape
        q, k, v = (t.view(b, n, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = q @ k.transpose(-1, -2) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~keep, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class Model(nn.Module):
    def __init__(self, vocab=40, dim=16):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.attn = Attention(dim)

    def forward(self, input_ids, attention_mask):
        n = input_ids.shape[1]
        keep = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & attention_mask.bool()[:, None, None, :]
        keep = keep | torch.eye(n, dtype=torch.bool)  # (a row with no key would give NaN)
        return self.attn(self.embed(input_ids), keep)


def collate(examples, tokenizer):
    width = max(len(p) + len(a) for p, a in examples)
    ids, labels = [], []
    for prompt, answer in examples:
        row = prompt + answer
        ids.append(row + [tokenizer.pad_token_id] * (width - len(row)))
        labels.append([-100] * len(prompt) + answer + [-100] * (width - len(row)))
    ids, labels = torch.tensor(ids), torch.tensor(labels)
    mask = (ids != tokenizer.pad_token_id) if FIXED else (labels != -100)
    return {"input_ids": ids, "attention_mask": mask.long(), "labels": labels}


def main():
    torch.manual_seed(0)
    tokenizer = SimpleNamespace(pad_token_id=3, eos_token_id=2, padding_side="right")
    batch = collate([([10, 11, 12, 13], [20, 21, 2]), ([14, 15], [22, 2])], tokenizer)
    with torch.no_grad():
        out = Model()(batch["input_ids"], batch["attention_mask"])
    print("out[0,-1,:3] =", [round(v, 4) for v in out[0, -1, :3].tolist()])


if __name__ == "__main__":
    main()
