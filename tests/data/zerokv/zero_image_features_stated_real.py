"""Correct: zero keys the program states are tokens (written here, for checks/zerokv.py to stay quiet on).

A small vision-language decoder, left-padded, whose image placeholder tokens are replaced by the projected image
features, as LLaVA and Gemma 3 splice them in. The image here is blank and the projector has no bias, so the image
tokens' embeddings, and their K and V under bias-free projections, are exactly zero: a run of zero keys right after
each row's padding. The model call's `attention_mask` states they are real tokens (1), and the mask hides only the
padding (0): the image tokens are attended as the program means. Runs the same with or without --fixed.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

IMAGE_TOKEN_ID = 9


class TinyVLM(nn.Module):
    def __init__(self, vocab=16, dim=32, heads=4, patches=3):
        super().__init__()
        self.heads, self.patches = heads, patches
        self.embed = nn.Embedding(vocab, dim)
        self.projector = nn.Linear(12, dim, bias=False)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, pixel_values, attention_mask):
        b, n = input_ids.shape
        x = self.embed(input_ids)
        features = self.projector(pixel_values)  # (b, patches, dim): zero for a blank image
        x = x.masked_scatter((input_ids == IMAGE_TOKEN_ID)[..., None], features)
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        mask = mask | torch.eye(n, dtype=torch.bool)  # (a padding query sees itself: no empty row)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.head(y.transpose(1, 2).reshape(b, n, -1))


if __name__ == "__main__":
    torch.manual_seed(0)
    model = TinyVLM().eval()
    input_ids = torch.tensor([[0, 0, 9, 9, 9, 4, 5, 6], [9, 9, 9, 7, 8, 4, 5, 6]])  # row 0 left-padded (pad id 0)
    attention_mask = (torch.arange(8)[None] >= torch.tensor([[2], [0]])).long()
    pixel_values = torch.zeros(2, 3, 12)  # a blank image
    with torch.no_grad():
        logits = model(input_ids=input_ids, pixel_values=pixel_values, attention_mask=attention_mask)
    print("logits", tuple(logits.shape))
