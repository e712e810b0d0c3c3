# Dia (nari-labs/dia) batched text-to-dialogue generation, ported small.
#
# Citation: nari-labs/dia @876125e461a03b157ec905b0fe8b57a0f8b9e7a0:
#   dia/state.py  (create_attn_mask, EncoderInferenceState.new, KVCache, DecoderInferenceState.new / prepare_step,
#                  DecoderOutput)
#   dia/layers.py (DenseGeneral, MlpBlock, RotaryEmbedding, SelfAttention, CrossAttention, EncoderLayer, Encoder,
#                  DecoderLayer, Decoder.precompute_cross_attn_cache / decode_step / forward, DiaModel)
#   dia/audio.py  (build_delay_indices, apply_audio_delay)
#   dia/model.py  (Dia._encode_text, _pad_text_input, _prepare_audio_prompt, _prepare_generation, _decoder_step,
#                  generate up to the codes handed to the DAC decoder)
#
# Byte-level text is right-padded with 0 to the encoder's max_position_embeddings. Classifier-free guidance doubles
# the batch: row 2i is the unconditional input (all zeros), row 2i+1 the text; both rows use the text's padding
# mask (EncoderInferenceState.new is given the conditional input and repeat_interleaves its mask). The encoder mask
# lets real tokens see real tokens and pads see pads; the decoder's cross-attention mask lets every audio step see
# the real text tokens. Audio prompts of different lengths are delayed per channel, the shortest prompt is
# prefilled with is_causal=True into a static KV cache, and each step then reads the cache through row
# `current_idx` of a (max_tokens, max_tokens) lower-triangular mask. Greedy decoding (temperature 0) on CPU.
#
# Self-check: logits of every cond/uncond row at every fed step equal a per-item reference run with no padding, no
# mask beyond causality and no cache (encoder over the item's real bytes only, full decoder re-run over the fed
# frames), and every freely generated token equals the CFG top-k pick made from the reference logits.
import torch
import torch.nn as nn
import torch.nn.functional as F
from dataclasses import dataclass, field
from typing import Optional
from torch import Tensor
from torch.nn import RMSNorm


# ----------------------------------------------------------------------------- dia/config.py (trimmed)
@dataclass(frozen=True)
class EncoderConfig:
    head_dim: int = 8
    hidden_size: int = 32
    intermediate_size: int = 64
    max_position_embeddings: int = 24
    norm_eps: float = 1e-5
    num_attention_heads: int = 4
    num_hidden_layers: int = 2
    num_key_value_heads: int = 4
    rope_theta: float = 10000.0
    vocab_size: int = 256


@dataclass(frozen=True)
class DecoderConfig:
    cross_head_dim: int = 8
    cross_num_attention_heads: int = 4
    cross_num_key_value_heads: int = 4
    head_dim: int = 8
    hidden_size: int = 48
    intermediate_size: int = 96
    max_position_embeddings: int = 40
    norm_eps: float = 1e-5
    num_attention_heads: int = 4
    num_channels: int = 4
    num_hidden_layers: int = 2
    num_key_value_heads: int = 2
    rope_theta: float = 10000.0
    vocab_size: int = 40


@dataclass(frozen=True)
class DiaConfig:
    encoder_config: EncoderConfig = field(default_factory=EncoderConfig)
    decoder_config: DecoderConfig = field(default_factory=DecoderConfig)
    bos_token_id: int = 34
    eos_token_id: int = 32
    pad_token_id: int = 33
    delay_pattern: list = field(default_factory=lambda: [0, 2, 3, 4])


# ----------------------------------------------------------------------------- dia/state.py
def create_attn_mask(
    q_padding_mask_1d: torch.Tensor,
    k_padding_mask_1d: torch.Tensor,
    device: torch.device,
    is_causal: bool = False,
) -> torch.Tensor:
    """
    Creates the attention mask (self or cross) mimicking JAX segment ID logic.
    """
    p_mask_q = q_padding_mask_1d.unsqueeze(2)  # Shape [B, Tq, 1]
    p_mask_k = k_padding_mask_1d.unsqueeze(1)  # Shape [B, 1, Tk]

    # Condition A: Non-padding query attends to non-padding key
    non_pad_attends_non_pad = p_mask_q & p_mask_k  # Shape [B, Tq, Tk]

    # Condition B: Padding query attends to padding key
    pad_attends_pad = (~p_mask_q) & (~p_mask_k)  # Shape [B, Tq, Tk]

    # Combine: True if padding status is compatible (both non-pad OR both pad)
    mask = non_pad_attends_non_pad | pad_attends_pad  # Shape [B, Tq, Tk]

    if is_causal:
        causal_mask_2d = torch.tril(torch.ones_like(mask[0], dtype=torch.bool, device=device))
        causal_mask = mask & causal_mask_2d
        return causal_mask.unsqueeze(1)  # Shape [B, 1, Tq, Tk]
    else:
        return mask.unsqueeze(1)  # Shape [B, 1, Tq, Tk]


@dataclass
class EncoderInferenceState:
    """Parameters specifically for encoder inference."""

    max_seq_len: int
    device: torch.device
    positions: torch.Tensor
    padding_mask: torch.Tensor
    attn_mask: torch.Tensor

    @classmethod
    def new(cls, config: DiaConfig, cond_src: torch.Tensor) -> "EncoderInferenceState":
        device = cond_src.device

        positions = torch.arange(
            config.encoder_config.max_position_embeddings, dtype=torch.float32, device=device
        ).unsqueeze(0)
        padding_mask = (cond_src.squeeze(1) != 0).to(device).repeat_interleave(2, dim=0)
        attn_mask = create_attn_mask(padding_mask, padding_mask, device, is_causal=False)

        return cls(
            max_seq_len=config.encoder_config.max_position_embeddings,
            device=device,
            positions=positions,
            padding_mask=padding_mask,
            attn_mask=attn_mask,
        )


class KVCache(torch.nn.Module):
    k: torch.Tensor
    v: torch.Tensor

    def __init__(
        self,
        batch_size: int,
        num_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ):
        k = torch.zeros((2 * batch_size, num_heads, max_len, head_dim), dtype=dtype, device=device) if k is None else k
        v = torch.zeros((2 * batch_size, num_heads, max_len, head_dim), dtype=dtype, device=device) if v is None else v
        super().__init__()

        self.register_buffer("k", k)
        self.register_buffer("v", v)

    @classmethod
    def from_kv(cls, k: torch.Tensor, v: torch.Tensor) -> "KVCache":
        return cls(
            batch_size=k.shape[0] // 2,
            num_heads=k.shape[1],
            max_len=k.shape[2],
            head_dim=k.shape[3],
            dtype=k.dtype,
            device=k.device,
            k=k,
            v=v,
        )

    def update(self, k: torch.Tensor, v: torch.Tensor, current_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k_out, v_out = self.k, self.v
        k_out[:, :, current_idx, :] = k
        v_out[:, :, current_idx, :] = v
        return self.k, self.v

    def prefill(self, k: torch.Tensor, v: torch.Tensor):
        prefill_len = k.shape[2]
        self.k[:, :, :prefill_len, :] = k
        self.v[:, :, :prefill_len, :] = v


@dataclass
class DecoderInferenceState:
    """Parameters specifically for decoder inference."""

    device: torch.device
    dtype: torch.dtype
    enc_out: torch.Tensor
    enc_positions: torch.Tensor
    dec_positions: torch.Tensor
    self_attn_cache: list[KVCache]
    cross_attn_cache: list[KVCache]
    casual_attn_mask: torch.Tensor
    cross_attn_mask: torch.Tensor

    @classmethod
    def new(
        cls,
        config: DiaConfig,
        enc_state: EncoderInferenceState,
        enc_out: torch.Tensor,
        dec_cross_attn_cache: list[KVCache],
        compute_dtype: torch.dtype,
        max_generation_length: Optional[int] = None,
    ) -> "DecoderInferenceState":
        device = enc_out.device
        max_audio_len = max_generation_length or config.decoder_config.max_position_embeddings
        batch_size = enc_out.shape[0] // 2

        dec_positions = torch.full((2 * batch_size, 1), fill_value=0, dtype=torch.int32, device=device)
        causal_mask = torch.tril(torch.ones(max_audio_len, max_audio_len, dtype=torch.bool, device=device))
        dec_mask = torch.ones((2 * batch_size, 1), dtype=torch.bool, device=device)
        cross_attn_mask = create_attn_mask(dec_mask, enc_state.padding_mask, device, is_causal=False)

        self_attn_cache = [
            KVCache(
                batch_size,
                config.decoder_config.num_key_value_heads,
                max_audio_len,
                config.decoder_config.head_dim,
                compute_dtype,
                device,
            )
            for _ in range(config.decoder_config.num_hidden_layers)
        ]

        return cls(
            device=device,
            dtype=compute_dtype,
            enc_out=enc_out,
            enc_positions=enc_state.positions,
            dec_positions=dec_positions,
            self_attn_cache=self_attn_cache,
            cross_attn_cache=dec_cross_attn_cache,
            casual_attn_mask=causal_mask,
            cross_attn_mask=cross_attn_mask,
        )

    def prepare_step(self, step_from: int, step_to: int | None = None) -> None:
        if step_to is None:
            step_to = step_from + 1
        self.dec_positions = torch.arange(step_from, step_to, dtype=torch.int32, device=self.device).unsqueeze(0)


@dataclass
class DecoderOutput:
    generated_tokens: torch.Tensor
    prefill_steps: list[int]

    @classmethod
    def new(cls, batch_size: int, config: DiaConfig, device: torch.device) -> "DecoderOutput":
        max_audio_len = config.decoder_config.max_position_embeddings
        return cls(
            generated_tokens=torch.full(
                (batch_size, max_audio_len, config.decoder_config.num_channels),
                fill_value=-1,
                dtype=torch.int,
                device=device,
            ),
            prefill_steps=[],
        )

    def get_tokens_at(self, step_from: int, step_to: int | None = None) -> torch.Tensor:
        if step_to is None:
            step_to = step_from + 1
        return self.generated_tokens[:, step_from:step_to, :]

    def update_one(self, dec_out: torch.Tensor, step: int, apply_mask: bool = False):
        dec_out = dec_out.to(self.generated_tokens.dtype)
        if apply_mask:
            mask = self.generated_tokens[:, step, :] == -1
            self.generated_tokens[:, step, :] = torch.where(mask, dec_out, self.generated_tokens[:, step, :])
        else:
            self.generated_tokens[:, step, :] = dec_out

    def prefill(self, dec_out: torch.Tensor, prefill_steps: list[int]):
        length = dec_out.shape[1]
        self.generated_tokens[:, :length, :] = dec_out
        self.prefill_steps = prefill_steps


# ----------------------------------------------------------------------------- dia/audio.py
def build_delay_indices(B: int, T: int, C: int, delay_pattern: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """out[t, c] = in[t - delay[c], c]. Negative t_idx => BOS; t_idx >= T => PAD."""
    delay_arr = torch.tensor(delay_pattern, dtype=torch.int32)

    t_idx_BxT = torch.broadcast_to(torch.arange(T, dtype=torch.int32)[None, :], [B, T])
    t_idx_BxTx1 = t_idx_BxT[..., None]
    t_idx_BxTxC = t_idx_BxTx1 - delay_arr.view(1, 1, C)

    b_idx_BxTxC = torch.broadcast_to(torch.arange(B, dtype=torch.int32).view(B, 1, 1), [B, T, C])
    c_idx_BxTxC = torch.broadcast_to(torch.arange(C, dtype=torch.int32).view(1, 1, C), [B, T, C])

    t_clamped_BxTxC = torch.clamp(t_idx_BxTxC, 0, T - 1)

    indices_BTCx3 = torch.stack(
        [b_idx_BxTxC.reshape(-1), t_clamped_BxTxC.reshape(-1), c_idx_BxTxC.reshape(-1)],
        dim=1,
    ).long()

    return t_idx_BxTxC, indices_BTCx3


def apply_audio_delay(
    audio_BxTxC: torch.Tensor,
    pad_value: int,
    bos_value: int,
    precomp: tuple[torch.Tensor, torch.Tensor],
) -> torch.Tensor:
    device = audio_BxTxC.device
    t_idx_BxTxC, indices_BTCx3 = precomp
    t_idx_BxTxC = t_idx_BxTxC.to(device)
    indices_BTCx3 = indices_BTCx3.to(device)

    gathered_flat = audio_BxTxC[indices_BTCx3[:, 0], indices_BTCx3[:, 1], indices_BTCx3[:, 2]]
    gathered_BxTxC = gathered_flat.view(audio_BxTxC.shape)

    mask_bos = t_idx_BxTxC < 0
    mask_pad = t_idx_BxTxC >= audio_BxTxC.shape[1]

    bos_tensor = torch.tensor(bos_value, dtype=audio_BxTxC.dtype, device=device)
    pad_tensor = torch.tensor(pad_value, dtype=audio_BxTxC.dtype, device=device)

    return torch.where(mask_bos, bos_tensor, torch.where(mask_pad, pad_tensor, gathered_BxTxC))


# ----------------------------------------------------------------------------- dia/layers.py
def _normalize_axes(axes: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    return tuple(ax if ax >= 0 else ndim + ax for ax in axes)


class DenseGeneral(nn.Module):
    """PyTorch equivalent of flax.linen.DenseGeneral with shapes defined at init."""

    def __init__(self, in_shapes, out_features, axis=(-1,), weight_dtype=None, device=None):
        super().__init__()
        self.in_shapes = in_shapes
        self.out_features = out_features
        self.axis = axis
        self.kernel_shape = self.in_shapes + self.out_features

        factory_kwargs = {"device": device, "dtype": weight_dtype}
        self.weight = nn.Parameter(torch.empty(self.kernel_shape, **factory_kwargs))

    def forward(self, inputs: Tensor) -> Tensor:
        norm_axis = _normalize_axes(self.axis, inputs.ndim)
        kernel_contract_axes = tuple(range(len(norm_axis)))

        output = torch.tensordot(
            inputs.to(self.weight.dtype),
            self.weight,
            dims=(norm_axis, kernel_contract_axes),
        ).to(inputs.dtype)
        return output


class MlpBlock(nn.Module):
    def __init__(self, embed_dim: int, intermediate_dim: int, compute_dtype: torch.dtype):
        super().__init__()
        self.dtype = compute_dtype
        self.wi_fused = DenseGeneral((embed_dim,), (2, intermediate_dim), axis=(-1,), weight_dtype=compute_dtype)
        self.wo = DenseGeneral((intermediate_dim,), (embed_dim,), axis=(-1,), weight_dtype=compute_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused_x = self.wi_fused(x)
        gate = fused_x[..., 0, :]
        up = fused_x[..., 1, :]
        hidden = torch.mul(F.silu(gate), up).to(self.dtype)
        return self.wo(hidden)


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims: int, min_timescale=1.0, max_timescale=10000.0, dtype=torch.float32):
        super().__init__()
        if embedding_dims % 2 != 0:
            raise ValueError("Embedding dim must be even for RoPE.")
        self.embedding_dims = embedding_dims
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale
        self.compute_dtype = dtype

        half_embedding_dim = embedding_dims // 2
        fraction = (2.0 * torch.arange(0, half_embedding_dim)) / embedding_dims
        timescale = (self.min_timescale * (self.max_timescale / self.min_timescale) ** fraction).to(torch.float32)
        self.register_buffer("timescale", timescale, persistent=False)

    def apply_rope(self, inputs: torch.Tensor, sin: torch.Tensor, cos: torch.Tensor):
        first_half, second_half = torch.chunk(inputs.to(torch.float32), 2, dim=-1)
        first_part = first_half * cos - second_half * sin
        second_part = second_half * cos + first_half * sin
        return torch.cat((first_part.to(self.compute_dtype), second_part.to(self.compute_dtype)), dim=-1)


class CrossAttention(nn.Module):
    """Cross-Attention using DenseGeneral."""

    def __init__(self, config, q_embed_dim, kv_embed_dim, num_query_heads, num_kv_heads, head_dim, compute_dtype,
                 out_embed_dim=None):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_dim = out_embed_dim if out_embed_dim is not None else q_embed_dim
        if num_query_heads % num_kv_heads != 0:
            raise ValueError("num_query_heads must be divisible by num_kv_heads")
        self.num_gqa_groups = num_query_heads // num_kv_heads

        self.q_proj = DenseGeneral((q_embed_dim,), (num_query_heads, head_dim), weight_dtype=compute_dtype)
        self.k_proj = DenseGeneral((kv_embed_dim,), (num_kv_heads, head_dim), weight_dtype=compute_dtype)
        self.v_proj = DenseGeneral((kv_embed_dim,), (num_kv_heads, head_dim), weight_dtype=compute_dtype)
        self.o_proj = DenseGeneral((num_query_heads, head_dim), (self.output_dim,), axis=(-2, -1),
                                   weight_dtype=compute_dtype)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_timescale=config.rope_theta, dtype=compute_dtype)

    def forward(self, Xq, q_positions, kv_positions=None, attn_mask=None, cache: KVCache | None = None,
                is_causal: bool = False):
        original_dtype = Xq.dtype

        Xq_BxTxNxH = self.q_proj(Xq)
        Xq_BxNxTxH = Xq_BxTxNxH.transpose(1, 2)

        attn_k = cache.k if cache is not None else None
        attn_v = cache.v if cache is not None else None

        attn_output = F.scaled_dot_product_attention(
            Xq_BxNxTxH,
            attn_k,
            attn_v,
            attn_mask=attn_mask if not is_causal else None,
            scale=1.0,
            enable_gqa=self.num_gqa_groups > 1,
            is_causal=is_causal,
        )

        attn_output = attn_output.transpose(1, 2).contiguous()  # (B, T, N, H)
        output = self.o_proj(attn_output)
        return output.to(original_dtype)


class SelfAttention(nn.Module):
    """Attention using DenseGeneral."""

    def __init__(self, config, q_embed_dim, kv_embed_dim, num_query_heads, num_kv_heads, head_dim, compute_dtype,
                 out_embed_dim=None):
        super().__init__()
        self.num_query_heads = num_query_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.output_dim = out_embed_dim if out_embed_dim is not None else q_embed_dim
        if num_query_heads % num_kv_heads != 0:
            raise ValueError("num_query_heads must be divisible by num_kv_heads")
        self.num_gqa_groups = num_query_heads // num_kv_heads

        self.q_proj = DenseGeneral((q_embed_dim,), (num_query_heads, head_dim), weight_dtype=compute_dtype)
        self.k_proj = DenseGeneral((kv_embed_dim,), (num_kv_heads, head_dim), weight_dtype=compute_dtype)
        self.v_proj = DenseGeneral((kv_embed_dim,), (num_kv_heads, head_dim), weight_dtype=compute_dtype)
        self.o_proj = DenseGeneral((num_query_heads, head_dim), (self.output_dim,), axis=(-2, -1),
                                   weight_dtype=compute_dtype)
        self.rotary_emb = RotaryEmbedding(self.head_dim, max_timescale=config.rope_theta, dtype=compute_dtype)

    def forward(self, X, q_positions, kv_positions=None, attn_mask=None, cache: KVCache | None = None,
                prefill: bool = False, is_causal: bool = False, current_idx: torch.Tensor | None = None):
        if kv_positions is None:
            kv_positions = q_positions
        original_dtype = X.dtype

        Xq_BxTxNxH = self.q_proj(X)
        Xk_BxSxKxH = self.k_proj(X)
        Xv_BxSxKxH = self.v_proj(X)

        position = q_positions.unsqueeze(-1).unsqueeze(-1)
        sinusoid_inp = position / self.rotary_emb.timescale
        sin = torch.sin(sinusoid_inp)
        cos = torch.cos(sinusoid_inp)

        Xq_BxTxNxH = self.rotary_emb.apply_rope(Xq_BxTxNxH, sin, cos)
        Xk_BxSxKxH = self.rotary_emb.apply_rope(Xk_BxSxKxH, sin, cos)

        Xq_BxNxTxH = Xq_BxTxNxH.transpose(1, 2)

        Xk_BxKxSxH = Xk_BxSxKxH.transpose(1, 2)  # (B, K, S, H)
        Xv_BxKxSxH = Xv_BxSxKxH.transpose(1, 2)  # (B, K, S, H)

        if cache is None:
            attn_k = Xk_BxKxSxH
            attn_v = Xv_BxKxSxH
        elif prefill:
            attn_k, attn_v = Xk_BxKxSxH, Xv_BxKxSxH
            cache.prefill(attn_k, attn_v)
        else:
            attn_k, attn_v = cache.update(Xk_BxKxSxH, Xv_BxKxSxH, current_idx)

        attn_output = F.scaled_dot_product_attention(
            Xq_BxNxTxH,
            attn_k,
            attn_v,
            attn_mask=attn_mask if not is_causal else None,
            scale=1.0,
            enable_gqa=self.num_gqa_groups > 1,
            is_causal=is_causal,
        )

        attn_output = attn_output.transpose(1, 2).contiguous()  # (B, T, N, H)
        output = self.o_proj(attn_output)
        return output.to(original_dtype)


class EncoderLayer(nn.Module):
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype):
        super().__init__()
        enc_config = config.encoder_config
        embed_dim = enc_config.hidden_size
        self.compute_dtype = compute_dtype
        self.pre_sa_norm = RMSNorm(embed_dim, eps=enc_config.norm_eps, dtype=torch.float32)
        self.self_attention = SelfAttention(
            enc_config,
            q_embed_dim=embed_dim,
            kv_embed_dim=embed_dim,
            num_query_heads=enc_config.num_attention_heads,
            num_kv_heads=enc_config.num_key_value_heads,
            head_dim=enc_config.head_dim,
            compute_dtype=compute_dtype,
            out_embed_dim=embed_dim,
        )
        self.post_sa_norm = RMSNorm(embed_dim, eps=enc_config.norm_eps, dtype=torch.float32)
        self.mlp = MlpBlock(embed_dim, enc_config.intermediate_size, compute_dtype)

    def forward(self, x: torch.Tensor, state: EncoderInferenceState) -> torch.Tensor:
        residual = x
        x_norm = self.pre_sa_norm(x).to(self.compute_dtype)
        sa_out = self.self_attention(
            X=x_norm,
            q_positions=state.positions,
            kv_positions=state.positions,
            attn_mask=state.attn_mask,
        )
        x = residual + sa_out

        residual = x
        x_norm = self.post_sa_norm(x).to(self.compute_dtype)
        mlp_out = self.mlp(x_norm)
        return residual + mlp_out


class Encoder(nn.Module):
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype):
        super().__init__()
        enc_config = config.encoder_config
        self.compute_dtype = compute_dtype
        self.embedding = nn.Embedding(enc_config.vocab_size, enc_config.hidden_size, dtype=compute_dtype)
        self.layers = nn.ModuleList([EncoderLayer(config, compute_dtype) for _ in range(enc_config.num_hidden_layers)])
        self.norm = RMSNorm(enc_config.hidden_size, eps=enc_config.norm_eps, dtype=torch.float32)

    def forward(self, x_ids: torch.Tensor, state: EncoderInferenceState) -> torch.Tensor:
        x = self.embedding(x_ids)
        for layer in self.layers:
            x = layer(x, state)
        return self.norm(x).to(self.compute_dtype)


class DecoderLayer(nn.Module):
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype):
        super().__init__()
        dec_config = config.decoder_config
        enc_config = config.encoder_config
        dec_embed_dim = dec_config.hidden_size
        enc_embed_dim = enc_config.hidden_size
        self.compute_dtype = compute_dtype

        self.pre_sa_norm = RMSNorm(dec_embed_dim, eps=dec_config.norm_eps, dtype=torch.float32)
        self.pre_ca_norm = RMSNorm(dec_embed_dim, eps=dec_config.norm_eps, dtype=torch.float32)
        self.pre_mlp_norm = RMSNorm(dec_embed_dim, eps=dec_config.norm_eps, dtype=torch.float32)

        # Self-Attention (GQA) with Causal Masking
        self.self_attention = SelfAttention(
            dec_config,
            q_embed_dim=dec_embed_dim,
            kv_embed_dim=dec_embed_dim,
            num_query_heads=dec_config.num_attention_heads,
            num_kv_heads=dec_config.num_key_value_heads,
            head_dim=dec_config.head_dim,
            compute_dtype=compute_dtype,
            out_embed_dim=dec_embed_dim,
        )
        # Cross-Attention (MHA)
        self.cross_attention = CrossAttention(
            dec_config,
            q_embed_dim=dec_embed_dim,
            kv_embed_dim=enc_embed_dim,
            num_query_heads=dec_config.cross_num_attention_heads,
            num_kv_heads=dec_config.cross_num_key_value_heads,
            head_dim=dec_config.cross_head_dim,
            compute_dtype=compute_dtype,
            out_embed_dim=dec_embed_dim,
        )
        self.mlp = MlpBlock(dec_embed_dim, dec_config.intermediate_size, compute_dtype)

    def forward(self, x, state: DecoderInferenceState, self_attn_cache=None, cross_attn_cache=None,
                prefill: bool = False, current_idx=0):
        residual = x
        x_norm = self.pre_sa_norm(x).to(self.compute_dtype)

        self_attn_mask = state.casual_attn_mask[None, None, current_idx]

        sa_out = self.self_attention(
            X=x_norm,  # (2, 1, D)
            q_positions=state.dec_positions,  # (2, 1)
            kv_positions=state.dec_positions,  # (2, 1)
            attn_mask=self_attn_mask,
            cache=self_attn_cache,
            prefill=prefill,
            is_causal=prefill,
            current_idx=current_idx,
        )
        x = residual + sa_out

        residual = x
        x_norm = self.pre_ca_norm(x).to(self.compute_dtype)
        ca_out = self.cross_attention(
            Xq=x_norm,
            q_positions=state.dec_positions,
            kv_positions=state.enc_positions,
            attn_mask=state.cross_attn_mask,
            cache=cross_attn_cache,
        )
        x = residual + ca_out

        residual = x
        x_norm = self.pre_mlp_norm(x).to(self.compute_dtype)
        mlp_out = self.mlp(x_norm)
        return residual + mlp_out


class Decoder(nn.Module):
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype):
        super().__init__()
        dec_config = config.decoder_config
        self.num_channels = dec_config.num_channels
        self.num_layers = dec_config.num_hidden_layers

        self.embeddings = nn.ModuleList(
            [nn.Embedding(dec_config.vocab_size, dec_config.hidden_size, dtype=compute_dtype)
             for _ in range(self.num_channels)]
        )
        self.layers = nn.ModuleList([DecoderLayer(config, compute_dtype) for _ in range(self.num_layers)])
        self.norm = RMSNorm(dec_config.hidden_size, eps=dec_config.norm_eps, dtype=torch.float32)
        self.logits_dense = DenseGeneral(
            (dec_config.hidden_size,), (self.num_channels, dec_config.vocab_size), axis=(-1,),
            weight_dtype=compute_dtype,
        )

    def precompute_cross_attn_cache(self, enc_out: torch.Tensor) -> list[KVCache]:
        per_layer_kv_cache: list[KVCache] = []
        for layer in self.layers:
            cross_attn_module = layer.cross_attention
            k_proj = cross_attn_module.k_proj(enc_out)
            v_proj = cross_attn_module.v_proj(enc_out)
            k = k_proj.transpose(1, 2)
            v = v_proj.transpose(1, 2)
            per_layer_kv_cache.append(KVCache.from_kv(k, v))
        return per_layer_kv_cache

    def decode_step(self, tgt_ids_Bx1xC: torch.Tensor, state: DecoderInferenceState, current_idx) -> torch.Tensor:
        x = None
        for i in range(self.num_channels):
            channel_tokens = tgt_ids_Bx1xC[..., i]
            channel_embed = self.embeddings[i](channel_tokens)
            x = channel_embed if x is None else x + channel_embed

        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                state,
                self_attn_cache=state.self_attn_cache[i],
                cross_attn_cache=state.cross_attn_cache[i],
                current_idx=current_idx,
            )

        x = self.norm(x)
        logits_Bx1xCxV = self.logits_dense(x)
        return logits_Bx1xCxV.to(torch.float32)

    def forward(self, tgt_ids_BxTxC: torch.Tensor, state: DecoderInferenceState) -> torch.Tensor:
        _, _, num_channels_in = tgt_ids_BxTxC.shape
        assert num_channels_in == self.num_channels, "Input channels mismatch"

        x = None
        for i in range(self.num_channels):
            channel_tokens = tgt_ids_BxTxC[..., i]
            channel_embed = self.embeddings[i](channel_tokens)
            x = channel_embed if x is None else x + channel_embed

        for i, layer in enumerate(self.layers):
            x = layer(
                x,
                state,
                self_attn_cache=state.self_attn_cache[i],
                cross_attn_cache=state.cross_attn_cache[i],
                prefill=True,
            )

        x = self.norm(x)
        logits_BxTxCxV = self.logits_dense(x)
        return logits_BxTxCxV.to(torch.float32)


class DiaModel(nn.Module):
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.encoder = Encoder(config, compute_dtype)
        self.decoder = Decoder(config, compute_dtype)


# ----------------------------------------------------------------------------- dia/model.py (trimmed)
def _sample_next_token(logits_BCxV: torch.Tensor, temperature: float, top_p: float, top_k: int | None,
                       audio_eos_value: int) -> torch.Tensor:
    if temperature == 0.0:
        return torch.argmax(logits_BCxV, dim=-1)
    raise NotImplementedError("this port decodes greedily")


class Dia:
    def __init__(self, config: DiaConfig, compute_dtype: torch.dtype = torch.float32,
                 device: torch.device = torch.device("cpu")):
        self.config = config
        self.device = device
        self.compute_dtype = compute_dtype
        self.model = DiaModel(config, compute_dtype).to(device)

    def _encode_text(self, text: str) -> torch.Tensor:
        max_len = self.config.encoder_config.max_position_embeddings
        byte_text = text.encode("utf-8")
        replaced_bytes = byte_text.replace(b"[S1]", b"\x01").replace(b"[S2]", b"\x02")
        text_tokens = list(replaced_bytes)
        return torch.tensor(text_tokens[:max_len], dtype=torch.long, device=self.device)

    def _pad_text_input(self, text_tokens: list[torch.Tensor]) -> torch.Tensor:
        """Pads the text input to the maximum length."""
        text_pad_value = 0
        max_len = self.config.encoder_config.max_position_embeddings
        batch_size = len(text_tokens)

        src_tokens = torch.full((batch_size, 1, max_len), fill_value=text_pad_value, dtype=torch.long,
                                device=self.device)
        for i in range(batch_size):
            current_len = len(text_tokens[i])
            src_tokens[i, 0, :current_len] = text_tokens[i]
        return src_tokens

    def _prepare_audio_prompt(self, audio_prompts: list[torch.Tensor | None]) -> tuple[torch.Tensor, list[int]]:
        num_channels = self.config.decoder_config.num_channels
        audio_bos_value = self.config.bos_token_id
        delay_pattern = self.config.delay_pattern
        max_delay_pattern = max(delay_pattern)
        batch_size = len(audio_prompts)

        max_len = max(p.shape[0] if p is not None else 0 for p in audio_prompts) + max_delay_pattern
        prefill_steps = []

        prefill = torch.full((batch_size, max_len, num_channels), fill_value=-1, dtype=torch.int, device=self.device)
        prefill[:, 0, :] = audio_bos_value

        for i in range(batch_size):
            prompt = audio_prompts[i]
            if prompt is not None:
                prompt = prompt.to(device=self.device, dtype=torch.int)
                prefill[i, 1 : prompt.shape[0] + 1, :] = prompt
                prefill_steps.append(prompt.shape[0] + 1)
            else:
                prefill_steps.append(1)

        delay_precomp = build_delay_indices(B=batch_size, T=max_len, C=num_channels, delay_pattern=delay_pattern)
        delayed_batch = apply_audio_delay(audio_BxTxC=prefill, pad_value=-1, bos_value=audio_bos_value,
                                          precomp=delay_precomp)
        return delayed_batch, prefill_steps

    def _prepare_generation(self, text: torch.Tensor, audio_prompts, max_tokens: int | None = None):
        batch_size = text.shape[0]

        enc_input_uncond = torch.zeros_like(text)
        enc_input_cond = text
        stacked_inputs = torch.stack([enc_input_uncond, enc_input_cond], dim=1)
        enc_input = stacked_inputs.view(2 * batch_size, -1)

        enc_state = EncoderInferenceState.new(self.config, enc_input_cond)
        encoder_out = self.model.encoder(enc_input, enc_state)

        dec_cross_attn_cache = self.model.decoder.precompute_cross_attn_cache(encoder_out)
        dec_state = DecoderInferenceState.new(
            self.config, enc_state, encoder_out, dec_cross_attn_cache, self.compute_dtype,
            max_generation_length=max_tokens,
        )
        prefill, prefill_steps = self._prepare_audio_prompt(audio_prompts)

        dec_output = DecoderOutput.new(batch_size, self.config, self.device)
        dec_output.prefill(prefill, prefill_steps)

        dec_step = min(prefill_steps) - 1
        if dec_step > 0:
            dec_state.prepare_step(0, dec_step)
            tokens_BxTxC = dec_output.get_tokens_at(0, dec_step).repeat_interleave(2, dim=0)
            self.model.decoder.forward(tokens_BxTxC, dec_state)

        return dec_state, dec_output

    def _decoder_step(self, tokens_Bx1xC, dec_state, cfg_scale, temperature, top_p, top_k, current_idx):
        B = tokens_Bx1xC.shape[0] // 2

        audio_eos_value = self.config.eos_token_id
        logits_Bx1xCxV = self.model.decoder.decode_step(tokens_Bx1xC, dec_state, current_idx)

        logits_last_2BxCxV = logits_Bx1xCxV[:, -1]
        logits_last_Bx2xCxV = logits_last_2BxCxV.view(B, 2, *logits_last_2BxCxV.shape[1:])

        uncond_logits_BxCxV = logits_last_Bx2xCxV[:, 0, :, :]  # Shape [B, C, V]
        cond_logits_BxCxV = logits_last_Bx2xCxV[:, 1, :, :]  # Shape [B, C, V]
        logits_BxCxV = cond_logits_BxCxV + cfg_scale * (cond_logits_BxCxV - uncond_logits_BxCxV)

        _, top_k_indices_BxCxk = torch.topk(logits_BxCxV, k=top_k, dim=-1)
        mask_BxCxV = torch.ones_like(logits_BxCxV, dtype=torch.bool)
        mask_BxCxV = mask_BxCxV.scatter(dim=-1, index=top_k_indices_BxCxk, value=False)
        logits_BxCxV = cond_logits_BxCxV.masked_fill(mask_BxCxV, -torch.inf)

        logits_BxCxV[:, :, audio_eos_value + 1 :] = torch.full_like(
            logits_BxCxV[:, :, audio_eos_value + 1 :], fill_value=-torch.inf
        )
        logits_BxCxV[:, 1:, audio_eos_value:] = torch.full_like(
            logits_BxCxV[:, 1:, audio_eos_value:], fill_value=-torch.inf
        )

        flat_logits_BCxV = logits_BxCxV.view(B * self.config.decoder_config.num_channels, -1)
        pred_BC = _sample_next_token(flat_logits_BCxV.float(), temperature=temperature, top_p=top_p, top_k=top_k,
                                     audio_eos_value=audio_eos_value)
        return pred_BC.view(B, self.config.decoder_config.num_channels)

    @torch.inference_mode()
    def generate(self, text: list[str], max_tokens: int, cfg_scale: float = 3.0, temperature: float = 0.0,
                 top_p: float = 0.95, cfg_filter_top_k: int = 8, audio_prompt: list | None = None):
        batch_size = len(text)
        audio_eos_value = self.config.eos_token_id
        audio_pad_value = self.config.pad_token_id
        delay_pattern = self.config.delay_pattern
        max_delay_pattern = max(delay_pattern)
        delay_pattern_Cx = torch.tensor(delay_pattern, device=self.device, dtype=torch.long)
        self.model.eval()

        if audio_prompt is None:
            audio_prompt = [None] * batch_size
        assert len(audio_prompt) == batch_size, "Number of audio prompts must match batch size"

        text = self._pad_text_input([self._encode_text(t) for t in text])

        dec_state, dec_output = self._prepare_generation(text, audio_prompt, max_tokens=max_tokens)
        dec_step = min(dec_output.prefill_steps) - 1
        current_idx = torch.tensor([dec_step], device=self.device)

        eos_detected_Bx = torch.zeros((batch_size,), dtype=torch.bool, device=self.device)
        eos_countdown_Bx = torch.full((batch_size,), -1, dtype=torch.long, device=self.device)
        finished_step_Bx = torch.full((batch_size,), -1, dtype=torch.long, device=self.device)

        bos_over = False

        while dec_step < max_tokens:
            if (eos_countdown_Bx == 0).all():
                break

            current_step_idx = dec_step + 1
            dec_state.prepare_step(dec_step)
            tokens_Bx1xC = dec_output.get_tokens_at(dec_step).repeat_interleave(2, dim=0)  # Repeat for CFG

            pred_BxC = self._decoder_step(tokens_Bx1xC, dec_state, cfg_scale, temperature, top_p, cfg_filter_top_k,
                                          current_idx)

            current_idx += 1

            active_mask_Bx = eos_countdown_Bx != 0
            eos_trigger_Bx = torch.zeros_like(active_mask_Bx)
            if active_mask_Bx.any():
                is_eos_token = (~eos_detected_Bx[active_mask_Bx]) & (pred_BxC[active_mask_Bx, 0] == audio_eos_value)
                is_max_len = current_step_idx >= max_tokens - max_delay_pattern
                eos_trigger_Bx[active_mask_Bx] = is_eos_token | is_max_len
            eos_detected_Bx |= eos_trigger_Bx
            start_countdown_mask_Bx = eos_trigger_Bx & (eos_countdown_Bx < 0)
            if start_countdown_mask_Bx.any():
                eos_countdown_Bx[start_countdown_mask_Bx] = max_delay_pattern
                finished_step_Bx[start_countdown_mask_Bx] = current_step_idx

            padding_mask_Bx = eos_countdown_Bx > 0
            if padding_mask_Bx.any():
                pred_active_BxC = pred_BxC[padding_mask_Bx].clone()
                countdown_active_Bx = eos_countdown_Bx[padding_mask_Bx]
                step_after_eos_Bx = max_delay_pattern - countdown_active_Bx
                step_after_eos_Bx_ = step_after_eos_Bx.unsqueeze(1)
                delay_pattern_Cx_ = delay_pattern_Cx.unsqueeze(0)
                eos_mask_NxC = step_after_eos_Bx_ == delay_pattern_Cx_
                pad_mask_NxC = step_after_eos_Bx_ > delay_pattern_Cx_
                pred_active_BxC[eos_mask_NxC] = audio_eos_value
                pred_active_BxC[pad_mask_NxC] = audio_pad_value
                pred_BxC[padding_mask_Bx] = pred_active_BxC
                eos_countdown_Bx[padding_mask_Bx] -= 1

            if not bos_over:
                bos_over = all(dec_step - prefill_step > max_delay_pattern for prefill_step in dec_output.prefill_steps)

            dec_output.update_one(pred_BxC, current_step_idx, not bos_over)
            dec_step += 1

        # --- Finalize and Extract Output ---
        final_step = dec_step + 1
        finished_step_Bx[finished_step_Bx == -1] = final_step - max_delay_pattern

        prefill_steps_tensor = torch.tensor(dec_output.prefill_steps, device=self.device)
        lengths_Bx = torch.clamp(finished_step_Bx - prefill_steps_tensor, min=0)

        max_len = lengths_Bx.max().item() + max_delay_pattern
        generated_codes = torch.full((batch_size, max_len, self.config.decoder_config.num_channels),
                                     fill_value=audio_pad_value, dtype=torch.long, device=self.device)
        for i in range(batch_size):
            start_step = dec_output.prefill_steps[i]
            actual_len = lengths_Bx[i].item() + max_delay_pattern
            if actual_len > 0:
                generated_codes[i, :actual_len, :] = dec_output.generated_tokens[i, start_step : start_step + actual_len, :]

        # what the DAC decoder would receive, plus what the check below needs
        return generated_codes, lengths_Bx, dec_output, dec_step, finished_step_Bx


# ----------------------------------------------------------------------------- reference (test code)
def _ref_attend(q, k, v, allowed):
    # q (N, T, H), k/v (N, S, H), allowed (T, S) bool; Dia uses scale=1.0
    scores = q @ k.transpose(-1, -2)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _ref_rope(x, pos, timescale):
    # x (T, N, H), pos (T,)
    ang = pos[:, None, None] / timescale
    a, b = torch.chunk(x, 2, dim=-1)
    return torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], dim=-1)


def _ref_self_attn(attn, x, causal):
    T = x.shape[0]
    q = torch.einsum("td,dnh->tnh", x, attn.q_proj.weight.double())
    k = torch.einsum("td,dnh->tnh", x, attn.k_proj.weight.double())
    v = torch.einsum("td,dnh->tnh", x, attn.v_proj.weight.double())
    pos = torch.arange(T, dtype=torch.float64)
    ts = attn.rotary_emb.timescale.double()
    q, k = _ref_rope(q, pos, ts), _ref_rope(k, pos, ts)
    rep = attn.num_gqa_groups
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    allowed = torch.ones(T, T, dtype=torch.bool)
    if causal:
        allowed = torch.tril(allowed)
    out = _ref_attend(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), allowed)  # (N, T, H)
    return torch.einsum("nth,nhd->td", out, attn.o_proj.weight.double())


def _ref_cross_attn(attn, x, enc):
    q = torch.einsum("td,dnh->nth", x, attn.q_proj.weight.double())
    k = torch.einsum("sd,dnh->nsh", enc, attn.k_proj.weight.double())
    v = torch.einsum("sd,dnh->nsh", enc, attn.v_proj.weight.double())
    allowed = torch.ones(x.shape[0], enc.shape[0], dtype=torch.bool)
    out = _ref_attend(q, k, v, allowed)
    return torch.einsum("nth,nhd->td", out, attn.o_proj.weight.double())


def _ref_rms(norm, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.double()


def _ref_mlp(mlp, x):
    fused = torch.einsum("td,dki->tki", x, mlp.wi_fused.weight.double())
    return (F.silu(fused[:, 0]) * fused[:, 1]) @ mlp.wo.weight.double()


def reference_logits(model: DiaModel, text_ids: torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
    """One item alone, unpadded text, no cache: logits (T, C, V) in float64."""
    enc = model.encoder
    x = enc.embedding.weight.double()[text_ids]
    for layer in enc.layers:
        x = x + _ref_self_attn(layer.self_attention, _ref_rms(layer.pre_sa_norm, x), causal=False)
        x = x + _ref_mlp(layer.mlp, _ref_rms(layer.post_sa_norm, x))
    enc_out = _ref_rms(enc.norm, x)

    dec = model.decoder
    y = sum(dec.embeddings[c].weight.double()[frames[:, c].long()] for c in range(dec.num_channels))
    for layer in dec.layers:
        y = y + _ref_self_attn(layer.self_attention, _ref_rms(layer.pre_sa_norm, y), causal=True)
        y = y + _ref_cross_attn(layer.cross_attention, _ref_rms(layer.pre_ca_norm, y), enc_out)
        y = y + _ref_mlp(layer.mlp, _ref_rms(layer.pre_mlp_norm, y))
    y = _ref_rms(dec.norm, y)
    return torch.einsum("td,dcv->tcv", y, dec.logits_dense.weight.double())


def reference_pick(cond, uncond, cfg_scale, top_k, eos):
    guided = cond + cfg_scale * (cond - uncond)
    keep = torch.zeros_like(guided, dtype=torch.bool)
    keep.scatter_(-1, guided.topk(top_k, dim=-1).indices, True)
    filtered = cond.masked_fill(~keep, float("-inf"))
    filtered[:, eos + 1 :] = float("-inf")
    filtered[1:, eos:] = float("-inf")
    return filtered.argmax(-1)


def main():
    torch.manual_seed(1)
    config = DiaConfig()
    dia = Dia(config)
    with torch.no_grad():
        for name, p in dia.model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))

    captured = []
    dia.model.decoder.logits_dense.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))

    texts = ["[S1] Hi there.", "[S2] Oh, a longer line!", "[S1] Yes."]
    C = config.decoder_config.num_channels
    V = config.decoder_config.vocab_size
    audio_prompt = [
        torch.randint(0, config.eos_token_id, (4, C)),
        torch.randint(0, config.eos_token_id, (2, C)),
        torch.randint(0, config.eos_token_id, (3, C)),
    ]
    max_tokens, cfg_scale, top_k = 26, 3.0, 8

    codes, lengths, dec_output, last_dec_step, finished = dia.generate(
        texts, max_tokens=max_tokens, cfg_scale=cfg_scale, cfg_filter_top_k=top_k, audio_prompt=audio_prompt
    )

    logits = torch.cat(captured, dim=1)  # (2B, fed steps, C, V): prefill then one per decode step
    n_fed = last_dec_step
    assert logits.shape == (2 * len(texts), n_fed, C, V), logits.shape
    delayed_prompt, prefill_steps = dia._prepare_audio_prompt(audio_prompt)
    first_free_step = min(prefill_steps)

    worst, picks = 0.0, 0
    for b, t in enumerate(texts):
        ids = dia._encode_text(t)
        frames = dec_output.generated_tokens[b, :n_fed]
        assert (frames >= 0).all()
        ref_cond = reference_logits(dia.model, ids, frames)
        ref_uncond = reference_logits(dia.model, torch.zeros_like(ids), frames)
        worst = max(worst, (logits[2 * b + 1].double() - ref_cond).abs().max().item())
        worst = max(worst, (logits[2 * b].double() - ref_uncond).abs().max().item())

        for step in range(first_free_step, int(finished[b])):
            pick = reference_pick(ref_cond[step - 1], ref_uncond[step - 1], cfg_scale, top_k, config.eos_token_id)
            for c in range(C):
                forced = step < delayed_prompt.shape[1] and delayed_prompt[b, step, c] != -1
                if not forced:
                    assert dec_output.generated_tokens[b, step, c] == pick[c], (b, step, c)
                    picks += 1

    assert worst < 1e-4, worst
    print(f"prefill steps {prefill_steps}, fed {n_fed} steps, lengths {lengths.tolist()}, codes {tuple(codes.shape)}")
    print(f"max |logit - per-item unpadded uncached reference| = {worst:.2e}; {picks} greedy CFG picks match")


if __name__ == "__main__":
    main()
