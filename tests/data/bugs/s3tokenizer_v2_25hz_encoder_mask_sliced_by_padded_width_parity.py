# Citation: xingchensong/S3Tokenizer PR #26 ("fix v2 25 hz mask", commits 6b8f60c and d12e390,
#   merge 961650b). Buggy file: s3tokenizer/model_v2.py @ 6b8f60c^ (AudioEncoderV2.forward,
#   FSMNMultiHeadAttention.qkv_attention / forward_fsmn; utils.make_non_pad_mask, mask_to_bias, padding).
#   This is the 25 Hz v2 encoder (the speech tokenizer of CosyVoice 2); the v1 encoder's analogous
#   fix is #24/#25, this one is the separate v2 fix.
# Bug: AudioEncoderV2 built the frame mask at mel rate and subsampled it by slicing every other
#   column, starting at an offset picked from the parity of the PADDED batch width
#   (mask[:, :, (T + 2) % 2::2], then mask[:, :, (_T + 1) % 2::2] for stride 2), and computed the
#   output lengths as (x_len + 1) // 2 twice; the mel frames were fed to the convolutions unmasked.
#   The attention bias (mask_to_bias) and the FSMN mask_pad therefore come from the wrong columns.
# Fix: compute the lengths after every stride-2 conv with the conv formula
#   ((x_len + 2 - 1 * (3 - 1) - 1) // stride + 1), rebuild make_non_pad_mask(x_len) after each conv,
#   multiply the conv inputs by the mask, and use that mask for the attention bias and mask_pad.
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------- s3tokenizer/utils.py ----------------
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
    # attention mask bias
    mask = (1.0 - mask) * -1.0e+10
    return mask


def padding(data: List[torch.Tensor]):
    sample = data
    assert isinstance(sample, list)
    feats_lengths = torch.tensor([s.size(1) for s in sample], dtype=torch.int32)
    feats = [s.t() for s in sample]
    padded_feats = pad_sequence(feats, batch_first=True, padding_value=0)
    return padded_feats.transpose(1, 2), feats_lengths


# ---------------- s3tokenizer/model.py (building blocks) ----------------
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


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int):
        super().__init__()
        self.n_head = n_head
        self.query = Linear(n_state, n_state)
        self.key = Linear(n_state, n_state, bias=False)
        self.value = Linear(n_state, n_state)
        self.out = Linear(n_state, n_state)


# ---------------- s3tokenizer/model_v2.py ----------------
@dataclass
class ModelDimensions:
    n_mels: int = 16          # upstream 128
    n_audio_ctx: int = 1500
    n_audio_state: int = 128  # upstream 1280 (head dim stays 64, as the rotary table needs)
    n_audio_head: int = 2     # upstream 20
    n_audio_layer: int = 2    # upstream 6
    n_codebook_size: int = 3**8


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0, scaling=None):
    freqs = 1.0 / (theta**(torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    if scaling is not None:
        t = t * scaling
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return torch.cat((freqs_cis, freqs_cis), dim=-1)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor,
                     freqs_cis: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    real = torch.view_as_real(freqs_cis)
    cos, sin = real[:, :, 0], real[:, :, 1]
    cos = cos.unsqueeze(0).unsqueeze(2)
    sin = sin.unsqueeze(0).unsqueeze(2)

    D = xq.shape[-1]
    half_l, half_r = xq[:, :, :, :D // 2], xq[:, :, :, D // 2:]
    xq_r = torch.cat((-half_r, half_l), dim=-1)
    D = xk.shape[-1]
    half_l, half_r = xk[:, :, :, :D // 2], xk[:, :, :, D // 2:]
    xk_r = torch.cat((-half_r, half_l), dim=-1)
    return xq * cos + xq_r * sin, xk * cos + xk_r * sin


class FSQCodebook(torch.nn.Module):
    def __init__(self, dim: int, level: int = 3):
        super().__init__()
        self.project_down = torch.nn.Linear(dim, 8)
        self.level = level
        self.embed = None

    @torch.inference_mode()
    def preprocess(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(-1, x.shape[-1])

    @torch.inference_mode()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x_shape = x.shape
        x = self.preprocess(x)
        h = self.project_down(x)
        h = h.tanh()
        h = h * 0.9990000128746033
        h = h.round() + 1
        powers = torch.pow(self.level, torch.arange(2**self.level, device=x.device))
        mu = torch.sum(h * powers.unsqueeze(0), dim=-1)
        ind = mu.reshape(x_shape[0], x_shape[1]).int()
        return ind


class FSQVectorQuantization(torch.nn.Module):
    def __init__(self, dim: int, codebook_size: int):
        super().__init__()
        assert 3**8 == codebook_size
        self._codebook = FSQCodebook(dim=dim, level=3)
        self.codebook_size = codebook_size

    @torch.inference_mode()
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return self._codebook.encode(x)


class FSMNMultiHeadAttention(MultiHeadAttention):
    def __init__(self, n_state: int, n_head: int, kernel_size: int = 31):
        super().__init__(n_state, n_head)
        self.fsmn_block = torch.nn.Conv1d(n_state, n_state, kernel_size, stride=1,
                                          padding=0, groups=n_state, bias=False)
        self.left_padding = (kernel_size - 1) // 2
        self.right_padding = kernel_size - 1 - self.left_padding
        self.pad_fn = torch.nn.ConstantPad1d((self.left_padding, self.right_padding), 0.0)

    def forward_fsmn(self, inputs: torch.Tensor, mask: Optional[torch.Tensor] = None):
        b, t, _, _ = inputs.size()
        inputs = inputs.view(b, t, -1)
        if mask is not None and mask.size(2) > 0:  # time2 > 0
            inputs = inputs * mask
        x = inputs.transpose(1, 2)
        x = self.pad_fn(x)
        x = self.fsmn_block(x)
        x = x.transpose(1, 2)
        x += inputs
        return x * mask

    def qkv_attention(self, q, k, v, mask=None, mask_pad=None, freqs_cis=None):
        _, _, D = q.shape
        scale = (D // self.n_head)**-0.25
        q = q.view(*q.shape[:2], self.n_head, -1)
        k = k.view(*k.shape[:2], self.n_head, -1)
        v = v.view(*v.shape[:2], self.n_head, -1)

        if freqs_cis is not None:
            q, k = apply_rotary_emb(q, k, freqs_cis=freqs_cis)

        fsm_memory = self.forward_fsmn(v, mask_pad)

        q = q.permute(0, 2, 1, 3) * scale
        k = k.permute(0, 2, 3, 1) * scale
        v = v.permute(0, 2, 1, 3)

        qk = q @ k  # (B, n_head, T, T)
        if mask is not None:
            qk = qk + mask
        qk = qk.float()
        w = torch.nn.functional.softmax(qk, dim=-1).to(q.dtype)
        return (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach(), fsm_memory

    def forward(self, x, mask=None, mask_pad=None, freqs_cis=None):
        q = self.query(x)
        k = self.key(x)
        v = self.value(x)
        wv, qk, fsm_memory = self.qkv_attention(q, k, v, mask, mask_pad, freqs_cis)
        return self.out(wv) + fsm_memory, qk


class ResidualAttentionBlock(torch.nn.Module):
    def __init__(self, n_state: int, n_head: int, kernel_size: int = 31):
        super().__init__()
        self.attn = FSMNMultiHeadAttention(n_state, n_head, kernel_size)
        self.attn_ln = LayerNorm(n_state, eps=1e-6)
        n_mlp = n_state * 4
        self.mlp = torch.nn.Sequential(Linear(n_state, n_mlp), torch.nn.GELU(),
                                       Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def forward(self, x, mask=None, mask_pad=None, freqs_cis=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, mask_pad=mask_pad,
                          freqs_cis=freqs_cis)[0]
        x = x + self.mlp(self.mlp_ln(x))
        return x


class AudioEncoderV2(torch.nn.Module):
    def __init__(self, n_mels: int, n_state: int, n_head: int, n_layer: int, stride: int):
        super().__init__()
        self.stride = stride
        self.conv1 = Conv1d(n_mels, n_state, kernel_size=3, stride=stride, padding=1)
        self.conv2 = Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.freqs_cis = precompute_freqs_cis(64, 1024 * 2)
        self.blocks = torch.nn.ModuleList(
            [ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)])

    def forward(self, x: torch.Tensor, x_len: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """
        x : (batch_size, n_mels, T) mel spectrogram; x_len: (batch_size,)
        """
        if not FIXED:
            T = x.size(-1)
            x = torch.nn.functional.gelu(self.conv1(x))
            x = torch.nn.functional.gelu(self.conv2(x))
            x = x.permute(0, 2, 1)  # (B, T // 2, n_state)
            freqs_cis = self.freqs_cis.to(x.device)
            mask = make_non_pad_mask(x_len, T).unsqueeze(1)  # (B, 1, T)
            mask = mask[:, :, (T + 2) % 2::2]  # (B, 1, T // 2)
            mask_pad = None
            if self.stride == 2:
                _T = mask.size(-1)
                mask = mask[:, :, (_T + 1) % 2::2]  # (B, 1, T // 4)
                mask_pad = mask.transpose(1, 2)
            mask = mask_to_bias(mask, x.dtype)
        else:
            mask = make_non_pad_mask(x_len).unsqueeze(1)
            x = torch.nn.functional.gelu(self.conv1(x * mask))
            x_len = (x_len + 2 - 1 * (3 - 1) - 1) // self.stride + 1
            mask = make_non_pad_mask(x_len).unsqueeze(1)
            x = torch.nn.functional.gelu(self.conv2(x * mask))
            x_len = (x_len + 2 - 1 * (3 - 1) - 1) // 2 + 1
            mask = make_non_pad_mask(x_len).unsqueeze(1)
            x = x.permute(0, 2, 1)  # (B, T // 2, n_state)
            freqs_cis = self.freqs_cis.to(x.device)
            mask_pad = mask.transpose(1, 2)
            mask = mask_to_bias(mask, x.dtype)

        for block in self.blocks:
            x = block(x, mask.unsqueeze(1), mask_pad, freqs_cis[:x.size(1)])

        if not FIXED:
            x_len = (x_len + 1) // 2
            if self.stride == 2:
                x_len = (x_len + 1) // 2
        return x, x_len


class S3TokenizerV2(torch.nn.Module):
    def __init__(self, name: str, dims: ModelDimensions = ModelDimensions()):
        super().__init__()
        if 'v1' not in name:
            assert 'v2' in name
            dims.n_codebook_size = 3**8
        self.dims = dims
        self.encoder = AudioEncoderV2(self.dims.n_mels, self.dims.n_audio_state,
                                      self.dims.n_audio_head, self.dims.n_audio_layer, 2)
        self.quantizer = FSQVectorQuantization(self.dims.n_audio_state,
                                               self.dims.n_codebook_size)

    def forward(self, mel, mel_len):
        return self.quantize(mel, mel_len)

    @torch.inference_mode()
    def quantize(self, mel: torch.Tensor, mel_len: torch.Tensor):
        hidden, code_len = self.encoder(mel, mel_len)
        code = self.quantizer.encode(hidden)
        return code, code_len, hidden


def main():
    model = S3TokenizerV2("speech_tokenizer_v2_25hz").eval()
    # three utterances' log-mels (100 frames/s), batched with s3tokenizer.padding()
    lens = [40, 30, 26]
    mels = [torch.randn(model.dims.n_mels, n) for n in lens]
    mel, mel_len = padding(mels)
    codes, code_len, hidden = model.quantize(mel, mel_len)
    print("mel lengths :", mel_len.tolist(), "padded width", mel.shape[-1])
    print("code lengths:", code_len.tolist())
    for b in range(len(lens)):
        n = int(code_len[b])
        print(f"utt {b} codes:", codes[b, :n].tolist())
        print(f"utt {b} hidden mean over its frames: {hidden[b, :n].mean().item():.6f}")

    # the same utterances one at a time, as the single-utterance CLI does
    for b in range(len(lens)):
        m1, l1 = padding([mels[b]])
        c1, cl1, h1 = model.quantize(m1, l1)
        n = int(cl1[0])
        print(f"utt {b} alone codes:", c1[0, :n].tolist())
        print(f"utt {b} alone hidden mean: {h1[0, :n].mean().item():.6f}")


if __name__ == "__main__":
    main()
