# earthspecies/avex commit 2006604 (PR #26, "bug fix in padding -> beats and aves expect the inverse mask").
#
# representation_learning/data/dataset.py Collater pads every clip to audio_max_length_seconds * sr with
# representation_learning/data/audio_utils.py pad_or_window, which returned a mask with True on the real
# samples and False on the zero padding. The batch's "padding_mask" goes to the BEATs wrapper
# (models/beats_model.py) and on to BEATs.extract_features / TransformerEncoder / MultiheadAttention
# (models/beats/beats.py, backbone.py), which read it as True = padding: key_padding_mask, x[padding_mask] = 0
# and the masked mean-pooling.
# Fix: pad_or_window builds the real-sample mask and inverts it (invert=True by default), so True = padding.
#
# Ported trimmed; the BEATs config is the pretrained BEATs checkpoint's kind (patch 16, relative position
# bias with gated relative positions, deep norm) at tiny sizes. torchaudio's kaldi fbank is replaced by a
# torch-only Kaldi-style fbank (25 ms / 10 ms frames, povey window, 128 mel bins).
import math
import sys
from typing import Any, Literal, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn import LayerNorm

FIXED = "--fixed" in sys.argv


# --------------------------------------------------------------------------- #
#  representation_learning/data/audio_utils.py
# --------------------------------------------------------------------------- #
if not FIXED:

    def pad_or_window(
        wav: torch.Tensor,
        target_len: int,
        window_selection: Literal["random", "center"] = "random",
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        wav_len = wav.size(-1)

        if wav_len == target_len:
            mask = torch.ones(target_len, dtype=torch.bool)
            return wav, mask

        if wav_len > target_len:  # crop
            if window_selection == "random":
                start = torch.randint(0, wav_len - target_len + 1, ()).item()
                end = start + target_len
                return wav[..., start:end], torch.ones(target_len, dtype=torch.bool)
            elif window_selection == "center":
                start = (wav_len - target_len) // 2
                end = start + target_len
                return wav[..., start:end], torch.ones(target_len, dtype=torch.bool)
            elif window_selection == "start":
                return wav[..., :target_len], torch.ones(target_len, dtype=torch.bool)
            else:
                raise ValueError(f"Unknown window selection: {window_selection}")

        # pad
        pad_len = target_len - wav_len
        padded = F.pad(wav, (0, pad_len))
        mask = torch.zeros(target_len, dtype=torch.bool)
        mask[:wav_len] = True
        return padded, mask

else:

    def pad_or_window(
        wav: torch.Tensor,
        target_len: int,
        window_selection: Literal["random", "center"] = "random",
        invert: bool = True,
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        wav_len = wav.size(-1)
        mask = torch.ones(target_len, dtype=torch.bool)
        processed_wav = wav

        if wav_len == target_len:
            pass
        elif wav_len > target_len:  # crop
            if window_selection == "random":
                start = torch.randint(0, wav_len - target_len + 1, ()).item()
                end = start + target_len
                processed_wav = wav[..., start:end]
            elif window_selection == "center":
                start = (wav_len - target_len) // 2
                end = start + target_len
                processed_wav = wav[..., start:end]
            elif window_selection == "start":
                processed_wav = wav[..., :target_len]
            else:
                raise ValueError(f"Unknown window selection: {window_selection}")
        else:  # pad
            pad_len = target_len - wav_len
            processed_wav = F.pad(wav, (0, pad_len))
            mask[wav_len:] = False

        if invert:
            mask = ~mask

        return processed_wav, mask


# --------------------------------------------------------------------------- #
#  representation_learning/data/dataset.py
# --------------------------------------------------------------------------- #
class Collater:
    def __init__(self, audio_max_length_seconds: float, sr: int, window_selection: str = "random") -> None:
        self.audio_max_length_seconds = audio_max_length_seconds
        self.window_selection = window_selection
        self.sr = sr

    def __call__(self, batch: list[dict[str, Any]]) -> dict[str, Any]:
        audios, masks, labels = [], [], []
        for item in batch:
            wav = torch.as_tensor(item["raw_wav"])  # (T,)
            wav, pad_mask = pad_or_window(
                wav, int(self.audio_max_length_seconds * self.sr), self.window_selection
            )
            audios.append(wav)
            masks.append(pad_mask)
            labels.append(item["label"])

        audio_tensor = torch.stack(audios)  # [B, T] float32
        mask_tensor = torch.stack(masks)  # [B, T] bool
        label_tensor = torch.tensor(labels, dtype=torch.long)
        return {"raw_wav": audio_tensor, "padding_mask": mask_tensor, "label": label_tensor}


# --------------------------------------------------------------------------- #
#  Kaldi-style fbank (stand-in for torchaudio.compliance.kaldi.fbank)
# --------------------------------------------------------------------------- #
def _mel(f):
    return 1127.0 * torch.log(1.0 + f / 700.0)


def kaldi_fbank(waveform, num_mel_bins=128, sample_frequency=16000, frame_length=25, frame_shift=10):
    wav = waveform[0]
    win = int(sample_frequency * frame_length / 1000)
    shift = int(sample_frequency * frame_shift / 1000)
    n_frames = 1 + (wav.numel() - win) // shift
    frames = wav.unfold(0, win, shift)[:n_frames]
    frames = frames - frames.mean(dim=1, keepdim=True)
    frames = torch.cat([frames[:, :1] - 0.97 * frames[:, :1], frames[:, 1:] - 0.97 * frames[:, :-1]], dim=1)
    window = torch.hann_window(win, periodic=False).pow(0.85)
    frames = frames * window
    n_fft = 1 << (win - 1).bit_length()
    spec = torch.fft.rfft(frames, n=n_fft).abs().pow(2)
    fft_freqs = torch.arange(n_fft // 2 + 1) * sample_frequency / n_fft
    mel_pts = torch.linspace(_mel(torch.tensor(20.0)), _mel(torch.tensor(sample_frequency / 2.0)), num_mel_bins + 2)
    mf = _mel(fft_freqs)
    left, center, right = mel_pts[:-2, None], mel_pts[1:-1, None], mel_pts[2:, None]
    banks = torch.clamp(torch.minimum((mf - left) / (center - left), (right - mf) / (right - center)), min=0.0)
    return torch.log(torch.clamp(spec @ banks.T, min=torch.finfo(torch.float32).eps))


# --------------------------------------------------------------------------- #
#  representation_learning/models/beats/modules.py
# --------------------------------------------------------------------------- #
class SamePad(nn.Module):
    def __init__(self, kernel_size, causal=False):
        super().__init__()
        if causal:
            self.remove = kernel_size - 1
        else:
            self.remove = 1 if kernel_size % 2 == 0 else 0

    def forward(self, x):
        if self.remove > 0:
            x = x[:, :, : -self.remove]
        return x


# --------------------------------------------------------------------------- #
#  representation_learning/models/beats/backbone.py
# --------------------------------------------------------------------------- #
class TransformerEncoder(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.dropout = args.dropout
        self.embedding_dim = args.encoder_embed_dim

        self.pos_conv = nn.Conv1d(
            self.embedding_dim,
            self.embedding_dim,
            kernel_size=args.conv_pos,
            padding=args.conv_pos // 2,
            groups=args.conv_pos_groups,
        )
        dropout = 0
        std = math.sqrt((4 * (1.0 - dropout)) / (args.conv_pos * self.embedding_dim))
        nn.init.normal_(self.pos_conv.weight, mean=0, std=std)
        nn.init.constant_(self.pos_conv.bias, 0)
        self.pos_conv = nn.Sequential(self.pos_conv, SamePad(args.conv_pos), nn.GELU())

        self.relative_position_embedding = args.relative_position_embedding
        self.num_buckets = args.num_buckets
        self.max_distance = args.max_distance

        self.layers = nn.ModuleList(
            [
                TransformerSentenceEncoderLayer(
                    embedding_dim=self.embedding_dim,
                    ffn_embedding_dim=args.encoder_ffn_embed_dim,
                    num_attention_heads=args.encoder_attention_heads,
                    dropout=self.dropout,
                    attention_dropout=args.attention_dropout,
                    activation_dropout=args.activation_dropout,
                    layer_norm_first=args.layer_norm_first,
                    deep_norm=args.deep_norm,
                    has_relative_attention_bias=self.relative_position_embedding,
                    num_buckets=self.num_buckets,
                    max_distance=self.max_distance,
                    gru_rel_pos=args.gru_rel_pos,
                    encoder_layers=args.encoder_layers,
                )
                for i in range(args.encoder_layers)
            ]
        )
        if self.relative_position_embedding:
            for i in range(1, args.encoder_layers):
                del self.layers[i].self_attn.relative_attention_bias
                self.layers[i].self_attn.relative_attention_bias = self.layers[0].self_attn.relative_attention_bias

        self.layer_norm_first = args.layer_norm_first
        self.layer_norm = LayerNorm(self.embedding_dim)
        self.layerdrop = args.encoder_layerdrop

    def forward(self, x, padding_mask=None, layer=None):
        x, layer_results = self.extract_features(x, padding_mask, layer)
        if self.layer_norm_first and layer is None:
            x = self.layer_norm(x)
        return x, layer_results

    def extract_features(self, x, padding_mask=None, tgt_layer=None):
        if padding_mask is not None:
            x[padding_mask] = 0

        x_conv = self.pos_conv(x.transpose(1, 2))
        x_conv = x_conv.transpose(1, 2)
        x = x + x_conv

        if not self.layer_norm_first:
            x = self.layer_norm(x)

        x = F.dropout(x, p=self.dropout, training=self.training)

        # B x T x C -> T x B x C
        x = x.transpose(0, 1)

        layer_results = []
        z = None
        r = None
        pos_bias = None
        for i, layer in enumerate(self.layers):
            dropout_probability = np.random.random()
            if not self.training or (dropout_probability > self.layerdrop):
                x, z, pos_bias = layer(x, self_attn_padding_mask=padding_mask, need_weights=False, pos_bias=pos_bias)
            if tgt_layer is not None:
                layer_results.append((x, z))
            if i == tgt_layer:
                r = x
                break

        if r is not None:
            x = r

        # T x B x C -> B x T x C
        x = x.transpose(0, 1)
        return x, layer_results


class TransformerSentenceEncoderLayer(nn.Module):
    def __init__(
        self,
        embedding_dim=768,
        ffn_embedding_dim=3072,
        num_attention_heads=8,
        dropout=0.1,
        attention_dropout=0.1,
        activation_dropout=0.1,
        layer_norm_first=False,
        deep_norm=False,
        has_relative_attention_bias=False,
        num_buckets=0,
        max_distance=0,
        gru_rel_pos=False,
        encoder_layers=0,
    ) -> None:
        super().__init__()
        self.embedding_dim = embedding_dim
        self.activation_fn = F.gelu
        self.self_attn = MultiheadAttention(
            self.embedding_dim,
            num_attention_heads,
            dropout=attention_dropout,
            self_attention=True,
            has_relative_attention_bias=has_relative_attention_bias,
            num_buckets=num_buckets,
            max_distance=max_distance,
            gru_rel_pos=gru_rel_pos,
        )
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(activation_dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.layer_norm_first = layer_norm_first
        self.self_attn_layer_norm = LayerNorm(self.embedding_dim)
        self.fc1 = nn.Linear(self.embedding_dim, ffn_embedding_dim)
        self.fc2 = nn.Linear(ffn_embedding_dim, self.embedding_dim)
        self.final_layer_norm = LayerNorm(self.embedding_dim)
        self.deep_norm = deep_norm
        if self.deep_norm:
            self.deep_norm_alpha = math.pow(2 * encoder_layers, 1 / 4)
        else:
            self.deep_norm_alpha = 1

    def forward(self, x, self_attn_mask=None, self_attn_padding_mask=None, need_weights=False, pos_bias=None):
        residual = x
        x, attn, pos_bias = self.self_attn(
            query=x,
            key=x,
            value=x,
            key_padding_mask=self_attn_padding_mask,
            need_weights=need_weights,
            attn_mask=self_attn_mask,
            position_bias=pos_bias,
        )
        x = self.dropout1(x)
        x = residual * self.deep_norm_alpha + x
        x = self.self_attn_layer_norm(x)

        residual = x
        x = self.activation_fn(self.fc1(x))
        x = self.dropout2(x)
        x = self.fc2(x)
        x = self.dropout3(x)
        x = residual * self.deep_norm_alpha + x
        x = self.final_layer_norm(x)
        return x, attn, pos_bias


class MultiheadAttention(nn.Module):
    def __init__(
        self,
        embed_dim,
        num_heads,
        dropout=0.0,
        bias=True,
        self_attention=False,
        has_relative_attention_bias=False,
        num_buckets=32,
        max_distance=128,
        gru_rel_pos=False,
    ):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.dropout_module = nn.Dropout(dropout)

        self.has_relative_attention_bias = has_relative_attention_bias
        self.num_buckets = num_buckets
        self.max_distance = max_distance
        if self.has_relative_attention_bias:
            self.relative_attention_bias = nn.Embedding(num_buckets, num_heads)

        self.head_dim = embed_dim // num_heads
        self.q_head_dim = self.head_dim
        self.k_head_dim = self.head_dim
        self.scaling = self.head_dim**-0.5
        self.self_attention = self_attention

        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=True)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=bias)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=bias)

        self.gru_rel_pos = gru_rel_pos
        if self.gru_rel_pos:
            self.grep_linear = nn.Linear(self.q_head_dim, 8)
            self.grep_a = nn.Parameter(torch.ones(1, num_heads, 1, 1))

        nn.init.xavier_uniform_(self.k_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.v_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.q_proj.weight, gain=1 / math.sqrt(2))
        nn.init.xavier_uniform_(self.out_proj.weight)
        if self.out_proj.bias is not None:
            nn.init.constant_(self.out_proj.bias, 0.0)
        if self.has_relative_attention_bias:
            nn.init.xavier_normal_(self.relative_attention_bias.weight)

    def _relative_positions_bucket(self, relative_positions, bidirectional=True):
        num_buckets = self.num_buckets
        max_distance = self.max_distance
        relative_buckets = 0

        if bidirectional:
            num_buckets = num_buckets // 2
            relative_buckets += (relative_positions > 0).to(torch.long) * num_buckets
            relative_positions = torch.abs(relative_positions)
        else:
            relative_positions = -torch.min(relative_positions, torch.zeros_like(relative_positions))

        max_exact = num_buckets // 2
        is_small = relative_positions < max_exact

        relative_postion_if_large = max_exact + (
            torch.log(relative_positions.float() / max_exact)
            / math.log(max_distance / max_exact)
            * (num_buckets - max_exact)
        ).to(torch.long)
        relative_postion_if_large = torch.min(
            relative_postion_if_large, torch.full_like(relative_postion_if_large, num_buckets - 1)
        )

        relative_buckets += torch.where(is_small, relative_positions, relative_postion_if_large)
        return relative_buckets

    def compute_bias(self, query_length, key_length):
        context_position = torch.arange(query_length, dtype=torch.long)[:, None]
        memory_position = torch.arange(key_length, dtype=torch.long)[None, :]
        relative_position = memory_position - context_position
        relative_position_bucket = self._relative_positions_bucket(relative_position, bidirectional=True)
        relative_position_bucket = relative_position_bucket.to(self.relative_attention_bias.weight.device)
        values = self.relative_attention_bias(relative_position_bucket)
        values = values.permute([2, 0, 1])
        return values

    def forward(
        self,
        query,
        key: Optional[Tensor],
        value: Optional[Tensor],
        key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[Tensor] = None,
        position_bias: Optional[Tensor] = None,
    ):
        tgt_len, bsz, embed_dim = query.size()
        src_len = tgt_len
        if key is not None:
            src_len, key_bsz, _ = key.size()

        if self.has_relative_attention_bias and position_bias is None:
            position_bias = self.compute_bias(tgt_len, src_len)
            position_bias = position_bias.unsqueeze(0).repeat(bsz, 1, 1, 1).view(bsz * self.num_heads, tgt_len, src_len)

        q = self.q_proj(query)
        k = self.k_proj(query)
        v = self.v_proj(query)
        q *= self.scaling
        alpha = 32
        q *= 1 / alpha

        q = q.contiguous().view(tgt_len, bsz * self.num_heads, self.q_head_dim).transpose(0, 1)
        k = k.contiguous().view(-1, bsz * self.num_heads, self.k_head_dim).transpose(0, 1)
        v = v.contiguous().view(-1, bsz * self.num_heads, self.head_dim).transpose(0, 1)

        if key_padding_mask is not None and key_padding_mask.dim() == 0:
            key_padding_mask = None

        if key_padding_mask is not None:
            assert key_padding_mask.size(0) == bsz
            assert key_padding_mask.size(1) == src_len

        attn_weights = torch.bmm(q, k.transpose(1, 2))
        attn_weights = (attn_weights - attn_weights.max(dim=-1, keepdim=True)[0]) * alpha

        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(0)
            attn_weights += attn_mask

        if key_padding_mask is not None:
            # don't attend to padding symbols
            attn_weights = attn_weights.view(bsz, self.num_heads, tgt_len, src_len)
            attn_weights = attn_weights.masked_fill(
                key_padding_mask.unsqueeze(1).unsqueeze(2).to(torch.bool),
                float("-inf"),
            )
            attn_weights = attn_weights.view(bsz * self.num_heads, tgt_len, src_len)

        if position_bias is not None:
            attn_mask_rel_pos = position_bias
            if self.gru_rel_pos == 1:
                query_layer = q.view(bsz, self.num_heads, tgt_len, self.q_head_dim) * alpha / self.scaling
                _B, _H, _L, __ = query_layer.size()
                gate_a, gate_b = torch.sigmoid(
                    self.grep_linear(query_layer).view(_B, _H, _L, 2, 4).sum(-1, keepdim=False)
                ).chunk(2, dim=-1)
                gate_a_1 = gate_a * (gate_b * self.grep_a - 1.0) + 2.0
                attn_mask_rel_pos = gate_a_1.view(bsz * self.num_heads, tgt_len, 1) * position_bias

            attn_mask_rel_pos = attn_mask_rel_pos.view(attn_weights.size())
            attn_weights = attn_weights + attn_mask_rel_pos

        attn_weights_float = F.softmax(attn_weights, dim=-1)
        attn_weights = attn_weights_float.type_as(attn_weights)
        attn_probs = self.dropout_module(attn_weights)

        attn = torch.bmm(attn_probs, v)
        attn = attn.transpose(0, 1).contiguous().view(tgt_len, bsz, embed_dim)
        attn = self.out_proj(attn)
        return attn, None, position_bias


# --------------------------------------------------------------------------- #
#  representation_learning/models/beats/beats.py
# --------------------------------------------------------------------------- #
class BEATsConfig:
    def __init__(self, cfg=None):
        self.input_patch_size: int = -1
        self.embed_dim: int = 512
        self.conv_bias: bool = False
        self.encoder_layers: int = 12
        self.encoder_embed_dim: int = 768
        self.encoder_ffn_embed_dim: int = 3072
        self.encoder_attention_heads: int = 12
        self.activation_fn: str = "gelu"
        self.layer_norm_first: bool = False
        self.deep_norm: bool = False
        self.dropout: float = 0.1
        self.attention_dropout: float = 0.1
        self.activation_dropout: float = 0.0
        self.encoder_layerdrop: float = 0.0
        self.dropout_input: float = 0.0
        self.conv_pos: int = 128
        self.conv_pos_groups: int = 16
        self.relative_position_embedding: bool = False
        self.num_buckets: int = 320
        self.max_distance: int = 1280
        self.gru_rel_pos: bool = False
        self.finetuned_model: bool = False
        if cfg is not None:
            self.update(cfg)

    def update(self, cfg: dict):
        self.__dict__.update(cfg)


class BEATs(nn.Module):
    def __init__(self, cfg: BEATsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = cfg.embed_dim
        self.post_extract_proj = (
            nn.Linear(self.embed, cfg.encoder_embed_dim) if self.embed != cfg.encoder_embed_dim else None
        )
        self.input_patch_size = cfg.input_patch_size
        self.patch_embedding = nn.Conv2d(
            1, self.embed, kernel_size=self.input_patch_size, stride=self.input_patch_size, bias=cfg.conv_bias
        )
        self.dropout_input = nn.Dropout(cfg.dropout_input)
        assert not cfg.deep_norm or not cfg.layer_norm_first
        self.encoder = TransformerEncoder(cfg)
        self.layer_norm = LayerNorm(self.embed)
        self.predictor = None

    def forward_padding_mask(self, features: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        extra = padding_mask.size(1) % features.size(1)
        if extra > 0:
            padding_mask = padding_mask[:, :-extra]
        padding_mask = padding_mask.view(padding_mask.size(0), features.size(1), -1)
        padding_mask = padding_mask.all(-1)
        return padding_mask

    def preprocess(self, source: torch.Tensor, fbank_mean: float = 15.41663, fbank_std: float = 6.55582) -> torch.Tensor:
        fbanks = []
        for waveform in source:
            waveform = waveform.unsqueeze(0) * 2**15
            fbank = kaldi_fbank(waveform, num_mel_bins=128, sample_frequency=16000, frame_length=25, frame_shift=10)
            fbanks.append(fbank)
        fbank = torch.stack(fbanks, dim=0)
        fbank = (fbank - fbank_mean) / (2 * fbank_std)
        return fbank

    def extract_features(self, source, padding_mask=None, fbank_mean=15.41663, fbank_std=6.55582, feature_only=False):
        fbank = self.preprocess(source, fbank_mean=fbank_mean, fbank_std=fbank_std).to(torch.float32)

        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(fbank, padding_mask)

        fbank = fbank.unsqueeze(1)
        features = self.patch_embedding(fbank)
        features = features.reshape(features.shape[0], features.shape[1], -1)
        features = features.transpose(1, 2)
        features = self.layer_norm(features)

        if padding_mask is not None:
            padding_mask = self.forward_padding_mask(features, padding_mask)

        if self.post_extract_proj is not None:
            features = self.post_extract_proj(features)

        x = self.dropout_input(features)
        x, layer_results = self.encoder(x, padding_mask=padding_mask)
        return x, padding_mask

    def forward(self, source: torch.Tensor, padding_mask: Optional[torch.Tensor] = None):
        return self.extract_features(source, padding_mask, feature_only=True)


# --------------------------------------------------------------------------- #
#  representation_learning/models/beats_model.py
# --------------------------------------------------------------------------- #
class Model(nn.Module):
    def __init__(self, *, num_classes: int, cfg: BEATsConfig) -> None:
        super().__init__()
        self.backbone = BEATs(cfg)
        self.classifier = nn.Linear(cfg.encoder_embed_dim, num_classes)

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        features, frame_padding = self.backbone(x, padding_mask)
        # features: (B, T', D)
        # frame_padding: (B, T') or None
        if frame_padding is not None and frame_padding.any():
            masked_features = features.clone()
            masked_features[frame_padding] = 0.0  # Zero-out padded frames
            valid_counts = (~frame_padding).sum(dim=1, keepdim=True).clamp(min=1)
            pooled = masked_features.sum(dim=1) / valid_counts
        else:
            pooled = features.mean(dim=1)
        return self.classifier(pooled)


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    sr = 16000
    # the pretrained BEATs checkpoint's config kind, at tiny sizes
    cfg = BEATsConfig(
        dict(
            input_patch_size=16,
            embed_dim=24,
            encoder_layers=2,
            encoder_embed_dim=32,
            encoder_ffn_embed_dim=64,
            encoder_attention_heads=4,
            deep_norm=True,
            layer_norm_first=False,
            conv_pos=16,
            conv_pos_groups=4,
            relative_position_embedding=True,
            num_buckets=320,
            max_distance=800,
            gru_rel_pos=True,
        )
    )
    model = Model(num_classes=5, cfg=cfg)
    model.eval()

    dataset = []
    for n, (secs, label) in enumerate([(0.45, 1), (0.8, 3), (0.6, 0)]):
        t = torch.arange(int(secs * sr)) / sr
        wav = 0.3 * torch.sin(2 * math.pi * (300 + 200 * n) * t) + 0.02 * torch.randn(t.numel())
        dataset.append({"raw_wav": wav, "label": label})

    collate = Collater(audio_max_length_seconds=1, sr=sr, window_selection="random")
    batch = collate(dataset)

    with torch.no_grad():
        logits = model(batch["raw_wav"], padding_mask=batch["padding_mask"])
        loss = F.cross_entropy(logits, batch["label"])

    torch.set_printoptions(precision=4, sci_mode=False)
    print("padding_mask true count per clip:", batch["padding_mask"].sum(dim=1).tolist())
    print("logits:", logits)
    print("loss: %.6f" % loss.item())


if __name__ == "__main__":
    main()
