"""T5-style seq2seq: causal decoder self-attention plus cross-attention over a padded, SHORTER encoder.

Follows huggingface/transformers src/transformers/models/t5/modeling_t5.py (T5Attention, T5Stack,
get_extended_attention_mask / invert_attention_mask): the padding mask is turned into an additive float
mask with torch.finfo(dtype).min; the decoder self-attention adds a causal mask; the cross-attention
uses only the *encoder* padding mask, broadcast over all decoder positions. Summarisation in reverse:
a 5-token source expands into a 12-token target, so the cross-attention has more queries than keys.
"""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class T5Config:
    d_model: int = 32
    num_heads: int = 4
    d_kv: int = 8
    vocab_size: int = 50
    pad_token_id: int = 0


def invert_attention_mask(encoder_attention_mask, dtype):
    """[bs, src] 1/0 -> additive [bs, 1, 1, src]."""
    ext = encoder_attention_mask[:, None, None, :].to(dtype)
    return (1.0 - ext) * torch.finfo(dtype).min


def get_extended_attention_mask(attention_mask, dtype):
    """Decoder: causal AND padding, additive [bs, 1, tgt, tgt]."""
    bs, seq_length = attention_mask.shape
    seq_ids = torch.arange(seq_length)
    causal_mask = seq_ids[None, None, :].repeat(bs, seq_length, 1) <= seq_ids[None, :, None]
    ext = causal_mask[:, None, :, :].to(dtype) * attention_mask[:, None, None, :].to(dtype)
    return (1.0 - ext) * torch.finfo(dtype).min


class T5Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads, self.key_value_proj_dim = config.num_heads, config.d_kv
        inner = self.n_heads * self.key_value_proj_dim
        self.q = nn.Linear(config.d_model, inner, bias=False)
        self.k = nn.Linear(config.d_model, inner, bias=False)
        self.v = nn.Linear(config.d_model, inner, bias=False)
        self.o = nn.Linear(inner, config.d_model, bias=False)

    def forward(self, hidden_states, mask, key_value_states=None):
        bs = hidden_states.shape[0]
        src = hidden_states if key_value_states is None else key_value_states

        def shape(x):
            return x.view(bs, -1, self.n_heads, self.key_value_proj_dim).transpose(1, 2)

        q, k, v = shape(self.q(hidden_states)), shape(self.k(src)), shape(self.v(src))
        scores = torch.matmul(q, k.transpose(3, 2))     # T5 does not scale
        scores = scores + mask
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(attn_weights, v).transpose(1, 2).reshape(bs, -1, self.n_heads * self.key_value_proj_dim)
        return self.o(out)


class T5Block(nn.Module):
    def __init__(self, config, is_decoder):
        super().__init__()
        self.is_decoder = is_decoder
        self.SelfAttention = T5Attention(config)
        if is_decoder:
            self.EncDecAttention = T5Attention(config)

    def forward(self, hidden_states, attention_mask, encoder_hidden_states=None, encoder_attention_mask=None):
        hidden_states = hidden_states + self.SelfAttention(hidden_states, attention_mask)
        if self.is_decoder:
            hidden_states = hidden_states + self.EncDecAttention(
                hidden_states, encoder_attention_mask, key_value_states=encoder_hidden_states)
        return hidden_states


def main():
    torch.manual_seed(0)
    config = T5Config()
    embed = nn.Embedding(config.vocab_size, config.d_model)
    encoder, decoder = T5Block(config, False).eval(), T5Block(config, True).eval()

    input_ids = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0]])
    attention_mask = (input_ids != config.pad_token_id).long()
    decoder_input_ids = torch.randint(1, config.vocab_size, (2, 12))
    decoder_attention_mask = torch.ones_like(decoder_input_ids)

    with torch.no_grad():
        dtype = embed.weight.dtype
        enc = encoder(embed(input_ids), invert_attention_mask(attention_mask, dtype))
        dec = decoder(embed(decoder_input_ids), get_extended_attention_mask(decoder_attention_mask, dtype),
                      encoder_hidden_states=enc,
                      encoder_attention_mask=invert_attention_mask(attention_mask, dtype))
    print("decoder", tuple(dec.shape))


if __name__ == "__main__":
    main()
