"""NeMo ECAPA-TDNN speaker embeddings: the attentive pooling's frame mask let every padded frame in.

Citation: NVIDIA/NeMo#2648 ("Fix incorrect masking that always included all samples.",
nemo/collections/asr/parts/submodules/tdnn_attention.py, ``lens_to_mask``). The line it removes is
gone from later versions of tdnn_attention.py, which build the mask from the frame counts as they are.

The bug: ``lens_to_mask(lens, max_len)`` did ``lens = lens * max_len`` before comparing
``arange(max_len) < lens``. The encoder hands the decoder absolute frame counts (not fractions of the
longest utterance), so ``lens * max_len >= max_len`` and the mask is True on every frame of every
utterance. ``AttentivePoolLayer`` then takes its global mean / std over the padded frames, and its
``masked_fill(mask == 0, -inf)`` before the softmax over time masks nothing, so a short utterance's
attention weights and its (mu, sigma) statistics spread over the zero frames of the batch's padding.
``SE_Module`` (squeeze-excite in each SE_TDNN block) uses the same mask for its time average.

The fix: drop ``lens = lens * max_len``; the mask is ``arange(max_len) < lens``.

Ported as NeMo wrote it at the time (TDNN_Module, SE_Module, SE_TDNN_Module, AttentivePoolLayer,
ECAPAEncoder-style layer stack with feature aggregation, SpeakerDecoder with pool_mode='attention'
and an angular final layer), at toy sizes with random weights, in eval mode. A batch of two
utterances of 24 and 11 frames (right-padded with zeros) is embedded; the second one is also
embedded alone.
"""

import sys
from typing import List

import torch
from numpy import inf
from torch import nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


def get_same_padding(kernel_size, stride, dilation):
    if stride > 1 and dilation > 1:
        raise ValueError("Only stride OR dilation may be greater than 1")
    return (dilation * (kernel_size - 1)) // 2


def lens_to_mask(lens: List[int], max_len: int, device: str = None):
    """
    outputs masking labels for list of lengths of audio features, with max length of any
    mask as max_len
    """
    lens_mat = torch.arange(max_len).to(device)
    if not FIXED:
        lens = lens * max_len
    mask = lens_mat[:max_len].unsqueeze(0) < lens.unsqueeze(1)
    mask = mask.unsqueeze(1)
    num_values = torch.sum(mask, dim=2, keepdim=True)
    return mask, num_values


def get_statistics_with_mask(x, m, dim=2, eps=1e-10):
    mean = torch.sum((m * x), dim=dim)
    std = torch.sqrt((m * (x - mean.unsqueeze(dim)).pow(2)).sum(dim).clamp(eps))
    return mean, std


class TDNN_Module(nn.Module):
    def __init__(self, inp_filters, out_filters, kernel_size=1, dilation=1, stride=1, padding=None):
        super(TDNN_Module, self).__init__()
        if padding is None:
            padding = get_same_padding(kernel_size, stride=stride, dilation=dilation)

        self.conv_layer = nn.Conv1d(
            in_channels=inp_filters,
            out_channels=out_filters,
            kernel_size=kernel_size,
            dilation=dilation,
            padding=padding,
        )

        self.activation = nn.ReLU()
        self.bn = nn.BatchNorm1d(out_filters)

    def forward(self, x, length=None):
        x = self.conv_layer(x)
        x = self.activation(x)
        return self.bn(x)


class SE_Module(nn.Module):
    def __init__(self, inp_filters, se_filters, out_filters, kernel_size=1, dilation=1):
        super(SE_Module, self).__init__()
        self.se_layer = nn.Sequential(
            nn.Conv1d(inp_filters, se_filters, kernel_size=kernel_size, dilation=dilation,),
            nn.ReLU(),
            nn.BatchNorm1d(se_filters),
            nn.Conv1d(se_filters, out_filters, kernel_size=kernel_size, dilation=dilation,),
            nn.Sigmoid(),
        )

    def forward(self, input, length=None):
        if length is None:
            x = torch.mean(input, dim=2, keepdim=True)
        else:
            max_len = input.size(2)
            mask, num_values = lens_to_mask(length, max_len=max_len, device=input.device)
            x = torch.sum((input * mask), dim=2, keepdim=True) / (num_values)

        out = self.se_layer(x)
        return out * input


class SE_TDNN_Module(nn.Module):
    def __init__(self, inp_filters, out_filters, group_scale=8, se_channels=128, kernel_size=1, dilation=1):
        super(SE_TDNN_Module, self).__init__()
        self.out_filters = out_filters
        padding_val = get_same_padding(kernel_size=kernel_size, dilation=dilation, stride=1)

        group_conv = nn.Conv1d(
            out_filters,
            out_filters,
            kernel_size=kernel_size,
            dilation=dilation,
            padding=padding_val,
            groups=group_scale,
        )
        self.group_tdnn_block = nn.Sequential(
            TDNN_Module(inp_filters, out_filters, kernel_size=1, dilation=1),
            group_conv,
            nn.ReLU(),
            nn.BatchNorm1d(out_filters),
            TDNN_Module(out_filters, out_filters, kernel_size=1, dilation=1),
        )

        self.se_layer = SE_Module(out_filters, se_channels, out_filters)

    def forward(self, input, length=None):
        x = self.group_tdnn_block(input)
        x = self.se_layer(x, length)
        return x + input


class AttentivePoolLayer(nn.Module):
    def __init__(self, inp_filters, attention_channels=128, kernel_size=1, dilation=1, eps=1e-10):
        super(AttentivePoolLayer, self).__init__()

        self.feat_in = 2 * inp_filters

        self.attention_layer = nn.Sequential(
            TDNN_Module(inp_filters * 3, attention_channels, kernel_size=kernel_size, dilation=dilation),
            nn.Tanh(),
            nn.Conv1d(
                in_channels=attention_channels, out_channels=inp_filters, kernel_size=kernel_size, dilation=dilation,
            ),
        )
        self.eps = eps

    def forward(self, x, length=None):
        max_len = x.size(2)

        if length is None:
            length = torch.ones(x.shape[0], device=x.device)

        mask, num_values = lens_to_mask(length, max_len=max_len, device=x.device)

        # encoder statistics
        mean, std = get_statistics_with_mask(x, mask / num_values)
        mean = mean.unsqueeze(2).repeat(1, 1, max_len)
        std = std.unsqueeze(2).repeat(1, 1, max_len)
        attn = torch.cat([x, mean, std], dim=1)

        # attention statistics
        attn = self.attention_layer(attn)  # attention pass
        attn = attn.masked_fill(mask == 0, -inf)
        alpha = F.softmax(attn, dim=2)  # attention values, α
        mu, sg = get_statistics_with_mask(x, alpha)  # µ and ∑

        # gather
        return torch.cat((mu, sg), dim=1).unsqueeze(2)


class ECAPAEncoder(nn.Module):
    """Modified ECAPA encoder layer stack (ConvASREncoder with SE_TDNN blocks, as the ECAPA config builds it)."""

    def __init__(self, feat_in, filters, kernel_sizes, dilations, scale=8):
        super().__init__()
        self.layers = nn.ModuleList()
        self.layers.append(TDNN_Module(feat_in, filters[0], kernel_size=kernel_sizes[0], dilation=dilations[0]))
        for i in range(len(filters) - 2):
            self.layers.append(
                SE_TDNN_Module(
                    filters[i],
                    filters[i + 1],
                    group_scale=scale,
                    se_channels=16,
                    kernel_size=kernel_sizes[i + 1],
                    dilation=dilations[i + 1],
                )
            )
        self.feature_agg = TDNN_Module(filters[-1], filters[-1], kernel_sizes[-1], dilations[-1])

    def forward(self, audio_signal, length=None):
        x = audio_signal
        outputs = []

        for layer in self.layers:
            x = layer(x, length=length)
            outputs.append(x)

        x = torch.cat(outputs[1:], dim=1)
        x = self.feature_agg(x)
        return x, length


class SpeakerDecoder(nn.Module):
    def __init__(self, feat_in, num_classes, emb_sizes=16, pool_mode='attention', angular=True, attention_channels=16):
        super().__init__()
        self.angular = angular
        self.emb_id = 2
        bias = False if self.angular else True
        self._pooling = AttentivePoolLayer(inp_filters=feat_in, attention_channels=attention_channels)
        self._feat_in = self._pooling.feat_in

        shapes = [self._feat_in, emb_sizes]
        emb_layers = []
        for shape_in, shape_out in zip(shapes[:-1], shapes[1:]):
            layer = nn.Sequential(
                nn.BatchNorm1d(shape_in, affine=True, track_running_stats=True),
                nn.Conv1d(shape_in, shape_out, kernel_size=1),
                nn.BatchNorm1d(shape_out, affine=True, track_running_stats=True),
            )
            emb_layers.append(layer)
        self.emb_layers = nn.ModuleList(emb_layers)
        self.final = nn.Linear(shapes[-1], num_classes, bias=bias)

    def forward(self, encoder_output, length=None):
        pool = self._pooling(encoder_output, length)
        embs = []

        for layer in self.emb_layers:
            pool, emb = layer(pool), layer[: self.emb_id](pool)
            embs.append(emb)

        pool = pool.squeeze(-1)
        if self.angular:
            for W in self.final.parameters():
                W = F.normalize(W, p=2, dim=1)
            pool = F.normalize(pool, p=2, dim=1)

        out = self.final(pool)
        return out, embs[-1].squeeze(-1)


class EncDecSpeakerLabelModel(nn.Module):
    def __init__(self):
        super().__init__()
        filters = [32, 32, 32, 32, 96]
        self.encoder = ECAPAEncoder(feat_in=20, filters=filters, kernel_sizes=[5, 3, 3, 3, 1], dilations=[1, 2, 3, 4, 1])
        self.decoder = SpeakerDecoder(feat_in=96, num_classes=5, emb_sizes=16)

    def forward(self, processed_signal, processed_signal_len):
        encoded, length = self.encoder(audio_signal=processed_signal, length=processed_signal_len)
        logits, embs = self.decoder(encoder_output=encoded, length=length)
        return logits, embs


def main():
    torch.manual_seed(0)
    model = EncDecSpeakerLabelModel()
    # give the BatchNorms non-trivial running statistics, then evaluate
    model.train()
    with torch.no_grad():
        for _ in range(3):
            model(torch.randn(4, 20, 24), torch.tensor([24, 24, 24, 24]))
    model.eval()

    lengths = torch.tensor([24, 11])
    feats = torch.randn(2, 20, 24)
    feats[1, :, lengths[1]:] = 0.0  # log-mel features of the short utterance, right-padded with zeros

    with torch.no_grad():
        logits, embs = model(feats, lengths)
        alone_logits, alone_embs = model(feats[1:, :, : lengths[1]], lengths[1:])

    torch.set_printoptions(precision=4, sci_mode=False)
    print("batched logits:\n", logits)
    print("short utterance alone, logits:\n", alone_logits)
    print("speaker label (batched, alone):", logits[1].argmax().item(), alone_logits[0].argmax().item())
    cos = F.cosine_similarity(embs[1:], alone_embs).item()
    print("cosine(batched embedding, alone embedding) of the short utterance: %.6f" % cos)


if __name__ == "__main__":
    main()
