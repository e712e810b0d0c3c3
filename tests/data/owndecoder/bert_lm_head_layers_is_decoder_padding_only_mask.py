"""A BERT-style LM head model written by hand (as BertLMHeadModel ports write it): each layer keeps
`self.is_decoder = True` (the model generates left to right), and its extended attention mask is built from the
padding alone, a float additive mask handed to SDPA over a right-padded batch, so each token sees the ones after it.
--fixed: a decoder layer's extended mask ands in the causal triangle, as BertModel.get_extended_attention_mask does
where config.is_decoder.
"""
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class BertSelfAttention(nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, hidden_states, extended_attention_mask):
        b, t, d = hidden_states.shape
        q, k, v = (f(hidden_states).view(b, t, self.heads, -1).transpose(1, 2) for f in (self.query, self.key, self.value))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=extended_attention_mask)
        return out.transpose(1, 2).reshape(b, t, d)


class BertLayer(nn.Module):
    def __init__(self, hidden, heads, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.attention = BertSelfAttention(hidden, heads)
        self.output = nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden))

    def extended_mask(self, attention_mask):
        b, t = attention_mask.shape
        keep = attention_mask[:, None, None, :].bool().expand(b, 1, t, t)
        if FIXED and self.is_decoder:
            keep = keep & torch.ones(t, t, dtype=torch.bool).tril()
        keep = keep | torch.eye(t, dtype=torch.bool)  # (a pad row keeps its own key)
        return torch.zeros(b, 1, t, t).masked_fill(~keep, torch.finfo(torch.float32).min)

    def forward(self, hidden_states, attention_mask):
        h = hidden_states + self.attention(hidden_states, self.extended_mask(attention_mask))
        return h + self.output(h)


class BertLMHeadModel(nn.Module):
    def __init__(self, vocab=40, hidden=16, heads=2, layers=2):
        super().__init__()
        self.word_embeddings = nn.Embedding(vocab, hidden, padding_idx=0)
        self.layer = nn.ModuleList(BertLayer(hidden, heads, is_decoder=True) for _ in range(layers))
        self.cls = nn.Linear(hidden, vocab)

    def forward(self, input_ids, attention_mask):
        h = self.word_embeddings(input_ids)
        for layer in self.layer:
            h = layer(h, attention_mask)
        return self.cls(h)


def main():
    torch.manual_seed(0)
    model = BertLMHeadModel().eval()
    input_ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]])
    with torch.no_grad():
        logits = model(input_ids, attention_mask=(input_ids != 0).long())
    print("next-token logits", tuple(logits.shape))


if __name__ == "__main__":
    main()
