"""Dia TTS decoder: cross-attention over the padded text encoder output ran without a mask.

Citation: nari-labs/dia#230 "fix cross attention mask", merged as commit 2811af1
(dia/layers.py, dia/state.py).

The bug: Dia pads every text prompt to ``config.data.text_length`` with
``config.data.text_pad_value`` and keeps an ``EncoderInferenceState.padding_mask``.
The encoder self-attention used it (``enc_state.attn_mask``), but ``DecoderLayer.forward``
called ``self.cross_attention(...)`` without ``attn_mask``, so every decoder step's query
attended to all ``text_length`` encoder positions, padding included (the precomputed
cross-attention cache only zeroes the padded keys, which still get softmax weight).

The fix: ``DecoderInferenceState.new`` builds ``cross_attn_mask =
create_attn_mask(dec_mask, enc_state.padding_mask, device, is_causal=False)`` and the
decoder layer passes ``attn_mask=state.cross_attn_mask`` to the cross-attention.

This program keeps Dia's inference structure (CFG batch of 2*B rows, encoder state,
per-layer KVCache for decoder self-attention, precomputed cross-attention KVCache,
prefill step then single-token decode steps with ``current_idx``) at toy sizes with random
weights; DenseGeneral is written as nn.Linear and pydantic configs as dataclasses.
Two prompts of 5 and 9 tokens are padded to text_length=16.
"""

import sys
from dataclasses import dataclass, field

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class DataConfig:
    text_length: int = 16
    audio_length: int = 8
    channels: int = 2
    text_pad_value: int = 0
    audio_bos_value: int = 30


@dataclass
class EncoderConfig:
    n_embd: int = 32
    n_head: int = 2
    head_dim: int = 16


@dataclass
class DecoderConfig:
    n_embd: int = 32
    n_layer: int = 2
    gqa_query_heads: int = 2
    kv_heads: int = 1
    gqa_head_dim: int = 16
    cross_query_heads: int = 2
    cross_head_dim: int = 16


@dataclass
class ModelConfig:
    encoder: EncoderConfig = field(default_factory=EncoderConfig)
    decoder: DecoderConfig = field(default_factory=DecoderConfig)
    src_vocab_size: int = 64
    tgt_vocab_size: int = 32
    rope_min_timescale: int = 1
    rope_max_timescale: int = 10000


@dataclass
class DiaConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)


def create_attn_mask(q_padding_mask_1d, k_padding_mask_1d, device, is_causal=False):
    """Creates the attention mask (self or cross) mimicking JAX segment ID logic."""
    p_mask_q = q_padding_mask_1d.unsqueeze(2)  # [B, Tq, 1]
    p_mask_k = k_padding_mask_1d.unsqueeze(1)  # [B, 1, Tk]
    non_pad_attends_non_pad = p_mask_q & p_mask_k
    pad_attends_pad = (~p_mask_q) & (~p_mask_k)
    mask = non_pad_attends_non_pad | pad_attends_pad
    if is_causal:
        causal_mask_2d = torch.tril(torch.ones_like(mask[0], dtype=torch.bool, device=device))
        return (mask & causal_mask_2d).unsqueeze(1)
    return mask.unsqueeze(1)  # [B, 1, Tq, Tk]


@dataclass
class EncoderInferenceState:
    max_seq_len: int
    device: torch.device
    positions: torch.Tensor
    padding_mask: torch.Tensor
    attn_mask: torch.Tensor

    @classmethod
    def new(cls, config, cond_src):
        device = cond_src.device
        positions = torch.arange(config.data.text_length, dtype=torch.float32, device=device).unsqueeze(0)
        padding_mask = (cond_src.squeeze(1) != config.data.text_pad_value).to(device).repeat_interleave(2, dim=0)
        attn_mask = create_attn_mask(padding_mask, padding_mask, device, is_causal=False)
        return cls(config.data.text_length, device, positions, padding_mask, attn_mask)


class KVCache(nn.Module):
    def __init__(self, batch_size, num_heads, max_len, head_dim, dtype, device, k=None, v=None):
        k = torch.zeros((2 * batch_size, num_heads, max_len, head_dim), dtype=dtype, device=device) if k is None else k
        v = torch.zeros((2 * batch_size, num_heads, max_len, head_dim), dtype=dtype, device=device) if v is None else v
        super().__init__()
        self.register_buffer("k", k)
        self.register_buffer("v", v)

    @classmethod
    def from_kv(cls, k, v):
        return cls(k.shape[0] // 2, k.shape[1], k.shape[2], k.shape[3], k.dtype, k.device, k=k, v=v)

    def update(self, k, v, current_idx):
        self.k[:, :, current_idx, :] = k
        self.v[:, :, current_idx, :] = v
        return self.k, self.v

    def prefill(self, k, v):
        prefill_len = k.shape[2]
        self.k[:, :, :prefill_len, :] = k
        self.v[:, :, :prefill_len, :] = v


@dataclass
class DecoderInferenceState:
    device: torch.device
    dtype: torch.dtype
    enc_out: torch.Tensor
    enc_positions: torch.Tensor
    dec_positions: torch.Tensor
    self_attn_cache: list
    cross_attn_cache: list
    casual_attn_mask: torch.Tensor
    cross_attn_mask: torch.Tensor | None

    @classmethod
    def new(cls, config, enc_state, enc_out, dec_cross_attn_cache, compute_dtype):
        device = enc_out.device
        max_audio_len = config.data.audio_length
        batch_size = enc_out.shape[0] // 2
        dec_positions = torch.full((2 * batch_size, 1), fill_value=0, dtype=torch.int32, device=device)
        causal_mask = torch.tril(torch.ones(max_audio_len, max_audio_len, dtype=torch.bool, device=device))
        cross_attn_mask = None
        if FIXED:
            dec_mask = torch.ones((2 * batch_size, 1), dtype=torch.bool, device=device)
            cross_attn_mask = create_attn_mask(dec_mask, enc_state.padding_mask, device, is_causal=False)
        self_attn_cache = [
            KVCache(batch_size, config.model.decoder.kv_heads, max_audio_len, config.model.decoder.gqa_head_dim,
                    compute_dtype, device)
            for _ in range(config.model.decoder.n_layer)
        ]
        return cls(device, compute_dtype, enc_out, enc_state.positions, dec_positions, self_attn_cache,
                   dec_cross_attn_cache, causal_mask, cross_attn_mask)

    def prepare_step(self, step_from, step_to=None):
        if step_to is None:
            step_to = step_from + 1
        self.dec_positions = torch.arange(step_from, step_to, dtype=torch.int32, device=self.device).unsqueeze(0)


class RotaryEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10000):
        super().__init__()
        half = embedding_dims // 2
        fraction = (2.0 * torch.arange(0, half)) / embedding_dims
        self.register_buffer("timescale", (min_timescale * (max_timescale / min_timescale) ** fraction).float(),
                             persistent=False)

    def forward(self, inputs, position):
        position = position.unsqueeze(-1).unsqueeze(-1)
        sinusoid_inp = position / self.timescale
        sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
        first_half, second_half = torch.chunk(inputs.float(), 2, dim=-1)
        return torch.cat((first_half * cos - second_half * sin, second_half * cos + first_half * sin), dim=-1)


class SelfAttention(nn.Module):
    def __init__(self, config, embed_dim, num_query_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_query_heads, self.num_kv_heads, self.head_dim = num_query_heads, num_kv_heads, head_dim
        self.num_gqa_groups = num_query_heads // num_kv_heads
        self.q_proj = nn.Linear(embed_dim, num_query_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_query_heads * head_dim, embed_dim, bias=False)
        self.rotary_emb = RotaryEmbedding(head_dim, config.model.rope_min_timescale, config.model.rope_max_timescale)

    def forward(self, X, q_positions, attn_mask=None, cache=None, prefill=False, is_causal=False, current_idx=None):
        B, T, _ = X.shape
        Xq = self.rotary_emb(self.q_proj(X).view(B, T, self.num_query_heads, self.head_dim), q_positions)
        Xk = self.rotary_emb(self.k_proj(X).view(B, T, self.num_kv_heads, self.head_dim), q_positions)
        Xv = self.v_proj(X).view(B, T, self.num_kv_heads, self.head_dim)
        Xq_BxNxTxH, Xk_BxKxSxH, Xv_BxKxSxH = Xq.transpose(1, 2), Xk.transpose(1, 2), Xv.transpose(1, 2)
        if cache is None:
            attn_k, attn_v = Xk_BxKxSxH, Xv_BxKxSxH
        elif prefill:
            attn_k, attn_v = Xk_BxKxSxH, Xv_BxKxSxH
            cache.prefill(attn_k, attn_v)
        else:
            attn_k, attn_v = cache.update(Xk_BxKxSxH, Xv_BxKxSxH, current_idx)
        attn_output = F.scaled_dot_product_attention(
            Xq_BxNxTxH, attn_k, attn_v,
            attn_mask=attn_mask if not is_causal else None,
            scale=1.0, enable_gqa=self.num_gqa_groups > 1, is_causal=is_causal,
        )
        return self.o_proj(attn_output.transpose(1, 2).reshape(B, T, -1))


class CrossAttention(nn.Module):
    def __init__(self, config, q_embed_dim, kv_embed_dim, num_query_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_query_heads, self.head_dim = num_query_heads, head_dim
        self.num_gqa_groups = num_query_heads // num_kv_heads
        self.q_proj = nn.Linear(q_embed_dim, num_query_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_embed_dim, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_query_heads * head_dim, q_embed_dim, bias=False)
        self.rotary_emb = RotaryEmbedding(head_dim, config.model.rope_min_timescale, config.model.rope_max_timescale)

    def forward(self, Xq, q_positions, kv_positions=None, attn_mask=None, cache=None, is_causal=False):
        B, T, _ = Xq.shape
        Xq_BxTxNxH = self.rotary_emb(self.q_proj(Xq).view(B, T, self.num_query_heads, self.head_dim), q_positions)
        attn_k, attn_v = cache.k, cache.v
        attn_output = F.scaled_dot_product_attention(
            Xq_BxTxNxH.transpose(1, 2), attn_k, attn_v,
            attn_mask=attn_mask if not is_causal else None,
            scale=1.0, enable_gqa=self.num_gqa_groups > 1, is_causal=is_causal,
        )
        return self.o_proj(attn_output.transpose(1, 2).reshape(B, T, -1))


class Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        enc = config.model.encoder
        self.embedding = nn.Embedding(config.model.src_vocab_size, enc.n_embd)
        self.norm = nn.RMSNorm(enc.n_embd)
        self.self_attention = SelfAttention(config, enc.n_embd, enc.n_head, enc.n_head, enc.head_dim)

    def forward(self, x_ids, state):
        x = self.embedding(x_ids)
        x = x + self.self_attention(self.norm(x), q_positions=state.positions, attn_mask=state.attn_mask)
        return x


class DecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        dec, enc = config.model.decoder, config.model.encoder
        self.pre_sa_norm = nn.RMSNorm(dec.n_embd)
        self.pre_ca_norm = nn.RMSNorm(dec.n_embd)
        self.self_attention = SelfAttention(config, dec.n_embd, dec.gqa_query_heads, dec.kv_heads, dec.gqa_head_dim)
        self.cross_attention = CrossAttention(config, dec.n_embd, enc.n_embd, dec.cross_query_heads,
                                              dec.cross_query_heads, dec.cross_head_dim)

    def forward(self, x, state, self_attn_cache=None, cross_attn_cache=None, prefill=False, current_idx=0):
        self_attn_mask = state.casual_attn_mask[None, None, current_idx]
        x = x + self.self_attention(self.pre_sa_norm(x), q_positions=state.dec_positions, attn_mask=self_attn_mask,
                                    cache=self_attn_cache, prefill=prefill, is_causal=prefill,
                                    current_idx=current_idx)
        ca_kwargs = dict(Xq=self.pre_ca_norm(x), q_positions=state.dec_positions, kv_positions=state.enc_positions,
                         cache=cross_attn_cache)
        if FIXED:
            ca_kwargs["attn_mask"] = state.cross_attn_mask
        return x + self.cross_attention(**ca_kwargs)


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        dec = config.model.decoder
        self.embeddings = nn.ModuleList(
            [nn.Embedding(config.model.tgt_vocab_size, dec.n_embd) for _ in range(config.data.channels)])
        self.layers = nn.ModuleList([DecoderLayer(config) for _ in range(dec.n_layer)])
        self.logits_dense = nn.Linear(dec.n_embd, config.data.channels * config.model.tgt_vocab_size, bias=False)
        self.channels, self.vocab = config.data.channels, config.model.tgt_vocab_size

    def precompute_cross_attn_cache(self, enc_out, enc_positions, k_padding_mask=None):
        per_layer_kv_cache = []
        for layer in self.layers:
            ca = layer.cross_attention
            B, S, _ = enc_out.shape
            k_proj = ca.rotary_emb(ca.k_proj(enc_out).view(B, S, -1, ca.head_dim), enc_positions)
            v_proj = ca.v_proj(enc_out).view(B, S, -1, ca.head_dim)
            k, v = k_proj.transpose(1, 2), v_proj.transpose(1, 2)
            if k_padding_mask is not None:
                k = k.masked_fill(~k_padding_mask.unsqueeze(1).unsqueeze(3), 0.0)
            per_layer_kv_cache.append(KVCache.from_kv(k, v))
        return per_layer_kv_cache

    def forward(self, tgt_ids_Bx1xC, state, prefill=False, current_idx=0):
        x = sum(emb(tgt_ids_Bx1xC[..., i]) for i, emb in enumerate(self.embeddings))
        for i, layer in enumerate(self.layers):
            x = layer(x, state, self_attn_cache=state.self_attn_cache[i], cross_attn_cache=state.cross_attn_cache[i],
                      prefill=prefill, current_idx=current_idx)
        return self.logits_dense(x).view(x.shape[0], x.shape[1], self.channels, self.vocab)


def main():
    torch.manual_seed(0)
    config = DiaConfig()
    encoder, decoder = Encoder(config).eval(), Decoder(config).eval()

    # Two prompts (5 and 9 byte tokens) right-padded to text_length with text_pad_value.
    lengths = [5, 9]
    text = torch.full((2, config.data.text_length), config.data.text_pad_value, dtype=torch.long)
    for b, n in enumerate(lengths):
        text[b, :n] = torch.randint(1, config.model.src_vocab_size, (n,))

    enc_input_uncond = torch.zeros_like(text)
    enc_input = torch.stack([enc_input_uncond, text], dim=1).view(-1, config.data.text_length)
    enc_state = EncoderInferenceState.new(config, text.unsqueeze(1))
    with torch.no_grad():
        encoder_out = encoder(enc_input, enc_state)
        cross_cache = decoder.precompute_cross_attn_cache(encoder_out, enc_state.positions, enc_state.padding_mask)
        dec_state = DecoderInferenceState.new(config, enc_state, encoder_out, cross_cache, torch.float32)

        tokens = torch.full((2 * len(lengths), 1, config.data.channels), config.data.audio_bos_value)
        generated = []
        for step in range(4):
            dec_state.prepare_step(step)
            current_idx = torch.tensor([step])
            logits = decoder(tokens, dec_state, prefill=(step == 0), current_idx=current_idx)
            uncond, cond = logits.view(len(lengths), 2, 1, config.data.channels, -1).unbind(1)
            pred = (cond + 3.0 * (cond - uncond)).argmax(-1)  # classifier-free guidance
            generated.append(pred)
            tokens = pred.repeat_interleave(2, dim=0)
    print("generated audio codes:", torch.cat(generated, dim=1)[:, :, 0].tolist())


if __name__ == "__main__":
    main()
