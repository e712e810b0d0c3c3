# cumc-dbmi/cehrbert commit 8c98e10 ("Fixed the lookback mask"); the cache came in with commit f26807e
# ("Cache the previously computed states for the GPT Decoder in inference"), so the code before the fix
# is models/gpt_model.py at 21639e4 (cache on, old mask).
# CEHR-GPT generates synthetic patient timelines (concept tokens, one per step) with
# GptInferenceModel._generate_next_token, which keeps every decoder layer's outputs in a cache and runs
# only the new token through the layers. The look-ahead mask for the new rows was built as
# `1 - band_part(ones((current_length - previous_length, current_length)), -1, 0)`: the lower band of
# that rectangle is anchored at the top-left, so the new token (row 0) may attend to key 0 only.
# Fix: take rows `previous_length:current_length` of the square `(current_length, current_length)` mask.
# Ported from TensorFlow/Keras (models/gpt_model.py, models/layers/custom_layers.py GptDecoder /
# GptDecoderLayer / MultiHeadAttention / scaled_dot_product_attention, keras_transformer ReusableEmbedding,
# TiedOutputEmbedding, TransformerCoordinateEmbedding) to torch with the same structure.
import sys

import numpy as np
import torch
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class ConceptTokenizer:
    def __init__(self, vocab_size):
        self.vocab_size = vocab_size

    def get_start_token_id(self):
        return 1

    def get_end_token_id(self):
        return 2


def point_wise_feed_forward_network(d_model, dff):
    return nn.Sequential(nn.Linear(d_model, dff), nn.ReLU(), nn.Linear(dff, d_model))


def scaled_dot_product_attention(q, k, v, mask):
    matmul_qk = torch.matmul(q, k.transpose(-1, -2))  # (..., seq_len_q, seq_len_k)
    dk = torch.tensor(k.shape[-1], dtype=torch.float32)
    scaled_attention_logits = matmul_qk / torch.sqrt(dk)
    # add the mask to the scaled tensor.
    if mask is not None:
        scaled_attention_logits += mask.to(torch.float32) * -1e9
    attention_weights = torch.softmax(scaled_attention_logits, dim=-1)
    output = torch.matmul(attention_weights, v)
    return output, attention_weights


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.d_model = d_model
        assert d_model % self.num_heads == 0
        self.depth = d_model // self.num_heads
        self.wq = nn.Linear(d_model, d_model)
        self.wk = nn.Linear(d_model, d_model)
        self.wv = nn.Linear(d_model, d_model)
        self.dense = nn.Linear(d_model, d_model)

    def split_heads(self, x, batch_size):
        x = x.reshape(batch_size, -1, self.num_heads, self.depth)
        return x.permute(0, 2, 1, 3)

    def forward(self, v, k, q, mask):
        batch_size = q.shape[0]
        q = self.wq(q)
        k = self.wk(k)
        v = self.wv(v)
        q = self.split_heads(q, batch_size)
        k = self.split_heads(k, batch_size)
        v = self.split_heads(v, batch_size)
        scaled_attention, attention_weights = scaled_dot_product_attention(q, k, v, mask)
        scaled_attention = scaled_attention.permute(0, 2, 1, 3)
        concat_attention = scaled_attention.reshape(batch_size, -1, self.d_model)
        return self.dense(concat_attention), attention_weights


class GptDecoderLayer(nn.Module):
    def __init__(self, d_model, num_heads, dff, rate=0.1):
        super().__init__()
        self.mha = MultiHeadAttention(d_model, num_heads)
        self.ffn = point_wise_feed_forward_network(d_model, dff)
        self.layernorm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.layernorm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout1 = nn.Dropout(rate)
        self.dropout2 = nn.Dropout(rate)

    def forward(self, query, key, value, decoder_mask):
        attn, attn_weights_block = self.mha(v=value, k=key, q=query, mask=decoder_mask)
        attn = self.dropout1(attn)
        out = self.layernorm1(attn + query)
        ffn_output = self.dropout2(self.ffn(out))
        out2 = self.layernorm2(ffn_output + out)
        return out2, attn_weights_block


class GptDecoder(nn.Module):
    def __init__(self, num_layers, d_model, num_heads, dff=2148, dropout_rate=0.1):
        super().__init__()
        self.num_layers = num_layers
        self.decoder_layers = nn.ModuleList(
            [GptDecoderLayer(d_model, num_heads, dff, dropout_rate) for _ in range(num_layers)])

    def forward(self, x, mask):
        layer_contexts = []
        for i in range(self.num_layers):
            x, _ = self.decoder_layers[i](x, x, x, mask)
            layer_contexts.append(x)
        return x, torch.stack(layer_contexts, dim=0)


class ReusableEmbedding(nn.Embedding):
    def forward(self, inputs):
        return super().forward(inputs), self.weight


class TiedOutputEmbedding(nn.Module):
    def __init__(self, d_model, emb_output_dim):
        super().__init__()
        self.projection = nn.Parameter(torch.empty(d_model, emb_output_dim))
        nn.init.xavier_uniform_(self.projection)

    def forward(self, inputs):
        main_input, embedding_matrix = inputs
        projected = main_input @ self.projection
        return projected @ embedding_matrix.t()


class TransformerCoordinateEmbedding(nn.Module):
    def __init__(self, max_transformer_depth, sequence_length, d_model):
        super().__init__()
        self.word_position_embeddings = nn.Parameter(torch.empty(sequence_length, d_model).uniform_(-0.05, 0.05))
        self.depth_embeddings = nn.Parameter(torch.empty(max_transformer_depth, d_model).uniform_(-0.05, 0.05))

    def forward(self, inputs, step):
        return inputs + self.word_position_embeddings + self.depth_embeddings[step]


class GptModel(nn.Module):
    """create_model(): concept embeddings + coordinate embedding -> GptDecoder -> tied output."""

    def __init__(self, context_window_size, vocab_size, embedding_size, num_heads, depth, dff):
        super().__init__()
        self.concept_embedding_layer = ReusableEmbedding(vocab_size, embedding_size)
        self.positional_encoding_layer = TransformerCoordinateEmbedding(depth, context_window_size, embedding_size)
        self.transformer_block = GptDecoder(depth, embedding_size, num_heads, dff=dff)
        self.output_layer = TiedOutputEmbedding(embedding_size, embedding_size)


class GptInferenceModel(nn.Module):
    def __init__(self, gpt_model, tokenizer, context_window, top_k):
        super().__init__()
        self.context_window = context_window
        self.tokenizer = tokenizer
        self.top_k = top_k
        self.concept_embedding_layer = gpt_model.concept_embedding_layer
        self.positional_encoding_layer = gpt_model.positional_encoding_layer
        self.output_layer = gpt_model.output_layer
        self.gpt_decoder = gpt_model.transformer_block

    def _generate_next_token(self, generated_tokens, cached_contexts):
        current_length = generated_tokens.shape[-1]
        previous_length = cached_contexts.shape[2] if cached_contexts is not None else 0

        first_layer_context, concept_embedding_matrix = self.concept_embedding_layer(generated_tokens)
        # Add the positional embeddings
        first_layer_context = first_layer_context + self.positional_encoding_layer.word_position_embeddings[:current_length]
        first_layer_context = first_layer_context + self.positional_encoding_layer.depth_embeddings[0]

        if FIXED:
            look_ahead_mask_base = (
                1 - torch.tril(torch.ones((current_length, current_length)))
            ).to(torch.int32)[None, None, previous_length:current_length, :]
        else:
            look_ahead_mask_base = (
                1 - torch.tril(torch.ones((current_length - previous_length, current_length)))
            ).to(torch.int32)[None, None, :, :]

        if cached_contexts is not None:
            # Slice out the new token representations
            x = first_layer_context[:, previous_length:current_length]
        else:
            x = first_layer_context

        layer_contexts = []
        for i in range(self.gpt_decoder.num_layers):
            if i == 0:
                value = first_layer_context
            elif cached_contexts is not None:
                # Concat the previous context with the x representation
                value = torch.cat([cached_contexts[i - 1], x], dim=1)
            else:
                value = x

            x, attn_weights = self.gpt_decoder.decoder_layers[i](
                query=x, key=value, value=value, decoder_mask=look_ahead_mask_base)
            layer_contexts.append(x)

        layer_contexts = torch.stack(layer_contexts, dim=0)

        if cached_contexts is not None:
            new_cached_contexts = torch.cat([cached_contexts, layer_contexts], dim=2)
        else:
            new_cached_contexts = layer_contexts

        logtis = self.output_layer([x, concept_embedding_matrix])
        return logtis, new_cached_contexts

    @torch.no_grad()
    def forward(self, inputs, generator):
        length = inputs.shape[1]
        cached_contexts = None
        while length < self.context_window:
            outputs, cached_contexts = self._generate_next_token(torch.from_numpy(inputs), cached_contexts)
            pred_logits, indices = torch.topk(outputs, k=self.top_k, dim=-1, sorted=True)
            next_token_indices = indices[:, -1, :]
            next_token_logits = pred_logits[:, -1, :]
            choice = torch.multinomial(torch.softmax(next_token_logits, dim=-1), 1, generator=generator)
            next_tokens = torch.gather(next_token_indices, 1, choice).numpy()
            # Stitch up the new tokens and previously generated tokens
            inputs = np.hstack([inputs, next_tokens])
            _, length = np.shape(inputs)
            if np.all(np.any(inputs == self.tokenizer.get_end_token_id(), axis=-1)):
                break
        return inputs


VOCAB_SIZE = 24
CONTEXT_WINDOW = 12
tokenizer = ConceptTokenizer(VOCAB_SIZE)
gpt_model = GptModel(CONTEXT_WINDOW, VOCAB_SIZE, embedding_size=16, num_heads=2, depth=2, dff=32).eval()
inference_model = GptInferenceModel(gpt_model, tokenizer, context_window=CONTEXT_WINDOW, top_k=5).eval()

# [START], year, age, gender, race tokens of two patients
prompts = np.array([[1, 7, 12, 4, 9], [1, 8, 15, 5, 9]], dtype=np.int64)
generator = torch.Generator().manual_seed(1234)
sequences = inference_model(prompts, generator)
print("generated patient sequences:")
print(sequences)
