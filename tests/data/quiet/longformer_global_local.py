"""Longformer's attention as a dense mask (allenai/longformer; transformers' LongformerSelfAttention computes it
banded, the same cells): each token sees a symmetric window of `attention_window // 2` tokens each side; tokens with
`global_attention_mask` = 1 (the [CLS] token, a question) see every token and are seen by every token; padding
(`attention_mask` = 0) is seen by no one. Bidirectional: an encoder, no causal triangle.

Right: local band | global rows | global columns, then the padded keys removed."""
import torch
from torch import nn


class LongformerSelfAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, allowed):
        b, t, d = hidden_states.shape
        q, k, v = (lin(hidden_states).view(b, t, self.heads, -1).transpose(1, 2)
                   for lin in (self.query, self.key, self.value))
        scores = (q @ k.transpose(-1, -2)) / (d // self.heads) ** 0.5
        scores = scores.masked_fill(~allowed[:, None], torch.finfo(scores.dtype).min)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)


class LongformerModel(nn.Module):
    def __init__(self, d=16, attention_window=4, vocab=32):
        super().__init__()
        self.attention_window = attention_window
        self.embeddings = nn.Embedding(vocab, d, padding_idx=1)
        self.layer = nn.ModuleList(LongformerSelfAttention(d) for _ in range(2))

    def forward(self, input_ids, attention_mask, global_attention_mask):
        t = input_ids.shape[1]
        i = torch.arange(t)
        local = (i[:, None] - i[None, :]).abs() <= self.attention_window // 2
        is_global = global_attention_mask.bool()
        allowed = local[None] | is_global[:, :, None] | is_global[:, None, :]
        allowed = allowed & attention_mask.bool()[:, None, :]
        h = self.embeddings(input_ids)
        for layer in self.layer:
            h = h + layer(h, allowed)
        return h


def main():
    torch.manual_seed(0)
    input_ids = torch.tensor([[0, 5, 6, 7, 8, 9, 10, 11, 12, 2], [0, 5, 6, 7, 8, 9, 2, 1, 1, 1]])
    attention_mask = (input_ids != 1).long()
    global_attention_mask = torch.zeros_like(input_ids)
    global_attention_mask[:, 0] = 1  # [CLS] attends globally
    with torch.no_grad():
        out = LongformerModel().eval()(input_ids, attention_mask, global_attention_mask)
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
