"""Texar-PyTorch's Transformer NMT example, shrunk to tiny sizes: train, then beam search.

Correct program (quiet batch quiet-r154a). Ported from asyml/texar-pytorch
@5b56ad39ff980c7a2129d59158d43c809c4b43db:
  texar/torch/utils/utils.py                  sequence_mask
  texar/torch/utils/transformer_attentions.py attention_bias_lower_triangle / _local,
                                              attention_bias_ignore_padding, _ones_matrix_band_part
  texar/torch/modules/encoders/multihead_attention.py  MultiheadAttentionEncoder (additive
                                              memory_attention_bias, per-layer 'keys'/'values' cache)
  texar/torch/modules/encoders/transformer_encoder.py  TransformerEncoder.forward (pre-norm)
  texar/torch/modules/decoders/transformer_decoders.py TransformerDecoder.forward
                                              ("train_greedy" and beam search), _self_attention_stack,
                                              _init_cache, beam_decode, _inputs_to_outputs
  texar/torch/utils/beam_search.py            the tensor2tensor beam search (gather_nd,
                                              _expand_to_beam_size, _merge_beam_dim, grow_topk ...)
  texar/torch/modules/embedders/position_embedders.py  SinusoidsPositionEmbedder
  examples/transformer/model.py               Transformer (encoder_input_length from pad id 0,
                                              word * sqrt(dim) + sinusoid positions), LabelSmoothingLoss
  examples/transformer/utils/data_utils.py    the collate: src + <eos>, right-padded with 0,
                                              target_input = <bos> + target_output[:-1]

Sources of different lengths are right-padded with 0. The encoder adds
attention_bias_ignore_padding(1 - sequence_mask(lengths)) (-1e18 on pad keys) to every
self-attention logit; the decoder builds the same bias for the memory and, when teacher
forced, adds attention_bias_lower_triangle to its self-attention. In beam search the bias
and the memory live in the decoding cache: the beam search tiles them beam_width times,
merges (batch, beam) for each step and gathers every cache entry (memory, bias, each
layer's keys/values) by the chosen beams; one query a step attends all cached keys.

Checked against references written here, in float64: each source encoded alone
(unpadded), each pair teacher-forced alone, the cached step-by-step decoder against
the teacher-forced one, each sentence beam-searched alone (batch of one), and the best
hypothesis' score against its log-probability re-scored by a full teacher-forced pass.
"""
import copy
import math
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.set_default_dtype(torch.float64)

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2
INF = 1.0 * 1e7


# --------------------------------------------------------------------------
# texar/torch/utils/utils.py
# --------------------------------------------------------------------------
def sequence_mask(lengths, max_len=None, dtype=None, device=None):
    if not isinstance(lengths, torch.Tensor):
        lengths = torch.tensor(lengths, device=device)
    elif device is None:
        device = lengths.device
    if max_len is None:
        max_len = torch.max(lengths).item()
    size = lengths.size()
    row_vector = torch.arange(max_len, device=device, dtype=lengths.dtype).view(
        *([1] * len(size)), -1).expand(*size, max_len)
    mask = (row_vector < lengths.unsqueeze(-1)).to(device=device)
    if dtype is not None:
        mask = mask.to(dtype=dtype)
    return mask


def map_structure(fn, obj):
    if isinstance(obj, dict):
        return {k: map_structure(fn, v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_structure(fn, v) for v in obj)
    return fn(obj)


# --------------------------------------------------------------------------
# texar/torch/utils/transformer_attentions.py
# --------------------------------------------------------------------------
def attention_bias_lower_triangle(length, bias_value=-1e18):
    return attention_bias_local(length, -1, 0, bias_value)


def attention_bias_local(length, max_backward, max_forward, bias_value=-1e18):
    band = _ones_matrix_band_part(
        length, length, max_backward, max_forward,
        out_shape=(1, 1, length, length))
    return bias_value * (1.0 - band)


def attention_bias_ignore_padding(memory_padding, bias_value=-1e18):
    ret = memory_padding * bias_value
    return ret.view(ret.size(0), 1, 1, ret.size(-1))


def _ones_matrix_band_part(rows, cols, num_lower, num_upper, out_shape=None):
    if num_lower < 0:
        num_lower = rows - 1
    if num_upper < 0:
        num_upper = cols - 1
    lower_mask = np.tri(cols, rows, num_lower).T
    upper_mask = np.tri(rows, cols, num_upper)
    band = np.ones((rows, cols)) * lower_mask * upper_mask
    if out_shape:
        band = band.reshape(out_shape)
    band = torch.as_tensor(band, dtype=torch.float32)
    return band


# --------------------------------------------------------------------------
# texar/torch/modules/encoders/multihead_attention.py
# --------------------------------------------------------------------------
class MultiheadAttentionEncoder(nn.Module):
    def __init__(self, input_size, hparams):
        super().__init__()
        self._hparams = hparams
        use_bias = hparams.use_bias
        self.Q_dense = nn.Linear(input_size, hparams.num_units, bias=use_bias)
        self.K_dense = nn.Linear(input_size, hparams.num_units, bias=use_bias)
        self.V_dense = nn.Linear(input_size, hparams.num_units, bias=use_bias)
        self.O_dense = nn.Linear(hparams.num_units, hparams.output_dim, bias=use_bias)

    def forward(self, queries, memory, memory_attention_bias, cache=None):
        num_heads = self._hparams.num_heads
        num_units = self._hparams.num_units
        if num_units % num_heads != 0:
            raise ValueError(
                f"Value depth ({num_units}) must be divisible by "
                f"the number of attention heads ({num_heads}).")

        def _update_and_return(layer, key):
            if memory is None:
                # Self Attention
                out = layer(queries)

                if cache is not None:
                    # decoder self attention when dynamic decoding
                    res = cache[key]
                    if isinstance(res, list):
                        # inference-like decoding
                        res.append(out.squeeze(1))
                        out = torch.stack(res, dim=1)
                    else:
                        # normal decoding
                        res = torch.cat([res, out], dim=1)
                        out = res
                    cache[key] = res
            else:
                # encoder decoder attention
                if cache is not None:
                    res = cache[key]
                    if isinstance(res, list):
                        if len(res) == 0:
                            out = layer(memory)
                        else:
                            out = torch.stack(res, dim=1)
                    else:
                        if res.size(1) == 0:
                            out = layer(memory)
                        else:
                            out = res
                else:
                    out = layer(memory)
            return out

        Q = self.Q_dense(queries)
        K = _update_and_return(self.K_dense, 'keys')
        V = _update_and_return(self.V_dense, 'values')

        Q_ = self._split_heads(Q)
        K_ = self._split_heads(K)
        V_ = self._split_heads(V)
        # [batch_size, num_heads, seq_length, memory_depth]
        key_depth_per_head = num_units // num_heads
        Q_ *= key_depth_per_head ** -0.5

        logits = torch.matmul(Q_, K_.transpose(-2, -1))
        if memory_attention_bias is not None:
            memory_attention_bias = memory_attention_bias.to(device=logits.device)
            logits += memory_attention_bias
        weights = torch.softmax(logits, dim=-1)
        weights = F.dropout(weights, self._hparams.dropout_rate, self.training)
        outputs = torch.matmul(weights, V_)

        outputs = self._combine_heads(outputs)
        outputs = self.O_dense(outputs)
        return outputs

    def _split_heads(self, x):
        depth = x.size(-1)
        split_x = torch.reshape(x, (
            x.size(0), x.size(1),
            self._hparams.num_heads, depth // self._hparams.num_heads))
        return split_x.permute((0, 2, 1, 3))

    def _combine_heads(self, x):
        t = x.permute((0, 2, 1, 3))  # [batch, seq_len, num_heads, dim]
        num_heads, dim = t.size()[-2:]
        assert num_heads == self._hparams.num_heads
        return torch.reshape(t, (t.size(0), t.size(1), num_heads * dim))


def default_transformer_poswise_net(input_dim, output_dim, dropout=0.1):
    # default_transformer_poswise_net_hparams: Linear(4x) - ReLU - Dropout - Linear
    return nn.Sequential(
        nn.Linear(input_dim, output_dim * 4, bias=True),
        nn.ReLU(inplace=True),
        nn.Dropout(p=dropout),
        nn.Linear(output_dim * 4, output_dim, bias=True),
    )


# --------------------------------------------------------------------------
# texar/torch/modules/encoders/transformer_encoder.py (use_bert_config=False)
# --------------------------------------------------------------------------
class TransformerEncoder(nn.Module):
    def __init__(self, hparams):
        super().__init__()
        self._hparams = hparams
        dim = hparams.dim
        self.self_attns = nn.ModuleList()
        self.self_attn_layer_norm = nn.ModuleList()
        self.poswise_networks = nn.ModuleList()
        self.poswise_layer_norm = nn.ModuleList()
        for _ in range(hparams.num_blocks):
            self.self_attns.append(MultiheadAttentionEncoder(dim, hparams.multihead_attention))
            self.self_attn_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
            self.poswise_networks.append(default_transformer_poswise_net(dim, dim))
            self.poswise_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
        self.embed_dropout = nn.Dropout(hparams.embedding_dropout)
        self.residual_dropout = nn.Dropout(hparams.residual_dropout)
        self.final_layer_norm = nn.LayerNorm(dim, eps=hparams.eps)

    def forward(self, inputs, sequence_length):
        inputs_padding = 1 - sequence_mask(
            sequence_length, inputs.size()[1]).float()
        ignore_padding = attention_bias_ignore_padding(inputs_padding)
        encoder_self_attention_bias = ignore_padding

        x = self.embed_dropout(inputs)
        for i in range(self._hparams.num_blocks):
            _queries_input = self.self_attn_layer_norm[i](x)
            attention_output = self.self_attns[i](
                queries=_queries_input,
                memory=_queries_input,
                memory_attention_bias=encoder_self_attention_bias,
            )
            attention_output = self.residual_dropout(attention_output)
            x = x + attention_output

            y = self.poswise_layer_norm[i](x)
            original_shape = y.size()
            y = y.view(-1, self._hparams.dim)
            layer_output = self.poswise_networks[i](y)
            sub_output = self.residual_dropout(layer_output)
            sub_output = sub_output.view(original_shape)
            x = x + sub_output

        x = self.final_layer_norm(x)
        return x


# --------------------------------------------------------------------------
# texar/torch/utils/beam_search.py (adapted from tensor2tensor)
# --------------------------------------------------------------------------
def gather_nd(params, indices):
    if not isinstance(params, torch.Tensor):
        return params
    assert len(indices.size()) == 3
    orig_size = params.size()
    index = indices[:, :, 1].view(-1) + indices[:, :, 0].view(-1) * orig_size[1]
    ret = torch.index_select(
        params.view(-1, *params.size()[2:]), dim=0, index=index)
    ret = ret.view(orig_size[0], indices.size(1), *orig_size[2:])
    return ret


def _merge_beam_dim(tensor):
    if not isinstance(tensor, torch.Tensor):
        return tensor
    shape = list(tensor.size())
    shape[0] *= shape[1]  # batch -> batch * beam_size
    shape.pop(1)  # Remove beam dim
    return tensor.view(tuple(shape))


def _unmerge_beam_dim(tensor, batch_size, beam_size):
    if not isinstance(tensor, torch.Tensor):
        return tensor
    shape = list(tensor.size())
    new_shape = [batch_size] + [beam_size] + shape[1:]
    return tensor.view(tuple(new_shape))


def _expand_to_beam_size(tensor, beam_size):
    if not isinstance(tensor, torch.Tensor):
        return tensor
    tensor = torch.unsqueeze(tensor, dim=1)
    tile_dims = [1] * len(tensor.size())
    tile_dims[1] = beam_size
    return tensor.repeat(tuple(tile_dims))


def log_prob_from_logits(logits):
    return logits - torch.logsumexp(logits, dim=-1, keepdim=True)


def compute_batch_indices(batch_size, beam_size):
    batch_pos = torch.arange(batch_size)
    batch_pos = batch_pos.view(-1, 1).expand(batch_size, beam_size)
    return batch_pos


def compute_topk_scores_and_seq(sequences, scores, scores_to_gather, flags,
                                beam_size, batch_size, states_to_gather=None):
    _, topk_indexes = torch.topk(scores, k=beam_size)
    batch_pos = compute_batch_indices(batch_size, beam_size)
    batch_pos = batch_pos.to(device=topk_indexes.device)
    top_coordinates = torch.stack([batch_pos, topk_indexes], dim=2)

    topk_seq = gather_nd(sequences, top_coordinates)
    topk_flags = gather_nd(flags, top_coordinates)
    topk_gathered_scores = gather_nd(scores_to_gather, top_coordinates)
    if states_to_gather is not None:
        topk_gathered_states = map_structure(
            lambda state: gather_nd(state, top_coordinates), states_to_gather)
    else:
        topk_gathered_states = states_to_gather
    return topk_seq, topk_gathered_scores, topk_flags, topk_gathered_states


def beam_search(symbols_to_logits_fn, initial_ids, beam_size, decode_length,
                vocab_size, alpha, eos_id, states=None, stop_early=True):
    batch_size = initial_ids.size()[0]

    initial_log_probs = torch.Tensor(
        [[0.0] + [-float("inf")] * (beam_size - 1)])  # [1, beam_size]
    initial_log_probs = initial_log_probs.to(device=initial_ids.device)
    alive_log_probs = initial_log_probs.repeat((batch_size, 1))

    alive_seq = _expand_to_beam_size(initial_ids, beam_size)
    alive_seq = torch.unsqueeze(alive_seq, dim=2)

    if states is not None:
        states = map_structure(
            lambda state: _expand_to_beam_size(state, beam_size), states)

    finished_seq = torch.zeros(alive_seq.size(), dtype=torch.long)
    finished_scores = torch.full((batch_size, beam_size), -INF)
    finished_flags = torch.zeros((batch_size, beam_size), dtype=torch.bool)

    def grow_finished(finished_seq, finished_scores, finished_flags,
                      curr_seq, curr_scores, curr_finished):
        _appended = torch.zeros(batch_size, beam_size, 1, dtype=torch.long)
        finished_seq = torch.cat([finished_seq, _appended], dim=2)

        curr_scores = curr_scores + (1.0 - curr_finished.float()) * -INF
        curr_finished_seq = torch.cat([finished_seq, curr_seq], dim=1)
        curr_finished_scores = torch.cat([finished_scores, curr_scores], dim=1)
        curr_finished_flags = torch.cat([finished_flags, curr_finished], dim=1)
        next_seq, next_scores, next_flags, _ = compute_topk_scores_and_seq(
            curr_finished_seq, curr_finished_scores, curr_finished_scores,
            curr_finished_flags, beam_size, batch_size)
        return next_seq, next_scores, next_flags

    def grow_alive(curr_seq, curr_scores, curr_log_probs, curr_finished, states):
        curr_scores = curr_scores + curr_finished.float() * -INF
        return compute_topk_scores_and_seq(
            curr_seq, curr_scores, curr_log_probs, curr_finished,
            beam_size, batch_size, states)

    def grow_topk(i, alive_seq, alive_log_probs, states):
        flat_ids = alive_seq.view(batch_size * beam_size, -1)

        if states is not None:
            flat_states = map_structure(_merge_beam_dim, states)
            flat_logits, flat_states = symbols_to_logits_fn(flat_ids, flat_states)
            states = map_structure(
                lambda t: _unmerge_beam_dim(t, batch_size, beam_size), flat_states)
        else:
            flat_logits = symbols_to_logits_fn(flat_ids)
        logits = flat_logits.view(batch_size, beam_size, -1)

        candidate_log_probs = log_prob_from_logits(logits)
        log_probs = candidate_log_probs + alive_log_probs.unsqueeze(dim=2)

        length_penalty = ((5.0 + float(i + 1)) / 6.0) ** alpha

        curr_scores = log_probs / length_penalty
        flat_curr_scores = curr_scores.view(-1, beam_size * vocab_size)

        topk_scores, topk_ids = torch.topk(flat_curr_scores, k=beam_size * 2)
        topk_log_probs = topk_scores * length_penalty

        topk_beam_index = topk_ids // vocab_size
        topk_ids %= vocab_size  # Un-flatten the ids

        batch_pos = compute_batch_indices(batch_size, beam_size * 2)
        batch_pos = batch_pos.to(device=topk_beam_index.device)
        topk_coordinates = torch.stack([batch_pos, topk_beam_index], dim=2)

        topk_seq = gather_nd(alive_seq, topk_coordinates)

        if states is not None:
            states = map_structure(
                lambda state: gather_nd(state, topk_coordinates), states)

        topk_seq = torch.cat([topk_seq, topk_ids.unsqueeze(dim=2)], dim=2)
        topk_finished = topk_ids == eos_id
        return topk_seq, topk_log_probs, topk_scores, topk_finished, states

    def inner_loop(i, alive_seq, alive_log_probs, finished_seq, finished_scores,
                   finished_flags, states):
        topk_seq, topk_log_probs, topk_scores, topk_finished, states = grow_topk(
            i, alive_seq, alive_log_probs, states)
        alive_seq, alive_log_probs, _, states = grow_alive(
            topk_seq, topk_scores, topk_log_probs, topk_finished, states)
        finished_seq, finished_scores, finished_flags = grow_finished(
            finished_seq, finished_scores, finished_flags,
            topk_seq, topk_scores, topk_finished)
        return (i + 1, alive_seq, alive_log_probs, finished_seq,
                finished_scores, finished_flags, states)

    def _is_finished(i, alive_log_probs, finished_scores):
        max_length_penalty = ((5.0 + float(decode_length)) / 6.0) ** alpha
        lower_bound_alive_scores = alive_log_probs[:, 0] / max_length_penalty
        if not stop_early:
            lowest_score_of_finished_in_finished = torch.min(finished_scores)
        else:
            lowest_score_of_finished_in_finished, _ = torch.max(finished_scores, dim=1)
        bound_is_met = (
            (lowest_score_of_finished_in_finished > lower_bound_alive_scores)
            .all().item())
        return (i < decode_length) & (not bound_is_met)

    step = 0
    while _is_finished(step, alive_log_probs, finished_scores):
        (step, alive_seq, alive_log_probs, finished_seq, finished_scores,
         finished_flags, states) = inner_loop(
            step, alive_seq, alive_log_probs, finished_seq, finished_scores,
            finished_flags, states)

    ret_seq, ret_scores = [], []
    for idx, flag_per_instance in enumerate(finished_flags.any(dim=1).tolist()):
        if flag_per_instance:
            ret_seq.append(finished_seq[idx])
            ret_scores.append(finished_scores[idx])
        else:
            ret_seq.append(alive_seq[idx])
            ret_scores.append(alive_log_probs[idx])
    return torch.stack(ret_seq, dim=0), torch.stack(ret_scores, dim=0)


# --------------------------------------------------------------------------
# texar/torch/modules/decoders/transformer_decoders.py
# --------------------------------------------------------------------------
class TransformerDecoder(nn.Module):
    def __init__(self, token_pos_embedder, vocab_size, output_layer, hparams):
        super().__init__()
        self._hparams = hparams
        self._token_pos_embedder = token_pos_embedder
        self._input_size = hparams.dim
        self._vocab_size = vocab_size
        self._output_weight = output_layer  # embedding_tie, output_layer_bias False
        dim = hparams.dim
        self.self_attns = nn.ModuleList()
        self.self_attn_layer_norm = nn.ModuleList()
        self.enc_dec_attns = nn.ModuleList()
        self.end_dec_attn_layer_norm = nn.ModuleList()
        self.poswise_networks = nn.ModuleList()
        self.poswise_layer_norm = nn.ModuleList()
        for _ in range(hparams.num_blocks):
            self.self_attns.append(MultiheadAttentionEncoder(dim, hparams.multihead_attention))
            self.self_attn_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
            self.enc_dec_attns.append(MultiheadAttentionEncoder(dim, hparams.multihead_attention))
            self.end_dec_attn_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
            self.poswise_networks.append(default_transformer_poswise_net(dim, dim))
            self.poswise_layer_norm.append(nn.LayerNorm(dim, eps=hparams.eps))
        self.final_layer_norm = nn.LayerNorm(dim, eps=hparams.eps)
        self.embed_dropout = nn.Dropout(hparams.embedding_dropout)
        self.residual_dropout = nn.Dropout(hparams.residual_dropout)

    def embed_tokens(self, tokens, positions):
        return self._token_pos_embedder(tokens, positions)

    def _output_layer(self, x):
        return F.linear(x, self._output_weight)

    def _inputs_to_outputs(self, inputs, cache):
        outputs = self._self_attention_stack(
            inputs.unsqueeze(1), memory=cache['memory'], cache=cache)
        outputs = self._output_layer(outputs)
        outputs = outputs.squeeze(1)
        return outputs, cache

    def forward(self, inputs=None, memory=None, memory_sequence_length=None,
                memory_attention_bias=None, decoding_strategy='train_greedy',
                max_decoding_length=None, beam_width=None, length_penalty=0.,
                **kwargs):
        if memory is not None:
            if memory_attention_bias is None:
                if memory_sequence_length is None:
                    raise ValueError(
                        "`memory_sequence_length` is required if "
                        "`memory_attention_bias` is not given.")
                enc_padding = 1 - sequence_mask(
                    memory_sequence_length, memory.size(1), dtype=torch.float32)
                memory_attention_bias = attention_bias_ignore_padding(enc_padding)

        # Faster code path for teacher-forcing training
        if beam_width is None and decoding_strategy == 'train_greedy':
            if inputs is None:
                raise ValueError("'input' must not be none "
                                 "when using 'train_greedy' decoding strategy.")
            times = torch.arange(inputs.size(1), dtype=torch.long, device=inputs.device)
            times = times.unsqueeze(0).expand(inputs.size(0), -1)
            inputs = self.embed_tokens(inputs, times)

            decoder_self_attention_bias = attention_bias_lower_triangle(inputs.size(1))

            decoder_output = self._self_attention_stack(
                inputs, memory, decoder_self_attention_bias,
                memory_attention_bias, cache=None)
            logits = self._output_layer(decoder_output)
            sample_id = torch.argmax(logits, dim=-1)
            return SimpleNamespace(logits=logits, sample_id=sample_id)

        if max_decoding_length is None:
            max_decoding_length = self._hparams.max_decoding_length

        # Beam-search decoding (the example always sets beam_width)
        start_tokens = kwargs['start_tokens']
        _batch_size = start_tokens.size(0)
        self._state_cache = self._init_cache(
            memory, memory_attention_bias,
            beam_search_decoding=True, batch_size=_batch_size)
        end_token = kwargs.get('end_token')

        sample_id, log_prob = self.beam_decode(
            start_tokens, end_token,
            embedding_fn=self.embed_tokens,
            beam_width=beam_width,
            length_penalty=length_penalty,
            decode_length=max_decoding_length)
        del self._state_cache
        return {'sample_id': sample_id, 'log_prob': log_prob}

    def _self_attention_stack(self, inputs, memory,
                              decoder_self_attention_bias=None,
                              memory_attention_bias=None, cache=None):
        inputs = self.embed_dropout(inputs)
        if cache is not None:
            if memory is not None:
                memory_attention_bias = cache['memory_attention_bias']
        else:
            assert decoder_self_attention_bias is not None

        x = inputs
        for i in range(self._hparams.num_blocks):
            layer_cache = cache['layers'][i] if cache is not None else None

            selfatt_output = self.self_attns[i](
                queries=self.self_attn_layer_norm[i](x),
                memory=None,
                memory_attention_bias=decoder_self_attention_bias,
                cache=layer_cache)
            x = x + self.residual_dropout(selfatt_output)

            if memory is not None:
                encdec_output = self.enc_dec_attns[i](
                    queries=self.end_dec_attn_layer_norm[i](x),
                    memory=memory,
                    memory_attention_bias=memory_attention_bias)
                x = x + self.residual_dropout(encdec_output)

            sub_output = self.poswise_networks[i](self.poswise_layer_norm[i](x))
            x = x + self.residual_dropout(sub_output)

        return self.final_layer_norm(x)

    def _init_cache(self, memory, memory_attention_bias, beam_search_decoding,
                    batch_size):
        device = next(self.parameters()).device

        def _create_ta():
            return []

        def _create_empty_tensor():
            ret = torch.zeros(
                batch_size, 0, self._hparams.multihead_attention.num_units,
                dtype=torch.get_default_dtype(), device=device)
            return ret

        _create_fn = (_create_empty_tensor if beam_search_decoding
                      else _create_ta)

        cache = {
            'memory': memory,
            'memory_attention_bias': memory_attention_bias,
            'layers': [{
                'keys': _create_fn(),
                'values': _create_fn(),
            } for _ in range(self._hparams.num_blocks)],
        }
        return cache

    def beam_decode(self, start_tokens, end_token, embedding_fn,
                    decode_length=256, beam_width=5, length_penalty=0.6):

        def _symbols_to_logits_fn(ids, cache):
            batch_size = ids.size(0)
            step = ids.size(-1) - 1
            times = ids.new_full((batch_size,), step)
            inputs = embedding_fn(ids[:, -1], times)
            return self._inputs_to_outputs(inputs, cache)

        outputs, log_prob = beam_search(
            _symbols_to_logits_fn, start_tokens, beam_width, decode_length,
            self._vocab_size, length_penalty,
            states=self._state_cache, eos_id=end_token)

        # Ignores <BOS>
        outputs = outputs[:, :, 1:]
        # shape = [batch_size, seq_length, beam_width]
        outputs = outputs.permute(0, 2, 1)
        return outputs, log_prob


# --------------------------------------------------------------------------
# texar/torch/modules/embedders/position_embedders.py (cache_embeddings=True)
# --------------------------------------------------------------------------
class SinusoidsPositionEmbedder(nn.Module):
    def __init__(self, position_size, dim, min_timescale=1.0, max_timescale=1.0e4):
        super().__init__()
        self._dim = dim
        num_timescales = dim // 2
        log_timescale_increment = (math.log(max_timescale / min_timescale) /
                                   (num_timescales - 1))
        inv_timescales = min_timescale * torch.exp(
            (torch.arange(num_timescales, dtype=torch.float) * -log_timescale_increment))
        positions = torch.arange(position_size, dtype=torch.float)
        self.register_buffer('signal', self._compute_embeddings(positions, inv_timescales))

    def _compute_embeddings(self, positions, inv_timescales):
        scaled_time = (positions.type_as(inv_timescales).view(-1, 1) *
                       inv_timescales.unsqueeze(0))
        signal = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)
        signal = signal.view(*positions.size(), -1).contiguous()
        return signal

    def forward(self, positions):
        return F.embedding(positions, self.signal)


# --------------------------------------------------------------------------
# examples/transformer/model.py + config_model.py (tiny)
# --------------------------------------------------------------------------
hidden_dim = 32
beam_width = 4
length_penalty = 0.6
max_decoding_length = 16

_mha = SimpleNamespace(num_units=hidden_dim, num_heads=4, dropout_rate=0.1,
                       output_dim=hidden_dim, use_bias=False)
encoder_hparams = SimpleNamespace(
    dim=hidden_dim, num_blocks=2, multihead_attention=_mha, eps=1e-6,
    embedding_dropout=0.1, residual_dropout=0.1)
decoder_hparams = copy.deepcopy(encoder_hparams)
decoder_hparams.max_decoding_length = int(1e10)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, label_confidence, tgt_vocab_size, ignore_index=0):
        super().__init__()
        self.ignore_index = ignore_index
        self.tgt_vocab_size = tgt_vocab_size
        label_smoothing = 1 - label_confidence
        assert 0.0 < label_smoothing <= 1.0
        smoothing_value = label_smoothing / (tgt_vocab_size - 2)
        one_hot = torch.full((tgt_vocab_size,), smoothing_value)
        one_hot[self.ignore_index] = 0
        self.register_buffer("one_hot", one_hot.unsqueeze(0))
        self.confidence = label_confidence

    def forward(self, output, target, label_lengths):
        orig_shapes = (output.size(), target.size())
        output = output.view(-1, self.tgt_vocab_size)
        target = target.view(-1)
        model_prob = self.one_hot.repeat(target.size(0), 1)
        model_prob.scatter_(1, target.unsqueeze(1), self.confidence)
        model_prob.masked_fill_((target == self.ignore_index).unsqueeze(1), 0)
        output = output.view(orig_shapes[0])
        model_prob = model_prob.view(orig_shapes[0])
        # tx.losses.sequence_softmax_cross_entropy(average_across_batch=False,
        #                                          sum_over_timesteps=False)
        losses = -(model_prob * F.log_softmax(output, dim=-1)).sum(-1)
        return losses * sequence_mask(label_lengths, losses.size(1), dtype=losses.dtype)


class Transformer(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.vocab_size = vocab_size
        self.word_embedder = nn.Embedding(vocab_size, hidden_dim)
        nn.init.normal_(self.word_embedder.weight, mean=0.0, std=hidden_dim ** -0.5)
        self.pos_embedder = SinusoidsPositionEmbedder(max_decoding_length + 8, hidden_dim)
        self.encoder = TransformerEncoder(encoder_hparams)
        self.decoder = TransformerDecoder(
            token_pos_embedder=self._embedding_fn,
            vocab_size=self.vocab_size,
            output_layer=self.word_embedder.weight,
            hparams=decoder_hparams)
        self.smoothed_loss_func = LabelSmoothingLoss(
            label_confidence=0.9, tgt_vocab_size=self.vocab_size, ignore_index=0)

    def _embedding_fn(self, tokens, positions):
        word_embed = self.word_embedder(tokens)
        scale = hidden_dim ** 0.5
        pos_embed = self.pos_embedder(positions)
        return word_embed * scale + pos_embed

    def encode(self, encoder_input):
        batch_size = encoder_input.size(0)
        # Text sequence length excluding padding
        encoder_input_length = (encoder_input != 0).int().sum(dim=1)
        positions = torch.arange(
            encoder_input_length.max(), dtype=torch.long,
            device=encoder_input.device).unsqueeze(0).expand(batch_size, -1)
        src_input_embedding = self._embedding_fn(encoder_input, positions)
        encoder_output = self.encoder(
            inputs=src_input_embedding, sequence_length=encoder_input_length)
        return encoder_output, encoder_input_length

    def forward(self, encoder_input, decoder_input=None, labels=None, beam_width=None):
        batch_size = encoder_input.size(0)
        encoder_output, encoder_input_length = self.encode(encoder_input)

        if decoder_input is not None and labels is not None:
            outputs = self.decoder(
                memory=encoder_output,
                memory_sequence_length=encoder_input_length,
                inputs=decoder_input,
                decoding_strategy="train_greedy")
            label_lengths = (labels != 0).long().sum(dim=1)
            is_target = (labels != 0).float()
            mle_loss = self.smoothed_loss_func(outputs.logits, labels, label_lengths)
            mle_loss = (mle_loss * is_target).sum() / is_target.sum()
            return mle_loss
        else:
            start_tokens = encoder_input.new_full((batch_size,), BOS_ID)
            predictions = self.decoder(
                memory=encoder_output,
                memory_sequence_length=encoder_input_length,
                beam_width=beam_width,
                length_penalty=length_penalty,
                start_tokens=start_tokens,
                end_token=EOS_ID,
                max_decoding_length=max_decoding_length,
                decoding_strategy="infer_greedy")
            return predictions


# --------------------------------------------------------------------------
# examples/transformer/utils/data_utils.py: TrainData collate
# --------------------------------------------------------------------------
def padded_batch(seqs, pad_value=PAD_ID):
    max_len = max(len(s) for s in seqs)
    out = np.full((len(seqs), max_len), pad_value, dtype=np.int64)
    for i, s in enumerate(seqs):
        out[i, :len(s)] = s
    return out


def collate(examples):
    src_seqs = [list(ex[0]) + [EOS_ID] for ex in examples]
    tgt_seqs = [list(ex[1]) + [EOS_ID] for ex in examples]
    source = padded_batch(src_seqs)
    target_output = padded_batch(tgt_seqs)
    # Add BOS token to the target inputs.
    target_input = np.pad(target_output[:, :-1], ((0, 0), (1, 0)),
                          mode="constant", constant_values=BOS_ID)
    return tuple(torch.from_numpy(x) for x in (source, target_input, target_output))


# --------------------------------------------------------------------------
# A toy translation task: the target is the source reversed, shifted by one id.
# --------------------------------------------------------------------------
VOCAB = 14
WORDS = list(range(3, VOCAB - 1))


def make_pair(rng):
    n = int(rng.integers(2, 7))
    src = [int(w) for w in rng.choice(WORDS, size=n)]
    tgt = [w + 1 for w in reversed(src)]
    return src, tgt


def train(model, steps=200, batch_size=32, seed=0):
    rng = np.random.default_rng(seed)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.997), eps=1e-9)
    model.train()
    for _ in range(steps):
        source, target_input, target_output = collate(
            [make_pair(rng) for _ in range(batch_size)])
        loss = model(encoder_input=source, decoder_input=target_input, labels=target_output)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


def main():
    torch.manual_seed(0)
    model = Transformer(VOCAB)
    last_loss = train(model)
    print(f"trained: last label-smoothed loss {last_loss:.3f}")

    rng = np.random.default_rng(123)
    examples = [make_pair(rng) for _ in range(5)]
    # lengths of different sizes so that every row but the longest is padded
    examples[1] = ([5, 9], [10, 6])
    examples[3] = ([4, 7, 3, 11, 8, 6], [7, 9, 12, 4, 8, 5])
    source, target_input, target_output = collate(examples)
    src_lens = (source != 0).sum(1)
    tgt_lens = (target_output != 0).sum(1)
    print("source lengths", src_lens.tolist())

    with torch.no_grad():
        # 1) encoder over the padded batch == each source alone
        enc, enc_len = model.encode(source)
        for b in range(len(examples)):
            alone, _ = model.encode(source[b:b + 1, :src_lens[b]])
            err = (enc[b, :src_lens[b]] - alone[0]).abs().max().item()
            assert err < 1e-10, (b, err)

        # 2) teacher forcing over the padded batch == each pair alone
        out = model.decoder(memory=enc, memory_sequence_length=enc_len,
                            inputs=target_input, decoding_strategy="train_greedy")
        for b in range(len(examples)):
            s, t = src_lens[b], tgt_lens[b]
            enc_b, len_b = model.encode(source[b:b + 1, :s])
            out_b = model.decoder(memory=enc_b, memory_sequence_length=len_b,
                                  inputs=target_input[b:b + 1, :t],
                                  decoding_strategy="train_greedy")
            err = (out.logits[b, :t] - out_b.logits[0]).abs().max().item()
            assert err < 1e-10, (b, err)
        loss = model(encoder_input=source, decoder_input=target_input, labels=target_output)
        print(f"held-out loss {loss.item():.3f}")

        # 3) the cache the beam search carries, stepped one token at a time
        #    over the teacher-forced targets == the full teacher-forced pass
        memory_attention_bias = attention_bias_ignore_padding(
            1 - sequence_mask(enc_len, enc.size(1), dtype=torch.float32))
        cache = model.decoder._init_cache(enc, memory_attention_bias,
                                          beam_search_decoding=True,
                                          batch_size=source.size(0))
        for step in range(target_input.size(1)):
            times = target_input.new_full((source.size(0),), step)
            inputs = model.decoder.embed_tokens(target_input[:, step], times)
            step_logits, cache = model.decoder._inputs_to_outputs(inputs, cache)
            err = (step_logits - out.logits[:, step]).abs().max().item()
            assert err < 1e-10, (step, err)

        # 4) beam search over the padded batch == each sentence alone
        preds = model(encoder_input=source, beam_width=beam_width)
        best = preds['sample_id'][:, :, 0]
        n_correct = 0
        for b in range(len(examples)):
            alone = model(encoder_input=source[b:b + 1, :src_lens[b]], beam_width=beam_width)
            hyp = best[b].tolist()
            hyp = hyp[:hyp.index(EOS_ID) + 1] if EOS_ID in hyp else hyp
            hyp_alone = alone['sample_id'][0, :, 0].tolist()
            hyp_alone = hyp_alone[:hyp_alone.index(EOS_ID) + 1] if EOS_ID in hyp_alone else hyp_alone
            assert hyp == hyp_alone, (b, hyp, hyp_alone)
            score = preds['log_prob'][b, 0].item()
            assert abs(score - alone['log_prob'][0, 0].item()) < 1e-9, b

            # 5) the best hypothesis' score == its length-penalised log-probability,
            #    re-scored by one teacher-forced pass over the source alone
            assert hyp[-1] == EOS_ID, hyp
            dec_in = torch.tensor([[BOS_ID] + hyp[:-1]])
            enc_b, len_b = model.encode(source[b:b + 1, :src_lens[b]])
            logits = model.decoder(memory=enc_b, memory_sequence_length=len_b,
                                   inputs=dec_in, decoding_strategy="train_greedy").logits
            lp = F.log_softmax(logits[0], dim=-1).gather(1, torch.tensor(hyp)[:, None]).sum()
            penalty = ((5.0 + len(hyp)) / 6.0) ** length_penalty
            assert abs(lp.item() / penalty - score) < 1e-9, (b, lp.item() / penalty, score)

            n_correct += hyp[:-1] == examples[b][1]
            print(f"src {examples[b][0]} -> {hyp[:-1]} (ref {examples[b][1]}) score {score:.4f}")
    print(f"{n_correct}/{len(examples)} exact translations")
    print("OK: padded batch == each sentence alone (encoder, teacher forcing, cached steps, beam search)")


if __name__ == "__main__":
    main()
