# Citation: huggingface/text-generation-inference
#   server/text_generation_server/models/causal_lm.py @db931fcf42da018a3657580c64bf2720f167f9ab (file last changed in
#   2003d8be0c02a59cecafc035090f8bcdd64b85d9): CausalLMBatch.from_pb / filter / concatenate, CausalLM.forward,
#   CausalLM.generate_token; server/text_generation_server/models/custom_modeling/opt_modeling.py (file last changed
#   in 3bb3fd19ae115484878e421649dba4b9549aa42a): _make_causal_mask, _expand_mask, OPTLearnedPositionalEmbedding,
#   OPTAttention, OPTDecoderLayer, OPTDecoder._prepare_decoder_attention_mask / forward, OPTForCausalLM.
#   The tensor-parallel layers are world-size-1 shims that load the same tensors; the tokenizer is replaced by token
#   lists left-padded with pad_token_id the way TGI's tokenizer (padding_side="left") pads them; greedy choosers.
# TGI's non-flash CausalLM serves a batch of left-padded requests. from_pb allocates attention_mask with
# padding_right_offset extra zero columns (room for max_new_tokens); each generate_token slices those off
# (`attention_mask[:, :-padding_right_offset]`), then writes a 1 into the next column for the token just chosen.
# concatenate() joins a running batch with a newly prefilled one: the shorter batch is left-padded (zeros in the
# attention mask, zero past K/V at the front), past length max_input_length - 1. filter() drops finished requests and
# slices the left padding they no longer need out of the mask and the past. OPT takes no position_ids: its learned
# positions come from cumsum(attention_mask), and its decoder adds _expand_mask(attention_mask) to the causal mask.
# Self-check: every request's prompt + generated tokens run alone (one row, no padding, no mask argument) by
# transformers' OPTForCausalLM with the same weights: the logits behind every generated token and the greedy tokens.
import math
import random
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn
from transformers import OPTConfig
from transformers import OPTForCausalLM as HFOPTForCausalLM
from transformers.activations import ACT2FN
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

torch.manual_seed(0)
EPS = 1e-5


# ---- world-size-1 stand-ins for text_generation_server.layers / utils.Weights ----
class _PG:
    def size(self):
        return 1

    def rank(self):
        return 0


class Weights:
    def __init__(self, tensors):
        self.routing = tensors
        self.process_group = _PG()

    def get_tensor(self, name):
        return self.routing[name]


class FastLinear(nn.Module):
    def __init__(self, weight, bias):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None

    @classmethod
    def load(cls, config, prefix, weights, bias):
        return cls(weights.get_tensor(f"{prefix}.weight"), weights.get_tensor(f"{prefix}.bias") if bias else None)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias)


TensorParallelColumnLinear = FastLinear
TensorParallelRowLinear = FastLinear


class TensorParallelEmbedding(nn.Module):
    def __init__(self, prefix, weights):
        super().__init__()
        self.weight = nn.Parameter(weights.get_tensor(f"{prefix}.weight"), requires_grad=False)

    def forward(self, input_ids):
        return F.embedding(input_ids, self.weight)


class SpeculativeHead(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    @classmethod
    def load(cls, config, prefix, weights):
        return cls(weights.get_tensor(f"{prefix}.weight"))

    def forward(self, x):
        return F.linear(x, self.weight), None


def _layer_norm_load(prefix, weights, eps):
    ln = nn.LayerNorm(weights.get_tensor(f"{prefix}.weight").shape[0], eps=eps)
    ln.weight = nn.Parameter(weights.get_tensor(f"{prefix}.weight"), requires_grad=False)
    ln.bias = nn.Parameter(weights.get_tensor(f"{prefix}.bias"), requires_grad=False)
    return ln


nn.LayerNorm.load = staticmethod(_layer_norm_load)       # TGI patches nn.LayerNorm.load the same way


# ---- custom_modeling/opt_modeling.py ----
def _make_causal_mask(input_ids_shape, dtype, device, past_key_values_length: int = 0):
    bsz, tgt_len = input_ids_shape
    mask = torch.full((tgt_len, tgt_len), torch.tensor(torch.finfo(dtype).min, device=device), device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)
    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def _expand_mask(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    bsz, src_len = mask.size()
    tgt_len = tgt_len if tgt_len is not None else src_len
    expanded_mask = mask[:, None, None, :].expand(bsz, 1, tgt_len, src_len).to(dtype)
    inverted_mask = 1.0 - expanded_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(dtype).min)


class OPTLearnedPositionalEmbedding(nn.Module):
    def __init__(self, prefix: str, weights):
        super().__init__()
        self.offset = 2
        self.weight = nn.Parameter(
            weights.get_tensor(f"{prefix if prefix else ''}decoder.embed_positions.weight"), requires_grad=False)

    def forward(self, attention_mask: torch.LongTensor, past_key_values_length: int = 0):
        attention_mask = attention_mask.long()
        # create positions depending on attention_mask
        positions = (torch.cumsum(attention_mask, dim=1).type_as(attention_mask) * attention_mask).long() - 1
        # cut positions if `past_key_values_length` is > 0
        positions = positions[:, past_key_values_length:]
        return torch.nn.functional.embedding(positions + self.offset, self.weight)


class OPTAttention(nn.Module):
    def __init__(self, config, prefix, weights, is_decoder: bool = False, bias: bool = True):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.dropout = config.dropout
        self.head_dim = self.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.is_decoder = is_decoder
        process_group = weights.process_group
        self.num_heads = self.num_heads // process_group.size()
        self.hidden_size = self.hidden_size // process_group.size()
        self.q_proj = TensorParallelColumnLinear.load(config, prefix=f"{prefix}.q_proj", weights=weights, bias=bias)
        self.k_proj = TensorParallelColumnLinear.load(config, prefix=f"{prefix}.k_proj", weights=weights, bias=bias)
        self.v_proj = TensorParallelColumnLinear.load(config, prefix=f"{prefix}.v_proj", weights=weights, bias=bias)
        self.out_proj = TensorParallelRowLinear.load(config, prefix=f"{prefix}.out_proj", weights=weights,
                                                     bias=bias)

    def _shape(self, tensor: torch.Tensor, seq_len: int, bsz: int):
        return tensor.view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2).contiguous()

    def forward(self, hidden_states, key_value_states=None, past_key_value=None, attention_mask=None,
                layer_head_mask=None, output_attentions: bool = False):
        bsz, tgt_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states) * self.scaling
        if past_key_value is not None:
            # reuse k, v, self_attention
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)
        else:
            key_states = self._shape(self.k_proj(hidden_states), -1, bsz)
            value_states = self._shape(self.v_proj(hidden_states), -1, bsz)
        if self.is_decoder:
            past_key_value = (key_states, value_states)

        proj_shape = (bsz * self.num_heads, -1, self.head_dim)
        query_states = self._shape(query_states, tgt_len, bsz).view(*proj_shape)
        key_states = key_states.view(*proj_shape)
        value_states = value_states.view(*proj_shape)

        src_len = key_states.size(1)
        attn_weights = torch.bmm(query_states, key_states.transpose(1, 2))
        if attention_mask is not None:
            if attention_mask.size() != (bsz, 1, tgt_len, src_len):
                raise ValueError(f"Attention mask should be of size {(bsz, 1, tgt_len, src_len)}, "
                                 f"but is {attention_mask.size()}")
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len) + attention_mask
            attn_weights = torch.max(attn_weights, torch.tensor(torch.finfo(attn_weights.dtype).min))
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_probs = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        attn_output = torch.bmm(attn_probs, value_states)
        attn_output = attn_output.view(bsz, self.num_heads, tgt_len, self.head_dim).transpose(1, 2)
        attn_output = attn_output.reshape(bsz, tgt_len, self.hidden_size)
        attn_output = self.out_proj(attn_output)
        return attn_output, None, past_key_value


class OPTDecoderLayer(nn.Module):
    def __init__(self, layer_id: int, prefix: str, config: OPTConfig, weights):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.self_attn = OPTAttention(config, prefix=f"{prefix}.self_attn", weights=weights, is_decoder=True,
                                      bias=config.enable_bias)
        self.do_layer_norm_before = config.do_layer_norm_before
        self.dropout = config.dropout
        self.activation_fn = ACT2FN[config.activation_function]
        self.self_attn_layer_norm = nn.LayerNorm.load(prefix=f"{prefix}.self_attn_layer_norm", weights=weights,
                                                      eps=EPS)
        self.fc1 = TensorParallelColumnLinear.load(config, prefix=f"{prefix}.fc1", weights=weights,
                                                   bias=config.enable_bias)
        self.fc2 = TensorParallelRowLinear.load(config, prefix=f"{prefix}.fc2", weights=weights,
                                                bias=config.enable_bias)
        self.final_layer_norm = nn.LayerNorm.load(prefix=f"{prefix}.final_layer_norm", weights=weights, eps=EPS)

    def forward(self, hidden_states, attention_mask=None, layer_head_mask=None, output_attentions=False,
                use_cache=False, past_key_value=None):
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states, self_attn_weights, present_key_value = self.self_attn(
            hidden_states=hidden_states, past_key_value=past_key_value, attention_mask=attention_mask,
            layer_head_mask=layer_head_mask, output_attentions=output_attentions)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = residual + hidden_states
        if not self.do_layer_norm_before:
            hidden_states = self.self_attn_layer_norm(hidden_states)
        hidden_states_shape = hidden_states.shape
        hidden_states = hidden_states.reshape(-1, hidden_states.size(-1))
        residual = hidden_states
        if self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        hidden_states = self.fc1(hidden_states)
        hidden_states = self.activation_fn(hidden_states)
        hidden_states = self.fc2(hidden_states)
        hidden_states = nn.functional.dropout(hidden_states, p=self.dropout, training=self.training)
        hidden_states = (residual + hidden_states).view(hidden_states_shape)
        if not self.do_layer_norm_before:
            hidden_states = self.final_layer_norm(hidden_states)
        outputs = (hidden_states,)
        if use_cache:
            outputs += (present_key_value,)
        return outputs


class OPTDecoder(nn.Module):
    def __init__(self, prefix: str, config: OPTConfig, weights):
        super().__init__()
        self.config = config
        self.layerdrop = config.layerdrop
        prefix = prefix + "." if prefix else ""
        self.embed_tokens = TensorParallelEmbedding(prefix=f"{prefix}decoder.embed_tokens", weights=weights)
        self.embed_positions = OPTLearnedPositionalEmbedding(prefix, weights)
        self.project_out = None
        self.project_in = None
        if config.do_layer_norm_before and not config._remove_final_layer_norm:
            self.final_layer_norm = nn.LayerNorm.load(prefix=f"{prefix}decoder.final_layer_norm", weights=weights,
                                                      eps=EPS)
        else:
            self.final_layer_norm = None
        self.layers = nn.ModuleList([
            OPTDecoderLayer(layer_id, prefix=f"{prefix}decoder.layers.{layer_id}", config=config, weights=weights)
            for layer_id in range(config.num_hidden_layers)])

    # Copied from transformers.models.bart.modeling_bart.BartDecoder._prepare_decoder_attention_mask
    def _prepare_decoder_attention_mask(self, attention_mask, input_shape, inputs_embeds, past_key_values_length):
        # create causal mask
        # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
        combined_attention_mask = None
        if input_shape[-1] > 1:
            combined_attention_mask = _make_causal_mask(input_shape, inputs_embeds.dtype,
                                                        device=inputs_embeds.device,
                                                        past_key_values_length=past_key_values_length)
        if attention_mask is not None:
            # [bsz, seq_len] -> [bsz, 1, tgt_seq_len, src_seq_len]
            expanded_attn_mask = _expand_mask(attention_mask, inputs_embeds.dtype,
                                              tgt_len=input_shape[-1]).to(inputs_embeds.device)
            combined_attention_mask = (expanded_attn_mask if combined_attention_mask is None
                                       else expanded_attn_mask + combined_attention_mask)
        return combined_attention_mask

    def forward(self, input_ids=None, attention_mask=None, head_mask=None, past_key_values=None,
                inputs_embeds=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None):
        input_shape = input_ids.size()
        input_ids = input_ids.view(-1, input_shape[-1])
        inputs_embeds = self.embed_tokens(input_ids)
        batch_size, seq_length = input_shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        # required mask seq length can be calculated via length of past
        mask_seq_length = past_key_values_length + seq_length
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, mask_seq_length, device=inputs_embeds.device)
        causal_attention_mask = self._prepare_decoder_attention_mask(attention_mask, input_shape, inputs_embeds,
                                                                     past_key_values_length)
        pos_embeds = self.embed_positions(attention_mask, past_key_values_length)
        hidden_states = inputs_embeds + pos_embeds
        next_decoder_cache = () if use_cache else None
        for idx, decoder_layer in enumerate(self.layers):
            dropout_probability = random.uniform(0, 1)
            if self.training and (dropout_probability < self.layerdrop):
                continue
            past_key_value = past_key_values[idx] if past_key_values is not None else None
            layer_outputs = decoder_layer(hidden_states, attention_mask=causal_attention_mask,
                                          layer_head_mask=(head_mask[idx] if head_mask is not None else None),
                                          past_key_value=past_key_value, output_attentions=output_attentions,
                                          use_cache=use_cache)
            hidden_states = layer_outputs[0]
            if use_cache:
                next_decoder_cache += (layer_outputs[1],)
        if self.final_layer_norm is not None:
            hidden_states = self.final_layer_norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=next_decoder_cache)


class OPTModel(nn.Module):
    def __init__(self, prefix: str, config: OPTConfig, weights):
        super().__init__()
        self.decoder = OPTDecoder(prefix, config, weights)


class OPTForCausalLM(nn.Module):
    def __init__(self, prefix, config, weights):
        super().__init__()
        self.config = config
        if not prefix and any(s.startswith("model") for s in weights.routing.keys()):
            prefix = "model"
        self.model = OPTModel(prefix, config, weights)
        self.lm_head = SpeculativeHead.load(config, prefix=f"{prefix + '.' if prefix else ''}decoder.embed_tokens",
                                            weights=weights)

    def forward(self, input_ids=None, attention_mask=None, head_mask=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None,
                output_hidden_states=None, return_dict=None):
        outputs = self.model.decoder(input_ids=input_ids, attention_mask=attention_mask, head_mask=head_mask,
                                     past_key_values=past_key_values, inputs_embeds=inputs_embeds,
                                     use_cache=use_cache, output_attentions=output_attentions,
                                     output_hidden_states=output_hidden_states, return_dict=return_dict)
        logits, speculative_logits = self.lm_head(outputs.last_hidden_state)
        return (CausalLMOutputWithPast(loss=None, logits=logits, past_key_values=outputs.past_key_values),
                speculative_logits)


# ---- request / chooser / stopping stand-ins (generate_pb2.Request, NextTokenChooser, StoppingCriteria) ----
@dataclass
class Request:
    id: int
    input_ids: List[int]
    max_new_tokens: int


class NextTokenChooser:
    def __call__(self, input_ids, scores):
        logprobs = torch.log_softmax(scores, -1)
        next_id = scores.argmax(dim=-1).view(1, 1)
        return next_id.view(1), logprobs


class StoppingCriteria:
    def __init__(self, max_new_tokens):
        self.max_new_tokens = max_new_tokens
        self.current_tokens = 0

    def __call__(self, last_token, last_output):
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return True, "length"
        return False, None


def tokenize_left_padded(inputs: List[List[int]], pad_token_id: int):
    # AutoTokenizer(padding_side="left")(inputs, padding=True, return_tensors="pt")
    longest = max(len(x) for x in inputs)
    ids = torch.full((len(inputs), longest), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), longest), dtype=torch.long)
    for i, x in enumerate(inputs):
        ids[i, longest - len(x):] = torch.tensor(x)
        mask[i, longest - len(x):] = 1
    return {"input_ids": ids, "attention_mask": mask}


# ---- models/causal_lm.py ----
@dataclass
class CausalLMBatch:
    batch_id: int
    requests: List[Request]
    requests_idx_mapping: Dict[int, int]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: Optional[List[Tuple]]
    all_input_ids: List[torch.Tensor]
    input_lengths: List[int]
    next_token_choosers: List[NextTokenChooser]
    stopping_criterias: List[StoppingCriteria]
    max_input_length: int
    padding_right_offset: int
    max_tokens: int
    keys_head_dim_last: bool = True

    @classmethod
    def from_pb(cls, batch_id, requests, pad_token_id, device=torch.device("cpu")):
        inputs = []
        next_token_choosers = []
        stopping_criterias = []
        requests_idx_mapping = {}
        padding_right_offset = 0
        max_decode_tokens = 0
        for i, r in enumerate(requests):
            requests_idx_mapping[r.id] = i
            inputs.append(r.input_ids)
            next_token_choosers.append(NextTokenChooser())
            stopping_criteria = StoppingCriteria(r.max_new_tokens)
            stopping_criterias.append(stopping_criteria)
            max_decode_tokens += stopping_criteria.max_new_tokens
            padding_right_offset = max(padding_right_offset, stopping_criteria.max_new_tokens)

        tokenized_inputs = tokenize_left_padded(inputs, pad_token_id)
        input_lengths = tokenized_inputs["attention_mask"].sum(1)
        max_input_length = input_lengths.max()

        input_ids = tokenized_inputs["input_ids"]
        # Allocate maximum attention_mask
        attention_mask = input_ids.new_zeros((len(requests), max_input_length + padding_right_offset))
        # Copy tokenizer attention_mask into fully allocated attention_mask
        attention_mask[:, :max_input_length] = tokenized_inputs["attention_mask"]

        position_ids = tokenized_inputs["attention_mask"].long().cumsum(-1) - 1
        position_ids.masked_fill_(tokenized_inputs["attention_mask"] == 0, 1)
        all_input_ids = tokenized_inputs["input_ids"].T.split(1, dim=1)
        max_tokens = len(inputs) * (max_input_length + max_decode_tokens)

        return cls(batch_id=batch_id, requests=requests, requests_idx_mapping=requests_idx_mapping,
                   input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=None, all_input_ids=list(all_input_ids), input_lengths=input_lengths.tolist(),
                   next_token_choosers=next_token_choosers, stopping_criterias=stopping_criterias,
                   max_input_length=max_input_length.item(), padding_right_offset=padding_right_offset,
                   max_tokens=max_tokens)

    def filter(self, request_ids: List[int]) -> Optional["CausalLMBatch"]:
        if len(request_ids) == 0:
            raise ValueError("Batch must have at least one request")
        if len(request_ids) == len(self):
            return self

        keep_indices = []
        requests_idx_mapping = {}
        requests = []
        input_lengths = []
        all_input_ids = []
        max_input_length = 0
        next_token_choosers = []
        stopping_criterias = []
        total_remaining_decode_tokens = 0
        new_padding_right_offset = 0

        for i, request_id in enumerate(request_ids):
            idx = self.requests_idx_mapping[request_id]
            requests_idx_mapping[request_id] = i
            keep_indices.append(idx)
            requests.append(self.requests[idx])
            all_input_ids.append(self.all_input_ids[idx])
            request_input_length = self.input_lengths[idx]
            input_lengths.append(request_input_length)
            max_input_length = max(max_input_length, request_input_length)
            next_token_choosers.append(self.next_token_choosers[idx])
            stopping_criteria = self.stopping_criterias[idx]
            stopping_criterias.append(stopping_criteria)
            remaining_decode_tokens = stopping_criteria.max_new_tokens - stopping_criteria.current_tokens
            total_remaining_decode_tokens += remaining_decode_tokens
            new_padding_right_offset = max(new_padding_right_offset, remaining_decode_tokens)

        # Apply indices to input_ids, attention mask, past key values and other items that need to be cached
        input_ids = self.input_ids[keep_indices]
        position_ids = self.position_ids[keep_indices]
        self.attention_mask = self.attention_mask[
            keep_indices,
            -(self.padding_right_offset + max_input_length):
            (self.attention_mask.shape[1] - self.padding_right_offset) + new_padding_right_offset,
        ]

        # Ensure that past_key_values tensors can be updated in-place
        if type(self.past_key_values[0]) is tuple:
            self.past_key_values = [list(layer) for layer in self.past_key_values]

        # Update tensors in-place to allow incremental garbage collection
        past_kv_length = max_input_length - 1
        for layer in self.past_key_values:
            past_keys, past_values = layer
            if len(past_keys.shape) == 3:
                past_keys = past_keys.view(len(self), -1, *past_keys.shape[-2:])
                past_values = past_values.view(len(self), -1, *past_values.shape[-2:])
            if self.keys_head_dim_last:
                layer[0] = past_keys[keep_indices, :, -past_kv_length:, :]
            else:
                layer[0] = past_keys[keep_indices, :, :, -past_kv_length:]
            del past_keys
            layer[1] = past_values[keep_indices, :, -past_kv_length:, :]
            del past_values

        max_tokens = len(request_ids) * max_input_length + total_remaining_decode_tokens

        self.requests = requests
        self.requests_idx_mapping = requests_idx_mapping
        self.input_ids = input_ids
        self.position_ids = position_ids
        self.all_input_ids = all_input_ids
        self.input_lengths = input_lengths
        self.next_token_choosers = next_token_choosers
        self.stopping_criterias = stopping_criterias
        self.max_input_length = max_input_length
        self.padding_right_offset = new_padding_right_offset
        self.max_tokens = max_tokens
        return self

    @classmethod
    def concatenate(cls, batches: List["CausalLMBatch"]) -> "CausalLMBatch":
        # Used for padding
        total_batch_size = 0
        max_input_length = 0
        padding_right_offset = 0
        for batch in batches:
            total_batch_size += len(batch)
            max_input_length = max(max_input_length, batch.max_input_length)
            padding_right_offset = max(padding_right_offset, batch.padding_right_offset)

        requests = []
        requests_idx_mapping = {}
        input_lengths = []
        all_input_ids = []
        next_token_choosers = []
        stopping_criterias = []
        max_tokens = 0

        input_ids = None
        attention_mask = None
        position_ids = None
        past_key_values = []

        start_index = 0
        for i, batch in enumerate(batches):
            requests.extend(batch.requests)
            input_lengths.extend(batch.input_lengths)
            all_input_ids.extend(batch.all_input_ids)
            next_token_choosers.extend(batch.next_token_choosers)
            stopping_criterias.extend(batch.stopping_criterias)

            if i == 0:
                requests_idx_mapping = batch.requests_idx_mapping
            else:
                # We need to offset the mapping for each batch by the cumulative batch size
                for k, v in batch.requests_idx_mapping.items():
                    requests_idx_mapping[k] = v + start_index

            end_index = start_index + len(batch)

            if batch.past_key_values is None:
                raise ValueError("only concatenate prefilled batches")

            # input_ids is always of shape [batch_size, 1]
            if input_ids is None:
                input_ids = batch.input_ids.new_empty((total_batch_size, 1))
            input_ids[start_index:end_index] = batch.input_ids

            # Create padded tensor
            if attention_mask is None:
                attention_mask = batch.attention_mask.new_zeros(
                    (total_batch_size, max_input_length + padding_right_offset))

            # We need to slice the attention mask to remove padding from previous steps
            # and to remove unused allocated space
            left_offset = max_input_length - batch.max_input_length
            batch_left_offset = batch.attention_mask.shape[1] - batch.max_input_length - batch.padding_right_offset
            attention_mask[start_index:end_index, left_offset:-padding_right_offset] = batch.attention_mask[
                :, batch_left_offset: -batch.padding_right_offset]

            # position_ids is always of shape [batch_size, 1]
            if position_ids is None:
                position_ids = batch.position_ids.new_empty((total_batch_size, 1))
            position_ids[start_index:end_index] = batch.position_ids

            if isinstance(batch.past_key_values[0], tuple):
                batch.past_key_values = [[t.view(len(batch), -1, *t.shape[-2:]) for t in layer]
                                         for layer in batch.past_key_values]
            elif len(batch.past_key_values[0][0].shape) == 3:
                for layer in batch.past_key_values:
                    for k, t in enumerate(layer):
                        layer[k] = t.view(len(batch), -1, *t.shape[-2:])

            # Add eventual padding tokens that were added while concatenating
            max_tokens += batch.max_tokens + (max_input_length - batch.max_input_length) * len(batch)
            start_index = end_index

        first_past_kvs = batches[0].past_key_values
        _, num_heads, padded_sequence_length, head_dim = first_past_kvs[0][1].shape
        padded_past_values_shape = (total_batch_size, num_heads, max_input_length - 1, head_dim)
        padded_past_keys_shape = padded_past_values_shape

        # Iterate over attention layers
        for j in range(len(first_past_kvs)):
            padded_past_keys = first_past_kvs[j][0].new_zeros(padded_past_keys_shape)
            start_index = 0
            for batch in batches:
                past_keys = batch.past_key_values[j][0]
                batch.past_key_values[j][0] = None
                end_index = start_index + len(batch)
                # We slice the keys to remove the padding from previous batches
                past_seq_len = batch.max_input_length - 1
                padded_past_keys[start_index:end_index, :, -past_seq_len:, :] = past_keys[:, :, -past_seq_len:, :]
                del past_keys
                start_index = end_index

            padded_past_values = first_past_kvs[j][1].new_zeros(padded_past_values_shape)
            start_index = 0
            for batch in batches:
                past_values = batch.past_key_values[j][1]
                batch.past_key_values[j][1] = None
                end_index = start_index + len(batch)
                past_seq_len = batch.max_input_length - 1
                padded_past_values[start_index:end_index, :, -past_seq_len:, :] = \
                    past_values[:, :, -past_seq_len:, :]
                del past_values
                start_index = end_index

            past_key_values.append([padded_past_keys, padded_past_values])

        return cls(batch_id=batches[0].batch_id, requests=requests, requests_idx_mapping=requests_idx_mapping,
                   input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   past_key_values=past_key_values, all_input_ids=all_input_ids, input_lengths=input_lengths,
                   next_token_choosers=next_token_choosers, stopping_criterias=stopping_criterias,
                   max_input_length=max_input_length, padding_right_offset=padding_right_offset,
                   keys_head_dim_last=batches[0].keys_head_dim_last, max_tokens=max_tokens)

    def __len__(self):
        return len(self.requests)


class CausalLM:
    def __init__(self, model):
        self.model = model
        # Model.__init__: position_ids are passed only if the model's forward takes them (OPT's does not)
        import inspect
        self.has_position_ids = inspect.signature(model.forward).parameters.get("position_ids", None) is not None
        self.step_logits = {}

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values,
                  "use_cache": True, "return_dict": True}
        if self.has_position_ids:
            kwargs["position_ids"] = position_ids
        outputs = self.model.forward(**kwargs)
        if isinstance(outputs, tuple):
            outputs, speculative_logits = outputs
        else:
            speculative_logits = None
        return outputs.logits, speculative_logits, outputs.past_key_values

    @torch.no_grad()
    def generate_token(self, batch: CausalLMBatch):
        # slice the attention mask to the correct shape
        attention_mask = batch.attention_mask[:, : -batch.padding_right_offset]
        logits, speculative_logits, past = self.forward(batch.input_ids, attention_mask, batch.position_ids,
                                                        batch.past_key_values)
        generations = []
        stopped = True
        iterator = zip(batch.requests, batch.input_lengths, logits, batch.next_token_choosers,
                       batch.stopping_criterias, batch.all_input_ids)
        for i, (request, input_length, logits, next_token_chooser, stopping_criteria, all_input_ids) in \
                enumerate(iterator):
            # Select next token
            next_token_id, logprobs = next_token_chooser(all_input_ids.view(1, -1), logits[-1:, :])
            self.step_logits.setdefault(request.id, []).append(logits[-1].clone())
            # Append next token to all tokens
            all_input_ids = torch.cat([all_input_ids, next_token_id.view(1, 1)])
            new_input_length = input_length + 1
            next_token_id_squeezed = next_token_id.squeeze()
            stop, reason = stopping_criteria(next_token_id_squeezed, None)
            if not stop:
                stopped = False
            generations.append((request.id, int(next_token_id_squeezed), stop))

            batch.input_ids[i, 0] = next_token_id
            batch.all_input_ids[i] = all_input_ids
            batch.input_lengths[i] = new_input_length
            batch.max_input_length = max(batch.max_input_length, new_input_length)

        # We finished all generations in the batch; there is no next batch
        if stopped:
            return generations, None

        # Slice unused values from prefill
        batch.input_ids = batch.input_ids[:, :1]
        # Update attention_mask as we added a new token to input_ids
        batch.attention_mask[:, -batch.padding_right_offset] = 1
        # Decrease right offset
        batch.padding_right_offset -= 1
        # Update position_ids
        batch.position_ids = batch.position_ids[:, -1:] + 1
        # Update past key values
        batch.past_key_values = past
        return generations, batch


# ---- a tiny OPT with weights drawn large enough that greedy picks are clear ----
config = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                   max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=1, dropout=0.0)
hf_model = HFOPTForCausalLM(config).eval()
with torch.no_grad():
    for name, p in hf_model.named_parameters():
        if name.endswith("weight") and p.dim() == 2:
            p.normal_(0.0, 0.3)
        elif "layer_norm" in name and name.endswith("weight"):
            p.normal_(1.0, 0.1)
        else:
            p.normal_(0.0, 0.1)
state = {k: v.clone() for k, v in hf_model.state_dict().items()}
state.setdefault("lm_head.weight", state["model.decoder.embed_tokens.weight"])
model = OPTForCausalLM("", config, Weights(state)).eval()
server = CausalLM(model)

# ---- a router-like schedule: prefill A, decode, prefill B, concatenate, decode, filter finished, decode ----
g = torch.Generator().manual_seed(3)
rand_prompt = lambda n: torch.randint(2, config.vocab_size, (n,), generator=g).tolist()
req = {0: Request(0, rand_prompt(5), 7), 1: Request(1, rand_prompt(2), 3), 2: Request(2, rand_prompt(9), 5),
       3: Request(3, rand_prompt(4), 6)}
generated = {i: [] for i in req}


def run_step(batch):
    gens, batch = server.generate_token(batch)
    for rid, tok, stop in gens:
        generated[rid].append(tok)
    if batch is not None:
        keep = [rid for rid, tok, stop in gens if not stop]
        if len(keep) < len(batch):
            batch = batch.filter(keep)
    return batch


batch_a = CausalLMBatch.from_pb(0, [req[0], req[1]], config.pad_token_id)
batch_a = run_step(batch_a)                     # prefill
batch_a = run_step(batch_a)                     # decode 1
batch_b = CausalLMBatch.from_pb(1, [req[2], req[3]], config.pad_token_id)
batch_b = run_step(batch_b)                     # prefill of the second batch
assert batch_a.max_input_length != batch_b.max_input_length
batch = CausalLMBatch.concatenate([batch_a, batch_b])
n_filters = 0
while batch is not None:
    before = len(batch)
    batch = run_step(batch)
    if batch is not None and len(batch) < before:
        n_filters += 1
assert n_filters >= 1

# ---- reference: each request alone, one row, no padding, no mask argument ----
with torch.no_grad():
    for rid, r in req.items():
        assert len(generated[rid]) == r.max_new_tokens, (rid, generated[rid])
        full = r.input_ids + generated[rid][:-1]
        ref = hf_model(input_ids=torch.tensor([full])).logits[0]
        start = len(r.input_ids) - 1
        served = server.step_logits[rid]
        for t, tok in enumerate(generated[rid]):
            assert torch.allclose(served[t], ref[start + t], atol=1e-4), (rid, t, (served[t] - ref[start + t]).abs().max())
            assert tok == int(ref[start + t].argmax()), (rid, t)
        print(f"request {rid}: prompt {len(r.input_ids)} tokens, generated {generated[rid]}")
print("ok")
