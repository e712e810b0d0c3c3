"""TAPE (songlab-cal/tape): ProteinBert on a zero-padded batch of proteins, masked LM and remote homology.

Follows songlab-cal/tape @6d345c2b2bbf52cd32cf179325c222afd92aec7e: tape/models/modeling_bert.py (ProteinBertConfig,
ProteinBertEmbeddings, ProteinBertSelfAttention, ..., ProteinBertModel.forward, ProteinBertForMaskedLM,
ProteinBertForSequenceClassification), tape/models/modeling_utils.py (MLMHead, PredictionHeadTransform,
SequenceClassificationHead, SimpleMLP, gelu, TF-style LayerNorm), tape/tokenizers.py (TAPETokenizer, IUPAC_VOCAB:
<cls> protein <sep>, <pad> = 0) and tape/datasets.py (pad_sequences, MaskedLanguageModelingDataset.collate_fn,
RemoteHomologyDataset.collate_fn).

Each dataset item carries `input_mask = np.ones_like(token_ids)`; collate_fn right-pads input_ids and input_mask
with 0 and the MLM labels with -1. ProteinBertModel.forward turns input_mask into an additive
`(1.0 - input_mask[:, None, None, :]) * -10000.0` added to every layer's raw scores (eager softmax); the pooler
reads the <cls> token at position 0; MLMHead's CrossEntropyLoss(ignore_index=-1) skips padding and unmasked tokens.

Checked (eval mode): every real token's hidden state, attention map row and MLM logits, the pooled output and the
remote-homology fold logits equal each protein run alone with input_mask=None (no padding), and the batch MLM loss
equals the mean over a double loop (protein x masked position) of the per-protein token losses.
"""
import math
import random
import typing
from collections import OrderedDict
from copy import copy

import numpy as np
import torch
from torch import nn
from torch.nn.utils import weight_norm

IUPAC_VOCAB = OrderedDict([
    ("<pad>", 0), ("<mask>", 1), ("<cls>", 2), ("<sep>", 3), ("<unk>", 4),
    ("A", 5), ("B", 6), ("C", 7), ("D", 8), ("E", 9), ("F", 10), ("G", 11), ("H", 12), ("I", 13), ("K", 14),
    ("L", 15), ("M", 16), ("N", 17), ("O", 18), ("P", 19), ("Q", 20), ("R", 21), ("S", 22), ("T", 23),
    ("U", 24), ("V", 25), ("W", 26), ("X", 27), ("Y", 28), ("Z", 29)])


class TAPETokenizer():
    def __init__(self, vocab: str = 'iupac'):
        self.vocab = IUPAC_VOCAB
        self.tokens = list(self.vocab.keys())

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    @property
    def start_token(self) -> str:
        return "<cls>"

    @property
    def stop_token(self) -> str:
        return "<sep>"

    @property
    def mask_token(self) -> str:
        return "<mask>"

    def tokenize(self, text):
        return [x for x in text]

    def convert_token_to_id(self, token):
        return self.vocab[token]

    def convert_tokens_to_ids(self, tokens):
        return [self.convert_token_to_id(token) for token in tokens]

    def convert_id_to_token(self, index):
        return self.tokens[index]

    def add_special_tokens(self, token_ids):
        cls_token = [self.start_token]
        sep_token = [self.stop_token]
        return cls_token + token_ids + sep_token

    def encode(self, text):
        tokens = self.tokenize(text)
        tokens = self.add_special_tokens(tokens)
        token_ids = self.convert_tokens_to_ids(tokens)
        return np.array(token_ids, np.int64)


def pad_sequences(sequences, constant_value=0, dtype=None) -> np.ndarray:
    batch_size = len(sequences)
    shape = [batch_size] + np.max([seq.shape for seq in sequences], 0).tolist()

    if dtype is None:
        dtype = sequences[0].dtype

    if isinstance(sequences[0], np.ndarray):
        array = np.full(shape, constant_value, dtype=dtype)
    elif isinstance(sequences[0], torch.Tensor):
        array = torch.full(shape, constant_value, dtype=dtype)

    for arr, seq in zip(array, sequences):
        arrslice = tuple(slice(dim) for dim in seq.shape)
        arr[arrslice] = seq

    return array


class MaskedLanguageModelingDataset():
    def __init__(self, data, tokenizer):
        self.data = data
        self.tokenizer = tokenizer

    def __len__(self):
        return len(self.data)

    def __getitem__(self, index):
        item = self.data[index]
        tokens = self.tokenizer.tokenize(item['primary'])
        tokens = self.tokenizer.add_special_tokens(tokens)
        masked_tokens, labels = self._apply_bert_mask(tokens)
        masked_token_ids = np.array(
            self.tokenizer.convert_tokens_to_ids(masked_tokens), np.int64)
        input_mask = np.ones_like(masked_token_ids)

        return masked_token_ids, input_mask, labels, item['clan'], item['family']

    def collate_fn(self, batch):
        input_ids, input_mask, lm_label_ids, clan, family = tuple(zip(*batch))

        input_ids = torch.from_numpy(pad_sequences(input_ids, 0))
        input_mask = torch.from_numpy(pad_sequences(input_mask, 0))
        # ignore_index is -1
        lm_label_ids = torch.from_numpy(pad_sequences(lm_label_ids, -1))

        return {'input_ids': input_ids,
                'input_mask': input_mask,
                'targets': lm_label_ids}

    def _apply_bert_mask(self, tokens):
        masked_tokens = copy(tokens)
        labels = np.zeros([len(tokens)], np.int64) - 1

        for i, token in enumerate(tokens):
            if token in (self.tokenizer.start_token, self.tokenizer.stop_token):
                pass

            prob = random.random()
            if prob < 0.15:
                prob /= 0.15
                labels[i] = self.tokenizer.convert_token_to_id(token)

                if prob < 0.8:
                    token = self.tokenizer.mask_token
                elif prob < 0.9:
                    token = self.tokenizer.convert_id_to_token(
                        random.randint(0, self.tokenizer.vocab_size - 1))
                else:
                    pass

                masked_tokens[i] = token

        return masked_tokens, labels


class RemoteHomologyDataset():
    def __init__(self, data, tokenizer):
        self.data = data
        self.tokenizer = tokenizer

    def __getitem__(self, index: int):
        item = self.data[index]
        token_ids = self.tokenizer.encode(item['primary'])
        input_mask = np.ones_like(token_ids)
        return token_ids, input_mask, item['fold_label']

    def collate_fn(self, batch):
        input_ids, input_mask, fold_label = tuple(zip(*batch))
        input_ids = torch.from_numpy(pad_sequences(input_ids, 0))
        input_mask = torch.from_numpy(pad_sequences(input_mask, 0))
        fold_label = torch.LongTensor(fold_label)

        return {'input_ids': input_ids,
                'input_mask': input_mask,
                'targets': fold_label}


# ---------------------------------------------------------------- modeling_utils.py
def gelu(x):
    return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


def get_activation_fn(name: str) -> typing.Callable:
    if name == 'gelu':
        return gelu
    elif name == 'relu':
        return torch.nn.functional.relu
    raise ValueError(name)


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-12):
        """TF style (epsilon inside the square root)."""
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.bias = nn.Parameter(torch.zeros(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x):
        u = x.mean(-1, keepdim=True)
        s = (x - u).pow(2).mean(-1, keepdim=True)
        x = (x - u) / torch.sqrt(s + self.variance_epsilon)
        return self.weight * x + self.bias


class PredictionHeadTransform(nn.Module):
    def __init__(self, hidden_size, hidden_act='gelu', layer_norm_eps=1e-12):
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)
        self.transform_act_fn = get_activation_fn(hidden_act)
        self.LayerNorm = LayerNorm(hidden_size, eps=layer_norm_eps)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = self.LayerNorm(hidden_states)
        return hidden_states


class MLMHead(nn.Module):
    def __init__(self, hidden_size, vocab_size, hidden_act='gelu', layer_norm_eps=1e-12, ignore_index=-100):
        super().__init__()
        self.transform = PredictionHeadTransform(hidden_size, hidden_act, layer_norm_eps)
        self.decoder = nn.Linear(hidden_size, vocab_size, bias=False)
        self.bias = nn.Parameter(data=torch.zeros(vocab_size))
        self.vocab_size = vocab_size
        self._ignore_index = ignore_index

    def forward(self, hidden_states, targets=None):
        hidden_states = self.transform(hidden_states)
        hidden_states = self.decoder(hidden_states) + self.bias
        outputs = (hidden_states,)
        if targets is not None:
            loss_fct = nn.CrossEntropyLoss(ignore_index=self._ignore_index)
            masked_lm_loss = loss_fct(
                hidden_states.view(-1, self.vocab_size), targets.view(-1))
            metrics = {'perplexity': torch.exp(masked_lm_loss)}
            loss_and_metrics = (masked_lm_loss, metrics)
            outputs = (loss_and_metrics,) + outputs
        return outputs  # (loss), prediction_scores


class SimpleMLP(nn.Module):
    def __init__(self, in_dim, hid_dim, out_dim, dropout=0.):
        super().__init__()
        self.main = nn.Sequential(
            weight_norm(nn.Linear(in_dim, hid_dim), dim=None),
            nn.ReLU(),
            nn.Dropout(dropout, inplace=True),
            weight_norm(nn.Linear(hid_dim, out_dim), dim=None))

    def forward(self, x):
        return self.main(x)


class SequenceClassificationHead(nn.Module):
    def __init__(self, hidden_size: int, num_labels: int):
        super().__init__()
        self.classify = SimpleMLP(hidden_size, 512, num_labels)

    def forward(self, pooled_output, targets=None):
        logits = self.classify(pooled_output)
        outputs = (logits,)
        if targets is not None:
            loss_fct = nn.CrossEntropyLoss()
            classification_loss = loss_fct(logits, targets)
            outputs = ((classification_loss, {}),) + outputs
        return outputs  # (loss), logits


# ---------------------------------------------------------------- modeling_bert.py
class ProteinBertConfig():
    def __init__(self, vocab_size=30, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 intermediate_size=3072, hidden_act="gelu", hidden_dropout_prob=0.1,
                 attention_probs_dropout_prob=0.1, max_position_embeddings=8096, type_vocab_size=2,
                 initializer_range=0.02, layer_norm_eps=1e-12, num_labels=2, output_attentions=False,
                 output_hidden_states=False):
        self.vocab_size = vocab_size
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
        self.layer_norm_eps = layer_norm_eps
        self.num_labels = num_labels
        self.output_attentions = output_attentions
        self.output_hidden_states = output_hidden_states


class ProteinBertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(
            config.vocab_size, config.hidden_size, padding_idx=0)
        self.position_embeddings = nn.Embedding(
            config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None, position_ids=None):
        seq_length = input_ids.size(1)
        if position_ids is None:
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


class ProteinBertSelfAttention(nn.Module):
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

    def forward(self, hidden_states, attention_mask):
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(hidden_states)
        mixed_value_layer = self.value(hidden_states)

        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

        attention_scores = torch.matmul(query_layer, key_layer.transpose(-1, -2))
        attention_scores = attention_scores / math.sqrt(self.attention_head_size)
        # Apply the attention mask is (precomputed for all layers in ProteinBertModel forward() function)
        attention_scores = attention_scores + attention_mask

        attention_probs = nn.Softmax(dim=-1)(attention_scores)
        attention_probs = self.dropout(attention_probs)

        context_layer = torch.matmul(attention_probs, value_layer)

        context_layer = context_layer.permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (self.all_head_size,)
        context_layer = context_layer.view(*new_context_layer_shape)

        outputs = (context_layer, attention_probs) \
            if self.output_attentions else (context_layer,)
        return outputs


class ProteinBertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class ProteinBertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = ProteinBertSelfAttention(config)
        self.output = ProteinBertSelfOutput(config)

    def forward(self, input_tensor, attention_mask):
        self_outputs = self.self(input_tensor, attention_mask)
        attention_output = self.output(self_outputs[0], input_tensor)
        outputs = (attention_output,) + self_outputs[1:]
        return outputs


class ProteinBertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = get_activation_fn(config.hidden_act)

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class ProteinBertOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class ProteinBertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ProteinBertAttention(config)
        self.intermediate = ProteinBertIntermediate(config)
        self.output = ProteinBertOutput(config)

    def forward(self, hidden_states, attention_mask):
        attention_outputs = self.attention(hidden_states, attention_mask)
        attention_output = attention_outputs[0]
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        outputs = (layer_output,) + attention_outputs[1:]
        return outputs


class ProteinBertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.output_attentions = config.output_attentions
        self.output_hidden_states = config.output_hidden_states
        self.layer = nn.ModuleList(
            [ProteinBertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask, chunks=None):
        all_hidden_states = ()
        all_attentions = ()
        for i, layer_module in enumerate(self.layer):
            if self.output_hidden_states:
                all_hidden_states = all_hidden_states + (hidden_states,)

            layer_outputs = layer_module(hidden_states, attention_mask)
            hidden_states = layer_outputs[0]

            if self.output_attentions:
                all_attentions = all_attentions + (layer_outputs[1],)

        if self.output_hidden_states:
            all_hidden_states = all_hidden_states + (hidden_states,)

        outputs = (hidden_states,)
        if self.output_hidden_states:
            outputs = outputs + (all_hidden_states,)
        if self.output_attentions:
            outputs = outputs + (all_attentions,)
        return outputs  # outputs, (hidden states), (attentions)


class ProteinBertPooler(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.activation = nn.Tanh()

    def forward(self, hidden_states):
        # We "pool" the model by simply taking the hidden state corresponding to the first token.
        first_token_tensor = hidden_states[:, 0]
        pooled_output = self.dense(first_token_tensor)
        pooled_output = self.activation(pooled_output)
        return pooled_output


class ProteinBertAbstractModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config

    def _init_weights(self, module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()

    def init_weights(self):
        self.apply(self._init_weights)


class ProteinBertModel(ProteinBertAbstractModel):
    def __init__(self, config):
        super().__init__(config)
        self.embeddings = ProteinBertEmbeddings(config)
        self.encoder = ProteinBertEncoder(config)
        self.pooler = ProteinBertPooler(config)
        self.init_weights()

    def forward(self, input_ids, input_mask=None):
        if input_mask is None:
            input_mask = torch.ones_like(input_ids)

        # We create a 3D attention mask from a 2D tensor mask.
        # Sizes are [batch_size, 1, 1, to_seq_length]
        extended_attention_mask = input_mask.unsqueeze(1).unsqueeze(2)

        # 0.0 for positions we want to attend and -10000.0 for masked positions.
        extended_attention_mask = extended_attention_mask.to(
            dtype=next(self.parameters()).dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0

        embedding_output = self.embeddings(input_ids)
        encoder_outputs = self.encoder(embedding_output,
                                       extended_attention_mask,
                                       chunks=None)
        sequence_output = encoder_outputs[0]
        pooled_output = self.pooler(sequence_output)

        outputs = (sequence_output, pooled_output,) + encoder_outputs[1:]
        return outputs  # sequence_output, pooled_output, (hidden_states), (attentions)


class ProteinBertForMaskedLM(ProteinBertAbstractModel):
    def __init__(self, config):
        super().__init__(config)
        self.bert = ProteinBertModel(config)
        self.mlm = MLMHead(
            config.hidden_size, config.vocab_size, config.hidden_act, config.layer_norm_eps,
            ignore_index=-1)
        self.init_weights()
        self.tie_weights()

    def tie_weights(self):
        self.mlm.decoder.weight = self.bert.embeddings.word_embeddings.weight

    def forward(self, input_ids, input_mask=None, targets=None):
        outputs = self.bert(input_ids, input_mask=input_mask)
        sequence_output, pooled_output = outputs[:2]
        outputs = self.mlm(sequence_output, targets) + outputs[2:]
        return outputs  # (loss), prediction_scores, (hidden_states), (attentions)


class ProteinBertForSequenceClassification(ProteinBertAbstractModel):
    def __init__(self, config):
        super().__init__(config)
        self.bert = ProteinBertModel(config)
        self.classify = SequenceClassificationHead(
            config.hidden_size, config.num_labels)
        self.init_weights()

    def forward(self, input_ids, input_mask=None, targets=None):
        outputs = self.bert(input_ids, input_mask=input_mask)
        sequence_output, pooled_output = outputs[:2]
        outputs = self.classify(pooled_output, targets) + outputs[2:]
        return outputs  # (loss), prediction_scores, (hidden_states), (attentions)


def main():
    torch.manual_seed(0)
    random.seed(0)
    tokenizer = TAPETokenizer(vocab='iupac')
    proteins = ["MKTAYIAKQRQISFVKSHFSRQ", "GSHMLE", "MADEEKLPPGWEKRMSRS", "PEPTIDE", "MKVLAAGIVGLLLA"]

    config = ProteinBertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                               num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                               num_labels=5, output_attentions=True)

    # ---- masked LM over Pfam-style items
    mlm_data = MaskedLanguageModelingDataset(
        [{'primary': p, 'clan': 0, 'family': i} for i, p in enumerate(proteins)], tokenizer)
    items = [mlm_data[i] for i in range(len(mlm_data))]
    for ids, _, labels, _, _ in items:  # make sure every protein has at least one scored position
        if (labels == -1).all():
            labels[1] = ids[1] if ids[1] > 4 else tokenizer.convert_token_to_id("A")
    batch = mlm_data.collate_fn(items)

    model = ProteinBertForMaskedLM(config).eval()
    with torch.no_grad():
        (loss, metrics), prediction_scores, attentions = model(**batch)
        seq_out = model.bert(batch['input_ids'], input_mask=batch['input_mask'])[0]

        per_token = []
        for i, (ids, _, labels, _, _) in enumerate(items):
            L = len(ids)
            ids_t = torch.from_numpy(ids)[None]
            ref_scores, ref_attn = model(ids_t)  # input_mask=None: no padding at all
            ref_seq = model.bert(ids_t)[0]
            assert torch.allclose(seq_out[i, :L], ref_seq[0], atol=1e-5), i
            assert torch.allclose(prediction_scores[i, :L], ref_scores[0], atol=1e-4), i
            for layer, (a_b, a_r) in enumerate(zip(attentions, ref_attn)):
                assert torch.allclose(a_b[i, :, :L, :L], a_r[0], atol=1e-6), (i, layer)
                assert float(a_b[i, :, :L, L:].abs().max() if a_b.shape[-1] > L else 0.0) < 1e-6, (i, layer)
            logp = torch.log_softmax(ref_scores[0], -1)
            for t in range(L):  # double loop: protein x position
                if labels[t] != -1:
                    per_token.append(-logp[t, labels[t]])
        ref_loss = torch.stack(per_token).mean()
        assert torch.allclose(loss, ref_loss, atol=1e-5), (loss, ref_loss)
    print(f"masked LM: {len(per_token)} scored residues, loss {loss.item():.4f} equals the per-protein runs")

    # ---- remote homology (fold classification from the pooled <cls> token)
    rh_data = RemoteHomologyDataset([{'primary': p, 'fold_label': i % 5} for i, p in enumerate(proteins)],
                                    tokenizer)
    batch = rh_data.collate_fn([rh_data[i] for i in range(len(proteins))])
    clf = ProteinBertForSequenceClassification(config).eval()
    with torch.no_grad():
        (loss, _), logits, attentions = clf(**batch)
        pooled = clf.bert(batch['input_ids'], input_mask=batch['input_mask'])[1]
        ref_losses = []
        for i, p in enumerate(proteins):
            ids_t = torch.from_numpy(tokenizer.encode(p))[None]
            ref_logits, _ = clf(ids_t)
            ref_pooled = clf.bert(ids_t)[1]
            assert torch.allclose(pooled[i], ref_pooled[0], atol=1e-5), i
            assert torch.allclose(logits[i], ref_logits[0], atol=1e-4), i
            ref_losses.append(-torch.log_softmax(ref_logits[0], -1)[i % 5])
        assert torch.allclose(loss, torch.stack(ref_losses).mean(), atol=1e-5)
    print("remote homology: fold logits of", len(proteins), "padded proteins equal the unpadded runs;",
          "preds", logits.argmax(-1).tolist())
    print("OK")


if __name__ == "__main__":
    main()
