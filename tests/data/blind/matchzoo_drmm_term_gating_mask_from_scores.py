# NTMC-Community/MatchZoo-py#81 (commit f4c2858): DRMM's term-gating Attention built its mask from
# the projected scores (`x != self.mask` on linear(x)), not from the padded query ids, so the
# padded query terms (mask_value 0) were never masked and took softmax weight in the ranking score.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class Attention(nn.Module):
    """Attention module (term gating over the query terms)."""

    def __init__(self, input_size: int = 100, mask: int = 0):
        super().__init__()
        self.linear = nn.Linear(input_size, 1, bias=False)
        self.mask = mask

    def forward(self, x, x_mask=None):
        """Perform attention on the input."""
        x = self.linear(x).squeeze(dim=-1)
        if FIXED:
            x = x.masked_fill(x_mask, -float('inf'))
        else:
            mask = (x != self.mask)
            x = x.masked_fill(mask == self.mask, -float('inf'))
        return F.softmax(x, dim=-1)


class DRMM(nn.Module):
    def __init__(self, vocab_size=100, embedding_output_dim=16, hist_bin_size=5, mask_value=0):
        super().__init__()
        self._params = {'embedding_output_dim': embedding_output_dim, 'hist_bin_size': hist_bin_size,
                        'mask_value': mask_value}
        self.embedding = nn.Embedding(vocab_size, embedding_output_dim)
        self.attention = Attention(input_size=self._params['embedding_output_dim'],
                                   mask=self._params['mask_value'])
        self.mlp = nn.Sequential(nn.Linear(hist_bin_size, 10), nn.Tanh(), nn.Linear(10, 1), nn.Tanh())
        self.out = nn.Linear(1, 1)

    def forward(self, inputs):
        # query: shape = [B, L]; match_hist: shape = [B, L, H]
        query, match_hist = inputs['text_left'], inputs['match_histogram']
        if FIXED:
            # shape = [B, L]
            mask_query = (query == self._params['mask_value'])
            embed_query = self.embedding(query.long())
            attention_probs = self.attention(embed_query, mask_query)
        else:
            query = self.embedding(query.long())
            # shape = [B, L]
            attention_probs = self.attention(query)
        # shape = [B, L]
        dense_output = self.mlp(match_hist).squeeze(dim=-1)
        x = torch.einsum('bl,bl->b', dense_output, attention_probs)
        out = self.out(x.unsqueeze(dim=-1))
        return out, attention_probs


def main():
    torch.manual_seed(0)
    model = DRMM().eval()
    # two (query, document) pairs; the second query has 2 terms, padded with mask_value 0 to length 5
    text_left = torch.tensor([[12, 45, 7, 88, 31],
                              [23, 56, 0, 0, 0]])
    match_hist = torch.rand(2, 5, 5)
    match_hist[1, 2:] = 0.0  # padded query terms have empty histograms
    with torch.no_grad():
        score, probs = model({'text_left': text_left, 'match_histogram': match_hist})
        # the same short query alone, without padding
        score_alone, _ = model({'text_left': text_left[1:, :2], 'match_histogram': match_hist[1:, :2]})
    print(f"{'fixed' if FIXED else 'buggy'}: gate weight on padded query terms {probs[1, 2:].sum().item():.3f}; "
          f"padded score {score[1].item():.4f} vs unpadded {score_alone[0].item():.4f}")


if __name__ == "__main__":
    main()
