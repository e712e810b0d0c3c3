"""KoSpeech Speech Transformer: the multi-head attention's mask was repeated batch-major.

Citation: sooftware/kospeech commit b4c3b3f5 "Fix MultiHeadAttention mask"
(kospeech/models/attention.py ``MultiHeadAttention.forward`` / ``ScaledDotProductAttention.forward``).

The bug: ``MultiHeadAttention`` folds the heads into the batch head-major
(``permute(2, 0, 1, 3).view(batch_size * num_heads, ...)``, row ``h * B + b``), but the
(B, Q_LEN, K_LEN) mask was expanded with ``mask.unsqueeze(1).repeat(1, num_heads, 1, 1)`` and then
``mask.view(score.size())`` in ``ScaledDotProductAttention``, which lays it out batch-major
(row ``b * N + h``). With more than one utterance in the batch, most heads of an utterance are
masked with another utterance's padding (encoder self-attention, decoder cross-attention over the
encoder frames) or another transcript's key padding (decoder self-attention).

The fix: ``mask = mask.repeat(self.num_heads, 1, 1)`` (head-major, like the scores) and
``score.masked_fill_(mask, -np.inf)``.

Ported at b4c3b3f5^ (kospeech/models/acoustic/transformer/{transformer,layers,sublayers,mask,
embeddings}.py, kospeech/models/{attention,modules}.py) at toy sizes with random weights: a padded
batch of two feature sequences with ``input_lengths``, teacher-forced transcripts padded with the
eos id, ``model.eval()``. The location-aware attention and the RNN parts of the files are left out.
"""

import math
import sys
from typing import Any, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.init as init
from torch import Tensor

FIXED = "--fixed" in sys.argv


# ---- kospeech/models/modules.py -------------------------------------------------------------------
class Linear(nn.Module):
    """
    Wrapper class of torch.nn.Linear
    Weight initialize by xavier initialization and bias initialize to zeros.
    """
    def __init__(self, in_features: int, out_features: int, bias: bool = True) -> None:
        super(Linear, self).__init__()
        self.linear = nn.Linear(in_features, out_features, bias=bias)
        init.xavier_uniform_(self.linear.weight)
        if bias:
            init.zeros_(self.linear.bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear(x)


class LayerNorm(nn.Module):
    """ Wrapper class of torch.nn.LayerNorm """
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super(LayerNorm, self).__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.beta = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, z: Tensor) -> Tensor:
        mean = z.mean(dim=-1, keepdim=True)
        std = z.std(dim=-1, keepdim=True)
        output = (z - mean) / (std + self.eps)
        output = self.gamma * output + self.beta
        return output


# ---- kospeech/models/attention.py -----------------------------------------------------------------
class ScaledDotProductAttention(nn.Module):
    def __init__(self, dim: int) -> None:
        super(ScaledDotProductAttention, self).__init__()
        self.sqrt_dim = np.sqrt(dim)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
        score = torch.bmm(query, key.transpose(1, 2)) / self.sqrt_dim

        if mask is not None:
            if FIXED:
                score.masked_fill_(mask, -np.inf)
            else:
                score.masked_fill_(mask.view(score.size()), -float('inf'))

        attn = F.softmax(score, -1)
        context = torch.bmm(attn, value)
        return context, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8) -> None:
        super(MultiHeadAttention, self).__init__()

        assert d_model % num_heads == 0, "hidden_dim % num_heads should be zero."

        self.d_head = int(d_model / num_heads)
        self.num_heads = num_heads
        self.query_proj = Linear(d_model, self.d_head * num_heads)
        self.key_proj = Linear(d_model, self.d_head * num_heads)
        self.value_proj = Linear(d_model, self.d_head * num_heads)
        self.sqrt_dim = np.sqrt(d_model)
        self.scaled_dot_attn = ScaledDotProductAttention(self.d_head)

    def forward(self, query: Tensor, key: Tensor, value: Tensor, mask: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
        batch_size = value.size(0)

        query = self.query_proj(query).view(batch_size, -1, self.num_heads, self.d_head)  # BxQ_LENxNxD
        key = self.key_proj(key).view(batch_size, -1, self.num_heads, self.d_head)        # BxK_LENxNxD
        value = self.value_proj(value).view(batch_size, -1, self.num_heads, self.d_head)  # BxV_LENxNxD

        query = query.permute(2, 0, 1, 3).contiguous().view(batch_size * self.num_heads, -1, self.d_head)  # BNxQ_LENxD
        key = key.permute(2, 0, 1, 3).contiguous().view(batch_size * self.num_heads, -1, self.d_head)      # BNxK_LENxD
        value = value.permute(2, 0, 1, 3).contiguous().view(batch_size * self.num_heads, -1, self.d_head)  # BNxV_LENxD

        if mask is not None:
            if FIXED:
                mask = mask.repeat(self.num_heads, 1, 1)
            else:
                mask = mask.unsqueeze(1).repeat(1, self.num_heads, 1, 1)  # BxNxQ_LENxK_LEN

        context, attn = self.scaled_dot_attn(query, key, value, mask)
        context = context.view(self.num_heads, batch_size, -1, self.d_head)
        context = context.permute(1, 2, 0, 3).contiguous().view(batch_size, -1, self.num_heads * self.d_head)  # BxTxND

        return context, attn


# ---- kospeech/models/acoustic/transformer/mask.py -------------------------------------------------
def get_pad_mask(inputs: Tensor, input_lengths: Optional[Any] = None, pad_id: int = None) -> Tensor:
    """ Padding position is set to True, either use input_lengths or pad_id """
    assert (input_lengths is None and pad_id is not None) or (input_lengths is not None and pad_id is None)

    if input_lengths is not None:
        batch_size = inputs.size(0)
        pad_mask = inputs.new_zeros(inputs.size()[:-1])  # B x T

        for i in range(batch_size):
            pad_mask[i, input_lengths[i]:] = 1

    if pad_id is not None:
        assert inputs.dim() == 2
        pad_mask = inputs.eq(pad_id)

    return pad_mask.unsqueeze(-1).bool()


def get_subsequent_mask(inputs: Tensor) -> Tensor:
    batch_size, seq_length = inputs.size()
    subsequent_mask = torch.triu(torch.ones((seq_length, seq_length), device=inputs.device, dtype=torch.uint8), diagonal=1)
    subsequent_mask = subsequent_mask.unsqueeze(0).expand(batch_size, -1, -1)  # BxTxT

    return subsequent_mask.bool()


def get_attn_pad_mask(padded_input, input_lengths, expand_length):
    """ mask position is set to 1 """
    # N x Ti x 1
    non_pad_mask = get_pad_mask(padded_input, input_lengths=input_lengths).eq(False)
    # N x Ti, lt(1) like not operation
    pad_mask = non_pad_mask.squeeze(-1).lt(1)
    attn_mask = pad_mask.unsqueeze(1).expand(-1, expand_length, -1)
    return attn_mask


def get_attn_key_pad_mask(seq_k, seq_q, pad_idx):
    """ For masking out the padding part of key sequence. """
    len_q = seq_q.size(1)
    padding_mask = seq_k.eq(pad_idx)
    padding_mask = padding_mask.unsqueeze(1).expand(-1, len_q, -1)  # b x lq x lk

    return padding_mask


# ---- kospeech/models/acoustic/transformer/embeddings.py -------------------------------------------
class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int = 80, max_len: int = 5000) -> None:
        super(PositionalEncoding, self).__init__()
        pe = torch.zeros(max_len, d_model, requires_grad=False)
        position = torch.arange(0, max_len, dtype=torch.float).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.register_buffer('pe', pe)

    def forward(self, length: int) -> Tensor:
        return self.pe[:, :length]


class Embedding(nn.Module):
    def __init__(self, num_embeddings: int, pad_id: int, d_model: int = 512) -> Tensor:
        super(Embedding, self).__init__()
        self.sqrt_dim = math.sqrt(d_model)
        self.embedding = nn.Embedding(num_embeddings, d_model, padding_idx=pad_id)

    def forward(self, inputs: Tensor) -> Tensor:
        return self.embedding(inputs) * self.sqrt_dim


# ---- kospeech/models/acoustic/transformer/sublayers.py --------------------------------------------
class AddNorm(nn.Module):
    def __init__(self, sublayer: nn.Module, d_model: int = 512) -> None:
        super(AddNorm, self).__init__()
        self.sublayer = sublayer
        self.layer_norm = LayerNorm(d_model)

    def forward(self, *args):
        residual = args[0]
        output = self.sublayer(*args)

        if isinstance(output, tuple):
            return self.layer_norm(output[0] + residual), output[1]

        return self.layer_norm(output + residual)


class PositionWiseFeedForwardNet(nn.Module):
    def __init__(self, d_model: int = 512, d_ff: int = 2048,
                 dropout_p: float = 0.3, ffnet_style: str = 'ff') -> None:
        super(PositionWiseFeedForwardNet, self).__init__()
        self.ffnet_style = ffnet_style.lower()
        if self.ffnet_style == 'ff':
            self.feed_forward = nn.Sequential(
                Linear(d_model, d_ff),
                nn.Dropout(dropout_p),
                nn.ReLU(),
                Linear(d_ff, d_model),
                nn.Dropout(dropout_p)
            )

        elif self.ffnet_style == 'conv':
            self.conv1 = nn.Conv1d(in_channels=d_model, out_channels=d_ff, kernel_size=1)
            self.relu = nn.ReLU()
            self.conv2 = nn.Conv1d(in_channels=d_ff, out_channels=d_model, kernel_size=1)

        else:
            raise ValueError("Unsupported mode: {0}".format(self.mode))

    def forward(self, inputs: Tensor) -> Tensor:
        if self.ffnet_style == 'conv':
            output = self.conv1(inputs.transpose(1, 2))
            output = self.relu(output)
            return self.conv2(output).transpose(1, 2)

        return self.feed_forward(inputs)


# ---- kospeech/models/acoustic/transformer/layers.py -----------------------------------------------
class SpeechTransformerEncoderLayer(nn.Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8, d_ff: int = 2048,
                 dropout_p: float = 0.3, ffnet_style: str = 'ff') -> None:
        super(SpeechTransformerEncoderLayer, self).__init__()
        self.self_attention = AddNorm(MultiHeadAttention(d_model, num_heads), d_model)
        self.feed_forward = AddNorm(PositionWiseFeedForwardNet(d_model, d_ff, dropout_p, ffnet_style), d_model)

    def forward(self, inputs: Tensor, non_pad_mask: Optional[Any] = None,
                self_attn_mask: Optional[Any] = None) -> Tuple[Tensor, Tensor]:
        output, attn = self.self_attention(inputs, inputs, inputs, self_attn_mask)

        if non_pad_mask is not None:
            output *= non_pad_mask

        output = self.feed_forward(output)

        if non_pad_mask is not None:
            output *= non_pad_mask

        return output, attn


class SpeechTransformerDecoderLayer(nn.Module):
    def __init__(self, d_model: int = 512, num_heads: int = 8, d_ff: int = 2048,
                 dropout_p: float = 0.3, ffnet_style: str = 'ff') -> None:
        super(SpeechTransformerDecoderLayer, self).__init__()
        self.self_attention = AddNorm(MultiHeadAttention(d_model, num_heads), d_model)
        self.memory_attention = AddNorm(MultiHeadAttention(d_model, num_heads), d_model)
        self.feed_forward = AddNorm(PositionWiseFeedForwardNet(d_model, d_ff, dropout_p, ffnet_style), d_model)

    def forward(self, inputs: Tensor, memory: Tensor,
                non_pad_mask: Optional[Any] = None, self_attn_mask: Optional[Any] = None,
                memory_mask: Optional[Any] = None) -> Tuple[Tensor, Tensor, Tensor]:
        output, self_attn = self.self_attention(inputs, inputs, inputs, self_attn_mask)

        if non_pad_mask is not None:
            output *= non_pad_mask

        output, memory_attn = self.memory_attention(output, memory, memory, memory_mask)

        if non_pad_mask is not None:
            output *= non_pad_mask

        output = self.feed_forward(output)

        if non_pad_mask is not None:
            output *= non_pad_mask

        return output, self_attn, memory_attn


# ---- kospeech/models/acoustic/transformer/transformer.py ------------------------------------------
class SpeechTransformer(nn.Module):
    def __init__(
            self,
            num_classes: int,                      # the number of classfication
            d_model: int = 512,                    # dimension of model
            input_dim: int = 80,                   # dimension of input
            pad_id: int = 0,                       # identification of <PAD_token>
            eos_id: int = 2,                       # identification of <EOS_token>
            d_ff: int = 2048,                      # dimension of feed forward network
            num_heads: int = 8,                    # number of attention heads
            num_encoder_layers: int = 6,           # number of encoder layers
            num_decoder_layers: int = 6,           # number of decoder layers
            dropout_p: float = 0.3,                # dropout probability
            ffnet_style: str = 'ff'                # feed forward network style 'ff' or 'conv'
    ) -> None:
        super(SpeechTransformer, self).__init__()

        assert d_model % num_heads == 0, "d_model % num_heads should be zero."

        self.eos_id = eos_id
        self.pad_id = pad_id
        self.encoder = SpeechTransformerEncoder(
            d_model=d_model, input_dim=input_dim, d_ff=d_ff, num_layers=num_encoder_layers,
            num_heads=num_heads, ffnet_style=ffnet_style, dropout_p=dropout_p, pad_id=pad_id
        )
        self.decoder = SpeechTransformerDecoder(
            num_classes=num_classes, d_model=d_model, d_ff=d_ff, num_layers=num_decoder_layers,
            num_heads=num_heads, ffnet_style=ffnet_style, dropout_p=dropout_p, pad_id=pad_id,
            eos_id=eos_id
        )

    def forward(self, inputs: Tensor, input_lengths: Tensor, targets: Optional[Tensor] = None,
                return_attns: bool = False):
        memory, encoder_self_attns = self.encoder(inputs, input_lengths)
        output, decoder_self_attns, memory_attns = self.decoder(targets, input_lengths, memory)

        if return_attns:
            output = (output, encoder_self_attns, decoder_self_attns, memory_attns)
        else:
            del encoder_self_attns, decoder_self_attns, memory_attns

        return output


class SpeechTransformerEncoder(nn.Module):
    def __init__(self, d_model: int = 512, input_dim: int = 80, d_ff: int = 2048,
                 num_layers: int = 6, num_heads: int = 8, ffnet_style: str = 'ff',
                 dropout_p: float = 0.3, pad_id: int = 0) -> None:
        super(SpeechTransformerEncoder, self).__init__()
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.pad_id = pad_id
        self.input_proj = Linear(input_dim, d_model)
        self.input_layer_norm = LayerNorm(d_model)
        self.input_dropout = nn.Dropout(p=dropout_p)
        self.positional_encoding = PositionalEncoding(d_model)
        self.layers = nn.ModuleList(
            [SpeechTransformerEncoderLayer(d_model, num_heads, d_ff, dropout_p, ffnet_style) for _ in range(num_layers)]
        )

    def forward(self, inputs: Tensor, input_lengths: Tensor = None) -> Tuple[Tensor, Tensor]:
        self_attns = list()

        non_pad_mask = get_pad_mask(inputs, input_lengths=input_lengths).eq(False)
        length = inputs.size(1)
        self_attn_mask = get_attn_pad_mask(inputs, input_lengths, length)

        output = self.input_dropout(
            self.input_layer_norm(self.input_proj(inputs))
            + self.positional_encoding(inputs.size(1))
        )

        for layer in self.layers:
            output, attn = layer(output, non_pad_mask, self_attn_mask)
            self_attns.append(attn)

        return output, self_attns


class SpeechTransformerDecoder(nn.Module):
    def __init__(self, num_classes: int, d_model: int = 512, d_ff: int = 512,
                 num_layers: int = 6, num_heads: int = 8, ffnet_style: str = 'ff',
                 dropout_p: float = 0.3, pad_id: int = 0, eos_id: int = 2) -> None:
        super(SpeechTransformerDecoder, self).__init__()
        self.d_model = d_model
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.embedding = Embedding(num_classes, pad_id, d_model)
        self.positional_encoding = PositionalEncoding(d_model)
        self.input_dropout = nn.Dropout(p=dropout_p)
        self.layers = nn.ModuleList(
            [SpeechTransformerDecoderLayer(d_model, num_heads, d_ff, dropout_p, ffnet_style) for _ in range(num_layers)]
        )
        self.pad_id = pad_id
        self.eos_id = eos_id
        self.generator = Linear(d_model, num_classes)

        self.generator.weight = self.embedding.embedding.weight
        self.logit_scale = (d_model ** 0.5)

    def forward(self, targets: Tensor, input_lengths: Optional[Any] = None,
                memory: Tensor = None) -> Tuple[Tensor, Tensor, Tensor]:
        self_attns, memory_attns = list(), list()

        non_pad_mask = get_pad_mask(targets, pad_id=self.eos_id).eq(False)
        self_attn_mask = get_attn_key_pad_mask(targets, targets, self.eos_id) | get_subsequent_mask(targets)

        output_length = targets.size(1)
        memory_mask = get_attn_pad_mask(memory, input_lengths, output_length)

        output = self.input_dropout(
            self.embedding(targets)
            * self.logit_scale
            + self.positional_encoding(targets.size(1))
        )

        for layer in self.layers:
            output, self_attn, memory_attn = layer(output, memory, non_pad_mask, self_attn_mask, memory_mask)
            self_attns.append(self_attn)
            memory_attns.append(memory_attn)

        output = self.generator(output)
        output = F.log_softmax(output, dim=-1)

        return output, self_attns, memory_attns


def main():
    torch.manual_seed(0)
    num_classes, sos_id, eos_id, pad_id = 12, 1, 2, 0
    model = SpeechTransformer(
        num_classes=num_classes, d_model=16, input_dim=8, pad_id=pad_id, eos_id=eos_id,
        d_ff=32, num_heads=4, num_encoder_layers=2, num_decoder_layers=2, dropout_p=0.1,
    ).eval()

    # two utterances of log-mel-like features, zero-padded to the longest, and their transcripts
    # ([sos] tokens [eos], padded with eos as the decoder's pad id)
    input_lengths = torch.tensor([12, 7])
    inputs = torch.randn(2, 12, 8)
    inputs[1, 7:] = 0.0
    targets = torch.tensor([[sos_id, 5, 6, 7, 8, 9],
                            [sos_id, 10, 3, 4, eos_id, eos_id]])

    with torch.no_grad():
        log_probs = model(inputs, input_lengths, targets)

    # teacher-forced NLL of the next token, per utterance
    for b in range(2):
        n = int((targets[b] != eos_id).sum())
        gold = torch.cat([targets[b, 1:n], torch.tensor([eos_id])])
        nll = F.nll_loss(log_probs[b, :n], gold)
        print(f"utterance {b}: nll={nll.item():.6f} argmax={log_probs[b, :n].argmax(-1).tolist()}")


if __name__ == "__main__":
    main()
