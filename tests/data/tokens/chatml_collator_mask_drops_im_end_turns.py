# A ChatML SFT collator (right padding, pad id in the model's config) that builds the attention_mask from the ids:
# `ids != im_end & ids != pad`, so the <|im_end|> closing every turn inside a conversation is masked as if padding.
# The model is a hand-written decoder over nn.MultiheadAttention (key_padding_mask True = padding, causal attn_mask).
# Fixed: the mask from each conversation's length.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
IM_START, IM_END = 5, 6


@dataclass
class ChatConfig:
    vocab_size: int = 50
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 2
    pad_token_id: int = 2


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.attn = nn.MultiheadAttention(cfg.d_model, cfg.n_heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(cfg.d_model, 2 * cfg.d_model), nn.ReLU(), nn.Linear(2 * cfg.d_model, cfg.d_model))
        self.n1, self.n2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)

    def forward(self, x, causal, key_padding_mask):
        h = self.n1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.ff(self.n2(x))


class ChatLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(64, cfg.d_model)
        self.layers = nn.ModuleList(Layer(cfg) for _ in range(cfg.n_layers))
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size)

    def forward(self, input_ids, attention_mask):
        T = input_ids.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).triu(1)
        x = self.tok(input_ids) + self.pos(torch.arange(T))[None]
        for layer in self.layers:
            x = layer(x, causal, attention_mask == 0)
        return self.head(x)


def collate(conversations, pad_id):
    rows = [[t for turn in conv for t in (IM_START, *turn, IM_END)] for conv in conversations]
    width = max(map(len, rows))
    input_ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    if FIXED:
        lengths = torch.tensor([len(r) for r in rows])
        attention_mask = (torch.arange(width)[None] < lengths[:, None]).long()
    else:
        attention_mask = (input_ids.ne(IM_END) & input_ids.ne(pad_id)).long()
    return {"input_ids": input_ids, "attention_mask": attention_mask}


cfg = ChatConfig()
model = ChatLM(cfg).eval()
conversations = [[[10, 11, 12], [20, 21], [30, 31, 32]], [[13, 14], [22, 23, 24]]]
batch = collate(conversations, cfg.pad_token_id)
with torch.no_grad():
    logits = model(**batch)
    alone = collate(conversations[:1], cfg.pad_token_id)
    ref = model(alone["input_ids"], torch.ones_like(alone["input_ids"]))
print(f"fixed={FIXED} attention_mask={batch['attention_mask'].tolist()}")
print(f"max |logits row 0 - alone, every token seen| = {(logits[0] - ref[0]).abs().max().item():.4f}")
