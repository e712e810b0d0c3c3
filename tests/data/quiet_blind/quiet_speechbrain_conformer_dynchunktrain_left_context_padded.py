# Citation: speechbrain/speechbrain @9c826ef3937bac885c8a6ca86c6889a30f256fb5
#   speechbrain/lobes/models/transformer/TransformerASR.py (make_transformer_src_mask with a DynChunkTrainConfig:
#   future beyond each chunk masked, past before `left_context_size` chunks masked, bool True = may not attend;
#   make_transformer_src_tgt_masks: src_key_padding_mask = ~length_to_mask(round(wav_len * T)); TransformerASR.encode),
#   speechbrain/lobes/models/transformer/Conformer.py (ConformerEncoder / ConformerEncoderLayer with
#   attention_type="regularMHA", ConvolutionModule's Dynamic Chunk Convolution), speechbrain/nnet/attention.py
#   (MultiheadAttention: batch-first in, permuted to (T, B, E) for nn.MultiheadAttention, need_weights=True),
#   speechbrain/utils/dynamic_chunk_training.py (DynChunkTrainConfig), speechbrain/nnet/losses.py (ctc_loss).
# A right-padded batch of three utterances (20, 16, 12 frames of 20; wav_len relative, as SpeechBrain passes it)
# encoded in the masked (training / evaluation) form of chunked streaming: chunks of 4 frames, 2 chunks of left
# context. Lengths are whole chunks (the chunked convolution reads its own chunk, padding included) and every padded
# frame has a real frame in its context. Checked against each utterance alone, unpadded, no key padding mask, with a
# double-loop mask (j // 4 <= i // 4 and j // 4 >= i // 4 - 2): encoder output on real frames and per-utterance CTC loss.
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


@dataclass
class DynChunkTrainConfig:
    chunk_size: int
    left_context_size: Optional[int] = None

    def is_infinite_left_context(self) -> bool:
        return self.left_context_size is None


def length_to_mask(length, max_len=None, dtype=None, device=None):
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len) < length.unsqueeze(1)
    return torch.as_tensor(mask, dtype=dtype or length.dtype, device=device or length.device)


def make_transformer_src_mask(src, causal=False, dynchunktrain_config=None):
    if causal:
        raise NotImplementedError
    if dynchunktrain_config is None:
        return
    timesteps = src.size(1)
    chunk_size = dynchunktrain_config.chunk_size
    num_chunks = timesteps // chunk_size
    timestep_idx = torch.arange(timesteps, device=src.device)
    mask_idx = torch.arange(chunk_size, chunk_size * (num_chunks + 2), chunk_size,
                            device=src.device).repeat_interleave(chunk_size)[:timesteps]
    src_mask = timestep_idx[None] >= mask_idx[:, None]
    if not dynchunktrain_config.is_infinite_left_context():
        num_left_chunks = dynchunktrain_config.left_context_size
        mask_idx -= chunk_size * (num_left_chunks + 1)
        src_mask += timestep_idx[None] < mask_idx[:, None]
    return src_mask


def make_transformer_src_tgt_masks(src, tgt=None, wav_len=None, pad_idx=0, causal=False, dynchunktrain_config=None):
    src_key_padding_mask = None
    if wav_len is not None:
        abs_len = torch.round(wav_len * src.shape[1])
        src_key_padding_mask = ~length_to_mask(abs_len).bool()
    src_mask = make_transformer_src_mask(src, causal=causal, dynchunktrain_config=dynchunktrain_config)
    return src_key_padding_mask, None, src_mask, None


class Swish(nn.Module):
    def forward(self, x):
        return x * torch.sigmoid(x)


class MultiheadAttention(nn.Module):
    def __init__(self, nhead, d_model, dropout=0.0):
        super().__init__()
        self.att = nn.MultiheadAttention(embed_dim=d_model, num_heads=nhead, dropout=dropout)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, return_attn_weights=True,
                pos_embs=None):
        query = query.permute(1, 0, 2)
        key = key.permute(1, 0, 2)
        value = value.permute(1, 0, 2)
        output, attention_weights = self.att(query, key, value, attn_mask=attn_mask,
                                             key_padding_mask=key_padding_mask, need_weights=return_attn_weights)
        return output.permute(1, 0, 2), attention_weights


class PositionalwiseFeedForward(nn.Module):
    def __init__(self, d_ffn, input_size, dropout=0.0, activation=nn.ReLU):
        super().__init__()
        self.ffn = nn.Sequential(nn.Linear(input_size, d_ffn), activation(), nn.Dropout(dropout),
                                 nn.Linear(d_ffn, input_size))

    def forward(self, x):
        return self.ffn(x)


class PositionalEncoding(nn.Module):
    def __init__(self, input_size, max_len=2500):
        super().__init__()
        pe = torch.zeros(max_len, input_size, requires_grad=False)
        positions = torch.arange(0, max_len).unsqueeze(1).float()
        denominator = torch.exp(torch.arange(0, input_size, 2).float() * -(math.log(10000.0) / input_size))
        pe[:, 0::2] = torch.sin(positions * denominator)
        pe[:, 1::2] = torch.cos(positions * denominator)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, :x.size(1)].clone().detach()


class ConvolutionModule(nn.Module):
    def __init__(self, input_size, kernel_size=31, bias=True, activation=Swish, dropout=0.0):
        super().__init__()
        self.padding = (kernel_size - 1) // 2
        self.layer_norm = nn.LayerNorm(input_size)
        self.bottleneck = nn.Sequential(nn.Conv1d(input_size, 2 * input_size, kernel_size=1, stride=1, bias=bias),
                                        nn.GLU(dim=1))
        self.conv = nn.Conv1d(input_size, input_size, kernel_size=kernel_size, stride=1, padding=self.padding,
                              groups=input_size, bias=bias)
        self.after_conv = nn.Sequential(nn.LayerNorm(input_size), activation(),
                                        nn.Linear(input_size, input_size, bias=bias), nn.Dropout(dropout))

    def forward(self, x, mask=None, dynchunktrain_config=None):
        if dynchunktrain_config is not None:
            chunk_size = dynchunktrain_config.chunk_size
            batch_size = x.shape[0]
            if x.shape[1] % chunk_size != 0:
                final_right_padding = chunk_size - (x.shape[1] % chunk_size)
            else:
                final_right_padding = 0
            out = self.layer_norm(x)
            out = out.transpose(1, 2)
            out = self.bottleneck(out)
            out = F.pad(out, (self.padding, final_right_padding), value=0)
            out = out.unfold(2, size=chunk_size + self.padding, step=chunk_size)
            out = F.pad(out, (0, self.padding), value=0)
            out = out.transpose(1, 2)
            out = out.flatten(start_dim=0, end_dim=1)
            out = F.conv1d(out, weight=self.conv.weight, bias=self.conv.bias, stride=self.conv.stride, padding=0,
                           dilation=self.conv.dilation, groups=self.conv.groups)
            out = out.transpose(1, 2)
            out = self.after_conv(out)
            out = torch.unflatten(out, dim=0, sizes=(batch_size, -1))
            out = torch.flatten(out, start_dim=1, end_dim=2)
            if final_right_padding > 0:
                out = out[:, :-final_right_padding, :]
        else:
            out = self.layer_norm(x).transpose(1, 2)
            out = self.conv(self.bottleneck(out)).transpose(1, 2)
            out = self.after_conv(out)
        if mask is not None:
            out.masked_fill_(mask, 0.0)
        return out


class ConformerEncoderLayer(nn.Module):
    def __init__(self, d_model, d_ffn, nhead, kernel_size=31, activation=Swish, bias=True, dropout=0.0,
                 attention_type="regularMHA"):
        super().__init__()
        assert attention_type == "regularMHA"
        self.mha_layer = MultiheadAttention(nhead=nhead, d_model=d_model, dropout=dropout)
        self.convolution_module = ConvolutionModule(d_model, kernel_size, bias, activation, dropout)
        self.ffn_module1 = nn.Sequential(nn.LayerNorm(d_model),
                                         PositionalwiseFeedForward(d_ffn, d_model, dropout, activation),
                                         nn.Dropout(dropout))
        self.ffn_module2 = nn.Sequential(nn.LayerNorm(d_model),
                                         PositionalwiseFeedForward(d_ffn, d_model, dropout, activation),
                                         nn.Dropout(dropout))
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)

    def forward(self, x, src_mask=None, src_key_padding_mask=None, pos_embs=None, dynchunktrain_config=None):
        conv_mask = None
        if src_key_padding_mask is not None:
            conv_mask = src_key_padding_mask.unsqueeze(-1)
        x = x + 0.5 * self.ffn_module1(x)
        skip = x
        x = self.norm1(x)
        x, self_attn = self.mha_layer(x, x, x, attn_mask=src_mask, key_padding_mask=src_key_padding_mask,
                                      pos_embs=pos_embs)
        x = x + skip
        x = x + self.convolution_module(x, conv_mask, dynchunktrain_config=dynchunktrain_config)
        x = self.norm2(x + 0.5 * self.ffn_module2(x))
        return x, self_attn


class ConformerEncoder(nn.Module):
    def __init__(self, num_layers, d_model, d_ffn, nhead, kernel_size=31, attention_type="regularMHA"):
        super().__init__()
        self.layers = nn.ModuleList([
            ConformerEncoderLayer(d_model, d_ffn, nhead, kernel_size, attention_type=attention_type)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos_embs=None, dynchunktrain_config=None):
        output = src
        attention_lst = []
        for enc_layer in self.layers:
            output, attention = enc_layer(output, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                          pos_embs=pos_embs, dynchunktrain_config=dynchunktrain_config)
            attention_lst.append(attention)
        return self.norm(output), attention_lst


class TransformerASREncoder(nn.Module):
    """TransformerASR.encode with encoder_module="conformer", attention_type="regularMHA", fixed_abs_sine."""

    def __init__(self, input_size=20, d_model=32, nhead=4, num_encoder_layers=2, d_ffn=64, kernel_size=5,
                 n_tokens=10):
        super().__init__()
        self.causal = False
        self.custom_src_module = nn.Sequential(nn.Linear(input_size, d_model), nn.Dropout(0.0))
        self.positional_encoding = PositionalEncoding(d_model)
        self.encoder = ConformerEncoder(num_encoder_layers, d_model, d_ffn, nhead, kernel_size)
        self.ctc_lin = nn.Linear(d_model, n_tokens)

    def encode(self, src, wav_len=None, pad_idx=0, dynchunktrain_config=None, src_mask_override=None):
        src_key_padding_mask, _, src_mask, _ = make_transformer_src_tgt_masks(
            src, None, wav_len, pad_idx=pad_idx, causal=self.causal, dynchunktrain_config=dynchunktrain_config)
        if src_mask_override is not None:
            src_mask = src_mask_override
        src = self.custom_src_module(src)
        src = src + self.positional_encoding(src)
        encoder_out, _ = self.encoder(src=src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                      pos_embs=None, dynchunktrain_config=dynchunktrain_config)
        return encoder_out


def ctc_loss(log_probs, targets, input_lens, target_lens, blank_index=0):
    input_lens = (input_lens * log_probs.shape[1]).round().int()
    target_lens = (target_lens * targets.shape[1]).round().int()
    log_probs = log_probs.transpose(0, 1)
    return F.ctc_loss(log_probs, targets, input_lens, target_lens, blank_index, zero_infinity=True, reduction="none")


def main():
    model = TransformerASREncoder().eval()
    cfg = DynChunkTrainConfig(chunk_size=4, left_context_size=2)
    T = 20
    lengths = [20, 16, 12]
    feats = torch.randn(3, T, 20)
    for b, n in enumerate(lengths):
        feats[b, n:] = 0.0
    wav_lens = torch.tensor([n / T for n in lengths])
    tokens = torch.tensor([[3, 5, 2, 7], [4, 4, 9, 0], [1, 6, 0, 0]])
    tok_lens = torch.tensor([4 / 4, 3 / 4, 2 / 4])

    with torch.no_grad():
        enc = model.encode(feats, wav_lens, dynchunktrain_config=cfg)
        logp = F.log_softmax(model.ctc_lin(enc), dim=-1)
        loss = ctc_loss(logp, tokens, wav_lens, tok_lens)

        for b, n in enumerate(lengths):
            C, L = cfg.chunk_size, cfg.left_context_size
            blocked = torch.zeros(n, n, dtype=torch.bool)
            for i in range(n):
                for j in range(n):
                    blocked[i, j] = not (j // C <= i // C and j // C >= i // C - L)
            ref = model.encode(feats[b:b + 1, :n], None, dynchunktrain_config=cfg, src_mask_override=blocked)
            assert torch.allclose(enc[b, :n], ref[0], atol=1e-5), b
            ref_logp = F.log_softmax(model.ctc_lin(ref), dim=-1)
            n_tok = int(round(float(tok_lens[b]) * tokens.shape[1]))
            ref_loss = F.ctc_loss(ref_logp.transpose(0, 1), tokens[b:b + 1, :n_tok], torch.tensor([n]),
                                  torch.tensor([n_tok]), 0, zero_infinity=True, reduction="none")
            assert torch.allclose(loss[b], ref_loss[0], atol=1e-5), b
    print("ok: SpeechBrain DynChunkTrain conformer (chunk 4, 2 left chunks, right-padded) matches per-utterance reference")


if __name__ == "__main__":
    main()
