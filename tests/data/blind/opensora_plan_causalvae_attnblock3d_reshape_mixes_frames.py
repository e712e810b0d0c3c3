"""Open-Sora-Plan CausalVAE: AttnBlock3D reshapes (b, c, t, h, w) to per-frame groups without moving t first.

Citation: PKU-YuanGroup/Open-Sora-Plan#171 (reported), fixed by PKU-YuanGroup/Open-Sora-Plan#172
("[Bug fix] Fix reshape bugs in AttnBlock3D in CausalVideoVAE"); also PKU-YuanGroup/Open-Sora-Plan#257
("I think there should be a `permute` for `q,k,v` before reshape").  The repository kept the old
class as `AttnBlock3D` ("Compatible with old versions, there are issues") next to
`AttnBlock3DFix` ("Thanks to .../pull/172").  I read both classes in
opensora/models/ae/videobase/modules/attention.py; I did not read thread #171 itself.

Bug: the mid-block attention of the causal video VAE is spatial attention within each frame:
(b*t) groups of h*w tokens with c channels.  The old code did `q.reshape(b * t, c, h * w)`
directly on a (b, c, t, h, w) tensor, so a "frame" group was a slice of the channel axis and
each token's channel vector was stitched from several frames: queries attended to keys built
from other frames (and other channels), and the output was reshaped back the same wrong way.
Fix: permute to (b, t, c, h, w) before the reshape for q, k and v, and reshape the output to
(b, t, c, h, w) then permute back.

This program keeps AttnBlock3D as written (GroupNorm, 1x1x1 CausalConv3d projections, bmm
attention with softmax over the h*w keys) and runs it on a latent of 2 videos x 3 frames at 2x2
with 32 channels, as the CausalVAE encoder mid block does.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def Normalize(in_channels, num_groups=32):
    return torch.nn.GroupNorm(num_groups=num_groups, num_channels=in_channels, eps=1e-6, affine=True)


class CausalConv3d(nn.Module):
    """Causal in time: pads the first frame time_pad times before the convolution."""

    def __init__(self, chan_in, chan_out, kernel_size, stride=1, padding=0):
        super().__init__()
        self.kernel_size = (kernel_size,) * 3 if isinstance(kernel_size, int) else kernel_size
        self.time_kernel_size = self.kernel_size[0]
        self.conv = nn.Conv3d(chan_in, chan_out, self.kernel_size, stride=stride, padding=(0, padding, padding))

    def forward(self, x):
        first_frame_pad = x[:, :, :1, :, :].repeat((1, 1, self.time_kernel_size - 1, 1, 1))
        x = torch.concatenate((first_frame_pad, x), dim=2)
        return self.conv(x)


class AttnBlock3D(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels

        self.norm = Normalize(in_channels)
        self.q = CausalConv3d(in_channels, in_channels, kernel_size=1, stride=1)
        self.k = CausalConv3d(in_channels, in_channels, kernel_size=1, stride=1)
        self.v = CausalConv3d(in_channels, in_channels, kernel_size=1, stride=1)
        self.proj_out = CausalConv3d(in_channels, in_channels, kernel_size=1, stride=1)

    def forward(self, x):
        h_ = x
        h_ = self.norm(h_)
        q = self.q(h_)
        k = self.k(h_)
        v = self.v(h_)

        # compute attention
        b, c, t, h, w = q.shape
        if FIXED:
            # q: (b c t h w) -> (b t c h w) -> (b*t c h*w) -> (b*t h*w c)
            q = q.permute(0, 2, 1, 3, 4)
            k = k.permute(0, 2, 1, 3, 4)
            v = v.permute(0, 2, 1, 3, 4)
        q = q.reshape(b * t, c, h * w)
        q = q.permute(0, 2, 1)  # b,hw,c
        k = k.reshape(b * t, c, h * w)  # b,c,hw
        w_ = torch.bmm(q, k)  # b,hw,hw    w[b,i,j]=sum_c q[b,i,c]k[b,c,j]
        w_ = w_ * (int(c) ** (-0.5))
        w_ = F.softmax(w_, dim=2)

        # attend to values
        v = v.reshape(b * t, c, h * w)
        w_ = w_.permute(0, 2, 1)  # b,hw,hw (first hw of k, second of q)
        h_ = torch.bmm(v, w_)  # b, c,hw (hw of q) h_[b,c,j] = sum_i v[b,c,i] w_[b,i,j]
        if FIXED:
            # h_: (b*t c hw) -> (b t c h w) -> (b c t h w)
            h_ = h_.reshape(b, t, c, h, w)
            h_ = h_.permute(0, 2, 1, 3, 4)
        else:
            h_ = h_.reshape(b, c, t, h, w)

        h_ = self.proj_out(h_)

        return x + h_


def main():
    torch.manual_seed(0)
    block = AttnBlock3D(32).eval()
    latent = torch.randn(2, 32, 3, 2, 2)  # b, c, t, h, w
    with torch.no_grad():
        out = block(latent)
    print("fixed" if FIXED else "buggy", tuple(out.shape), f"{out.abs().sum().item():.4f}")


if __name__ == "__main__":
    main()
