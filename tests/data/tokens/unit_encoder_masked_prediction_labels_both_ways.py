"""A correct program of the same shape that must stay quiet: a HuBERT-style masked unit predictor over packed
utterances (segment numbers in `segment_ids`, 0 = padding). Its forward computes the loss on `labels` at the same
positions (the masked units, -100 elsewhere), not shifted, so each utterance attends both ways on purpose: nothing
the program states asks for a causal mask. (python FILE; --fixed runs the same program.)
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG = {"n_units": 20, "special_tokens": 4, "pad_token_id": 0, "mask_token_id": 3, "d_model": 32, "n_heads": 4}


class UnitEncoderForMaskedLM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.h, self.d = cfg["n_heads"], cfg["d_model"]
        self.embed = nn.Embedding(cfg["n_units"] + cfg["special_tokens"], self.d, padding_idx=cfg["pad_token_id"])
        self.qkv = nn.Linear(self.d, 3 * self.d)
        self.head = nn.Linear(self.d, cfg["n_units"])

    def forward(self, input_ids, segment_ids, labels=None):
        x = self.embed(input_ids)
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.h, -1).permute(0, 2, 1, 3) for t in self.qkv(x).chunk(3, dim=-1))
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        allowed = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] > 0)
        allowed = allowed | torch.eye(n, dtype=torch.bool)
        weights = scores.masked_fill(~allowed[:, None], float("-inf")).softmax(dim=-1)
        logits = self.head((weights @ v).permute(0, 2, 1, 3).reshape(b, n, self.d))
        loss = None if labels is None else F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
        return loss, logits


def main():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    units = torch.randint(0, CONFIG["n_units"], (2, 16), generator=g)
    segment_ids = torch.tensor([[1] * 7 + [2] * 9, [1] * 10 + [2] * 3 + [0] * 3])
    input_ids = torch.where(segment_ids > 0, units + CONFIG["special_tokens"], CONFIG["pad_token_id"])
    masked = (torch.rand(2, 16, generator=g) < 0.4) & (segment_ids > 0)
    labels = torch.where(masked, units, -100)
    input_ids = torch.where(masked, CONFIG["mask_token_id"], input_ids)
    model = UnitEncoderForMaskedLM(CONFIG)
    loss, _ = model(input_ids, segment_ids, labels=labels)
    loss.backward()
    print(f"loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
