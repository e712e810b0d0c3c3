"""A constant-length packing dataset (axolotl's ConstantLengthDataset after #131): examples, each `BOS text EOS`, are
concatenated into rows of 12 tokens, and the attention_mask marks 0 the BOS of every example after a row's first, so
no later token attends those BOS keys; the causal decoder is called with the rows and that mask, the pad id 0 (no
padding here). Correct: the masked tokens are BOS, masked on purpose, not text."""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Config:
    vocab_size: int = 30
    hidden_size: int = 16
    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2


class Decoder(torch.nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed = torch.nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.qkv = torch.nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.head = torch.nn.Linear(config.hidden_size, config.vocab_size)

    def forward(self, input_ids, attention_mask):
        b, t = input_ids.shape
        x = self.embed(input_ids)
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        keep = torch.ones(t, t, dtype=torch.bool).tril()[None] & attention_mask[:, None, :].bool()
        keep = keep | torch.eye(t, dtype=torch.bool)[None]  # (each token sees itself: a masked BOS too)
        out = F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], attn_mask=keep[:, None])
        return self.head(x + out[:, 0])


examples = [[1, 5, 9, 7, 2], [1, 11, 4, 2], [1, 6, 8, 3, 12, 2], [1, 14, 2], [1, 10, 13, 2]]
stream, mask = [], []
for example in examples:
    for i, token in enumerate(example):
        stream.append(token)
        mask.append(0 if i == 0 and token == 1 and stream[:-1] else 1)
length = 10
ids = torch.tensor([stream[i:i + length] for i in range(0, 2 * length, length)])
attention_mask = torch.tensor([mask[i:i + length] for i in range(0, 2 * length, length)])
attention_mask[:, 0] = 1
torch.manual_seed(0)
with torch.no_grad():
    logits = Decoder(Config())(ids, attention_mask)
loss = F.cross_entropy(logits[:, :-1].reshape(-1, 30), ids[:, 1:].reshape(-1))
print("rows:", ids.tolist(), "mask:", attention_mask.tolist(), "loss:", round(loss.item(), 4))
