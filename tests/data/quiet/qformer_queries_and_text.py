"""BLIP-2's Q-Former (transformers' Blip2QFormerModel, salesforce/LAVIS Qformer.py): 4 learned query tokens
cross-attend to the image encoder's 4 patch features (every patch real: no mask), and in the self-attention the
queries and the text tokens attend to each other, the text padded (`attention_mask` over queries + text: the
queries' ones concatenated in front of the text's, as LAVIS does). The queries are as many as the patches.

Right: every real token sees every real token of [queries, text]; the cross-attention (queries to patches) is
full."""
import torch
import torch.nn.functional as F
from torch import nn


class QFormerAttention(nn.Module):
    def __init__(self, d=16, heads=2, is_cross_attention=False):
        super().__init__()
        self.heads = heads
        self.query, self.key, self.value = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None):
        b, t, d = hidden_states.shape
        kv = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        q = self.query(hidden_states).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.key(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        v = self.value(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask).transpose(1, 2).reshape(b, t, d)


class QFormerLayer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.attention = QFormerAttention(d)
        self.crossattention = QFormerAttention(d)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states, query_length):
        hidden_states = hidden_states + self.attention(hidden_states, attention_mask)
        queries = hidden_states[:, :query_length]
        queries = queries + self.crossattention(queries, encoder_hidden_states=encoder_hidden_states)
        return torch.cat([queries, hidden_states[:, query_length:]], dim=1)


class QFormer(nn.Module):
    def __init__(self, d=16, num_query_tokens=4, vocab=32):
        super().__init__()
        self.query_tokens = nn.Parameter(torch.randn(1, num_query_tokens, d))
        self.embed = nn.Embedding(vocab, d)
        self.layer = nn.ModuleList(QFormerLayer(d) for _ in range(2))

    def forward(self, input_ids, attention_mask, image_embeds):
        b = input_ids.shape[0]
        query = self.query_tokens.expand(b, -1, -1)
        hidden = torch.cat([query, self.embed(input_ids)], dim=1)
        full_mask = torch.cat([torch.ones(b, query.shape[1], dtype=attention_mask.dtype), attention_mask], dim=1)
        extended = full_mask.bool()[:, None, None, :]
        for layer in self.layer:
            hidden = layer(hidden, extended, image_embeds, query.shape[1])
        return hidden


def main():
    torch.manual_seed(0)
    input_ids = torch.tensor([[5, 6, 7], [8, 9, 0]])
    attention_mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad():
        out = QFormer().eval()(input_ids, attention_mask, torch.randn(2, 4, 16))
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
