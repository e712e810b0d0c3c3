"""S3Tokenizer speech_tokenizer_v1_25hz: the encoder returns code lengths for half the
downsampling it does, so each utterance's valid-code length counts padded frames.

Citation: xingchensong/S3Tokenizer commit f583c97 ("[s3tokenizer] fix len").

s3tokenizer/model.py AudioEncoder.forward: the 25 Hz model (stride=2) runs two stride-2
convolutions (4x in time) and slices its attention mask twice, but returned
`x_len = (x_len + 1) // 2`, the length after one halving. `quantize` hands these lengths
back as `codes_lens`; callers (the README's batch loop, the CLI, a downstream model as in
README usage 1) keep `codes[i, :codes_lens[i]]` and build the code padding mask from them,
so a shorter utterance in a padded batch keeps codes made from padded mel frames and a
downstream model attends to them.
Fix: for stride == 2 halve once more, `x_len = (x_len + 1) // 2`.

`python FILE` runs the code before the fix; `python FILE --fixed` after it.
"""
import sys
from dataclasses import dataclass
from typing import Iterable, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv


# ---- s3tokenizer/utils.py -------------------------------------------------------------
def make_non_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    batch_size = lengths.size(0)
    max_len = max_len if max_len > 0 else lengths.max().item()
    seq_range = torch.arange(0, max_len, dtype=torch.int64, device=lengths.device)
    seq_range_expand = seq_range.unsqueeze(0).expand(batch_size, max_len)
    seq_length_expand = lengths.unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return ~mask


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    assert mask.dtype == torch.bool
    assert dtype in [torch.float32, torch.bfloat16, torch.float16]
    mask = mask.to(dtype)
    mask = (1.0 - mask) * -1.0e+10
    return mask


def padding(data):
    sample = data
    assert isinstance(sample, list)
    feats_lengths = torch.tensor([s.size(1) for s in sample], dtype=torch.int32)
    feats = [s.t() for s in sample]
    padded_feats = pad_sequence(feats, batch_first=True, padding_value=0)
    return padded_feats.transpose(1, 2), feats_lengths


# ---- s3tokenizer/model.py -------------------------------------------------------------
@dataclass
class ModelDimensions:
    n_mels: int = 8
    n_audio_ctx: int = 64
    n_audio_state: int = 16
    n_audio_head: int = 2
    n_audio_layer: int = 2
    n_codebook_size: int = 32


class LayerNorm(nn.LayerNorm):
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.float()).type(x.dtype)


class Linear(nn.Linear):
    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight.to(x.dtype),
                        None if self.bias is None else self.bias.to(x.dtype))


class Conv1d(nn.Conv1d):
    def _conv_forward(self, x: Tensor, weight: Tensor, bias: Optional[Tensor]) -> Tensor:
        return super()._conv_forward(x, weight.to(x.dtype),
                                     None if bias is None else bias.to(x.dtype))


def sinusoids(length, channels, max_timescale=10000):
    assert channels % 2 == 0
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None):
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor] = None):
        _, T, D = q.shape
        scale = (D // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k  # (B, n_head, T, T)
        if mask is not None:
            qk = qk + mask
        qk = qk.float()
        w = F.softmax(qk, dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = LayerNorm(n_state)
        n_mlp = n_state * 4
        self.mlp = nn.Sequential(Linear(n_state, n_mlp), nn.GELU(), Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x: Tensor, mask: Optional[Tensor] = None):
        x = x + self.attn(self.attn_ln(x), mask=mask)[0]
        x = x + self.mlp(self.mlp_ln(x))
        return x


class AudioEncoder(nn.Module):
    def __init__(self, n_mels: int, n_ctx: int, n_state: int, n_head: int, n_layer: int,
                 stride: int):
        super().__init__()
        self.stride = stride
        self.conv1 = Conv1d(n_mels, n_state, kernel_size=3, stride=stride, padding=1)
        self.conv2 = Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks: Iterable[ResidualAttentionBlock] = nn.ModuleList(
            [ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)])

    def forward(self, x: Tensor, x_len: Tensor) -> Tuple[Tensor, Tensor]:
        T = x.size(-1)
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.permute(0, 2, 1)  # (B, T // 2, n_state)
        mask = make_non_pad_mask(x_len, T).unsqueeze(1)  # (B, 1, T)
        mask = mask[:, :, (T + 1) % 2::2]  # (B, 1, T // 2)
        if self.stride == 2:
            _T = mask.size(-1)
            mask = mask[:, :, (_T + 1) % 2::2]  # (B, 1, T // 4)
        mask = mask_to_bias(mask, x.dtype)

        x = (x + self.positional_embedding[:x.shape[1], :]).to(x.dtype)

        for block in self.blocks:
            x = block(x, mask.unsqueeze(1))

        x_len = (x_len + 1) // 2
        if FIXED:
            if self.stride == 2:
                x_len = (x_len + 1) // 2
        return x, x_len


class EuclideanCodebook(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        embed = torch.randn(codebook_size, dim)
        self.codebook_size = codebook_size
        self.register_buffer("embed", embed)

    @torch.inference_mode()
    def quantize(self, x: Tensor) -> Tensor:
        embed = self.embed.t()
        dist = -(x.pow(2).sum(1, keepdim=True) - 2 * x @ embed + embed.pow(2).sum(0, keepdim=True))
        return dist.max(dim=-1).indices

    @torch.inference_mode()
    def encode(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        embed_ind = self.quantize(x)
        return embed_ind.view(*shape[:-1])


class VectorQuantization(nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        self._codebook = EuclideanCodebook(dim=dim, codebook_size=codebook_size)
        self.codebook_size = codebook_size

    @torch.inference_mode()
    def encode(self, x: Tensor) -> Tensor:
        x = F.normalize(x, p=2, dim=-1)
        return self._codebook.encode(x)


class S3Tokenizer(nn.Module):
    def __init__(self, name: str, dims: ModelDimensions = ModelDimensions()):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(
            self.dims.n_mels, self.dims.n_audio_ctx, self.dims.n_audio_state,
            self.dims.n_audio_head, self.dims.n_audio_layer,
            2 if name == "speech_tokenizer_v1_25hz" else 1,
        )
        self.quantizer = VectorQuantization(self.dims.n_audio_state, self.dims.n_codebook_size)

    def forward(self, mel: Tensor, mel_len: Tensor) -> Tuple[Tensor, Tensor]:
        return self.quantize(mel, mel_len)

    @torch.inference_mode()
    def quantize(self, mel: Tensor, mel_len: Tensor) -> Tuple[Tensor, Tensor]:
        hidden, code_len = self.encoder(mel, mel_len)
        code = self.quantizer.encode(hidden)
        return code, code_len

    def freeze(self):
        for _, param in self.named_parameters():
            param.requires_grad = False


# ---- README usage 1: a downstream model that consumes the codes and their lengths ------
class SpeechTokenLM(nn.Module):
    """A tiny speech-token model: embeds the codes, masks padded codes by length."""

    def __init__(self, dims: ModelDimensions):
        super().__init__()
        self.speech_tokenizer = S3Tokenizer("speech_tokenizer_v1_25hz", dims)
        self.speech_tokenizer.freeze()
        self.speech_embedding = nn.Embedding(dims.n_codebook_size, dims.n_audio_state)
        self.block = ResidualAttentionBlock(dims.n_audio_state, dims.n_audio_head)
        self.head = Linear(dims.n_audio_state, dims.n_codebook_size)

    def forward(self, speech: Tensor, speech_lens: Tensor):
        speech_codes, speech_codes_lens = self.speech_tokenizer.quantize(speech, speech_lens)
        speech_codes = speech_codes.clone()
        speech_codes_lens = speech_codes_lens.clone()
        T = speech_codes.size(1)
        mask = make_non_pad_mask(speech_codes_lens.clamp(max=T), T)  # (B, T)
        bias = mask_to_bias(mask.unsqueeze(1), torch.float32).unsqueeze(1)  # (B, 1, 1, T)
        h = self.block(self.speech_embedding(speech_codes), bias)
        logits = self.head(h)
        # next-code loss over the valid codes of each utterance
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               speech_codes[:, 1:].reshape(-1), reduction="none").view(len(speech), -1)
        valid = mask[:, 1:].float()
        return (loss * valid).sum() / valid.sum(), speech_codes, speech_codes_lens


def main():
    torch.manual_seed(0)
    dims = ModelDimensions()
    model = SpeechTokenLM(dims).eval()

    # two utterances' log-mel spectrograms (n_mels, frames) of different lengths
    mels = [torch.randn(dims.n_mels, 40), torch.randn(dims.n_mels, 26)]
    mels, mels_lens = padding(mels)

    with torch.no_grad():
        loss, codes, codes_lens = model(mels, mels_lens)

    for i in range(len(mels)):
        print(f"utt{i}: {codes[i, :codes_lens[i].item()].tolist()}")
    print(f"codes_lens={codes_lens.tolist()} loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
