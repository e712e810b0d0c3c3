# Citation: NVIDIA/DeepLearningExamples @1d4211fe9d94550d7bc72bb9b0ac4f576533ca52:
#   PyTorch/LanguageModeling/BERT/modeling.py (LinearActivation, BertConfig, BertLayerNorm, BertEmbeddings,
#   BertSelfAttention, BertAttention, BertLayer, BertEncoder, BertPooler, BertModel, BertForTokenClassification)
#   + UKPLab/sentence-transformers @13b4da229038847bad09d663918f0a489cc00775:
#   sentence_transformers/models/Pooling.py (Pooling.forward, pooling_mode_mean_tokens).
# A hand-written BERT encoder fine-tuned for token classification (NER tags) over a batch of features
# right-padded to max_seq_length (input_mask 1 on [CLS] tokens [SEP], 0 on the pads, label 0 on the pads).
# BertModel.forward turns the (B, L) input_mask into the extended additive mask (B, 1, 1, L),
# (1.0 - mask) * -10000.0 in the embeddings' dtype, which every BertSelfAttention adds to its raw scores
# before the softmax; BertForTokenClassification keeps only the positions with attention_mask == 1 in its
# loss. The fine-tuned encoder's last layer is then mean-pooled into a sentence embedding as
# sentence-transformers' Pooling does it: token embeddings times the expanded mask, summed, divided by the
# clamped count of real tokens.
# Checked (float64, dropout 0): at each fine-tuning step the batched loss and its gradients equal the
# cross-entropy over every real token of each sentence run alone (no padding, all-ones mask); after
# training, the batched logits at real tokens and the mean-pooled embeddings equal those of each sentence
# run alone.
import math

import torch
import torch.nn.functional as F
import torch.nn.init as init
from torch import nn
from torch.nn import CrossEntropyLoss, Module
from torch.nn.parameter import Parameter

torch.manual_seed(0)
torch.set_num_threads(1)


# ---- PyTorch/LanguageModeling/BERT/modeling.py ----------------------------------------------------
def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def bias_gelu(bias, y):
    x = bias + y
    return x * 0.5 * (1.0 + torch.erf(x / 1.41421))


def bias_tanh(bias, y):
    x = bias + y
    return torch.tanh(x)


ACT2FN = {"gelu": gelu, "bias_gelu": bias_gelu, "bias_tanh": bias_tanh, "relu": torch.nn.functional.relu}


class LinearActivation(Module):
    r"""Fused Linear and activation Module.
    """
    __constants__ = ['bias']

    def __init__(self, in_features, out_features, act='gelu', bias=True):
        super(LinearActivation, self).__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.act_fn = nn.Identity()
        self.biased_act_fn = None
        self.bias = None
        if isinstance(act, str):
            if bias and not 'bias' in act:
                act = 'bias_' + act
                self.biased_act_fn = ACT2FN[act]
            else:
                self.act_fn = ACT2FN[act]
        else:
            self.act_fn = act
        self.weight = Parameter(torch.Tensor(out_features, in_features))
        if bias:
            self.bias = Parameter(torch.Tensor(out_features))
        else:
            self.register_parameter('bias', None)
        self.reset_parameters()

    def reset_parameters(self):
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init._calculate_fan_in_and_fan_out(self.weight)
            bound = 1 / math.sqrt(fan_in)
            init.uniform_(self.bias, -bound, bound)

    def forward(self, input):
        if not self.bias is None:
            return self.biased_act_fn(self.bias, F.linear(input, self.weight, None))
        else:
            return self.act_fn(F.linear(input, self.weight, self.bias))


class BertConfig(object):
    """Configuration class to store the configuration of a `BertModel`.
    """
    def __init__(self,
                 vocab_size_or_config_json_file,
                 hidden_size=768,
                 num_hidden_layers=12,
                 num_attention_heads=12,
                 intermediate_size=3072,
                 hidden_act="gelu",
                 hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1,
                 max_position_embeddings=512,
                 type_vocab_size=2,
                 initializer_range=0.02,
                 output_all_encoded_layers=False):
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
        self.output_all_encoded_layers = output_all_encoded_layers


class BertLayerNorm(Module):
    # apex is not installed here: the non-fused branch of BertLayerNorm.forward.
    def __init__(self, hidden_size, eps=1e-12):
        super(BertLayerNorm, self).__init__()
        self.shape = torch.Size((hidden_size,))
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u)
        s = s * s
        s = s.mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.eps)
        x = self.weight * x + self.bias
        return x


class BertEmbeddings(nn.Module):
    """Construct the embeddings from word, position and token_type embeddings.
    """
    def __init__(self, config):
        super(BertEmbeddings, self).__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids):
        seq_length = input_ids.size(1)
        position_ids = torch.arange(seq_length, dtype=torch.long, device=input_ids.device)
        position_ids = position_ids.unsqueeze(0).expand_as(input_ids)

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
        if config.hidden_size % config.num_attention_heads != 0:
            raise ValueError(
                "The hidden size (%d) is not a multiple of the number of attention "
                "heads (%d)" % (config.hidden_size, config.num_attention_heads))
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size

        self.query = nn.Linear(config.hidden_size, self.all_head_size)
        self.key = nn.Linear(config.hidden_size, self.all_head_size)
        self.value = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = torch.reshape(x, new_x_shape)
        return x.permute(0, 2, 1, 3)

    def transpose_key_for_scores(self, x):
        new_x_shape = x.size()[:-1] + (self.num_attention_heads, self.attention_head_size)
        x = torch.reshape(x, new_x_shape)
        return x.permute(0, 2, 3, 1)

    def forward(self, hidden_states, attention_mask):
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(hidden_states)
        mixed_value_layer = self.value(hidden_states)

        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_key_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

        # Take the dot product between "query" and "key" to get the raw attention scores.
        attention_scores = torch.matmul(query_layer, key_layer)
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # Apply the attention mask is (precomputed for all layers in BertModel forward() function)
        attention_scores = attention_scores + attention_mask

        # Normalize the attention scores to probabilities.
        attention_probs = F.softmax(attention_scores, dim=-1)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = torch.reshape(context_layer, new_context_layer_shape)
        return context_layer


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super(BertSelfOutput, self).__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertAttention(nn.Module):
    def __init__(self, config):
        super(BertAttention, self).__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, input_tensor, attention_mask):
        self_output = self.self(input_tensor, attention_mask)
        attention_output = self.output(self_output, input_tensor)
        return attention_output


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super(BertIntermediate, self).__init__()
        self.dense_act = LinearActivation(config.hidden_size, config.intermediate_size, act=config.hidden_act)

    def forward(self, hidden_states):
        hidden_states = self.dense_act(hidden_states)
        return hidden_states


class BertOutput(nn.Module):
    def __init__(self, config):
        super(BertOutput, self).__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = BertLayerNorm(config.hidden_size, eps=1e-12)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertLayer(nn.Module):
    def __init__(self, config):
        super(BertLayer, self).__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask):
        attention_output = self.attention(hidden_states, attention_mask)
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return layer_output


class BertEncoder(nn.Module):
    def __init__(self, config):
        super(BertEncoder, self).__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.output_all_encoded_layers = config.output_all_encoded_layers

    def forward(self, hidden_states, attention_mask):
        all_encoder_layers = []
        for i, layer_module in enumerate(self.layer):
            hidden_states = layer_module(hidden_states, attention_mask)
            if self.output_all_encoded_layers:
                all_encoder_layers.append(hidden_states)
        if not self.output_all_encoded_layers:
            all_encoder_layers.append(hidden_states)
        return all_encoder_layers


class BertPooler(nn.Module):
    def __init__(self, config):
        super(BertPooler, self).__init__()
        self.dense_act = LinearActivation(config.hidden_size, config.hidden_size, act="tanh")

    def forward(self, hidden_states):
        # We "pool" the model by simply taking the hidden state corresponding
        # to the first token.
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense_act(first_token_tensor)
        return pooled_output


class BertPreTrainedModel(nn.Module):
    def __init__(self, config, *inputs, **kwargs):
        super(BertPreTrainedModel, self).__init__()
        self.config = config

    def init_bert_weights(self, module):
        """ Initialize the weights.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, BertLayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()


class BertModel(BertPreTrainedModel):
    def __init__(self, config):
        super(BertModel, self).__init__(config)
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)
        self.apply(self.init_bert_weights)
        self.output_all_encoded_layers = config.output_all_encoded_layers

    def forward(self, input_ids, token_type_ids, attention_mask):
        # We create a 3D attention mask from a 2D tensor mask.
        # Sizes are [batch_size, 1, 1, to_seq_length]
        # So we can broadcast to [batch_size, num_heads, from_seq_length, to_seq_length]
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)

        # Since attention_mask is 1.0 for positions we want to attend and 0.0 for
        # masked positions, this operation will create a tensor which is 0.0 for
        # positions we want to attend and -10000.0 for masked positions.
        extended_attention_mask = extended_attention_mask.to(dtype=self.embeddings.word_embeddings.weight.dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        embedding_output = self.embeddings(input_ids, token_type_ids)
        encoded_layers = self.encoder(embedding_output, extended_attention_mask)
        sequence_output = encoded_layers[-1]
        pooled_output = self.pooler(sequence_output)
        if not self.output_all_encoded_layers:
            encoded_layers = encoded_layers[-1:]
        return encoded_layers, pooled_output


class BertForTokenClassification(BertPreTrainedModel):
    def __init__(self, config, num_labels):
        super(BertForTokenClassification, self).__init__(config)
        self.num_labels = num_labels
        self.bert = BertModel(config)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)
        self.apply(self.init_bert_weights)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        encoded_layers, _ = self.bert(input_ids, token_type_ids, attention_mask)
        sequence_output = encoded_layers[-1]
        sequence_output = self.dropout(sequence_output)
        logits = self.classifier(sequence_output)

        if labels is not None:
            loss_fct = CrossEntropyLoss()
            # Only keep active parts of the loss
            if attention_mask is not None:
                active_loss = attention_mask.view(-1) == 1
                active_logits = logits.view(-1, self.num_labels)[active_loss]
                active_labels = labels.view(-1)[active_loss]
                loss = loss_fct(active_logits, active_labels)
            else:
                loss = loss_fct(logits.view(-1, self.num_labels), labels.view(-1))
            return loss
        else:
            return logits


# ---- sentence_transformers/models/Pooling.py ------------------------------------------------------
class Pooling(nn.Module):
    def __init__(self, word_embedding_dimension, pooling_mode_cls_token=False, pooling_mode_max_tokens=False,
                 pooling_mode_mean_tokens=True, pooling_mode_mean_sqrt_len_tokens=False):
        super(Pooling, self).__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = pooling_mode_cls_token
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens
        self.pooling_mode_max_tokens = pooling_mode_max_tokens
        self.pooling_mode_mean_sqrt_len_tokens = pooling_mode_mean_sqrt_len_tokens
        pooling_mode_multiplier = sum([pooling_mode_cls_token, pooling_mode_max_tokens, pooling_mode_mean_tokens,
                                       pooling_mode_mean_sqrt_len_tokens])
        self.pooling_output_dimension = (pooling_mode_multiplier * word_embedding_dimension)

    def forward(self, features):
        token_embeddings = features['token_embeddings']
        cls_token = features['cls_token_embeddings']
        attention_mask = features['attention_mask']

        ## Pooling strategy
        output_vectors = []
        if self.pooling_mode_cls_token:
            output_vectors.append(cls_token)
        if self.pooling_mode_max_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            token_embeddings[input_mask_expanded == 0] = -1e9  # Set padding tokens to large negative value
            max_over_time = torch.max(token_embeddings, 1)[0]
            output_vectors.append(max_over_time)
        if self.pooling_mode_mean_tokens or self.pooling_mode_mean_sqrt_len_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).to(token_embeddings.dtype)
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)

            if 'token_weights_sum' in features:
                sum_mask = features['token_weights_sum'].unsqueeze(-1).expand(sum_embeddings.size())
            else:
                sum_mask = input_mask_expanded.sum(1)

            sum_mask = torch.clamp(sum_mask, min=1e-9)

            if self.pooling_mode_mean_tokens:
                output_vectors.append(sum_embeddings / sum_mask)
            if self.pooling_mode_mean_sqrt_len_tokens:
                output_vectors.append(sum_embeddings / torch.sqrt(sum_mask))

        output_vector = torch.cat(output_vectors, 1)
        features.update({'sentence_embedding': output_vector})
        return features


# ---- features: [CLS] tokens [SEP], right-padded to max_seq_length ---------------------------------
PAD_ID, CLS_ID, SEP_ID = 0, 1, 2
label_list = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "[CLS]", "[SEP]"]
label_map = {label: i for i, label in enumerate(label_list, 1)}  # 0 is the padding label
num_labels = len(label_list) + 1
max_seq_length = 12


def convert_example_to_feature(token_ids, labels):
    tokens = [CLS_ID] + token_ids + [SEP_ID]
    label_ids = [label_map["[CLS]"]] + [label_map[l] for l in labels] + [label_map["[SEP]"]]
    input_mask = [1] * len(tokens)
    segment_ids = [0] * len(tokens)
    while len(tokens) < max_seq_length:
        tokens.append(PAD_ID)
        input_mask.append(0)
        segment_ids.append(0)
        label_ids.append(0)
    return tokens, input_mask, segment_ids, label_ids


examples = [
    ([11, 12, 13, 14, 15, 16, 17, 18, 19, 20], ["B-PER", "I-PER", "O", "O", "B-LOC", "O", "O", "O", "B-PER", "O"]),
    ([21, 22, 23, 24], ["O", "B-LOC", "I-LOC", "O"]),
    ([25, 26, 27, 28, 29, 30, 31], ["B-PER", "O", "O", "O", "B-LOC", "I-LOC", "O"]),
    ([32, 33], ["O", "B-PER"]),
]
features = [convert_example_to_feature(t, l) for t, l in examples]
all_input_ids = torch.tensor([f[0] for f in features], dtype=torch.long)
all_input_mask = torch.tensor([f[1] for f in features], dtype=torch.long)
all_segment_ids = torch.tensor([f[2] for f in features], dtype=torch.long)
all_label_ids = torch.tensor([f[3] for f in features], dtype=torch.long)
seq_lens = all_input_mask.sum(1).tolist()

config = BertConfig(64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, max_position_embeddings=32)
model = BertForTokenClassification(config, num_labels=num_labels).double()
# Larger random weights than initializer_range so that a pad key would move the outputs visibly.
with torch.no_grad():
    for p in model.parameters():
        if p.dim() > 1:
            p.normal_(0.0, 0.2)
optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)


def reference_loss_and_logits(model):
    """Each sentence alone: its own length, no padding, an all-ones mask."""
    total, count, logits = 0.0, 0, []
    for i, n in enumerate(seq_lens):
        ids = all_input_ids[i:i + 1, :n]
        seg = all_segment_ids[i:i + 1, :n]
        row_logits = model(ids, seg, torch.ones_like(ids))
        total = total + F.cross_entropy(row_logits[0], all_label_ids[i, :n], reduction="sum")
        count += n
        logits.append(row_logits[0])
    return total / count, logits


# ---- fine-tuning -----------------------------------------------------------------------------------
model.train()
for step in range(4):
    loss = model(all_input_ids, all_segment_ids, all_input_mask, all_label_ids)
    grads = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)

    ref_loss, _ = reference_loss_and_logits(model)
    ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()), allow_unused=True)
    assert torch.allclose(loss, ref_loss, atol=1e-10), (step, loss.item(), ref_loss.item())
    for g, rg in zip(grads, ref_grads):
        if g is None or rg is None:
            assert g is None and rg is None
            continue
        assert torch.allclose(g, rg, atol=1e-9), step

    optimizer.zero_grad()
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    optimizer.step()
    print(f"step {step}: loss {loss.item():.6f} (sentences alone {ref_loss.item():.6f})")

# ---- evaluation: tags and sentence embeddings --------------------------------------------------------
model.eval()
pooling = Pooling(config.hidden_size, pooling_mode_mean_tokens=True)
with torch.no_grad():
    logits = model(all_input_ids, all_segment_ids, all_input_mask)
    _, ref_logits = reference_loss_and_logits(model)
    for i, n in enumerate(seq_lens):
        assert torch.allclose(logits[i, :n], ref_logits[i], atol=1e-10), i
    preds = logits.argmax(-1)

    encoded_layers, pooled_output = model.bert(all_input_ids, all_segment_ids, all_input_mask)
    out = pooling({'token_embeddings': encoded_layers[-1], 'cls_token_embeddings': encoded_layers[-1][:, 0],
                   'attention_mask': all_input_mask})
    sentence_embedding = out['sentence_embedding']
    for i, n in enumerate(seq_lens):
        ids = all_input_ids[i:i + 1, :n]
        alone, alone_pooled = model.bert(ids, all_segment_ids[i:i + 1, :n], torch.ones_like(ids))
        assert torch.allclose(sentence_embedding[i], alone[-1][0].mean(0), atol=1e-10), i
        assert torch.allclose(pooled_output[i], alone_pooled[0], atol=1e-10), i

id2label = {i: l for l, i in label_map.items()}
for i, n in enumerate(seq_lens):
    print(i, [id2label.get(int(p), "[PAD]") for p in preds[i, 1:n - 1]])
print("sentence embeddings", tuple(sentence_embedding.shape), "norms",
      [round(v, 4) for v in sentence_embedding.norm(dim=-1).tolist()])
print("ok: batched loss, gradients, logits and mean-pooled embeddings match each sentence run alone")
