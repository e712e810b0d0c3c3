# A Conformer-style encoder (NeMo / icefall layout: features (B, T, F) batch-first, config kept as a dict) whose
# frame lengths are `feat_lens // subsampling_factor`, floored, where its two Conv1d(kernel 3, stride 2, padding 1)
# make ceil(n / 2) frames each: an utterance whose feature count is not a multiple of 4 loses its last real frame as
# a key of nn.MultiheadAttention's key_padding_mask. --fixed counts the frames by the conv formula, layer by layer.
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv

CONFIG = {"feat_dim": 16, "d_model": 32, "n_heads": 4, "n_layers": 2, "subsampling_factor": 4,
          "conv_kernel": 3, "conv_stride": 2, "conv_padding": 1}


class ConvSubsampling(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        k, s, p = cfg["conv_kernel"], cfg["conv_stride"], cfg["conv_padding"]
        self.layers = nn.Sequential(
            nn.Conv1d(cfg["feat_dim"], cfg["d_model"], k, stride=s, padding=p), nn.SiLU(),
            nn.Conv1d(cfg["d_model"], cfg["d_model"], k, stride=s, padding=p), nn.SiLU(),
        )

    def forward(self, feats: torch.Tensor) -> torch.Tensor:  # (B, T, F) -> (B, T', D)
        return self.layers(feats.transpose(1, 2)).transpose(1, 2)

    def output_lengths(self, lengths: torch.Tensor) -> torch.Tensor:
        for conv in self.layers:
            if isinstance(conv, nn.Conv1d):
                k, s, p = conv.kernel_size[0], conv.stride[0], conv.padding[0]
                lengths = (lengths + 2 * p - (k - 1) - 1) // s + 1
        return lengths


class Block(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.norm = nn.LayerNorm(cfg["d_model"])
        self.attn = nn.MultiheadAttention(cfg["d_model"], cfg["n_heads"], batch_first=True)
        self.ff = nn.Sequential(nn.Linear(cfg["d_model"], 2 * cfg["d_model"]), nn.SiLU(),
                                nn.Linear(2 * cfg["d_model"], cfg["d_model"]))

    def forward(self, x, key_padding_mask):
        h = self.norm(x)
        x = x + self.attn(h, h, h, key_padding_mask=key_padding_mask, need_weights=False)[0]
        return x + self.ff(x)


class Encoder(nn.Module):
    def __init__(self, cfg: dict):
        super().__init__()
        self.cfg = cfg
        self.subsampling = ConvSubsampling(cfg)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg["n_layers"]))

    def forward(self, feats: torch.Tensor, feat_lens: torch.Tensor):
        x = self.subsampling(feats)
        if FIXED:
            out_lens = self.subsampling.output_lengths(feat_lens)
        else:
            out_lens = feat_lens // self.cfg["subsampling_factor"]
        key_padding_mask = torch.arange(x.size(1))[None, :] >= out_lens[:, None]  # True = padding
        for block in self.blocks:
            x = block(x, key_padding_mask)
        return x, out_lens


def main():
    torch.manual_seed(0)
    model = Encoder(CONFIG).eval()
    feat_lens = torch.tensor([50, 64, 37])
    feats = torch.randn(3, 64, CONFIG["feat_dim"])
    feats = feats * (torch.arange(64)[None, :, None] < feat_lens[:, None, None])
    with torch.no_grad():
        out, out_lens = model(feats, feat_lens)
    print("frames", out.shape[1], "lengths", out_lens.tolist())


if __name__ == "__main__":
    main()
