# wenet-e2e/wenet#413 (commit 88f3df6d, "debug relate to issue #388"): simulated streaming decoding
# (recognize.py --simulate_streaming, BaseEncoder.forward_chunk_by_chunk -> forward_chunk) with a limited
# left context (num_decoding_left_chunks) keeps required_cache_size = chunk * left_chunks frames of
# subsampling output and per-layer output as the cache for the next chunk:
#     next_cache_start = xs.size(1) - required_cache_size
# While the cache plus the new chunk is still shorter than required_cache_size this is negative, and
# xs[:, next_cache_start:] keeps only the last |next_cache_start| frames instead of all of them, so
# later chunks attend to a left context cut short. The fix clamps it:
#     next_cache_start = max(xs.size(1) - required_cache_size, 0)
# Ported from wenet/transformer/{encoder,encoder_layer,attention,embedding,subsampling}.py @88f3df6d^
# (TransformerEncoder, input_layer "linear", abs_pos), with a CTC head and greedy search as asr_model does.
import math
import sys
from typing import List, Optional, Tuple

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class PositionalEncoding(torch.nn.Module):
    def __init__(self, d_model: int, dropout_rate: float, max_len: int = 5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = torch.nn.Dropout(p=dropout_rate)
        self.max_len = max_len
        self.pe = torch.zeros(self.max_len, self.d_model)
        position = torch.arange(0, self.max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32) *
            -(math.log(10000.0) / self.d_model))
        self.pe[:, 0::2] = torch.sin(position * div_term)
        self.pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = self.pe.unsqueeze(0)

    def forward(self, x: torch.Tensor, offset: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
        assert offset + x.size(1) < self.max_len
        self.pe = self.pe.to(x.device)
        pos_emb = self.pe[:, offset:offset + x.size(1)]
        x = x * self.xscale + pos_emb
        return self.dropout(x), self.dropout(pos_emb)

    def position_encoding(self, offset: int, size: int) -> torch.Tensor:
        assert offset + size < self.max_len
        return self.dropout(self.pe[:, offset:offset + size])


class LinearNoSubsampling(torch.nn.Module):
    def __init__(self, idim: int, odim: int, dropout_rate: float, pos_enc_class: torch.nn.Module):
        super().__init__()
        self.out = torch.nn.Sequential(
            torch.nn.Linear(idim, odim),
            torch.nn.LayerNorm(odim, eps=1e-12),
            torch.nn.Dropout(dropout_rate),
        )
        self.pos_enc = pos_enc_class
        self.right_context = 0
        self.subsampling_rate = 1

    def position_encoding(self, offset: int, size: int) -> torch.Tensor:
        return self.pos_enc.position_encoding(offset, size)

    def forward(self, x, x_mask, offset: int = 0):
        x = self.out(x)
        x, pos_emb = self.pos_enc(x, offset)
        return x, pos_emb, x_mask


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head: int, n_feat: int, dropout_rate: float):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        q = q.transpose(1, 2)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask: Optional[torch.Tensor]):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            scores = scores.masked_fill(mask, -float('inf'))
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(attn)
        x = torch.matmul(p_attn, value)
        x = (x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k))
        return self.linear_out(x)

    def forward(self, query, key, value, mask: Optional[torch.Tensor]):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(torch.nn.Module):
    def __init__(self, idim: int, hidden_units: int, dropout_rate: float):
        super().__init__()
        self.w_1 = torch.nn.Linear(idim, hidden_units)
        self.activation = torch.nn.ReLU()
        self.dropout = torch.nn.Dropout(dropout_rate)
        self.w_2 = torch.nn.Linear(hidden_units, idim)

    def forward(self, xs):
        return self.w_2(self.dropout(self.activation(self.w_1(xs))))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True,
                 concat_after=False):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before
        self.concat_after = concat_after
        self.concat_linear = nn.Linear(size + size, size)

    def forward(self, x, mask, pos_emb, mask_pad=None, output_cache=None, cnn_cache=None):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)

        if output_cache is None:
            x_q = x
        else:
            assert output_cache.size(0) == x.size(0)
            assert output_cache.size(2) == self.size
            assert output_cache.size(1) < x.size(1)
            chunk = x.size(1) - output_cache.size(1)
            x_q = x[:, -chunk:, :]
            residual = residual[:, -chunk:, :]
            mask = mask[:, -chunk:, :]

        if self.concat_after:
            x_concat = torch.cat((x, self.self_attn(x_q, x, x, mask)), dim=-1)
            x = residual + self.concat_linear(x_concat)
        else:
            x = residual + self.dropout(self.self_attn(x_q, x, x, mask))
        if not self.normalize_before:
            x = self.norm1(x)

        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm2(x)

        if output_cache is not None:
            x = torch.cat([output_cache, x], dim=1)

        fake_cnn_cache = torch.tensor([0.0], dtype=x.dtype, device=x.device)
        return x, mask, fake_cnn_cache


class TransformerEncoder(torch.nn.Module):
    def __init__(self, input_size, output_size=256, attention_heads=4, linear_units=2048,
                 num_blocks=6, dropout_rate=0.1, positional_dropout_rate=0.1,
                 attention_dropout_rate=0.0, normalize_before=True, concat_after=False,
                 static_chunk_size=0, use_dynamic_chunk=False, use_dynamic_left_chunk=False):
        super().__init__()
        self._output_size = output_size
        self.global_cmvn = None
        self.embed = LinearNoSubsampling(input_size, output_size, dropout_rate,
                                         PositionalEncoding(output_size, positional_dropout_rate))
        self.normalize_before = normalize_before
        self.after_norm = torch.nn.LayerNorm(output_size, eps=1e-12)
        self.static_chunk_size = static_chunk_size
        self.use_dynamic_chunk = use_dynamic_chunk
        self.use_dynamic_left_chunk = use_dynamic_left_chunk
        self.encoders = torch.nn.ModuleList([
            TransformerEncoderLayer(
                output_size,
                MultiHeadedAttention(attention_heads, output_size, attention_dropout_rate),
                PositionwiseFeedForward(output_size, linear_units, dropout_rate), dropout_rate,
                normalize_before, concat_after) for _ in range(num_blocks)
        ])

    def output_size(self) -> int:
        return self._output_size

    def forward_chunk(
        self,
        xs: torch.Tensor,
        offset: int,
        required_cache_size: int,
        subsampling_cache: Optional[torch.Tensor] = None,
        elayers_output_cache: Optional[List[torch.Tensor]] = None,
        conformer_cnn_cache: Optional[List[torch.Tensor]] = None,
    ):
        assert xs.size(0) == 1
        # tmp_masks is just for interface compatibility
        tmp_masks = torch.ones(1, xs.size(1), device=xs.device, dtype=torch.bool)
        tmp_masks = tmp_masks.unsqueeze(1)
        if self.global_cmvn is not None:
            xs = self.global_cmvn(xs)
        xs, pos_emb, _ = self.embed(xs, tmp_masks, offset)
        if subsampling_cache is not None:
            cache_size = subsampling_cache.size(1)
            xs = torch.cat((subsampling_cache, xs), dim=1)
        else:
            cache_size = 0
        pos_emb = self.embed.position_encoding(offset - cache_size, xs.size(1))
        if required_cache_size < 0:
            next_cache_start = 0
        elif required_cache_size == 0:
            next_cache_start = xs.size(1)
        else:
            if FIXED:
                next_cache_start = max(xs.size(1) - required_cache_size, 0)
            else:
                next_cache_start = xs.size(1) - required_cache_size
        r_subsampling_cache = xs[:, next_cache_start:, :]
        # Real mask for transformer/conformer layers
        masks = torch.ones(1, xs.size(1), device=xs.device, dtype=torch.bool)
        masks = masks.unsqueeze(1)
        r_elayers_output_cache = []
        r_conformer_cnn_cache = []
        for i, layer in enumerate(self.encoders):
            if elayers_output_cache is None:
                attn_cache = None
            else:
                attn_cache = elayers_output_cache[i]
            if conformer_cnn_cache is None:
                cnn_cache = None
            else:
                cnn_cache = conformer_cnn_cache[i]
            xs, _, new_cnn_cache = layer(xs, masks, pos_emb, output_cache=attn_cache,
                                         cnn_cache=cnn_cache)
            r_elayers_output_cache.append(xs[:, next_cache_start:, :])
            r_conformer_cnn_cache.append(new_cnn_cache)
        if self.normalize_before:
            xs = self.after_norm(xs)

        return (xs[:, cache_size:, :], r_subsampling_cache,
                r_elayers_output_cache, r_conformer_cnn_cache)

    def forward_chunk_by_chunk(self, xs: torch.Tensor, decoding_chunk_size: int,
                               num_decoding_left_chunks: int = -1):
        assert decoding_chunk_size > 0
        # The model is trained by static or dynamic chunk
        assert self.static_chunk_size > 0 or self.use_dynamic_chunk
        subsampling = self.embed.subsampling_rate
        context = self.embed.right_context + 1  # Add current frame
        stride = subsampling * decoding_chunk_size
        decoding_window = (decoding_chunk_size - 1) * subsampling + context
        num_frames = xs.size(1)
        subsampling_cache: Optional[torch.Tensor] = None
        elayers_output_cache: Optional[List[torch.Tensor]] = None
        conformer_cnn_cache: Optional[List[torch.Tensor]] = None
        outputs = []
        offset = 0
        required_cache_size = decoding_chunk_size * num_decoding_left_chunks

        # Feed forward overlap input step by step
        for cur in range(0, num_frames - context + 1, stride):
            end = min(cur + decoding_window, num_frames)
            chunk_xs = xs[:, cur:end, :]
            (y, subsampling_cache, elayers_output_cache,
             conformer_cnn_cache) = self.forward_chunk(chunk_xs, offset, required_cache_size,
                                                       subsampling_cache, elayers_output_cache,
                                                       conformer_cnn_cache)
            outputs.append(y)
            offset += y.size(1)
        ys = torch.cat(outputs, 1)
        masks = torch.ones(1, ys.size(1), device=ys.device, dtype=torch.bool)
        masks = masks.unsqueeze(1)
        return ys, masks


class CTC(torch.nn.Module):
    def __init__(self, odim: int, encoder_output_size: int):
        super().__init__()
        self.ctc_lo = torch.nn.Linear(encoder_output_size, odim)

    def log_softmax(self, hs_pad: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.log_softmax(self.ctc_lo(hs_pad), dim=2)


def remove_duplicates_and_blank(hyp: List[int]) -> List[int]:
    new_hyp: List[int] = []
    cur = 0
    while cur < len(hyp):
        if hyp[cur] != 0:
            new_hyp.append(hyp[cur])
        prev = cur
        while cur < len(hyp) and hyp[cur] == hyp[prev]:
            cur += 1
    return new_hyp


def ctc_greedy_search(encoder, ctc, speech, decoding_chunk_size, num_decoding_left_chunks):
    # asr_model._forward_encoder(..., simulate_streaming=True)
    encoder_out, encoder_mask = encoder.forward_chunk_by_chunk(
        speech, decoding_chunk_size=decoding_chunk_size,
        num_decoding_left_chunks=num_decoding_left_chunks)
    ctc_probs = ctc.log_softmax(encoder_out)  # (1, maxlen, vocab_size)
    topk_prob, topk_index = ctc_probs.topk(1, dim=2)
    hyp = topk_index.view(-1).tolist()
    return encoder_out, remove_duplicates_and_blank(hyp), topk_prob.sum().item()


def main():
    torch.manual_seed(0)
    idim, odim, vocab = 20, 32, 12
    encoder = TransformerEncoder(idim, output_size=odim, attention_heads=4, linear_units=64,
                                 num_blocks=2, static_chunk_size=4)
    ctc = CTC(vocab, odim)
    encoder.eval()
    ctc.eval()
    speech = torch.randn(1, 40, idim)  # fbank frames of one utterance
    with torch.no_grad():
        encoder_out, hyp, score = ctc_greedy_search(encoder, ctc, speech,
                                                    decoding_chunk_size=4,
                                                    num_decoding_left_chunks=4)
    print("encoder_out", tuple(encoder_out.shape), "sum %.4f" % encoder_out.sum().item())
    print("last chunk frame0[:4]", [round(v, 4) for v in encoder_out[0, -4, :4].tolist()])
    print("hyp", hyp, "score %.4f" % score)


if __name__ == "__main__":
    main()
