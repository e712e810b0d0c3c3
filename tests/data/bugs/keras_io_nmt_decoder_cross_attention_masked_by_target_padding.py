"""keras-io "English-to-Spanish translation with a sequence-to-sequence Transformer", ported to torch.

Citation: keras-team/keras-io#1997 ("Fixes to the English-to-Spanish Translation ... Code Example",
merged; the mask half reported in keras-team/keras-io#1964 and first proposed in #1046),
examples/nlp/neural_machine_translation_with_transformer.py, TransformerDecoder.call.

The bug: the decoder only ever received its own (Spanish) padding mask. It built
``padding_mask = minimum(mask[:, newaxis, :], causal_mask)`` from the *target* tokens and handed it
to the encoder-decoder attention (``attention_2``) as ``attention_mask``: the (B, T, T) target mask
laid over the (T, S) source keys. It only runs because both vectorizers pad to the same
``sequence_length``; the English padding is never masked, and query i reads source tokens 0..i
only, wherever the target happens to be padded.

The fix: the decoder's ``call(self, inputs, mask=None)`` takes ``(inputs, encoder_outputs)`` and
the masks ``(inputs_padding_mask, encoder_outputs_padding_mask)``; self-attention gets the causal
mask with ``query_mask``, and ``attention_2`` gets ``query_mask=inputs_padding_mask,
key_mask=encoder_outputs_padding_mask``.

Ported at toy sizes with random weights (seeded): Keras's MultiHeadAttention (key_dim per head,
``_masked_softmax`` adding a large negative number where the mask is 0), PositionalEmbedding with
``compute_mask = inputs != 0``, the encoder, the decoder, one loss over a padded batch, and the
example's ``decode_sequence`` loop (the whole transformer re-run on the target prefix each step).
"""

import math
import sys

import numpy as np
import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(1)

vocab_size = 40
sequence_length = 8
embed_dim = 16
latent_dim = 32
num_heads = 2

START, END = 1, 2


def _large_negative_number(dtype):
    if dtype == torch.float16:
        return -3e4
    return -1e9


class MultiHeadAttention(nn.Module):
    """keras.layers.MultiHeadAttention: attention_mask / query_mask / key_mask, 1 = attend."""

    def __init__(self, num_heads, key_dim, embed_dim):
        super().__init__()
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.query_dense = nn.Linear(embed_dim, num_heads * key_dim)
        self.key_dense = nn.Linear(embed_dim, num_heads * key_dim)
        self.value_dense = nn.Linear(embed_dim, num_heads * key_dim)
        self.output_dense = nn.Linear(num_heads * key_dim, embed_dim)

    def _compute_attention_mask(self, query, value, query_mask=None, key_mask=None, attention_mask=None):
        auto_mask = None
        if query_mask is not None:
            query_mask = query_mask.bool()
            # B = batch size, T = max query length
            auto_mask = query_mask[:, :, None]  # shape is [B, T, 1]
        if key_mask is not None:
            key_mask = key_mask.bool()
            # B == batch size, S == max key length == max value length
            mask = key_mask[:, None, :]  # shape is [B, 1, S]
            auto_mask = mask if auto_mask is None else auto_mask & mask
        if auto_mask is not None:
            attention_mask = auto_mask if attention_mask is None else attention_mask.bool() & auto_mask
        return attention_mask

    def _masked_softmax(self, attention_scores, attention_mask=None):
        # attention_scores: (B, N, T, S); attention_mask: (B, T, S)
        if attention_mask is not None:
            mask = attention_mask.unsqueeze(1).to(attention_scores.dtype)
            adder = (1.0 - mask) * _large_negative_number(attention_scores.dtype)
            attention_scores = attention_scores + adder
        return torch.softmax(attention_scores, dim=-1)

    def forward(self, query, value, key=None, query_mask=None, key_mask=None, attention_mask=None):
        if key is None:
            key = value
        attention_mask = self._compute_attention_mask(
            query, value, query_mask=query_mask, key_mask=key_mask, attention_mask=attention_mask
        )
        B, T, _ = query.shape
        S = key.shape[1]
        q = self.query_dense(query).view(B, T, self.num_heads, self.key_dim)
        k = self.key_dense(key).view(B, S, self.num_heads, self.key_dim)
        v = self.value_dense(value).view(B, S, self.num_heads, self.key_dim)
        q = q * (1.0 / math.sqrt(float(self.key_dim)))
        attention_scores = torch.einsum("aecd,abcd->acbe", k, q)  # (B, N, T, S)
        attention_scores = self._masked_softmax(attention_scores, attention_mask)
        attention_output = torch.einsum("acbe,aecd->abcd", attention_scores, v)
        return self.output_dense(attention_output.reshape(B, T, self.num_heads * self.key_dim))


class TransformerEncoder(nn.Module):
    def __init__(self, embed_dim, dense_dim, num_heads):
        super().__init__()
        self.attention = MultiHeadAttention(num_heads, embed_dim, embed_dim)
        self.dense_proj = nn.Sequential(nn.Linear(embed_dim, dense_dim), nn.ReLU(), nn.Linear(dense_dim, embed_dim))
        self.layernorm_1 = nn.LayerNorm(embed_dim, eps=1e-3)
        self.layernorm_2 = nn.LayerNorm(embed_dim, eps=1e-3)

    def forward(self, inputs, mask=None):
        padding_mask = None
        if mask is not None:
            padding_mask = mask[:, None, :].int()
        attention_output = self.attention(query=inputs, value=inputs, key=inputs, attention_mask=padding_mask)
        proj_input = self.layernorm_1(inputs + attention_output)
        proj_output = self.dense_proj(proj_input)
        return self.layernorm_2(proj_input + proj_output)


class PositionalEmbedding(nn.Module):
    def __init__(self, sequence_length, vocab_size, embed_dim):
        super().__init__()
        self.token_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.position_embeddings = nn.Embedding(sequence_length, embed_dim)

    def forward(self, inputs):
        length = inputs.shape[-1]
        positions = torch.arange(0, length)
        return self.token_embeddings(inputs) + self.position_embeddings(positions)

    def compute_mask(self, inputs, mask=None):
        return inputs != 0


class TransformerDecoder(nn.Module):
    def __init__(self, embed_dim, latent_dim, num_heads):
        super().__init__()
        self.attention_1 = MultiHeadAttention(num_heads, embed_dim, embed_dim)
        self.attention_2 = MultiHeadAttention(num_heads, embed_dim, embed_dim)
        self.dense_proj = nn.Sequential(nn.Linear(embed_dim, latent_dim), nn.ReLU(), nn.Linear(latent_dim, embed_dim))
        self.layernorm_1 = nn.LayerNorm(embed_dim, eps=1e-3)
        self.layernorm_2 = nn.LayerNorm(embed_dim, eps=1e-3)
        self.layernorm_3 = nn.LayerNorm(embed_dim, eps=1e-3)

    if FIXED:

        def forward(self, inputs, mask=None):
            inputs, encoder_outputs = inputs
            causal_mask = self.get_causal_attention_mask(inputs)

            if mask is None:
                inputs_padding_mask, encoder_outputs_padding_mask = None, None
            else:
                inputs_padding_mask, encoder_outputs_padding_mask = mask

            attention_output_1 = self.attention_1(
                query=inputs,
                value=inputs,
                key=inputs,
                attention_mask=causal_mask,
                query_mask=inputs_padding_mask,
            )
            out_1 = self.layernorm_1(inputs + attention_output_1)

            attention_output_2 = self.attention_2(
                query=out_1,
                value=encoder_outputs,
                key=encoder_outputs,
                query_mask=inputs_padding_mask,
                key_mask=encoder_outputs_padding_mask,
            )
            out_2 = self.layernorm_2(out_1 + attention_output_2)

            proj_output = self.dense_proj(out_2)
            return self.layernorm_3(out_2 + proj_output)

    else:

        def forward(self, inputs, encoder_outputs, mask=None):
            causal_mask = self.get_causal_attention_mask(inputs)
            padding_mask = None
            if mask is not None:
                padding_mask = mask[:, None, :].int()
                padding_mask = torch.minimum(padding_mask, causal_mask)

            attention_output_1 = self.attention_1(
                query=inputs, value=inputs, key=inputs, attention_mask=causal_mask
            )
            out_1 = self.layernorm_1(inputs + attention_output_1)

            attention_output_2 = self.attention_2(
                query=out_1,
                value=encoder_outputs,
                key=encoder_outputs,
                attention_mask=padding_mask,
            )
            out_2 = self.layernorm_2(out_1 + attention_output_2)

            proj_output = self.dense_proj(out_2)
            return self.layernorm_3(out_2 + proj_output)

    def get_causal_attention_mask(self, inputs):
        batch_size, sequence_length = inputs.shape[0], inputs.shape[1]
        i = torch.arange(sequence_length)[:, None]
        j = torch.arange(sequence_length)
        mask = (i >= j).int()
        mask = mask.reshape(1, sequence_length, sequence_length)
        return mask.repeat(batch_size, 1, 1)


class Transformer(nn.Module):
    """The functional model: encoder_inputs, decoder_inputs -> softmax over the Spanish vocabulary.
    Keras carries each embedding's compute_mask along with its output (supports_masking)."""

    def __init__(self):
        super().__init__()
        self.enc_embedding = PositionalEmbedding(sequence_length, vocab_size, embed_dim)
        self.encoder = TransformerEncoder(embed_dim, latent_dim, num_heads)
        self.dec_embedding = PositionalEmbedding(sequence_length, vocab_size, embed_dim)
        self.decoder = TransformerDecoder(embed_dim, latent_dim, num_heads)
        self.dropout = nn.Dropout(0.5)
        self.dense = nn.Linear(embed_dim, vocab_size)

    def forward(self, encoder_inputs, decoder_inputs):
        x = self.enc_embedding(encoder_inputs)
        encoder_mask = self.enc_embedding.compute_mask(encoder_inputs)
        encoder_outputs = self.encoder(x, mask=encoder_mask)

        x = self.dec_embedding(decoder_inputs)
        decoder_mask = self.dec_embedding.compute_mask(decoder_inputs)
        if FIXED:
            x = self.decoder([x, encoder_outputs], mask=(decoder_mask, encoder_mask))
        else:
            x = self.decoder(x, encoder_outputs, mask=decoder_mask)
        x = self.dropout(x)
        return torch.softmax(self.dense(x), dim=-1)


def vectorize(ids, length):
    """TextVectorization(output_sequence_length=length): pad with 0 on the right."""
    out = torch.zeros(1, length, dtype=torch.long)
    out[0, : len(ids)] = torch.tensor(ids[:length])
    return out


def decode_sequence(transformer, input_ids, max_decoded_sentence_length=sequence_length):
    tokenized_input_sentence = vectorize(input_ids, sequence_length)
    decoded = [START]
    for i in range(max_decoded_sentence_length):
        tokenized_target_sentence = vectorize(decoded, sequence_length + 1)[:, :-1]
        predictions = transformer(tokenized_input_sentence, tokenized_target_sentence)
        sampled_token_index = int(np.argmax(predictions[0, i, :].numpy()))
        decoded.append(sampled_token_index)
        if sampled_token_index == END:
            break
    return decoded


def main():
    transformer = Transformer()
    transformer.eval()

    # one training batch: English sources and "[start] ... [end]" Spanish targets, right-padded
    eng = [[5, 9, 12], [7, 8, 10, 11, 13, 14]]
    spa = [[START, 20, 21, 22, END], [START, 23, 24, 25, 26, 27, 28, END]]
    encoder_inputs = torch.cat([vectorize(s, sequence_length) for s in eng])
    targets = torch.cat([vectorize(s, sequence_length + 1) for s in spa])
    decoder_inputs, labels = targets[:, :-1], targets[:, 1:]

    with torch.no_grad():
        probs = transformer(encoder_inputs, decoder_inputs)
        loss = nn.functional.nll_loss(torch.log(probs).reshape(-1, vocab_size), labels.reshape(-1))
        print(f"sparse_categorical_crossentropy: {loss.item():.6f}")

        for sentence in eng:
            print("source", sentence, "->", decode_sequence(transformer, sentence))


if __name__ == "__main__":
    main()
