# Correct program (quiet batch quiet-r158a): ConSERT's unsupervised contrastive fine-tuning of BERT.
# Ported from yym6472/ConSERT @03c9e8f (read through the stored mirror):
#   transformers/modeling_bert.py (ConSERT's patched transformers 3.4 BertModel: BertEmbeddings, BertSelfAttention with
#     the precomputed additive mask, BertModel.forward with the "custom added" data augmentation hooks set_flag /
#     _replace_position_ids ("shuffle": position ids permuted among the first attention_mask.sum() positions) /
#     _replace_embedding_output / _cutoff_embeddings ("row" = token cutoff over the real tokens, "column" = feature
#     cutoff)), the inherited get_extended_attention_mask ((1.0 - mask) * -10000.0),
#   sentence_transformers/models/Transformer.py (forward, get_sentence_features: prepare_for_model padded to
#     max_len + 3, 'max_length'), sentence_transformers/models/Pooling.py (mean pooling over attention_mask),
#   sentence_transformers/SentenceTransformer.py (smart_batching_collate: each batch padded to its own longest text),
#   sentence_transformers/losses/AdvCLSoftmaxLoss.py (_data_aug, _contrastive_loss_forward "nt_xent", LARGE_NUM),
#   scripts/unsup-consert-base.sh (--no_pair --no_dropout --temperature 0.1 --da_final_1 feature_cutoff
#     --cutoff_rate_final_1 0.2 --da_final_2 shuffle --cl_loss_only, mean pooling).
# Trimmed: from_pretrained is replaced by a tiny BertConfig (transformers' config class) and these modules; the tokenizer
# by word-piece ids and its prepare_for_model framing ([CLS] ... [SEP], pad id 0, right padding); the loss keeps the
# no_pair, cl_loss_only, final_1 / final_2 path (no projection head); apex, tensorboard and the span / adv branches go.
# Self-check: every sentence alone (its own L tokens, no padding, no mask) run through a hand-written BERT forward with
# the same permutation / cutoff indices gives each view's mean-pooled embedding; the padded batch must match it, and the
# NT-Xent loss must equal a double loop over the reference views.
import math
import random
from typing import Any, Dict, Iterable, List

import numpy as np
import torch
from torch import Tensor, nn
from transformers import BertConfig

LARGE_NUM = 1e9
CLS_ID, SEP_ID, PAD_ID = 1, 2, 0


# --- transformers/modeling_bert.py (ConSERT's patched copy) ---
class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size, padding_idx=config.pad_token_id)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.register_buffer("position_ids", torch.arange(config.max_position_embeddings).expand((1, -1)))

    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None):
        input_shape = input_ids.size()
        seq_length = input_shape[1]
        if position_ids is None:
            position_ids = self.position_ids[:, :seq_length]
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=self.position_ids.device)
        if inputs_embeds is None:
            inputs_embeds = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids)
        token_type_embeddings = self.token_type_embeddings(token_type_ids)
        embeddings = inputs_embeds + position_embeddings + token_type_embeddings
        embeddings = self.LayerNorm(embeddings)
        embeddings = self.dropout(embeddings)
        return embeddings


class BertSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
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
        mixed_query_layer = self.query(hidden_states)
        mixed_key_layer = self.key(hidden_states)
        mixed_value_layer = self.value(hidden_states)
        query_layer = self.transpose_for_scores(mixed_query_layer)
        key_layer = self.transpose_for_scores(mixed_key_layer)
        value_layer = self.transpose_for_scores(mixed_value_layer)

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
        context_layer = context_layer.view(*new_context_layer_shape)
        return (context_layer,)


class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        self_outputs = self.self(hidden_states, attention_mask)
        attention_output = self.output(self_outputs[0], hidden_states)
        return (attention_output,) + self_outputs[1:]


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class BertOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states = self.LayerNorm(hidden_states + input_tensor)
        return hidden_states


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask=None):
        self_attention_outputs = self.attention(hidden_states, attention_mask)
        attention_output = self_attention_outputs[0]
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output)
        return (layer_output,)


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None):
        for i, layer_module in enumerate(self.layer):
            layer_outputs = layer_module(hidden_states, attention_mask)
            hidden_states = layer_outputs[0]
        return (hidden_states,)


class BertModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)

    @property
    def dtype(self):
        return next(self.parameters()).dtype

    # transformers 3.4 ModuleUtilsMixin.get_extended_attention_mask (encoder branch)
    def get_extended_attention_mask(self, attention_mask: Tensor, input_shape, device) -> Tensor:
        if attention_mask.dim() == 3:
            extended_attention_mask = attention_mask[:, None, :, :]
        elif attention_mask.dim() == 2:
            extended_attention_mask = attention_mask[:, None, None, :]
        else:
            raise ValueError("Wrong shape for input_ids (shape {}) or attention_mask (shape {})".format(
                input_shape, attention_mask.shape))
        extended_attention_mask = extended_attention_mask.to(dtype=self.dtype)  # fp16 compatibility
        extended_attention_mask = (1.0 - extended_attention_mask) * -10000.0
        return extended_attention_mask

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, position_ids=None):
        input_shape = input_ids.size()
        device = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(input_shape, device=device)
        if token_type_ids is None:
            token_type_ids = torch.zeros(input_shape, dtype=torch.long, device=device)

        extended_attention_mask: torch.Tensor = self.get_extended_attention_mask(attention_mask, input_shape, device)

        # Custom added, for data augmentation
        position_ids = self._replace_position_ids(input_ids, position_ids, attention_mask)
        # ----- Custom added END ------------

        embedding_output = self.embeddings(input_ids=input_ids, position_ids=position_ids, token_type_ids=token_type_ids)

        # Custom added, for data augmentation
        self._most_recent_embedding_output = embedding_output
        embedding_output = self._replace_embedding_output(embedding_output, attention_mask)
        # ----- Custom added END ------------
        encoder_outputs = self.encoder(embedding_output, attention_mask=extended_attention_mask)
        sequence_output = encoder_outputs[0]
        return (sequence_output,)

    # custom added functions for data augmentation
    def set_flag(self, key: str, value: Any):
        assert f"flag__{key}" not in self.__dict__
        self.__dict__[f"flag__{key}"] = value

    def unset_flag(self, key: str):
        assert f"flag__{key}" in self.__dict__
        del self.__dict__[f"flag__{key}"]

    def exists_flag(self, key: str):
        return f"flag__{key}" in self.__dict__

    def get_flag(self, key: str):
        assert f"flag__{key}" in self.__dict__
        return self.__dict__[f"flag__{key}"]

    def _replace_embedding_output(self, embedding_output, attention_mask):
        bsz, seq_len, emb_size = embedding_output.shape
        if self.exists_flag("data_aug_cutoff"):
            direction = self.get_flag("data_aug_cutoff.direction")
            assert direction in ("row", "column", "random")
            rate = self.get_flag("data_aug_cutoff.rate")
            assert isinstance(rate, float) and 0.0 < rate < 1.0
            self.unset_flag("data_aug_cutoff")
            self.unset_flag("data_aug_cutoff.direction")
            self.unset_flag("data_aug_cutoff.rate")
            embedding_after_cutoff = self._cutoff_embeddings(embedding_output, attention_mask, direction, rate)
            return embedding_after_cutoff
        else:
            return embedding_output

    def _replace_position_ids(self, input_ids, position_ids, attention_mask):
        bsz, seq_len = input_ids.shape
        if self.exists_flag("data_aug_shuffle"):
            self.unset_flag("data_aug_shuffle")
            if position_ids is None:
                position_ids = torch.arange(512).expand((bsz, -1))[:, :seq_len].to(device=input_ids.device)
            # shuffle position_ids
            shuffled_pid = []
            for bsz_id in range(bsz):
                sample_pid = position_ids[bsz_id]
                sample_mask = attention_mask[bsz_id]
                num_tokens = sample_mask.sum().int().item()
                indexes = list(range(num_tokens))
                random.shuffle(indexes)
                rest_indexes = list(range(num_tokens, seq_len))
                total_indexes = indexes + rest_indexes
                shuffled_pid.append(torch.index_select(sample_pid, 0, torch.tensor(total_indexes).to(device=input_ids.device)).unsqueeze(0))
            return torch.cat(shuffled_pid, 0)
        else:
            return position_ids

    def _cutoff_embeddings(self, embedding_output, attention_mask, direction, rate):
        bsz, seq_len, emb_size = embedding_output.shape
        cutoff_embeddings = []
        for bsz_id in range(bsz):
            sample_embedding = embedding_output[bsz_id]
            sample_mask = attention_mask[bsz_id]
            if direction == "row":
                num_dimensions = sample_mask.sum().int().item()  # number of tokens
                dim_index = 0
            elif direction == "column":
                num_dimensions = emb_size  # number of features
                dim_index = 1
            elif direction == "random":
                num_dimensions = sample_mask.sum().int().item() * emb_size
                dim_index = 0
            num_cutoff_indexes = int(num_dimensions * rate)
            if num_cutoff_indexes < 0 or num_cutoff_indexes > num_dimensions:
                raise ValueError(f"number of cutoff dimensions should be in (0, {num_dimensions}), but got {num_cutoff_indexes}")
            indexes = list(range(num_dimensions))
            random.shuffle(indexes)
            cutoff_indexes = indexes[:num_cutoff_indexes]
            if direction == "random":
                sample_embedding = sample_embedding.reshape(-1)
            cutoff_embedding = torch.index_fill(sample_embedding, dim_index, torch.tensor(cutoff_indexes, dtype=torch.long).to(device=embedding_output.device), 0.0)
            if direction == "random":
                cutoff_embedding = cutoff_embedding.reshape(seq_len, emb_size)
            cutoff_embeddings.append(cutoff_embedding.unsqueeze(0))
        cutoff_embeddings = torch.cat(cutoff_embeddings, 0)
        assert cutoff_embeddings.shape == embedding_output.shape, (cutoff_embeddings.shape, embedding_output.shape)
        return cutoff_embeddings


# --- sentence_transformers/models/Transformer.py ---
class Transformer(nn.Module):
    def __init__(self, config: BertConfig, max_seq_length: int = 64):
        super(Transformer, self).__init__()
        self.config_keys = ['max_seq_length']
        self.max_seq_length = max_seq_length
        self.auto_model = BertModel(config)

    def forward(self, features):
        """Returns token_embeddings, cls_token"""
        output_states = self.auto_model(**features)
        output_tokens = output_states[0]
        cls_tokens = output_tokens[:, 0, :]  # CLS token is first token
        features.update({'token_embeddings': output_tokens, 'cls_token_embeddings': cls_tokens, 'attention_mask': features['attention_mask']})
        return features

    def get_word_embedding_dimension(self) -> int:
        return self.auto_model.config.hidden_size

    def prepare_for_model(self, ids: List[int], max_length: int):
        # BertTokenizer.prepare_for_model(ids, max_length=..., padding='max_length', truncation=True,
        # return_tensors='pt', prepend_batch_axis=True): [CLS] ids [SEP], right padded with the pad id
        ids = ids[:max_length - 2]
        input_ids = [CLS_ID] + ids + [SEP_ID]
        attention_mask = [1] * len(input_ids)
        difference = max_length - len(input_ids)
        input_ids = input_ids + [PAD_ID] * difference
        attention_mask = attention_mask + [0] * difference
        token_type_ids = [0] * max_length
        return {'input_ids': torch.tensor([input_ids]), 'token_type_ids': torch.tensor([token_type_ids]),
                'attention_mask': torch.tensor([attention_mask])}

    def get_sentence_features(self, tokens: List[int], pad_seq_length: int):
        pad_seq_length = min(pad_seq_length, self.max_seq_length, self.auto_model.config.max_position_embeddings - 3) + 3  # Add space for special tokens
        return self.prepare_for_model(tokens, max_length=pad_seq_length)


# --- sentence_transformers/models/Pooling.py (mean branch, as main.py builds it) ---
class Pooling(nn.Module):
    def __init__(self, word_embedding_dimension: int, pooling_mode_cls_token: bool = False,
                 pooling_mode_max_tokens: bool = False, pooling_mode_mean_tokens: bool = True):
        super(Pooling, self).__init__()
        self.word_embedding_dimension = word_embedding_dimension
        self.pooling_mode_cls_token = pooling_mode_cls_token
        self.pooling_mode_mean_tokens = pooling_mode_mean_tokens
        self.pooling_mode_max_tokens = pooling_mode_max_tokens

    def forward(self, features: Dict[str, Tensor]):
        token_embeddings = features['token_embeddings']
        cls_token = features['cls_token_embeddings']
        attention_mask = features['attention_mask']
        output_vectors = []
        if self.pooling_mode_cls_token:
            output_vectors.append(cls_token)
        if self.pooling_mode_mean_tokens:
            input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
            sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
            sum_mask = input_mask_expanded.sum(1)
            sum_mask = torch.clamp(sum_mask, min=1e-9)
            output_vectors.append(sum_embeddings / sum_mask)
        output_vector = torch.cat(output_vectors, 1)
        features.update({'sentence_embedding': output_vector})
        return features


# --- sentence_transformers/SentenceTransformer.py ---
class SentenceTransformer(nn.Sequential):
    def get_sentence_features(self, *features):
        return self._first_module().get_sentence_features(*features)

    def _first_module(self):
        return self._modules[next(iter(self._modules))]

    def _text_length(self, text):
        if len(text) == 0 or isinstance(text[0], int):
            return len(text)
        return sum([len(t) for t in text])

    def smart_batching_collate(self, batch):
        num_texts = len(batch[0][0])
        labels = []
        paired_texts = [[] for _ in range(num_texts)]
        max_seq_len = [0] * num_texts
        for tokens, label in batch:
            labels.append(label)
            for i in range(num_texts):
                paired_texts[i].append(tokens[i])
                max_seq_len[i] = max(max_seq_len[i], self._text_length(tokens[i]))
        features = []
        for idx in range(num_texts):
            max_len = max_seq_len[idx]
            feature_lists = {}
            for text in paired_texts[idx]:
                sentence_features = self.get_sentence_features(text, max_len)
                for feature_name in sentence_features:
                    if feature_name not in feature_lists:
                        feature_lists[feature_name] = []
                    feature_lists[feature_name].append(sentence_features[feature_name])
            for feature_name in feature_lists:
                feature_lists[feature_name] = torch.cat(feature_lists[feature_name])
            features.append(feature_lists)
        return {'features': features, 'labels': torch.stack(labels)}

    def smart_batching_collate_text_only(self, batch):
        max_seq_len = max([self._text_length(text) for text in batch])
        feature_lists = {}
        for text in batch:
            sentence_features = self.get_sentence_features(text, max_seq_len)
            for feature_name in sentence_features:
                if feature_name not in feature_lists:
                    feature_lists[feature_name] = []
                feature_lists[feature_name].append(sentence_features[feature_name])
        for feature_name in feature_lists:
            feature_lists[feature_name] = torch.cat(feature_lists[feature_name])
        return feature_lists


# --- sentence_transformers/losses/AdvCLSoftmaxLoss.py (no_pair, cl_loss_only, final_1 / final_2 views) ---
class AdvCLSoftmaxLoss(nn.Module):
    def __init__(self, model: SentenceTransformer, temperature: float = 1.0, contrastive_loss_rate: float = 1.0,
                 data_augmentation_strategy_final_1: str = None, data_augmentation_strategy_final_2: str = None,
                 cutoff_rate_final_1: float = None, cutoff_rate_final_2: float = None, no_pair: bool = True):
        super().__init__()
        self.model = model
        self.temperature = temperature
        self.contrastive_loss_rate = contrastive_loss_rate
        self.data_augmentation_strategy_final_1 = data_augmentation_strategy_final_1
        self.data_augmentation_strategy_final_2 = data_augmentation_strategy_final_2
        self.cutoff_rate_final_1 = cutoff_rate_final_1
        self.cutoff_rate_final_2 = cutoff_rate_final_2
        self.no_pair = no_pair
        self.do_hidden_normalization = True

    def _contrastive_loss_forward(self, hidden1: torch.Tensor, hidden2: torch.Tensor, hidden_norm: bool = True,
                                  temperature: float = 1.0):
        batch_size, hidden_dim = hidden1.shape
        if hidden_norm:
            hidden1 = torch.nn.functional.normalize(hidden1, p=2, dim=-1)
            hidden2 = torch.nn.functional.normalize(hidden2, p=2, dim=-1)
        hidden1_large = hidden1
        hidden2_large = hidden2
        labels = torch.arange(0, batch_size).to(device=hidden1.device)
        masks = torch.nn.functional.one_hot(torch.arange(0, batch_size), num_classes=batch_size).to(device=hidden1.device, dtype=torch.float)

        logits_aa = torch.matmul(hidden1, hidden1_large.transpose(0, 1)) / temperature  # shape (bsz, bsz)
        logits_aa = logits_aa - masks * LARGE_NUM
        logits_bb = torch.matmul(hidden2, hidden2_large.transpose(0, 1)) / temperature  # shape (bsz, bsz)
        logits_bb = logits_bb - masks * LARGE_NUM
        logits_ab = torch.matmul(hidden1, hidden2_large.transpose(0, 1)) / temperature  # shape (bsz, bsz)
        logits_ba = torch.matmul(hidden2, hidden1_large.transpose(0, 1)) / temperature  # shape (bsz, bsz)

        loss_a = torch.nn.functional.cross_entropy(torch.cat([logits_ab, logits_aa], dim=1), labels)
        loss_b = torch.nn.functional.cross_entropy(torch.cat([logits_ba, logits_bb], dim=1), labels)
        loss = loss_a + loss_b
        return loss

    def _recover_to_origin_keys(self, sentence_feature: Dict[str, Tensor], ori_keys):
        return {k: v for k, v in sentence_feature.items() if k in ori_keys}

    def _data_aug(self, sentence_feature, name, ori_keys, cutoff_rate):
        assert name in ("none", "shuffle", "token_cutoff", "feature_cutoff", "dropout")
        sentence_feature = self._recover_to_origin_keys(sentence_feature, ori_keys)
        if name == "none":
            pass  # do nothing
        elif name == "shuffle":
            self.model[0].auto_model.set_flag("data_aug_shuffle", True)
        elif name == "token_cutoff":
            self.model[0].auto_model.set_flag("data_aug_cutoff", True)
            self.model[0].auto_model.set_flag("data_aug_cutoff.direction", "row")
            self.model[0].auto_model.set_flag("data_aug_cutoff.rate", cutoff_rate)
        elif name == "feature_cutoff":
            self.model[0].auto_model.set_flag("data_aug_cutoff", True)
            self.model[0].auto_model.set_flag("data_aug_cutoff.direction", "column")
            self.model[0].auto_model.set_flag("data_aug_cutoff.rate", cutoff_rate)
        elif name == "dropout":
            self.model[0].auto_model.set_flag("data_aug_cutoff", True)
            self.model[0].auto_model.set_flag("data_aug_cutoff.direction", "random")
            self.model[0].auto_model.set_flag("data_aug_cutoff.rate", cutoff_rate)
        rep = self.model(sentence_feature)["sentence_embedding"]
        return rep

    def forward(self, sentence_features: Iterable[Dict[str, Tensor]], labels: Tensor):
        sentence_feature_a = sentence_features[0]
        ori_feature_keys = set(sentence_feature_a.keys())  # record the keys since the features will be updated
        rep_a_view1 = self._data_aug(sentence_feature_a, self.data_augmentation_strategy_final_1, ori_feature_keys, self.cutoff_rate_final_1)
        rep_a_view2 = self._data_aug(sentence_feature_a, self.data_augmentation_strategy_final_2, ori_feature_keys, self.cutoff_rate_final_2)
        final_loss = 0
        contrastive_loss_a = self._contrastive_loss_forward(rep_a_view1, rep_a_view2, hidden_norm=self.do_hidden_normalization, temperature=self.temperature)
        final_loss += self.contrastive_loss_rate * contrastive_loss_a
        self.last_views = (rep_a_view1, rep_a_view2)
        return final_loss


# --- independent reference: one sentence at a time, its own tokens only, no padding and no mask ---
def ref_layer_norm(x, ln):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + ln.eps) * ln.weight + ln.bias


def ref_sentence_embedding(bert: BertModel, tokens: List[int], aug: str, rate: float):
    """Mean-pooled embedding of [CLS] tokens [SEP] alone. Draws from `random` exactly as one sample of the batch does."""
    ids = [CLS_ID] + tokens + [SEP_ID]
    L = len(ids)
    cfg = bert.config
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    dh = H // nh
    pos = list(range(L))
    if aug == "shuffle":
        perm = list(range(L))
        random.shuffle(perm)
        pos = perm
    emb = bert.embeddings
    x = torch.stack([emb.word_embeddings.weight[ids[t]] + emb.position_embeddings.weight[pos[t]]
                     + emb.token_type_embeddings.weight[0] for t in range(L)])
    x = ref_layer_norm(x, emb.LayerNorm)
    if aug == "token_cutoff":
        order = list(range(L))
        random.shuffle(order)
        for t in order[:int(L * rate)]:
            x[t] = 0.0
    elif aug == "feature_cutoff":
        order = list(range(H))
        random.shuffle(order)
        for d in order[:int(H * rate)]:
            x[:, d] = 0.0
    for layer in bert.encoder.layer:
        sa = layer.attention.self
        q = x @ sa.query.weight.T + sa.query.bias
        k = x @ sa.key.weight.T + sa.key.bias
        v = x @ sa.value.weight.T + sa.value.bias
        ctx = torch.zeros(L, H, dtype=x.dtype)
        for h in range(nh):
            sl = slice(h * dh, (h + 1) * dh)
            for i in range(L):
                s = torch.stack([(q[i, sl] * k[j, sl]).sum() / math.sqrt(dh) for j in range(L)])
                p = torch.exp(s - s.max())
                p = p / p.sum()
                ctx[i, sl] = (p[:, None] * v[:, sl]).sum(0)
        so = layer.attention.output
        a = ref_layer_norm(ctx @ so.dense.weight.T + so.dense.bias + x, so.LayerNorm)
        it = layer.intermediate.dense
        m = a @ it.weight.T + it.bias
        m = 0.5 * m * (1.0 + torch.erf(m / math.sqrt(2.0)))
        oo = layer.output
        x = ref_layer_norm(m @ oo.dense.weight.T + oo.dense.bias + a, oo.LayerNorm)
    return x.sum(0) / L


def ref_views(bert, texts, aug, rate):
    return torch.stack([ref_sentence_embedding(bert, t, aug, rate) for t in texts])


def ref_nt_xent(h1, h2, temperature):
    h1 = h1 / h1.norm(dim=-1, keepdim=True)
    h2 = h2 / h2.norm(dim=-1, keepdim=True)
    B = h1.shape[0]
    total = 0.0
    for a, b in ((h1, h2), (h2, h1)):
        loss = 0.0
        for i in range(B):
            pos = float(a[i] @ b[i]) / temperature
            cands = [float(a[i] @ b[j]) / temperature for j in range(B)]
            cands += [float(a[i] @ a[j]) / temperature for j in range(B) if j != i]
            loss += -(pos - math.log(sum(math.exp(c) for c in cands)))
        total += loss / B
    return total


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    config = BertConfig(vocab_size=60, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2, pad_token_id=PAD_ID,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)  # --no_dropout
    word_embedding_model = Transformer(config, max_seq_length=64)
    pooling_model = Pooling(word_embedding_model.get_word_embedding_dimension(), pooling_mode_mean_tokens=True,
                            pooling_mode_cls_token=False, pooling_mode_max_tokens=False)
    model = SentenceTransformer(word_embedding_model, pooling_model)
    model.double()
    bert = model[0].auto_model

    # unsupervised STS sentences (--no_pair): word-piece ids of different lengths, one dataloader batch
    rng = np.random.RandomState(1)
    lengths = [3, 9, 5, 12, 2, 7]
    texts = [[int(t) for t in rng.randint(3, config.vocab_size, size=n)] for n in lengths]
    batch = [([t], torch.tensor(0)) for t in texts]
    collated = model.smart_batching_collate(batch)
    feats = collated['features']
    assert feats[0]['input_ids'].shape == (len(texts), max(lengths) + 3)

    train_loss = AdvCLSoftmaxLoss(model=model, temperature=0.1, contrastive_loss_rate=0.15,
                                  data_augmentation_strategy_final_1="feature_cutoff", cutoff_rate_final_1=0.2,
                                  data_augmentation_strategy_final_2="shuffle", no_pair=True)
    model.train()
    train_loss.train()
    worst = 0.0
    with torch.no_grad():
        for step, (aug1, rate1, aug2, rate2) in enumerate([("feature_cutoff", 0.2, "shuffle", None),
                                                         ("token_cutoff", 0.3, "shuffle", None),
                                                         ("none", None, "shuffle", None)]):
            train_loss.data_augmentation_strategy_final_1, train_loss.cutoff_rate_final_1 = aug1, rate1
            train_loss.data_augmentation_strategy_final_2, train_loss.cutoff_rate_final_2 = aug2, rate2
            random.seed(100 + step)
            state = random.getstate()
            loss = train_loss([dict(f) for f in feats], collated['labels'])
            v1, v2 = train_loss.last_views

            random.setstate(state)
            r1 = ref_views(bert, texts, aug1, rate1)
            r2 = ref_views(bert, texts, aug2, rate2)
            ref_loss = 0.15 * ref_nt_xent(r1, r2, 0.1)
            e = max((v1 - r1).abs().max().item(), (v2 - r2).abs().max().item())
            el = abs(loss.item() - ref_loss)
            worst = max(worst, e, el)
            print(f"views {aug1}/{aug2}: max |batch - alone| = {e:.2e}, loss {loss.item():.6f} vs ref {ref_loss:.6f}")
            assert e < 1e-9 and el < 1e-9, (e, el)

        # evaluation: model.encode-style batches, each padded to its own longest sentence (no augmentation)
        model.eval()
        order = np.argsort([-len(t) for t in texts])
        enc = {}
        for start in range(0, len(texts), 4):
            idx = order[start:start + 4]
            f = model.smart_batching_collate_text_only([texts[i] for i in idx])
            out = model(f)['sentence_embedding']
            for row, i in enumerate(idx):
                enc[int(i)] = out[row]
        emb = torch.stack([enc[i] for i in range(len(texts))])
        ref = ref_views(bert, texts, "none", None)
        e = (emb - ref).abs().max().item()
        worst = max(worst, e)
        print(f"encode: max |batch - alone| = {e:.2e}")
        assert e < 1e-9, e

    # one optimiser step on the script's views, gradients finite
    model.train()
    random.seed(7)
    train_loss.data_augmentation_strategy_final_1, train_loss.cutoff_rate_final_1 = "feature_cutoff", 0.2
    train_loss.data_augmentation_strategy_final_2, train_loss.cutoff_rate_final_2 = "shuffle", None
    opt = torch.optim.AdamW(model.parameters(), lr=5e-7)
    loss = train_loss([dict(f) for f in feats], collated['labels'])
    opt.zero_grad()
    loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    opt.step()
    print(f"OK (worst error {worst:.2e})")


if __name__ == "__main__":
    main()
