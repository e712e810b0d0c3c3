"""keras.io English-to-Spanish Transformer example: cross-attention masked with the target's mask.

Citation: keras-team/keras-io PR #1046 "Fix masks in English-to-Spanish translation
example" (merged; description read, diff not read). Also reported again as
keras-team/keras-io#1964 ("TransformerDecoder second attention_mask maybe wrong ...
attention_mask should be set to padding_mask of encoder_inputs").

Bug (examples/nlp/neural_machine_translation_with_transformer.py, Keras/TF): in
`TransformerDecoder.call(inputs, encoder_outputs, mask=None)` the only mask is the
decoder inputs' Keras mask; it builds `padding_mask = mask[:, newaxis, :]`, reduces it
with `tf.minimum(padding_mask, causal_mask)` and hands that to `attention_2`, the
cross-attention over `encoder_outputs`. So each target position attends only to the
source positions at or before its own index that are real *target* tokens, and to the
source's padding; the source mask never reaches the decoder (the example gives source
and target the same `sequence_length`, so the shapes agree and nothing fails).
Fix (as the PR states it): pass `encoder_input_mask` (the source embedding's
`compute_mask`) to the decoder and use it on the cross-attention keys, so every target
position sees all the real source tokens; the target padding is applied along the
query axis and combined into the causal mask of the self-attention.

Reproduction: a torch port of the example's `PositionalEmbedding` (mask_zero,
`compute_mask = inputs != 0`), `TransformerEncoder`, `TransformerDecoder`, with a
Keras-semantics MultiHeadAttention (attention_mask 1 = attend; scores get
`(1 - mask) * -1e9` before softmax, as Keras' masked Softmax does). One pair with
5 real source tokens and 6 real target tokens out of sequence_length 8.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class MultiHeadAttention(nn.Module):
    """keras.layers.MultiHeadAttention semantics: attention_mask[b, t, s] = 1 lets t see s."""

    def __init__(self, num_heads, key_dim):
        super().__init__()
        self.num_heads, self.key_dim = num_heads, key_dim
        dim = num_heads * key_dim
        self.query_dense = nn.Linear(dim, dim)
        self.key_dense = nn.Linear(dim, dim)
        self.value_dense = nn.Linear(dim, dim)
        self.output_dense = nn.Linear(dim, dim)

    def forward(self, query, value, key, attention_mask=None):
        B, T, _ = query.shape
        S = key.shape[1]
        q = self.query_dense(query).view(B, T, self.num_heads, self.key_dim).transpose(1, 2)
        k = self.key_dense(key).view(B, S, self.num_heads, self.key_dim).transpose(1, 2)
        v = self.value_dense(value).view(B, S, self.num_heads, self.key_dim).transpose(1, 2)
        scores = (q * self.key_dim ** -0.5) @ k.transpose(-2, -1)
        if attention_mask is not None:
            scores = scores + (1.0 - attention_mask[:, None].float()) * -1e9
        weights = F.softmax(scores, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(B, T, -1)
        return self.output_dense(out)


class PositionalEmbedding(nn.Module):
    def __init__(self, sequence_length, vocab_size, embed_dim):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.position_embeddings = nn.Embedding(sequence_length, embed_dim)

    def forward(self, inputs):
        positions = torch.arange(inputs.shape[-1])
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return inputs != 0


class TransformerEncoder(nn.Module):
    def __init__(self, embed_dim, dense_dim, num_heads):
        super().__init__()
        self.attention = MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads)
        self.dense_proj = nn.Sequential(nn.Linear(embed_dim, dense_dim), nn.ReLU(), nn.Linear(dense_dim, embed_dim))
        self.layernorm_1 = nn.LayerNorm(embed_dim)
        self.layernorm_2 = nn.LayerNorm(embed_dim)

    def forward(self, inputs, mask=None):
        padding_mask = None
        if mask is not None:
            padding_mask = mask[:, None, :].int()
        attention_output = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        return self.layernorm_2(proj_input + self.dense_proj(proj_input))


class TransformerDecoder(nn.Module):
    def __init__(self, embed_dim, latent_dim, num_heads):
        super().__init__()
        self.attention_1 = MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads)
        self.attention_2 = MultiHeadAttention(num_heads=num_heads, key_dim=embed_dim // num_heads)
        self.dense_proj = nn.Sequential(nn.Linear(embed_dim, latent_dim), nn.ReLU(), nn.Linear(latent_dim, embed_dim))
        self.layernorm_1 = nn.LayerNorm(embed_dim)
        self.layernorm_2 = nn.LayerNorm(embed_dim)
        self.layernorm_3 = nn.LayerNorm(embed_dim)

    def get_causal_attention_mask(self, inputs):
        batch_size, sequence_length = inputs.shape[0], inputs.shape[1]
        i = torch.arange(sequence_length)[:, None]
        j = torch.arange(sequence_length)
        mask = (i >= j).int()
        return mask.reshape(1, sequence_length, sequence_length).expand(batch_size, -1, -1)

    def forward(self, inputs, encoder_outputs, encoder_input_mask=None, mask=None):
        causal_mask = self.get_causal_attention_mask(inputs)
        if FIXED:
            cross_mask = None
            if mask is not None:
                padding_mask = mask[:, :, None].int()
                causal_mask = torch.minimum(padding_mask, causal_mask)
            if encoder_input_mask is not None:
                cross_mask = encoder_input_mask[:, None, :].int()
        else:
            if mask is not None:
                padding_mask = mask[:, None, :].int()
                padding_mask = torch.minimum(padding_mask, causal_mask)
            cross_mask = padding_mask

        attention_output_1 = self.attention_1(query=inputs, value=inputs, key=inputs, attention_mask=causal_mask)
        out_1 = self.layernorm_1(inputs + attention_output_1)

        attention_output_2 = self.attention_2(
            query=out_1, value=encoder_outputs, key=encoder_outputs, attention_mask=cross_mask)
        out_2 = self.layernorm_2(out_1 + attention_output_2)
        return self.layernorm_3(out_2 + self.dense_proj(out_2))


def main():
    torch.manual_seed(0)
    embed_dim, latent_dim, num_heads = 32, 64, 4
    sequence_length, vocab_size = 8, 50
    enc_embed = PositionalEmbedding(sequence_length, vocab_size, embed_dim)
    encoder = TransformerEncoder(embed_dim, latent_dim, num_heads)
    dec_embed = PositionalEmbedding(sequence_length, vocab_size, embed_dim)
    decoder = TransformerDecoder(embed_dim, latent_dim, num_heads)

    encoder_inputs = torch.tensor([[12, 7, 33, 4, 9, 0, 0, 0]])
    decoder_inputs = torch.tensor([[2, 15, 8, 41, 6, 19, 0, 0]])
    with torch.no_grad():
        x = enc_embed(encoder_inputs)
        encoder_input_mask = enc_embed.compute_mask(encoder_inputs)
        encoder_outputs = encoder(x, mask=encoder_input_mask)
        y = dec_embed(decoder_inputs)
        # before the fix the example never handed the source mask to the decoder
        extra = {"encoder_input_mask": encoder_input_mask} if FIXED else {}
        out = decoder(y, encoder_outputs, mask=dec_embed.compute_mask(decoder_inputs), **extra)
    print("fixed" if FIXED else "buggy", "target pos 0:", [round(v, 4) for v in out[0, 0, :4].tolist()])


if __name__ == "__main__":
    main()
