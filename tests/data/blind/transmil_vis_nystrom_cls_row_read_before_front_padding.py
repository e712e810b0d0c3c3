"""TransMIL attention heatmaps: the class token's attention row was read at index 1 of the padded sequence.

Citation: PerrySkywalker/TransMIL-visualisation commit 90405b7 ("fix bug"; issue
PerrySkywalker/TransMIL-visualisation#8, "class_token attention ?"), nystrom_attention.py
``NystromAttention.forward`` (return_attn branch), used by model/TransMIL.py and main.py.

TransMIL turns a whole-slide image into a bag of patch features, pads the bag to a square
(_H x _W, by repeating the first patches), puts a class token in front and runs two Nystrom
attention layers. NystromAttention pads the sequence at the FRONT with zeros
(``F.pad(x, (0, 0, padding, 0))``) so that it splits into ``num_landmarks`` groups; the real tokens
(class token first) sit in the last ``n`` rows. For the heatmap, the layer returns the class
token's (approximate) attention over the patches, and main.py rolls the two layers' maps up.

The bug: the class token's row was taken as ``(attn1 @ attn2_inv)[:, :, 1, :]``, row 1 of the
front-padded sequence, which is a zero padding row whenever the sequence was padded (and the first
patch when it was not).
The fix: ``(attn1 @ attn2_inv)[:, :, -n:-n+1, :]``, the class token's row after the front padding.

Ported at toy sizes with random weights (dim 64 instead of 512, so num_landmarks = dim // 2 = 32;
768-d input features; 50 patches of one slide). einops' rearrange / reduce are written with
torch ops; the shape prints of the original are left out.
"""

import sys
from math import ceil

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import einsum

FIXED = "--fixed" in sys.argv

# helper functions


def exists(val):
    return val is not None


def moore_penrose_iter_pinv(x, iters=6):
    device = x.device

    abs_x = torch.abs(x)
    col = abs_x.sum(dim=-1)
    row = abs_x.sum(dim=-2)
    z = x.transpose(-1, -2) / (torch.max(col) * torch.max(row))

    I = torch.eye(x.shape[-1], device=device)
    I = I[None]

    for _ in range(iters):
        xz = x @ z
        z = 0.25 * z @ (13 * I - (xz @ (15 * I - (xz @ (7 * I - xz)))))

    return z


# main attention class


class NystromAttention(nn.Module):
    def __init__(
        self,
        dim,
        dim_head=64,
        heads=8,
        num_landmarks=256,
        pinv_iterations=6,
        residual=True,
        residual_conv_kernel=33,
        eps=1e-8,
        dropout=0.,
        return_attn=False,
        head_fusion='mean'
    ):
        super().__init__()
        self.head_fusion = head_fusion
        self.return_attn = return_attn
        self.eps = eps
        inner_dim = heads * dim_head

        self.num_landmarks = num_landmarks
        self.pinv_iterations = pinv_iterations

        self.heads = heads
        self.scale = dim_head ** -0.5
        self.to_qkv = nn.Linear(dim, inner_dim * 3, bias=False)

        self.to_out = nn.Sequential(
            nn.Linear(inner_dim, dim),
            nn.Dropout(dropout)
        )

        self.residual = residual
        if residual:
            kernel_size = residual_conv_kernel
            padding = residual_conv_kernel // 2
            self.res_conv = nn.Conv2d(heads, heads, (kernel_size, 1), padding=(padding, 0), groups=heads, bias=False)

    def forward(self, x, mask=None, return_attn=False):
        b, n, _, h, m, iters, eps = *x.shape, self.heads, self.num_landmarks, self.pinv_iterations, self.eps

        # pad so that sequence can be evenly divided into m landmarks

        remainder = n % m
        if remainder > 0:
            padding = m - (n % m)
            x = F.pad(x, (0, 0, padding, 0), value=0)

            if exists(mask):
                mask = F.pad(mask, (padding, 0), value=False)

        # derive query, keys, values

        q, k, v = self.to_qkv(x).chunk(3, dim=-1)
        # 'b n (h d) -> b h n d'
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).transpose(1, 2), (q, k, v))

        # set masked positions to 0 in queries, keys, values

        if exists(mask):
            mask = mask[:, None, :]
            q, k, v = map(lambda t: t * mask[..., None], (q, k, v))

        q = q * self.scale

        # generate landmarks by sum reduction, and then calculate mean using the mask

        l = ceil(n / m)
        # '... (n l) d -> ... n d', 'sum'
        q_landmarks = q.reshape(*q.shape[:-2], -1, l, q.shape[-1]).sum(dim=-2)
        k_landmarks = k.reshape(*k.shape[:-2], -1, l, k.shape[-1]).sum(dim=-2)

        # calculate landmark mask, and also get sum of non-masked elements in preparation for masked mean

        divisor = l
        if exists(mask):
            mask_landmarks_sum = mask.reshape(*mask.shape[:-1], -1, l).sum(dim=-1)
            divisor = mask_landmarks_sum[..., None] + eps
            mask_landmarks = mask_landmarks_sum > 0

        # masked mean (if mask exists)

        q_landmarks /= divisor
        k_landmarks /= divisor

        # similarities

        einops_eq = '... i d, ... j d -> ... i j'
        sim1 = einsum(einops_eq, q, k_landmarks)
        sim2 = einsum(einops_eq, q_landmarks, k_landmarks)
        sim3 = einsum(einops_eq, q_landmarks, k)

        # masking

        if exists(mask):
            mask_value = -torch.finfo(q.dtype).max
            sim1.masked_fill_(~(mask[..., None] * mask_landmarks[..., None, :]), mask_value)
            sim2.masked_fill_(~(mask_landmarks[..., None] * mask_landmarks[..., None, :]), mask_value)
            sim3.masked_fill_(~(mask_landmarks[..., None] * mask[..., None, :]), mask_value)

        # eq (15) in the paper and aggregate values

        attn1, attn2, attn3 = map(lambda t: t.softmax(dim=-1), (sim1, sim2, sim3))
        attn2_inv = moore_penrose_iter_pinv(attn2, iters)

        out = (attn1 @ attn2_inv) @ (attn3 @ v)

        # add depth-wise conv residual of values

        if self.residual:
            out += self.res_conv(v)

        # merge and combine heads

        out = out.transpose(1, 2).reshape(b, out.shape[2], -1)  # 'b h n d -> b n (h d)'
        out = self.to_out(out)
        out = out[:, -n:]

        if self.return_attn:
            if FIXED:
                attn1 = (attn1 @ attn2_inv)[:, :, -n:-n+1, :]
                attn1 = attn1[:, :, 0:1, :]
            else:
                attn1 = (attn1 @ attn2_inv)[:, :, 1, :].unsqueeze(dim=2)
            attn3 = attn3[:, :, :, -n:]
            if self.head_fusion == 'mean':
                attn = (attn1 @ attn3)[:, :, :, -n:].mean(dim=1)
            elif self.head_fusion == 'max':
                attn = (attn1 @ attn3)[:, :, :, -n:].max(dim=1)[0]
            else:
                attn = (attn1 @ attn3)[:, :, :, -n:].mean(dim=1)[0]
            return out, attn.squeeze(dim=1).detach()
        return out


# model/TransMIL.py


class TransLayer(nn.Module):

    def __init__(self, norm_layer=nn.LayerNorm, dim=512, head_fusion='mean'):
        super().__init__()
        self.norm = norm_layer(dim)
        self.attn = NystromAttention(
            dim=dim,
            dim_head=dim // 8,
            heads=8,
            num_landmarks=dim // 2,    # number of landmarks
            pinv_iterations=6,    # number of moore-penrose iterations for approximating pinverse. 6 was recommended by the paper
            residual=True,         # whether to do an extra residual with the value or not. supposedly faster convergence if turned on
            dropout=0.1,
            return_attn=True,
            head_fusion='max',
        )

    def forward(self, x):
        _, attn = self.attn(self.norm(x))
        x = x + _
        return x, attn


class PPEG(nn.Module):
    def __init__(self, dim=512):
        super(PPEG, self).__init__()
        self.proj = nn.Conv2d(dim, dim, 7, 1, 7 // 2, groups=dim)
        self.proj1 = nn.Conv2d(dim, dim, 5, 1, 5 // 2, groups=dim)
        self.proj2 = nn.Conv2d(dim, dim, 3, 1, 3 // 2, groups=dim)

    def forward(self, x, H, W):
        B, _, C = x.shape
        cls_token, feat_token = x[:, 0], x[:, 1:]
        cnn_feat = feat_token.transpose(1, 2).view(B, C, H, W)
        x = self.proj(cnn_feat) + cnn_feat + self.proj1(cnn_feat) + self.proj2(cnn_feat)
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat((cls_token.unsqueeze(1), x), dim=1)
        return x


class TransMIL(nn.Module):
    def __init__(self, n_classes, head_fusion='mean', dim=512, in_dim=768):
        super(TransMIL, self).__init__()
        self.pos_layer = PPEG(dim=dim)
        self._fc1 = nn.Sequential(nn.Linear(in_dim, dim), nn.ReLU())
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.n_classes = n_classes
        self.layer1 = TransLayer(dim=dim, head_fusion=head_fusion)
        self.layer2 = TransLayer(dim=dim, head_fusion=head_fusion)
        self.norm = nn.LayerNorm(dim)
        self._fc2 = nn.Linear(dim, self.n_classes)

    def forward(self, feature):

        h = feature  # [B, n, 768]

        h = self._fc1(h)  # [B, n, dim]

        # ---->pad
        H = h.shape[1]
        _H, _W = int(np.ceil(np.sqrt(H))), int(np.ceil(np.sqrt(H)))
        add_length = _H * _W - H
        h = torch.cat([h, h[:, :add_length, :]], dim=1)  # [B, N, dim]

        # ---->cls_token
        B = h.shape[0]
        cls_tokens = self.cls_token.expand(B, -1, -1).to(h.device)
        h = torch.cat((cls_tokens, h), dim=1)

        # ---->Translayer x1
        h, attn0 = self.layer1(h)  # [B, N, dim]

        # ---->PPEG
        h = self.pos_layer(h, _H, _W)  # [B, N, dim]

        # ---->Translayer x2
        h, attn1 = self.layer2(h)  # [B, N, dim]

        # ---->cls_token
        h = self.norm(h)[:, 0]

        # ---->predict
        logits = self._fc2(h)  # [B, n_classes]
        Y_hat = torch.argmax(logits, dim=1)
        Y_prob = F.softmax(logits, dim=1)
        results_dict = {'logits': logits, 'Y_prob': Y_prob, 'Y_hat': Y_hat}
        return results_dict, [attn0[:, :H + 1], attn1[:, :H + 1]]


# main.py


def load_model(head_fusion):
    model = TransMIL(n_classes=2, head_fusion=head_fusion, dim=64, in_dim=768)
    model.layer1.attn.head_fusion = head_fusion
    model.layer2.attn.head_fusion = head_fusion
    return model


def main():
    torch.manual_seed(0)
    model = load_model(head_fusion='min')
    model.eval()

    # one slide: 50 patch features (CLAM-style h5 'features'), batch_size=1 as in main.py's DataLoader
    num_patches = 50
    feature = torch.randn(1, num_patches, 768)

    with torch.no_grad():
        results_dict, attns = model(feature)
    result = torch.ones(attns[0].shape).to(attns[0].device)
    for i, attn in enumerate(attns):
        result = ((attn * result) + result) / 2
    attns = result[0, 1:].to('cpu')
    if int(results_dict['Y_hat']) == 1:
        epsilon = 1e-10
        attns = attns + epsilon
        attns = attns.exp()
        min_val = attns.min()
        max_val = attns.max()
        attns = (attns - min_val) / (max_val - min_val)
        attns = attns / attns.mean()
    else:
        attns = attns * 0.1

    print("Y_prob:", [round(p, 4) for p in results_dict['Y_prob'][0].tolist()])
    print("heatmap weights of the first 8 patches:", [round(a, 6) for a in attns[:8].tolist()])
    print("top-5 patches of the heatmap:", attns.topk(5).indices.tolist())
    print("heatmap sum: %.6f" % attns.sum().item())


if __name__ == "__main__":
    main()
