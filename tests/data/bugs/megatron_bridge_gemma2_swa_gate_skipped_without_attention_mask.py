"""Megatron-Bridge Gemma2: the sliding-window layers only got their window when a mask was passed in.

Citation: NVIDIA-NeMo/Megatron-Bridge#4308 (commit c60434f90, "fix+feat(gemma2): fix SWA correctness
bugs and add FlexAttention fused softcap+SWA path"), src/megatron/bridge/models/gemma/gemma2_provider.py.

The bug: ``Gemma2DotProductAttention.forward`` built the sliding-window mask with
``if attention_mask is not None and self.window_size is not None: attention_mask = get_swa(...)``.
Megatron-Core's GPT pretraining path passes ``attention_mask=None`` (the dataloader makes no mask),
so on every even (sliding) layer the window was never built and ``FusedScaleMaskSoftmax`` fell back
to its default causal mask: the local layers attended the whole prefix like the global ones.
The provider also gave ``window_size = (4096, 0)``, which get_swa reads as 4096 keys *before* the
query plus the query itself (one more than Gemma2's 4096-token window).

The fix: always build the window on the sliding layers (``swa_mask = get_swa(...)``; unsqueezed to
[1, 1, sq, sk] when there is no incoming mask, OR-ed with it otherwise), switch those layers to
``AttnMaskType.arbitrary`` and set ``window_size = (4095, 0)``. (The same commit adds a
FlexAttention subclass; this program keeps the unfused ``Gemma2DotProductAttention`` path.)

Ported at toy sizes, random weights, fp32 on CPU (so FusedScaleMaskSoftmax takes its torch path):
Megatron's [s, b, np, hn] layout, query_pre_attn_scalar scaling, attention logit softcapping,
Gemma2's pre/post norms and final logit softcap. The window is shrunk from 4096 to 8 (so
``(8, 0)`` before the fix, ``(7, 0)`` after) so that the 20-token pretraining sequences are longer
than it. ``get_swa`` allocated its mask on "cuda"; here it uses the query's device.
"""

import enum
import math
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


# ----------------------------------------------------------------- megatron.core stand-ins
class AttnMaskType(enum.Enum):
    padding = 1
    causal = 2
    no_mask = 3
    padding_causal = 4
    arbitrary = 5


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


def get_default_causal_mask(sq: int) -> Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


class FusedScaleMaskSoftmax(nn.Module):
    """megatron/core/fusions/fused_softmax.py, trimmed: the fused CUDA kernels are only taken for
    fp16/bf16 inputs, so in fp32 every call goes through forward_torch_softmax."""

    def __init__(self, input_in_fp16, input_in_bf16, attn_mask_type, scaled_masked_softmax_fusion,
                 mask_func, softmax_in_fp32, scale, window_size=None):
        super().__init__()
        self.input_in_fp16 = input_in_fp16
        self.input_in_bf16 = input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale
        self.window_size = window_size

    def forward(self, input: Tensor, mask: Optional[Tensor]):
        assert input.dim() == 4
        if self.is_kernel_available(mask, *input.size()):
            raise RuntimeError("fused softmax kernels are CUDA-only")
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask, b, np, sq, sk):
        attn_batches = b * np
        return (
            self.scaled_masked_softmax_fusion
            and self.input_in_float16
            and 16 < sk <= 4096
            and sq % 4 == 0
            and sk % 4 == 0
            and attn_batches % 4 == 0
        )

    def forward_torch_softmax(self, input, mask):
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        sq, sk = input.size(2), input.size(3)
        if self.attn_mask_type == AttnMaskType.causal and mask is None and sq > 1:
            assert sq == sk, "causal mask is only for self attention"
            mask = get_default_causal_mask(sq).to(input.device)
        mask_output = self.mask_func(input, mask) if mask is not None else input
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


def divide(a, b):
    assert a % b == 0
    return a // b


# ----------------------------------------------------------------- provider / config
@dataclass
class Gemma2ModelProvider:
    num_layers: int = 2
    hidden_size: int = 32
    ffn_hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    vocab_size: int = 96
    seq_length: int = 20
    layernorm_epsilon: float = 1e-6
    rotary_base: float = 10000
    window_size: tuple = (7, 0) if FIXED else (8, 0)  # upstream: (4095, 0) fixed, (4096, 0) before
    query_pre_attn_scalar: int = 16  # upstream 224 for head_dim 256
    attn_logit_softcapping: float = 50.0
    final_logit_softcapping: float = 30.0
    attention_dropout: float = 0.0
    apply_query_key_layer_scaling: bool = False
    fp16: bool = False
    bf16: bool = False
    masked_softmax_fusion: bool = True
    attention_softmax_in_fp32: bool = True
    context_parallel_size: int = 1
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = False


def logit_softcapping(logits: torch.Tensor, scale: Optional[float]) -> torch.Tensor:
    """Prevents logits from growing excessively by scaling them to a fixed range"""
    if not scale:
        return logits

    return scale * torch.tanh(logits / scale)


def get_swa(seq_q: int, seq_kv: int, window_size: tuple, device="cpu") -> torch.Tensor:
    """Create the equivalent attention mask for SWA in [seq_q, seq_kv] shape"""
    m = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=device)
    mu = torch.triu(m, diagonal=seq_kv - seq_q - window_size[0])
    ml = torch.tril(mu, diagonal=seq_kv - seq_q + window_size[1])
    ml = ~ml

    return ml


class Gemma2DotProductAttention(nn.Module):
    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float = None):
        super().__init__()
        self.config = config
        assert self.config.context_parallel_size == 1

        self.layer_number = max(1, layer_number)

        self.window_size = None
        if self.layer_number % 2 == 0:
            self.window_size = config.window_size

        if FIXED:
            self.attn_mask_type = AttnMaskType.arbitrary if self.window_size is not None else attn_mask_type
        else:
            self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type  # unused for now

        projection_size = self.config.kv_channels * self.config.num_attention_heads
        world_size = self.config.tensor_model_parallel_size
        self.hidden_size_per_partition = divide(projection_size, world_size)
        self.hidden_size_per_attention_head = divide(projection_size, config.num_attention_heads)
        self.num_attention_heads_per_partition = divide(self.config.num_attention_heads, world_size)
        self.num_query_groups_per_partition = divide(self.config.num_query_groups, world_size)

        coeff = None
        self.norm_factor = math.sqrt(config.query_pre_attn_scalar)
        if self.config.apply_query_key_layer_scaling:
            coeff = self.layer_number
            self.norm_factor *= coeff

        self.scale_mask_softmax = FusedScaleMaskSoftmax(
            input_in_fp16=self.config.fp16,
            input_in_bf16=self.config.bf16,
            attn_mask_type=self.attn_mask_type,
            scaled_masked_softmax_fusion=self.config.masked_softmax_fusion,
            mask_func=attention_mask_func,
            softmax_in_fp32=self.config.attention_softmax_in_fp32,
            scale=coeff,
        )
        self.attention_dropout = nn.Dropout(
            self.config.attention_dropout if attention_dropout is None else attention_dropout
        )

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Optional[Tensor],
                attn_mask_type: AttnMaskType = None, packed_seq_params=None):
        assert packed_seq_params is None

        if self.num_attention_heads_per_partition // self.num_query_groups_per_partition > 1:
            key = key.repeat_interleave(
                self.num_attention_heads_per_partition // self.num_query_groups_per_partition, dim=2
            )
            value = value.repeat_interleave(
                self.num_attention_heads_per_partition // self.num_query_groups_per_partition, dim=2
            )

        # [b, np, sq, sk]
        output_size = (query.size(1), query.size(2), query.size(0), key.size(0))

        # [sq, b, np, hn] -> [sq, b * np, hn]
        query = query.reshape(output_size[2], output_size[0] * output_size[1], -1)
        # [sk, b, np, hn] -> [sk, b * np, hn]
        key = key.reshape(output_size[3], output_size[0] * output_size[1], -1)

        matmul_input_buffer = torch.empty(
            (output_size[0] * output_size[1], output_size[2], output_size[3]), dtype=query.dtype
        )

        # Raw attention scores. [b * np, sq, sk]
        matmul_result = torch.baddbmm(
            matmul_input_buffer,
            query.transpose(0, 1),  # [b * np, sq, hn]
            key.transpose(0, 1).transpose(1, 2),  # [b * np, hn, sk]
            beta=0.0,
            alpha=(1.0 / self.norm_factor),
        )
        # Gemma 2 specific:
        matmul_result = logit_softcapping(matmul_result, self.config.attn_logit_softcapping)

        # change view to [b, np, sq, sk]
        attention_scores = matmul_result.view(*output_size)

        if FIXED:
            # sliding window attention: combine SWA mask with any incoming padding mask.
            if self.window_size is not None:
                swa_mask = get_swa(query.size(0), key.size(0), self.window_size, device=query.device)
                if attention_mask is None:
                    attention_mask = swa_mask.unsqueeze(0).unsqueeze(0)
                else:
                    attention_mask = swa_mask | attention_mask
        else:
            # sliding window attention
            if attention_mask is not None and self.window_size is not None:
                attention_mask = get_swa(query.size(0), key.size(0), self.window_size, device=query.device)

        # attention scores and attention mask [b, np, sq, sk]
        attention_probs: Tensor = self.scale_mask_softmax(attention_scores, attention_mask)
        attention_probs = self.attention_dropout(attention_probs)

        # [sk, b, np, hn] --> [b, np, sq, hn]
        output_size = (value.size(1), value.size(2), query.size(0), value.size(3))
        value = value.reshape(value.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context = torch.bmm(attention_probs, value.transpose(0, 1))
        context = context.view(*output_size)
        # [b, np, sq, hn] --> [sq, b, np, hn]
        context = context.permute(2, 0, 1, 3).contiguous()
        # [sq, b, np, hn] --> [sq, b, hp]
        new_context_shape = context.size()[:-2] + (self.hidden_size_per_partition,)
        context = context.view(*new_context_shape)
        return context


# ----------------------------------------------------------------- the rest of the GPT model
class RMSNorm(nn.Module):
    """layernorm_zero_centered_gamma=True: weight stored as (gamma - 1)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dim) * 0.1)
        self.eps = eps

    def forward(self, x):
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight)).type_as(x)


class RotaryEmbedding(nn.Module):
    def __init__(self, kv_channels, rotary_base):
        super().__init__()
        self.inv_freq = 1.0 / (rotary_base ** (torch.arange(0, kv_channels, 2).float() / kv_channels))

    def forward(self, max_seq_len: int) -> Tensor:
        seq = torch.arange(max_seq_len, dtype=self.inv_freq.dtype)
        freqs = torch.outer(seq, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        # [s, 1, 1, hn]
        return emb[:, None, None, :]


def _rotate_half(x):
    x1, x2 = torch.chunk(x, 2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    return t * freqs.cos() + _rotate_half(t) * freqs.sin()


class SelfAttention(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.config = config
        self.np = config.num_attention_heads
        self.ng = config.num_query_groups
        self.hn = config.kv_channels
        # TELayerNormColumnParallelLinear: input norm fused into linear_qkv
        self.linear_qkv_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.linear_qkv = nn.Linear(config.hidden_size, (self.np + 2 * self.ng) * self.hn, bias=False)
        self.core_attention = Gemma2DotProductAttention(
            config, layer_number, attn_mask_type=AttnMaskType.causal, attention_type="self"
        )
        # TERowParallelLinearLayerNorm: post-attention norm after linear_proj
        self.linear_proj = nn.Linear(self.np * self.hn, config.hidden_size, bias=False)
        self.linear_proj_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        sq, b, _ = hidden_states.shape
        mixed = self.linear_qkv(self.linear_qkv_norm(hidden_states))
        mixed = mixed.view(sq, b, self.ng, (self.np // self.ng + 2) * self.hn)
        query, key, value = torch.split(
            mixed, [self.np // self.ng * self.hn, self.hn, self.hn], dim=3
        )
        query = query.reshape(sq, b, self.np, self.hn)
        query = apply_rotary_pos_emb(query, rotary_pos_emb)
        key = apply_rotary_pos_emb(key, rotary_pos_emb)
        core = self.core_attention(query, key, value, attention_mask, attn_mask_type=AttnMaskType.causal)
        return self.linear_proj_norm(self.linear_proj(core))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.linear_fc1_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)
        self.linear_fc1 = nn.Linear(config.hidden_size, 2 * config.ffn_hidden_size, bias=False)
        self.linear_fc2 = nn.Linear(config.ffn_hidden_size, config.hidden_size, bias=False)
        self.linear_fc2_norm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, x):
        h = self.linear_fc1(self.linear_fc1_norm(x))
        g, u = torch.chunk(h, 2, dim=-1)
        h = F.gelu(g, approximate="tanh") * u
        return self.linear_fc2_norm(self.linear_fc2(h))


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number):
        super().__init__()
        self.self_attention = SelfAttention(config, layer_number)
        self.mlp = MLP(config)

    def forward(self, hidden_states, attention_mask, rotary_pos_emb):
        hidden_states = hidden_states + self.self_attention(hidden_states, attention_mask, rotary_pos_emb)
        hidden_states = hidden_states + self.mlp(hidden_states)
        return hidden_states


class GPTModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_pos_emb = RotaryEmbedding(config.kv_channels, config.rotary_base)
        # layer_number is 1-based in Megatron-Core
        self.layers = nn.ModuleList([TransformerLayer(config, i + 1) for i in range(config.num_layers)])
        self.final_layernorm = RMSNorm(config.hidden_size, config.layernorm_epsilon)

    def forward(self, input_ids, position_ids, attention_mask, labels=None):
        # EmbeddingScalingMixin: scale by sqrt(hidden_size); [b, s, h] -> [s, b, h]
        emb = self.word_embeddings(input_ids) * (self.config.hidden_size ** 0.5)
        hidden_states = emb.transpose(0, 1).contiguous()
        rotary_pos_emb = self.rotary_pos_emb(input_ids.size(1))
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask, rotary_pos_emb)
        hidden_states = self.final_layernorm(hidden_states)
        # shared embedding output layer + Gemma2OutputLayer final softcap
        logits = F.linear(hidden_states, self.word_embeddings.weight)
        logits = logit_softcapping(logits, self.config.final_logit_softcapping)
        logits = logits.transpose(0, 1).contiguous()  # [b, s, V]
        if labels is None:
            return logits
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)).float(), labels.view(-1), reduction="none")
        return loss.view_as(labels), logits


def get_batch(config, g):
    """Pretraining batch as Megatron's GPTDataset gives it with create_attention_mask=False:
    tokens, labels (shifted), loss_mask, position_ids, and no attention_mask."""
    text = torch.randint(0, config.vocab_size, (2, config.seq_length + 1), generator=g)
    tokens = text[:, :-1].contiguous()
    labels = text[:, 1:].contiguous()
    loss_mask = torch.ones_like(tokens, dtype=torch.float)
    position_ids = torch.arange(config.seq_length).unsqueeze(0).expand_as(tokens)
    return tokens, labels, loss_mask, None, position_ids


def main():
    torch.manual_seed(0)
    config = Gemma2ModelProvider()
    model = GPTModel(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
    model.eval()

    g = torch.Generator().manual_seed(1)
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(config, g)
    with torch.no_grad():
        losses, logits = model(tokens, position_ids, attention_mask, labels=labels)
    loss = (losses * loss_mask).sum() / loss_mask.sum()

    print(f"window_size={config.window_size}  pretraining batch {tuple(tokens.shape)}, attention_mask=None")
    print(f"lm loss: {loss.item():.6f}")
    print("per-position loss, sample 0:", [round(v, 4) for v in losses[0].tolist()])
    print("greedy next tokens, sample 0:", logits[0].argmax(-1).tolist())


if __name__ == "__main__":
    main()
