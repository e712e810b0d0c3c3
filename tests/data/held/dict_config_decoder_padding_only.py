"""A causal LM ported from a BERT-style encoder, configured by a dict (`self.cfg = {"is_decoder": True, ...}`): its
mask builder reads only the padding (left-padded batch), so each token sees the tokens after it. --fixed ands in the
causal triangle when cfg["is_decoder"].
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class LM(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg["vocab"], cfg["width"])
        self.qkv = nn.Linear(cfg["width"], 3 * cfg["width"])
        self.head = nn.Linear(cfg["width"], cfg["vocab"])

    def mask(self, attention_mask):
        b, t = attention_mask.shape
        allowed = attention_mask.bool()[:, None, None, :].expand(b, 1, t, t)
        if FIXED and self.cfg["is_decoder"]:
            allowed = allowed & torch.ones(t, t, dtype=torch.bool).tril()
        return allowed | torch.eye(t, dtype=torch.bool)  # (padding rows keep their own key: no NaN)

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.cfg["heads"], -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask(attention_mask))
        return self.head(out.transpose(1, 2).reshape(b, t, d))


def main():
    torch.manual_seed(0)
    model = LM({"vocab": 20, "width": 16, "heads": 2, "is_decoder": True}).eval()
    input_ids = torch.tensor([[0, 0, 5, 6, 7], [3, 4, 5, 6, 7]])
    with torch.no_grad():
        logits = model(input_ids, attention_mask=(input_ids != 0).long())
    print("logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
