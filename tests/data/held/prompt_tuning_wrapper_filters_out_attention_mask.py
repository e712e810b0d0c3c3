# The batch's padding mask dropped by a wrapper on its way to the model (padding-unused, written another way than
# nanoVLM 8c87101's generate): a prompt-tuning wrapper puts 3 learned soft tokens before a left-padded batch of token
# ids and forwards only the keyword arguments the model's forward names; the model calls its padding
# `key_padding_mask`, so the script's `attention_mask` is filtered out and SDPA runs plain causal over the pads.
# The script holds the batch (`input_ids`, `attention_mask`) at its top level; no function below it holds the mask.
# Fixed: the wrapper renames attention_mask to the model's key_padding_mask (True = padding), soft tokens real.
import inspect
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, V, SOFT = 32, 4, 50, 3


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x, key_padding_mask=None):
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, H, D // H).permute(2, 0, 3, 1, 4)
        if key_padding_mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            allowed = torch.ones(n, n, dtype=torch.bool).tril()[None, None] & ~key_padding_mask[:, None, None, :]
            allowed = allowed | torch.eye(n, dtype=torch.bool)  # (a pad's query sees itself)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return x + self.out(o.transpose(1, 2).reshape(b, n, D))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V)

    def forward(self, inputs_embeds, key_padding_mask=None):
        x = inputs_embeds
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return self.head(x)


class PromptTuning(nn.Module):
    """Soft prompt tokens before the text, PEFT-style; the model's own arguments passed on by name."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.embed = nn.Embedding(V, D)
        self.soft = nn.Parameter(torch.randn(SOFT, D))

    def forward(self, input_ids, **kwargs):
        embeds = torch.cat([self.soft.expand(input_ids.shape[0], -1, -1), self.embed(input_ids)], dim=1)
        if FIXED and "attention_mask" in kwargs:
            keep = torch.cat([torch.ones(input_ids.shape[0], SOFT, dtype=torch.long), kwargs.pop("attention_mask")], 1)
            kwargs["key_padding_mask"] = keep == 0
        accepted = inspect.signature(self.model.forward).parameters
        return self.model(inputs_embeds=embeds, **{k: v for k, v in kwargs.items() if k in accepted})


texts = [[11, 12, 13, 14, 15, 16, 17], [21, 22, 23]]
PAD_ID = 0
input_ids = torch.tensor([[PAD_ID] * (7 - len(t)) + t for t in texts])  # left-padded by the tokenizer
attention_mask = (torch.arange(7)[None, :] >= torch.tensor([7 - len(t) for t in texts])[:, None]).long()
wrapped = PromptTuning(TinyLM()).eval()
with torch.no_grad():
    logits = wrapped(input_ids, attention_mask=attention_mask)
print("next tokens:", logits[:, -1].argmax(-1).tolist())
