"""DNABERT get_extended_attention_mask: a misspelt variable returns the raw 0/1 mask instead of the additive one.

Citation: jerryji1993/DNABERT issue #102 ("There is a bug about attention mask", open) and PR #100 ("Fix typo in
modeling_utils.py to return the correct attention masks", open; `--fixed` applies it). Source read:
src/transformers/modeling_utils.py and modeling_bert.py at HEAD (commit 1fcc2cc, which switched
BertModel.forward to `self.get_extended_attention_mask(...)`).

Bug: `ModuleUtilsMixin.get_extended_attention_mask` ends with
    exteneded_attention_mask = extended_attention_mask.to(dtype=self.dtype)
    exteneded_attention_mask = (1.0 - extended_attention_mask) * -10000.0
    return extended_attention_mask
so BertModel receives the (batch, 1, 1, seq) tensor of 1.0 (attend) / 0.0 (pad) and BertSelfAttention adds it
to the scores: the padding of a shorter k-mer sequence gets score + 0 instead of -10000 and is attended.

Fix: convert and return the same variable, `(1.0 - extended_attention_mask) * -10000.0`.

This program condenses DNABERT's BertModel (embeddings, encoder of BertLayer with BertSelfAttention as
written) with a small BertConfig-like dataclass, and encodes two 6-mer token sequences (9 and 5 tokens,
[PAD] = 0, attention_mask from the tokenizer's padding).
"""
import math
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class BertConfig:
    vocab_size: int = 4101
    hidden_size: int = 32
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    intermediate_size: int = 64
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    is_decoder: bool = False
    output_attentions: bool = False


class ModuleUtilsMixin:
    @property
    def dtype(self):
        return next(self.parameters()).dtype

    def get_extended_attention_mask(self, attention_mask, input_shape, device):
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            if self.config.is_decoder:
                batch_size, seq_length = input_shape
                seq_ids = torch.arange(seq_length, device=device)
                causal_mask = seq_ids[None, None, :].repeat(batch_size, seq_length, 1) <= seq_ids[None, :, None]
                causal_mask = causal_mask.to(attention_mask.dtype)
                extended_attention_mask = causal_mask[:, None, :, :] * attention_mask[:, None, None, :]
            else:
                extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError(
                f"Wrong shape for input_ids (shape {input_shape}) or attention_mask (shape {attention_mask.shape})")

        # Since attention_mask is 1.0 for positions we want to attend and 0.0 for
        # masked positions, this operation will create a tensor which is 0.0 for
        # positions we want to attend and -10000.0 for masked positions.
        if FIXED:
            extended_attention_mask = extended_attention_mask.to(dtype=self.dtype)
            extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        else:
            exteneded_attention_mask = extended_attention_mask.to(dtype=self.dtype)
            exteneded_attention_mask = (1.0 - extended_attention_mask) * -10000.0  # noqa: F841
        return extended_attention_mask


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        position_ids = torch.arange(input_ids.size(1), dtype=torch.long).unsqueeze(0).expand_as(input_ids)
        embeddings = (self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
                      + self.token_type_embeddings(token_type_ids))
        return self.dropout(self.LayerNorm(embeddings))


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.output_attentions = config.output_attentions
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

    def forward(self, hidden_states, attention_mask=None, head_mask=None):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        if attention_mask is not None:
            # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
            attention_scores = attention_scores + attention_mask

        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)
        if head_mask is not None:
            attention_probs = attention_probs * head_mask

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.attn_out = nn.Linear(config.hidden_size, config.hidden_size)
        self.ln1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.output = nn.Linear(config.intermediate_size, config.hidden_size)
        self.ln2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        h = self.ln1(hidden_states + self.attn_out(self.self(hidden_states, attention_mask)))
        return self.ln2(h + self.output(nn.functional.gelu(self.intermediate(h))))


class BertModel(nn.Module, ModuleUtilsMixin):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None):
        input_shape = input_ids.size()
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(input_shape, device=device)
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=device)

        extended_attention_mask: torch.Tensor = self.get_extended_attention_mask(attention_mask, input_shape, device)

        hidden_states = self.embeddings(input_ids, token_type_ids)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        return (hidden_states,)


if __name__ == "__main__":
    torch.manual_seed(0)
    model = BertModel(BertConfig()).eval()
    # [CLS]=2 ... [SEP]=3 over 6-mer ids, right-padded with [PAD]=0 as DNATokenizer.batch_encode_plus does
    input_ids = torch.tensor([[2, 917, 3570, 1985, 3838, 2979, 3816, 2889, 3],
                              [2, 1457, 1733, 2834, 3, 0, 0, 0, 0]])
    attention_mask = (input_ids != 0).long()
    with torch.no_grad():
        sequence_output = model(input_ids, attention_mask=attention_mask)[0]
    print("fixed" if FIXED else "buggy", tuple(sequence_output.shape), f"{sequence_output[1, 0].sum().item():.4f} "
          f"{sequence_output[1, 0, 0].item():.4f}")
