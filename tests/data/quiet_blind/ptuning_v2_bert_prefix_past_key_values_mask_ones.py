"""P-tuning v2: deep prompts as past_key_values in every BERT layer, attention_mask extended by ones.

Follows THUDM/P-tuning-v2 model/prefix_encoder.py (PrefixEncoder with prefix_projection) and
model/sequence_classification.py (BertPrefixForSequenceClassification.get_prompt / forward), with the BERT
self-attention and get_extended_attention_mask of transformers' BertModel of that era written out in torch.
Mask: every layer's keys are [pre_seq_len virtual prompt keys] + [the sentence]. The prompt keys are learned
state, not tokens, so `prefix_attention_mask = torch.ones(batch_size, pre_seq_len)` is concatenated in front of
the tokenizer's attention_mask: every query (CLS, words, and also the right-padded positions, whose outputs are
never pooled) sees all prompt keys; padded sentence keys are hidden with the additive -10000 of
(1 - mask) * -10000. Encoder, so no causal part. Position ids start at past_key_values_length, as BertEmbeddings
computes them when past_key_values are given.
"""
import argparse
import math

import torch
from torch import nn


class BertConfig:
    def __init__(self, vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.1, num_labels=3):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.intermediate_size = intermediate_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_dropout_prob = hidden_dropout_prob
        self.num_labels = num_labels


class PrefixEncoder(nn.Module):
    r"""The torch.nn model to encode the prefix

    Input shape: (batch-size, prefix-length)
    Output shape: (batch-size, prefix-length, 2*layers*hidden)
    """
    def __init__(self, config):
        super().__init__()
        self.prefix_projection = config.prefix_projection
        if self.prefix_projection:
            # Use a two-layer MLP to encode the prefix
            self.embedding = nn.Embedding(config.pre_seq_len, config.hidden_size)
            self.trans = nn.Sequential(
                nn.Linear(config.hidden_size, config.prefix_hidden_size),
                nn.Tanh(),
                nn.Linear(config.prefix_hidden_size, config.num_hidden_layers * 2 * config.hidden_size))
        else:
            self.embedding = nn.Embedding(config.pre_seq_len, config.num_hidden_layers * 2 * config.hidden_size)

    def forward(self, prefix):
        if self.prefix_projection:
            prefix_tokens = self.embedding(prefix)
            past_key_values = self.trans(prefix_tokens)
        else:
            past_key_values = self.embedding(prefix)
        return past_key_values


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = config.hidden_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        return x.view(new_x_shape).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask, past_key_value):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        if past_key_value is not None:
            key_layer = torch.cat([past_key_value[0], key_layer], dim=2)
            value_layer = torch.cat([past_key_value[1], value_layer], dim=2)
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        attention_scores = attention_scores + attention_mask
        attention_probs = nn.functional.softmax(attention_scores, dim=-1)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        return context_layer.view(context_layer.size()[:-2] + (self.all_head_size,))


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=1e-12)

    def forward(self, hidden_states, attention_mask, past_key_value):
        a = self.ln1(hidden_states + self.attn_out(self.attention(hidden_states, attention_mask, past_key_value)))
        return self.ln2(a + self.output(nn.functional.gelu(self.intermediate(a))))


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.emb_ln = nn.LayerNorm(config.hidden_size, eps=1e-12)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)

    def get_extended_attention_mask(self, attention_mask, dtype=torch.float32):
        extended_attention_mask = attention_mask[:, None, None, :].to(dtype)
        return (1.0 - extended_attention_mask) * -10000.0

    def forward(self, input_ids, attention_mask, past_key_values):
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        seq_length = input_ids.shape[1]
        position_ids = torch.arange(past_key_values_length, seq_length + past_key_values_length)[None]
        hidden_states = self.emb_ln(self.word_embeddings(input_ids) + self.position_embeddings(position_ids))
        extended_attention_mask = self.get_extended_attention_mask(attention_mask)
        for i, layer_module in enumerate(self.layer):
            past_key_value = past_key_values[i] if past_key_values is not None else None
            hidden_states = layer_module(hidden_states, extended_attention_mask, past_key_value)
        pooled_output = torch.tanh(self.pooler(hidden_states[:, 0]))
        return hidden_states, pooled_output


class BertPrefixForSequenceClassification(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_labels = config.num_labels
        self.config = config
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        for param in self.bert.parameters():
            param.requires_grad = False
        self.pre_seq_len = config.pre_seq_len
        self.n_layer = config.num_hidden_layers
        self.n_head = config.num_attention_heads
        self.n_embd = config.hidden_size // config.num_attention_heads
        self.prefix_tokens = torch.arange(self.pre_seq_len).long()
        self.prefix_encoder = PrefixEncoder(config)

    def get_prompt(self, batch_size):
        prefix_tokens = self.prefix_tokens.unsqueeze(0).expand(batch_size, -1)
        past_key_values = self.prefix_encoder(prefix_tokens)
        past_key_values = past_key_values.view(batch_size, self.pre_seq_len, self.n_layer * 2, self.n_head, self.n_embd)
        past_key_values = self.dropout(past_key_values)
        past_key_values = past_key_values.permute([2, 0, 3, 1, 4]).split(2)
        return past_key_values

    def forward(self, input_ids, attention_mask):
        batch_size = input_ids.shape[0]
        past_key_values = self.get_prompt(batch_size=batch_size)
        prefix_attention_mask = torch.ones(batch_size, self.pre_seq_len)
        attention_mask = torch.cat((prefix_attention_mask, attention_mask), dim=1)
        _, pooled_output = self.bert(input_ids, attention_mask=attention_mask, past_key_values=past_key_values)
        return self.classifier(self.dropout(pooled_output))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pre_seq_len", type=int, default=4)
    parser.add_argument("--prefix_projection", action="store_true", default=True)
    parser.add_argument("--prefix_hidden_size", type=int, default=48)
    model_args = parser.parse_args([])

    torch.manual_seed(0)
    config = BertConfig()
    config.pre_seq_len = model_args.pre_seq_len
    config.prefix_projection = model_args.prefix_projection
    config.prefix_hidden_size = model_args.prefix_hidden_size
    model = BertPrefixForSequenceClassification(config).eval()

    # [CLS] w w w [SEP] and [CLS] w [SEP] [PAD] [PAD]
    input_ids = torch.tensor([[1, 11, 12, 13, 2], [1, 21, 2, 0, 0]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids, attention_mask)
        alone = model(input_ids[1:, :3], attention_mask[1:, :3])
    # -10000 leaves ~e-4000 weight on a padded key: the short sentence classifies as it does unpadded.
    assert torch.allclose(logits[1], alone[0], atol=1e-5)
    print("p-tuning v2 logits:", [round(x, 4) for x in logits[0].tolist()])


if __name__ == "__main__":
    main()
