# Citation: NVIDIA/NeMo @19916a4c2d39a16e6c23fb24163867789f4ae7c5
#   nemo/collections/asr/modules/conformer_encoder.py (ConformerEncoder.forward_internal with cache_last_channel /
#   cache_last_channel_len, _create_masks with offset, setup_streaming_params for att_context_style
#   "chunked_limited", get_initial_cache_state) and nemo/collections/asr/parts/submodules/multi_head_attention.py
#   (MultiHeadAttention.update_cache / forward_attention, RelPositionMultiHeadAttention, RelPositionalEncoding with
#   cache_len).
# Cache-aware streaming FastConformer-style encoder, trimmed to what builds and uses the masks: a Linear pre_encode
# (no subsampling), rel_pos self-attention layers (the conv module left out, so cache_last_time passes through).
# att_context_size = [4, 1] with "chunked_limited": chunks of 2 frames, each seeing its own chunk and 2 earlier chunks.
# Streaming: each step feeds 2 frames per row; every layer keeps its last 4 input frames as cache_last_channel, the
# keys are [cache; chunk], and the mask over the cache slots is cut by `offset = cache_len - cache_last_channel_len`
# (slots not yet filled) and by each row's padding. A right-padded batch of two utterances streamed chunk by chunk
# gives, at every real frame, the same encoder output as the offline (full-utterance) forward with the chunked_limited
# mask and as each utterance run alone, unpadded.
import math
import random
from dataclasses import dataclass

import torch
import torch.nn as nn

torch.manual_seed(0)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate, max_cache_len=0):
        super().__init__()
        self.cache_drop_size = None
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.s_d_k = math.sqrt(self.d_k)
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)
        self._max_cache_len = max_cache_len

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
            scores = scores.masked_fill(mask, -10000.0)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            attn = torch.softmax(scores, dim=-1)  # (batch, head, time1, time2)

        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)  # (batch, time1, d_model)
        return self.linear_out(x)  # (batch, time1, d_model)

    def update_cache(self, key, value, query, cache):
        if cache is not None:
            key = value = torch.cat([cache, key], dim=1)
            q_keep_size = query.shape[1] - self.cache_drop_size
            cache = torch.cat([cache[:, q_keep_size:, :], query[:, :q_keep_size, :]], dim=1)
        return key, value, query, cache


class RelPositionMultiHeadAttention(MultiHeadAttention):
    def __init__(self, n_head, n_feat, dropout_rate, pos_bias_u, pos_bias_v, max_cache_len=0):
        super().__init__(n_head=n_head, n_feat=n_feat, dropout_rate=dropout_rate, max_cache_len=max_cache_len)
        self.linear_pos = nn.Linear(n_feat, n_feat, bias=False)
        if pos_bias_u is None or pos_bias_v is None:
            self.pos_bias_u = nn.Parameter(torch.FloatTensor(self.h, self.d_k))
            self.pos_bias_v = nn.Parameter(torch.FloatTensor(self.h, self.d_k))
            # zeros upstream; small random values here so the positional terms matter in the check
            nn.init.normal_(self.pos_bias_u, 0.0, 0.3)
            nn.init.normal_(self.pos_bias_v, 0.0, 0.3)
        else:
            self.pos_bias_u = pos_bias_u
            self.pos_bias_v = pos_bias_v

    def rel_shift(self, x):
        b, h, qlen, pos_len = x.size()  # (b, h, t1, t2)
        x = torch.nn.functional.pad(x, pad=(1, 0))  # (b, h, t1, t2+1)
        x = x.view(b, h, -1, qlen)  # (b, h, t2+1, t1)
        x = x[:, :, 1:].view(b, h, qlen, pos_len)  # (b, h, t1, t2)
        return x

    def forward(self, query, key, value, mask, pos_emb, cache=None):
        key, value, query, cache = self.update_cache(key=key, value=value, query=query, cache=cache)

        q, k, v = self.forward_qkv(query, key, value)
        q = q.transpose(1, 2)  # (batch, time1, head, d_k)

        n_batch_pos = pos_emb.size(0)
        p = self.linear_pos(pos_emb).view(n_batch_pos, -1, self.h, self.d_k)
        p = p.transpose(1, 2)  # (batch, head, time1, d_k)

        q_with_bias_u = (q + self.pos_bias_u).transpose(1, 2)
        q_with_bias_v = (q + self.pos_bias_v).transpose(1, 2)

        matrix_ac = torch.matmul(q_with_bias_u, k.transpose(-2, -1))
        matrix_bd = torch.matmul(q_with_bias_v, p.transpose(-2, -1))
        matrix_bd = self.rel_shift(matrix_bd)
        # drops extra elements in the matrix_bd to match the matrix_ac's size
        matrix_bd = matrix_bd[:, :, :, : matrix_ac.size(-1)]

        scores = (matrix_ac + matrix_bd) / self.s_d_k  # (batch, head, time1, time2)

        out = self.forward_attention(v, scores, mask)

        if cache is None:
            return out
        else:
            return out, cache


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout_rate, max_len=5000, xscale=None, dropout_rate_emb=0.0):
        super().__init__()
        self.d_model = d_model
        self.xscale = xscale
        self.dropout = nn.Dropout(p=dropout_rate)
        self.max_len = max_len
        self.dropout_emb = nn.Dropout(dropout_rate_emb) if dropout_rate_emb > 0 else None

    def create_pe(self, positions):
        pos_length = positions.size(0)
        pe = torch.zeros(pos_length, self.d_model, device=positions.device)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32, device=positions.device)
            * -(math.log(10000.0) / self.d_model)
        )
        pe[:, 0::2] = torch.sin(positions * div_term)
        pe[:, 1::2] = torch.cos(positions * div_term)
        pe = pe.unsqueeze(0)
        if hasattr(self, 'pe'):
            self.pe = pe
        else:
            self.register_buffer('pe', pe, persistent=False)


class RelPositionalEncoding(PositionalEncoding):
    def extend_pe(self, length, device):
        needed_size = 2 * length - 1
        if hasattr(self, 'pe') and self.pe.size(1) >= needed_size:
            return
        # positive positions would be used for left positions and negative for right positions
        positions = torch.arange(length - 1, -length, -1, dtype=torch.float32, device=device).unsqueeze(1)
        self.create_pe(positions=positions)

    def forward(self, x, cache_len=0):
        if self.xscale:
            x = x * self.xscale
        # for input of length L, 2*L-1 positions are needed, positions from (L-1) to -(L-1)
        input_len = x.size(1) + cache_len
        center_pos = self.pe.size(1) // 2 + 1
        start_pos = center_pos - input_len
        end_pos = center_pos + input_len - 1
        pos_emb = self.pe[:, start_pos:end_pos]
        if self.dropout_emb:
            pos_emb = self.dropout_emb(pos_emb)
        return self.dropout(x), pos_emb


class ConformerFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout):
        super().__init__()
        self.linear1 = nn.Linear(d_model, d_ff)
        self.activation = nn.SiLU()
        self.dropout = nn.Dropout(p=dropout)
        self.linear2 = nn.Linear(d_ff, d_model)

    def forward(self, x):
        return self.linear2(self.dropout(self.activation(self.linear1(x))))


class ConformerLayer(nn.Module):
    """ConformerLayer with the convolution module left out (its cache_last_time passes through unchanged)."""

    def __init__(self, d_model, d_ff, n_heads=4, dropout=0.0, dropout_att=0.0, att_context_size=(-1, -1)):
        super().__init__()
        self.self_attention_model = 'rel_pos'
        self.fc_factor = 0.5
        self.norm_feed_forward1 = nn.LayerNorm(d_model)
        self.feed_forward1 = ConformerFeedForward(d_model=d_model, d_ff=d_ff, dropout=dropout)
        self.norm_self_att = nn.LayerNorm(d_model)
        self.self_attn = RelPositionMultiHeadAttention(
            n_head=n_heads, n_feat=d_model, dropout_rate=dropout_att, pos_bias_u=None, pos_bias_v=None,
            max_cache_len=att_context_size[0],
        )
        self.norm_feed_forward2 = nn.LayerNorm(d_model)
        self.feed_forward2 = ConformerFeedForward(d_model=d_model, d_ff=d_ff, dropout=dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm_out = nn.LayerNorm(d_model)

    def forward(self, x, att_mask=None, pos_emb=None, pad_mask=None, cache_last_channel=None, cache_last_time=None):
        residual = x
        x = self.norm_feed_forward1(x)
        x = self.feed_forward1(x)
        residual = residual + self.dropout(x) * self.fc_factor

        x = self.norm_self_att(residual)
        x = self.self_attn(query=x, key=x, value=x, mask=att_mask, pos_emb=pos_emb, cache=cache_last_channel)
        if x is not None and cache_last_channel is not None:
            (x, cache_last_channel) = x
        residual = residual + self.dropout(x)

        x = self.norm_feed_forward2(residual)
        x = self.feed_forward2(x)
        residual = residual + self.dropout(x) * self.fc_factor

        x = self.norm_out(residual)
        if cache_last_channel is None:
            return x
        else:
            return x, cache_last_channel, cache_last_time


@dataclass
class CacheAwareStreamingConfig:
    chunk_size: int = 0
    shift_size: int = 0
    cache_drop_size: int = 0
    last_channel_cache_size: int = 0
    valid_out_len: int = 0
    pre_encode_cache_size: int = 0
    drop_extra_pre_encoded: int = 0
    last_channel_num: int = 0
    last_time_num: int = 0


class ConformerEncoder(nn.Module):
    def __init__(self, feat_in, n_layers, d_model, ff_expansion_factor=4, n_heads=4, att_context_size=None,
                 att_context_style="chunked_limited", xscaling=True, pos_emb_max_len=5000, conv_kernel_size=9,
                 dropout=0.0, dropout_att=0.0):
        super().__init__()
        self.d_model = d_model
        self.n_layers = n_layers
        self._feat_in = feat_in
        self.att_context_style = att_context_style
        self.subsampling_factor = 1
        self.self_attention_model = "rel_pos"
        self.att_context_size_all = [list(att_context_size)]
        self.att_context_size = list(att_context_size)
        self.att_context_probs = [1.0]
        self.conv_context_size = [conv_kernel_size - 1, 0]
        self.xscale = math.sqrt(d_model) if xscaling else None
        self.reduction_position = None
        self.pre_encode = nn.Linear(feat_in, d_model)
        self.pos_enc = RelPositionalEncoding(d_model=d_model, dropout_rate=dropout, max_len=pos_emb_max_len,
                                             xscale=self.xscale)
        self.layers = nn.ModuleList()
        for _ in range(n_layers):
            self.layers.append(ConformerLayer(d_model=d_model, d_ff=d_model * ff_expansion_factor, n_heads=n_heads,
                                              dropout=dropout, dropout_att=dropout_att,
                                              att_context_size=self.att_context_size))
        self.layer_drop_probs = [0.0] * n_layers
        self.out_proj = None
        self.pos_emb_max_len = pos_emb_max_len
        self.max_audio_length = 0
        self.set_max_audio_length(pos_emb_max_len)
        self.setup_streaming_params()

    def set_max_audio_length(self, max_audio_length):
        self.max_audio_length = max_audio_length
        device = next(self.parameters()).device
        self.pos_enc.extend_pe(max_audio_length, device)

    def update_max_seq_length(self, seq_length, device):
        if seq_length > self.max_audio_length:
            self.set_max_audio_length(seq_length)

    def setup_streaming_params(self, att_context_size=None, max_context=10000):
        streaming_cfg = CacheAwareStreamingConfig()
        if att_context_size is None:
            att_context_size = self.att_context_size
        # att_context_style == "chunked_limited"
        lookahead_steps = att_context_size[1]
        streaming_cfg.cache_drop_size = 0
        streaming_cfg.last_channel_cache_size = att_context_size[0] if att_context_size[0] >= 0 else max_context
        # a Linear pre_encode has no get_sampling_frames: one feature frame is one encoder frame here
        sampling_frames = 1
        streaming_cfg.chunk_size = sampling_frames * (1 + lookahead_steps)
        streaming_cfg.shift_size = sampling_frames * (1 + lookahead_steps - streaming_cfg.cache_drop_size)
        streaming_cfg.valid_out_len = streaming_cfg.shift_size // self.subsampling_factor
        streaming_cfg.pre_encode_cache_size = 0
        streaming_cfg.drop_extra_pre_encoded = 0
        for m in self.layers.modules():
            if hasattr(m, "_max_cache_len"):
                if isinstance(m, MultiHeadAttention):
                    m.cache_drop_size = streaming_cfg.cache_drop_size
        self.streaming_cfg = streaming_cfg

    def get_initial_cache_state(self, batch_size=1, dtype=torch.float32, device=None):
        if device is None:
            device = next(self.parameters()).device
        last_time_cache_size = self.conv_context_size[0]
        cache_last_channel = torch.zeros(
            (len(self.layers), batch_size, self.streaming_cfg.last_channel_cache_size, self.d_model),
            device=device, dtype=dtype,
        )
        cache_last_time = torch.zeros(
            (len(self.layers), batch_size, self.d_model, last_time_cache_size), device=device, dtype=dtype
        )
        cache_last_channel_len = torch.zeros(batch_size, device=device, dtype=torch.int64)
        return cache_last_channel, cache_last_time, cache_last_channel_len

    def forward(self, audio_signal, length, cache_last_channel=None, cache_last_time=None,
                cache_last_channel_len=None):
        return self.forward_internal(audio_signal, length, cache_last_channel=cache_last_channel,
                                     cache_last_time=cache_last_time, cache_last_channel_len=cache_last_channel_len)

    def forward_internal(self, audio_signal, length, cache_last_channel=None, cache_last_time=None,
                         cache_last_channel_len=None):
        self.update_max_seq_length(seq_length=audio_signal.size(2), device=audio_signal.device)

        if length is None:
            length = audio_signal.new_full(
                (audio_signal.size(0),), audio_signal.size(-1), dtype=torch.int64, device=audio_signal.device
            )

        if self.training and len(self.att_context_size_all) > 1:
            cur_att_context_size = random.choices(self.att_context_size_all, weights=self.att_context_probs)[0]
        else:
            cur_att_context_size = self.att_context_size

        audio_signal = torch.transpose(audio_signal, 1, 2)

        if isinstance(self.pre_encode, nn.Linear):
            audio_signal = self.pre_encode(audio_signal)

        max_audio_length = audio_signal.size(1)
        if cache_last_channel is not None:
            cache_len = self.streaming_cfg.last_channel_cache_size
            cache_keep_size = max_audio_length - self.streaming_cfg.cache_drop_size
            max_audio_length = max_audio_length + cache_len
            padding_length = length + cache_len
            offset = torch.neg(cache_last_channel_len) + cache_len
        else:
            padding_length = length
            cache_last_channel_next = None
            cache_len = 0
            offset = None

        audio_signal, pos_emb = self.pos_enc(x=audio_signal, cache_len=cache_len)

        # Create the self-attention and padding masks
        pad_mask, att_mask = self._create_masks(
            att_context_size=cur_att_context_size,
            padding_length=padding_length,
            max_audio_length=max_audio_length,
            offset=offset,
            device=audio_signal.device,
        )

        if cache_last_channel is not None:
            pad_mask = pad_mask[:, cache_len:]
            if att_mask is not None:
                att_mask = att_mask[:, cache_len:]
            cache_last_time_next = []
            cache_last_channel_next = []

        for lth, (drop_prob, layer) in enumerate(zip(self.layer_drop_probs, self.layers)):
            if cache_last_channel is not None:
                cache_last_channel_cur = cache_last_channel[lth]
                cache_last_time_cur = cache_last_time[lth]
            else:
                cache_last_channel_cur = None
                cache_last_time_cur = None
            audio_signal = layer(
                x=audio_signal,
                att_mask=att_mask,
                pos_emb=pos_emb,
                pad_mask=pad_mask,
                cache_last_channel=cache_last_channel_cur,
                cache_last_time=cache_last_time_cur,
            )
            if cache_last_channel_cur is not None:
                (audio_signal, cache_last_channel_cur, cache_last_time_cur) = audio_signal
                cache_last_channel_next.append(cache_last_channel_cur)
                cache_last_time_next.append(cache_last_time_cur)

        audio_signal = torch.transpose(audio_signal, 1, 2)
        length = length.to(dtype=torch.int64)

        if cache_last_channel is not None:
            cache_last_channel_next = torch.stack(cache_last_channel_next, dim=0)
            cache_last_time_next = torch.stack(cache_last_time_next, dim=0)
            return (
                audio_signal,
                length,
                cache_last_channel_next,
                cache_last_time_next,
                torch.clamp(cache_last_channel_len + cache_keep_size, max=cache_len),
            )
        else:
            return audio_signal, length

    def _create_masks(self, att_context_size, padding_length, max_audio_length, offset, device):
        if self.self_attention_model != "rel_pos_local_attn":
            att_mask = torch.ones(1, max_audio_length, max_audio_length, dtype=torch.bool, device=device)

            if self.att_context_style == "regular":
                if att_context_size[0] >= 0:
                    att_mask = att_mask.triu(diagonal=-att_context_size[0])
                if att_context_size[1] >= 0:
                    att_mask = att_mask.tril(diagonal=att_context_size[1])
            elif self.att_context_style == "chunked_limited":
                if att_context_size[1] == -1:
                    if att_context_size[0] >= 0:
                        att_mask = att_mask.triu(diagonal=-att_context_size[0])
                else:
                    chunk_size = att_context_size[1] + 1
                    # left_chunks_num specifies the number of chunks to be visible by each chunk on the left side
                    if att_context_size[0] >= 0:
                        left_chunks_num = att_context_size[0] // chunk_size
                    else:
                        left_chunks_num = 10000

                    chunk_idx = torch.arange(0, max_audio_length, dtype=torch.int, device=att_mask.device)
                    chunk_idx = torch.div(chunk_idx, chunk_size, rounding_mode="trunc")
                    diff_chunks = chunk_idx.unsqueeze(1) - chunk_idx.unsqueeze(0)
                    chunked_limited_mask = torch.logical_and(
                        torch.le(diff_chunks, left_chunks_num), torch.ge(diff_chunks, 0)
                    )
                    att_mask = torch.logical_and(att_mask, chunked_limited_mask.unsqueeze(0))
        else:
            att_mask = None

        # pad_mask is the masking to be used to ignore paddings
        pad_mask = torch.arange(0, max_audio_length, device=device).expand(
            padding_length.size(0), -1
        ) < padding_length.unsqueeze(-1)

        if offset is not None:
            pad_mask_off = torch.arange(0, max_audio_length, device=device).expand(
                padding_length.size(0), -1
            ) >= offset.unsqueeze(-1)
            pad_mask = pad_mask_off.logical_and(pad_mask)

        if att_mask is not None:
            pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, max_audio_length, 1])
            pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask, pad_mask_for_att_mask.transpose(1, 2))
            att_mask = att_mask[:, :max_audio_length, :max_audio_length]
            att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask.to(pad_mask_for_att_mask.device))
            att_mask = ~att_mask

        pad_mask = ~pad_mask
        return pad_mask, att_mask


def stream(encoder, processed_signal, processed_signal_length):
    """Feeds the (B, F, T) features chunk by chunk, as the streaming buffer does with a Linear front end."""
    batch_size = processed_signal.size(0)
    cache_last_channel, cache_last_time, cache_last_channel_len = encoder.get_initial_cache_state(batch_size)
    chunk = encoder.streaming_cfg.chunk_size
    shift = encoder.streaming_cfg.shift_size
    outputs = []
    step = 0
    while step * shift < processed_signal.size(-1):
        start = step * shift
        chunk_audio = processed_signal[:, :, start:start + chunk]
        chunk_lengths = torch.clamp(processed_signal_length - start, min=0, max=chunk_audio.size(-1))
        (encoded, encoded_len, cache_last_channel, cache_last_time, cache_last_channel_len) = encoder(
            audio_signal=chunk_audio,
            length=chunk_lengths,
            cache_last_channel=cache_last_channel,
            cache_last_time=cache_last_time,
            cache_last_channel_len=cache_last_channel_len,
        )
        outputs.append(encoded[:, :, : encoder.streaming_cfg.valid_out_len])
        step += 1
    return torch.cat(outputs, dim=-1)


def main():
    feat_in, d_model = 8, 32
    encoder = ConformerEncoder(feat_in=feat_in, n_layers=2, d_model=d_model, n_heads=4, att_context_size=[4, 1],
                               att_context_style="chunked_limited", pos_emb_max_len=64)
    encoder.eval()

    lengths = [11, 7]
    T = max(lengths)
    utts = [torch.randn(feat_in, n) for n in lengths]
    # the preprocessor's batch: (B, F, T), right-padded with zeros, lengths beside it
    processed_signal = torch.zeros(len(lengths), feat_in, T)
    for b, u in enumerate(utts):
        processed_signal[b, :, : u.size(1)] = u
    processed_signal_length = torch.tensor(lengths, dtype=torch.int64)

    with torch.no_grad():
        offline, offline_len = encoder(audio_signal=processed_signal, length=processed_signal_length)
        streamed = stream(encoder, processed_signal, processed_signal_length)
        alone = [encoder(audio_signal=u.unsqueeze(0), length=torch.tensor([u.size(1)]))[0][0] for u in utts]
        alone_streamed = [stream(encoder, u.unsqueeze(0), torch.tensor([u.size(1)]))[0] for u in utts]

    for b, n in enumerate(lengths):
        assert torch.allclose(offline[b, :, :n], alone[b], atol=1e-5), b
        assert torch.allclose(streamed[b, :, :n], offline[b, :, :n], atol=1e-5), (b, (streamed[b, :, :n] - offline[b, :, :n]).abs().max())
        assert torch.allclose(alone_streamed[b][:, :n], alone[b], atol=1e-5), b
    assert offline_len.tolist() == lengths

    # the same encoder with unlimited context must differ: the chunked_limited context is in force
    full = ConformerEncoder(feat_in=feat_in, n_layers=2, d_model=d_model, n_heads=4, att_context_size=[-1, -1],
                            att_context_style="regular", pos_emb_max_len=64)
    full.load_state_dict(encoder.state_dict())
    full.eval()
    with torch.no_grad():
        unlimited = full(audio_signal=utts[0].unsqueeze(0), length=torch.tensor([lengths[0]]))[0][0]
    assert not torch.allclose(unlimited, alone[0], atol=1e-3)
    print("streamed == offline == per utterance at every real frame;",
          "max diff", float(max((streamed[b, :, :n] - alone[b]).abs().max() for b, n in enumerate(lengths))))


if __name__ == "__main__":
    main()
