# allenai/allennlp#2145 (commit 6c33005): "fix bert input order"
# BertEmbedder called pytorch-pretrained-bert's BertModel positionally as (input_ids, input_mask, token_type_ids),
# but BertModel.forward is (input_ids, token_type_ids, attention_mask): the padding mask went in as token types and
# the all-zero token_type_ids became the attention mask, so every key got the same -10000 and padded wordpieces were
# attended to. The fix passes the three tensors by keyword (attention_mask=input_mask).
import copy
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- pytorch_pretrained_bert/modeling.py (0.3.x, trimmed)
class BertConfig(object):
    def __init__(self, vocab_size_or_config_json_file, hidden_size=768, num_hidden_layers=12,
                 num_attention_heads=12, intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=512, type_vocab_size=2,
                 initializer_range=0.02):
        self.vocab_size = vocab_size_or_config_json_file
        self.hidden_size = hidden_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.hidden_act = hidden_act
        self.intermediate_size = intermediate_size
        self.hidden_dropout_prob = hidden_dropout_prob
        self.attention_probs_dropout_prob = attention_probs_dropout_prob
        self.max_position_embeddings = max_position_embeddings
        self.type_vocab_size = type_vocab_size
        self.initializer_range = initializer_range


def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class BertLayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        super(BertLayerNorm, self).__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super(BertEmbeddings, self).__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        words_embeddings = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = words_embeddings + position_embeddings + token_type_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


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

    def forward(self, hidden_states, attention_mask):
        query_layer = self.transpose_for_scores(self.query(hidden_states))
        key_layer = self.transpose_for_scores(self.key(hidden_states))
        value_layer = self.transpose_for_scores(self.value(hidden_states))

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
        attention_scores = attention_scores + attention_mask

        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        return context_layer.view(*new_context_layer_shape)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super(BertSelfOutput, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertAttention(nn.Module):
    def __init__(self, config):
        super(BertAttention, self).__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, attention_mask):
        self_output = self.self(input_tensor, attention_mask)
        return self.output(self_output, input_tensor)


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super(BertIntermediate, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = gelu

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    def __init__(self, config):
        super(BertOutput, self).__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dropout(self.dense(hidden_states))
        return self.LayerNorm(hidden_states + input_tensor)


class BertLayer(nn.Module):
    def __init__(self, config):
        super(BertLayer, self).__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(attention_output)
        return self.output(intermediate_output, attention_output)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super(BertEncoder, self).__init__()
        layer = BertLayer(config)
        self.layer = nn.ModuleList([copy.deepcopy(layer) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, output_all_encoded_layers=True):
        all_encoder_layers = []
        for layer_module in self.layer:
            hidden_states = layer_module(hidden_states, attention_mask)
            if output_all_encoded_layers:
                all_encoder_layers.append(hidden_states)
        if not output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


class BertPooler(nn.Module):
    def __init__(self, config):
        super(BertPooler, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        return self.activation(self.dense(hidden_states[:, 0]))


class BertModel(nn.Module):
    def __init__(self, config):
        super(BertModel, self).__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)
        self.apply(self.init_bert_weights)

    def init_bert_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, BertLayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, output_all_encoded_layers=True):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        # We create a 3D attention mask from a 2D tensor mask.
        # Sizes are [batch_size, 1, 1, to_seq_length]
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        extended_attention_mask = extended_attention_mask.to(dtype=next(self.parameters()).dtype)
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        embedding_output = self.embeddings(input_ids, token_type_ids)
        encoded_layers = self.encoder(embedding_output, extended_attention_mask,
                                      output_all_encoded_layers=output_all_encoded_layers)
        sequence_output = encoded_layers[-1]
        pooled_output = self.pooler(sequence_output)
        if not output_all_encoded_layers:
            encoded_layers = encoded_layers[-1]
        return encoded_layers, pooled_output


# ---------------------------------------------------------------- allennlp.nn.util / allennlp.modules.scalar_mix
def combine_initial_dims(tensor):
    if tensor.dim() <= 2:
        return tensor
    return tensor.view(-1, tensor.size(-1))


def uncombine_initial_dims(tensor, original_size):
    if len(original_size) <= 2:
        return tensor
    view_args = list(original_size) + [tensor.size(-1)]
    return tensor.view(*view_args)


def get_text_field_mask(text_field_tensors):
    return text_field_tensors["mask"].long()


def sequence_cross_entropy_with_logits(logits, targets, weights):
    log_probs = torch.nn.functional.log_softmax(logits.view(-1, logits.size(-1)), dim=-1)
    nll = -torch.gather(log_probs, 1, targets.view(-1, 1)).view(*targets.size())
    nll = nll * weights.float()
    per_batch = nll.sum(1) / (weights.sum(1).float() + 1e-13)
    return per_batch.mean()


class ScalarMix(nn.Module):
    def __init__(self, mixture_size, do_layer_norm=False):
        super(ScalarMix, self).__init__()
        self.mixture_size = mixture_size
        self.scalar_parameters = nn.ParameterList([nn.Parameter(torch.FloatTensor([0.0]))
                                                   for _ in range(mixture_size)])
        self.gamma = nn.Parameter(torch.FloatTensor([1.0]))

    def forward(self, tensors, mask=None):
        normed_weights = torch.nn.functional.softmax(torch.cat([p for p in self.scalar_parameters]), dim=0)
        normed_weights = torch.split(normed_weights, split_size_or_sections=1)
        pieces = [weight * tensor for weight, tensor in zip(normed_weights, tensors)]
        return self.gamma * sum(pieces)


# ---------------------------------------------------------------- allennlp/modules/token_embedders/bert_token_embedder.py
class BertEmbedder(nn.Module):
    def __init__(self, bert_model, top_layer_only=False):
        super().__init__()
        self.bert_model = bert_model
        self.output_dim = bert_model.config.hidden_size
        if not top_layer_only:
            self._scalar_mix = ScalarMix(bert_model.config.num_hidden_layers, do_layer_norm=False)
        else:
            self._scalar_mix = None

    def get_output_dim(self):
        return self.output_dim

    def forward(self, input_ids, offsets=None, token_type_ids=None):
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        input_mask = (input_ids != 0).long()

        # input_ids may have extra dimensions, so we reshape down to 2-d
        # before calling the BERT model and then reshape back at the end.
        if FIXED:
            all_encoder_layers, _ = self.bert_model(input_ids=combine_initial_dims(input_ids),
                                                    token_type_ids=combine_initial_dims(token_type_ids),
                                                    attention_mask=combine_initial_dims(input_mask))
        else:
            all_encoder_layers, _ = self.bert_model(combine_initial_dims(input_ids),
                                                    combine_initial_dims(input_mask),
                                                    combine_initial_dims(token_type_ids))
        if self._scalar_mix is not None:
            mix = self._scalar_mix(all_encoder_layers, input_mask)
        else:
            mix = all_encoder_layers[-1]

        if offsets is None:
            return uncombine_initial_dims(mix, input_ids.size())
        offsets2d = combine_initial_dims(offsets)
        range_vector = torch.arange(offsets2d.size(0)).unsqueeze(1)
        selected_embeddings = mix[range_vector, offsets2d]
        return uncombine_initial_dims(selected_embeddings, offsets.size())


# ---------------------------------------------------------------- allennlp SimpleTagger (NER), text field {"bert": ..., "mask": ...}
class SimpleTagger(nn.Module):
    def __init__(self, text_field_embedder, num_tags):
        super().__init__()
        self.text_field_embedder = text_field_embedder
        self.tag_projection_layer = nn.Linear(text_field_embedder.get_output_dim(), num_tags)

    def forward(self, tokens, tags=None):
        embedded_text_input = self.text_field_embedder(tokens["bert"], offsets=tokens.get("bert-offsets"))
        mask = get_text_field_mask(tokens)
        logits = self.tag_projection_layer(embedded_text_input)
        output = {"logits": logits, "mask": mask}
        if tags is not None:
            output["loss"] = sequence_cross_entropy_with_logits(logits, tags, mask)
        return output


def main():
    config = BertConfig(vocab_size_or_config_json_file=50, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=4, intermediate_size=64, max_position_embeddings=32)
    bert = BertModel(config)
    model = SimpleTagger(BertEmbedder(bert, top_layer_only=False), num_tags=5)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    # BertIndexer output: [CLS] ... [SEP] wordpieces, padded with 0 on the right; offsets = first wordpiece of
    # each word; "mask" is over the original words.
    cls, sep = 2, 3
    rows = [[cls, 11, 12, 13, 14, 15, 16, 17, sep], [cls, 21, 22, 23, sep], [cls, 31, sep]]
    offsets = [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    word_mask = [[1] * 7, [1, 1, 1, 0, 0, 0, 0], [1, 0, 0, 0, 0, 0, 0]]
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([r + [0] * (width - len(r)) for r in rows])
    tokens = {"bert": input_ids, "bert-offsets": torch.tensor(offsets), "mask": torch.tensor(word_mask)}
    tags = torch.randint(0, 5, (3, 7))

    model.train()
    output = model(tokens, tags)
    optimizer.zero_grad()
    output["loss"].backward()
    optimizer.step()
    print("train loss: %.4f" % output["loss"].item())

    # The second sentence tagged alone (no padding) vs. inside the padded batch.
    model.eval()
    with torch.no_grad():
        batched = model(tokens)["logits"][1, :3]
        alone_tokens = {"bert": input_ids[1:2, :5], "bert-offsets": torch.tensor([[1, 2, 3]]),
                        "mask": torch.tensor([[1, 1, 1]])}
        alone = model(alone_tokens)["logits"][0]
    print("max |logits(batched) - logits(alone)| for the short sentence: %.6f" % (batched - alone).abs().max().item())


if __name__ == "__main__":
    main()
