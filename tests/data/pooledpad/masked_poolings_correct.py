# Correct attention poolings over a padded batch, each as a project writes it:
# - AllenNLP's masked_softmax (its memory-efficient=False path): softmax(vector * mask), times the mask, renormalised,
#   then the weights times the values summed over the tokens;
# - a multi-head pooling (one learned query per head) whose scores are filled with -inf at the pads before the softmax,
#   pooled with einsum "bhl,bld->bhd";
# - an unpadded batch pooled by softmax(scores, dim=1) and sum(weights * h, dim=1), no mask needed.
import torch
import torch.nn as nn

torch.manual_seed(0)


def masked_softmax(vector: torch.Tensor, mask: torch.Tensor, dim: int = -1) -> torch.Tensor:
    mask = mask.float()
    result = torch.nn.functional.softmax(vector * mask, dim=dim)
    result = result * mask
    return result / (result.sum(dim=dim, keepdim=True) + 1e-13)


class Encoder(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(50, d, padding_idx=0)
        layer = nn.TransformerEncoderLayer(d, nhead=2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.score = nn.Linear(d, 1)
        self.queries = nn.Parameter(torch.randn(3, d))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        h = self.encoder(self.embed(input_ids), src_key_padding_mask=attention_mask == 0)
        alpha = masked_softmax(self.score(h).squeeze(-1), attention_mask)  # (B, L)
        pooled = (alpha.unsqueeze(-1) * h).sum(dim=1)
        scores = torch.einsum("hd,bld->bhl", self.queries, h)
        scores = scores.masked_fill(attention_mask[:, None, :] == 0, float("-inf"))
        heads = torch.einsum("bhl,bld->bhd", scores.softmax(dim=-1), h)
        return pooled, heads


class Unpadded(nn.Module):
    def __init__(self, d: int = 16):
        super().__init__()
        self.embed = nn.Embedding(50, d)
        self.weighting = nn.Linear(d, 1)

    def forward(self, input_ids: torch.Tensor):
        h = self.embed(input_ids)
        weights = torch.softmax(self.weighting(h), dim=1)
        return torch.sum(weights * h, dim=1)


lengths = [9, 5, 7]
input_ids = torch.zeros(3, 9, dtype=torch.long)
for row, n in enumerate(lengths):
    input_ids[row, :n] = torch.randint(1, 50, (n,))
attention_mask = (input_ids != 0).long()
with torch.no_grad():
    pooled, heads = Encoder().eval()(input_ids, attention_mask)
    plain = Unpadded()(torch.randint(0, 50, (2, 6)))
print(pooled.shape, heads.shape, plain.shape)
