# The LLaVA-NeXT cached-decode mask slip (transformers#29850) written another way: a hand-written vision-language
# decoder that places 4 image tokens before a left-padded text prompt, caches their keys, and decodes greedily while
# the loop grows a text-level mask. At the prefill the model builds its key mask itself, cat([image ones, text mask]);
# at each cached step the loop hands it a mask over every cached key, made from the text mask, which is 4 columns
# short of the cache. Before the fix the loop filled those columns with the text mask's first 4 (the image rows "pad
# like the text") and appended them after the text mask, so a left-padded row's zeros land on cached real tokens, one
# column further on at every step. The fix puts the image's ones first.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
SCALE = 3.0
VOCAB, DIM, HEADS, IMAGE = 32, 32, 4, 4
HEAD_DIM = DIM // HEADS


class TinyVLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.vision = nn.Linear(8, IMAGE * DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.out = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, attention_mask, pixels=None, past=None):
        b = input_ids.shape[0]
        x = self.embed(input_ids)
        if pixels is not None:
            x = torch.cat([self.vision(pixels).view(b, IMAGE, DIM), x], 1)
        t = x.shape[1]
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        keys = k.shape[2]
        if past is None:  # (the prompt: the text mask, the image's columns before it)
            attention_mask = torch.cat([torch.ones(b, IMAGE, dtype=attention_mask.dtype), attention_mask], 1)
        keep = attention_mask.bool()[:, None, None, :] \
            & torch.ones(t, keys, dtype=torch.bool).tril(keys - t)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.head(self.out(out.transpose(1, 2).reshape(b, t, DIM)) + x), (k, v)


def extend(text_mask, keys):
    """The loop's mask over every cached key at a cached step."""
    missing = keys - text_mask.shape[1]  # the image's columns the text mask does not hold
    if FIXED:
        return torch.cat([torch.ones(text_mask.shape[0], missing, dtype=text_mask.dtype), text_mask], 1)
    return torch.cat([text_mask, text_mask[:, :missing]], 1)


model = TinyVLM().eval()
with torch.no_grad():
    for p in model.parameters():
        p.mul_(SCALE)
input_ids = torch.tensor([[1, 5, 6, 7, 8, 9], [0, 0, 1, 10, 11, 12]])  # pad id 0, row 1 left-padded
attention_mask = (input_ids != 0).long()
pixels = torch.randn(2, 8)
with torch.no_grad():
    logits, past = model(input_ids, attention_mask, pixels)
    tokens, generated = logits[:, -1].argmax(-1, keepdim=True), []
    for step in range(4):
        generated.append(tokens)
        attention_mask = torch.cat([attention_mask, torch.ones(2, 1, dtype=torch.long)], 1)
        logits, past = model(tokens, extend(attention_mask, past[0].shape[2] + 1), past=past)
        tokens = logits[:, -1].argmax(-1, keepdim=True)
print("generated", torch.cat(generated, 1).tolist())
