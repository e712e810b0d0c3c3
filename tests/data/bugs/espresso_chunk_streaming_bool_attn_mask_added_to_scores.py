"""Espresso streaming speech Transformer encoder: the chunk-streaming attention mask stayed boolean.

Citation: freewym/espresso commit f823f17e ("adds an option to include EOS in transducer model
training; fixes a bug regarding attn_mask; ..."), espresso/models/transformer/
speech_transformer_encoder.py ``SpeechTransformerEncoderBase.forward_scriptable``.

``get_attn_mask`` returns ``~speech_utils.chunk_streaming_mask(...)`` (or a triu/tril context mask), a
BoolTensor of shape (T, T) where True means "exclude this key". fairseq's
``TransformerEncoderLayerBase.forward`` turns the mask into a bias with
``attn_mask.masked_fill(attn_mask.to(torch.bool), -1e8)``; on a bool tensor that fill leaves it
boolean (True stays True). With relative positional embeddings ``MultiheadAttention`` skips
``F.multi_head_attention_forward`` and runs its own path, where ``attn_weights += attn_mask`` adds
1.0 to the excluded scores instead of -1e8.

The fix casts the mask to the activations' dtype before the layers:
``attn_mask = attn_mask.type_as(x)`` ("casting is important as attn_mask will be added to
attn_weights").

Ported at toy sizes (2 layers, 16-dim, 2 heads, sinusoidal relative positional embeddings, no
convolutional pre-encoder, 40-dim features through ``fc0``), in eval mode (``always_partial_in_last``),
chunk_size 4 with one left chunk, on a right-padded batch of two utterances (12 and 9 frames).
"""

import contextlib
import math
import sys
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


# ---- espresso/tools/utils.py ------------------------------------------------------------------
def sequence_mask(sequence_length, max_len=None):
    if max_len is None:
        max_len = sequence_length.data.max()
    batch_size = sequence_length.size(0)
    seq_range = torch.arange(0, max_len).to(
        device=sequence_length.device,
        dtype=sequence_length.dtype,
    )
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = sequence_length.unsqueeze(1).expand_as(seq_range_expand)
    return seq_range_expand < seq_length_expand


def chunk_streaming_mask(
    sequence_length: torch.Tensor,
    chunk_size: int,
    left_window: int = 0,
    right_window: int = 0,
    always_partial_in_last: bool = False,
):
    """Returns (tgt_len, src_len) BoolTensor; True means tgt_i needs src_j."""
    max_len = sequence_length.data.max()
    chunk_start_idx = torch.arange(
        0,
        max_len,
        chunk_size,
        dtype=sequence_length.dtype,
        device=sequence_length.device,
    )  # e.g. [0,18,36,54]
    if not always_partial_in_last and np.random.rand() > 0.5:
        # either first or last chunk is partial. If only the last one is not complete, EOS is not effective
        chunk_start_idx = max_len - chunk_start_idx
        chunk_start_idx = chunk_start_idx.flip([0])
        chunk_start_idx = chunk_start_idx[:-1]
        chunk_start_idx = F.pad(chunk_start_idx, (1, 0))

    start_pad = torch.nn.functional.pad(chunk_start_idx, (1, 0))  # [0,0,18,36,54]
    end_pad = torch.nn.functional.pad(
        chunk_start_idx, (0, 1), value=max_len
    )  # [0,18,36,54,max_len]
    seq_range = torch.arange(
        0, max_len, dtype=sequence_length.dtype, device=sequence_length.device
    )
    idx = (
        (seq_range.unsqueeze(-1) >= start_pad) & (seq_range.unsqueeze(-1) < end_pad)
    ).nonzero()[
        :, 1
    ]  # max_len
    seq_range_expand = seq_range.unsqueeze(0).expand(max_len, -1)  # max_len x max_len

    idx_left = idx - left_window
    idx_left[idx_left < 0] = 0
    boundary_left = start_pad[idx_left]  # max_len
    mask_left = seq_range_expand >= boundary_left.unsqueeze(-1)

    idx_right = idx + right_window
    idx_right[idx_right > len(chunk_start_idx)] = len(chunk_start_idx)
    boundary_right = end_pad[idx_right]  # max_len
    mask_right = seq_range_expand < boundary_right.unsqueeze(-1)

    return mask_left & mask_right


# ---- fairseq/data/data_utils.py ----------------------------------------------------------------
@contextlib.contextmanager
def numpy_seed(seed, *addl_seeds):
    if seed is None:
        yield
        return
    state = np.random.get_state()
    np.random.seed(seed)
    try:
        yield
    finally:
        np.random.set_state(state)


# ---- config (SpeechTransformerConfig, trimmed) -------------------------------------------------
@dataclass
class EncoderConfig:
    embed_dim: int = 16
    ffn_embed_dim: int = 32
    layers: int = 2
    attention_heads: int = 2
    normalize_before: bool = True
    learned_pos: bool = False
    relative_positional_embeddings: bool = True
    layer_type: str = "transformer"
    chunk_size: int = 4
    chunk_left_window: int = 1
    chunk_right_window: int = 0
    transformer_context: Optional[str] = None


@dataclass
class SpeechTransformerConfig:
    dropout: float = 0.0
    attention_dropout: float = 0.0
    activation_dropout: float = 0.0
    max_source_positions: int = 1024
    no_scale_embedding: bool = False
    encoder: EncoderConfig = field(default_factory=EncoderConfig)


# ---- espresso/modules/sinusoidal_relative_positional_embedding.py -----------------------------
class SinusoidalRelativePositionalEmbedding(nn.Module):
    def __init__(self, embedding_dim, padding_idx=None, init_size=1024, max_size=None,
                 scale_embedding=False):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.padding_idx = padding_idx
        self.embedding_scale = embedding_dim**-0.5 if scale_embedding else 1.0
        self.weight = self.embedding_scale * SinusoidalRelativePositionalEmbedding.get_embedding(
            init_size, embedding_dim, padding_idx
        )
        self.register_buffer("_float_tensor", torch.FloatTensor(1))
        self.max_size = max_size

    @property
    def learnable(self) -> bool:
        return False

    @staticmethod
    def get_embedding(seq_len: int, embedding_dim: int, padding_idx: Optional[int] = None):
        half_dim = embedding_dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim, dtype=torch.float) * -emb)
        emb = torch.arange(seq_len, dtype=torch.float).unsqueeze(1) * emb.unsqueeze(0)
        emb_pos = torch.cat([torch.sin(emb), torch.cos(emb)], dim=1).view(seq_len, -1)
        emb_neg = torch.cat([torch.sin(-emb), torch.cos(-emb)], dim=1).view(seq_len, -1)
        emb_neg = torch.flip(emb_neg, [0])
        emb_pos = emb_pos[1:]
        emb = torch.cat([emb_neg, emb_pos], dim=0)
        if padding_idx is not None:
            emb = torch.cat([emb.new_zeros([padding_idx + 1, emb.size(1)]), emb], dim=0)
        return emb

    def forward(self, input: Tensor, incremental_state=None, positions=None):
        bsz, seq_len = input.size(0), input.size(1)
        max_positions = self.weight.size(0)
        self.weight = self.weight.to(self._float_tensor)
        start = max_positions // 2 - seq_len + 1
        end = max_positions // 2 + seq_len
        positions = torch.arange(start, end)
        used_weight = self.weight[positions, :]
        return used_weight.expand(bsz, -1, -1)


def RelativePositionalEmbedding(embedding_dim, padding_idx=None, max_size=None, learned=False):
    return SinusoidalRelativePositionalEmbedding(
        embedding_dim, padding_idx, init_size=1024, max_size=max_size, scale_embedding=True
    )


# ---- fairseq/modules/multihead_attention.py (espresso fork, self-attention path) ---------------
class MultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, self_attention=False,
                 positional_embedding=None):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout_p = dropout
        self.head_dim = embed_dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention
        self.encoder_decoder_attention = False
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self.positional_embedding = positional_embedding
        if self.positional_embedding is not None and not self.positional_embedding.learnable:
            self.pos_bias_u = nn.Parameter(torch.Tensor(embed_dim))
            self.pos_bias_v = nn.Parameter(torch.Tensor(embed_dim))
            self.pos_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        else:
            self.pos_bias_u = self.pos_bias_v = self.pos_proj = None
        self.onnx_trace = False
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        nn.init.constant_(self.out_proj.bias, 0.0)
        if self.pos_bias_u is not None:
            nn.init.xavier_uniform_(self.pos_bias_u.view(self.num_heads, -1))
            nn.init.xavier_uniform_(self.pos_bias_v.view(self.num_heads, -1))
            nn.init.xavier_uniform_(self.pos_proj.weight, gain=1 / math.sqrt(2))

    def forward(self, query, key, value, key_padding_mask=None, incremental_state=None,
                need_weights=True, static_kv=False, attn_mask=None):
        tgt_len, bsz, embed_dim = query.size()
        src_len = tgt_len

        if (
            incremental_state is None
            and not static_kv
            and self.positional_embedding is None
        ):
            return F.multi_head_attention_forward(
                query, key, value, self.embed_dim, self.num_heads, torch.empty([0]),
                torch.cat((self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)),
                self.bias_k, self.bias_v, self.add_zero_attn, self.dropout_p,
                self.out_proj.weight, self.out_proj.bias, self.training,
                key_padding_mask, need_weights, attn_mask,
                use_separate_proj_weight=True,
                q_proj_weight=self.q_proj.weight,
                k_proj_weight=self.k_proj.weight,
                v_proj_weight=self.v_proj.weight,
            )

        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)

        if self.positional_embedding is not None:
            if not self.positional_embedding.learnable:
                q_with_bias_v = (q + self.pos_bias_v) * self.scaling
                q_with_bias_v = (
                    q_with_bias_v.contiguous()
                    .view(tgt_len, bsz * self.num_heads, self.head_dim)
                    .transpose(0, 1)
                )
                q = q + self.pos_bias_u
        q *= self.scaling

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.head_dim).transpose(0, 1)
        kv_bsz = k.size(1)
        k = k.contiguous().view(-1, kv_bsz * self.num_heads, self.head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, kv_bsz * self.num_heads, self.head_dim).transpose(0, 1)

        attn_weights = torch.bmm(q, k.transpose(1, 2))

        if self.positional_embedding is not None:
            # compute `attn_weights` as described in https://arxiv.org/abs/1901.02860 Section 3.3
            if key_padding_mask is not None:
                pe = self.positional_embedding(~(key_padding_mask.bool()))
            else:
                pe = self.positional_embedding(k.new_ones([bsz, src_len], dtype=torch.bool))
            if not self.positional_embedding.learnable:
                pe = self.pos_proj(pe)
            pe = pe.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)
            pe = pe.reshape(bsz * self.num_heads, -1, self.head_dim)
            positional_logits = torch.bmm(
                q_with_bias_v if not self.positional_embedding.learnable else q,
                pe.transpose(1, 2),
            )
            batch_head_stride, tgt_stride, src_stride = positional_logits.stride()
            # assume src (key) and tgt (query) sequences are right-aligned
            positional_logits = positional_logits.as_strided(
                (bsz * self.num_heads, tgt_len, src_len),
                (batch_head_stride, tgt_stride - src_stride, src_stride),
                storage_offset=src_stride * (tgt_len - 1),
            )
            attn_weights = attn_weights + positional_logits

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(kv_bsz, -1, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).unsqueeze(3).to(torch.bool),
                float("-inf"),
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        attn_weights_float = F.softmax(attn_weights, dim=-1, dtype=torch.float32)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = F.dropout(attn_weights, p=self.dropout_p, training=self.training)

        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, self.embed_dim)
        attn = self.out_proj(attn)
        return attn, None


# ---- fairseq/modules/transformer_layer.py + espresso layer subclass ---------------------------
class TransformerWithRelativePositionalEmbeddingEncoderLayerBase(nn.Module):
    def __init__(self, cfg, return_fc=False, positional_embedding=None):
        super().__init__()
        self.positional_embedding = [positional_embedding]
        self.cfg = cfg
        self.return_fc = return_fc
        self.embed_dim = cfg.encoder.embed_dim
        self.self_attn = self.build_self_attention(self.embed_dim, cfg)
        self.self_attn_layer_norm = nn.LayerNorm(self.embed_dim)
        self.dropout_p = cfg.dropout
        self.activation_fn = F.relu
        self.normalize_before = cfg.encoder.normalize_before
        self.fc1 = nn.Linear(self.embed_dim, cfg.encoder.ffn_embed_dim)
        self.fc2 = nn.Linear(cfg.encoder.ffn_embed_dim, self.embed_dim)
        self.final_layer_norm = nn.LayerNorm(self.embed_dim)

    def build_self_attention(self, embed_dim, cfg):
        return MultiheadAttention(
            embed_dim,
            cfg.encoder.attention_heads,
            dropout=cfg.attention_dropout,
            self_attention=True,
            positional_embedding=self.positional_embedding[0],
        )

    def forward(self, x, encoder_padding_mask: Optional[Tensor], attn_mask: Optional[Tensor] = None):
        # anything in original attn_mask = 1, becomes -1e8
        # anything in original attn_mask = 0, becomes 0
        # Note that we cannot use -inf here, because at some edge cases,
        # the attention weight (before softmax) for some padded element in query
        # will become -inf, which results in NaN in model parameters
        if attn_mask is not None:
            attn_mask = attn_mask.masked_fill(
                attn_mask.to(torch.bool), -1e8 if x.dtype == torch.float32 else -1e4
            )

        residual = x
        if self.normalize_before:
            x = self.self_attn_layer_norm(x)
        x, _ = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=encoder_padding_mask,
            need_weights=False,
            attn_mask=attn_mask,
        )
        x = F.dropout(x, p=self.dropout_p, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.self_attn_layer_norm(x)

        residual = x
        if self.normalize_before:
            x = self.final_layer_norm(x)
        x = self.activation_fn(self.fc1(x))
        x = self.fc2(x)
        x = F.dropout(x, p=self.dropout_p, training=self.training)
        x = residual + x
        if not self.normalize_before:
            x = self.final_layer_norm(x)
        return x


# ---- espresso/models/transformer/speech_transformer_encoder.py ---------------------------------
class SpeechTransformerEncoderBase(nn.Module):
    def __init__(self, cfg, pre_encoder=None, input_size=83):
        super().__init__()
        self.cfg = cfg
        embed_dim = cfg.encoder.embed_dim
        self.pre_encoder = pre_encoder
        self.fc0 = nn.Linear(input_size, embed_dim) if input_size != embed_dim else None
        self.embed_scale = (
            1.0 if cfg.no_scale_embedding or self.fc0 is not None else math.sqrt(embed_dim)
        )
        self.embed_positions = None  # relative positional embeddings are used instead
        rel_pos_embed = RelativePositionalEmbedding(
            cfg.encoder.embed_dim, padding_idx=None, max_size=None, learned=False
        )
        # single instance referenced across layers
        rel_pos_embed_list = [rel_pos_embed] * cfg.encoder.layers
        self.layers = nn.ModuleList(
            [
                TransformerWithRelativePositionalEmbeddingEncoderLayerBase(
                    cfg, positional_embedding=rel_pos_embed_list[i]
                )
                for i in range(cfg.encoder.layers)
            ]
        )
        self.layer_norm = nn.LayerNorm(embed_dim) if cfg.encoder.normalize_before else None
        self.transformer_context = None
        self.num_updates = 0

    def get_attn_mask(self, in_lengths):
        """`attn_mask[tgt_i, src_j] = 1` means that when calculating the
        embedding for `tgt_i`, we exclude (mask out) `src_j`."""
        if self.cfg.encoder.chunk_size > 0:
            with numpy_seed(self.num_updates):
                return ~chunk_streaming_mask(
                    in_lengths,
                    self.cfg.encoder.chunk_size,
                    left_window=self.cfg.encoder.chunk_left_window,
                    right_window=self.cfg.encoder.chunk_right_window,
                    always_partial_in_last=(not self.training),
                )

        if self.transformer_context is None or (
            self.transformer_context[0] is None and self.transformer_context[1] is None
        ):
            return None
        max_len = in_lengths.data.max()
        all_ones = in_lengths.ones([max_len, max_len], dtype=torch.bool)
        if self.transformer_context[0] is None:
            return all_ones.triu(self.transformer_context[1] + 1)
        if self.transformer_context[1] is None:
            return all_ones.tril(-self.transformer_context[0] - 1)
        return all_ones.triu(self.transformer_context[1] + 1) | all_ones.tril(
            -self.transformer_context[0] - 1
        )

    def forward(self, src_tokens, src_lengths, return_all_hiddens: bool = False):
        return self.forward_scriptable(src_tokens, src_lengths, return_all_hiddens)

    def forward_scriptable(self, src_tokens, src_lengths, return_all_hiddens: bool = False):
        x, encoder_padding_mask = (
            src_tokens,
            ~sequence_mask(src_lengths, src_tokens.size(1)),
        )
        has_pads = src_tokens.device.type == "xla" or encoder_padding_mask.any()

        if self.fc0 is not None:
            x = self.fc0(x)
        x = self.embed_scale * x

        # account for padding while computing the representation
        if has_pads:
            x = x * (1 - encoder_padding_mask.unsqueeze(-1).type_as(x))

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        attn_mask = self.get_attn_mask(src_lengths)
        if FIXED and attn_mask is not None:
            # casting is important as attn_mask will be added to attn_weights
            attn_mask = attn_mask.type_as(x)

        # encoder layers
        for layer in self.layers:
            x = layer(
                x,
                encoder_padding_mask=encoder_padding_mask if has_pads else None,
                attn_mask=attn_mask,
            )

        if self.layer_norm is not None:
            x = self.layer_norm(x)

        return {
            "encoder_out": [x],  # T x B x C
            "encoder_padding_mask": [encoder_padding_mask] if encoder_padding_mask.any() else [],
            "src_lengths": [src_lengths],
        }


def main():
    torch.manual_seed(0)
    cfg = SpeechTransformerConfig()
    input_size, vocab = 40, 12
    encoder = SpeechTransformerEncoderBase(cfg, pre_encoder=None, input_size=input_size).eval()
    ctc_proj = nn.Linear(cfg.encoder.embed_dim, vocab).eval()

    src_lengths = torch.tensor([12, 9])
    feats = torch.randn(2, int(src_lengths.max()), input_size)
    for b, n in enumerate(src_lengths.tolist()):
        feats[b, n:] = 0.0

    with torch.no_grad():
        out = encoder(feats, src_lengths)
        enc = out["encoder_out"][0].transpose(0, 1)  # B x T x C
        lprobs = F.log_softmax(ctc_proj(enc), dim=-1)

    for b, n in enumerate(src_lengths.tolist()):
        greedy = lprobs[b, :n].argmax(-1).tolist()
        print(f"utt {b}: frames={n} first-chunk enc[0,:4]={[round(v, 4) for v in enc[b, 0, :4].tolist()]}")
        print(f"utt {b}: frame-level argmax={greedy}")
        print(f"utt {b}: sum logprob of argmax={lprobs[b, :n].max(-1).values.sum().item():.4f}")


if __name__ == "__main__":
    main()
