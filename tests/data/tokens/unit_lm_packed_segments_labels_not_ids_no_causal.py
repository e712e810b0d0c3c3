"""A speech-unit language model (a GSLM-style uLM) trained on packed utterances: each row packs several utterances,
their segment numbers in the batch dict's `segment_ids` (0 = padding at the row's end), and the model's own forward
computes the next-unit loss on `labels` shifted by one, as a Hugging Face causal LM does. The labels are the raw
units (0 .. n_units-1); the input ids are the units moved past the special tokens (pad 0, bos 1, eos 2, unk 3), so
the labels are not the ids. The eager attention keeps each utterance to itself but never adds the causal part: every
unit sees the later units of its utterance, the very unit its loss asks it to predict (python FILE; --fixed: the
segment mask and a causal one together).
"""
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
CONFIG = {"n_units": 20, "special_tokens": 4, "pad_token_id": 0, "bos_token_id": 1, "d_model": 32, "n_heads": 4,
          "n_layers": 2}


class UnitAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.d = cfg["n_heads"], cfg["d_model"]
        self.qkv = nn.Linear(self.d, 3 * self.d)
        self.out = nn.Linear(self.d, self.d)

    def forward(self, x, segment_ids):
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        same = segment_ids[:, :, None] == segment_ids[:, None, :]
        allowed = same & (segment_ids[:, None, :] > 0)
        if FIXED:
            allowed = allowed & torch.ones(n, n, dtype=torch.bool).tril()
        allowed = allowed | torch.eye(n, dtype=torch.bool)  # (a pad query keeps itself: no empty row)
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        weights = scores.softmax(dim=-1)
        return self.out((weights @ v).permute(0, 2, 1, 3).reshape(b, n, self.d))


class UnitLMForCausalLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        vocab = cfg["n_units"] + cfg["special_tokens"]
        self.embed = nn.Embedding(vocab, cfg["d_model"], padding_idx=cfg["pad_token_id"])
        self.pos = nn.Embedding(64, cfg["d_model"])
        self.blocks = nn.ModuleList(UnitAttention(cfg) for _ in range(cfg["n_layers"]))
        self.unit_head = nn.Linear(cfg["d_model"], cfg["n_units"])  # (predicts raw units, not ids)

    def forward(self, input_ids, segment_ids, labels=None):
        positions = torch.arange(input_ids.shape[1])
        x = self.embed(input_ids) + self.pos(positions)[None]
        for block in self.blocks:
            x = x + block(x, segment_ids)
        logits = self.unit_head(x)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                                   ignore_index=-100)
        return loss, logits


def pack(utterances, length, cfg):
    """Rows of `length` tokens: bos + units moved past the special ids per utterance, numbered 1, 2, ... per row."""
    rows = {"input_ids": [], "segment_ids": [], "labels": []}
    ids, segs, labs, number = [], [], [], 0
    for units in utterances:
        piece = [cfg["bos_token_id"]] + [u + cfg["special_tokens"] for u in units]
        if len(ids) + len(piece) > length:
            pad = length - len(ids)
            rows["input_ids"].append(ids + [cfg["pad_token_id"]] * pad)
            rows["segment_ids"].append(segs + [0] * pad)
            rows["labels"].append(labs + [-100] * pad)
            ids, segs, labs, number = [], [], [], 0
        number += 1
        ids, segs, labs = ids + piece, segs + [number] * len(piece), labs + [-100] + list(units)
    pad = length - len(ids)
    rows["input_ids"].append(ids + [cfg["pad_token_id"]] * pad)
    rows["segment_ids"].append(segs + [0] * pad)
    rows["labels"].append(labs + [-100] * pad)
    return {k: torch.tensor(v) for k, v in rows.items()}


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    utterances = [torch.randint(0, CONFIG["n_units"], (n,), generator=g).tolist() for n in (5, 7, 4, 6, 8, 3)]
    batch = pack(utterances, 20, CONFIG)
    model = UnitLMForCausalLM(CONFIG)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        loss, _ = model(**batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
