"""DeBERTa masked-LM pre-training step with the Enhanced Mask Decoder (microsoft/DeBERTa), tiny, right-padded.

Citation: microsoft/DeBERTa @4d7fe0bd4fb3c7d4f4005a7cafabde9800372098
  DeBERTa/deberta/ops.py (XSoftmax, MaskedLayerNorm, StableDropout),
  DeBERTa/deberta/da_utils.py (make_log_bucket_dict, make_log_bucket_position, build_relative_position),
  DeBERTa/deberta/disentangled_attention.py (DisentangledSelfAttention, c2p|p2c, share_att_key),
  DeBERTa/deberta/bert.py (BertEmbeddings, BertLayer, ConvLayer, BertEncoder.get_attention_mask,
   get_rel_embedding, BertLMPredictionHead), DeBERTa/deberta/deberta.py (DeBERTa.forward),
  DeBERTa/deberta/config.py (ModelConfig.from_dict),
  DeBERTa/apps/models/masked_language_model.py (EnhancedMaskDecoder.emd_context_layer, MaskedLanguageModel).

The 2-D input mask (1 = token, 0 = pad) is turned into a (B, 1, L, L) byte mask as the product of its
query and key views (get_attention_mask / emd_context_layer), which XSoftmax reads: masked scores
set to -inf, the softmax taken, and masked entries (whole pad-query rows included) set back to 0.
The embeddings and the first layer's convolution are zeroed at pads by MaskedLayerNorm /
masked_fill with the same input mask.  Relative positions are log-bucketed and shared by every row.
The EMD re-runs the last encoder layer twice with query_states = absolute position embeddings +
the second-to-last layer, keys/values the second-to-last layer, under the same 4-D mask.

Check: for two configurations (v2-xlarge-like: buckets, shared keys, conv; v1-like: no buckets,
separate position projections), every encoder layer at real positions, the EMD's MLM logits and
per-label losses, and the parameter gradients of the summed loss, equal (a) each sequence run alone
through the same model without padding and (b) a per-query loop written by hand from the
weights (query i, key j: c2p index clamp(bucket(i - j) + span), p2c read at that same index).
"""
import math
from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import _softmax_backward_data
from torch.nn import LayerNorm

torch.manual_seed(0)


# ---------------------------------------------------------------- config.py
class AbsModelConfig(object):
    def __init__(self):
        pass

    @classmethod
    def from_dict(cls, json_object):
        config = cls()
        for key, value in json_object.items():
            if isinstance(value, dict):
                value = AbsModelConfig.from_dict(value)
            config.__dict__[key] = value
        return config


class ModelConfig(AbsModelConfig):
    def __init__(self):
        self.hidden_size = 768
        self.num_hidden_layers = 12
        self.num_attention_heads = 12
        self.hidden_act = "gelu"
        self.intermediate_size = 3072
        self.hidden_dropout_prob = 0.1
        self.attention_probs_dropout_prob = 0.1
        self.max_position_embeddings = 512
        self.type_vocab_size = 0
        self.initializer_range = 0.02
        self.layer_norm_eps = 1e-7
        self.padding_idx = 0
        self.vocab_size = -1


# ---------------------------------------------------------------- ops.py
class XSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(self, input, mask, dim):
        self.dim = dim
        rmask = ~(mask.bool())
        output = input.masked_fill(rmask, float('-inf'))
        output = torch.softmax(output, self.dim)
        output.masked_fill_(rmask, 0)
        self.save_for_backward(output)
        return output

    @staticmethod
    def backward(self, grad_output):
        output, = self.saved_tensors
        inputGrad = _softmax_backward_data(grad_output, output, self.dim, output.dtype)
        return inputGrad, None, None


class StableDropout(torch.nn.Module):
    def __init__(self, drop_prob):
        super().__init__()
        self.drop_prob = drop_prob

    def forward(self, x):
        if self.training and self.drop_prob > 0:
            return F.dropout(x, self.drop_prob, True)
        return x


def MaskedLayerNorm(layerNorm, input, mask=None):
    output = layerNorm(input).to(input)
    if mask is None:
        return output
    if mask.dim() != input.dim():
        if mask.dim() == 4:
            mask = mask.squeeze(1).squeeze(1)
        mask = mask.unsqueeze(2)
    mask = mask.to(output.dtype)
    return output * mask


ACT2FN = {"gelu": torch.nn.functional.gelu, "tanh": torch.tanh}


# ---------------------------------------------------------------- da_utils.py
@lru_cache(maxsize=128)
def make_log_bucket_dict(bucket_size, max_position, device=None):
    relative_pos = torch.arange(-max_position, max_position, device=device)
    sign = torch.sign(relative_pos)
    mid = bucket_size // 2
    abs_pos = torch.where((relative_pos < mid) & (relative_pos > -mid), torch.tensor(mid - 1).to(relative_pos), torch.abs(relative_pos))
    log_pos = torch.ceil(torch.log(abs_pos / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid
    bucket_pos = torch.where(abs_pos <= mid, relative_pos, (log_pos * sign).to(relative_pos)).to(torch.long)
    return bucket_pos


def make_log_bucket_position(relative_pos, bucket_size, max_position):
    relative_pos = torch.clamp(relative_pos, -max_position + 1, max_position - 1) + max_position
    bucket_dict = make_log_bucket_dict(bucket_size, max_position, relative_pos.device)
    for d in range(relative_pos.dim() - 1):
        bucket_dict = bucket_dict.unsqueeze(0)
        bucket_pos = torch.gather(bucket_dict.expand(list(relative_pos.size())[:-1] + [bucket_dict.size(-1)]), index=relative_pos.long(), dim=-1)
    return bucket_pos


@lru_cache(maxsize=128)
def build_relative_position(query_size, key_size, bucket_size=-1, max_position=-1, device=None):
    q_ids = torch.arange(0, query_size)
    k_ids = torch.arange(0, key_size)
    if device is not None:
        q_ids = q_ids.to(device)
        k_ids = k_ids.to(device)
    rel_pos_ids = q_ids.view(-1, 1) - k_ids.view(1, -1)
    if bucket_size > 0 and max_position > 0:
        rel_pos_ids = make_log_bucket_position(rel_pos_ids, bucket_size, max_position)
    rel_pos_ids = rel_pos_ids[:query_size, :]
    rel_pos_ids = rel_pos_ids.unsqueeze(0)
    return rel_pos_ids


# ---------------------------------------------------------------- disentangled_attention.py
class DisentangledSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        _attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.attention_head_size = getattr(config, 'attention_head_size', _attention_head_size)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.query_proj = nn.Linear(config.hidden_size, self.all_head_size, bias=True)
        self.key_proj = nn.Linear(config.hidden_size, self.all_head_size, bias=True)
        self.value_proj = nn.Linear(config.hidden_size, self.all_head_size, bias=True)

        self.share_att_key = getattr(config, 'share_att_key', False)
        self.pos_att_type = [x.strip() for x in getattr(config, 'pos_att_type', 'c2p').lower().split('|')]
        self.relative_attention = getattr(config, 'relative_attention', False)

        if self.relative_attention:
            self.position_buckets = getattr(config, 'position_buckets', -1)
            self.max_relative_positions = getattr(config, 'max_relative_positions', -1)
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings
            self.pos_ebd_size = self.max_relative_positions
            if self.position_buckets > 0:
                self.pos_ebd_size = self.position_buckets

            self.pos_dropout = StableDropout(config.hidden_dropout_prob)

            if (not self.share_att_key):
                if 'c2p' in self.pos_att_type or 'p2p' in self.pos_att_type:
                    self.pos_key_proj = nn.Linear(config.hidden_size, self.all_head_size, bias=True)
                if 'p2c' in self.pos_att_type or 'p2p' in self.pos_att_type:
                    self.pos_query_proj = nn.Linear(config.hidden_size, self.all_head_size)

        self.dropout = StableDropout(config.attention_probs_dropout_prob)

    def transpose_for_scores(self, x, attention_heads):
        new_x_shape = x.size()[:-1] + (attention_heads, -1)
        x = x.view(*new_x_shape)
        return x.permute(0, 2, 1, 3).contiguous().view(-1, x.size(1), x.size(-1))

    def forward(self, hidden_states, attention_mask, return_att=False, query_states=None, relative_pos=None, rel_embeddings=None):
        if query_states is None:
            query_states = hidden_states
        query_layer = self.transpose_for_scores(self.query_proj(query_states), self.num_attention_heads).float()
        key_layer = self.transpose_for_scores(self.key_proj(hidden_states), self.num_attention_heads).float()
        value_layer = self.transpose_for_scores(self.value_proj(hidden_states), self.num_attention_heads)

        rel_att = None
        scale_factor = 1
        if 'c2p' in self.pos_att_type:
            scale_factor += 1
        if 'p2c' in self.pos_att_type:
            scale_factor += 1
        if 'p2p' in self.pos_att_type:
            scale_factor += 1
        scale = 1 / math.sqrt(query_layer.size(-1) * scale_factor)
        attention_scores = torch.bmm(query_layer, key_layer.transpose(-1, -2) * scale)
        if self.relative_attention:
            rel_embeddings = self.pos_dropout(rel_embeddings)
            rel_att = self.disentangled_attention_bias(query_layer, key_layer, relative_pos, rel_embeddings, scale_factor)

        if rel_att is not None:
            attention_scores = (attention_scores + rel_att)
        attention_scores = (attention_scores - attention_scores.max(dim=-1, keepdim=True).values.detach()).to(hidden_states)
        attention_scores = attention_scores.view(-1, self.num_attention_heads, attention_scores.size(-2), attention_scores.size(-1))

        _attention_probs = XSoftmax.apply(attention_scores, attention_mask, -1)
        attention_probs = self.dropout(_attention_probs)
        context_layer = torch.bmm(attention_probs.view(-1, attention_probs.size(-2), attention_probs.size(-1)), value_layer)
        context_layer = context_layer.view(-1, self.num_attention_heads, context_layer.size(-2), context_layer.size(-1)).permute(0, 2, 1, 3).contiguous()
        new_context_layer_shape = context_layer.size()[:-2] + (-1,)
        context_layer = context_layer.view(*new_context_layer_shape)

        return {
            'hidden_states': context_layer,
            'attention_probs': _attention_probs,
            'attention_logits': attention_scores
        }

    def disentangled_attention_bias(self, query_layer, key_layer, relative_pos, rel_embeddings, scale_factor):
        if relative_pos is None:
            q = query_layer.size(-2)
            relative_pos = build_relative_position(q, key_layer.size(-2), bucket_size=self.position_buckets,
                                                   max_position=self.max_relative_positions, device=query_layer.device)
        if relative_pos.dim() == 2:
            relative_pos = relative_pos.unsqueeze(0).unsqueeze(0)
        elif relative_pos.dim() == 3:
            relative_pos = relative_pos.unsqueeze(1)
        elif relative_pos.dim() != 4:
            raise ValueError(f'Relative postion ids must be of dim 2 or 3 or 4. {relative_pos.dim()}')

        att_span = self.pos_ebd_size
        relative_pos = relative_pos.long().to(query_layer.device)

        rel_embeddings = rel_embeddings[self.pos_ebd_size - att_span:self.pos_ebd_size + att_span, :].unsqueeze(0)
        if self.share_att_key:
            pos_query_layer = self.transpose_for_scores(self.query_proj(rel_embeddings), self.num_attention_heads)\
                .repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)
            pos_key_layer = self.transpose_for_scores(self.key_proj(rel_embeddings), self.num_attention_heads)\
                .repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)
        else:
            if 'c2p' in self.pos_att_type or 'p2p' in self.pos_att_type:
                pos_key_layer = self.transpose_for_scores(self.pos_key_proj(rel_embeddings), self.num_attention_heads)\
                    .repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)
            if 'p2c' in self.pos_att_type or 'p2p' in self.pos_att_type:
                pos_query_layer = self.transpose_for_scores(self.pos_query_proj(rel_embeddings), self.num_attention_heads)\
                    .repeat(query_layer.size(0) // self.num_attention_heads, 1, 1)

        score = 0
        # content->position
        if 'c2p' in self.pos_att_type:
            scale = 1 / math.sqrt(pos_key_layer.size(-1) * scale_factor)
            c2p_att = torch.bmm(query_layer, pos_key_layer.transpose(-1, -2).to(query_layer) * scale)
            c2p_pos = torch.clamp(relative_pos + att_span, 0, att_span * 2 - 1).squeeze(0).expand([query_layer.size(0), query_layer.size(1), relative_pos.size(-1)])
            c2p_att = torch.gather(c2p_att, dim=-1, index=c2p_pos)
            score += c2p_att

        # position->content
        if 'p2c' in self.pos_att_type or 'p2p' in self.pos_att_type:
            scale = 1 / math.sqrt(pos_query_layer.size(-1) * scale_factor)

        if 'p2c' in self.pos_att_type:
            p2c_att = torch.bmm(pos_query_layer.to(key_layer) * scale, key_layer.transpose(-1, -2))
            p2c_att = torch.gather(p2c_att, dim=-2, index=c2p_pos)
            score += p2c_att

        return score


# ---------------------------------------------------------------- bert.py
class BertSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = StableDropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, hidden_states, input_states, mask=None):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states += input_states
        hidden_states = MaskedLayerNorm(self.LayerNorm, hidden_states)
        return hidden_states


class BertAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self = DisentangledSelfAttention(config)
        self.output = BertSelfOutput(config)
        self.config = config

    def forward(self, hidden_states, attention_mask, return_att=False, query_states=None, relative_pos=None, rel_embeddings=None):
        output = self.self(hidden_states, attention_mask, return_att, query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
        self_output, att_matrix, att_logits_ = output['hidden_states'], output['attention_probs'], output['attention_logits']
        if query_states is None:
            query_states = hidden_states
        attention_output = self.output(self_output, query_states, attention_mask)

        if return_att:
            return (attention_output, att_matrix)
        else:
            return attention_output


class BertIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.intermediate_act_fn(hidden_states)
        return hidden_states


class BertOutput(nn.Module):
    def __init__(self, config):
        super(BertOutput, self).__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = StableDropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, hidden_states, input_states, mask=None):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.dropout(hidden_states)
        hidden_states += input_states
        hidden_states = MaskedLayerNorm(self.LayerNorm, hidden_states)
        return hidden_states


class BertLayer(nn.Module):
    def __init__(self, config):
        super(BertLayer, self).__init__()
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, hidden_states, attention_mask, return_att=False, query_states=None, relative_pos=None, rel_embeddings=None):
        attention_output = self.attention(hidden_states, attention_mask, return_att=return_att,
                                          query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
        if return_att:
            attention_output, att_matrix = attention_output
        intermediate_output = self.intermediate(attention_output)
        layer_output = self.output(intermediate_output, attention_output, attention_mask)
        if return_att:
            return (layer_output, att_matrix)
        else:
            return layer_output


class ConvLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        kernel_size = getattr(config, 'conv_kernel_size', 3)
        groups = getattr(config, 'conv_groups', 1)
        self.conv_act = getattr(config, 'conv_act', 'tanh')
        self.conv = torch.nn.Conv1d(config.hidden_size, config.hidden_size, kernel_size, padding=(kernel_size - 1) // 2, groups=groups)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = StableDropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, hidden_states, residual_states, input_mask):
        out = self.conv(hidden_states.permute(0, 2, 1).contiguous()).permute(0, 2, 1).contiguous()
        rmask = (1 - input_mask).bool()
        out.masked_fill_(rmask.unsqueeze(-1).expand(out.size()), 0)
        out = ACT2FN[self.conv_act](self.dropout(out))
        output_states = MaskedLayerNorm(self.LayerNorm, residual_states + out, input_mask)
        return output_states


class BertEncoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(config) for _ in range(config.num_hidden_layers)])
        self.relative_attention = getattr(config, 'relative_attention', False)
        if self.relative_attention:
            self.max_relative_positions = getattr(config, 'max_relative_positions', -1)
            if self.max_relative_positions < 1:
                self.max_relative_positions = config.max_position_embeddings
            self.position_buckets = getattr(config, 'position_buckets', -1)
            pos_ebd_size = self.max_relative_positions * 2
            if self.position_buckets > 0:
                pos_ebd_size = self.position_buckets * 2
            self.rel_embeddings = nn.Embedding(pos_ebd_size, config.hidden_size)

        self.norm_rel_ebd = [x.strip() for x in getattr(config, 'norm_rel_ebd', 'none').lower().split('|')]
        if 'layer_norm' in self.norm_rel_ebd:
            self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps, elementwise_affine=True)
        kernel_size = getattr(config, 'conv_kernel_size', 0)
        self.with_conv = False
        if kernel_size > 0:
            self.with_conv = True
            self.conv = ConvLayer(config)

    def get_rel_embedding(self):
        rel_embeddings = self.rel_embeddings.weight if self.relative_attention else None
        if rel_embeddings is not None and ('layer_norm' in self.norm_rel_ebd):
            rel_embeddings = self.LayerNorm(rel_embeddings)
        return rel_embeddings

    def get_attention_mask(self, attention_mask):
        if attention_mask.dim() <= 2:
            extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            attention_mask = extended_attention_mask * extended_attention_mask.squeeze(-2).unsqueeze(-1)
            attention_mask = attention_mask.byte()
        elif attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)
        return attention_mask

    def get_rel_pos(self, hidden_states, query_states=None, relative_pos=None):
        if self.relative_attention and relative_pos is None:
            q = query_states.size(-2) if query_states is not None else hidden_states.size(-2)
            relative_pos = build_relative_position(q, hidden_states.size(-2), bucket_size=self.position_buckets,
                                                   max_position=self.max_relative_positions, device=hidden_states.device)
        return relative_pos

    def forward(self, hidden_states, attention_mask, output_all_encoded_layers=True, return_att=False, query_states=None, relative_pos=None):
        if attention_mask.dim() <= 2:
            input_mask = attention_mask
        else:
            input_mask = (attention_mask.sum(-2) > 0).byte()
        attention_mask = self.get_attention_mask(attention_mask)
        relative_pos = self.get_rel_pos(hidden_states, query_states, relative_pos)

        all_encoder_layers = []
        next_kv = hidden_states
        rel_embeddings = self.get_rel_embedding()
        for i, layer_module in enumerate(self.layer):
            output_states = layer_module(next_kv, attention_mask, return_att, query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)

            if i == 0 and self.with_conv:
                prenorm = output_states
                output_states = self.conv(hidden_states, prenorm, input_mask)

            if query_states is not None:
                query_states = output_states
            else:
                next_kv = output_states

            if output_all_encoded_layers:
                all_encoder_layers.append(output_states)
        if not output_all_encoded_layers:
            all_encoder_layers.append(output_states)
        return {'hidden_states': all_encoder_layers}


class BertEmbeddings(nn.Module):
    def __init__(self, config):
        super(BertEmbeddings, self).__init__()
        padding_idx = getattr(config, 'padding_idx', 0)
        self.embedding_size = getattr(config, 'embedding_size', config.hidden_size)
        self.word_embeddings = nn.Embedding(config.vocab_size, self.embedding_size, padding_idx=padding_idx)
        self.position_biased_input = getattr(config, 'position_biased_input', True)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, self.embedding_size)
        if config.type_vocab_size > 0:
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, self.embedding_size)
        self.LayerNorm = LayerNorm(config.hidden_size, config.layer_norm_eps)
        self.dropout = StableDropout(config.hidden_dropout_prob)
        self.config = config

    def forward(self, input_ids, token_type_ids=None, position_ids=None, mask=None):
        seq_length = input_ids.size(1)
        if position_ids is None:
            position_ids = torch.arange(0, seq_length, dtype=torch.long, device=input_ids.device)
            position_ids = position_ids.unsqueeze(0).expand_as(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        words_embeddings = self.word_embeddings(input_ids)
        position_embeddings = self.position_embeddings(position_ids.long())

        embeddings = words_embeddings
        if self.config.type_vocab_size > 0:
            token_type_embeddings = self.token_type_embeddings(token_type_ids)
            embeddings += token_type_embeddings

        if self.position_biased_input:
            embeddings += position_embeddings

        embeddings = MaskedLayerNorm(self.LayerNorm, embeddings, mask)
        embeddings = self.dropout(embeddings)
        return {'embeddings': embeddings, 'position_embeddings': position_embeddings}


class BertLMPredictionHead(nn.Module):
    def __init__(self, config, vocab_size):
        super().__init__()
        self.embedding_size = getattr(config, 'embedding_size', config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, self.embedding_size)
        self.transform_act_fn = ACT2FN[config.hidden_act]
        self.LayerNorm = LayerNorm(self.embedding_size, config.layer_norm_eps, elementwise_affine=True)
        self.bias = nn.Parameter(torch.zeros(vocab_size))

    def forward(self, hidden_states, embeding_weight):
        hidden_states = self.dense(hidden_states)
        hidden_states = self.transform_act_fn(hidden_states)
        hidden_states = MaskedLayerNorm(self.LayerNorm, hidden_states)
        logits = torch.matmul(hidden_states, embeding_weight.t().to(hidden_states)) + self.bias
        return logits


# ---------------------------------------------------------------- deberta.py
class DeBERTa(torch.nn.Module):
    def __init__(self, config=None):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.config = config

    def forward(self, input_ids, attention_mask=None, token_type_ids=None, output_all_encoded_layers=True, position_ids=None, return_att=False):
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)

        ebd_output = self.embeddings(input_ids.to(torch.long), token_type_ids.to(torch.long), position_ids, attention_mask)
        embedding_output = ebd_output['embeddings']
        encoder_output = self.encoder(embedding_output, attention_mask,
                                      output_all_encoded_layers=output_all_encoded_layers, return_att=return_att)
        encoder_output.update(ebd_output)
        return encoder_output


# ---------------------------------------------------------------- apps/models/masked_language_model.py
class EnhancedMaskDecoder(torch.nn.Module):
    def __init__(self, config, vocab_size):
        super().__init__()
        self.config = config
        self.position_biased_input = getattr(config, 'position_biased_input', True)
        self.lm_head = BertLMPredictionHead(config, vocab_size)

    def forward(self, ctx_layers, ebd_weight, target_ids, input_ids, input_mask, z_states, attention_mask, encoder, relative_pos=None):
        mlm_ctx_layers = self.emd_context_layer(ctx_layers, z_states, attention_mask, encoder, target_ids, input_ids, input_mask, relative_pos=relative_pos)
        loss_fct = torch.nn.CrossEntropyLoss(reduction='none')
        ctx_layer = mlm_ctx_layers[-1]
        lm_logits = self.lm_head(ctx_layer, ebd_weight).float()
        lm_logits = lm_logits.view(-1, lm_logits.size(-1))
        lm_labels = target_ids.view(-1)
        label_index = (target_ids.view(-1) > 0).nonzero().view(-1)
        lm_labels = lm_labels.index_select(0, label_index)
        lm_loss = loss_fct(lm_logits, lm_labels.long())
        return lm_logits, lm_labels, lm_loss

    def emd_context_layer(self, encoder_layers, z_states, attention_mask, encoder, target_ids, input_ids, input_mask, relative_pos=None):
        if attention_mask.dim() <= 2:
            extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
            att_mask = extended_attention_mask.byte()
            attention_mask = att_mask * att_mask.squeeze(-2).unsqueeze(-1)
        elif attention_mask.dim() == 3:
            attention_mask = attention_mask.unsqueeze(1)
        hidden_states = encoder_layers[-2]
        if not self.position_biased_input:
            layers = [encoder.layer[-1] for _ in range(2)]
            z_states += hidden_states
            query_states = z_states
            query_mask = attention_mask
            outputs = []
            rel_embeddings = encoder.get_rel_embedding()

            for layer in layers:
                output = layer(hidden_states, query_mask, return_att=False, query_states=query_states, relative_pos=relative_pos, rel_embeddings=rel_embeddings)
                query_states = output
                outputs.append(query_states)
        else:
            outputs = [encoder_layers[-1]]

        _mask_index = (target_ids > 0).view(-1).nonzero().view(-1)

        def flatten_states(q_states):
            q_states = q_states.view((-1, q_states.size(-1)))
            q_states = q_states.index_select(0, _mask_index)
            return q_states

        return [flatten_states(q) for q in outputs]


class MaskedLanguageModel(nn.Module):
    def __init__(self, config, *wargs, **kwargs):
        super().__init__()
        self.config = config
        self.deberta = DeBERTa(config)
        self.lm_predictions = EnhancedMaskDecoder(self.deberta.config, self.deberta.embeddings.word_embeddings.weight.size(0))

    def forward(self, input_ids, input_mask=None, labels=None, position_ids=None, attention_mask=None):
        type_ids = None
        lm_labels = labels
        if attention_mask is None:
            attention_mask = input_mask

        encoder_output = self.deberta(input_ids, input_mask, type_ids, output_all_encoded_layers=True, position_ids=position_ids)
        encoder_layers = encoder_output['hidden_states']
        z_states = encoder_output['position_embeddings']
        ebd_weight = self.deberta.embeddings.word_embeddings.weight
        (lm_logits, lm_labels, lm_loss) = self.lm_predictions(encoder_layers, ebd_weight, lm_labels, input_ids, input_mask, z_states, attention_mask, self.deberta.encoder)

        return {
            'logits': lm_logits,
            'labels': lm_labels,
            'loss': lm_loss.float(),
            'hidden_states': encoder_layers,
        }


# ---------------------------------------------------------------- data: right-padded MLM batch
PAD, CLS, SEP, MASK = 0, 1, 2, 3
VOCAB = 48


def make_example(gen, n_words, n_masked):
    words = torch.randint(4, VOCAB, (n_words,), generator=gen).tolist()
    ids = [CLS] + words + [SEP]
    labels = [0] * len(ids)
    picks = torch.randperm(n_words, generator=gen)[:n_masked].tolist()
    for p in picks:
        labels[p + 1] = ids[p + 1]
        ids[p + 1] = MASK
    return ids, labels


def collate(examples):
    L = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), L), PAD, dtype=torch.long)
    input_mask = torch.zeros((len(examples), L), dtype=torch.long)
    labels = torch.zeros((len(examples), L), dtype=torch.long)
    for b, (ids, lab) in enumerate(examples):
        input_ids[b, :len(ids)] = torch.tensor(ids)
        input_mask[b, :len(ids)] = 1
        labels[b, :len(lab)] = torch.tensor(lab)
    return input_ids, input_mask, labels


# ---------------------------------------------------------------- hand-written loop reference
def ref_bucket(r, bucket_size, max_position):
    if bucket_size <= 0:
        return r
    r = max(-max_position + 1, min(max_position - 1, r))
    mid = bucket_size // 2
    if abs(r) <= mid:
        return r
    sign = 1 if r > 0 else -1
    return sign * (math.ceil(math.log(abs(r) / mid) / math.log((max_position - 1) / mid) * (mid - 1)) + mid)


def ref_layer(layer, cfg, q_in, kv, rel, n):
    """One BertLayer over a single unpadded sequence (n, H), every score written per (query, key)."""
    att = layer.attention.self
    Hn = cfg.num_attention_heads
    d = cfg.hidden_size // Hn
    buckets = getattr(cfg, 'position_buckets', -1)
    max_rel = cfg.max_relative_positions if cfg.max_relative_positions > 0 else cfg.max_position_embeddings
    span = buckets if buckets > 0 else max_rel
    Q = att.query_proj(q_in)
    K = att.key_proj(kv)
    V = att.value_proj(kv)
    if att.share_att_key:
        Kr, Qr = att.key_proj(rel), att.query_proj(rel)
    else:
        Kr, Qr = att.pos_key_proj(rel), att.pos_query_proj(rel)
    scale = 1.0 / math.sqrt(d * 3)
    ctx = torch.zeros(n, cfg.hidden_size)
    for h in range(Hn):
        sl = slice(h * d, (h + 1) * d)
        for i in range(n):
            idx = torch.tensor([min(max(ref_bucket(i - j, buckets, max_rel) + span, 0), 2 * span - 1) for j in range(n)])
            scores = (K[:, sl] @ Q[i, sl] + Kr[idx, sl] @ Q[i, sl] + (Qr[idx, sl] * K[:, sl]).sum(-1)) * scale
            p = torch.softmax(scores, dim=0)
            ctx[i, sl] = p @ V[:, sl]
    a = layer.attention.output.LayerNorm(layer.attention.output.dense(ctx) + q_in)
    m = layer.output.LayerNorm(layer.output.dense(F.gelu(layer.intermediate.dense(a))) + a)
    return m


def ref_alone(model, cfg, ids, labels):
    """The whole MLM forward for one sequence, no padding and no mask."""
    ids = torch.tensor(ids)
    n = len(ids)
    emb = model.deberta.embeddings
    enc = model.deberta.encoder
    z = emb.position_embeddings(torch.arange(n))
    x = emb.word_embeddings(ids)
    if cfg.position_biased_input:
        x = x + z
    x = emb.LayerNorm(x)
    rel = enc.rel_embeddings.weight
    if 'layer_norm' in enc.norm_rel_ebd:
        rel = enc.LayerNorm(rel)
    layers = []
    h = x
    for i, layer in enumerate(enc.layer):
        out = ref_layer(layer, cfg, h, h, rel, n)
        if i == 0 and enc.with_conv:
            c = enc.conv
            k = c.conv.kernel_size[0]
            padded = torch.cat([torch.zeros((k - 1) // 2, cfg.hidden_size), x, torch.zeros((k - 1) // 2, cfg.hidden_size)])
            conv = torch.stack([sum(c.conv.weight[:, :, t] @ padded[i2 + t] for t in range(k)) + c.conv.bias for i2 in range(n)])
            out = c.LayerNorm(out + ACT2FN[c.conv_act](conv))
        layers.append(out)
        h = out
    hid = layers[-2]
    q = z + hid
    for _ in range(2):
        q = ref_layer(enc.layer[-1], cfg, q, hid, rel, n)
    pos = [t for t, l in enumerate(labels) if l > 0]
    head = model.lm_predictions.lm_head
    hs = head.LayerNorm(F.gelu(head.dense(q[pos])))
    logits = hs @ emb.word_embeddings.weight.t() + head.bias
    loss = F.cross_entropy(logits, torch.tensor([labels[t] for t in pos]), reduction='none')
    return layers, logits, loss


def close(a, b, what, rtol=1e-5):
    err = ((a - b).abs().max() / b.abs().max().clamp(min=1.0)).item()
    assert err < rtol, f"{what}: max diff {err:.3e} (relative to the largest entry)"
    return err


def run(name, cfg_dict, lengths, n_masked):
    cfg = ModelConfig.from_dict(cfg_dict)
    model = MaskedLanguageModel(cfg).eval()
    gen = torch.Generator().manual_seed(7)
    examples = [make_example(gen, n, m) for n, m in zip(lengths, n_masked)]
    input_ids, input_mask, labels = collate(examples)

    # Batched, right-padded
    model.zero_grad()
    out = model(input_ids, input_mask=input_mask, labels=labels)
    out['loss'].sum().backward()
    g_batch = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    # Each example alone, same model, no padding
    model.zero_grad()
    alone = []
    for ids, lab in examples:
        o = model(torch.tensor([ids]), input_mask=torch.ones(1, len(ids), dtype=torch.long), labels=torch.tensor([lab]))
        o['loss'].sum().backward()
        alone.append(o)
    g_alone = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    errs = []
    with torch.no_grad():
        for b, (ids, lab) in enumerate(examples):
            n = len(ids)
            r_layers, r_logits, r_loss = ref_alone(model, cfg, ids, lab)
            for li in range(cfg.num_hidden_layers):
                errs.append(close(out['hidden_states'][li][b, :n], alone[b]['hidden_states'][li][0], f"{name} row {b} layer {li} batched vs alone"))
                errs.append(close(alone[b]['hidden_states'][li][0], r_layers[li], f"{name} row {b} layer {li} alone vs loop"))
            errs.append(close(alone[b]['logits'], r_logits, f"{name} row {b} EMD logits alone vs loop"))
            errs.append(close(alone[b]['loss'], r_loss, f"{name} row {b} EMD loss alone vs loop"))
        errs.append(close(out['logits'], torch.cat([o['logits'] for o in alone]), f"{name} EMD logits batched vs alone"))
        errs.append(close(out['loss'], torch.cat([o['loss'] for o in alone]), f"{name} EMD losses batched vs alone"))
        assert torch.equal(out['labels'], torch.cat([o['labels'] for o in alone]))
        assert g_batch.keys() == g_alone.keys() and len(g_batch) > 0
        for k in g_batch:
            errs.append(close(g_batch[k], g_alone[k], f"{name} grad {k} batched vs alone", rtol=1e-4))
    # the bucket table the port builds is the hand-written one
    if cfg.position_buckets > 0:
        L = input_ids.size(1)
        rp = build_relative_position(L, L, bucket_size=cfg.position_buckets, max_position=cfg.max_position_embeddings)[0]
        ref = torch.tensor([[ref_bucket(i - j, cfg.position_buckets, cfg.max_position_embeddings) for j in range(L)] for i in range(L)])
        assert torch.equal(rp, ref) and rp.abs().max() > cfg.position_buckets // 2
    print(f"{name}: batch {tuple(input_ids.shape)}, lengths {[len(e[0]) for e in examples]}, "
          f"{int((labels > 0).sum())} masked tokens, loss {out['loss'].mean().item():.4f}, max rel diff {max(errs):.2e}")


BASE = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
            hidden_act="gelu", hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, max_position_embeddings=32,
            type_vocab_size=0, layer_norm_eps=1e-7, padding_idx=PAD, relative_attention=True, max_relative_positions=-1,
            pos_att_type="p2c|c2p", position_biased_input=False)

if __name__ == "__main__":
    # deberta-v2-xlarge-like: log buckets, shared attention keys, LayerNorm'd rel embeddings, conv after layer 0
    run("v2-conv-buckets", dict(BASE, position_buckets=8, norm_rel_ebd="layer_norm", share_att_key=True,
                                 conv_kernel_size=3, conv_act="gelu"), lengths=[12, 5, 9], n_masked=[3, 1, 2])
    # v1-like relative attention: no buckets, separate pos_key_proj / pos_query_proj, no conv
    run("v1-separate-proj", dict(BASE, position_buckets=-1, norm_rel_ebd="none", share_att_key=False,
                                  conv_kernel_size=0, conv_act="tanh"), lengths=[4, 10, 7, 2], n_masked=[1, 3, 2, 1])
    print("OK")
