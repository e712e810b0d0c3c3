"""Efficient Conformer CTC encoder, causal with a limited left context, over a right-padded batch of utterances.

Ported (shrunk) from burchim/EfficientConformer @612ef0b39c5df842b0bbbfe16943f271f1369e0a:
  models/attentions.py  MultiHeadAttention, RelPosMultiHeadSelfAttention (causal rel_to_abs),
                        RelativeSinusoidalPositionalEncoding, PaddingMask, StreamingMask
  models/modules.py     FeedForwardModule, MultiHeadSelfAttentionModule, ConvolutionModule
  models/blocks.py      ConformerBlock (conv_stride / att_res / conv_res, block stride)
  models/encoders.py    ConformerEncoder.forward (StreamingMask(left_context, right_context=0 if causal),
                        mask[:, :, ::stride, ::stride] and x_len = (x_len - 1) // stride + 1 after a strided block)
  models/layers.py      Linear, Conv1d ("causal" pre-padding), Transpose; models/losses.py LossCTC
The audio front end (mel + Conv2dSubsampling) is left out: the encoder is fed the subsampled features (B, D, T) and
their frame lengths, as ConformerEncoder.forward has them after `self.subsampling_module`.

The mask is float, 1 = masked, added to the scores as `mask * -1e9`: StreamingMask lets frame i see frames
i - left_context .. i (right_context 0, causal) that are not padding; after each strided block (depthwise conv of
stride 2) the mask is subsampled on both axes, so the left context shrinks to left_context // 2 frames, and so on.

Checked: the padded batch against each utterance run alone (unpadded), against a hand-written reference that
computes every query's attention over an explicit key list (j <= i, i - j <= left_context // stride, j < length)
with relative positions rebuilt from the sinusoid of i - j, and per-utterance CTC losses / greedy decodes.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F


# ----------------------------------------------------------------------------- models/activations.py
class Swish(nn.Module):
    def forward(self, x):
        return x * x.sigmoid()


class Glu(nn.Module):
    def __init__(self, dim):
        super(Glu, self).__init__()
        self.dim = dim

    def forward(self, x):
        x_in, x_gate = x.chunk(2, dim=self.dim)
        return x_in * x_gate.sigmoid()


# ----------------------------------------------------------------------------- models/layers.py
class Linear(nn.Linear):
    pass


class Conv1d(nn.Conv1d):
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding="same", dilation=1, groups=1, bias=True):
        super(Conv1d, self).__init__(in_channels=in_channels, out_channels=out_channels, kernel_size=kernel_size,
                                     stride=stride, padding=0, dilation=dilation, groups=groups, bias=bias,
                                     padding_mode="zeros")
        assert padding in ["valid", "same", "causal"]
        if padding == "valid":
            self.pre_padding = None
        elif padding == "same":
            self.pre_padding = nn.ConstantPad1d(padding=((kernel_size - 1) // 2, (kernel_size - 1) // 2), value=0)
        elif padding == "causal":
            self.pre_padding = nn.ConstantPad1d(padding=(kernel_size - 1, 0), value=0)

    def forward(self, input):
        if self.pre_padding is not None:
            input = self.pre_padding(input)
        return F.conv1d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Transpose(nn.Module):
    def __init__(self, dim0, dim1):
        super(Transpose, self).__init__()
        self.dim0 = dim0
        self.dim1 = dim1

    def forward(self, x):
        return x.transpose(self.dim0, self.dim1)


# ----------------------------------------------------------------------------- models/attentions.py
class MultiHeadAttention(nn.Module):
    def __init__(self, dim_model, num_heads):
        super(MultiHeadAttention, self).__init__()
        self.num_heads = num_heads
        self.dim_model = dim_model
        self.dim_head = dim_model // num_heads
        self.query_layer = Linear(self.dim_model, self.dim_model)
        self.key_layer = Linear(self.dim_model, self.dim_model)
        self.value_layer = Linear(self.dim_model, self.dim_model)
        self.output_layer = Linear(self.dim_model, self.dim_model)


class RelativeSinusoidalPositionalEncoding(nn.Module):
    def __init__(self, max_len, dim_model, causal=False):
        super(RelativeSinusoidalPositionalEncoding, self).__init__()
        pos_encoding = torch.zeros(2 * max_len - 1, dim_model)
        pos_left = torch.arange(start=max_len - 1, end=0, step=-1, dtype=torch.float)
        pos_right = torch.arange(start=0, end=-max_len, step=-1, dtype=torch.float)
        pos = torch.cat([pos_left, pos_right], dim=0).unsqueeze(1)
        angles = pos / 10000 ** (2 * torch.arange(0, dim_model // 2, dtype=torch.float).unsqueeze(0) / dim_model)
        pos_encoding[:, 0::2] = angles.sin()
        pos_encoding[:, 1::2] = angles.cos()
        pos_encoding = pos_encoding.unsqueeze(0)
        self.register_buffer('pos_encoding', pos_encoding, persistent=False)
        self.max_len = max_len
        self.causal = causal

    def forward(self, batch_size=1, seq_len=None, hidden_len=0):
        if self.causal:
            if seq_len is not None:
                R = self.pos_encoding[:, self.max_len - seq_len - hidden_len: self.max_len]
            else:
                R = self.pos_encoding[:, :self.max_len]
        else:
            if seq_len is not None:
                R = self.pos_encoding[:, self.max_len - seq_len - hidden_len: self.max_len - 1 + seq_len]
            else:
                R = self.pos_encoding
        return R.repeat(batch_size, 1, 1)


class RelPosMultiHeadSelfAttention(MultiHeadAttention):
    def __init__(self, dim_model, num_heads, causal, max_pos_encoding):
        super(RelPosMultiHeadSelfAttention, self).__init__(dim_model, num_heads)
        self.pos_layer = nn.Linear(self.dim_model, self.dim_model)
        self.causal = causal
        self.u = nn.Parameter(torch.Tensor(self.dim_model))
        self.v = nn.Parameter(torch.Tensor(self.dim_model))
        torch.nn.init.xavier_uniform_(self.u.reshape(self.num_heads, self.dim_head))
        torch.nn.init.xavier_uniform_(self.v.reshape(self.num_heads, self.dim_head))
        self.rel_pos_enc = RelativeSinusoidalPositionalEncoding(max_pos_encoding, self.dim_model, self.causal)

    def rel_to_abs(self, att_scores):
        if self.causal:
            # Att Scores (B, H, T, Th + T)
            batch_size, num_heads, seq_length1, seq_length2 = att_scores.size()
            att_scores = F.pad(att_scores, pad=(1, 0), value=0)
            att_scores = att_scores.reshape(batch_size, num_heads, -1)
            att_scores = F.pad(att_scores, pad=(seq_length2 - seq_length1, 0), value=0)
            att_scores = att_scores.reshape(batch_size, num_heads, 1 + seq_length1, seq_length2)
            att_scores = att_scores[:, :, 1:]
        else:
            batch_size, num_heads, seq_length1, seq_length2 = att_scores.size()
            att_scores = F.pad(att_scores, pad=(0, 1), value=0)
            att_scores = att_scores.reshape(batch_size, num_heads, -1)
            att_scores = F.pad(att_scores, pad=(0, seq_length2 - seq_length1), value=0)
            att_scores = att_scores.reshape(batch_size, num_heads, 1 + seq_length1, seq_length2)
            att_scores = att_scores[:, :, :seq_length1, seq_length1 - 1:]
        return att_scores

    def forward(self, Q, K, V, mask=None, hidden=None):
        batch_size = Q.size(0)

        Q = self.query_layer(Q)
        K = self.key_layer(K)
        V = self.value_layer(V)

        if hidden:
            K = torch.cat([hidden["K"], K], dim=1)
            V = torch.cat([hidden["V"], V], dim=1)
        hidden = {"K": K.detach(), "V": V.detach()}

        Qu = Q + self.u
        Qv = Q + self.v

        # Relative Positional Embeddings (B, Th + T, D) in the causal case
        E = self.pos_layer(self.rel_pos_enc(batch_size, Q.size(1), K.size(1) - Q.size(1)))

        Qu = Qu.reshape(batch_size, -1, self.num_heads, self.dim_head).transpose(1, 2)
        Qv = Qv.reshape(batch_size, -1, self.num_heads, self.dim_head).transpose(1, 2)
        K = K.reshape(batch_size, -1, self.num_heads, self.dim_head).transpose(1, 2)
        V = V.reshape(batch_size, -1, self.num_heads, self.dim_head).transpose(1, 2)
        E = E.reshape(batch_size, -1, self.num_heads, self.dim_head).transpose(1, 2)

        # att_scores (B, H, T, Th + T)
        att_scores_K = Qu.matmul(K.transpose(2, 3))
        att_scores_E = self.rel_to_abs(Qv.matmul(E.transpose(2, 3)))
        att_scores = (att_scores_K + att_scores_E) / K.shape[-1] ** 0.5

        # Apply mask
        if mask is not None:
            att_scores += (mask * -1e9)

        att_w = att_scores.softmax(dim=-1)
        O = att_w.matmul(V)
        O = O.transpose(1, 2).reshape(batch_size, -1, self.dim_model)
        O = self.output_layer(O)
        return O, att_w.detach(), hidden


class PaddingMask(nn.Module):
    def forward(self, seq_len, x_len):
        if x_len is not None:
            mask = x_len.new_ones(x_len.size(0), seq_len)
            for b in range(x_len.size(0)):
                mask[b, :x_len[b]] = x_len.new_zeros(x_len[b])
            # Padding Mask (B, 1, 1, T)
            return mask[:, None, None, :]
        else:
            return None


class StreamingMask(nn.Module):
    def __init__(self, left_context, right_context):
        super(StreamingMask, self).__init__()
        self.padding_mask = PaddingMask()
        self.left_context = left_context
        self.right_context = right_context

    def forward(self, x, x_len):
        # Seq Length T
        seq_len = x.size(-1)

        # Right Context Mask (T, T)
        right_context_mask = x.new_ones(seq_len, seq_len).triu(diagonal=1 + self.right_context)

        # Left Context Mask (T, T)
        left_context_mask = 1 - x.new_ones(seq_len, seq_len).triu(diagonal=-self.left_context)

        # Streaming Mask (T, T)
        streaming_mask = right_context_mask.max(left_context_mask)

        if x_len is not None:
            # Padding Mask (B, 1, 1, T)
            padding_mask = self.padding_mask(seq_len, x_len)
            # Streaming Mask + Padding Mask (B, 1, T, T)
            return streaming_mask.maximum(padding_mask)
        else:
            return streaming_mask[None, None, :, :]


# ----------------------------------------------------------------------------- models/modules.py
class FeedForwardModule(nn.Module):
    def __init__(self, dim_model, dim_ffn, Pdrop, act, inner_dropout):
        super(FeedForwardModule, self).__init__()
        assert act in ["relu", "swish"]
        self.layers = nn.Sequential(
            nn.LayerNorm(dim_model, eps=1e-6),
            Linear(dim_model, dim_ffn),
            Swish() if act == "swish" else nn.ReLU(),
            nn.Dropout(p=Pdrop) if inner_dropout else nn.Identity(),
            Linear(dim_ffn, dim_model),
            nn.Dropout(p=Pdrop)
        )

    def forward(self, x):
        return self.layers(x)


class MultiHeadSelfAttentionModule(nn.Module):
    # Trimmed to the branch this config takes (no grouped / local / strided / linear attention).
    def __init__(self, dim_model, num_heads, Pdrop, max_pos_encoding, relative_pos_enc, causal, group_size,
                 kernel_size, stride, linear_att):
        super(MultiHeadSelfAttentionModule, self).__init__()
        assert relative_pos_enc and group_size == 1 and kernel_size is None and stride == 1 and not linear_att
        self.norm = nn.LayerNorm(dim_model, eps=1e-6)
        self.mhsa = RelPosMultiHeadSelfAttention(dim_model, num_heads, causal, max_pos_encoding)
        self.dropout = nn.Dropout(Pdrop)
        self.rel_pos_enc = relative_pos_enc
        self.linear_att = linear_att

    def forward(self, x, mask=None, hidden=None):
        x = self.norm(x)
        x, attention, hidden = self.mhsa(x, x, x, mask, hidden)
        x = self.dropout(x)
        return x, attention, hidden


class ConvolutionModule(nn.Module):
    def __init__(self, dim_model, dim_expand, kernel_size, Pdrop, stride, padding):
        super(ConvolutionModule, self).__init__()
        self.layers = nn.Sequential(
            nn.LayerNorm(dim_model, eps=1e-6),
            Transpose(1, 2),
            Conv1d(dim_model, 2 * dim_expand, kernel_size=1),
            Glu(dim=1),
            Conv1d(dim_expand, dim_expand, kernel_size, stride=stride, padding=padding, groups=dim_expand),
            nn.BatchNorm1d(dim_expand),
            Swish(),
            Conv1d(dim_expand, dim_expand, kernel_size=1),
            Transpose(1, 2),
            nn.Dropout(p=Pdrop)
        )

    def forward(self, x):
        return self.layers(x)


# ----------------------------------------------------------------------------- models/blocks.py
class ConformerBlock(nn.Module):
    def __init__(self, dim_model, dim_expand, ff_ratio, num_heads, kernel_size, att_group_size, att_kernel_size,
                 linear_att, Pdrop, relative_pos_enc, max_pos_encoding, conv_stride, att_stride, causal):
        super(ConformerBlock, self).__init__()
        self.feed_forward_module1 = FeedForwardModule(dim_model=dim_model, dim_ffn=dim_model * ff_ratio, Pdrop=Pdrop,
                                                      act="swish", inner_dropout=True)
        self.multi_head_self_attention_module = MultiHeadSelfAttentionModule(
            dim_model=dim_model, num_heads=num_heads, Pdrop=Pdrop, max_pos_encoding=max_pos_encoding,
            relative_pos_enc=relative_pos_enc, causal=causal, group_size=att_group_size, kernel_size=att_kernel_size,
            stride=att_stride, linear_att=linear_att)
        self.convolution_module = ConvolutionModule(dim_model=dim_model, dim_expand=dim_expand,
                                                    kernel_size=kernel_size, Pdrop=Pdrop, stride=conv_stride,
                                                    padding="causal" if causal else "same")
        self.feed_forward_module2 = FeedForwardModule(dim_model=dim_expand, dim_ffn=dim_expand * ff_ratio,
                                                      Pdrop=Pdrop, act="swish", inner_dropout=True)
        self.norm = nn.LayerNorm(dim_expand, eps=1e-6)
        self.att_res = nn.Sequential(
            Transpose(1, 2), nn.MaxPool1d(kernel_size=1, stride=att_stride), Transpose(1, 2)
        ) if att_stride > 1 else nn.Identity()
        self.conv_res = nn.Sequential(
            Transpose(1, 2), Conv1d(dim_model, dim_expand, kernel_size=1, stride=conv_stride), Transpose(1, 2)
        ) if dim_model != dim_expand else nn.Sequential(
            Transpose(1, 2), nn.MaxPool1d(kernel_size=1, stride=conv_stride), Transpose(1, 2)
        ) if conv_stride > 1 else nn.Identity()
        self.stride = conv_stride * att_stride

    def forward(self, x, mask=None, hidden=None):
        x = x + 1 / 2 * self.feed_forward_module1(x)
        x_att, attention, hidden = self.multi_head_self_attention_module(x, mask, hidden)
        x = self.att_res(x) + x_att
        x = self.conv_res(x) + self.convolution_module(x)
        x = x + 1 / 2 * self.feed_forward_module2(x)
        x = self.norm(x)
        return x, attention, hidden


# ----------------------------------------------------------------------------- models/encoders.py
class ConformerEncoder(nn.Module):
    def __init__(self, params):
        super(ConformerEncoder, self).__init__()

        # Padding Mask
        self.padding_mask = StreamingMask(
            left_context=params.get("left_context", params["max_pos_encoding"]),
            right_context=0 if params.get("causal", False) else params.get("right_context", params["max_pos_encoding"]))

        # Linear Proj (input: the subsampling module's output channels)
        self.linear = nn.Linear(params["subsampling_out_dim"],
                                params["dim_model"][0] if isinstance(params["dim_model"], list) else params["dim_model"])
        self.dropout = nn.Dropout(p=params["Pdrop"])

        self.blocks = nn.ModuleList([ConformerBlock(
            dim_model=params["dim_model"][(block_id > torch.tensor(params.get("expand_blocks", []))).sum()] if isinstance(params["dim_model"], list) else params["dim_model"],
            dim_expand=params["dim_model"][(block_id >= torch.tensor(params.get("expand_blocks", []))).sum()] if isinstance(params["dim_model"], list) else params["dim_model"],
            ff_ratio=params["ff_ratio"],
            num_heads=params["num_heads"][(block_id > torch.tensor(params.get("expand_blocks", []))).sum()] if isinstance(params["num_heads"], list) else params["num_heads"],
            kernel_size=params["kernel_size"][(block_id >= torch.tensor(params.get("expand_blocks", []))).sum()] if isinstance(params["kernel_size"], list) else params["kernel_size"],
            att_group_size=params["att_group_size"][(block_id > torch.tensor(params.get("strided_blocks", []))).sum()] if isinstance(params.get("att_group_size", 1), list) else params.get("att_group_size", 1),
            att_kernel_size=params["att_kernel_size"][(block_id > torch.tensor(params.get("strided_layers", []))).sum()] if isinstance(params.get("att_kernel_size", None), list) else params.get("att_kernel_size", None),
            linear_att=params.get("linear_att", False),
            Pdrop=params["Pdrop"],
            relative_pos_enc=params["relative_pos_enc"],
            max_pos_encoding=params["max_pos_encoding"] // params.get("stride", 2) ** int((block_id > torch.tensor(params.get("strided_blocks", []))).sum()),
            conv_stride=(params["conv_stride"][(block_id > torch.tensor(params.get("strided_blocks", []))).sum()] if isinstance(params["conv_stride"], list) else params["conv_stride"]) if block_id in params.get("strided_blocks", []) else 1,
            att_stride=(params["att_stride"][(block_id > torch.tensor(params.get("strided_blocks", []))).sum()] if isinstance(params["att_stride"], list) else params["att_stride"]) if block_id in params.get("strided_blocks", []) else 1,
            causal=params.get("causal", False)
        ) for block_id in range(params["num_blocks"])])

    def forward(self, x, x_len=None):
        # x: subsampled features (B, D, T), x_len: their frame lengths

        # Padding Mask
        mask = self.padding_mask(x, x_len)

        # Transpose (B, D, T) -> (B, T, D)
        x = x.transpose(1, 2)
        x = self.linear(x)
        x = self.dropout(x)

        attentions = []
        for block in self.blocks:
            x, attention, hidden = block(x, mask)
            attentions.append(attention)

            # Strided Block
            if block.stride > 1:
                # Stride Mask (B, 1, T // S, T // S)
                if mask is not None:
                    mask = mask[:, :, ::block.stride, ::block.stride]
                # Update Seq Lengths
                if x_len is not None:
                    x_len = torch.div(x_len - 1, block.stride, rounding_mode='floor') + 1

        return x, x_len, attentions


# ----------------------------------------------------------------------------- models/model_ctc.py (trimmed)
class ModelCTC(nn.Module):
    def __init__(self, encoder_params, tokenizer_params):
        super(ModelCTC, self).__init__()
        self.encoder = ConformerEncoder(encoder_params)
        self.fc = nn.Linear(encoder_params["dim_model"][-1] if isinstance(encoder_params["dim_model"], list) else encoder_params["dim_model"], tokenizer_params["vocab_size"])
        self.criterion = nn.CTCLoss(blank=0, reduction="none", zero_infinity=False)

    def forward(self, x, x_len):
        logits, logits_len, attentions = self.encoder(x, x_len)
        logits = self.fc(logits)
        return logits, logits_len, attentions

    def gready_search_decoding(self, x, x_len):
        logits, logits_len = self.encoder(x, x_len)[:2]
        logits = self.fc(logits)
        preds = logits.log_softmax(dim=-1).argmax(dim=-1)
        batch_pred_list = []
        for b in range(logits.size(0)):
            pred_list = []
            prev = 0
            for t in range(logits_len[b]):
                p = preds[b, t].item()
                if p != prev and p != 0:
                    pred_list.append(p)
                prev = p
            batch_pred_list.append(pred_list)
        return batch_pred_list


# ----------------------------------------------------------------------------- hand-written reference
def sinusoid(dist, dim):
    i = torch.arange(0, dim // 2, dtype=torch.float)
    ang = dist / 10000 ** (2 * i / dim)
    pe = torch.zeros(dim)
    pe[0::2] = torch.sin(ang)
    pe[1::2] = torch.cos(ang)
    return pe


def reference_attention(mhsa, x, left):
    """x: (T, D) one unpadded utterance. Query i attends keys j with 0 <= i - j <= left, written as loops."""
    T, D = x.shape
    H, d = mhsa.num_heads, mhsa.dim_head
    q = mhsa.query_layer(x).view(T, H, d)
    k = mhsa.key_layer(x).view(T, H, d)
    v = mhsa.value_layer(x).view(T, H, d)
    u = mhsa.u.view(H, d)
    vb = mhsa.v.view(H, d)
    pe = {}  # relative distance -> pos_layer(sinusoid(distance)), (H, d)
    out = torch.zeros(T, H, d)
    for i in range(T):
        keys = [j for j in range(T) if 0 <= i - j <= left]
        for j in keys:
            if i - j not in pe:
                pe[i - j] = mhsa.pos_layer(sinusoid(float(i - j), D)).view(H, d)
        E = torch.stack([pe[i - j] for j in keys])  # (n, H, d)
        kj, vj = k[keys], v[keys]  # (n, H, d)
        s = (((q[i] + u) * kj).sum(-1) + ((q[i] + vb) * E).sum(-1)) / math.sqrt(d)  # (n, H)
        w = torch.softmax(s, dim=0)
        out[i] = (w[:, :, None] * vj).sum(0)
    return mhsa.output_layer(out.reshape(T, D))


def reference_encoder(model, feats, left_context):
    """feats: (D, T) one utterance, unpadded."""
    enc = model.encoder
    x = enc.linear(feats.t().unsqueeze(0))  # (1, T, D)
    S = 1
    for block in enc.blocks:
        x = x + 0.5 * block.feed_forward_module1(x)
        mod = block.multi_head_self_attention_module
        x_att = reference_attention(mod.mhsa, mod.norm(x)[0], left_context // S).unsqueeze(0)
        x = x + x_att
        x = block.conv_res(x) + block.convolution_module(x)
        x = x + 0.5 * block.feed_forward_module2(x)
        x = block.norm(x)
        S *= block.stride
    return model.fc(x)[0]


def main():
    torch.manual_seed(0)
    encoder_params = {
        "arch": "Conformer",
        "num_blocks": 5,
        "dim_model": [16, 24, 32],
        "ff_ratio": 2,
        "num_heads": 4,
        "kernel_size": 5,
        "Pdrop": 0.1,
        "conv_stride": 2,
        "att_stride": 1,
        "strided_blocks": [1, 3],
        "expand_blocks": [1, 3],
        "att_group_size": 1,
        "relative_pos_enc": True,
        "max_pos_encoding": 64,
        "causal": True,
        "left_context": 6,
        "subsampling_out_dim": 20,
    }
    tokenizer_params = {"vocab_size": 11}
    model = ModelCTC(encoder_params, tokenizer_params)
    # random BatchNorm statistics so the eval-mode conv module is not an identity
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    model.eval()

    lengths = torch.tensor([30, 23, 17])
    B, T = len(lengths), int(lengths.max())
    feats = torch.zeros(B, encoder_params["subsampling_out_dim"], T)
    for b in range(B):
        feats[b, :, :lengths[b]] = torch.randn(encoder_params["subsampling_out_dim"], int(lengths[b]))
    # the padded tail holds the subsampling module's output on padded audio, not zeros
    for b in range(B):
        feats[b, :, lengths[b]:] = 3.0 + torch.randn(encoder_params["subsampling_out_dim"], T - int(lengths[b]))

    y = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 0], [8, 9, 0, 0]])
    y_len = torch.tensor([4, 3, 2])

    with torch.no_grad():
        logits, logits_len, _ = model(feats, lengths)
        loss_b = model.criterion(F.log_softmax(logits, dim=-1).transpose(0, 1), y, logits_len, y_len)
        preds_b = model.gready_search_decoding(feats, lengths)

        expect_len = lengths.clone()
        for _ in encoder_params["strided_blocks"]:
            expect_len = (expect_len + 1) // 2  # ceil(T / 2) frames out of a causal stride-2 conv
        assert logits_len.tolist() == expect_len.tolist(), (logits_len, expect_len)
        assert logits.shape[1] == int(expect_len.max())

        for b in range(B):
            n = int(lengths[b])
            one = feats[b:b + 1, :, :n]
            l1, l1_len, _ = model(one, lengths[b:b + 1])
            assert int(l1_len) == int(logits_len[b])
            m = int(logits_len[b])
            torch.testing.assert_close(logits[b, :m], l1[0], atol=1e-4, rtol=1e-4)

            ref = reference_encoder(model, feats[b, :, :n], encoder_params["left_context"])
            torch.testing.assert_close(logits[b, :m], ref, atol=1e-4, rtol=1e-4)

            loss_1 = model.criterion(F.log_softmax(l1, dim=-1).transpose(0, 1), y[b:b + 1, :int(y_len[b])],
                                     l1_len, y_len[b:b + 1])
            torch.testing.assert_close(loss_b[b], loss_1[0], atol=1e-4, rtol=1e-4)
            assert preds_b[b] == model.gready_search_decoding(one, lengths[b:b + 1])[0]

    print("logits_len", logits_len.tolist(), "ctc losses", [round(float(v), 4) for v in loss_b])
    print("ok: padded causal streaming batch matches per-utterance runs and the loop reference")


if __name__ == "__main__":
    main()
