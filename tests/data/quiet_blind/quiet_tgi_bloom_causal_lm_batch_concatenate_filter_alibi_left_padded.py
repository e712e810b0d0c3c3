"""text-generation-inference's non-flash BLOOM server path: left-padded batches, a key/value cache, and ALiBi
positions counted from the first real token, with batches concatenated and filtered between decode steps.

Ported from huggingface/text-generation-inference:
  server/text_generation_server/models/custom_modeling/bloom_modeling.py @15bf3d4944c701d1db611e307ebdacf8a966c319
    (build_alibi_tensor with arange_tensor = ((attention_mask.cumsum(-1) - 1) * attention_mask), _make_causal_mask,
    _expand_mask, BloomModel._prepare_attn_mask, BloomAttention.compute_attention: alibi.baddbmm then
    masked_fill_(mask, finfo.min), the BLOOM cache layout keys [B * H, head_dim, kv] / values [B * H, kv, head_dim])
  server/text_generation_server/models/causal_lm.py @00359fcdc5cca7e802cdc7ade953440bb496f0ef
    (CausalLMBatch.from_pb / filter / concatenate, CausalLM.generate_token; BloomCausalLMBatch sets
    keys_head_dim_last = False)
The tensor-parallel layers are plain nn.Linear / nn.Embedding (world size 1), the tokenizer is a stand-in that pads
on the left as TGI asks for (padding_side="left"), and the next-token chooser is greedy. The router's schedule is
played by hand: a first batch is prefilled and decoded, a second batch is prefilled and concatenated onto it, and
finished requests are filtered out after every step. Every request's tokens and logits are checked against an
unpadded, uncached run of the same weights with the ALiBi bias written as -slope * (i - j).
"""
import math
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.nn import LayerNorm
from torch.nn import functional as F
from transformers import BloomConfig


def _make_causal_mask(input_ids_shape: torch.Size, device: torch.device, past_key_values_length: int) -> torch.BoolTensor:
    """
    Make causal mask used for self-attention.
    """
    batch_size, target_length = input_ids_shape
    mask = torch.ones((target_length, target_length + past_key_values_length), dtype=torch.bool, device=device)
    mask = mask.triu(1 + past_key_values_length)

    expanded_mask = mask.unsqueeze(0).expand(batch_size, target_length, target_length + past_key_values_length)
    return expanded_mask


def _expand_mask(mask: torch.Tensor, tgt_length: int) -> torch.BoolTensor:
    """
    Expands attention_mask from `[batch_size, src_length]` to `[batch_size, 1, tgt_length, src_length]`.
    """
    batch_size, src_length = mask.shape
    tgt_length = tgt_length if tgt_length is not None else src_length

    expanded_mask = ~(mask[:, None, :].to(torch.bool))
    return expanded_mask.expand(batch_size, tgt_length, src_length)


def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Returns tensor shaped (batch_size, num_heads, max_seq_len); relies on softmax(l + a) = softmax(l)."""
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(
        2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
    )
    powers = torch.arange(1, 1 + closest_power_of_2, device=attention_mask.device, dtype=torch.int32)
    slopes = torch.pow(base, powers)

    if closest_power_of_2 != num_heads:
        extra_base = torch.tensor(
            2 ** (-(2 ** -(math.log2(2 * closest_power_of_2) - 3))), device=attention_mask.device, dtype=torch.float32
        )
        num_remaining_heads = min(closest_power_of_2, num_heads - closest_power_of_2)
        extra_powers = torch.arange(1, 1 + 2 * num_remaining_heads, 2, device=attention_mask.device, dtype=torch.int32)
        slopes = torch.cat([slopes, torch.pow(extra_base, extra_powers)], dim=0)

    # alibi is added to the query/key product: (batch_size, num_heads, 1, key_length), broadcast over queries
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi


def _split_heads(fused_qkv: torch.Tensor, num_heads: int, head_dim: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    batch_size, seq_length, three_times_hidden_size = fused_qkv.shape
    fused_qkv = fused_qkv.view(batch_size, seq_length, num_heads, 3 * head_dim)
    query_layer, key_layer, value_layer = fused_qkv.split(head_dim, dim=-1)

    query_layer = query_layer.transpose(1, 2).reshape(batch_size * num_heads, seq_length, head_dim)
    key_layer = key_layer.permute(0, 2, 3, 1).reshape(batch_size * num_heads, head_dim, seq_length)
    value_layer = value_layer.transpose(1, 2).reshape(batch_size * num_heads, seq_length, head_dim)

    return query_layer, key_layer, value_layer


def _merge_heads(x: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    batch_size_and_num_heads, seq_length, _ = x.shape
    batch_size = batch_size_and_num_heads // num_heads
    x = x.view(batch_size, num_heads, seq_length, head_dim)
    x = x.permute(0, 2, 1, 3)
    return x.reshape(batch_size, seq_length, num_heads * head_dim)


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.n_head
        self.head_dim = self.hidden_size // self.num_heads
        # Layer-wise attention scaling
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(self.hidden_size, 3 * self.hidden_size, bias=True)
        self.dense = nn.Linear(self.hidden_size, self.hidden_size, bias=True)

    @staticmethod
    def compute_attention(fused_qkv, layer_past, alibi, attention_mask, head_mask, beta, inv_norm_factor, num_heads, use_cache):
        batch_size, q_length, three_times_hidden_size = fused_qkv.shape
        head_dim = three_times_hidden_size // (3 * num_heads)

        # 3 x [batch_size * num_heads, ...]
        (query_layer, key_layer, value_layer) = _split_heads(fused_qkv, num_heads=num_heads, head_dim=head_dim)

        if layer_past is not None:
            past_key, past_value = layer_past
            # concatenate along seq_length dimension:
            #  - key: [batch_size * self.num_heads, head_dim, kv_length]
            #  - value: [batch_size * self.num_heads, kv_length, head_dim]
            past_key = past_key.view(-1, *past_key.shape[-2:])
            key_layer = torch.cat((past_key, key_layer), dim=2)
            past_value = past_value.view(-1, *past_value.shape[-2:])
            value_layer = torch.cat((past_value, value_layer), dim=1)

        if use_cache is True:
            present = (key_layer, value_layer)
        else:
            present = None

        # [batch_size * num_heads, q_length, kv_length]
        attention_scores = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=beta, alpha=inv_norm_factor)

        input_dtype = attention_scores.dtype
        if input_dtype == torch.float16:
            attention_scores = attention_scores.to(torch.float)
        attn_weights = attention_scores.masked_fill_(attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(input_dtype)

        if head_mask is not None:
            attention_probs = attention_probs * head_mask

        # [batch_size * num_heads, q_length, head_dim]
        context_layer = torch.bmm(attention_probs, value_layer, out=query_layer)
        context_layer = _merge_heads(context_layer, num_heads=num_heads, head_dim=head_dim)
        return context_layer, present, attention_probs

    def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, head_mask=None, use_cache=False):
        fused_qkv = self.query_key_value(hidden_states)  # [batch_size, seq_length, 3 x hidden_size]

        if layer_past is not None:
            past_key, past_value = layer_past
            layer_past = (past_key.view(-1, *past_key.shape[-2:]), past_value.view(-1, *past_value.shape[-2:]))

        context_layer, present, attention_probs = self.compute_attention(
            fused_qkv=fused_qkv,
            layer_past=layer_past,
            alibi=alibi,
            attention_mask=attention_mask,
            head_mask=head_mask,
            beta=self.beta,
            inv_norm_factor=self.inv_norm_factor,
            num_heads=self.num_heads,
            use_cache=use_cache,
        )
        output_tensor = self.dense(context_layer)
        output_tensor += residual
        return output_tensor, present


class BloomMLP(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, 4 * config.hidden_size, bias=True)
        self.dense_4h_to_h = nn.Linear(4 * config.hidden_size, config.hidden_size, bias=True)
        self.gelu_impl = torch.nn.GELU(approximate="tanh")

    def forward(self, hidden_states, residual):
        hidden_states = self.gelu_impl(self.dense_h_to_4h(hidden_states))
        intermediate_output = self.dense_4h_to_h(hidden_states)
        intermediate_output += residual
        return intermediate_output


class BloomBlock(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.input_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = BloomAttention(config)
        self.post_attention_layernorm = LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.mlp = BloomMLP(config)
        self.apply_residual_connection_post_layernorm = config.apply_residual_connection_post_layernorm

    def forward(self, hidden_states, alibi, attention_mask, layer_past=None, head_mask=None, use_cache=False):
        layernorm_output = self.input_layernorm(hidden_states)
        residual = layernorm_output if self.apply_residual_connection_post_layernorm else hidden_states

        attention_output, present = self.self_attention(
            layernorm_output,
            residual,
            layer_past=layer_past,
            attention_mask=attention_mask,
            alibi=alibi,
            head_mask=head_mask,
            use_cache=use_cache,
        )
        layernorm_output = self.post_attention_layernorm(attention_output)
        residual = layernorm_output if self.apply_residual_connection_post_layernorm else attention_output
        output = self.mlp(layernorm_output, residual)
        return output, present


class BloomModel(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.n_head
        self.word_embeddings = nn.Embedding(config.vocab_size, self.embed_dim)
        self.word_embeddings_layernorm = LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)
        self.h = nn.ModuleList([BloomBlock(config) for _ in range(config.num_hidden_layers)])
        self.ln_f = LayerNorm(self.embed_dim, eps=config.layer_norm_epsilon)

    def _prepare_attn_mask(self, attention_mask, input_shape, past_key_values_length) -> torch.BoolTensor:
        # [batch_size, seq_length] -> [batch_size, tgt_length, src_length]
        combined_attention_mask = None
        device = attention_mask.device
        _, src_length = input_shape

        if src_length > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape, device=device, past_key_values_length=past_key_values_length
            )

        expanded_attn_mask = _expand_mask(attention_mask, tgt_length=src_length)
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask | combined_attention_mask
        )
        return combined_attention_mask

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True):
        batch_size, seq_length = input_ids.shape
        if past_key_values is None:
            past_key_values = tuple([None] * len(self.h))

        inputs_embeds = self.word_embeddings(input_ids)
        hidden_states = self.word_embeddings_layernorm(inputs_embeds)
        presents = () if use_cache else None

        # Compute alibi tensor: check build_alibi_tensor documentation
        seq_length_with_past = seq_length
        past_key_values_length = 0
        if past_key_values[0] is not None:
            past_key_values_length = past_key_values[0][0].shape[-1]
            seq_length_with_past = seq_length_with_past + past_key_values_length
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, seq_length_with_past), device=hidden_states.device)
        else:
            attention_mask = attention_mask.to(hidden_states.device)

        alibi = build_alibi_tensor(attention_mask, self.num_heads)

        causal_mask = self._prepare_attn_mask(
            attention_mask, input_shape=(batch_size, seq_length), past_key_values_length=past_key_values_length
        )

        alibi = alibi.reshape(batch_size * self.num_heads, 1, seq_length_with_past)
        causal_mask = torch.repeat_interleave(causal_mask, self.num_heads, dim=0)
        alibi = alibi.to(hidden_states.dtype)

        for block, layer_past in zip(self.h, past_key_values):
            hidden_states, present = block(
                hidden_states, layer_past=layer_past, attention_mask=causal_mask, use_cache=use_cache, alibi=alibi
            )
            if use_cache is True:
                presents = presents + (present,)

        hidden_states = self.ln_f(hidden_states)
        return hidden_states, presents


class BloomForCausalLM(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.config = config
        self.transformer = BloomModel(config)

    def forward(self, input_ids, attention_mask=None, past_key_values=None, use_cache=True):
        hidden_states, presents = self.transformer(
            input_ids, past_key_values=past_key_values, attention_mask=attention_mask, use_cache=use_cache
        )
        # TensorParallelHead.load(prefix="word_embeddings"): the head is tied to the input embeddings
        logits = F.linear(hidden_states, self.transformer.word_embeddings.weight)
        return logits, presents


# ----------------------------------------------------------------------------------------------------------------
# Server side (causal_lm.py): requests, stopping criteria, the batch and its cache bookkeeping.


@dataclass
class Request:
    id: int
    inputs: List[int]
    max_new_tokens: int


class StoppingCriteria:
    def __init__(self, max_new_tokens: int):
        self.max_new_tokens = max_new_tokens
        self.current_tokens = 0

    def __call__(self, last_token: int) -> Tuple[bool, Optional[str]]:
        self.current_tokens += 1
        if self.current_tokens >= self.max_new_tokens:
            return True, "length"
        return False, None


class LeftPaddingTokenizer:
    """Stand-in for AutoTokenizer.from_pretrained(model_id, padding_side="left"): inputs arrive as token ids."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, inputs: List[List[int]]) -> Dict[str, torch.Tensor]:
        width = max(len(ids) for ids in inputs)
        input_ids = torch.full((len(inputs), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(inputs), width), dtype=torch.long)
        for i, ids in enumerate(inputs):
            input_ids[i, width - len(ids):] = torch.tensor(ids)
            attention_mask[i, width - len(ids):] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


@dataclass
class CausalLMBatch:
    batch_id: int
    requests: List[Request]
    requests_idx_mapping: Dict[int, int]

    # Decoder values
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: Optional[List[Tuple]]

    # All tokens
    all_input_ids: List[torch.Tensor]

    # Lengths of all generations present in the batch
    input_lengths: List[int]

    stopping_criterias: List[StoppingCriteria]

    # Metadata used for padding
    max_input_length: int
    padding_right_offset: int

    # Past metadata
    keys_head_dim_last: bool = True

    @classmethod
    def from_pb(cls, batch_id: int, requests: List[Request], tokenizer: LeftPaddingTokenizer) -> "CausalLMBatch":
        inputs = []
        stopping_criterias = []
        requests_idx_mapping = {}

        padding_right_offset = 0
        for i, r in enumerate(requests):
            requests_idx_mapping[r.id] = i
            inputs.append(r.inputs)
            stopping_criteria = StoppingCriteria(r.max_new_tokens)
            stopping_criterias.append(stopping_criteria)
            padding_right_offset = max(padding_right_offset, stopping_criteria.max_new_tokens)

        tokenized_inputs = tokenizer(inputs)

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

        return cls(
            batch_id=batch_id,
            requests=requests,
            requests_idx_mapping=requests_idx_mapping,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=None,
            all_input_ids=list(all_input_ids),
            input_lengths=input_lengths.tolist(),
            stopping_criterias=stopping_criterias,
            max_input_length=max_input_length.item(),
            padding_right_offset=padding_right_offset,
            # BloomCausalLMBatch: BLOOM keys are [batch_size * num_heads, head_dim, seq_length]
            keys_head_dim_last=False,
        )

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
        stopping_criterias = []
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

            stopping_criteria = self.stopping_criterias[idx]
            stopping_criterias.append(stopping_criteria)
            remaining_decode_tokens = stopping_criteria.max_new_tokens - stopping_criteria.current_tokens
            new_padding_right_offset = max(new_padding_right_offset, remaining_decode_tokens)

        # Apply indices to input_ids, attention mask, past key values and other items that need to be cached
        input_ids = self.input_ids[keep_indices]
        position_ids = self.position_ids[keep_indices]
        self.attention_mask = self.attention_mask[
            keep_indices,
            -(self.padding_right_offset + max_input_length) : (self.attention_mask.shape[1] - self.padding_right_offset)
            + new_padding_right_offset,
        ]

        # Ensure that past_key_values tensors can be updated in-place
        if type(self.past_key_values[0]) == tuple:
            self.past_key_values = [list(layer) for layer in self.past_key_values]

        past_kv_length = max_input_length - 1
        for layer in self.past_key_values:
            past_keys, past_values = layer
            if len(past_keys.shape) == 3:
                # Force past to be of dim [self_size, num_heads, ...] for easy indexing
                past_keys = past_keys.view(len(self), -1, *past_keys.shape[-2:])
                past_values = past_values.view(len(self), -1, *past_values.shape[-2:])
            if self.keys_head_dim_last:
                layer[0] = past_keys[keep_indices, :, -past_kv_length:, :]
            else:
                layer[0] = past_keys[keep_indices, :, :, -past_kv_length:]
            del past_keys
            layer[1] = past_values[keep_indices, :, -past_kv_length:, :]
            del past_values

        self.requests = requests
        self.requests_idx_mapping = requests_idx_mapping
        self.input_ids = input_ids
        self.position_ids = position_ids
        self.all_input_ids = all_input_ids
        self.input_lengths = input_lengths
        self.stopping_criterias = stopping_criterias
        self.max_input_length = max_input_length
        self.padding_right_offset = new_padding_right_offset
        return self

    @classmethod
    def concatenate(cls, batches: List["CausalLMBatch"]) -> "CausalLMBatch":
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
        stopping_criterias = []

        input_ids = None
        attention_mask = None
        position_ids = None
        past_key_values = []

        start_index = 0
        for i, batch in enumerate(batches):
            requests.extend(batch.requests)
            input_lengths.extend(batch.input_lengths)
            all_input_ids.extend(batch.all_input_ids)
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

            if attention_mask is None:
                attention_mask = batch.attention_mask.new_zeros((total_batch_size, max_input_length + padding_right_offset))

            # We need to slice the attention mask to remove padding from previous steps
            # and to remove unused allocated space
            left_offset = max_input_length - batch.max_input_length
            batch_left_offset = batch.attention_mask.shape[1] - batch.max_input_length - batch.padding_right_offset
            attention_mask[start_index:end_index, left_offset:-padding_right_offset] = batch.attention_mask[
                :, batch_left_offset : -batch.padding_right_offset
            ]

            if position_ids is None:
                position_ids = batch.position_ids.new_empty((total_batch_size, 1))
            position_ids[start_index:end_index] = batch.position_ids

            # BLOOM Keys:   [batch_size * num_heads, head_dim, seq_length]
            # BLOOM Values: [batch_size * num_heads, seq_length, head_dim]
            if type(batch.past_key_values[0]) == tuple:
                batch.past_key_values = [
                    [t.view(len(batch), -1, *t.shape[-2:]) for t in layer] for layer in batch.past_key_values
                ]
            elif len(batch.past_key_values[0][0].shape) == 3:
                for layer in batch.past_key_values:
                    for k, t in enumerate(layer):
                        layer[k] = t.view(len(batch), -1, *t.shape[-2:])

            start_index = end_index

        first_past_kvs = batches[0].past_key_values
        _, num_heads, padded_sequence_length, head_dim = first_past_kvs[0][1].shape

        padded_past_values_shape = (total_batch_size, num_heads, max_input_length - 1, head_dim)
        if batches[0].keys_head_dim_last:
            padded_past_keys_shape = padded_past_values_shape
        else:
            # seq_length is last for BLOOM
            padded_past_keys_shape = (total_batch_size, num_heads, head_dim, max_input_length - 1)

        for j in range(len(first_past_kvs)):
            padded_past_keys = first_past_kvs[j][0].new_zeros(padded_past_keys_shape)
            start_index = 0
            for batch in batches:
                past_keys = batch.past_key_values[j][0]
                batch.past_key_values[j][0] = None
                end_index = start_index + len(batch)
                # We slice the keys to remove the padding from previous batches
                past_seq_len = batch.max_input_length - 1
                if batch.keys_head_dim_last:
                    padded_past_keys[start_index:end_index, :, -past_seq_len:, :] = past_keys[:, :, -past_seq_len:, :]
                else:
                    # BLOOM case
                    padded_past_keys[start_index:end_index, :, :, -past_seq_len:] = past_keys[:, :, :, -past_seq_len:]
                del past_keys
                start_index = end_index

            padded_past_values = first_past_kvs[j][1].new_zeros(padded_past_values_shape)
            start_index = 0
            for batch in batches:
                past_values = batch.past_key_values[j][1]
                batch.past_key_values[j][1] = None
                end_index = start_index + len(batch)
                past_seq_len = batch.max_input_length - 1
                padded_past_values[start_index:end_index, :, -past_seq_len:, :] = past_values[:, :, -past_seq_len:, :]
                del past_values
                start_index = end_index

            past_key_values.append([padded_past_keys, padded_past_values])

        return cls(
            batch_id=batches[0].batch_id,
            requests=requests,
            requests_idx_mapping=requests_idx_mapping,
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
            all_input_ids=all_input_ids,
            input_lengths=input_lengths,
            stopping_criterias=stopping_criterias,
            max_input_length=max_input_length,
            padding_right_offset=padding_right_offset,
            keys_head_dim_last=batches[0].keys_head_dim_last,
        )

    def __len__(self):
        return len(self.requests)


@dataclass
class Generation:
    request_id: int
    token_id: int
    logits: torch.Tensor
    stopped: bool


class CausalLM:
    def __init__(self, model: BloomForCausalLM):
        self.model = model
        # BloomForCausalLM.forward takes no position_ids (ALiBi needs none)
        self.has_position_ids = False

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        kwargs = {"input_ids": input_ids, "attention_mask": attention_mask, "past_key_values": past_key_values, "use_cache": True}
        if self.has_position_ids:
            kwargs["position_ids"] = position_ids
        return self.model.forward(**kwargs)

    @torch.no_grad()
    def generate_token(self, batch: CausalLMBatch) -> Tuple[List[Generation], Optional[CausalLMBatch]]:
        # slice the attention mask to the correct shape
        attention_mask = batch.attention_mask[:, : -batch.padding_right_offset]

        logits, past = self.forward(batch.input_ids, attention_mask, batch.position_ids, batch.past_key_values)

        generations: List[Generation] = []
        stopped = True

        iterator = zip(batch.requests, batch.input_lengths, logits, batch.stopping_criterias, batch.all_input_ids)
        for i, (request, input_length, logits, stopping_criteria, all_input_ids) in enumerate(iterator):
            # Greedy next-token choice
            next_token_id = logits[-1:, :].argmax(dim=-1, keepdim=True)

            all_input_ids = torch.cat([all_input_ids, next_token_id])
            new_input_length = input_length + 1

            stop, reason = stopping_criteria(next_token_id.item())
            if not stop:
                stopped = False

            generations.append(Generation(request.id, next_token_id.item(), logits[-1].clone(), stop))

            batch.input_ids[i, 0] = next_token_id
            batch.all_input_ids[i] = all_input_ids
            batch.input_lengths[i] = new_input_length
            batch.max_input_length = max(batch.max_input_length, new_input_length)

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


# ----------------------------------------------------------------------------------------------------------------
# Reference: one request at a time, no padding, no cache, ALiBi written as the distance penalty of the paper.


def reference_slopes(num_heads: int) -> torch.Tensor:
    # power-of-two head count: slope_h = 2 ** (-8 * (h + 1) / num_heads)
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)])


@torch.no_grad()
def reference_logits(model: BloomForCausalLM, ids: List[int]) -> torch.Tensor:
    config = model.config
    n_head, head_dim = config.n_head, config.hidden_size // config.n_head
    tokens = torch.tensor(ids)
    length = len(ids)
    slopes = reference_slopes(n_head)
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    bias = -slopes[:, None, None] * (i - j).float()  # (H, L, L)
    allowed = j <= i

    x = model.transformer.word_embeddings_layernorm(model.transformer.word_embeddings(tokens))
    for block in model.transformer.h:
        attn = block.self_attention
        ln = block.input_layernorm(x)
        qkv = attn.query_key_value(ln).view(length, n_head, 3 * head_dim)
        q, k, v = qkv.split(head_dim, dim=-1)  # (L, H, d)
        scores = torch.einsum("ihd,jhd->hij", q, k) / math.sqrt(head_dim) + bias
        scores = scores.masked_fill(~allowed, float("-inf"))
        ctx = torch.einsum("hij,jhd->ihd", scores.softmax(-1), v).reshape(length, config.hidden_size)
        residual = ln if block.apply_residual_connection_post_layernorm else x
        h = attn.dense(ctx) + residual
        ln2 = block.post_attention_layernorm(h)
        residual = ln2 if block.apply_residual_connection_post_layernorm else h
        x = block.mlp.dense_4h_to_h(block.mlp.gelu_impl(block.mlp.dense_h_to_4h(ln2))) + residual
    x = model.transformer.ln_f(x)
    return F.linear(x, model.transformer.word_embeddings.weight)


def reference_generate(model, prompt: List[int], max_new_tokens: int):
    ids = list(prompt)
    tokens, logits = [], []
    for _ in range(max_new_tokens):
        last = reference_logits(model, ids)[-1]
        token = int(last.argmax())
        tokens.append(token)
        logits.append(last)
        ids.append(token)
    return tokens, logits


def main():
    torch.manual_seed(0)
    config = BloomConfig(
        vocab_size=96,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        layer_norm_epsilon=1e-5,
        pad_token_id=3,
        apply_residual_connection_post_layernorm=False,
    )
    model = BloomForCausalLM(config).eval()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.5)
    tokenizer = LeftPaddingTokenizer(config.pad_token_id)
    causal_lm = CausalLM(model)

    g = torch.Generator().manual_seed(1)

    def prompt(n):
        return torch.randint(4, config.vocab_size, (n,), generator=g).tolist()

    first = [Request(0, prompt(5), 6), Request(1, prompt(9), 3), Request(2, prompt(3), 8)]
    second = [Request(3, prompt(11), 4), Request(4, prompt(2), 5)]
    all_requests = {r.id: r for r in first + second}

    generated: Dict[int, List[int]] = {r: [] for r in all_requests}
    step_logits: Dict[int, List[torch.Tensor]] = {r: [] for r in all_requests}

    def record(generations):
        for gen in generations:
            generated[gen.request_id].append(gen.token_id)
            step_logits[gen.request_id].append(gen.logits)
        return [gen.request_id for gen in generations if not gen.stopped]

    def run_step(batch):
        generations, batch = causal_lm.generate_token(batch)
        remaining = record(generations)
        if batch is not None and len(remaining) < len(batch):
            batch = batch.filter(remaining)
        return batch

    # Router: prefill the first batch, decode twice, then prefill a second batch and concatenate it.
    batch = CausalLMBatch.from_pb(0, first, tokenizer)
    batch = run_step(batch)
    batch = run_step(batch)
    batch = run_step(batch)  # request 1 (3 new tokens) finishes here and is filtered out
    assert len(batch) == 2

    new_batch = CausalLMBatch.from_pb(1, second, tokenizer)
    new_batch = run_step(new_batch)
    batch = CausalLMBatch.concatenate([batch, new_batch])
    while batch is not None:
        batch = run_step(batch)

    worst = 0.0
    for rid, request in all_requests.items():
        ref_tokens, ref_logits = reference_generate(model, request.inputs, request.max_new_tokens)
        assert generated[rid] == ref_tokens, (rid, generated[rid], ref_tokens)
        for got, want in zip(step_logits[rid], ref_logits):
            worst = max(worst, (got - want).abs().max().item())
        print(f"request {rid}: prompt {len(request.inputs):2d} tokens -> {generated[rid]}")
    assert worst < 1e-4, worst
    print(f"batched TGI BLOOM generation matches the unpadded reference (max logit diff {worst:.2e})")


if __name__ == "__main__":
    main()
