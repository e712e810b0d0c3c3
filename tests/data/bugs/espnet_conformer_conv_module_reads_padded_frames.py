"""ESPnet Conformer encoder: the convolution module never gets the encoder's non-padding mask.

Citation: espnet/espnet#6660 ("Keep the encoder's time convolutions from reading padded frames",
merged; stacked on #6633, tracking issue #6600). Code from
espnet/nets/pytorch_backend/conformer/convolution.py (ConvolutionModule) and
espnet/nets/pytorch_backend/conformer/encoder_layer.py (EncoderLayer), before and after the fix.

The bug: ``EncoderLayer.forward(x_input, mask)`` holds the (#batch, 1, time) non-padding mask and
hands it to self-attention, but calls ``self.conv_module(x)`` with no mask. Inside the module the
pointwise conv + GLU put their biases into the padded frames, so the depthwise convolution
(kernel 15 'SAME') pulls those padded activations into the last real frames of every shorter
utterance in a right-padded batch; attention then spreads them over the whole utterance. An
utterance encodes differently next to a longer one than alone.

The fix: the layer passes its mask down (``mask_pad``) and ``ConvolutionModule.forward`` calls
``mask_padded_frames(x, mask_pad)`` (``x.masked_fill(mask_pad.eq(0), 0.0)``) right before the
depthwise convolution.

Kept as ESPnet writes it: espnet2-style ConformerEncoder forward (``masks =
(~make_pad_mask(ilens)[:, None, :])``, ``olens = masks.squeeze(1).sum(1)``), macaron FFN,
legacy MultiHeadedAttention with ``forward_attention`` (masked_fill with dtype min, then 0.0 on
the attention weights), abs positional encoding, Linear input layer, BatchNorm in the conv
module, a CTC projection with greedy decoding. Tiny sizes, random weights, eval mode.
"""

import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- nets_utils
def make_pad_mask(lengths, maxlen=None):
    if maxlen is None:
        maxlen = int(max(lengths))
    bs = int(len(lengths))
    seq_range = torch.arange(0, maxlen, dtype=torch.int64)
    seq_range_expand = seq_range.unsqueeze(0).expand(bs, maxlen)
    seq_length_expand = seq_range_expand.new(lengths).unsqueeze(-1)
    return seq_range_expand >= seq_length_expand


# ---------------------------------------------------------------- transformer/embedding.py
class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout_rate, max_len=5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        self.pe = None
        self.extend_pe(torch.tensor(0.0).expand(1, max_len))

    def extend_pe(self, x):
        if self.pe is not None and self.pe.size(1) >= x.size(1):
            return
        pe = torch.zeros(x.size(1), self.d_model)
        position = torch.arange(0, x.size(1), dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(
            torch.arange(0, self.d_model, 2, dtype=torch.float32)
            * -(math.log(10000.0) / self.d_model)
        )
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        self.extend_pe(x)
        x = x * self.xscale + self.pe[:, : x.size(1)]
        return self.dropout(x)


# ---------------------------------------------------------------- transformer/attention.py
class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)

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


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate, activation=nn.ReLU()):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)
        self.dropout = nn.Dropout(dropout_rate)
        self.activation = activation

    def forward(self, x):
        return self.w_2(self.dropout(self.activation(self.w_1(x))))


# ---------------------------------------------------------------- conformer/convolution.py
def mask_padded_frames(x, mask_pad):
    """Zero the padded time steps of `x` (#batch, channels, time)."""
    if (
        mask_pad is None
        or mask_pad.dim() != 3
        or mask_pad.size(1) != 1
        or mask_pad.size(-1) != x.size(-1)
    ):
        return x
    return x.masked_fill(mask_pad.eq(0), 0.0)


class ConvolutionModule(nn.Module):
    def __init__(self, channels, kernel_size, activation=nn.ReLU(), bias=True):
        super().__init__()
        assert (kernel_size - 1) % 2 == 0
        self.pointwise_conv1 = nn.Conv1d(
            channels, 2 * channels, kernel_size=1, stride=1, padding=0, bias=bias
        )
        self.depthwise_conv = nn.Conv1d(
            channels,
            channels,
            kernel_size,
            stride=1,
            padding=(kernel_size - 1) // 2,
            groups=channels,
            bias=bias,
        )
        self.norm = nn.BatchNorm1d(channels)
        self.pointwise_conv2 = nn.Conv1d(
            channels, channels, kernel_size=1, stride=1, padding=0, bias=bias
        )
        self.activation = activation

    def forward(self, x, mask_pad=None):
        # exchange the temporal dimension and the feature dimension
        x = x.transpose(1, 2)

        # GLU mechanism
        x = self.pointwise_conv1(x)  # (batch, 2*channel, dim)
        x = nn.functional.glu(x, dim=1)  # (batch, channel, dim)

        # 1D Depthwise Conv
        if FIXED:
            x = mask_padded_frames(x, mask_pad)
        x = self.depthwise_conv(x)
        x = self.activation(self.norm(x))

        x = self.pointwise_conv2(x)

        return x.transpose(1, 2)


# ---------------------------------------------------------------- conformer/encoder_layer.py
class EncoderLayer(nn.Module):
    def __init__(
        self,
        size,
        self_attn,
        feed_forward,
        feed_forward_macaron,
        conv_module,
        dropout_rate,
        normalize_before=True,
        concat_after=False,
    ):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.feed_forward_macaron = feed_forward_macaron
        self.conv_module = conv_module
        self.norm_ff = nn.LayerNorm(size, eps=1e-12)
        self.norm_mha = nn.LayerNorm(size, eps=1e-12)
        if feed_forward_macaron is not None:
            self.norm_ff_macaron = nn.LayerNorm(size, eps=1e-12)
            self.ff_scale = 0.5
        else:
            self.ff_scale = 1.0
        if self.conv_module is not None:
            self.norm_conv = nn.LayerNorm(size, eps=1e-12)
            self.norm_final = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before
        self.concat_after = concat_after

    def forward(self, x_input, mask, cache=None):
        if isinstance(x_input, tuple):
            x, pos_emb = x_input[0], x_input[1]
        else:
            x, pos_emb = x_input, None

        # whether to use macaron style
        if self.feed_forward_macaron is not None:
            residual = x
            if self.normalize_before:
                x = self.norm_ff_macaron(x)
            x = residual + self.ff_scale * self.dropout(self.feed_forward_macaron(x))
            if not self.normalize_before:
                x = self.norm_ff_macaron(x)

        # multi-headed self-attention module
        residual = x
        if self.normalize_before:
            x = self.norm_mha(x)

        if cache is None:
            x_q = x
        else:
            x_q = x[:, -1:, :]
            residual = residual[:, -1:, :]
            mask = None if mask is None else mask[:, -1:, :]

        x_att = self.self_attn(x_q, x, x, mask)
        x = residual + self.dropout(x_att)
        if not self.normalize_before:
            x = self.norm_mha(x)

        # convolution module
        if self.conv_module is not None:
            residual = x
            if self.normalize_before:
                x = self.norm_conv(x)
            if FIXED:
                x = residual + self.dropout(self.conv_module(x, mask_pad=mask))
            else:
                x = residual + self.dropout(self.conv_module(x))
            if not self.normalize_before:
                x = self.norm_conv(x)

        # feed forward module
        residual = x
        if self.normalize_before:
            x = self.norm_ff(x)
        x = residual + self.ff_scale * self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm_ff(x)

        if self.conv_module is not None:
            x = self.norm_final(x)

        if cache is not None:
            x = torch.cat([cache, x], dim=1)

        return x, mask


# ---------------------------------------------------------------- espnet2 ConformerEncoder
class ConformerEncoder(nn.Module):
    def __init__(
        self,
        input_size,
        output_size=32,
        attention_heads=4,
        linear_units=64,
        num_blocks=2,
        dropout_rate=0.1,
        positional_dropout_rate=0.1,
        attention_dropout_rate=0.0,
        normalize_before=True,
        macaron_style=True,
        use_cnn_module=True,
        cnn_module_kernel=15,
    ):
        super().__init__()
        self._output_size = output_size
        # input_layer == "linear"
        self.embed = nn.Sequential(
            nn.Linear(input_size, output_size),
            nn.LayerNorm(output_size),
            nn.Dropout(dropout_rate),
            PositionalEncoding(output_size, positional_dropout_rate),
        )
        self.normalize_before = normalize_before
        self.encoders = nn.ModuleList(
            [
                EncoderLayer(
                    output_size,
                    MultiHeadedAttention(attention_heads, output_size, attention_dropout_rate),
                    PositionwiseFeedForward(output_size, linear_units, dropout_rate),
                    PositionwiseFeedForward(output_size, linear_units, dropout_rate)
                    if macaron_style
                    else None,
                    ConvolutionModule(output_size, cnn_module_kernel, nn.SiLU())
                    if use_cnn_module
                    else None,
                    dropout_rate,
                    normalize_before,
                )
                for _ in range(num_blocks)
            ]
        )
        if self.normalize_before:
            self.after_norm = nn.LayerNorm(output_size, eps=1e-12)

    def forward(self, xs_pad, ilens):
        masks = (~make_pad_mask(ilens)[:, None, :]).to(xs_pad.device)
        xs_pad = self.embed(xs_pad)
        for layer in self.encoders:
            xs_pad, masks = layer(xs_pad, masks)
        if self.normalize_before:
            xs_pad = self.after_norm(xs_pad)
        olens = masks.squeeze(1).sum(1)
        return xs_pad, olens, None


def main():
    torch.manual_seed(0)
    feat_dim, vocab = 20, 12
    encoder = ConformerEncoder(feat_dim)
    ctc_lo = nn.Linear(encoder._output_size, vocab)
    # trained BatchNorm running statistics, not the init ones
    for layer in encoder.encoders:
        bn = layer.conv_module.norm
        bn.running_mean.normal_(0.0, 0.3)
        bn.running_var.uniform_(0.5, 1.5)
    encoder.eval()
    ctc_lo.eval()

    # two utterances of fbank-like features, right-padded to the longer one with zeros
    lengths = [40, 27]
    feats = [torch.randn(n, feat_dim) for n in lengths]
    xs_pad = torch.zeros(len(lengths), max(lengths), feat_dim)
    for i, f in enumerate(feats):
        xs_pad[i, : f.size(0)] = f
    ilens = torch.tensor(lengths)

    with torch.no_grad():
        enc, olens, _ = encoder(xs_pad, ilens)
        logp = torch.log_softmax(ctc_lo(enc), dim=-1)
        alone, _, _ = encoder(feats[1].unsqueeze(0), torch.tensor([lengths[1]]))

    print("olens:", olens.tolist())
    for i, n in enumerate(olens.tolist()):
        hyp = logp[i, :n].argmax(-1).tolist()
        print(f"utt{i} ctc greedy frames:", hyp)
    short = enc[1, : lengths[1]]
    print("utt1 encoder out, last real frame [:6]:", [round(v, 4) for v in short[-1, :6].tolist()])
    print("utt1 batched vs alone, max abs diff: %.3e" % (short - alone[0]).abs().max().item())
    print("utt1 ctc logp sum: %.4f" % logp[1, : lengths[1]].max(-1).values.sum().item())


if __name__ == "__main__":
    main()
