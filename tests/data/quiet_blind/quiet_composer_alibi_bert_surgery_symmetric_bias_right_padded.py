"""Composer's ALiBi algorithm applied to a BERT encoder, run on a right-padded batch (correct program).

Port, shrunk to tiny sizes, of mosaicml/composer @02a0b20d338f349943d4afdf657452ac88689c56:
composer/algorithms/alibi/attention_surgery_functions/utils.py (register_alibi with causal=False,
_get_alibi_head_slopes, zero_and_freeze_expand_position_embeddings) and
composer/algorithms/alibi/attention_surgery_functions/_bert.py (bert_embedding_converter,
bert_attention_converter, the replacement BertSelfAttention `forward`). The BERT it operates on is
written as transformers 4.x wrote BertEmbeddings / BertSelfAttention / BertModel
(get_extended_attention_mask: `(1.0 - mask[:, None, None, :]) * finfo.min`).

* register_alibi(causal=False) keeps a [1, n_heads, max_len, max_len] buffer `slopes * -|j - i|`
  (the symmetric "Implementation 1" of ofirpress/attention_with_linear_biases#5), because an
  encoder has no causal mask to make the one-row trick valid.
* The replacement forward adds the extended padding mask, then the ALiBi slice `[:, :, :L, :L]`.
* Position embeddings are zeroed and frozen, so position enters only through the bias.

Check: every sequence alone, unpadded, through a reference encoder whose attention is a double
loop over (query, key) pairs with the bias `-slope * |i - j|`; hidden states of the real tokens and
the [CLS] pooled output must match the padded batch.
"""
import copy
import math
from types import MethodType

import torch
from torch import nn

torch.manual_seed(0)


class BertConfig:
    vocab_size = 40
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 64
    max_position_embeddings = 16
    type_vocab_size = 2
    layer_norm_eps = 1e-12
    hidden_dropout_prob = 0.0
    attention_probs_dropout_prob = 0.0
    pad_token_id = 0
    position_embedding_type = "absolute"
    is_decoder = False


# ------------------------------------------------------------ BERT as transformers 4.x wrote it
class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.shape[1]
        position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        embeddings = self.word_embeddings(input_ids) + self.token_type_embeddings(token_type_ids)
        embeddings = embeddings + self.position_embeddings(position_ids)
        embeddings = self.LayerNorm(embeddings)
        return self.dropout(embeddings)


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = config.hidden_size // config.num_attention_heads
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)
        self.position_embedding_type = config.position_embedding_type
        self.is_decoder = config.is_decoder

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = x.view(new_x_shape)
        return x.permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, past_key_value=None, output_attentions=False):
        raise RuntimeError("replaced by Composer's ALiBi surgery")


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, input_tensor):
        return self.LayerNorm(self.dense(hidden_states) + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)
        self.intermediate = nn.Linear(config.hidden_size, config.intermediate_size)
        self.out_dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.out_ln = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask)
        attention_output = self.output(self_outputs[0], hidden_states)
        inter = nn.functional.gelu(self.intermediate(attention_output))
        return self.out_ln(self.out_dense(inter) + attention_output)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.pooler = nn.Linear(config.hidden_size, config.hidden_size)

    def get_extended_attention_mask(self, attention_mask, dtype):
        extended_attention_mask = attention_mask[:, None, None, :]
        extended_attention_mask = extended_attention_mask.to(dtype=dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * torch.finfo(dtype).min
        return extended_attention_mask

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        extended_attention_mask = self.get_extended_attention_mask(attention_mask, torch.float32)
        hidden_states = self.embeddings(input_ids, token_type_ids)
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, extended_attention_mask)
        pooled_output = torch.tanh(self.pooler(hidden_states[:, 0]))
        return hidden_states, pooled_output


# ------------------------------------------------------------ composer alibi/attention_surgery_functions/utils.py
def zero_and_freeze_expand_position_embeddings(module, max_sequence_length, position_embedding_attribute):
    pos_embedding_module = getattr(module, position_embedding_attribute)
    old_weight = getattr(pos_embedding_module, "weight")
    new_weight = torch.nn.Parameter(
        torch.zeros((max_sequence_length, old_weight.shape[1]), dtype=old_weight.dtype, device=old_weight.device))
    new_weight.requires_grad = False
    setattr(pos_embedding_module, "weight", new_weight)


def register_alibi(module, n_heads, max_token_length, causal):
    if causal:
        slopes = torch.Tensor(_get_alibi_head_slopes(n_heads))
        alibi = slopes.unsqueeze(1).unsqueeze(1) * \
            torch.arange(max_token_length).unsqueeze(0).unsqueeze(0).expand(n_heads, -1, -1)
        assert alibi.shape == torch.Size([n_heads, 1, max_token_length])
    else:
        context_position = torch.arange(max_token_length)[:, None]
        memory_position = torch.arange(max_token_length)[None, :]
        relative_position = torch.abs(memory_position - context_position)
        relative_position = relative_position.unsqueeze(0).expand(n_heads, -1, -1)
        slopes = torch.Tensor(_get_alibi_head_slopes(n_heads))
        alibi = slopes.unsqueeze(1).unsqueeze(1) * -relative_position
        alibi = alibi.unsqueeze(0)
        assert alibi.shape == torch.Size([1, n_heads, max_token_length, max_token_length])
    module_device = next(module.parameters()).device
    module.register_buffer("alibi", alibi.to(module_device))
    return module


def _get_alibi_head_slopes(n_heads):
    def get_slopes_power_of_2(n_heads):
        start = (2 ** (-2 ** -(math.log2(n_heads) - 3)))
        ratio = start
        return [start * ratio ** i for i in range(n_heads)]

    if math.log2(n_heads).is_integer():
        return get_slopes_power_of_2(n_heads)
    closest_power_of_2 = 2 ** math.floor(math.log2(n_heads))
    return get_slopes_power_of_2(closest_power_of_2) + _get_alibi_head_slopes(
        2 * closest_power_of_2)[0::2][:n_heads - closest_power_of_2]


# ------------------------------------------------------------ composer alibi/attention_surgery_functions/_bert.py
def bert_embedding_converter(module, module_index, max_sequence_length):
    del module_index
    new_module = copy.deepcopy(module)
    zero_and_freeze_expand_position_embeddings(new_module, max_sequence_length,
                                               position_embedding_attribute="position_embeddings")
    module_device = next(new_module.parameters()).device
    new_module.register_buffer("position_ids", torch.arange(max_sequence_length).expand((1, -1)).to(module_device))
    return new_module


def bert_attention_converter(module, module_index, max_sequence_length):
    del module_index
    module = register_alibi(module=module, n_heads=int(module.num_attention_heads),
                            max_token_length=max_sequence_length, causal=False)
    setattr(module, "forward", MethodType(forward, module))
    return module


def forward(self, hidden_states, attention_mask=None, head_mask=None, encoder_hidden_states=None,
            encoder_attention_mask=None, past_key_value=None, output_attentions=False):
    mixed_query_layer = self.query(hidden_states)
    is_cross_attention = encoder_hidden_states is not None
    if is_cross_attention:
        key_layer = self.transpose_for_scores(self.key(encoder_hidden_states))
        value_layer = self.transpose_for_scores(self.value(encoder_hidden_states))
        attention_mask = encoder_attention_mask
    else:
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))
    query_layer = self.transpose_for_scores(mixed_query_layer)

    attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
    if self.position_embedding_type == "relative_key" or self.position_embedding_type == "relative_key_query":
        raise NotImplementedError("ALiBi is not supported for BERT with position_embedding_type: {}".format(
            self.position_embedding_type))
    attention_scores = attention_scores / math.sqrt(self.attention_head_size)
    if attention_mask is not None:
        attention_scores = attention_scores + attention_mask

    ##### Modification for adding ALiBi #####
    seq_len = attention_scores.shape[-1]
    attention_scores = attention_scores + self.alibi[:, :, :seq_len, :seq_len]
    #########################################

    attention_probs = nn.functional.softmax(attention_scores, dim=-1)
    attention_probs = self.dropout(attention_probs)
    if head_mask is not None:
        attention_probs = attention_probs * head_mask
    context_layer = torch.matmul(attention_probs, value_layer)
    context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
    new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
    context_layer = context_layer.view(new_context_layer_shape)
    outputs = (context_layer, attention_probs) if output_attentions else (context_layer,)
    return outputs


def apply_alibi(model, max_sequence_length):
    """composer.algorithms.alibi.apply_alibi, reduced to the two BERT policies."""
    model.embeddings = bert_embedding_converter(model.embeddings, 0, max_sequence_length)
    for index, layer in enumerate(model.layer):
        layer.self = bert_attention_converter(layer.self, index, max_sequence_length)
    return model


# ------------------------------------------------------------ reference: one sequence, double loop
def reference_encode(model, ids):
    """Runs one unpadded sequence; attention is a loop over (query, key) pairs with -slope * |i - j|."""
    slopes = _get_alibi_head_slopes(model.config.num_attention_heads)
    with torch.no_grad():
        h = model.embeddings.word_embeddings(ids) + model.embeddings.token_type_embeddings(torch.zeros_like(ids))
        h = model.embeddings.LayerNorm(h)  # position embeddings are zero after surgery
        n = ids.shape[0]
        for layer in model.layer:
            att = layer.self
            d = att.attention_head_size
            q = att.query(h).view(n, att.num_attention_heads, d)
            k = att.key(h).view(n, att.num_attention_heads, d)
            v = att.value(h).view(n, att.num_attention_heads, d)
            ctx = torch.zeros(n, att.num_attention_heads, d)
            for head in range(att.num_attention_heads):
                for i in range(n):
                    scores = torch.stack([
                        (q[i, head] @ k[j, head]) / math.sqrt(d) - slopes[head] * abs(i - j) for j in range(n)])
                    p = torch.softmax(scores, dim=0)
                    ctx[i, head] = sum(p[j] * v[j, head] for j in range(n))
            ctx = ctx.reshape(n, -1)
            a = layer.output(ctx, h)
            h = layer.out_ln(layer.out_dense(nn.functional.gelu(layer.intermediate(a))) + a)
        pooled = torch.tanh(model.pooler(h[0]))
    return h, pooled


def main():
    config = BertConfig()
    model = BertModel(config).eval()
    max_sequence_length = 32  # ALiBi lets the encoder run past the trained 16 positions
    model = apply_alibi(model, max_sequence_length)

    lengths = [11, 6, 18, 3]
    batch_len = max(lengths)
    seqs = [torch.randint(1, config.vocab_size, (n,)) for n in lengths]
    input_ids = torch.full((len(seqs), batch_len), config.pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(seqs), batch_len), dtype=torch.long)
    for b, s in enumerate(seqs):  # tokenizer(padding=True): right padding
        input_ids[b, :len(s)] = s
        attention_mask[b, :len(s)] = 1

    with torch.no_grad():
        hidden, pooled = model(input_ids, attention_mask=attention_mask)

    for b, s in enumerate(seqs):
        ref_h, ref_pooled = reference_encode(model, s)
        n = len(s)
        err_h = (hidden[b, :n] - ref_h).abs().max().item()
        err_p = (pooled[b] - ref_pooled).abs().max().item()
        assert err_h < 1e-4, (b, err_h)
        assert err_p < 1e-4, (b, err_p)
    print("composer ALiBi BERT: padded batch matches per-sequence double-loop reference")


if __name__ == "__main__":
    main()
