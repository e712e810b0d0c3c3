"""NISQA double-ended Alignment: the reference-padding mask was applied after the softmax.

Citation: gabrielmittag/NISQA#17 ("Bug in Alignment", closed); maintainer: "Thank you for pointing
that out! I fixed it now by applying the softmax after the masking."  Read: the issue (pointing at
nisqa/NISQA_lib.py L1264-1274 at 2c8917f) and the fixed `Alignment` / `AttDot` /
`ApplySoftAttention` in NISQA_lib.py; the pre-fix attention function is written from the issue's
description ("in self.att(query, y) the softmax is already calculated for att").

Bug: `Alignment.forward` got already-softmaxed weights from `self.att(query, y)` and then called
`_mask_attention`, which sets the weights of padded reference windows (`n_wins_y`) to -inf; the
softmax had already spread probability over the padded windows, and the -inf weights then turn
`torch.bmm(att, y)` into inf/NaN for every query of a padded reference.
Fix: the attention function returns raw scores, `_mask_attention` writes -inf into the scores,
then `att_score = F.softmax(att_score, dim=2)`, then `apply_att`.

Reproduction: `Alignment(att_method='dot', apply_att_method='soft')` aligning degraded-signal frame
features (query, 5 windows) to reference frame features (y) of a batch of 2 with n_wins_y = [6, 4].
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class AttDot(torch.nn.Module):
    """AttDot: Dot attention that can be used by the Alignment module."""

    def __init__(self):
        super().__init__()

    def forward(self, query, y):
        att = torch.bmm(query, y.transpose(2, 1))
        sim = att.max(2)[0].unsqueeze(1)
        if not FIXED:
            att = F.softmax(att, dim=2)
        return att, sim


class ApplySoftAttention(torch.nn.Module):
    """ApplySoftAttention: weighted sum of the reference windows."""

    def __init__(self):
        super().__init__()

    def forward(self, y, att):
        y = torch.bmm(att, y)
        return y


class Alignment(torch.nn.Module):
    def __init__(self, att_method, apply_att_method, q_dim=None, y_dim=None):
        super().__init__()
        if att_method == 'dot':
            self.att = AttDot()
        else:
            raise NotImplementedError
        if apply_att_method == 'soft':
            self.apply_att = ApplySoftAttention()
        else:
            raise NotImplementedError

    def _mask_attention(self, att, y, n_wins):
        mask = torch.arange(att.shape[2])[None, :] < n_wins[:, None].to('cpu').to(torch.long)
        mask = mask.unsqueeze(1).expand_as(att)
        att[~mask] = float("-Inf")

    def forward(self, query, y, n_wins_y):
        if self.att is not None:
            att_score, sim = self.att(query, y)
            self._mask_attention(att_score, y, n_wins_y)
            if FIXED:
                att_score = F.softmax(att_score, dim=2)
            y = self.apply_att(y, att_score)
        return y


def main():
    torch.manual_seed(0)
    framewise = nn.Linear(12, 8)  # stands in for the CNN frame-wise feature model
    align = Alignment('dot', 'soft', q_dim=8, y_dim=8)
    x = torch.randn(2, 5, 12)  # degraded signal windows
    y_ref = torch.randn(2, 6, 12)  # reference signal windows, second one padded to 6
    n_wins_y = torch.tensor([6, 4])
    with torch.no_grad():
        query, y = framewise(x), framewise(y_ref)
        aligned = align(query, y, n_wins_y)
    print("aligned reference, finite per item:", torch.isfinite(aligned).flatten(1).all(1).tolist(),
          "first value", round(aligned[0, 0, 0].item(), 4))


if __name__ == "__main__":
    main()
