"""Correct program (quiet batch quiet-r165b).

Ported from EleutherAI/gpt-neox @2155b91ce29899c0f5dbd6ff75ec1a401a246766 (the last commit before #505 moved the
cache into the layers), trimmed to one model-parallel rank and no pipeline engine, with a Pythia-style config
(rotary_pct = 0.25, gpt_j_residual, LayerNorm, no weight tying):
megatron/text_generation_utils.py (get_batch, pad_batch, switch, forward_model, stream_tokens with recompute
False and True), megatron/utils.py (get_attn_mask, get_ltor_masks_and_position_ids), megatron/model/gpt2_model.py
(gpt2_attention_mask_func, _pre_transformer_block, _post_transformer_block, the GPT2ModelPipe layer list),
megatron/model/word_embeddings.py (Embedding, EmbeddingPipe), megatron/model/transformer.py (ParallelMLP,
ParallelSelfAttention.attention / forward with layer_past, ParallelTransformerLayer, ParallelTransformerLayerPipe,
NormPipe, ParallelLinearPipe), megatron/model/fused_softmax.py (FusedScaleMaskSoftmax, torch path),
megatron/model/positional_embeddings.py (RotaryEmbedding, rotate_half, apply_rotary_pos_emb),
megatron/model/fused_bias_dropout.py (bias_dropout_add). mpu's parallel linears are nn.Linear here.

stream_tokens right-pads every prompt with the eod token to seq_length and builds one [1, 1, s, s] lower-triangular
mask (True = masked). With the cache it first forwards every row up to the SHORTEST prompt's length, then one
column at a time: a row whose prompt is longer is fed its own prompt token at that column (`switch` keeps it
and drops the sampled one), so no pad ever enters layer_past. The attention slices the mask to [:sk, :sk] for the
prefill and to row sk - 1 for a one-token step; rotary positions start at layer_past's length.

Self-check: for three prompts of 5, 9 and 7 tokens, both paths (cache and recompute) give, per row, the same
greedy tokens as that prompt generated alone by a hand-written causal forward (no padding, no cache, SDPA
is_causal), and the logits stream_tokens returns equal that reference's logits at every position it filled; once
with eos = eod and 8 forwards, once with an eos id two rows emit early (they finish, the third goes on).
"""
import copy
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

torch.manual_seed(0)
torch.set_num_threads(1)


def exists(x):
    return x is not None


# ---------------------------------------------------------------------------------------------------------------
# config (NeoXArgs, the fields this path reads)
# ---------------------------------------------------------------------------------------------------------------


class Tokenizer:
    eod = 0


@dataclass
class NeoXArgs:
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_layers: int = 3
    seq_length: int = 24
    max_position_embeddings: int = 24
    padded_vocab_size: int = 96
    pos_emb: str = "rotary"
    rotary_pct: float = 0.25
    rotary_emb_base: int = 10000
    gpt_j_residual: bool = True
    norm: str = "layernorm"
    layernorm_epsilon: float = 1e-5
    activation: str = "gelu"
    bias_gelu_fusion: bool = False
    bias_dropout_fusion: bool = False
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = False
    precision: str = "fp32"
    params_dtype: torch.dtype = torch.float32
    attention_config: List[str] = field(default_factory=lambda: ["global"] * 3)
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    no_weight_tying: bool = True
    eod_mask_loss: bool = False
    pipe_parallel_size: int = 0
    tokenizer: Tokenizer = field(default_factory=Tokenizer)


# ---------------------------------------------------------------------------------------------------------------
# megatron/utils.py
# ---------------------------------------------------------------------------------------------------------------


def get_attn_mask(seq_length, device):
    """
    Get triangular attention mask for a given sequence length / device.
    """
    # lower triangular attention mask
    mask = torch.tril(torch.ones((1, seq_length, seq_length), device=device)).view(
        1, 1, seq_length, seq_length
    )

    # convert to binary
    return mask < 0.5


def get_ltor_masks_and_position_ids(data, eod_token, eod_mask_loss=False):
    """Build masks and position id for left to right model."""

    # Extract batch size and sequence length.
    batch_size, seq_length = data.size()

    # Attention mask (lower triangular).
    attention_mask = get_attn_mask(seq_length=seq_length, device=data.device)

    # Loss mask.
    loss_mask = torch.ones(data.size(), dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0

    # Position ids.
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    position_ids = position_ids.unsqueeze(0).expand_as(data)

    return attention_mask, loss_mask, position_ids


# ---------------------------------------------------------------------------------------------------------------
# megatron/model: positional_embeddings.py, fused_softmax.py, fused_bias_dropout.py
# ---------------------------------------------------------------------------------------------------------------


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, dim, base=10000, precision=torch.half):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None
        self.precision = precision

    def forward(self, x, seq_dim=1, seq_len=None):
        if seq_len is None:
            seq_len = x.shape[seq_dim]
        if seq_len != self.seq_len_cached:
            self.seq_len_cached = seq_len
            t = torch.arange(seq_len, device=x.device).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
            self.cos_cached = emb.cos()[:, None, None, :]
            self.sin_cached = emb.sin()[:, None, None, :]
        return self.cos_cached, self.sin_cached


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=x1.ndim - 1)


def apply_rotary_pos_emb(q, k, cos, sin, offset: int = 0):
    cos, sin = cos[offset : q.shape[0] + offset, ...], sin[offset : q.shape[0] + offset, ...]
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class FusedScaleMaskSoftmax(nn.Module):
    """fusion_type none: the torch path only (no CUDA kernels here)."""

    def __init__(self, input_in_fp16, input_in_bf16, mask_func, softmax_in_fp32, scale):
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.fusion = False
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input, mask):
        # [b, np, sq, sk]
        assert input.dim() == 4
        return self.forward_torch_softmax(input, mask)

    def forward_torch_softmax(self, input, mask):
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()

        if self.scale is not None:
            input = input * self.scale
        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


def bias_dropout_add(x: Tensor, bias: Tensor, residual: Optional[Tensor], prob: float, training: bool) -> Tensor:
    out = torch.nn.functional.dropout(x + bias, p=prob, training=training)
    if residual is not None:
        out = residual + out
    return out


def get_bias_dropout_add(training):
    def _bias_dropout_add(x, bias, residual, prob):
        return bias_dropout_add(x, bias, residual, prob, training)

    return _bias_dropout_add


def gpt2_attention_mask_func(attention_scores, ltor_mask):
    attention_scores.masked_fill_(ltor_mask, -10000.0)
    return attention_scores


class ParallelLinearSkipBias(nn.Linear):
    """mpu.ColumnParallelLinear / RowParallelLinear on one rank: returns (output, bias)."""

    def __init__(self, input_size, output_size, bias=True, skip_bias_add=False):
        super().__init__(input_size, output_size, bias=bias)
        self.skip_bias_add = skip_bias_add

    def forward(self, x):
        if self.skip_bias_add:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias), None


# ---------------------------------------------------------------------------------------------------------------
# megatron/model/word_embeddings.py
# ---------------------------------------------------------------------------------------------------------------


class Embedding(torch.nn.Module):
    def __init__(self, neox_args, hidden_size, vocab_size, max_sequence_length, embedding_dropout_prob):
        super().__init__()
        self.hidden_size = hidden_size
        self.word_embeddings = nn.Embedding(vocab_size, self.hidden_size)
        self.embedding_type = neox_args.pos_emb
        if self.embedding_type == "learned":
            self.position_embeddings = nn.Embedding(max_sequence_length, self.hidden_size)
        self.embedding_dropout = torch.nn.Dropout(embedding_dropout_prob)

    def forward(self, input_ids, position_ids):
        words_embeddings = self.word_embeddings(input_ids)
        if self.embedding_type in ["learned", "sinusoidal"]:
            position_embeddings = self.position_embeddings(position_ids)
            embeddings = words_embeddings + position_embeddings
        else:
            embeddings = words_embeddings
        embeddings = self.embedding_dropout(embeddings)
        return embeddings


class EmbeddingPipe(Embedding):
    """Extends Embedding to forward attention_mask through the pipeline."""

    def forward(self, args):
        in_inference = len(args) == 4  # if the length of the args is 4, we're in inference :|
        in_train = len(args) == 3

        input_ids = args[0]
        position_ids = args[1]
        attention_mask = args[2]
        if in_inference:
            layer_past = args[3]
        elif in_train:
            pass
        else:
            raise ValueError(f"Incorrect number of args passed to {self.__class__.__name__}")

        embeddings = super().forward(input_ids, position_ids)
        if in_inference:
            return embeddings, layer_past, attention_mask
        else:
            return embeddings, attention_mask


# ---------------------------------------------------------------------------------------------------------------
# megatron/model/transformer.py
# ---------------------------------------------------------------------------------------------------------------


class ParallelMLP(nn.Module):
    def __init__(self, neox_args):
        super().__init__()
        self.activation_func = F.gelu
        ff_dim = 4 * neox_args.hidden_size
        self.dense_h_to_4h = ParallelLinearSkipBias(neox_args.hidden_size, ff_dim, skip_bias_add=True)
        self.dense_4h_to_h = ParallelLinearSkipBias(ff_dim, neox_args.hidden_size, skip_bias_add=True)

    def forward(self, hidden_states):
        # [s, b, 4hp]
        intermediate_parallel, bias_parallel = self.dense_h_to_4h(hidden_states)
        intermediate_parallel = self.activation_func(intermediate_parallel + bias_parallel)
        # [s, b, h]
        output, output_bias = self.dense_4h_to_h(intermediate_parallel)
        return output, output_bias


class ParallelSelfAttention(nn.Module):
    def __init__(self, neox_args, attention_mask_func, layer_number, rotary=False, get_key_value=False):
        super().__init__()
        self.fp16 = neox_args.precision == "fp16"
        self.bf16 = neox_args.precision == "bfloat16"
        self.attention_mask_func = attention_mask_func
        self.apply_query_key_layer_scaling = neox_args.apply_query_key_layer_scaling
        self.get_key_value = get_key_value
        self.attention_softmax_in_fp32 = neox_args.attention_softmax_in_fp32
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        self.layer_number = layer_number
        self.hidden_size_per_partition = neox_args.hidden_size
        self.hidden_size_per_attention_head = neox_args.hidden_size // neox_args.num_attention_heads
        self.num_attention_heads_per_partition = neox_args.num_attention_heads
        self.pos_emb = neox_args.pos_emb

        # Strided linear layer.
        self.query_key_value = ParallelLinearSkipBias(neox_args.hidden_size, 3 * neox_args.hidden_size)

        coeff = None
        self.norm_factor = math.sqrt(self.hidden_size_per_attention_head)
        if self.apply_query_key_layer_scaling:
            coeff = max(1, self.layer_number)
            self.norm_factor *= coeff

        if rotary:
            if neox_args.rotary_pct == 1:
                self.rotary_ndims = None
            else:
                assert neox_args.rotary_pct < 1
                self.rotary_ndims = int(self.hidden_size_per_attention_head * neox_args.rotary_pct)
            dim = self.rotary_ndims if self.rotary_ndims is not None else self.hidden_size_per_attention_head
            self.rotary_emb = RotaryEmbedding(dim, base=neox_args.rotary_emb_base, precision=neox_args.params_dtype)
        else:
            self.rotary_emb = None

        self.attention_type = neox_args.attention_config[layer_number]
        self.sparse = self.attention_type != "global"
        assert not self.sparse
        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=self.fp16,
            input_in_bf16=self.bf16,
            mask_func=self.attention_mask_func,
            softmax_in_fp32=self.attention_softmax_in_fp32,
            scale=coeff,
        )
        self.attention_dropout = nn.Dropout(neox_args.attention_dropout)

        # Output.
        self.dense = ParallelLinearSkipBias(neox_args.hidden_size, neox_args.hidden_size, skip_bias_add=True)

    def attention(self, query_layer, key_layer, value_layer, layer_past, attention_mask):
        # ===================================
        # Raw attention scores. [b, np, s, s]
        # ===================================

        # [b, np, sq, sk]
        output_size = (
            query_layer.size(1),
            query_layer.size(2),
            query_layer.size(0),
            key_layer.size(0),
        )

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)

        # preallocating result tensor: [b * np, sq, sk]
        matmul_result = torch.empty(
            output_size[0] * output_size[1],
            output_size[2],
            output_size[3],
            dtype=query_layer.dtype,
            device=query_layer.device,
        )

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(
            matmul_result,
            query_layer.transpose(0, 1),  # [b * np, sq, hn]
            key_layer.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        # ==================================================
        # Update attention mask for inference. [b, np, sq, sk]
        # ==================================================

        if self.get_key_value:
            with torch.no_grad():
                if layer_past is not None and layer_past.numel() > 0:
                    attention_mask = attention_mask[
                        ..., attention_scores.size(3) - 1, : attention_scores.size(3)
                    ].unsqueeze(2)
                else:
                    attention_mask = attention_mask[
                        ..., : attention_scores.size(3), : attention_scores.size(3)
                    ]

        # attention scores and attention mask [b, np, sq, sk]
        attention_probs = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        # =========================
        # Context layer. [sq, b, hp]
        # =========================

        # context layer shape: [b, np, sq, hn]
        output_size = (
            value_layer.size(1),
            value_layer.size(2),
            query_layer.size(0),
            value_layer.size(3),
        )

        # change view [sk, b * np, hn]
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)

        # change view [b * np, sq, sk]
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)

        # matmul: [b * np, sq, hn]
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))

        # change view [b, np, sq, hn]
        context_layer = context_layer.view(*output_size)
        return context_layer

    def forward(self, hidden_states, attention_mask, layer_past=None):
        # hidden_states: [sq, b, h]

        # Attention heads [sq, b, h] --> [sq, b, (np * 3 * hn)]
        mixed_x_layer, _ = self.query_key_value(hidden_states)

        # [sq, b, (np * 3 * hn)] --> [sq, b, np, 3 * hn]
        new_tensor_shape = mixed_x_layer.size()[:-1] + (
            self.num_attention_heads_per_partition,
            3 * self.hidden_size_per_attention_head,
        )
        mixed_x_layer = mixed_x_layer.view(*new_tensor_shape)

        # [sq, b, np, 3 * hn] --> 3 [sq, b, np, hn]  (mpu.split_tensor_along_last_dim)
        (query_layer, key_layer, value_layer) = torch.split(
            mixed_x_layer, self.hidden_size_per_attention_head, dim=-1
        )

        if exists(self.rotary_emb):
            if exists(self.rotary_ndims):
                # partial rotary
                query_rot, query_pass = (
                    query_layer[..., : self.rotary_ndims],
                    query_layer[..., self.rotary_ndims :],
                )
                key_rot, key_pass = (
                    key_layer[..., : self.rotary_ndims],
                    key_layer[..., self.rotary_ndims :],
                )
            else:
                # full rotary
                query_rot, key_rot = query_layer, key_layer
            apply_rotary_fn = apply_rotary_pos_emb

            seq_len = key_layer.shape[0]
            offset = 0
            if exists(layer_past) and layer_past.numel() > 0:
                offset = layer_past[0].shape[0]
                seq_len += offset
            cos, sin = self.rotary_emb(value_layer, seq_len=seq_len)
            query_layer, key_layer = apply_rotary_fn(query_rot, key_rot, cos, sin, offset=offset)

            if exists(self.rotary_ndims):
                query_layer = torch.cat((query_layer, query_pass), dim=-1)
                key_layer = torch.cat((key_layer, key_pass), dim=-1)

        # ==================================
        # Cache key and value for inference
        # ==================================

        if exists(layer_past) and layer_past.numel() > 0:
            past_key, past_value = layer_past
            key_layer = torch.cat((past_key.type_as(key_layer), key_layer), dim=0)
            value_layer = torch.cat((past_value.type_as(value_layer), value_layer), dim=0)

        if self.get_key_value:
            present = torch.stack((key_layer, value_layer))

        context_layer = self.attention(query_layer, key_layer, value_layer, layer_past, attention_mask)

        # [b, np, sq, hn] --> [sq, b, np, hn]
        context_layer = context_layer.permute(2, 0, 1, 3).contiguous()

        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_layer_shape = context_layer.size()[:-2] + (self.hidden_size_per_partition,)
        context_layer = context_layer.view(*new_context_layer_shape)

        # Output. [sq, b, h]
        output, bias = self.dense(context_layer)

        if self.get_key_value:
            output = [output, present]

        return output, bias


class ParallelTransformerLayer(nn.Module):
    def __init__(self, neox_args, attention_mask_func, layer_number, rotary=False, get_key_value=False):
        super().__init__()
        self.layer_number = layer_number
        eps = neox_args.layernorm_epsilon
        self.input_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=eps)
        self.get_key_value = get_key_value
        self.hidden_dropout = neox_args.hidden_dropout
        self.bias_dropout_fusion = neox_args.bias_dropout_fusion
        self.gpt_j_residual = neox_args.gpt_j_residual
        if self.gpt_j_residual:
            self.reduce = lambda x: x  # mpu.mappings.reduce_from_model_parallel_region on one rank

        self.attention = ParallelSelfAttention(
            neox_args=neox_args,
            attention_mask_func=attention_mask_func,
            layer_number=layer_number,
            get_key_value=self.get_key_value,
            rotary=rotary,
        )
        self.post_attention_layernorm = nn.LayerNorm(neox_args.hidden_size, eps=eps)
        self.mlp = ParallelMLP(neox_args=neox_args)

    def _get_bias_dropout(self):
        return get_bias_dropout_add(self.training)

    def forward(self, x, attention_mask, layer_past=None):
        bias_dropout_fn = self._get_bias_dropout()
        # x: [b, s, h]
        if self.gpt_j_residual:
            # x = x + attn(ln1(x)) + mlp(ln2(x))
            residual = x
            attention_output, attention_bias = self.attention(
                self.input_layernorm(x), attention_mask, layer_past=layer_past
            )
            if self.get_key_value:
                attention_output, presents = attention_output

            attention_output = bias_dropout_fn(
                attention_output,
                bias=attention_bias.expand_as(attention_output),
                residual=None,
                prob=self.hidden_dropout,
            )

            # output = mlp(ln2(x)) + attention_output
            mlp_output, mlp_bias = self.mlp(self.post_attention_layernorm(x))
            output = bias_dropout_fn(
                mlp_output,
                bias=mlp_bias.expand_as(mlp_output),
                residual=attention_output,
                prob=self.hidden_dropout,
            )

            # output = output + residual
            output = residual + self.reduce(output)
        else:
            residual = x
            attention_output, attention_bias = self.attention(
                self.input_layernorm(x), attention_mask, layer_past=layer_past
            )
            if self.get_key_value:
                attention_output, presents = attention_output
            attention_output = bias_dropout_fn(
                attention_output,
                bias=attention_bias.expand_as(residual),
                residual=residual,
                prob=self.hidden_dropout,
            )
            mlp_output, mlp_bias = self.mlp(self.post_attention_layernorm(attention_output))
            output = bias_dropout_fn(
                mlp_output,
                bias=mlp_bias.expand_as(attention_output),
                residual=attention_output,
                prob=self.hidden_dropout,
            )

        if self.get_key_value:
            output = [output, presents]

        return output


class ParallelTransformerLayerPipe(ParallelTransformerLayer):
    """Extends ParallelTransformerLayer to forward attention_mask through the pipeline."""

    def forward(self, args):
        in_inference = len(args) == 4  # length of the args in inference == 4
        in_train = len(args) == 2  # length of the args in training == 2
        if in_train:
            hidden_states, attention_mask = args
            # we are returning just [hidden_states, mask]
            return super().forward(hidden_states, attention_mask), attention_mask
        elif in_inference:
            # we are in inference
            hidden_states, layer_past, presents, attention_mask = args
            past = torch.Tensor()
            if layer_past is not None and layer_past.numel() > 0:
                past = layer_past[self.layer_number]
            outputs = super().forward(hidden_states, attention_mask, layer_past=past)

            if self.get_key_value:
                # outputs = [hidden_states, present]
                hidden_states, present = outputs
                if presents.numel() == 0:
                    presents = present.unsqueeze(dim=0)
                else:
                    presents = torch.cat((presents, present.unsqueeze(dim=0)))
            else:
                hidden_states = outputs
            return hidden_states, layer_past, presents, attention_mask
        else:
            raise ValueError(
                f"In layer {self.layer_number} - Incorrect number of arguments ({len(args)}) for {self.__class__.__name__}"
            )


class ParallelLinearPipe(nn.Module):
    """ParallelLinear (column parallelism, bias=False) + the pipe helper that passes presents through."""

    def __init__(self, neox_args):
        super().__init__()
        self.final_linear = ParallelLinearSkipBias(neox_args.hidden_size, neox_args.padded_vocab_size, bias=False)

    def forward(self, args):
        if not isinstance(args, tuple):
            hidden_state = args
            logits, bias = self.final_linear(hidden_state)
            return logits
        elif len(args) == 2:
            # we are in inference, so input is (hidden_states, presents)
            hidden_state, presents = args
            logits, bias = self.final_linear(hidden_state)
            return logits, presents
        else:
            raise ValueError(f"Incorrect number of arguments for {self.__class__.__name__}")


class NormPipe(nn.Module):
    """Just a helper class to pass presents through to the output when doing inference with a Pipe Parallel model"""

    def __init__(self, norm_class, hidden_size, eps):
        super().__init__()
        self.norm = norm_class(hidden_size, eps=eps)

    def forward(self, args):
        if not isinstance(args, tuple):
            hidden_state = args
            return self.norm(hidden_state)
        elif len(args) == 2:
            # in inference, args will be (hidden_state, presents)
            hidden_state, presents = args
            hidden_state = self.norm(hidden_state)
            return hidden_state, presents
        else:
            raise ValueError(f"Incorrect number of arguments for {self.__class__.__name__}")


# ---------------------------------------------------------------------------------------------------------------
# megatron/model/gpt2_model.py
# ---------------------------------------------------------------------------------------------------------------


def _pre_transformer_block(args):
    in_inference = len(args) == 3
    in_train = len(args) == 2
    # data format change for hidden_states to avoid explicit tranposes : [b s h] --> [s b h]
    if in_inference:
        # we need to add a container to cache `presents` from each layer's forward pass
        # inputs/outputs are now (hidden_states, layer_past, presents, attention_mask)
        fn = lambda x: (x[0].transpose(0, 1).contiguous(), x[1], torch.Tensor(), *x[2:])
    elif in_train:
        fn = lambda x: (x[0].transpose(0, 1).contiguous(), *x[1:])
    else:
        raise ValueError("Incorrect number of args in `_pre_transformer_block`")
    return fn(args)


def _post_transformer_block(args):
    in_inference = len(args) == 4
    in_train = len(args) == 2
    if in_inference:
        # from (hidden_states, layer_past, presents, attention_mask)
        # to (hidden_states.T, presents)
        fn = lambda x: (x[0].transpose(0, 1).contiguous(), x[2])
    elif in_train:
        fn = lambda x: x[0].transpose(0, 1).contiguous()
    else:
        raise ValueError("Incorrect number of args in `_post_transformer_block`")
    return fn(args)


class Lambda(nn.Module):
    def __init__(self, func):
        super().__init__()
        self.func = func

    def forward(self, x):
        return self.func(x)


class GPT2ModelPipe(nn.Module):
    """GPT2ModelPipe.to_sequential() on one rank, no weight tying (Pythia)."""

    def __init__(self, neox_args, inference=True, get_key_value=True):
        super().__init__()
        self.neox_args = neox_args
        self._inference = inference
        self.get_key_value = get_key_value if inference else False
        specs = [
            EmbeddingPipe(
                neox_args,
                neox_args.hidden_size,
                neox_args.padded_vocab_size,
                neox_args.max_position_embeddings,
                neox_args.hidden_dropout,
            ),
            Lambda(_pre_transformer_block),
        ]
        for i in range(neox_args.num_layers):
            specs.append(
                ParallelTransformerLayerPipe(
                    neox_args=neox_args,
                    attention_mask_func=gpt2_attention_mask_func,
                    layer_number=i,
                    rotary=neox_args.pos_emb == "rotary",
                    get_key_value=self.get_key_value,
                )
            )
        specs.append(Lambda(_post_transformer_block))
        specs.append(NormPipe(nn.LayerNorm, neox_args.hidden_size, eps=neox_args.layernorm_epsilon))
        specs.append(ParallelLinearPipe(neox_args))
        self.module = nn.Sequential(*specs)


# ---------------------------------------------------------------------------------------------------------------
# megatron/text_generation_utils.py
# ---------------------------------------------------------------------------------------------------------------


def get_batch(neox_args, context_tokens: torch.Tensor):
    tokens = context_tokens.contiguous()
    # Get the attention mask and postition ids.
    attention_mask, _, position_ids = get_ltor_masks_and_position_ids(
        tokens, neox_args.tokenizer.eod, neox_args.eod_mask_loss
    )
    return tokens, attention_mask, position_ids


def pad_batch(context_tokens: List[List[int]], pad_id: int, pad_len: int):
    context_lengths = []
    for tokens in context_tokens:
        context_length = len(tokens)
        if context_length < pad_len:
            tokens.extend([pad_id] * (pad_len - context_length))
        elif context_length > pad_len:
            raise ValueError("context_length is bigger than to be padded length")
        context_lengths.append(context_length)
    return context_tokens, context_lengths


def switch(val1, val2, boolean):
    """
    replaces items in val1 with items in val2 where boolean = True
    """
    boolean = boolean.type_as(val1)
    return (1 - boolean) * val1 + boolean * val2


def forward_model(neox_args, model, model_inputs):
    # pipe_parallel_size <= 1: the model is forwarded through model.module
    return model.module(model_inputs)


def stop_tokens_in_completion(stop_tokens, context_tokens, batch_index, current_index):
    if stop_tokens is None:
        return False
    res = []
    for token_group in stop_tokens:
        context = context_tokens[batch_index, : current_index + 1]
        context = context[-len(token_group) :]
        if context.shape[0] == token_group.shape[0]:
            res.append(all(token_group == context))
        else:
            res.append(False)
    return any(res)


def stream_tokens(
    neox_args,
    model,
    context_tokens: List[List[int]],
    eos_token_id: int = None,
    maximum_tokens: int = None,
    recompute: bool = False,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    stop_tokens=None,
):
    model.eval()

    # pad batch in order to allow conversion to tensor
    context_tokens, context_lengths = pad_batch(
        copy.deepcopy(context_tokens),
        pad_id=neox_args.tokenizer.eod,
        pad_len=neox_args.seq_length,
    )

    # convert to tensor
    context_tokens = torch.LongTensor(context_tokens)
    if stop_tokens:
        stop_tokens = torch.LongTensor(stop_tokens)
        if stop_tokens.ndim == 1:
            stop_tokens = stop_tokens.unsqueeze(0)

    token_generation_start_index = torch.LongTensor(context_lengths)

    # produce batch relevant attention_mask and position_ids
    context_tokens, attention_mask, position_ids = get_batch(neox_args, context_tokens)

    # set variables
    eos_token_id = eos_token_id or neox_args.tokenizer.eod
    maximum_tokens = maximum_tokens or (neox_args.seq_length - token_generation_start_index.max().item() - 1)
    batch_size = context_tokens.size(0)

    # get the context_index at which generation is to start
    # we start generation at the position where the smallest context ends
    token_index_to_generate = token_generation_start_index.min().item()
    first_token_index_to_generate = token_index_to_generate
    last_token_index_to_generate = min(
        neox_args.seq_length - 1,  # never generate more than the model's sequence length
        token_index_to_generate + maximum_tokens - 1,
    )

    all_logits = torch.zeros((batch_size, neox_args.seq_length, neox_args.padded_vocab_size))

    with torch.no_grad():
        # initialize generation variables
        state_is_done = torch.zeros([batch_size]).byte()
        layer_past = torch.Tensor()
        token_generation_end_index = torch.ones([batch_size]).long() * (-1)

        while token_index_to_generate <= last_token_index_to_generate:
            if recompute:
                model_inputs = (
                    context_tokens,
                    position_ids,
                    attention_mask,
                    torch.Tensor(),
                )
                logits, _ = forward_model(neox_args, model, model_inputs)
                generated_token_logits = logits[:, token_index_to_generate - 1, :]
                all_logits = logits
            else:
                if token_index_to_generate == first_token_index_to_generate:
                    tokens_to_use = context_tokens[:, :token_index_to_generate]
                    positions_to_use = position_ids[:, :token_index_to_generate]
                else:
                    tokens_to_use = context_tokens[:, token_index_to_generate - 1].view(batch_size, -1)
                    positions_to_use = position_ids[:, token_index_to_generate - 1].view(batch_size, -1)
                model_inputs = (
                    tokens_to_use,  # input_ids
                    positions_to_use,  # position_ids
                    attention_mask,  # attention_mask
                    layer_past,  # layer_past
                )

                logits, layer_past = forward_model(neox_args, model, model_inputs)
                generated_token_logits = logits[:, -1].view(batch_size, -1).contiguous()
                if token_index_to_generate == first_token_index_to_generate:
                    all_logits[:, :token_index_to_generate, :] = logits[:, :token_index_to_generate, :]
                else:
                    all_logits[:, token_index_to_generate - 1, :] = logits[:, 0, :]  # only one token will be computed

            # sample token id of the to be generated token (greedy: temperature 0, top_k 0, top_p 0)
            assert temperature == 0.0 and top_k == 0 and top_p == 0.0
            generated_tokens = torch.argmax(generated_token_logits, dim=-1).view(-1)

            # determine if state has started for each batch item
            state_started = token_generation_start_index <= token_index_to_generate

            # switch out only padding tokens (the batch items that have been started)
            context_tokens[:, token_index_to_generate] = switch(
                context_tokens[:, token_index_to_generate].view(-1),
                generated_tokens,
                state_started,
            )

            # determine if state has finished for each batch item
            state_done = (generated_tokens == eos_token_id).byte() & state_started.byte()
            state_is_done = state_is_done | state_done
            stop_tokens_produced = torch.zeros_like(state_is_done)
            for batch_idx, ctx in enumerate(context_tokens):
                stop_tokens_produced[batch_idx] = stop_tokens_in_completion(
                    stop_tokens, context_tokens, batch_idx, token_index_to_generate
                )
            state_is_done = state_is_done | stop_tokens_produced

            token_generation_end_index[(state_started.byte() & ~state_is_done).bool()] = token_index_to_generate

            token_index_to_generate += 1

            yield context_tokens, token_generation_start_index, token_generation_end_index, all_logits, state_is_done.bool()
            if torch.all(state_is_done):
                break


# ---------------------------------------------------------------------------------------------------------------
# self-check: a hand-written causal forward over one unpadded prompt, no cache
# ---------------------------------------------------------------------------------------------------------------


def reference_logits(model, neox_args, ids):
    """ids: a list of token ids of ONE sequence. Batch-first, SDPA is_causal, rotary angles at 0..T-1."""
    seq = model.module
    emb, layers, final_norm, head = seq[0], seq[2 : 2 + neox_args.num_layers], seq[-2].norm, seq[-1].final_linear
    T = len(ids)
    H = neox_args.num_attention_heads
    hd = neox_args.hidden_size // H
    rot = int(hd * neox_args.rotary_pct)
    x = emb.word_embeddings.weight[torch.tensor(ids)][None]  # [1, T, h]
    inv = 1.0 / (neox_args.rotary_emb_base ** (torch.arange(0, rot, 2).float() / rot))
    ang = torch.arange(T).float()[:, None] * inv[None, :]  # [T, rot/2]
    cos, sin = ang.cos(), ang.sin()

    def rope(t):  # t: [1, H, T, hd]; NeoX style: pairs (i, i + rot/2) over the first rot dims
        a, b, rest = t[..., : rot // 2], t[..., rot // 2 : rot], t[..., rot:]
        return torch.cat((a * cos - b * sin, b * cos + a * sin, rest), dim=-1)

    for lyr in layers:
        att = lyr.attention
        h1 = lyr.input_layernorm(x)
        qkv = F.linear(h1, att.query_key_value.weight, att.query_key_value.bias)  # [1, T, H * 3 * hd]
        qkv = qkv.view(1, T, H, 3 * hd).permute(0, 2, 1, 3)
        q, k, v = qkv[..., :hd], qkv[..., hd : 2 * hd], qkv[..., 2 * hd :]
        o = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        o = o.permute(0, 2, 1, 3).reshape(1, T, H * hd)
        a_out = F.linear(o, att.dense.weight, att.dense.bias)
        h2 = lyr.post_attention_layernorm(x)
        m = F.gelu(F.linear(h2, lyr.mlp.dense_h_to_4h.weight, lyr.mlp.dense_h_to_4h.bias))
        m_out = F.linear(m, lyr.mlp.dense_4h_to_h.weight, lyr.mlp.dense_4h_to_h.bias)
        x = x + a_out + m_out
    return F.linear(final_norm(x), head.weight)[0]  # [T, V]


def reference_greedy(model, neox_args, prompt, n_new, eos):
    ids = list(prompt)
    out = []
    for _ in range(n_new):
        nxt = int(reference_logits(model, neox_args, ids)[-1].argmax())
        if nxt == eos:
            break
        out.append(nxt)
        ids.append(nxt)
    return out


def main():
    neox_args = NeoXArgs()
    model = GPT2ModelPipe(neox_args, inference=True, get_key_value=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0.0, 0.1)
            elif "norm" in name:
                p.normal_(1.0, 0.1)
            else:
                p.normal_(0.0, 0.3)
    model.eval()

    g = torch.Generator().manual_seed(1)
    lengths = [5, 9, 7]
    prompts = [torch.randint(1, neox_args.padded_vocab_size, (n,), generator=g).tolist() for n in lengths]
    eod = neox_args.tokenizer.eod
    # each prompt alone, greedy as far as seq_length allows (a shorter run's tokens are a prefix of these)
    alone = {eod: [reference_greedy(model, neox_args, p, neox_args.seq_length - len(p), eod) for p in prompts]}
    # a second end-of-text id taken from the data (the 5th token prompt 0 generates alone), so that rows finish at
    # different columns while the others go on; the pad stays eod
    stop_id = alone[eod][0][4]
    assert stop_id != eod
    alone[stop_id] = [reference_greedy(model, neox_args, p, neox_args.seq_length - len(p), stop_id) for p in prompts]

    for recompute in (False, True):
        for maximum_tokens, eos in ((8, eod), (None, stop_id)):
            n_steps = 0
            for (
                context_tokens,
                start_index,
                end_index,
                all_logits,
                is_done,
            ) in stream_tokens(
                neox_args=neox_args,
                model=model,
                context_tokens=prompts,
                eos_token_id=eos,
                maximum_tokens=maximum_tokens,
                recompute=recompute,
            ):
                n_steps += 1

            first = min(lengths)
            last = first + n_steps - 1  # the last column generated
            counts = []
            for i, prompt in enumerate(prompts):
                start, end = start_index[i].item(), end_index[i].item()
                got = context_tokens[i, start : end + 1].tolist() if end >= start else []
                want = alone[eos][i][: last - len(prompt) + 1]
                assert got == want, (recompute, maximum_tokens, eos, i, got, want)
                assert context_tokens[i, : len(prompt)].tolist() == prompt
                counts.append(len(got))

                # logits stream_tokens filled (positions 0 .. last - 1) against the row's final tokens alone
                row_ids = context_tokens[i, :last].tolist()
                ref = reference_logits(model, neox_args, row_ids)
                torch.testing.assert_close(all_logits[i, :last], ref, rtol=1e-4, atol=1e-4)
            print(
                f"recompute={recompute} maximum_tokens={maximum_tokens} eos={eos}: {n_steps} steps from column "
                f"{first}, {counts} tokens per row (done: {is_done.tolist()}); tokens and logits match each prompt alone"
            )
    print("ok")


if __name__ == "__main__":
    main()
