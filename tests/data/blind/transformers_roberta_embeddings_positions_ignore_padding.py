"""RoBERTa's embeddings numbered every column as a position, padding included.

Citation: huggingface/transformers#1764 ("Bug-fix: Roberta Embeddings Not Masked", closes #1761),
merged as commit f15f087; file transformers/modeling_roberta.py, RobertaEmbeddings.forward.

The bug: RobertaEmbeddings made its position ids as
``torch.arange(padding_idx + 1, seq_length + padding_idx + 1)`` for every row, so a padded row's
real tokens were numbered from the first column whether or not it held a pad, and the pads took
position ids of their own (fairseq's ``utils.make_positions``, which the comment cites, leaves pads
at ``padding_idx`` and counts only the real tokens).

The fix: ``create_position_ids_from_input_ids``: ``mask = x.ne(padding_idx)``,
``cumsum(mask, dim=1) * mask + padding_idx``.

The program keeps the 2.x layout (BertEmbeddings / RobertaEmbeddings subclass, BertSelfAttention with
the extended mask ``(1.0 - mask) * -10000.0`` added to the scores, BertModel.forward building it) at
toy sizes with random weights, and feeds a batch collated the way fairseq's ``collate_tokens`` does
for sources (``left_pad=True``), with the attention mask passed; it prints the sentence embeddings'
cosine similarities (features mean-pooled over the real tokens).
"""

import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class Config:
    vocab_size = 50
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 64
    max_position_embeddings = 40
    type_vocab_size = 1
    layer_norm_eps = 1e-5
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super(BertEmbeddings, self).__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        if input_ids is not None:
            input_shape = input_ids.size()
        else:
            input_shape = inputs_embeds.size()[:-1]
        seq_length = input_shape[1]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            position_ids = torch.arange(seq_length, dtype=torch.long, device=device)
            position_ids = position_ids.unsqueeze(0).expand(input_shape)
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=device)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + position_embeddings + token_type_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class RobertaEmbeddings(BertEmbeddings):
    def __init__(self, config):
        super(RobertaEmbeddings, self).__init__(config)
        self.padding_idx = 1
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=self.padding_idx)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size,
                                                padding_idx=self.padding_idx)

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        if input_ids is not None:
            input_shape = input_ids.size()
        else:
            input_shape = inputs_embeds.size()[:-1]
        seq_length = input_shape[1]
        device = input_ids.device if input_ids is not None else inputs_embeds.device
        if position_ids is None:
            if FIXED and input_ids is not None:
                # Create the position ids from the input token ids. Any padded tokens remain padded.
                position_ids = self.create_position_ids_from_input_ids(input_ids).to(input_ids.device)
            else:
                # Position numbers begin at padding_idx+1. Padding symbols are ignored.
                # cf. fairseq's `utils.make_positions`
                position_ids = torch.arange(self.padding_idx + 1, seq_length + self.padding_idx + 1,
                                            dtype=torch.long, device=device)
                position_ids = position_ids.unsqueeze(0).expand(input_shape)
        return super(RobertaEmbeddings, self).forward(input_ids, token_type_ids=token_type_ids,
                                                      position_ids=position_ids, inputs_embeds=inputs_embeds)

    def create_position_ids_from_input_ids(self, x):
        """ Replace non-padding symbols with their position numbers. Position numbers begin at
        padding_idx+1. Padding symbols are ignored. This is modified from fairseq's
        `utils.make_positions`. """
        mask = x.ne(self.padding_idx).long()
        incremental_indicies = torch.cumsum(mask, dim=1) * mask
        return incremental_indicies + self.padding_idx


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super(BertSelfAttention, self).__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask
        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)
        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, config):
        super(BertLayer, self).__init__()
        self.attention = BertSelfAttention(config)
        self.attention_output = nn.Linear(config.hidden_size, config.hidden_size)
        self.attention_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.output_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.attention(hidden_states, attention_mask)
        attention_output = self.attention_norm(self.attention_output(self_outputs) + hidden_states)
        intermediate_output = nn.functional.gelu(self.intermediate(attention_output))
        return self.output_norm(self.output(intermediate_output) + attention_output)


class RobertaModel(nn.Module):
    def __init__(self, config):
        super(RobertaModel, self).__init__()
        self.config = config
        self.embeddings = RobertaEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        # [batch_size, 1, 1, to_seq_length], broadcast to [batch_size, num_heads, from_seq_length, to_seq_length]
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        embedding_output = self.embeddings(input_ids=input_ids, position_ids=position_ids,
                                           token_type_ids=token_type_ids)
        hidden_states = embedding_output
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        sequence_output = hidden_states
        pooled_output = torch.tanh(self.pooler(sequence_output[:, 0]))
        return sequence_output, pooled_output


def collate_tokens(values, pad_idx, left_pad):
    """fairseq.data.data_utils.collate_tokens: 1d tensors into a padded 2d tensor."""
    size = max(v.size(0) for v in values)
    res = values[0].new(len(values), size).fill_(pad_idx)
    for i, v in enumerate(values):
        dst = res[i][size - len(v):] if left_pad else res[i][:len(v)]
        dst.copy_(v)
    return res


def main():
    torch.manual_seed(0)
    config = Config()
    model = RobertaModel(config).eval()

    bos, eos, pad = 0, 2, 1
    sentences = [
        torch.tensor([bos, 7, 12, 31, 9, 44, 18, 5, eos]),
        torch.tensor([bos, 23, 8, 40, eos]),
        torch.tensor([bos, 15, 27, eos]),
    ]
    input_ids = collate_tokens(sentences, pad, left_pad=True)
    attention_mask = input_ids.ne(pad).long()

    with torch.no_grad():
        sequence_output, _ = model(input_ids=input_ids, attention_mask=attention_mask)
    # sentence embeddings: mean of the token features over the real tokens
    keep = attention_mask.unsqueeze(-1).to(sequence_output.dtype)
    sentence_embeddings = (sequence_output * keep).sum(1) / keep.sum(1)
    sentence_embeddings = nn.functional.normalize(sentence_embeddings, dim=-1)
    print("input_ids:\n", input_ids)
    print("cosine similarities:\n", sentence_embeddings @ sentence_embeddings.t())


if __name__ == "__main__":
    main()
