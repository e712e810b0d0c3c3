# wenet-e2e/wenet#2520 (commit bd22fae2, "[mask] set max_chunk_size according to subsample rate").
# Bug: BaseEncoder.forward -> add_optional_chunk_mask drew the dynamic-chunk training chunk as
# `chunk_size % 25 + 1` whatever the front end: 25 frames is 1 s only after 4x subsampling. With a
# Conv2dSubsampling8 encoder a chunk reaches 25 * 8 = 200 input frames, so training frames see up to 2 s of
# future audio inside their chunk, twice the delay the streaming model is decoded with.
# Fix: add_optional_chunk_mask takes `max_chunk_size`, and BaseEncoder passes
# `int(100.0 / self.embed.subsampling_rate)` (12 for 8x subsampling).
import math
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def make_pad_mask(lengths, max_len=0):
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    return seq_range_expand >= lengths.unsqueeze(-1)


def subsequent_chunk_mask(size, chunk_size, num_left_chunks=-1, device=torch.device("cpu")):
    ret = torch.zeros(size, size, device=device, dtype=torch.bool)
    for i in range(size):
        if num_left_chunks < 0:
            start = 0
        else:
            start = max((i // chunk_size - num_left_chunks) * chunk_size, 0)
        ending = min((i // chunk_size + 1) * chunk_size, size)
        ret[i, start:ending] = True
    return ret


def add_optional_chunk_mask(xs, masks, use_dynamic_chunk, use_dynamic_left_chunk, decoding_chunk_size,
                            static_chunk_size, num_decoding_left_chunks, enable_full_context=True,
                            max_chunk_size=25):
    if use_dynamic_chunk:
        max_len = xs.size(1)
        if decoding_chunk_size < 0:
            chunk_size, num_left_chunks = max_len, -1
        elif decoding_chunk_size > 0:
            chunk_size, num_left_chunks = decoding_chunk_size, num_decoding_left_chunks
        else:
            # chunk size is either [1, max_chunk_size] or full context(max_len).
            chunk_size = torch.randint(1, max_len, (1, )).item()
            num_left_chunks = -1
            if chunk_size > max_len // 2 and enable_full_context:
                chunk_size = max_len
            else:
                chunk_size = chunk_size % max_chunk_size + 1
                if use_dynamic_left_chunk:
                    max_left_chunks = (max_len - 1) // chunk_size
                    num_left_chunks = torch.randint(0, max_left_chunks, (1, )).item()
        chunk_masks = subsequent_chunk_mask(xs.size(1), chunk_size, num_left_chunks, xs.device)
        chunk_masks = masks & chunk_masks.unsqueeze(0)  # (B, L, L)
    elif static_chunk_size > 0:
        chunk_masks = subsequent_chunk_mask(xs.size(1), static_chunk_size, num_decoding_left_chunks, xs.device)
        chunk_masks = masks & chunk_masks.unsqueeze(0)
    else:
        chunk_masks = masks
    return chunk_masks


class PositionalEncoding(torch.nn.Module):
    def __init__(self, d_model, dropout_rate, max_len=5000):
        super().__init__()
        self.xscale = math.sqrt(d_model)
        self.dropout = torch.nn.Dropout(p=dropout_rate)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x, offset=0):
        pos_emb = self.pe[:, offset:offset + x.size(1)]
        return self.dropout(x * self.xscale + pos_emb), self.dropout(pos_emb)


class Conv2dSubsampling8(torch.nn.Module):
    def __init__(self, idim, odim, dropout_rate, pos_enc_class):
        super().__init__()
        self.conv = torch.nn.Sequential(
            torch.nn.Conv2d(1, odim, 3, 2), torch.nn.ReLU(),
            torch.nn.Conv2d(odim, odim, 3, 2), torch.nn.ReLU(),
            torch.nn.Conv2d(odim, odim, 3, 2), torch.nn.ReLU(),
        )
        self.linear = torch.nn.Linear(odim * ((((idim - 1) // 2 - 1) // 2 - 1) // 2), odim)
        self.pos_enc = pos_enc_class
        self.subsampling_rate = 8
        self.right_context = 14

    def forward(self, x, x_mask, offset=0):
        x = self.conv(x.unsqueeze(1))
        b, c, t, f = x.size()
        x = self.linear(x.transpose(1, 2).contiguous().view(b, t, c * f))
        x, pos_emb = self.pos_enc(x, offset)
        return x, pos_emb, x_mask[:, :, 2::2][:, :, 2::2][:, :, 2::2]


class MultiHeadedAttention(torch.nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        self.d_k, self.h = n_feat // n_head, n_head
        self.linear_q = torch.nn.Linear(n_feat, n_feat)
        self.linear_k = torch.nn.Linear(n_feat, n_feat)
        self.linear_v = torch.nn.Linear(n_feat, n_feat)
        self.linear_out = torch.nn.Linear(n_feat, n_feat)
        self.dropout = torch.nn.Dropout(p=dropout_rate)

    def forward(self, query, key, value, mask):
        b = query.size(0)
        q = self.linear_q(query).view(b, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(b, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(b, -1, self.h, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        mask = mask.unsqueeze(-3).eq(0)  # (batch, 1, time1, time2)
        mask = mask[..., :scores.size(-1)]
        scores = scores.masked_fill(mask, -float('inf'))
        attn = torch.softmax(scores.float(), dim=-1).type_as(v).masked_fill(mask, 0.0)
        x = torch.matmul(self.dropout(attn), v).transpose(1, 2).contiguous().view(b, -1, self.h * self.d_k)
        return self.linear_out(x)


class TransformerEncoderLayer(torch.nn.Module):
    def __init__(self, size, n_head, linear_units, dropout_rate):
        super().__init__()
        self.self_attn = MultiHeadedAttention(n_head, size, dropout_rate)
        self.feed_forward = torch.nn.Sequential(
            torch.nn.Linear(size, linear_units), torch.nn.ReLU(), torch.nn.Linear(linear_units, size))
        self.norm1, self.norm2 = torch.nn.LayerNorm(size, eps=1e-5), torch.nn.LayerNorm(size, eps=1e-5)
        self.dropout = torch.nn.Dropout(dropout_rate)

    def forward(self, x, mask, pos_emb, mask_pad):
        x = x + self.dropout(self.self_attn(self.norm1(x), self.norm1(x), self.norm1(x), mask))
        x = x + self.dropout(self.feed_forward(self.norm2(x)))
        return x, mask, None, None


class TransformerEncoder(torch.nn.Module):
    def __init__(self, input_size, output_size=32, attention_heads=4, linear_units=64, num_blocks=2,
                 dropout_rate=0.0, input_layer="conv2d8", static_chunk_size=0, use_dynamic_chunk=False,
                 use_dynamic_left_chunk=False):
        super().__init__()
        assert input_layer == "conv2d8"
        self.embed = Conv2dSubsampling8(input_size, output_size, dropout_rate,
                                        PositionalEncoding(output_size, dropout_rate))
        self.encoders = torch.nn.ModuleList(
            [TransformerEncoderLayer(output_size, attention_heads, linear_units, dropout_rate)
             for _ in range(num_blocks)])
        self.after_norm = torch.nn.LayerNorm(output_size, eps=1e-5)
        self.static_chunk_size = static_chunk_size
        self.use_dynamic_chunk = use_dynamic_chunk
        self.use_dynamic_left_chunk = use_dynamic_left_chunk

    def forward(self, xs, xs_lens, decoding_chunk_size=0, num_decoding_left_chunks=-1):
        T = xs.size(1)
        masks = ~make_pad_mask(xs_lens, T).unsqueeze(1)  # (B, 1, T)
        xs, pos_emb, masks = self.embed(xs, masks)
        mask_pad = masks  # (B, 1, T/subsample_rate)
        if FIXED:
            # Since we allow up to 1s(100 frames) delay, the maximum chunk_size is 100 / 4 = 25.
            chunk_masks = add_optional_chunk_mask(
                xs, masks, self.use_dynamic_chunk, self.use_dynamic_left_chunk, decoding_chunk_size,
                self.static_chunk_size, num_decoding_left_chunks,
                max_chunk_size=int(100.0 / self.embed.subsampling_rate))
        else:
            chunk_masks = add_optional_chunk_mask(xs, masks, self.use_dynamic_chunk, self.use_dynamic_left_chunk,
                                                  decoding_chunk_size, self.static_chunk_size,
                                                  num_decoding_left_chunks)
        for layer in self.encoders:
            xs, chunk_masks, _, _ = layer(xs, chunk_masks, pos_emb, mask_pad)
        return self.after_norm(xs), masks, chunk_masks


configs = {"input_dim": 80, "encoder_conf": {
    "output_size": 32, "attention_heads": 4, "linear_units": 64, "num_blocks": 2, "dropout_rate": 0.0,
    "input_layer": "conv2d8", "use_dynamic_chunk": True, "use_dynamic_left_chunk": False}}
encoder = TransformerEncoder(configs["input_dim"], **configs["encoder_conf"])
encoder.train()

# a training batch of fbank features: 5.0 s and 3.6 s utterances (10 ms frames)
xs_lens = torch.tensor([500, 360])
xs = torch.randn(2, 500, configs["input_dim"])
torch.manual_seed(7)  # the dynamic chunk draw of this step
encoder_out, encoder_mask, chunk_masks = encoder(xs, xs_lens)
chunk = int(chunk_masks[0, 0].sum())
print("subsampled frames:", encoder_out.size(1), "chunk (frames):", chunk,
      "=", chunk * encoder.embed.subsampling_rate * 10, "ms of audio")
print("first frame output:", [round(v, 4) for v in encoder_out[0, 0, :4].tolist()])
