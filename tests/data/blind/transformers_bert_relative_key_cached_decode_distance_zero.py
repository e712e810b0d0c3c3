# huggingface/transformers#19045, fixed by huggingface/transformers#20203 ("update relative positional embedding").
#
# BertSelfAttention with position_embedding_type="relative_key" (Shaw/Huang relative distances, as in the
# zhiheng-huang/bert-base-uncased-embedding-relative-key checkpoints) used as a decoder (BertLMHeadModel,
# is_decoder=True) with a key/value cache.  Before the fix the relative distance table was built from
# `seq_length = hidden_states.size()[1]` for both the query and the key axis: on a cached decode step the new
# token's hidden_states are one long, so `distance` is [[0]] and the single bias it gives is broadcast over every
# cached key -- the new query is scored as if it sat on top of each past key.  The fix numbers the query at
# `key_length - 1` when a cache is used and the keys at `arange(key_length)`.
#
# Ported from src/transformers/models/bert/modeling_bert.py (v4.24, legacy tuple cache), trimmed to a tiny
# BertLMHeadModel and a greedy decode loop.  `python FILE` runs the code before the fix, `--fixed` after.
import math
import sys

import torch
from torch import nn
from transformers import BertConfig

FIXED = "--fixed" in sys.argv


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.position_embedding_type = getattr(config, "position_embedding_type", "absolute")
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids, past_key_values_length=0):
        seq_length = input_ids.size(1)
        position_ids = self.position_ids[:, past_key_values_length : seq_length + past_key_values_length]
        token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        if self.position_embedding_type == "absolute":
            embeddings += self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config, position_embedding_type=None):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.position_embedding_type = position_embedding_type or getattr(
            config, "position_embedding_type", "absolute"
        )
        if self.position_embedding_type == "relative_key" or self.position_embedding_type == "relative_key_query":
            self.max_position_embeddings = config.max_position_embeddings
            self.distance_embedding = nn.Embedding(2 * config.max_position_embeddings - 1, self.attention_head_size)
        self.is_decoder = config.is_decoder

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        mixed_query_layer = self.query(hidden_states)
        if past_key_value is not None:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        else:
            key_layer = self.transpose_for_scores(self.key(hidden_states))
            value_layer = self.transpose_for_scores(self.value(hidden_states))

        query_layer = self.transpose_for_scores(mixed_query_layer)

        use_cache = past_key_value is not None
        if self.is_decoder:
            past_key_value = (key_layer, value_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))

        if self.position_embedding_type == "relative_key" or self.position_embedding_type == "relative_key_query":
            if FIXED:
                query_length, key_length = query_layer.shape[2], key_layer.shape[2]
                if use_cache:
                    position_ids_l = torch.tensor(key_length - 1, dtype=torch.long, device=hidden_states.device).view(
                        -1, 1
                    )
                else:
                    position_ids_l = torch.arange(query_length, dtype=torch.long, device=hidden_states.device).view(
                        -1, 1
                    )
                position_ids_r = torch.arange(key_length, dtype=torch.long, device=hidden_states.device).view(1, -1)
            else:
                seq_length = hidden_states.size()[1]
                position_ids_l = torch.arange(seq_length, dtype=torch.long, device=hidden_states.device).view(-1, 1)
                position_ids_r = torch.arange(seq_length, dtype=torch.long, device=hidden_states.device).view(1, -1)
            distance = position_ids_l - position_ids_r
            positional_embedding = self.distance_embedding(distance + self.max_position_embeddings - 1)
            positional_embedding = positional_embedding.to(dtype=query_layer.dtype)  # fp16 compatibility

            if self.position_embedding_type == "relative_key":
                relative_position_scores = torch.einsum("bhld,lrd->bhlr", query_layer, positional_embedding)
                attention_scores = attention_scores + relative_position_scores
            elif self.position_embedding_type == "relative_key_query":
                relative_position_scores_query = torch.einsum("bhld,lrd->bhlr", query_layer, positional_embedding)
                relative_position_scores_key = torch.einsum("bhrd,lrd->bhlr", key_layer, positional_embedding)
                attention_scores = attention_scores + relative_position_scores_query + relative_position_scores_key

        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask

        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(new_context_layer_shape)
        return context_layer, past_key_value


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.attn_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None):
        context, present = self.attention(hidden_states, attention_mask, past_key_value=past_key_value)
        attention_output = self.attn_norm(self.attn_out(context) + hidden_states)
        layer_output = self.out_norm(
            self.output(nn.functional.gelu(self.intermediate(attention_output))) + attention_output
        )
        return layer_output, present


class BertLMHeadModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.decoder = nn.Linear(config.hidden_size, config.vocab_size)

    def get_extended_attention_mask(self, attention_mask, input_shape):
        # ModuleUtilsMixin.create_extended_attention_mask_for_decoder
        batch_size, seq_length = input_shape
        seq_ids = torch.arange(seq_length, device=attention_mask.device)
        causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
        causal_mask = causal_mask.to(attention_mask.dtype)
        if causal_mask.shape[1] < attention_mask.shape[1]:
            prefix_seq_len = attention_mask.shape[1] - causal_mask.shape[1]
            causal_mask = torch.cat(
                [torch.ones((batch_size, seq_length, prefix_seq_len), dtype=causal_mask.dtype), causal_mask],
                axis=-1,
            )
        extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=torch.float32)
        return (1.0 - extended_attention_mask) * torch.finfo(torch.float32).min

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True):
        batch_size, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length + past_key_values_length))
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, (batch_size, seq_length))
        hidden_states = self.embeddings(input_ids, past_key_values_length=past_key_values_length)
        next_decoder_cache = ()
        for i, layer_module in enumerate(self.layer):
            layer_past = past_key_values[i] if past_key_values is not None else None
            hidden_states, present = layer_module(hidden_states, extended_attention_mask, layer_past)
            next_decoder_cache += (present,)
        return self.decoder(hidden_states), (next_decoder_cache if use_cache else None)


def main():
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=32,
        is_decoder=True,
        position_embedding_type="relative_key",
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    model = BertLMHeadModel(config).eval()
    with torch.no_grad():
        for layer in model.layer:
            layer.attention.distance_embedding.weight.normal_(0.0, 2.0)

    input_ids = torch.tensor([[2, 17, 5, 41, 9, 33]])
    attention_mask = torch.ones_like(input_ids)
    generated = input_ids
    with torch.no_grad():
        logits, past = model(input_ids, attention_mask=attention_mask)
        next_token = logits[:, -1].argmax(-1, keepdim=True)
        scores = [logits[:, -1].max().item()]
        for _ in range(8):
            generated = torch.cat([generated, next_token], dim=-1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_token)], dim=-1)
            logits, past = model(next_token, attention_mask=attention_mask, past_key_values=past)
            scores.append(logits[:, -1].max().item())
            next_token = logits[:, -1].argmax(-1, keepdim=True)
    print("generated:", generated[0, input_ids.shape[1]:].tolist())
    print("step max logits:", [round(s, 4) for s in scores])


if __name__ == "__main__":
    main()
