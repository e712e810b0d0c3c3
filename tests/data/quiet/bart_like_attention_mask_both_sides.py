"""A hand-written BART-style encoder-decoder (as transformers' modeling_bart.py names its arguments, without its
config): `attention_mask` is the source's padding (1 = real), `decoder_attention_mask` the target's; the encoder is
bidirectional over real source tokens, the decoder causal over real target tokens, its `encoder_attn` masked with
the source padding. Source and target are both 5 tokens long, padded differently.

Right: no real query of either side sees its own side's padding, nor the decoder's queries the source's."""
import torch
import torch.nn.functional as F
from torch import nn


class BartAttention(nn.Module):
    def __init__(self, d=16, heads=2):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, hidden_states, key_value_states=None, attention_mask=None):
        b, t, d = hidden_states.shape
        kv = hidden_states if key_value_states is None else key_value_states
        q = self.q_proj(hidden_states).view(b, t, self.heads, -1).transpose(1, 2)
        k = self.k_proj(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], self.heads, -1).transpose(1, 2)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask).transpose(1, 2).reshape(b, t, d)


class DecoderLayer(nn.Module):
    def __init__(self, d=16):
        super().__init__()
        self.self_attn, self.encoder_attn = BartAttention(d), BartAttention(d)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states, encoder_attention_mask):
        hidden_states = hidden_states + self.self_attn(hidden_states, attention_mask=attention_mask)
        return hidden_states + self.encoder_attn(hidden_states, encoder_hidden_states, encoder_attention_mask)


class BartModel(nn.Module):
    def __init__(self, d=16, vocab=32):
        super().__init__()
        self.shared = nn.Embedding(vocab, d, padding_idx=1)
        self.encoder = nn.ModuleList(BartAttention(d) for _ in range(2))
        self.decoder = nn.ModuleList(DecoderLayer(d) for _ in range(2))

    def forward(self, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
        t = decoder_input_ids.shape[1]
        src_keys = attention_mask.bool()[:, None, None, :]
        causal = torch.tril(torch.ones(t, t, dtype=torch.bool))
        tgt_keys = causal[None, None] & decoder_attention_mask.bool()[:, None, None, :]
        tgt_keys = tgt_keys | ~decoder_attention_mask.bool()[:, None, :, None]  # pad rows see all: no NaN (as HF)
        x = self.shared(input_ids)
        for layer in self.encoder:
            x = x + layer(x, attention_mask=src_keys)
        y = self.shared(decoder_input_ids)
        for layer in self.decoder:
            y = layer(y, tgt_keys, x, src_keys)
        return y


def main():
    torch.manual_seed(0)
    input_ids = torch.tensor([[0, 5, 6, 7, 2], [0, 8, 2, 1, 1]])
    decoder_input_ids = torch.tensor([[2, 0, 9, 1, 1], [2, 0, 4, 5, 6]])
    with torch.no_grad():
        out = BartModel().eval()(input_ids, (input_ids != 1).long(), decoder_input_ids, (decoder_input_ids != 1).long())
    print(tuple(out.shape))


if __name__ == "__main__":
    main()
