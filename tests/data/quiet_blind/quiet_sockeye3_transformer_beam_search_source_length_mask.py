"""Sockeye 3 transformer NMT, shrunk: right-padded sources, teacher-forced scoring and beam search.

Ported from awslabs/sockeye @871d9863d6a657d87de1c90f44977c5b70c99c7e (sockeye 3.1.39, PyTorch):
  sockeye/layers.py       interleaved_matmul_encdec_qk / _valatt, DotAttentionCell (masked_fill with
                          -LARGE_VALUES, True = padding), prepare_source_length_mask (lengths of shape
                          (batch, 2): total and prepended), MultiHeadSelfAttention, MultiHeadAttention
                          (fused F.multi_head_attention_forward in training, interleaved k/v at
                          inference, train() switching the layout), PositionalEmbeddings (steps)
  sockeye/transformer.py  TransformerEncoderBlock, TransformerDecoderBlock, TransformerProcessBlock,
                          AutoRegressiveMask
  sockeye/encoder.py      TransformerEncoder.forward (att_mask (batch * heads, max_len, max_len))
  sockeye/decoder.py      TransformerDecoder.state_structure / init_state_from_encoder / forward
                          (source_mask kept as a 'm' state (batch, heads, 1, src_len); inference
                          uses no target mask, the self-attention cache only holds past steps)
  sockeye/beam_search.py  UpdateScores, LengthPenalty, CandidateScorer, SortNormalizeAndUpdateFinished,
                          TopK, RepeatStates (repeat_interleave: 'm' and 's' on axis 0, 'e'/'d' on axis 1),
                          SortStates ('e' and 'm' left as they are), BeamSearch.forward
  sockeye/inference.py    _get_best_word_indices_for_kth_hypotheses (backtrace)
Lexicon, NVS, kNN, target factors, prefixes and sampling are left out. Weights are random (tiny config).
Reference: each sentence scored and translated alone (batch of one, no padding).
"""
import functools
import operator
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import torch as pt
import torch.nn.functional as F

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
STEP_STATE, MASK_STATE, ENCODER_STATE, DECODER_STATE = 's', 'm', 'e', 'd'
LARGE_VALUES = {pt.float32: np.finfo(np.float32).max, pt.float16: np.finfo(np.float16).max}


@dataclass
class TransformerConfig:
    model_size: int = 16
    attention_heads: int = 4
    feed_forward_num_hidden: int = 32
    num_layers: int = 2
    dropout_attention: float = 0.0
    dropout_act: float = 0.0
    dropout_prepost: float = 0.0
    preprocess_sequence: str = 'n'
    postprocess_sequence: str = 'r'
    max_seq_len_source: int = 32
    max_seq_len_target: int = 32
    block_prepended_cross_attention: bool = False

    @property
    def depth_key_value(self) -> int:
        return self.model_size


# ---------------------------------------------------------------- sockeye/layers.py

def interleaved_matmul_encdec_qk(q: pt.Tensor, kv: pt.Tensor, heads: int) -> pt.Tensor:
    qlen, batch, hidden = q.size()
    head_dim = hidden // heads
    q = q.contiguous().view(qlen, batch * heads, head_dim).transpose(0, 1)
    q = q * head_dim ** -0.5
    tmp = kv.reshape(-1, batch, heads, 2, head_dim)
    k = tmp[:, :, :, 0, :]
    k = k.permute(1, 2, 3, 0)
    k = k.reshape(batch * heads, head_dim, -1)
    return pt.bmm(q, k)  # (batch * heads, qlen, klen)


def interleaved_matmul_encdec_valatt(kv: pt.Tensor, att: pt.Tensor, heads: int) -> pt.Tensor:
    kvlen, batch, hidden2 = kv.size()
    hidden = hidden2 // 2
    head_dim = hidden // heads
    tmp = kv.reshape(kvlen, batch, heads, 2, -1)
    v = tmp[:, :, :, 1, :]
    v = v.permute(1, 2, 0, 3)
    v = v.reshape(-1, kvlen, head_dim)
    output = pt.bmm(att, v)
    output = output.transpose(0, 1).contiguous().view(-1, batch, hidden)
    return output


class DotAttentionCell(pt.nn.Module):

    def __init__(self, dropout: float = 0.0, heads: int = 1) -> None:
        super().__init__()
        self.dropout = pt.nn.Dropout(p=dropout)
        self.heads = heads

    def forward(self, queries, key_values, mask: Optional[pt.Tensor] = None):
        # (batch * heads, qlen, klen)
        logits = interleaved_matmul_encdec_qk(queries, key_values, heads=self.heads)
        if mask is not None:
            logits = logits.masked_fill(mask, -LARGE_VALUES[logits.dtype])
        probs = F.softmax(logits, dim=-1)
        probs = self.dropout(probs)
        return interleaved_matmul_encdec_valatt(key_values, probs, heads=self.heads)


def prepare_source_length_mask(lengths: pt.Tensor, heads: int, max_length: int, expand: bool = True,
                               mask_prepended_tokens: bool = False) -> pt.Tensor:
    # (batch_size, max_len)
    mask = ~(pt.arange(max_length, device=lengths.device).unsqueeze(0) < lengths[:, :1])
    if mask_prepended_tokens:
        prepended_token_mask = pt.arange(max_length, device=lengths.device).unsqueeze(0) < lengths[:, 1:2]
        mask |= prepended_token_mask
    if expand:
        # (batch_size * heads, 1, max_len)
        mask = mask.unsqueeze(1).expand(-1, heads, -1).reshape((-1, max_length)).unsqueeze(1)
    return mask


class MultiHeadAttentionBase(pt.nn.Module):

    def __init__(self, depth_att=512, heads=8, depth_out=512, dropout=0.0) -> None:
        super().__init__()
        assert depth_att % heads == 0
        self.depth = depth_att
        self.heads = heads
        self.depth_out = depth_out
        self.depth_per_head = self.depth // self.heads
        self.dot_att = DotAttentionCell(dropout=dropout, heads=heads)
        self.ff_out = pt.nn.Linear(in_features=depth_att, out_features=depth_out, bias=False)

    def _attend(self, queries, key_values, mask=None):
        contexts = self.dot_att(queries=queries, key_values=key_values, mask=mask)
        return self.ff_out(contexts)


class MultiHeadSelfAttention(MultiHeadAttentionBase):

    def __init__(self, depth_att=512, heads=8, depth_out=512, dropout=0.0) -> None:
        super().__init__(depth_att, heads, depth_out, dropout)
        self.depth_att = depth_att
        self.ff_in = pt.nn.Linear(in_features=depth_att, out_features=depth_att * 3, bias=False)
        self._drop_p = dropout
        self.kv_interleaved = False

    def separate_kv(self):
        assert self.kv_interleaved
        with pt.no_grad():
            kv = self.ff_in.weight.data[self.depth:, :]
            k, v = kv.view(self.heads, 2 * self.depth_per_head, self.depth).split(self.depth_per_head, dim=1)
            k = k.reshape(self.depth, self.depth)
            v = v.reshape(self.depth, self.depth)
        self.ff_in.weight.data[self.depth:, :] = pt.cat((k, v), dim=0)
        self.kv_interleaved = False

    def interleave_kv(self):
        assert not self.kv_interleaved
        with pt.no_grad():
            _, k, v = self.ff_in.weight.data.split(self.depth, dim=0)
            k = k.reshape(self.heads, -1, self.depth)
            v = v.reshape(self.heads, -1, self.depth)
        self.ff_in.weight.data[self.depth:, :] = pt.cat((k, v), dim=1).reshape(self.depth * 2, self.depth)
        self.kv_interleaved = True

    def train(self, mode: bool = True):
        if mode and self.kv_interleaved:
            self.separate_kv()
        elif not mode and not self.kv_interleaved:
            self.interleave_kv()
        return super().train(mode)

    @property
    def num_state_tensors(self) -> int:
        return 1

    @property
    def needs_mask(self) -> bool:
        return True

    def get_state_shape(self, batch_size: int) -> Tuple:
        # shape: (length, batch, key_depth + value_depth)
        return 0, batch_size, self.depth_out * 2

    def forward(self, inputs, previous_states=None, mask=None, **args):
        if self.training:  # fused multi-head attention op during training
            assert not self.kv_interleaved
            contexts, _ = F.multi_head_attention_forward(query=inputs, key=inputs, value=inputs,
                                                         embed_dim_to_check=self.depth, num_heads=self.heads,
                                                         in_proj_weight=self.ff_in.weight,
                                                         in_proj_bias=None,
                                                         bias_k=None, bias_v=None, add_zero_attn=False,
                                                         dropout_p=self._drop_p,
                                                         out_proj_weight=self.ff_out.weight,
                                                         out_proj_bias=self.ff_out.bias,
                                                         training=self.training,
                                                         key_padding_mask=None,
                                                         need_weights=False,
                                                         attn_mask=mask,
                                                         use_separate_proj_weight=False,
                                                         q_proj_weight=None,
                                                         k_proj_weight=None,
                                                         v_proj_weight=None)
            return contexts, contexts  # dummy return
        else:  # inference: interleaved key-value parameters
            proj = self.ff_in(inputs)
            queries, states = proj.split((self.depth_att, 2 * self.depth_att), dim=2)
            if previous_states is not None:
                states = pt.cat((previous_states, states), dim=0)
            return self._attend(queries=queries, key_values=states, mask=mask), states


class MultiHeadAttention(MultiHeadAttentionBase):

    def __init__(self, depth_att=512, heads=8, depth_out=512, dropout=0.0, depth_key_value=512) -> None:
        super().__init__(depth_att, heads, depth_out, dropout)
        self.ff_q = pt.nn.Linear(in_features=depth_out, out_features=depth_att, bias=False)
        self.ff_kv = pt.nn.Linear(in_features=depth_key_value, out_features=depth_att * 2, bias=False)
        self._drop_p = dropout
        self._depth_key_value = depth_key_value
        self.kv_interleaved = False

    def separate_kv(self):
        assert self.kv_interleaved
        with pt.no_grad():
            k, v = self.ff_kv.weight.data.view(self.heads, 2 * self.depth_per_head, self._depth_key_value).split(
                self.depth_per_head, dim=1)
            k = k.reshape(self.depth, self._depth_key_value)
            v = v.reshape(self.depth, self._depth_key_value)
        self.ff_kv.weight.data[:] = pt.cat((k, v), dim=0)
        self.kv_interleaved = False

    def interleave_kv(self):
        assert not self.kv_interleaved
        with pt.no_grad():
            k, v = self.ff_kv.weight.data.split(self.depth, dim=0)
            k = k.reshape(self.heads, -1, self.depth)
            v = v.reshape(self.heads, -1, self.depth)
        self.ff_kv.weight.data[:] = pt.cat((k, v), dim=1).reshape(self.depth * 2, self._depth_key_value)
        self.kv_interleaved = True

    def train(self, mode: bool = True):
        if mode and self.kv_interleaved:
            self.separate_kv()
        elif not mode and not self.kv_interleaved:
            self.interleave_kv()
        return super().train(mode)

    def forward(self, queries, key_values, mask=None, projected_memory_kv=None):
        if self.training:
            assert not self.kv_interleaved
            assert projected_memory_kv is None, "caching not supported in training"
            contexts, _ = F.multi_head_attention_forward(query=queries, key=key_values, value=key_values,
                                                         embed_dim_to_check=self.depth, num_heads=self.heads,
                                                         in_proj_weight=None,
                                                         in_proj_bias=None,
                                                         bias_k=None, bias_v=None, add_zero_attn=False,
                                                         dropout_p=self._drop_p,
                                                         out_proj_weight=self.ff_out.weight,
                                                         out_proj_bias=self.ff_out.bias,
                                                         training=self.training,
                                                         key_padding_mask=None,
                                                         need_weights=False,
                                                         attn_mask=mask,
                                                         use_separate_proj_weight=True,
                                                         q_proj_weight=self.ff_q.weight,
                                                         k_proj_weight=self.ff_kv.weight[:self.depth, :],
                                                         v_proj_weight=self.ff_kv.weight[self.depth:, :])
            return contexts
        else:
            queries = self.ff_q(queries)
            key_values = projected_memory_kv if projected_memory_kv is not None else self.ff_kv(key_values)
            return self._attend(queries=queries, key_values=key_values, mask=mask)


def get_positional_embeddings(length: int, depth: int) -> pt.Tensor:
    channels = pt.arange(depth // 2).unsqueeze(0)
    positions = pt.arange(0, length).unsqueeze(1)
    scaled_positions = positions / pt.pow(10000, (2 * channels) / depth)
    return pt.hstack([pt.sin(scaled_positions), pt.cos(scaled_positions)])


class PositionalEmbeddings(pt.nn.Module):

    def __init__(self, num_embed: int, max_seq_len: int, scale_up_input: bool = True) -> None:
        super().__init__()
        self.num_embed = num_embed
        self.max_seq_len = max_seq_len
        self.scale_up_input = scale_up_input
        self.weight = pt.nn.Parameter(get_positional_embeddings(max_seq_len, num_embed), requires_grad=False)

    def forward(self, data: pt.Tensor, steps: Optional[pt.Tensor] = None) -> pt.Tensor:
        if steps is None:
            pos_embedding = self.weight.unsqueeze(0)[:, :data.size()[1]]
        else:
            steps = pt.clip(steps, max=self.max_seq_len - 1)
            pos_embedding = F.embedding(steps, self.weight)
        pos_embedding = pos_embedding.detach()
        if self.scale_up_input:
            data = data * (self.num_embed ** 0.5)
        return data + pos_embedding


# ---------------------------------------------------------------- sockeye/transformer.py

class TransformerProcessBlock(pt.nn.Module):

    def __init__(self, sequence: str, dropout: float, num_hidden: int = 0) -> None:
        super().__init__()
        self.sequence = sequence
        self.dropout = dropout
        self.layer_norm = pt.nn.LayerNorm(num_hidden, eps=1e-06) if 'n' in sequence else None

    def forward(self, data: pt.Tensor, prev: Optional[pt.Tensor] = None) -> pt.Tensor:
        if not self.sequence:
            return data
        for step in self.sequence:
            if step == "r":
                data = data + prev
            elif step == "n":
                data = self.layer_norm(data)
            elif step == "d":
                data = F.dropout(data, p=self.dropout, training=self.training)
        return data


class TransformerFeedForward(pt.nn.Module):

    def __init__(self, num_hidden: int, num_model: int) -> None:
        super().__init__()
        self.ff1 = pt.nn.Linear(in_features=num_model, out_features=num_hidden)
        self.ff2 = pt.nn.Linear(in_features=num_hidden, out_features=num_model)

    def forward(self, x):
        return self.ff2(F.relu(self.ff1(x)))


class AutoRegressiveMask(pt.nn.Module):

    def forward(self, x: pt.Tensor) -> pt.Tensor:
        mask = pt.full((x.shape[1], x.shape[1]), fill_value=1, device=x.device, dtype=pt.bool)
        mask = pt.triu(mask, diagonal=1)
        return mask.detach()  # Shape: (len, len)


class TransformerEncoderBlock(pt.nn.Module):

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.pre_self_attention = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost,
                                                          config.model_size)
        self.self_attention = MultiHeadSelfAttention(depth_att=config.model_size, heads=config.attention_heads,
                                                     depth_out=config.model_size, dropout=config.dropout_attention)
        self.post_self_attention = TransformerProcessBlock(config.postprocess_sequence, config.dropout_prepost,
                                                           config.model_size)
        self.pre_ff = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost, config.model_size)
        self.ff = TransformerFeedForward(config.feed_forward_num_hidden, config.model_size)
        self.post_ff = TransformerProcessBlock(config.postprocess_sequence, config.dropout_prepost, config.model_size)

    def forward(self, data: pt.Tensor, att_mask: pt.Tensor = None) -> pt.Tensor:
        data_self_att, _ = self.self_attention(inputs=self.pre_self_attention(data), previous_states=None,
                                               mask=att_mask, bias=None)
        data = self.post_self_attention(data_self_att, data)
        data_ff = self.ff(self.pre_ff(data))
        return self.post_ff(data_ff, data)


class TransformerDecoderBlock(pt.nn.Module):

    def __init__(self, config: TransformerConfig, inference_only: bool) -> None:
        super().__init__()
        self.inference_only = inference_only
        self.autoregr_layer = MultiHeadSelfAttention(depth_att=config.model_size, heads=config.attention_heads,
                                                     depth_out=config.model_size, dropout=config.dropout_attention)
        self.pre_autoregr_layer = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost,
                                                          config.model_size)
        self.post_autoregr_layer = TransformerProcessBlock(config.postprocess_sequence, config.dropout_prepost,
                                                           config.model_size)
        self.pre_enc_attention = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost,
                                                         config.model_size)
        self.enc_attention = MultiHeadAttention(depth_att=config.model_size, heads=config.attention_heads,
                                                depth_out=config.model_size, dropout=config.dropout_attention,
                                                depth_key_value=config.depth_key_value)
        self.post_enc_attention = TransformerProcessBlock(config.postprocess_sequence, config.dropout_prepost,
                                                          config.model_size)
        self.pre_ff = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost, config.model_size)
        self.ff = TransformerFeedForward(config.feed_forward_num_hidden, config.model_size)
        self.post_ff = TransformerProcessBlock(config.postprocess_sequence, config.dropout_prepost, config.model_size)

    @property
    def num_state_tensors(self) -> int:
        return self.autoregr_layer.num_state_tensors

    @property
    def needs_mask(self):
        return self.autoregr_layer.needs_mask

    def get_states_shape(self, batch_size: int) -> Tuple:
        return self.autoregr_layer.get_state_shape(batch_size)

    def forward(self, target, target_mask, source, source_mask, autoregr_states, enc_att_kv=None):
        target_autoregr, *new_autoregr_states = self.autoregr_layer(inputs=self.pre_autoregr_layer(target),
                                                                    previous_states=autoregr_states,
                                                                    mask=target_mask)
        target = self.post_autoregr_layer(target_autoregr, target)
        target_enc_att = self.enc_attention(queries=self.pre_enc_attention(target),
                                            key_values=source,
                                            mask=source_mask,
                                            projected_memory_kv=enc_att_kv)
        target = self.post_enc_attention(target_enc_att, target)
        target_ff = self.ff(self.pre_ff(target))
        target = self.post_ff(target_ff, target)
        return target, new_autoregr_states


# ---------------------------------------------------------------- sockeye/encoder.py, sockeye/decoder.py

class TransformerEncoder(pt.nn.Module):

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.config = config
        self.dropout = pt.nn.Dropout(p=config.dropout_prepost)
        self.pos_embedding = PositionalEmbeddings(config.model_size, config.max_seq_len_source)
        self.layers = pt.nn.ModuleList(TransformerEncoderBlock(config) for _ in range(config.num_layers))
        self.final_process = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost,
                                                     config.model_size)

    def forward(self, data: pt.Tensor, valid_length: pt.Tensor):
        data = self.pos_embedding(data)
        data = self.dropout(data)
        _, max_len, __ = data.size()
        # Shape: (batch_size, max_len)
        single_head_att_mask = prepare_source_length_mask(valid_length, self.config.attention_heads,
                                                          max_length=max_len, expand=False)
        # Shape: (batch_size, max_len) -> (batch_size * heads, 1, max_len)
        att_mask = single_head_att_mask.unsqueeze(1).expand(-1, self.config.attention_heads, -1) \
            .reshape((-1, max_len)).unsqueeze(1)
        att_mask = att_mask.expand(-1, max_len, -1)

        data = data.transpose(1, 0)  # batch to time major
        for layer in self.layers:
            data = layer(data, att_mask=att_mask)
        data = self.final_process(data)
        data = data.transpose(1, 0)  # time to batch major
        return data, valid_length, single_head_att_mask


class TransformerDecoder(pt.nn.Module):

    def __init__(self, config: TransformerConfig, inference_only: bool = False) -> None:
        super().__init__()
        self.config = config
        self.pos_embedding = PositionalEmbeddings(config.model_size, config.max_seq_len_target)
        self.autoregressive_mask = AutoRegressiveMask()
        self.layers = pt.nn.ModuleList(TransformerDecoderBlock(config, inference_only)
                                       for _ in range(config.num_layers))
        self.final_process = TransformerProcessBlock(config.preprocess_sequence, config.dropout_prepost,
                                                     config.model_size)
        self.dropout = pt.nn.Dropout(p=config.dropout_prepost)
        self.inference_only = inference_only

    def state_structure(self) -> str:
        structure = ''
        if self.inference_only:
            structure += STEP_STATE + MASK_STATE + ENCODER_STATE * self.config.num_layers
        else:
            structure += STEP_STATE + ENCODER_STATE + MASK_STATE
        total_num_states = sum(layer.num_state_tensors for layer in self.layers)
        structure += DECODER_STATE * total_num_states
        return structure

    def init_state_from_encoder(self, encoder_outputs, encoder_valid_length=None, target_embed=None):
        source_max_len = encoder_outputs.size()[1]
        # (batch * heads, 1, source_max_len)
        source_mask = prepare_source_length_mask(encoder_valid_length, self.config.attention_heads,
                                                 source_max_len,
                                                 mask_prepended_tokens=self.config.block_prepended_cross_attention)
        if target_embed is None:  # Inference: initial step = 0. Shape: (batch_size, 1)
            steps = pt.zeros_like(encoder_valid_length[:, :1])
            # Shape: (batch, heads, 1, src_max_len)
            source_mask = source_mask.view(-1, self.config.attention_heads, 1, source_max_len)
        else:  # Training: steps up to target length. Shape: (1, target_length)
            target_length = target_embed.size()[1]
            steps = pt.arange(0, target_length, device=target_embed.device).unsqueeze(0)
            source_mask = source_mask.expand(-1, target_length, -1)
            # Shape: (batch, heads, trg_max_len, src_max_len)
            source_mask = source_mask.view(-1, self.config.attention_heads, target_length, source_max_len)

        if self.inference_only:
            states = [steps, source_mask]
            encoder_outputs_t = encoder_outputs.transpose(1, 0)  # time-major layout
            for layer in self.layers:
                states.append(layer.enc_attention.ff_kv(encoder_outputs_t))
        else:
            states = [steps, encoder_outputs.transpose(1, 0), source_mask]

        _batch_size = encoder_outputs.size()[0]
        dummy_autoregr_states = [pt.zeros(layer.get_states_shape(_batch_size), dtype=encoder_outputs.dtype)
                                 for layer in self.layers
                                 for _ in range(layer.num_state_tensors)]
        return states + dummy_autoregr_states

    def forward(self, step_input: pt.Tensor, states: List[pt.Tensor]):
        target_mask = None
        if self.inference_only:
            steps, source_mask, *other = states
            source_encoded = None  # constant pre-computed key value projections from the states
            enc_att_kv = other[:self.config.num_layers]
            autoregr_states = other[self.config.num_layers:]
        else:
            if any(layer.needs_mask for layer in self.layers):
                target_mask = self.autoregressive_mask(step_input)  # mask: (length, length)
            steps, source_encoded, source_mask, *autoregr_states = states
            enc_att_kv = [None for _ in range(self.config.num_layers)]

        batch, heads, target_max_len, source_max_len = source_mask.size()
        source_mask_view = source_mask.reshape(batch * heads, target_max_len, source_max_len)

        target = self.pos_embedding(step_input, steps)
        target = target.transpose(1, 0)  # (length, batch_size, model_size)
        target = self.dropout(target)

        new_autoregr_states = []
        for layer, layer_autoregr_state, layer_enc_att_kv in zip(self.layers, autoregr_states, enc_att_kv):
            target, new_layer_autoregr_state = layer(target=target,
                                                     target_mask=target_mask,
                                                     source=source_encoded,
                                                     source_mask=source_mask_view,
                                                     autoregr_states=layer_autoregr_state,
                                                     enc_att_kv=layer_enc_att_kv)
            new_autoregr_states += [*new_layer_autoregr_state]

        target = self.final_process(target)
        target = target.transpose(1, 0)

        steps = steps + 1  # inference: increment steps (discarded in training)
        if self.inference_only:
            encoder_attention_keys_values = states[2:2 + self.config.num_layers]
            new_states = [steps, states[1]] + encoder_attention_keys_values + new_autoregr_states
        else:
            new_states = [steps, states[1], states[2]] + new_autoregr_states
        return target, new_states


# ---------------------------------------------------------------- sockeye/model.py

class SockeyeModel(pt.nn.Module):

    def __init__(self, config: TransformerConfig, vocab_source: int, vocab_target: int,
                 inference_only: bool = False) -> None:
        super().__init__()
        self.config = config
        self.embedding_source = pt.nn.Embedding(vocab_source, config.model_size)
        self.embedding_target = pt.nn.Embedding(vocab_target, config.model_size)
        self.encoder = TransformerEncoder(config)
        self.decoder = TransformerDecoder(config, inference_only=inference_only)
        self.output_layer = pt.nn.Linear(config.model_size, vocab_target)

    def state_structure(self):
        return self.decoder.state_structure()

    def encode(self, inputs: pt.Tensor, valid_length: pt.Tensor):
        source_embed = self.embedding_source(inputs)
        return self.encoder(source_embed, valid_length)

    def encode_and_initialize(self, inputs: pt.Tensor, valid_length: pt.Tensor):
        source_encoded, source_encoded_lengths, att_mask = self.encode(inputs, valid_length=valid_length)
        states = self.decoder.init_state_from_encoder(source_encoded, source_encoded_lengths)
        return states

    def decode_step(self, step_input: pt.Tensor, states: List[pt.Tensor]):
        # step_input: (batch*beam, num_target_factors) -> (batch*beam, 1, model_size)
        target_embed = self.embedding_target(step_input[:, :1].long())
        decoder_out, new_states = self.decoder(target_embed, states)
        logits = self.output_layer(decoder_out.squeeze(1))
        return logits, new_states

    def forward(self, source, source_length, target, target_length):
        source_encoded, source_encoded_length, _ = self.encode(source, source_length)
        target_embed = self.embedding_target(target)
        states = self.decoder.init_state_from_encoder(source_encoded, source_encoded_length, target_embed)
        target, _ = self.decoder(target_embed, states)
        return self.output_layer(target)


# ---------------------------------------------------------------- sockeye/beam_search.py

class UpdateScores(pt.nn.Module):

    def forward(self, target_dists, finished, scores_accumulated, lengths, max_lengths, pad_dist, eos_dist):
        scores = target_dists + scores_accumulated
        pad_dist = scores_accumulated + pad_dist
        scores = pt.where(finished.unsqueeze(1), pad_dist, scores)
        lengths = lengths + ~finished
        below_max_length = lengths < max_lengths
        scores = pt.where(pt.logical_or(below_max_length, finished).unsqueeze(1), scores, eos_dist + scores)
        return scores, lengths


class LengthPenalty(pt.nn.Module):

    def __init__(self, alpha: float = 1.0, beta: float = 0.0) -> None:
        super().__init__()
        self.alpha = alpha
        self.beta = beta
        self.denominator = (self.beta + 1.) ** self.alpha

    def forward(self, lengths):
        numerator = self.beta + lengths if self.beta != 0.0 else lengths
        numerator = numerator ** self.alpha if self.alpha != 1.0 else numerator
        return numerator / self.denominator


class CandidateScorer(pt.nn.Module):

    def __init__(self, length_penalty_alpha: float = 1.0, length_penalty_beta: float = 0.0) -> None:
        super().__init__()
        self._lp = LengthPenalty(alpha=length_penalty_alpha, beta=length_penalty_beta)

    def forward(self, scores, lengths, reference_lengths):
        lp = self._lp(lengths).to(scores.dtype)
        return (scores.squeeze(1) / lp).unsqueeze(1)


class SortNormalizeAndUpdateFinished(pt.nn.Module):

    def __init__(self, pad_id: int, eos_id: int, scorer: CandidateScorer) -> None:
        super().__init__()
        self.pad_id = pad_id
        self.eos_id = eos_id
        self._scorer = scorer

    def forward(self, best_hyp_indices, best_word_indices, finished, scores_accumulated, lengths,
                reference_lengths):
        finished = finished.index_select(0, best_hyp_indices)
        lengths = lengths.index_select(0, best_hyp_indices)
        reference_lengths = reference_lengths.index_select(0, best_hyp_indices)

        all_finished = pt.logical_or(best_word_indices == self.pad_id, best_word_indices == self.eos_id)
        newly_finished = pt.logical_xor(all_finished, finished).unsqueeze(1)
        scores_accumulated = pt.where(newly_finished,
                                      self._scorer(scores_accumulated, lengths, reference_lengths),
                                      scores_accumulated)
        finished = pt.logical_or(best_word_indices == self.pad_id, best_word_indices == self.eos_id)
        best_word_indices = best_word_indices.unsqueeze(1)
        return best_word_indices, finished, scores_accumulated, lengths, reference_lengths


class TopK(pt.nn.Module):

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, scores):
        batch_times_beam, vocab_size = scores.size()
        batch_size = batch_times_beam // self.k
        scores = scores.view(batch_size, self.k * vocab_size)
        values, indices = pt.topk(scores, k=self.k, dim=1, largest=False, sorted=True)
        values, indices = values.view(-1, 1), indices.view(-1)
        best_hyp_indices = indices.div(vocab_size, rounding_mode='floor')
        best_word_indices = indices.fmod(vocab_size)
        return best_hyp_indices, best_word_indices, values


class RepeatStates(pt.nn.Module):

    def __init__(self, beam_size: int, state_structure: List):
        super().__init__()
        self.beam_size = beam_size
        self.flat_structure = functools.reduce(operator.add, state_structure)

    def forward(self, *states):
        repeated_states = []
        assert len(states) == len(self.flat_structure)
        for state, state_format in zip(states, self.flat_structure):
            if state_format == STEP_STATE or state_format == MASK_STATE:
                repeat_axis = 0  # steps and source mask: batch on axis 0
            elif state_format == DECODER_STATE or state_format == ENCODER_STATE:
                repeat_axis = 1  # time-major layer states: batch on axis 1
            else:
                raise ValueError("Provided state format %s not recognized." % state_format)
            repeated_states.append(state.repeat_interleave(repeats=self.beam_size, dim=repeat_axis))
        return repeated_states


class SortStates(pt.nn.Module):

    def __init__(self, state_structure):
        super().__init__()
        self.flat_structure = functools.reduce(operator.add, state_structure)

    def forward(self, best_hyp_indices, *states):
        sorted_states = []
        for state, state_format in zip(states, self.flat_structure):
            if state_format == STEP_STATE:
                sorted_state = state.index_select(0, best_hyp_indices)
            elif state_format == DECODER_STATE:
                sorted_state = state.index_select(1, best_hyp_indices)
            elif state_format == ENCODER_STATE or state_format == MASK_STATE:
                sorted_state = state  # a hypothesis never leaves its sentence's beam block
            else:
                raise ValueError("Provided state format %s not recognized." % state_format)
            sorted_states.append(sorted_state)
        return sorted_states


class BeamSearch(pt.nn.Module):

    def __init__(self, model: SockeyeModel, beam_size: int, bos_id: int = BOS_ID, eos_id: int = EOS_ID,
                 scorer: Optional[CandidateScorer] = None) -> None:
        super().__init__()
        self.model = model
        self.beam_size = beam_size
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.dtype = pt.float32
        self.output_vocab_size = model.output_layer.out_features
        self._update_scores = UpdateScores()
        self._scorer = scorer or CandidateScorer()
        self._repeat_states = RepeatStates(beam_size=beam_size, state_structure=[model.state_structure()])
        self._sort_states = SortStates(state_structure=[model.state_structure()])
        self._sort_norm_and_update_finished = SortNormalizeAndUpdateFinished(pad_id=PAD_ID, eos_id=eos_id,
                                                                             scorer=self._scorer)
        self._top = TopK(k=beam_size)

    def _decode_step(self, best_word_indices, model_states):
        logits, model_states = self.model.decode_step(best_word_indices, model_states)
        scores = -pt.log_softmax(logits, dim=-1)
        return scores, model_states

    def _should_stop(self, finished: pt.Tensor, batch_size: int) -> bool:
        return finished.sum().item() == batch_size * self.beam_size  # all finished

    @pt.no_grad()
    def forward(self, source: pt.Tensor, source_length: pt.Tensor, max_output_lengths: pt.Tensor):
        batch_size = source.size()[0]
        max_iterations = int(max_output_lengths.max().item())

        best_word_indices = pt.full((batch_size * self.beam_size, 1), fill_value=self.bos_id, dtype=pt.int32)
        offset = pt.arange(0, batch_size * self.beam_size, self.beam_size,
                           dtype=pt.int32).repeat_interleave(self.beam_size)
        batch_indices = pt.arange(0, batch_size * self.beam_size, self.beam_size, dtype=pt.int64)
        first_step_mask = pt.full((batch_size * self.beam_size, 1), fill_value=np.inf, dtype=self.dtype)
        first_step_mask[batch_indices] = pt.full((batch_size, 1), fill_value=0.0, dtype=self.dtype)

        best_hyp_indices_list = []
        best_word_indices_list = []

        lengths = pt.zeros(batch_size * self.beam_size, dtype=pt.int32)
        finished = pt.zeros(batch_size * self.beam_size, dtype=pt.bool)
        max_output_lengths = max_output_lengths.repeat_interleave(self.beam_size, dim=0)
        scores_accumulated = pt.zeros(batch_size * self.beam_size, 1, dtype=self.dtype)

        # (0) encode source sentence, repeat states to beam_size
        model_states = self.model.encode_and_initialize(source, source_length)
        model_states = self._repeat_states(*model_states)
        estimated_reference_lengths = pt.zeros(batch_size * self.beam_size, dtype=self.dtype)

        pad_dist = pt.full((1, self.output_vocab_size), fill_value=np.inf, dtype=self.dtype)
        pad_dist[0, 0] = 0
        eos_dist = pt.full((1, self.output_vocab_size), fill_value=np.inf, dtype=self.dtype)
        eos_dist[:, self.eos_id] = 0

        t = 1
        for t in range(1, max_iterations + 1):
            # (1) next predictions, advance the model's state
            target_dists, model_states = self._decode_step(best_word_indices, model_states)
            # (2) accumulated cost, finished rows only extend with <pad>
            scores, lengths = self._update_scores(target_dists, finished, scores_accumulated,
                                                  lengths, max_output_lengths, pad_dist, eos_dist)
            # (3) beam_size winners per sentence block; step 1 extends the first row only
            scores = scores + first_step_mask if t == 1 else scores
            best_hyp_indices, best_word_indices, scores_accumulated = self._top(scores)
            if batch_size > 1:
                best_hyp_indices = best_hyp_indices + offset
            # (4) normalize newly finished hypotheses
            best_word_indices, finished, scores_accumulated, lengths, estimated_reference_lengths = \
                self._sort_norm_and_update_finished(best_hyp_indices, best_word_indices, finished,
                                                    scores_accumulated, lengths, estimated_reference_lengths)
            best_word_indices_list.append(best_word_indices)
            best_hyp_indices_list.append(best_hyp_indices)
            if self._should_stop(finished, batch_size):
                break
            # (5) reorder the model's state by the winning hypotheses
            model_states = self._sort_states(best_hyp_indices, *model_states)

        # (9) sort the hypotheses within each sentence
        folded_accumulated_scores = scores_accumulated.reshape(batch_size, self.beam_size)
        indices = folded_accumulated_scores.argsort(dim=1, descending=False).reshape(-1)
        best_hyp_indices = indices.int() + offset
        scores_accumulated = scores_accumulated.index_select(0, best_hyp_indices)
        best_hyp_indices_list.append(best_hyp_indices)
        lengths = lengths.index_select(0, best_hyp_indices)
        all_best_hyp_indices = pt.stack(best_hyp_indices_list, dim=1)
        all_best_word_indices = pt.stack(best_word_indices_list, dim=2)
        return all_best_hyp_indices, all_best_word_indices, scores_accumulated, lengths


# ---------------------------------------------------------------- sockeye/inference.py

def _get_best_word_indices_for_kth_hypotheses(ks: np.ndarray, all_hyp_indices: np.ndarray) -> np.ndarray:
    batch_size = ks.shape[0]
    num_steps = all_hyp_indices.shape[1]
    result = np.zeros((batch_size, num_steps - 1), dtype=all_hyp_indices.dtype)
    pointer = all_hyp_indices[ks, -1]
    num_steps = all_hyp_indices.shape[1]
    for step in range(num_steps - 2, -1, -1):
        result[:, step] = pointer
        pointer = all_hyp_indices[pointer, step]
    return result


def translate(search: BeamSearch, source: pt.Tensor, source_length: pt.Tensor, max_output_lengths: pt.Tensor):
    """Best hypothesis per sentence: (tokens up to and including </s>, length-normalised score)."""
    hyp_indices, word_indices, scores, lengths = search(source, source_length, max_output_lengths)
    hyp_indices, word_indices = hyp_indices.numpy(), word_indices.numpy()
    batch_size = source.size(0)
    best_ids = np.arange(0, batch_size * search.beam_size, search.beam_size, dtype=np.int32)
    rows = _get_best_word_indices_for_kth_hypotheses(best_ids, hyp_indices)
    outputs = []
    for i, best_id in enumerate(best_ids):
        seq = word_indices[rows[i], 0, np.arange(rows.shape[1])]
        length = int(lengths[best_id].item())
        outputs.append((seq[:length].tolist(), float(scores[best_id, 0])))
    return outputs


# ---------------------------------------------------------------- run

def make_batch(sentences: List[List[int]]):
    """Sockeye's data_io: </s> appended to each source, right-padded with <pad> (id 0); lengths (batch, 2)."""
    seqs = [s + [EOS_ID] for s in sentences]
    max_len = max(len(s) for s in seqs)
    source = pt.full((len(seqs), max_len), PAD_ID, dtype=pt.long)
    for i, s in enumerate(seqs):
        source[i, :len(s)] = pt.tensor(s)
    length = pt.tensor([[len(s), 0] for s in seqs], dtype=pt.int32)
    return source, length


def make_targets(targets: List[List[int]]):
    """Decoder input <s> w1 .. wn and labels w1 .. wn </s>, right-padded with <pad>."""
    max_len = max(len(t) for t in targets) + 1
    inp = pt.full((len(targets), max_len), PAD_ID, dtype=pt.long)
    lab = pt.full((len(targets), max_len), PAD_ID, dtype=pt.long)
    for i, t in enumerate(targets):
        inp[i, :len(t) + 1] = pt.tensor([BOS_ID] + t)
        lab[i, :len(t) + 1] = pt.tensor(t + [EOS_ID])
    return inp, lab, pt.tensor([len(t) + 1 for t in targets], dtype=pt.int32)


def main():
    pt.manual_seed(7)
    vocab_source, vocab_target = 24, 20
    config = TransformerConfig()
    model = SockeyeModel(config, vocab_source, vocab_target, inference_only=False)
    with pt.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.dim() > 1:
                p.mul_(2.5)  # sharper distributions so that sources actually disagree

    sources = [[5, 9, 14, 7, 11, 20, 6], [8, 12], [17, 4, 10, 22], [13]]
    targets = [[6, 9, 4, 11, 15], [7, 12], [18, 5, 10], [14, 8, 16, 9]]
    source, source_length = make_batch(sources)
    target_in, labels, target_length = make_targets(targets)

    # --- teacher-forced scoring (training graph: fused MHA, (batch*heads, trg, src) bool masks)
    model.train()
    with pt.no_grad():
        logits = model(source, source_length, target_in, target_length)
        loss = F.cross_entropy(logits.reshape(-1, vocab_target), labels.reshape(-1), ignore_index=PAD_ID,
                               reduction='sum')
        ref_loss = 0.0
        for i in range(len(sources)):
            s, sl = make_batch([sources[i]])
            ti, li, tl = make_targets([targets[i]])
            ref = model(s, sl, ti, tl)
            n = int(target_length[i])
            err = (logits[i, :n] - ref[0, :n]).abs().max().item()
            assert err < 1e-4, ("teacher-forced logits", i, err)
            ref_loss += F.cross_entropy(ref[0], li[0], ignore_index=PAD_ID, reduction='sum').item()
        assert abs(loss.item() - ref_loss) < 1e-3, (loss.item(), ref_loss)
    print("teacher-forced loss %.4f (per-sentence sum %.4f)" % (loss.item(), ref_loss))

    # --- inference: same weights in an inference_only model (interleaved k/v, cached decoder states)
    infer = SockeyeModel(config, vocab_source, vocab_target, inference_only=True)
    infer.load_state_dict(model.state_dict())
    infer.eval()

    # encoder at inference (DotAttentionCell, masked_fill) agrees with the fused training graph
    with pt.no_grad():
        enc_train, _, _ = model.encode(source, source_length)
        enc_eval, _, _ = infer.encode(source, source_length)
        for i in range(len(sources)):
            n = int(source_length[i, 0])
            assert (enc_train[i, :n] - enc_eval[i, :n]).abs().max().item() < 1e-4

    search = BeamSearch(infer, beam_size=3)
    max_output_lengths = (source_length[:, 0] * 2).to(pt.int32)
    batch_out = translate(search, source, source_length, max_output_lengths)
    for i in range(len(sources)):
        s, sl = make_batch([sources[i]])
        alone = translate(search, s, sl, max_output_lengths[i:i + 1])[0]
        got = batch_out[i]
        print("src %-22s -> %s  score %.4f" % (sources[i], got[0], got[1]))
        assert got[0] == alone[0], (i, got[0], alone[0])
        assert abs(got[1] - alone[1]) < 1e-4, (i, got[1], alone[1])

    # the decoder's cached steps equal a full teacher-forced pass over the chosen hypothesis
    with pt.no_grad():
        for i in range(len(sources)):
            hyp = [t for t in batch_out[i][0] if t != EOS_ID]
            s, sl = make_batch([sources[i]])
            ti, li, tl = make_targets([hyp])
            full = model(s, sl, ti, tl)[0]
            states = infer.encode_and_initialize(s, sl)
            step_input = pt.full((1, 1), BOS_ID, dtype=pt.int32)
            for t in range(ti.size(1)):
                step_logits, states = infer.decode_step(step_input, states)
                assert (step_logits[0] - full[t]).abs().max().item() < 1e-4, (i, t)
                step_input = ti[:, t + 1:t + 2].int() if t + 1 < ti.size(1) else step_input
    print("batched beam search matches each sentence translated alone")


if __name__ == "__main__":
    main()
