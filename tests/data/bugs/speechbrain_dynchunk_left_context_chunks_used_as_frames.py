# speechbrain/speechbrain#2140 (commit 4558232, "Fix left context size calculation in new mask code"):
# make_asr_src_mask subtracted DCTConfig.left_context_size (a number of chunks) from the chunk's first
# frame index, so Dynamic Chunk Training kept only that many frames of left context instead of chunks.
import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class DCTConfig:
    chunk_size: int
    """Size in frames of a single chunk."""
    left_context_size: Optional[int] = None
    """Number of *chunks* of left context; None means infinite left context."""

    def is_infinite_left_context(self) -> bool:
        return self.left_context_size is None


def make_asr_src_mask(src: torch.Tensor, causal: bool = False, dct_config: Optional[DCTConfig] = None):
    if dct_config is not None:
        # 0 == no mask, 1 == mask
        src_mask = torch.zeros((src.shape[1], src.shape[1]), device=src.device, dtype=torch.bool)
        timesteps = src.size(1)
        # mask the future at the right of each chunk
        for t in range(timesteps):
            next_chunk_index = (t // dct_config.chunk_size) + 1
            visible_range = next_chunk_index * dct_config.chunk_size
            src_mask[t, visible_range:] = True
        # mask the past at the left of each chunk (accounting for left context)
        if not dct_config.is_infinite_left_context():
            for t in range(timesteps):
                chunk_index = t // dct_config.chunk_size
                chunk_first_t = chunk_index * dct_config.chunk_size
                if FIXED:
                    left_context_frames = dct_config.left_context_size * dct_config.chunk_size
                    frame_remaining_context = max(0, chunk_first_t - left_context_frames)
                else:
                    frame_remaining_context = max(0, chunk_first_t - dct_config.left_context_size)
                # end range is exclusive, so there is no off-by-one here
                src_mask[t, :frame_remaining_context] = True
        return src_mask
    return None


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model=32, nhead=4, d_ffn=64):
        super().__init__()
        self.self_att = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.pos_ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        src1 = self.norm1(src)
        output, _ = self.self_att(src1, src1, src1, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)
        src = src + output
        return src + self.pos_ffn(self.norm2(src))


class TransformerASR(nn.Module):
    def __init__(self, input_size=20, d_model=32):
        super().__init__()
        self.custom_src_module = nn.Linear(input_size, d_model)
        self.encoder = TransformerEncoderLayer(d_model)

    def encode(self, src, wav_len, dct_config: Optional[DCTConfig] = None):
        abs_len = torch.round(wav_len * src.shape[1])
        src_key_padding_mask = torch.arange(src.shape[1])[None, :] >= abs_len[:, None]
        src_mask = make_asr_src_mask(src, causal=False, dct_config=dct_config)
        src = self.custom_src_module(src)
        return self.encoder(src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask)


def main():
    torch.manual_seed(0)
    model = TransformerASR().eval()
    dct_config = DCTConfig(chunk_size=4, left_context_size=2)  # 2 chunks = 8 frames of left context
    feats = torch.randn(2, 24, 20)
    wav_len = torch.tensor([1.0, 0.75])
    with torch.no_grad():
        enc = model.encode(feats, wav_len, dct_config)  # dynamic chunk training forward
        # streaming: chunk 4 (frames 16..19) sees itself plus 2 chunks of left context (frames 8..15)
        ref = model.encode(feats[:, 8:20], torch.tensor([1.0, 10 / 12]), DCTConfig(chunk_size=4))
    diff = (enc[:, 16:20] - ref[:, 8:12]).abs().max().item()
    print(f"fixed={FIXED} chunk-4 output, DCT mask vs 2-chunk left-context streaming: max diff {diff:.3e}")


if __name__ == "__main__":
    main()
