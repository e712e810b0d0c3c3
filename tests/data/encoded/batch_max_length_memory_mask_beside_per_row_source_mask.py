# Written another way (quic/efficient-transformers abe7288a1's cross-attention half): an nn.Transformer translation
# batch whose encoder is handed each row's own source padding (src_key_padding_mask from the lengths), while the
# memory mask handed to the decoder is built from one length for the whole batch (the batch's longest source), so it
# calls every row's padded source tokens real and the decoder attends them. Fix: the same per-row mask for both.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def main():
    model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2, dim_feedforward=64,
                           dropout=0.0, batch_first=True).eval()
    src_lengths = torch.tensor([10, 6, 8])
    src = torch.randn(3, 10, 32)
    tgt = torch.randn(3, 5, 32)
    positions = torch.arange(src.shape[1])
    src_key_padding_mask = positions[None, :] >= src_lengths[:, None]  # True = padding, per row
    if FIXED:
        memory_key_padding_mask = src_key_padding_mask
    else:
        longest = int(src_lengths.max())
        memory_key_padding_mask = (positions >= longest)[None, :].expand(src.shape[0], -1)
    tgt_mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
    with torch.no_grad():
        out = model(src, tgt, tgt_mask=tgt_mask, src_key_padding_mask=src_key_padding_mask,
                    memory_key_padding_mask=memory_key_padding_mask, tgt_is_causal=True)
        n = int(src_lengths[1])
        ref = model(src[1:2, :n], tgt[1:2], tgt_mask=tgt_mask, tgt_is_causal=True)
    print(f"fixed={FIXED} max |row 1 - its unpadded source| = {(out[1] - ref[0]).abs().max().item():.6f}")


if __name__ == "__main__":
    main()
