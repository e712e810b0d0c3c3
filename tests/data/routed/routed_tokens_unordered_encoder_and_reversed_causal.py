# Correct: two attentions over tokens a gather routes out of each row, neither claiming the sequence's order.
# 1. A token-selection encoder (DynamicViT / EViT style): the top-k patches by score, gathered best first, attend to each
#    other whole: no causal mask, so their order says nothing.
# 2. A backward language model over routed tokens: the routed positions sorted in decreasing order, a causal mask over
#    that order, so each token sees the tokens after it in the sequence, as a right-to-left model means to.
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(1)


class Routed(nn.Module):
    def __init__(self, dim, keep):
        super().__init__()
        self.keep = keep
        self.qkv = nn.Linear(dim, 3 * dim)
        self.score = nn.Linear(dim, 1)

    def attend(self, tokens, causal):
        b, k, d = tokens.shape
        q, key, v = (t.view(b, k, 2, -1).transpose(1, 2) for t in self.qkv(tokens).chunk(3, dim=-1))
        return F.scaled_dot_product_attention(q, key, v, is_causal=causal)

    def forward(self, x):
        d = x.shape[-1]
        best = self.score(x).squeeze(-1).topk(self.keep, dim=1).indices        # best first, not in position order
        encoded = self.attend(torch.gather(x, 1, best[..., None].expand(-1, -1, d)), causal=False)
        backward = best.sort(dim=1, descending=True).values                    # right to left
        right_to_left = self.attend(torch.gather(x, 1, backward[..., None].expand(-1, -1, d)), causal=True)
        return encoded, right_to_left


model = Routed(16, keep=6).eval()
with torch.no_grad():
    encoded, right_to_left = model(torch.randn(2, 12, 16))
print(encoded.shape, right_to_left.shape)
