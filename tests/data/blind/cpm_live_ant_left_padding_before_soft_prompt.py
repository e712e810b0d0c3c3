"""CPM-Ant (OpenBMB/CPM-Live) batched generation: left padding put in front of the soft prompt.

Citation: OpenBMB/CPM-Live#370 (merge ba0e46d, commits 9309c0b "adapt prompt to left padding" and
430acd6), fixing OpenBMB/CPM-Live#368 ("get wrong results when inference with batch size larger
than 1"). Files: cpm-live/cpm_live/generation/ant.py (CPMAntGeneration._convert_to_tensors,
_process_texts, CPMAntRandomSampling._decode), cpm-live/cpm_live/utils/data_utils.py (pad,
cat_prompt), cpm-live/cpm_live/models/ant_torch.py (CPMAntTorch.inference) and
cpm-live/cpm_live/native_layers (Attention, SegmentPositionEmbedding, blocks, Encoder).

The bug: each text got its `prompt_length` soft-prompt ids prepended before the batch was
left-padded, so a shorter row reads [pad.., prompt, text]. `inference` takes
`input[:, :prompt_length]` as the prompt (looked up in `prompt_embedding`) and the rest as text,
and its left-padding mask keeps the last `length` columns. In a padded row the prompt
embeddings sit on pad columns the mask drops, and the text attends prompt ids looked up as
vocabulary tokens.

The fix: pad the texts on the left first, then `cat_prompt` puts the prompt in front of the
padding ([prompt, pad.., text]); `length` counts the text only and `mask_1d` is the left-padding
mask over the last `seqlen - prompt_length` columns with the `prompt_length` prompt columns
always kept.

Toy sizes, random weights, float32, a character tokenizer; greedy choice in place of sampling.
"""

import math
import sys
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- native_layers


def rms_layernorm(hidden: torch.Tensor, weight: torch.Tensor, eps: float):
    old_dtype = hidden.dtype
    variance = hidden.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
    hidden = (hidden * torch.rsqrt(variance + eps)).to(old_dtype)
    return hidden * weight


class LayerNorm(torch.nn.Module):
    def __init__(self, dim_norm: int, dtype=torch.float, eps: float = 1e-6, init_var: float = 1.0):
        super().__init__()
        self.eps = eps
        self.dim_norm = dim_norm
        self.weight = torch.nn.parameter.Parameter(torch.full((dim_norm,), init_var, dtype=dtype))

    def forward(self, x: torch.Tensor):
        assert x.size(-1) == self.dim_norm
        return rms_layernorm(x, self.weight, self.eps)


class Linear(torch.nn.Module):
    def __init__(self, dim_in: int, dim_out: int, dtype=torch.float, scale_before: bool = False):
        super().__init__()
        self.dim_in = self.in_features = dim_in
        self.dim_out = self.out_features = dim_out
        self.scale_before = scale_before
        self.weight = torch.nn.parameter.Parameter(torch.empty((dim_out, dim_in), dtype=dtype))

    def forward(self, x: torch.Tensor):
        if self.scale_before:
            x = x / math.sqrt(self.dim_in)
            x = F.linear(x, self.weight)
        else:
            x = F.linear(x, self.weight)
            x = x / math.sqrt(self.dim_in)
        return x


class Embedding(torch.nn.Module):
    def __init__(self, vocab_size: int, embedding_size: int, dtype=torch.float, init_std: float = 1):
        super().__init__()
        self.dim_model = embedding_size
        self.weight = torch.nn.parameter.Parameter(
            torch.empty(vocab_size, embedding_size, dtype=dtype)
        )

    def forward(self, ids: torch.Tensor):
        embeds = F.embedding(ids, self.weight) / math.sqrt(self.dim_model)
        return embeds

    def projection(self, x: torch.Tensor):
        logits = F.linear(x / math.sqrt(self.dim_model), self.weight)
        return logits


class SegmentPositionEmbedding(torch.nn.Module):
    def __init__(self, num_heads, num_segments=1, num_buckets=32, max_distance=128,
                 bidirectional=False, dtype=torch.float):
        super().__init__()
        self.num_heads = num_heads
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        self.bidirectional = bidirectional
        self.num_segments = num_segments
        self.relative_attention_bias = torch.nn.parameter.Parameter(
            torch.empty(num_segments * num_segments + num_buckets, num_heads, dtype=dtype)
        )

    def forward(self, key_pos, query_pos, key_segment, query_segment):
        with torch.no_grad():
            batch = key_pos.size(0)
            keylen = key_pos.size(1)
            querylen = query_pos.size(1)

            assert key_pos.size(0) == query_pos.size(0)
            assert keylen == key_segment.size(1) and querylen == query_segment.size(1)

            key_pos = key_pos.view(batch, -1, keylen)
            query_pos = query_pos.view(batch, querylen, -1)
            key_segment = key_segment.view(batch, -1, keylen)
            query_segment = query_segment.view(batch, querylen, -1)

            relative_position_bucket = self._segment_relative_position_bucket(
                query_segment, key_segment
            )
            relative_position_bucket = relative_position_bucket + self.num_buckets

            # b*q*k
            absolute_position_bucket = self._position_bucket(
                torch.arange(keylen, dtype=torch.int32, device=relative_position_bucket.device)[None, :]
                - torch.arange(querylen, dtype=torch.int32, device=relative_position_bucket.device)[:, None],
                bidirectional=self.bidirectional,
                num_buckets=self.num_buckets,
                max_distance=self.max_distance,
            )
            relative_position_bucket = torch.where(
                (key_segment == query_segment),
                absolute_position_bucket[None, :, :],
                relative_position_bucket,
            )
        embeds = F.embedding(relative_position_bucket, self.relative_attention_bias)
        embeds = embeds.permute(0, 3, 1, 2).contiguous()
        return embeds

    def _segment_relative_position_bucket(self, query_segment, key_segment):
        return query_segment * self.num_segments + key_segment

    def _position_bucket(self, relative_position, bidirectional=True, num_buckets=32, max_distance=128):
        relative_buckets = 0
        if bidirectional:
            num_buckets //= 2
            relative_buckets = (relative_position > 0).to(torch.int32) * num_buckets
            relative_position = torch.abs(relative_position)
        else:
            relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
        max_exact = num_buckets // 2
        is_small = relative_position < max_exact
        relative_postion_if_large = max_exact + (
            torch.log(relative_position.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.int32)
        relative_postion_if_large = torch.min(
            relative_postion_if_large,
            torch.full_like(relative_postion_if_large, num_buckets - 1),
        )
        relative_buckets += torch.where(
            is_small, relative_position.to(torch.int32), relative_postion_if_large
        )
        return relative_buckets


class Attention(torch.nn.Module):
    def __init__(self, dim_model, num_heads, dim_head, dtype=torch.float, dropout_p=None):
        super().__init__()
        self.dim_model = dim_model
        self.num_heads = num_heads
        self.dim_head = dim_head
        self.project_q = Linear(self.dim_model, self.num_heads * self.dim_head, dtype=dtype)
        self.project_k = Linear(self.dim_model, self.num_heads * self.dim_head, dtype=dtype)
        self.project_v = Linear(self.dim_model, self.num_heads * self.dim_head, dtype=dtype)
        self.attention_out = Linear(self.num_heads * self.dim_head, self.dim_model, dtype=dtype)
        self.softmax = torch.nn.Softmax(dim=-1)
        self.dropout = torch.nn.Dropout(p=dropout_p) if dropout_p is not None else None

    def forward(self, hidden_q, hidden_kv, attention_mask, position_bias,
                use_cache: bool = False, past_kv: Optional[Tuple[torch.Tensor, torch.Tensor]] = None):
        batch_size = hidden_q.size(0)
        len_q = hidden_q.size(1)
        len_k = hidden_kv.size(1)

        h_q = self.project_q(hidden_q)
        h_k = self.project_k(hidden_kv)
        h_v = self.project_v(hidden_kv)

        h_q = h_q.view(batch_size, len_q, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        h_k = h_k.view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)
        h_v = h_v.view(batch_size, len_k, self.num_heads, self.dim_head).permute(0, 2, 1, 3)

        if past_kv is not None:
            h_k = torch.cat([past_kv[0], h_k], dim=-2)
            h_v = torch.cat([past_kv[1], h_v], dim=-2)
            len_k = h_k.size(-2)

        # (b, n_h, len_q, d_h) @ (b, n_h, d_h, len_k) -> (b, n_h, len_q, len_k)
        score = torch.matmul(h_q, h_k.transpose(-1, -2)) / math.sqrt(self.dim_head)
        score = score + position_bias
        score = torch.masked_fill(
            score,
            attention_mask.view(batch_size, 1, len_q, len_k) == False,  # noqa: E712
            torch.scalar_tensor(float("-inf"), device=score.device, dtype=score.dtype),
        )

        score = self.softmax(score)

        score = torch.masked_fill(
            score,
            attention_mask.view(batch_size, 1, len_q, len_k) == False,  # noqa: E712
            torch.scalar_tensor(0, device=score.device, dtype=score.dtype),
        )

        if self.dropout is not None:
            score = self.dropout(score)

        score = torch.matmul(score, h_v)
        score = score.view(batch_size, self.num_heads, len_q, self.dim_head).permute(0, 2, 1, 3)
        score = score.contiguous().view(batch_size, len_q, self.num_heads * self.dim_head)
        score = self.attention_out(score)
        if use_cache:
            return score, (h_k, h_v)
        return score


class DenseGatedACT(torch.nn.Module):
    def __init__(self, dim_in, dim_ff, dtype=torch.float):
        super().__init__()
        self.w_0 = Linear(dim_in=dim_in, dim_out=dim_ff, dtype=dtype, scale_before=False)
        self.w_1 = Linear(dim_in=dim_in, dim_out=dim_ff, dtype=dtype, scale_before=False)
        self.act = torch.nn.GELU()

    def forward(self, x):
        gate_score = self.act(self.w_0(x))
        x = self.w_1(x)
        return gate_score * x


class FeedForward(torch.nn.Module):
    def __init__(self, dim_model, dim_ff, dtype=torch.float, dropout_p=None):
        super().__init__()
        self.w_in = DenseGatedACT(dim_in=dim_model, dim_ff=dim_ff, dtype=dtype)
        self.dropout = torch.nn.Dropout(dropout_p) if dropout_p is not None else None
        self.w_out = Linear(dim_in=dim_ff, dim_out=dim_model, dtype=dtype, scale_before=True)

    def forward(self, x):
        x = self.w_in(x)
        if self.dropout is not None:
            x = self.dropout(x)
        return self.w_out(x)


class SelfAttentionBlock(torch.nn.Module):
    def __init__(self, dim_model, num_heads, dim_head, dtype=torch.float, eps=1e-6, dropout_p=None):
        super().__init__()
        self.layernorm_before_attention = LayerNorm(dim_model, dtype=dtype, eps=eps)
        self.self_attention = Attention(dim_model=dim_model, num_heads=num_heads,
                                        dim_head=dim_head, dtype=dtype, dropout_p=dropout_p)
        self.dropout = torch.nn.Dropout(dropout_p) if dropout_p else None

    def forward(self, hidden_states, attention_mask, position_bias=None,
                use_cache=False, past_key_value=None):
        x = self.layernorm_before_attention(hidden_states)
        x = self.self_attention(x, x, attention_mask, position_bias, use_cache, past_key_value)
        if use_cache:
            x, current_key_value = x
        else:
            current_key_value = None
        if self.dropout is not None:
            x = self.dropout(x)
        hidden_states = hidden_states + x
        if use_cache:
            return hidden_states, current_key_value
        return hidden_states


class FFNBlock(torch.nn.Module):
    def __init__(self, dim_model, dim_ff, dtype=torch.float, eps=1e-6, dropout_p=0):
        super().__init__()
        self.layernorm_before_ffn = LayerNorm(dim_model, dtype=dtype, eps=eps)
        self.ffn = FeedForward(dim_model, dim_ff, dtype=dtype, dropout_p=dropout_p)
        self.dropout = torch.nn.Dropout(dropout_p) if dropout_p else None

    def forward(self, hidden_states):
        x = self.layernorm_before_ffn(hidden_states)
        x = self.ffn(x)
        if self.dropout is not None:
            x = self.dropout(x)
        return hidden_states + x


class TransformerBlock(torch.nn.Module):
    def __init__(self, dim_model, dim_ff, num_heads, dim_head, dtype=torch.float, eps=1e-6,
                 dropout_p=None, mask_att=False, mask_ffn=False):
        super().__init__()
        self.mask_att = mask_att
        self.mask_ffn = mask_ffn
        if not self.mask_att:
            self.self_att = SelfAttentionBlock(dim_model=dim_model, num_heads=num_heads,
                                               dim_head=dim_head, dtype=dtype, eps=eps,
                                               dropout_p=dropout_p)
        if not self.mask_ffn:
            self.ffn = FFNBlock(dim_model=dim_model, dim_ff=dim_ff, dtype=dtype, eps=eps,
                                dropout_p=dropout_p)

    def forward(self, self_hidden_states, self_attention_mask, self_position_bias=None,
                use_cache=False, past_key_value=None):
        current_key_value = None
        if not self.mask_att:
            hidden_states = self.self_att(
                self_hidden_states,
                attention_mask=self_attention_mask,
                position_bias=self_position_bias,
                use_cache=use_cache,
                past_key_value=past_key_value,
            )
            if use_cache:
                hidden_states, current_key_value = hidden_states
        else:
            hidden_states = self_hidden_states
        if not self.mask_ffn:
            hidden_states = self.ffn(hidden_states)
        if use_cache:
            return hidden_states, current_key_value
        return hidden_states


class Encoder(torch.nn.Module):
    def __init__(self, num_layers, dim_model, dim_ff, num_heads, dim_head, dtype=torch.float,
                 eps=1e-6, dropout_p=None, mask_modules=None):
        super().__init__()
        self.num_layers = num_layers
        if mask_modules is None:
            mask_modules = [(False, False)] * num_layers
        self.layers = torch.nn.ModuleList(
            [
                TransformerBlock(dim_model=dim_model, dim_ff=dim_ff, num_heads=num_heads,
                                 dim_head=dim_head, dtype=dtype, eps=eps, dropout_p=dropout_p,
                                 mask_att=mask_modules[ith][0], mask_ffn=mask_modules[ith][1])
                for ith in range(num_layers)
            ]
        )
        self.output_layernorm = LayerNorm(dim_norm=dim_model, dtype=dtype, eps=eps)

    def forward(self, hidden_states, attention_mask, position_bias, use_cache=False,
                past_key_values=None):
        with torch.no_grad():
            current_key_values = []
            for i, module in enumerate(self.layers):
                hidden_states = module(
                    hidden_states,
                    attention_mask,
                    position_bias,
                    past_key_value=past_key_values[i] if past_key_values else None,
                    use_cache=use_cache,
                )
                if use_cache:
                    current_key_values.append(hidden_states[1])
                    hidden_states = hidden_states[0]
            hidden_states = self.output_layernorm(hidden_states)
            if use_cache:
                return hidden_states, current_key_values
            return hidden_states


# ---------------------------------------------------------------- models/ant_torch.py


class CPMAntConfig:
    def __init__(self, vocab_size=64, dim_model=32, num_heads=4, dim_head=8, dim_ff=64,
                 num_layers=2, dropout_p=None, eps=1e-6, prompt_types=3, prompt_length=4,
                 segment_types=3, position_bias_num_buckets=32, position_bias_max_distance=128,
                 dtype=torch.float, mask_modules=None):
        self.vocab_size = vocab_size
        self.dim_model = dim_model
        self.num_heads = num_heads
        self.dim_head = dim_head
        self.dim_ff = dim_ff
        self.num_layers = num_layers
        self.dropout_p = dropout_p
        self.eps = eps
        self.prompt_types = prompt_types
        self.prompt_length = prompt_length
        self.segment_types = segment_types
        self.position_bias_num_buckets = position_bias_num_buckets
        self.position_bias_max_distance = position_bias_max_distance
        self.dtype = dtype
        self.mask_modules = mask_modules


class CPMAntTorch(torch.nn.Module):
    def __init__(self, config: CPMAntConfig):
        super().__init__()
        self.encoder = Encoder(
            num_layers=config.num_layers,
            dim_model=config.dim_model,
            dim_ff=config.dim_ff,
            num_heads=config.num_heads,
            dim_head=config.dim_head,
            dtype=config.dtype,
            eps=config.eps,
            dropout_p=config.dropout_p,
            mask_modules=config.mask_modules,
        )
        self.prompt_embedding = Embedding(
            vocab_size=config.prompt_types * config.prompt_length,
            embedding_size=config.dim_model, dtype=config.dtype, init_std=0.02,
        )
        self.segment_embedding = Embedding(
            vocab_size=config.segment_types, embedding_size=config.dim_model,
            dtype=config.dtype, init_std=0.02,
        )
        self.input_embedding = Embedding(
            vocab_size=config.vocab_size, embedding_size=config.dim_model,
            dtype=config.dtype, init_std=0.02,
        )
        self.position_bias = SegmentPositionEmbedding(
            num_heads=config.num_heads,
            num_segments=config.segment_types,
            num_buckets=config.position_bias_num_buckets,
            max_distance=config.position_bias_max_distance,
            bidirectional=True,
            dtype=config.dtype,
        )
        self.prompt_length = config.prompt_length

    def inference(
        self,
        input: torch.Tensor,  # (batch, seqlen)
        length: torch.Tensor,  # (batch)
        context: torch.Tensor,  # (batch, seqlen)
        position: torch.Tensor,  # (batch, seqlen)
        segment: torch.Tensor,  # (batch, seqlen)
        span: torch.Tensor,  # (batch, seqlen)
        past_key_values=None,  # num_layers * 2 * (batch, num_heads, seqlen, dim_head)
    ):
        batch = input.size(0)

        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * self.encoder.num_layers)
            input_prompt = input[:, : self.prompt_length].contiguous()
            input_ids = input[:, self.prompt_length :].contiguous()

            prompt_states = self.prompt_embedding(input_prompt)
            hidden_states = self.input_embedding(input_ids)
            segment_states = self.segment_embedding(segment)
            hidden_states = torch.cat([prompt_states, hidden_states], 1) + segment_states
        else:
            past_length = past_key_values[0][0].size(-2)
            segment_states = self.segment_embedding(segment)
            hidden_states = self.input_embedding(input) + segment_states[:, -1:, :]

        seqlen = past_length + input.size(1)

        with torch.no_grad():
            device = input.device
            directional_mask_2d = torch.arange(seqlen, device=device) <= torch.arange(
                seqlen, device=device
            ).view(-1, 1)
            attention_mask = context[:, None, :] | (
                context[:, :, None].logical_not() & directional_mask_2d.view(1, seqlen, seqlen)
            )
            attention_mask = attention_mask & (span[:, None, :] == span[:, :, None])
            # mask for left paddding
            if FIXED:
                seqlen_raw = seqlen - self.prompt_length
                mask_1d = (
                    torch.tensor(list(range(seqlen_raw))[::-1], device=device)[None, :].repeat(batch, 1)
                    < length[:, None]
                )
                mask_1d = torch.cat(
                    (
                        torch.ones(batch, self.prompt_length, device=device).bool(),
                        mask_1d,
                    ),
                    dim=1,
                )
            else:
                mask_1d = (
                    torch.tensor(list(range(seqlen))[::-1], device=device)[None, :].repeat(batch, 1)
                    < length[:, None]
                )
            attention_mask = (
                mask_1d.view(batch, seqlen, 1) & mask_1d.view(batch, 1, seqlen) & attention_mask
            )

        position_bias = self.position_bias(position, position, segment, segment)

        attention_mask = attention_mask[:, past_length:, :]
        position_bias = position_bias[:, :, past_length:, :]

        hidden_states, present_key_values = self.encoder(
            hidden_states, attention_mask, position_bias, True, past_key_values
        )
        logits = self.input_embedding.projection(hidden_states)
        return logits, hidden_states, present_key_values


# ---------------------------------------------------------------- utils/data_utils.py


def pad(orig_items, key, padding_value=0, padding_side="left"):
    items = orig_items
    batch_size = len(items)
    shape = items[0][key].shape
    dim = len(shape)
    max_length = max(item[key].shape[-1] for item in items)
    min_length = min(item[key].shape[-1] for item in items)
    dtype = items[0][key].dtype

    if dim == 1:
        return torch.cat([item[key] for item in items], dim=0)
    elif dim == 2:
        if max_length == min_length:
            return torch.cat([item[key] for item in items], dim=0)
        tensor = torch.zeros((batch_size, max_length), dtype=dtype) + padding_value

    for i, item in enumerate(items):
        if padding_side == "left":
            tensor[i, -len(item[key][0]):] = item[key][0].clone()
        else:
            tensor[i, : len(item[key][0])] = item[key][0].clone()
    return tensor


def cat_prompt(padded_inputs: Dict[str, torch.Tensor], prompt_length: int, task_id: int = 2):
    input_ids = padded_inputs["input"]
    batch, dtype, device = input_ids.size(0), input_ids.dtype, input_ids.device
    padded_inputs["input"] = torch.cat(
        (
            torch.arange(
                prompt_length * task_id,
                prompt_length * (task_id + 1),
                dtype=dtype,
                device=device,
            ).repeat(batch, 1),
            input_ids,
        ),
        dim=1,
    )
    padded_inputs["position"] = torch.cat(
        (
            torch.arange(prompt_length, dtype=dtype, device=device).repeat(batch, 1),
            padded_inputs["position"],
        ),
        dim=1,
    )
    for k in ["context", "span", "segment"]:
        if k == "context":
            cat_part = torch.ones(batch, prompt_length, dtype=dtype, device=device)
        else:
            cat_part = torch.zeros(batch, prompt_length, dtype=dtype, device=device)
        padded_inputs[k] = torch.cat((cat_part, padded_inputs[k]), dim=1)
    return padded_inputs


# ---------------------------------------------------------------- generation/ant.py


class CharTokenizer:
    """Stand-in for CPMAntTokenizer: one id per lowercase letter / space."""

    unk_id = 0
    bos_id = 1
    eos_id = 2
    newline_id = 3
    alphabet = "abcdefghijklmnopqrstuvwxyz "

    def encode(self, text: str) -> List[int]:
        return [self.alphabet.index(c) + 16 if c in self.alphabet else self.unk_id for c in text]

    def decode(self, ids: List[int]) -> str:
        return "".join(
            self.alphabet[i - 16] if 16 <= i < 16 + len(self.alphabet) else "<%d>" % i for i in ids
        )


class CPMAntGeneration:
    def __init__(self, model, tokenizer, prompt_length=32):
        model.eval()
        self.model = model
        self.tokenizer = tokenizer
        self.prompt_length = prompt_length

    if FIXED:

        def _convert_to_tensors(self, input_text):
            model_inputs = {}
            input_ids = [self.tokenizer.bos_id] + self.tokenizer.encode(input_text)
            input_ids = [j for j in input_ids if j != self.tokenizer.unk_id]

            model_inputs["input"] = input_ids
            model_inputs["length"] = len(input_ids)
            model_inputs["position"] = list(range(len(input_ids)))
            model_inputs["span"] = [0] * len(input_ids)
            model_inputs["context"] = [True] * len(input_ids)
            model_inputs["segment"] = [2] * len(input_ids)

            for key in model_inputs:
                model_inputs[key] = torch.tensor(model_inputs[key]).int().unsqueeze(0)
            return model_inputs

        def _process_texts(self, text_list, task_id=2):
            input_tensors = list(map(self._convert_to_tensors, text_list))
            keys = set(input_tensors[0].keys())
            # padding
            padded = {}
            for key in keys:
                padded[key] = pad(input_tensors, key, padding_side="left")
            # cat prompt
            padded_with_prompt = cat_prompt(padded, self.prompt_length, task_id)
            return padded_with_prompt

    else:

        def _convert_to_tensors(self, input_text, task_id=2):
            model_inputs = {}
            input_ids = [self.tokenizer.bos_id] + self.tokenizer.encode(input_text)
            input_ids = [j for j in input_ids if j != self.tokenizer.unk_id]

            model_inputs["input"] = [
                x + self.prompt_length * task_id for x in range(self.prompt_length)
            ] + input_ids
            model_inputs["length"] = len(model_inputs["input"])
            model_inputs["position"] = list(range(len(model_inputs["input"])))
            model_inputs["span"] = [0] * len(model_inputs["input"])
            model_inputs["context"] = [True] * len(model_inputs["input"])
            model_inputs["segment"] = [0] * self.prompt_length + [2] * len(input_ids)

            for key in model_inputs:
                model_inputs[key] = torch.tensor(model_inputs[key]).int().unsqueeze(0)
            return model_inputs

        def _process_texts(self, text_list):
            input_tensors = list(map(self._convert_to_tensors, text_list))
            keys = set(input_tensors[0].keys())
            padded = {}
            for key in keys:
                padded[key] = pad(input_tensors, key, padding_side="left")
            return padded

    def generate(self, text_list, **kwargs):
        model_inputs = self._process_texts(text_list)
        with torch.inference_mode():
            result = self._decode(model_inputs, **kwargs)
        return result


class CPMAntGreedy(CPMAntGeneration):
    """CPMAntRandomSampling._decode with the sampling step replaced by argmax."""

    def _decode(self, model_inputs, max_length=8, **kwargs):
        max_length += 1

        input = model_inputs["input"]
        length = model_inputs["length"]
        context = model_inputs["context"]
        position = model_inputs["position"]
        segment = model_inputs["segment"]
        span = model_inputs["span"]
        batch_size = input.size(0)

        pred_start_index = input.size(-1)
        past_key_values = None
        done = [False for _ in range(batch_size)]
        results = [None for _ in range(batch_size)]
        first_logits = None
        for i in range(max_length):
            if i == 0:
                logits, _, past_key_values = self.model.inference(
                    input=input, length=length, context=context, position=position,
                    segment=segment, span=span, past_key_values=past_key_values,
                )
            else:
                logits, _, past_key_values = self.model.inference(
                    input=input[:, -1:], length=length, context=context, position=position,
                    segment=segment, span=span, past_key_values=past_key_values,
                )

            logits = logits[:, -1, :]

            if i == 0:
                logits[:, self.tokenizer.eos_id] = -float("inf")
                logits[:, self.tokenizer.newline_id] = -float("inf")
                first_logits = logits.clone()

            next_token = logits.argmax(dim=-1, keepdim=True).to(input.dtype)

            for idx in range(batch_size):
                if not done[idx] and (
                    next_token[idx].item() == self.tokenizer.eos_id or i == max_length - 1
                ):
                    done[idx] = True
                    results[idx] = input[idx, pred_start_index:].clone().cpu().tolist()

            if sum(done) == batch_size:
                break

            # update input ids
            input = torch.cat([input, next_token], dim=-1)
            length += 1
            context = torch.cat(
                [context, torch.ones((context.size(0), 1), dtype=torch.int, device=context.device)],
                dim=-1,
            )
            position = torch.cat([position, position[:, -1:] + 1], dim=-1)
            segment = torch.cat([segment, segment[:, -1:]], dim=-1)
            span = torch.cat([span, span[:, -1:]], dim=-1)

        return results, first_logits


def main():
    torch.manual_seed(0)
    config = CPMAntConfig()
    model = CPMAntTorch(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "layernorm" in name:
                continue
            p.normal_(0.0, 1.0)

    tokenizer = CharTokenizer()
    generator = CPMAntGreedy(model, tokenizer, prompt_length=config.prompt_length)
    texts = ["the cat sat on the mat", "a dog"]
    results, first_logits = generator.generate(texts, max_length=6)
    for text, ids in zip(texts, results):
        print(repr(text), "->", ids, repr(tokenizer.decode(ids)))
    print("first-step logits, row 1 (padded), first 6:", first_logits[1, :6].tolist())


if __name__ == "__main__":
    main()
