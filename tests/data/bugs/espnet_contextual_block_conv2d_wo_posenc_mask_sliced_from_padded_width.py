# espnet/espnet#6670: "fix(asr): rebuild Conv2dSubsamplingWOPosEnc mask from ilens"
# Conv2dSubsamplingWOPosEnc (the embed layer of ContextualBlockTransformerEncoder) shrank the pad mask by
# slicing the padded batch (`x_mask[:, :, :-k+1:s]` per conv), so a short utterance next to a long one kept
# key frames whose conv receptive field covers its padding (288 frames -> 72 kept instead of 71).
# The fix rebuilds the mask from each row's own length with the conv length formula (`_subsample_mask`).
import math
import sys

import torch

FIXED = "--fixed" in sys.argv


def make_pad_mask(lengths, maxlen=None):
    if maxlen is None:
        maxlen = int(lengths.max())
    seq_range = torch.arange(maxlen).unsqueeze(0).expand(len(lengths), maxlen)
    return seq_range >= lengths.unsqueeze(-1)


def _conv_out_length(length, kernel_size, stride, padding=0, dilation=1):
    """Time-axis output length of a convolution (PyTorch Conv1d/Conv2d formula)."""
    return (length + 2 * padding - dilation * (kernel_size - 1) - 1) // stride + 1


def _subsample_mask(x_mask, out_time, convs):
    """Rebuild the pad mask from each utterance's own input length."""
    if x_mask is None:
        return None
    olens = x_mask.squeeze(1).sum(dim=-1)
    for kernel_size, stride in convs:
        olens = _conv_out_length(olens, kernel_size, stride)
    olens = olens.clamp(min=0, max=out_time)
    frames = torch.arange(out_time, device=x_mask.device)
    mask = frames.unsqueeze(0) < olens.unsqueeze(1)
    return mask.to(dtype=x_mask.dtype).unsqueeze(1)


class Conv2dSubsamplingWOPosEnc(torch.nn.Module):
    """Convolutional 2D subsampling (espnet/nets/pytorch_backend/transformer/subsampling_without_posenc.py)."""

    def __init__(self, idim, odim, dropout_rate, kernels, strides):
        assert len(kernels) == len(strides)
        super().__init__()
        conv = []
        olen = idim
        for i, (k, s) in enumerate(zip(kernels, strides)):
            conv += [
                torch.nn.Conv2d(1 if i == 0 else odim, odim, k, s),
                torch.nn.ReLU(),
            ]
            olen = math.floor((olen - k) / s + 1)
        self.conv = torch.nn.Sequential(*conv)
        self.out = torch.nn.Linear(odim * olen, odim)
        self.strides = strides
        self.kernels = kernels

    def forward(self, x, x_mask):
        x = x.unsqueeze(1)  # (b, c, t, f)
        x = self.conv(x)
        b, c, t, f = x.size()
        x = self.out(x.transpose(1, 2).contiguous().view(b, t, c * f))
        if x_mask is None:
            return x, None
        if FIXED:
            x_mask = _subsample_mask(x_mask, t, zip(self.kernels, self.strides))
        else:
            for k, s in zip(self.kernels, self.strides):
                x_mask = x_mask[:, :, : -k + 1 : s]
        return x, x_mask


class StreamPositionalEncoding(torch.nn.Module):
    def __init__(self, d_model, dropout_rate, max_len=5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(d_model)
        self.dropout = torch.nn.Dropout(p=dropout_rate)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x, start_idx: int = 0):
        x = x * self.xscale + self.pe[:, start_idx : start_idx + x.size(1)]
        return self.dropout(x)


class MultiHeadedAttention(torch.nn.Module):
    """espnet/nets/pytorch_backend/transformer/attention.py"""

    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = torch.nn.Linear(n_feat, n_feat)
        self.linear_k = torch.nn.Linear(n_feat, n_feat)
        self.linear_v = torch.nn.Linear(n_feat, n_feat)
        self.linear_out = torch.nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = torch.nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)
        else:
            self.attn = torch.softmax(scores, dim=-1)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(torch.nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate):
        super().__init__()
        self.w_1 = torch.nn.Linear(idim, hidden_units)
        self.w_2 = torch.nn.Linear(hidden_units, idim)
        self.dropout = torch.nn.Dropout(dropout_rate)

    def forward(self, x):
        return self.w_2(self.dropout(torch.relu(self.w_1(x))))


class ContextualBlockEncoderLayer(torch.nn.Module):
    """Trimmed to the non-streaming path (block_size == 0: no context embeddings)."""

    def __init__(self, size, self_attn, feed_forward, dropout_rate, total_layer_num, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = torch.nn.LayerNorm(size)
        self.norm2 = torch.nn.LayerNorm(size)
        self.dropout = torch.nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before
        self.total_layer_num = total_layer_num

    def forward(self, x, mask, infer_mode=False, past_ctx=None, next_ctx=None, is_short_segment=False, layer_idx=0, cache=None):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = residual + self.dropout(self.self_attn(x, x, x, mask))
        if not self.normalize_before:
            x = self.norm1(x)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm2(x)
        return x, mask, infer_mode, past_ctx, next_ctx, is_short_segment, layer_idx + 1


class MultiSequential(torch.nn.Sequential):
    def forward(self, *args):
        for m in self:
            args = m(*args)
        return args


class ContextualBlockTransformerEncoder(torch.nn.Module):
    """espnet2/asr/encoder/contextual_block_transformer_encoder.py (forward_train, block_size=0 path)."""

    def __init__(self, input_size, output_size=16, attention_heads=2, linear_units=32, num_blocks=2,
                 dropout_rate=0.0, positional_dropout_rate=0.0, attention_dropout_rate=0.0,
                 input_layer="conv2d", normalize_before=True, block_size=0, hop_size=0, look_ahead=0):
        super().__init__()
        self._output_size = output_size
        self.pos_enc = StreamPositionalEncoding(output_size, positional_dropout_rate)
        if input_layer == "conv2d":
            self.embed = Conv2dSubsamplingWOPosEnc(input_size, output_size, dropout_rate, kernels=[3, 3], strides=[2, 2])
        elif input_layer == "conv2d6":
            self.embed = Conv2dSubsamplingWOPosEnc(input_size, output_size, dropout_rate, kernels=[3, 5], strides=[2, 3])
        elif input_layer == "conv2d8":
            self.embed = Conv2dSubsamplingWOPosEnc(input_size, output_size, dropout_rate, kernels=[3, 3, 3], strides=[2, 2, 2])
        else:
            raise ValueError(input_layer)
        self.normalize_before = normalize_before
        self.encoders = MultiSequential(*[
            ContextualBlockEncoderLayer(
                output_size,
                MultiHeadedAttention(attention_heads, output_size, attention_dropout_rate),
                PositionwiseFeedForward(output_size, linear_units, dropout_rate),
                dropout_rate, num_blocks, normalize_before,
            )
            for _ in range(num_blocks)
        ])
        if self.normalize_before:
            self.after_norm = torch.nn.LayerNorm(output_size)
        self.block_size = block_size
        self.hop_size = hop_size
        self.look_ahead = look_ahead

    def forward(self, xs_pad, ilens, prev_states=None):
        masks = (~make_pad_mask(ilens)[:, None, :]).to(xs_pad.device)
        if isinstance(self.embed, Conv2dSubsamplingWOPosEnc):
            xs_pad, masks = self.embed(xs_pad, masks)
        elif self.embed is not None:
            xs_pad = self.embed(xs_pad)
        total_frame_num = xs_pad.size(1)
        # block_size could be 0 meaning infinite; apply usual encoder for short sequence
        if self.block_size == 0 or total_frame_num <= self.block_size:
            xs_pad, masks, _, _, _, _, _ = self.encoders(self.pos_enc(xs_pad), masks, False, None, None)
            if self.normalize_before:
                xs_pad = self.after_norm(xs_pad)
            olens = masks.squeeze(1).sum(1)
            return xs_pad, olens, None
        raise NotImplementedError("blockwise path trimmed")


def main():
    torch.manual_seed(0)
    idim = 20
    encoder = ContextualBlockTransformerEncoder(idim, output_size=16, attention_heads=2, linear_units=32,
                                                num_blocks=2, input_layer="conv2d", block_size=0)
    ctc_head = torch.nn.Linear(16, 10)
    opt = torch.optim.SGD(list(encoder.parameters()) + list(ctc_head.parameters()), lr=0.01)

    # the lengths of espnet#6600 / #6633: a 288-frame utterance padded next to a 363-frame one
    ilens = torch.tensor([363, 288])
    xs_pad = torch.randn(2, int(ilens.max()), idim)
    xs_pad[1, 288:] = 0.0

    encoder.train()
    hs, olens, _ = encoder(xs_pad, ilens)
    logp = ctc_head(hs).log_softmax(-1).transpose(0, 1)
    ys = torch.randint(1, 10, (2, 12))
    loss = torch.nn.functional.ctc_loss(logp, ys, olens, torch.tensor([12, 12]), zero_infinity=True)
    opt.zero_grad()
    loss.backward()
    opt.step()

    attn = encoder.encoders[0].self_attn.attn  # (B, H, T', T')
    n_keys_row1 = int((attn[1, 0, 0] > 0).sum())
    print(f"olens={olens.tolist()} keys attended by utterance 1 (288 frames)={n_keys_row1} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
