# The stale draft cache of mlc-llm#2939 written as Hugging Face-style assisted generation: the assistant model keeps a
# tuple of per-layer (key, value) past_key_values and is called with position_ids; after the target rejects some
# draft tokens the fix crops the assistant's cache to the accepted length (transformers' `_crop_past_key_values`),
# the bug keeps it, so the next draft step attends to the rejected drafts' keys.
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
VOCAB, DIM, HEADS, LAYERS = 25, 16, 2, 2
HEAD_DIM = DIM // HEADS


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.pos = nn.Embedding(64, DIM)

    def forward(self, x, position_ids, past):
        b, t, _ = x.shape
        x = x + self.pos(position_ids)
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        if past is not None:
            k, v = torch.cat([past[0], k], 2), torch.cat([past[1], v], 2)
        scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
        total = k.shape[2]
        future = torch.ones(t, total, dtype=torch.bool).triu(total - t + 1)
        scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v
        return x + out.transpose(1, 2).reshape(b, t, DIM), (k, v)


class Assistant(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.out = nn.Linear(DIM, VOCAB)

    def forward(self, input_ids, position_ids, past_key_values=None):
        x, new = self.embed(input_ids), []
        for i, block in enumerate(self.blocks):
            x, kv = block(x, position_ids, None if past_key_values is None else past_key_values[i])
            new.append(kv)
        return self.out(x), tuple(new)


def crop(past, length):
    return tuple((k[:, :, :length], v[:, :, :length]) for k, v in past)


assistant = Assistant().eval()
sequence = [2, 7, 1, 8, 2, 8]
num_assistant_tokens = 3
with torch.no_grad():
    ids = torch.tensor([sequence[:-1]])
    _, past = assistant(ids, torch.arange(ids.shape[1])[None])
    for round_ in range(2):
        last, drafts = sequence[-1], []
        for j in range(num_assistant_tokens):
            pos = torch.tensor([[len(sequence) - 1 + j]])
            logits, past = assistant(torch.tensor([[last]]), pos, past)
            last = int(logits[0, -1].argmax())
            drafts.append(last)
        accepted = drafts[:1]  # the target keeps the first draft and corrects the second
        sequence += accepted + [(drafts[1] + 1) % VOCAB]
        if FIXED:
            past = crop(past, len(sequence) - 1)  # the assistant's cache holds every token but the newest
        print("round", round_, "sequence", len(sequence), "assistant cache", past[0][0].shape[2])
