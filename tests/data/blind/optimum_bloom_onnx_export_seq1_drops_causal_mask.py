"""Optimum ONNX export of BLOOM: tracing with sequence_length=1 bakes out the causal mask.

Citation: huggingface/optimum PR #1257 ("Enable the export of only one decoder"; description read). It
states that for BLOOM-like architectures, exporting with a sequence length of 1 makes the decoder
attention mask "generated incorrectly for sequence length greater than 1", because of the
`if src_length > 1:` branch in transformers' `BloomModel._prepare_attn_mask`, and introduces a model
patcher for the export. (Follow-ups: issue #1461 / PR #1509 later dropped the patch by exporting with
sequence length > 1 instead.) The patched function body is written from that description.

Bug: the single ONNX decoder (`decoder_model.onnx` handling prefill and decode) is traced with a dummy
`input_ids` of length 1 plus dummy past key/values. During tracing `src_length == 1`, so the causal-mask
branch is not recorded: the exported graph only applies the padding mask. Run on a real prompt
(sequence length > 1, empty past), every prompt token attends to later prompt tokens.

Fix: during export, patch `_prepare_attn_mask` so the causal mask is always built (no
`src_length > 1` condition); for a single new token it is all-visible anyway.

Reproduction: a one-layer BLOOM port (ALiBi, `baddbmm` scores, `masked_fill` with the bool mask,
softmax) traced with `torch.jit.trace` (the tracer the TorchScript ONNX exporter runs) on a length-1
dummy with a length-2 dummy past, then run on a 5-token prompt with an empty past.
"""
import math
import sys
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
warnings.filterwarnings("ignore")


@dataclass
class BloomConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    n_head: int = 4
    layer_norm_epsilon: float = 1e-5


def build_alibi_tensor(attention_mask: torch.Tensor, num_heads: int, dtype: torch.dtype) -> torch.Tensor:
    batch_size, seq_length = attention_mask.shape
    closest_power_of_2 = 2 ** math.floor(math.log2(num_heads))
    base = torch.tensor(2 ** (-(2 ** -(math.log2(closest_power_of_2) - 3))), dtype=torch.float32)
    powers = torch.arange(1, 1 + closest_power_of_2, dtype=torch.int32)
    slopes = torch.pow(base, powers)
    arange_tensor = ((attention_mask.cumsum(dim=-1) - 1) * attention_mask)[:, None, :]
    alibi = slopes[..., None] * arange_tensor
    return alibi.reshape(batch_size * num_heads, 1, seq_length).to(dtype)


def _make_causal_mask(input_ids_shape: torch.Size, device: torch.device, past_key_values_length: int) -> torch.BoolTensor:
    batch_size, target_length = input_ids_shape
    mask = torch.empty((target_length, target_length + past_key_values_length), dtype=torch.bool, device=device)
    seq_ids = torch.arange(target_length, device=device)
    mask[:, past_key_values_length:] = seq_ids[:, None] < seq_ids[None, :]
    if past_key_values_length > 0:
        mask[:, :past_key_values_length] = False
    expanded_mask = mask[None, None, :, :].expand(batch_size, 1, target_length, target_length + past_key_values_length)
    return expanded_mask


def _expand_mask(mask: torch.Tensor, tgt_length: int) -> torch.BoolTensor:
    batch_size, src_length = mask.shape
    tgt_length = tgt_length if tgt_length is not None else src_length
    expanded_mask = ~(mask[:, None, None, :].to(torch.bool))
    return expanded_mask.expand(batch_size, 1, tgt_length, src_length)


class BloomAttention(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.num_heads = config.n_head
        self.head_dim = config.hidden_size // config.n_head
        self.inv_norm_factor = 1.0 / math.sqrt(self.head_dim)
        self.beta = 1.0
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size, bias=True)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, alibi, attention_mask, layer_past):
        batch_size, q_length, _ = hidden_states.shape
        fused = self.query_key_value(hidden_states).view(batch_size, q_length, self.num_heads, 3, self.head_dim)
        query_layer = fused[..., 0, :].transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        key_layer = fused[..., 1, :].permute(0, 2, 3, 1).reshape(batch_size * self.num_heads, self.head_dim, q_length)
        value_layer = fused[..., 2, :].transpose(1, 2).reshape(batch_size * self.num_heads, q_length, self.head_dim)
        past_key, past_value = layer_past
        key_layer = torch.cat((past_key, key_layer), dim=2)
        value_layer = torch.cat((past_value, value_layer), dim=1)
        kv_length = key_layer.shape[-1]
        matmul_result = alibi.baddbmm(batch1=query_layer, batch2=key_layer, beta=self.beta, alpha=self.inv_norm_factor)
        attention_scores = matmul_result.view(batch_size, self.num_heads, q_length, kv_length)
        attn_weights = torch.masked_fill(attention_scores, attention_mask, torch.finfo(attention_scores.dtype).min)
        attention_probs = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attention_probs_reshaped = attention_probs.view(batch_size * self.num_heads, q_length, kv_length)
        context_layer = torch.bmm(attention_probs_reshaped, value_layer)
        context_layer = context_layer.view(batch_size, self.num_heads, q_length, self.head_dim).transpose(1, 2)
        return self.dense(context_layer.reshape(batch_size, q_length, -1)), (key_layer, value_layer)


class BloomModel(nn.Module):
    def __init__(self, config: BloomConfig):
        super().__init__()
        self.num_heads = config.n_head
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.word_embeddings_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)
        self.self_attention = BloomAttention(config)
        self.ln_f = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_epsilon)

    def _prepare_attn_mask(self, attention_mask: torch.Tensor, input_shape: Tuple[int, int],
                           past_key_values_length: int) -> torch.BoolTensor:
        # create causal mask
        # [batch_size, seq_length] -> [batch_size, 1, tgt_length, src_length]
        combined_attention_mask = None
        device = attention_mask.device
        _, src_length = input_shape

        if src_length > 1:
            combined_attention_mask = _make_causal_mask(
                input_shape, device=device, past_key_values_length=past_key_values_length
            )

        # [batch_size, seq_length] -> [batch_size, 1, tgt_length, src_length]
        expanded_attn_mask = _expand_mask(attention_mask, tgt_length=src_length)
        combined_attention_mask = (
            expanded_attn_mask if combined_attention_mask is None else expanded_attn_mask | combined_attention_mask
        )
        return combined_attention_mask

    def forward(self, input_ids, attention_mask, past_key, past_value):
        hidden_states = self.word_embeddings_layernorm(self.word_embeddings(input_ids))
        past_key_values_length = past_key.shape[2]
        alibi = build_alibi_tensor(attention_mask, self.num_heads, dtype=hidden_states.dtype)
        causal_mask = self._prepare_attn_mask(attention_mask, input_shape=input_ids.shape,
                                              past_key_values_length=past_key_values_length)
        out, (present_key, present_value) = self.self_attention(hidden_states, alibi, causal_mask, (past_key, past_value))
        return self.ln_f(hidden_states + out), present_key, present_value


def _prepare_attn_mask_patched(self, attention_mask, input_shape, past_key_values_length):
    """Export-time replacement: always build the causal mask, whatever the traced sequence length."""
    device = attention_mask.device
    _, src_length = input_shape
    combined_attention_mask = _make_causal_mask(input_shape, device=device, past_key_values_length=past_key_values_length)
    expanded_attn_mask = _expand_mask(attention_mask, tgt_length=src_length)
    return expanded_attn_mask | combined_attention_mask


@contextmanager
def model_patcher(model):
    """Stand-in for optimum's ModelPatcher used around the export call."""
    if FIXED:
        model._prepare_attn_mask = _prepare_attn_mask_patched.__get__(model)
    try:
        yield model
    finally:
        model.__dict__.pop("_prepare_attn_mask", None)


def main():
    config = BloomConfig()
    model = BloomModel(config).eval()
    head_dim = config.hidden_size // config.n_head
    batch_size, dummy_past = 2, 2
    # dummy inputs of the exporter: sequence_length=1 plus a past of dummy_past tokens
    dummy = (
        torch.randint(0, config.vocab_size, (batch_size, 1)),
        torch.ones(batch_size, dummy_past + 1, dtype=torch.long),
        torch.randn(batch_size * config.n_head, head_dim, dummy_past),
        torch.randn(batch_size * config.n_head, dummy_past, head_dim),
    )
    with torch.no_grad(), model_patcher(model):
        exported = torch.jit.trace(model, dummy, check_trace=False)
    # first generation step of the exported decoder: the prompt with an empty past
    prompt = torch.randint(0, config.vocab_size, (batch_size, 5))
    empty_k = torch.zeros(batch_size * config.n_head, head_dim, 0)
    empty_v = torch.zeros(batch_size * config.n_head, 0, head_dim)
    with torch.no_grad():
        hidden, _, _ = exported(prompt, torch.ones(batch_size, 5, dtype=torch.long), empty_k, empty_v)
    print("prefill hidden checksum", round(float(hidden.abs().sum()), 4))


if __name__ == "__main__":
    main()
