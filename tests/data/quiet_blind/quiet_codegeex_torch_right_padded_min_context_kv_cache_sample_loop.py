# Citation: THUDM/CodeGeeX codegeex/torch/inference.py @593ef9e2319e6eae64091e61725be2be41d63d35
#   (get_ltor_masks_and_position_ids, get_batch, pad_batch, top_k_logits, switch, get_token_stream,
#   sample_sequence_batch) and codegeex/torch/codegeex_model.py @a2b6a15321a54e90e1c9c72bee65821ea9de713f
#   (SelfAttention, TopQuerySelfAttention, TransformerLayer, TopQueryLayer, Transformer, Embedding,
#   QueryEmbedding, TransformerLanguageModel, CodeGeeXModel). Trimmed: fp32 on CPU (the .half() casts and
#   .cuda() calls dropped), no checkpoint loading / state_dict helpers, a stub tokenizer, tiny sizes.
# CodeGeeX's Megatron-derived batch generation: every prompt is RIGHT-padded to seq_length with the eos id
# (pad_batch), one lower-triangular bool mask (True = hidden) of seq_length x seq_length is built for the batch
# (get_ltor_masks_and_position_ids with no resets), positions are 0..seq_length-1 for every row. Generation
# starts at the shortest prompt's length: the first call prefills tokens[:, :context_length] and keeps
# layer_past = [(k, v)] per layer (sequence-first, concatenated on dim 0); each later call feeds the single token
# at context_length - 1 and the attention slices row attention_scores.size(3) - 1 of the mask. Rows whose prompt
# is longer have not `started`: switch() writes their own prompt token back instead of the sampled one, so a
# pad slot is overwritten before it is ever fed, and the cache only ever holds real tokens of each row. Scores
# get `- attention_mask * 10000.0` before the softmax; the top query layer attends with query embeddings of
# the positions as its queries.
# Self-check: every logit row the loop consumed (for a row still inside its prompt or already generating) is
# compared with the same model run on that row alone, unpadded, recomputed from scratch with no cache; the
# greedy run's tokens are the argmax of the reference; a recompute=True run gives the same greedy tokens.
import math
import sys
from typing import *

import torch
import torch.nn.functional as F

torch.manual_seed(0)
DEVICE = torch.device("cpu")


# ---------------------------------------------------------------- codegeex/torch/codegeex_model.py
def fast_gelu(x):
    """Mindspore's fast gelu implementation."""
    return x / (1 + torch.exp(-1.702 * torch.abs(x))) * torch.exp(0.851 * (x - torch.abs(x)))


class MLP(torch.nn.Module):
    def __init__(self, hidden_size):
        super(MLP, self).__init__()
        self.hidden_size = hidden_size
        self.dense_h_to_4h = torch.nn.Linear(self.hidden_size, 4 * self.hidden_size)
        self.activation_func = fast_gelu
        self.dense_4h_to_h = torch.nn.Linear(4 * self.hidden_size, self.hidden_size)

    def forward(self, hidden_states):
        intermediate_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = self.activation_func(intermediate_parallel)
        output = self.dense_4h_to_h(intermediate_parallel)
        return output


class SelfAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, fp16=False,
                 attention_softmax_in_fp32=False):
        super(SelfAttention, self).__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.fp16 = fp16
        self.attention_softmax_in_fp32 = attention_softmax_in_fp32
        self.layer_number = max(1, layer_number)

        assert self.hidden_size % self.num_attention_heads == 0
        self.hidden_size_per_attention_head = int(self.hidden_size // self.num_attention_heads)

        self.query = torch.nn.Linear(self.hidden_size, self.hidden_size)
        self.key = torch.nn.Linear(self.hidden_size, self.hidden_size)
        self.value = torch.nn.Linear(self.hidden_size, self.hidden_size)

        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.softmax = torch.nn.Softmax(dim=-1)

        self.dense = torch.nn.Linear(self.hidden_size, self.hidden_size)

    def forward(self, hidden_states, attention_mask, layer_past=None, get_key_value=False,
                prompt_length=None, context_length=None):
        # hidden_states: [sq, b, h]
        query_layer = self.query(hidden_states)
        key_layer = self.key(hidden_states)
        value_layer = self.value(hidden_states)

        new_query_layer_shape = query_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        query_layer = query_layer.view(*new_query_layer_shape)

        new_query_layer_shape = key_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        key_layer = key_layer.view(*new_query_layer_shape)

        new_query_layer_shape = value_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        value_layer = value_layer.view(*new_query_layer_shape)

        # Adjust key and value for inference
        if layer_past is not None:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key.type_as(key_layer),
                                   key_layer), dim=0)
            value_layer = torch.cat((past_value.type_as(value_layer),
                                     value_layer), dim=0)
        if get_key_value:
            present = (key_layer, value_layer)

        # [b, np, sq, sk]
        output_size = (query_layer.size(1),
                       query_layer.size(2),
                       query_layer.size(0),
                       key_layer.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.contiguous().view(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.contiguous().view(output_size[3], output_size[0] * output_size[1], -1)

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.matmul(query_layer.transpose(0, 1),
                                     key_layer.transpose(0, 1).transpose(1, 2)) / self.norm_factor

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        # Update attention mask for inference. [b, np, sq, sk]
        if get_key_value:
            with torch.no_grad():
                if layer_past is not None:
                    attention_mask = attention_mask[
                                     ...,
                                     attention_scores.size(3) - 1,
                                     :attention_scores.size(3)].unsqueeze(2)
                else:
                    attention_mask = attention_mask[
                                     ...,
                                     :attention_scores.size(3),
                                     :attention_scores.size(3)]

        if context_length is not None:
            attention_mask = torch.clone(attention_mask)
            attention_mask[:, :, context_length:, :] = True

        # attention scores and attention mask [b, np, sq, sk]
        attention_scores = attention_scores - attention_mask * 10000.0
        if self.attention_softmax_in_fp32:
            attention_probs = self.softmax(attention_scores.float()).half()
        else:
            attention_probs = self.softmax(attention_scores)

        # context layer shape: [b, np, sq, hn]
        output_size = (value_layer.size(1),
                       value_layer.size(2),
                       query_layer.size(0),
                       value_layer.size(3))

        # change view [sq, b * np, hn]
        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)

        # change view [b * np, sq, sk]
        attention_probs = attention_probs.view(output_size[0] * output_size[1],
                                               output_size[2], -1)

        context_layer = torch.bmm(attention_probs, value_layer.unsqueeze(0).transpose(1, 2).squeeze(0))

        # change view [b, np, sq, hn]
        context_layer = context_layer.view(*output_size)

        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()

        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.size()[:-2] + \
                                  (self.hidden_size,)
        context_layer = context_layer.view(*new_context_layer_shape)

        output = self.dense(context_layer)

        if get_key_value:
            output = [output, present]

        return output


class TopQuerySelfAttention(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, fp16=False,
                 attention_softmax_in_fp32=False):
        super(TopQuerySelfAttention, self).__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.fp16 = fp16
        self.attention_softmax_in_fp32 = attention_softmax_in_fp32
        self.layer_number = max(1, layer_number)

        assert self.hidden_size % self.num_attention_heads == 0
        self.hidden_size_per_attention_head = int(self.hidden_size // self.num_attention_heads)

        self.query = torch.nn.Linear(self.hidden_size, self.hidden_size)
        self.key = torch.nn.Linear(self.hidden_size, self.hidden_size)
        self.value = torch.nn.Linear(self.hidden_size, self.hidden_size)

        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        self.softmax = torch.nn.Softmax(dim=-1)

        self.dense = torch.nn.Linear(self.hidden_size, self.hidden_size)

    def forward(self, hidden_states, query_hidden_state, attention_mask, layer_past=None,
                get_key_value=False, prompt_length=None, context_length=None):
        # hidden_states: [sq, b, h]
        query_layer = self.query(query_hidden_state)
        key_layer = self.key(hidden_states)
        value_layer = self.value(hidden_states)

        new_query_layer_shape = query_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        query_layer = query_layer.view(*new_query_layer_shape)

        new_query_layer_shape = key_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        key_layer = key_layer.view(*new_query_layer_shape)

        new_query_layer_shape = value_layer.size()[:-1] + \
                                (self.num_attention_heads,
                                 self.hidden_size_per_attention_head)
        value_layer = value_layer.view(*new_query_layer_shape)

        if layer_past is not None:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key.type_as(key_layer),
                                   key_layer), dim=0)
            value_layer = torch.cat((past_value.type_as(value_layer),
                                     value_layer), dim=0)
        if get_key_value:
            present = (key_layer, value_layer)

        output_size = (query_layer.size(1),
                       query_layer.size(2),
                       query_layer.size(0),
                       key_layer.size(0))

        query_layer = query_layer.contiguous().view(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.contiguous().view(output_size[3], output_size[0] * output_size[1], -1)

        matmul_result = torch.matmul(query_layer.transpose(0, 1),
                                     key_layer.transpose(0, 1).transpose(1, 2)) / self.norm_factor

        attention_scores = matmul_result.view(*output_size)

        if get_key_value:
            with torch.no_grad():
                if layer_past is not None:
                    attention_mask = attention_mask[
                                     ...,
                                     attention_scores.size(3) - 1,
                                     :attention_scores.size(3)].unsqueeze(2)
                else:
                    attention_mask = attention_mask[
                                     ...,
                                     :attention_scores.size(3),
                                     :attention_scores.size(3)]

        if context_length is not None:
            attention_mask = torch.clone(attention_mask)
            attention_mask[:, :, context_length:, :] = True

        attention_scores = attention_scores - attention_mask * 10000.0
        if self.attention_softmax_in_fp32:
            attention_probs = self.softmax(attention_scores.float()).half()
        else:
            attention_probs = self.softmax(attention_scores)

        output_size = (value_layer.size(1),
                       value_layer.size(2),
                       query_layer.size(0),
                       value_layer.size(3))

        value_layer = value_layer.view(value_layer.size(0), output_size[0] * output_size[1], -1)

        attention_probs = attention_probs.view(output_size[0] * output_size[1],
                                               output_size[2], -1)

        context_layer = torch.bmm(attention_probs, value_layer.unsqueeze(0).transpose(1, 2).squeeze(0))

        context_layer = context_layer.view(*output_size)

        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()

        new_context_layer_shape = context_layer.size()[:-2] + \
                                  (self.hidden_size,)
        context_layer = context_layer.view(*new_context_layer_shape)

        output = self.dense(context_layer)

        if get_key_value:
            output = [output, present]

        return output


class TransformerLayer(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, layernorm_epsilon=1e-5,
                 fp16=False, attention_softmax_in_fp32=False):
        super(TransformerLayer, self).__init__()
        self.hidden_size = hidden_size
        self.layernorm_epsilon = layernorm_epsilon
        self.layer_number = layer_number

        self.input_layernorm = torch.nn.LayerNorm(hidden_size, eps=self.layernorm_epsilon)
        self.attention = SelfAttention(hidden_size, num_attention_heads, layer_number, fp16,
                                       attention_softmax_in_fp32)
        self.post_attention_layernorm = torch.nn.LayerNorm(self.hidden_size, eps=self.layernorm_epsilon)
        self.mlp = MLP(self.hidden_size)

    def forward(self, hidden_states, attention_mask, layer_past=None, get_key_value=False,
                prompt_length=None, context_length=None):
        layernorm_output = self.input_layernorm(hidden_states)

        attention_output = self.attention(layernorm_output,
                                          attention_mask,
                                          layer_past=layer_past,
                                          get_key_value=get_key_value,
                                          prompt_length=prompt_length,
                                          context_length=context_length)

        if get_key_value:
            attention_output, presents = attention_output

        residual = hidden_states
        layernorm_input = attention_output + residual

        layernorm_output = self.post_attention_layernorm(layernorm_input)
        mlp_output = self.mlp(layernorm_output)
        output = mlp_output + layernorm_input

        if get_key_value:
            output = [output, presents]

        return output


class TopQueryLayer(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, layer_number, layernorm_epsilon=1e-5):
        super(TopQueryLayer, self).__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.layernorm_epsilon = layernorm_epsilon
        self.layer_number = layer_number

        self.input_layernorm = torch.nn.LayerNorm(self.hidden_size, eps=self.layernorm_epsilon)
        self.attention = TopQuerySelfAttention(self.hidden_size, self.num_attention_heads, self.layer_number)
        self.post_attention_layernorm = torch.nn.LayerNorm(self.hidden_size, eps=self.layernorm_epsilon)
        self.mlp = MLP(self.hidden_size)

    def forward(self, hidden_states, query_hidden_state, attention_mask, layer_past=None,
                get_key_value=False, prompt_length=None, context_length=None):
        assert query_hidden_state != None

        layernorm_output = self.input_layernorm(hidden_states)

        attention_output = self.attention(layernorm_output,
                                          query_hidden_state,
                                          attention_mask,
                                          layer_past=layer_past,
                                          get_key_value=get_key_value,
                                          prompt_length=prompt_length,
                                          context_length=context_length)

        if get_key_value:
            attention_output, presents = attention_output

        residual = hidden_states
        layernorm_input = attention_output + residual

        layernorm_output = self.post_attention_layernorm(layernorm_input)

        mlp_output = self.mlp(layernorm_output)

        residual = layernorm_input
        output = mlp_output + residual

        if get_key_value:
            output = [output, presents]

        return output


class Transformer(torch.nn.Module):
    def __init__(self, hidden_size, num_attention_heads, num_layers, layernorm_epsilon=1e-5):
        super(Transformer, self).__init__()
        self.hidden_size = hidden_size
        self.num_attention_heads = num_attention_heads
        self.layernorm_epsilon = layernorm_epsilon
        self.num_layers = num_layers
        self.num_unique_layers = None

        assert self.num_unique_layers is None

        if self.num_unique_layers is None:
            self.num_unique_layers = self.num_layers
        assert self.num_layers % self.num_unique_layers == 0, \
            'number of layers should be divisible by number of unique layers'

        def build_layer(layer_number):
            return TransformerLayer(self.hidden_size, self.num_attention_heads, layer_number)

        self.layers = torch.nn.ModuleList(
            [build_layer(i + 1) for i in range(self.num_unique_layers)])

        self.topQueryLayer = TopQueryLayer(self.hidden_size,
                                           self.num_attention_heads,
                                           self.num_unique_layers)

        self.final_layernorm = torch.nn.LayerNorm(self.hidden_size, eps=self.layernorm_epsilon)

    def _get_layer_index(self, layer_number):
        return layer_number % self.num_unique_layers

    def _get_layer(self, layer_number):
        return self.layers[self._get_layer_index(layer_number)]

    def forward(self, hidden_states, query_hidden_state, attention_mask, layer_past=None,
                get_key_value=False, prompt_length=None, context_length=None):
        # data format change to avoid explicit tranposes : [b s h] --> [s b h]
        hidden_states = hidden_states.transpose(0, 1).contiguous()
        query_hidden_state = query_hidden_state.transpose(0, 1).contiguous()

        if get_key_value:
            presents = []
        for index in range(self.num_layers):
            layer = self._get_layer(index)
            past = None
            if layer_past is not None:
                past = layer_past[index]
            hidden_states = layer(hidden_states,
                                  attention_mask,
                                  layer_past=past,
                                  get_key_value=get_key_value,
                                  prompt_length=prompt_length,
                                  context_length=context_length)
            if get_key_value:
                hidden_states, present = hidden_states
                presents.append(present)

        hidden_states_ = self.final_layernorm(hidden_states)

        # top query layer
        past = None
        if layer_past is not None:
            past = layer_past[self.num_layers]
        hidden_states = self.topQueryLayer(hidden_states_,
                                           query_hidden_state,
                                           attention_mask,
                                           layer_past=past,
                                           get_key_value=get_key_value,
                                           prompt_length=prompt_length,
                                           context_length=context_length)

        if get_key_value:
            hidden_states, present = hidden_states
            presents.append(present)

        # reverting data format change [s b h] --> [b s h]
        output = hidden_states.transpose(0, 1).contiguous()

        if get_key_value:
            output = [output, presents]

        return output


class Embedding(torch.nn.Module):
    def __init__(self, hidden_size, vocab_size, max_sequence_length):
        super(Embedding, self).__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.word_embeddings = torch.nn.Embedding(self.vocab_size, self.hidden_size)
        self.position_embeddings = torch.nn.Embedding(self.max_sequence_length, self.hidden_size)

    def forward(self, input_ids, position_ids):
        words_embeddings = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        embeddings = words_embeddings + position_embeddings
        return embeddings


class QueryEmbedding(torch.nn.Module):
    def __init__(self, hidden_size, vocab_size, max_sequence_length):
        super(QueryEmbedding, self).__init__()
        self.hidden_size = hidden_size
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        # Top query position embedding (serial).
        self.top_query_embeddings = torch.nn.Embedding(self.max_sequence_length, self.hidden_size)

    def forward(self, position_ids):
        embeddings = self.top_query_embeddings(position_ids)
        return embeddings


class TransformerLanguageModel(torch.nn.Module):
    def __init__(self, hidden_size, num_layers, num_attention_heads, padded_vocab_size,
                 max_position_embeddings):
        super(TransformerLanguageModel, self).__init__()
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_attention_heads = num_attention_heads
        self.padded_vocab_size = padded_vocab_size
        self.max_position_embeddings = max_position_embeddings

        self.embedding = Embedding(self.hidden_size, self.padded_vocab_size, self.max_position_embeddings)
        self.topQueryEmbedding = QueryEmbedding(self.hidden_size, self.padded_vocab_size,
                                                self.max_position_embeddings)
        self.transformer = Transformer(self.hidden_size, self.num_attention_heads, self.num_layers)

    def forward(self, input_ids, position_ids, attention_mask, layer_past=None, get_key_value=False,
                prompt_length=None, context_length=None):
        embedding_output = self.embedding(input_ids, position_ids)
        query_position_ids = position_ids
        queryEmbedding_out = self.topQueryEmbedding(query_position_ids)

        transformer_output = self.transformer(embedding_output,
                                              queryEmbedding_out,
                                              attention_mask,
                                              layer_past=layer_past,
                                              get_key_value=get_key_value,
                                              prompt_length=prompt_length,
                                              context_length=context_length)

        return transformer_output


class CodeGeeXModel(torch.nn.Module):
    """CodeGeeX: A Multilingual Code Generation Model."""

    def __init__(self, hidden_size, num_layers, num_attention_heads, padded_vocab_size,
                 max_position_embeddings):
        super(CodeGeeXModel, self).__init__()
        self.language_model = TransformerLanguageModel(hidden_size,
                                                       num_layers,
                                                       num_attention_heads,
                                                       padded_vocab_size,
                                                       max_position_embeddings)

    def forward(self, input_ids, position_ids, attention_mask, layer_past=None, get_key_value=False,
                prompt_length=None, context_length=None):
        lm_output = self.language_model(input_ids,
                                        position_ids,
                                        attention_mask,
                                        layer_past=layer_past,
                                        get_key_value=get_key_value,
                                        prompt_length=prompt_length,
                                        context_length=context_length)

        if get_key_value:
            lm_output, presents = lm_output

        output = F.linear(lm_output, self.language_model.embedding.word_embeddings.weight)

        if get_key_value:
            output = [output, presents]

        return output


# ---------------------------------------------------------------- codegeex/torch/inference.py
def get_ltor_masks_and_position_ids(data, eod_token, reset_position_ids, reset_attention_mask):
    """Build masks and position id for left to right model."""
    micro_batch_size, seq_length = data.size()

    if reset_attention_mask:
        att_mask_batch = micro_batch_size
    else:
        att_mask_batch = 1
    attention_mask = torch.tril(
        torch.ones((att_mask_batch, seq_length, seq_length), device=data.device)
    ).view(att_mask_batch, 1, seq_length, seq_length)

    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)
    if reset_position_ids:
        position_ids = position_ids.clone()

    if reset_position_ids or reset_attention_mask:
        for b in range(micro_batch_size):
            eod_index = position_ids[b, data[b] == eod_token]
            if reset_position_ids:
                eod_index = eod_index.clone()
            prev_index = 0
            for j in range(eod_index.size()[0]):
                i = eod_index[j]
                if reset_attention_mask:
                    attention_mask[b, 0, (i + 1):, : (i + 1)] = 0
                if reset_position_ids:
                    position_ids[b, (i + 1):] -= i + 1 - prev_index
                    prev_index = i + 1

    # Convert attention mask to binary:
    attention_mask = attention_mask < 0.5

    return attention_mask, position_ids


def get_batch(context_tokens, micro_batch_size, eod_token, reset_position_ids=False,
              reset_attention_mask=False):
    """Generate batch from context tokens."""
    tokens = context_tokens.view(micro_batch_size, -1).contiguous().to(DEVICE)
    attention_mask, position_ids = get_ltor_masks_and_position_ids(
        tokens,
        eod_token,
        reset_position_ids,
        reset_attention_mask,
    )
    return tokens, attention_mask, position_ids


def top_k_logits(logits, top_k=0, top_p=0.0, filter_value=-float("Inf")):
    if top_k > 0:
        indices_to_remove = logits < torch.topk(logits, top_k)[0][..., -1, None]
        logits[indices_to_remove] = filter_value

    if top_p > 0.0:
        sorted_logits, sorted_indices = torch.sort(logits, descending=True, dim=-1)
        cumulative_probs = torch.cumsum(F.softmax(sorted_logits, dim=-1), dim=-1)

        sorted_indices_to_remove = cumulative_probs > top_p
        sorted_indices_to_remove[..., 1:] = sorted_indices_to_remove[..., :-1].clone()
        sorted_indices_to_remove[..., 0] = 0
        for i in range(sorted_indices.size(0)):
            indices_to_remove = sorted_indices[i][sorted_indices_to_remove[i]]
            logits[i][indices_to_remove] = filter_value

    return logits


def pad_batch(batch, pad_id, seq_length):
    context_lengths = []
    for tokens in batch:
        context_length = len(tokens)
        if context_length < seq_length:
            tokens.extend([pad_id] * (seq_length - context_length))
        context_lengths.append(context_length)
    return batch, context_lengths


def get_token_stream(model, tokenizer, seq_length, out_seq_length, context_tokens,
                     return_scores: bool = False, prompt_length: int = None,
                     micro_batch_size: int = None, bad_ids: List = None, temperature: float = 1.0,
                     topp: float = 1.0, topk: int = 0.0, greedy: bool = False, recompute: bool = False):
    context_tokens, context_lengths = pad_batch(context_tokens, tokenizer.eos_token_id, seq_length)

    context_tokens_tensor = torch.tensor(context_tokens, dtype=torch.long, device=DEVICE)
    context_length_tensor = torch.tensor(context_lengths, dtype=torch.long, device=DEVICE)
    context_length = context_length_tensor.min().item()
    tokens, attention_mask, position_ids = get_batch(
        context_tokens_tensor,
        micro_batch_size,
        tokenizer.eos_token_id,
    )

    batch_token_iterator = sample_sequence_batch(
        model,
        tokenizer,
        context_tokens_tensor,
        context_length_tensor,
        attention_mask,
        position_ids,
        seq_length=seq_length,
        out_seq_length=out_seq_length,
        return_scores=return_scores,
        prompt_length=prompt_length,
        bad_ids=bad_ids,
        temperature=temperature,
        topp=topp,
        topk=topk,
        greedy=greedy,
        recompute=recompute,
    )

    for tokens, lengths in batch_token_iterator:
        context_length += 1
        if tokens is not None:
            yield tokens[:, :context_length], lengths
        else:
            yield None, None


def switch(val1, val2, boolean):
    boolean = boolean.type_as(val1)
    return (1 - boolean) * val1 + boolean * val2


def sample_sequence_batch(model, tokenizer, context_tokens, context_lengths, attention_mask,
                          position_ids, seq_length, out_seq_length, maxlen=None,
                          return_scores: bool = False, prompt_length: int = None,
                          bad_ids: List = None, temperature: float = 1.0, topp: float = 1.0,
                          topk: int = 0.0, recompute: bool = False, greedy: bool = False):
    model.eval()
    with torch.no_grad():
        context_length = context_lengths.min().item()
        eos_id = tokenizer.eos_token_id

        counter = 0
        org_context_length = context_length

        layer_past = None
        batch_size = context_tokens.size(0)
        is_done = torch.zeros([batch_size]).byte().to(DEVICE)
        tokens = context_tokens
        if maxlen is None:
            maxlen = seq_length - 1
            if maxlen > (org_context_length + out_seq_length):
                maxlen = org_context_length + out_seq_length

        lengths = torch.ones([batch_size]).long().to(DEVICE) * maxlen
        if return_scores:
            scores = torch.zeros([batch_size]).float().to(DEVICE)

        while context_length <= (maxlen):

            if recompute:
                logits = model(tokens,
                               position_ids,
                               attention_mask,
                               prompt_length=prompt_length,
                               context_length=context_length,
                               )
                logits = logits[:, context_length - 1, :]
            else:
                if counter == 0:
                    tokens2use = tokens[:, :context_length]
                    positions2use = position_ids[:, :context_length]
                else:
                    tokens2use = tokens[:, context_length - 1].view(
                        batch_size, -1)
                    positions2use = position_ids[:, context_length - 1].view(
                        batch_size, -1)
                logits, layer_past = model(tokens2use,
                                           positions2use,
                                           attention_mask,
                                           layer_past=layer_past,
                                           get_key_value=True,
                                           prompt_length=prompt_length,
                                           context_length=context_length,
                                           )
                logits = logits[:, -1].view(batch_size, -1).contiguous()

            if bad_ids is not None:
                for bad_id in bad_ids:
                    logits[:, bad_id] = -10000
            if greedy:
                prev = torch.argmax(logits, dim=-1).view(-1)
            else:
                logits = logits.float()
                if return_scores:
                    orig_log_probs = torch.log_softmax(logits, dim=-1)
                logits /= temperature
                logits = top_k_logits(logits, top_k=topk, top_p=topp)
                log_probs = F.softmax(logits, dim=-1)
                prev = torch.multinomial(log_probs, num_samples=1).view(-1)

            started = context_lengths <= context_length

            new_tokens = switch(tokens[:, context_length].view(-1), prev, started)

            if not greedy and return_scores:
                indices = prev.view(-1, 1)
                new_scores = orig_log_probs.gather(1, indices).view(-1)
                new_scores = new_scores * started
                new_scores = new_scores * is_done.bool().logical_not()
                scores += new_scores

            tokens[:, context_length] = new_tokens
            done_token = (prev == eos_id).byte() & started.byte()
            just_finished = (done_token & ~is_done).bool()
            lengths[just_finished.view(-1)] = context_length
            is_done = is_done | done_token
            done = torch.all(is_done)

            if return_scores:
                yield tokens, (lengths, scores)
            else:
                yield tokens, lengths

            context_length += 1
            counter += 1
            if done:
                break


# ---------------------------------------------------------------- driver and self-check
class CodeGeeXTokenizerStub:
    eos_token_id = 0


def generate(model, tokenizer, prompts, seq_length, out_seq_length, **kw):
    """As scripts/ test_inference.py drives it: exhaust get_token_stream, keep the last yield."""
    context_tokens = [list(p) for p in prompts]
    generated, lengths = None, None
    for generated, lengths in get_token_stream(model, tokenizer, seq_length, out_seq_length,
                                               context_tokens, micro_batch_size=len(prompts), **kw):
        pass
    return generated.clone(), lengths


def record_step_logits(model):
    """Keeps a copy of the last-position logits of every cached call the loop makes."""
    steps = []

    def hook(module, args, output):
        if isinstance(output, list):
            steps.append(output[0][:, -1].detach().clone())

    return steps, model.register_forward_hook(hook)


def reference_logits(model, row_tokens):
    """One row, no padding, no cache: the whole prefix recomputed, plain lower-triangular mask."""
    ids = torch.tensor([row_tokens], dtype=torch.long, device=DEVICE)
    mask, pos = get_ltor_masks_and_position_ids(ids, CodeGeeXTokenizerStub.eos_token_id, False, False)
    with torch.no_grad():
        return model(ids, pos, mask)[0]  # [len, vocab]


def check(model, prompts, out, steps, min_len, label):
    worst = 0.0
    n_checked = 0
    for b, p in enumerate(prompts):
        row = out[b].tolist()
        assert row[:len(p)] == list(p), f"{label}: row {b}'s prompt was overwritten"
        ref = reference_logits(model, row)
        for s, step_logits in enumerate(steps):
            c = min_len + s  # the loop's context_length at this call: logits for position c - 1
            diff = (step_logits[b] - ref[c - 1]).abs().max().item()
            worst = max(worst, diff)
            n_checked += 1
            assert diff < 1e-4, f"{label}: row {b} step {s} (position {c - 1}) differs by {diff}"
    print(f"{label}: {n_checked} logit rows match the unpadded no-cache run (max |diff| {worst:.2e})")


def main():
    vocab, hidden, heads, layers, max_pos = 64, 32, 4, 2, 32
    model = CodeGeeXModel(hidden, layers, heads, vocab, max_pos).to(DEVICE).eval()
    with torch.no_grad():  # a checkpoint-like scale for the tied word embeddings (the head reuses them)
        torch.nn.init.normal_(model.language_model.embedding.word_embeddings.weight, std=0.3)
    tokenizer = CodeGeeXTokenizerStub()

    g = torch.Generator().manual_seed(1)
    lens = [7, 3, 10, 5]
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    seq_length, out_seq_length = 24, 12
    min_len = min(lens)

    # greedy, cached
    steps, handle = record_step_logits(model)
    out_greedy, lengths = generate(model, tokenizer, prompts, seq_length, out_seq_length, greedy=True)
    handle.remove()
    check(model, prompts, out_greedy, steps, min_len, "greedy (cache)")
    for b, p in enumerate(prompts):
        ref = reference_logits(model, out_greedy[b].tolist())
        for pos in range(len(p), out_greedy.size(1)):
            assert out_greedy[b, pos].item() == ref[pos - 1].argmax().item(), (b, pos)
    print("greedy (cache): every generated token is the reference argmax;", out_greedy.tolist())

    # greedy, recompute=True (whole padded batch every step, no cache)
    out_recompute, _ = generate(model, tokenizer, prompts, seq_length, out_seq_length, greedy=True,
                                recompute=True)
    assert torch.equal(out_recompute, out_greedy), (out_recompute, out_greedy)
    print("greedy (recompute): same tokens as the cached loop")

    # sampled, cached, top-p, scores returned
    torch.manual_seed(123)
    steps, handle = record_step_logits(model)
    out_sampled, (lengths, scores) = generate(model, tokenizer, prompts, seq_length, out_seq_length,
                                              temperature=1.2, topp=0.95, return_scores=True)
    handle.remove()
    check(model, prompts, out_sampled, steps, min_len, "sampled (cache)")
    print("sampled (cache):", out_sampled.tolist(), "scores", [round(x, 3) for x in scores.tolist()])


if __name__ == "__main__":
    main()
