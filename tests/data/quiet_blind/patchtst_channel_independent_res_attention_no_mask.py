"""PatchTST (supervised): channel-independent patch encoder, residual attention scores, no mask at all.

Follows yuqinie98/PatchTST PatchTST_supervised/layers/PatchTST_backbone.py@204c21efe0b39603ad6e2ca640ef5896646ab1a9
(PatchTST_backbone, TSTiEncoder, TSTEncoder, TSTEncoderLayer, _MultiheadAttention, _ScaledDotProductAttention;
read) and layers/RevIN.py (read); the argparse names are those of PatchTST_supervised/run_longExp.py.
Attention: each channel of each sample is its own sequence of patch tokens ([bs * nvars, patch_num, d_model]),
so a patch sees every patch of ITS channel, past and future (an encoder over the look-back window; the forecast
comes from a flatten head, not from causal decoding) and nothing of other channels. No key padding mask: the
window is never padded (padding_patch="end" replicates the last value to make one more patch of real data).
With res_attention (the default), each layer adds the previous layer's pre-softmax scores to its own
(RealFormer): `attn_scores = attn_scores + prev`, on purpose.
"""
import argparse
import math

import torch
from torch import nn
import torch.nn.functional as F


class Transpose(nn.Module):
    def __init__(self, *dims):
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return x.transpose(*self.dims)


class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5, affine=True):
        super().__init__()
        self.eps = eps
        self.affine_weight = nn.Parameter(torch.ones(num_features))
        self.affine_bias = nn.Parameter(torch.zeros(num_features))

    def forward(self, x, mode):
        if mode == "norm":
            self.mean = torch.mean(x, dim=1, keepdim=True).detach()
            self.stdev = torch.sqrt(torch.var(x, dim=1, keepdim=True, unbiased=False) + self.eps).detach()
            return (x - self.mean) / self.stdev * self.affine_weight + self.affine_bias
        x = (x - self.affine_bias) / (self.affine_weight + self.eps * self.eps)
        return x * self.stdev + self.mean


class _ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model, n_heads, res_attention=False):
        super().__init__()
        self.res_attention = res_attention
        self.scale = nn.Parameter(torch.tensor((d_model // n_heads) ** -0.5), requires_grad=False)

    def forward(self, q, k, v, prev=None):
        attn_scores = torch.matmul(q, k) * self.scale
        # Add pre-softmax attention scores from the previous layer (optional)
        if prev is not None:
            attn_scores = attn_scores + prev
        attn_weights = F.softmax(attn_scores, dim=-1)
        output = torch.matmul(attn_weights, v)
        return output, attn_weights, attn_scores


class _MultiheadAttention(nn.Module):
    def __init__(self, d_model, n_heads, res_attention=False):
        super().__init__()
        self.n_heads, self.d_k = n_heads, d_model // n_heads
        self.W_Q = nn.Linear(d_model, d_model)
        self.W_K = nn.Linear(d_model, d_model)
        self.W_V = nn.Linear(d_model, d_model)
        self.sdp_attn = _ScaledDotProductAttention(d_model, n_heads, res_attention=res_attention)
        self.to_out = nn.Linear(d_model, d_model)

    def forward(self, Q, prev=None):
        bs = Q.size(0)
        q_s = self.W_Q(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        k_s = self.W_K(Q).view(bs, -1, self.n_heads, self.d_k).permute(0, 2, 3, 1)
        v_s = self.W_V(Q).view(bs, -1, self.n_heads, self.d_k).transpose(1, 2)
        output, attn_weights, attn_scores = self.sdp_attn(q_s, k_s, v_s, prev=prev)
        output = output.transpose(1, 2).contiguous().view(bs, -1, self.n_heads * self.d_k)
        return self.to_out(output), attn_weights, attn_scores


class TSTEncoderLayer(nn.Module):
    def __init__(self, d_model, n_heads, d_ff, res_attention=True):
        super().__init__()
        self.self_attn = _MultiheadAttention(d_model, n_heads, res_attention=res_attention)
        self.norm_attn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))
        self.ff = nn.Sequential(nn.Linear(d_model, d_ff), nn.GELU(), nn.Linear(d_ff, d_model))
        self.norm_ffn = nn.Sequential(Transpose(1, 2), nn.BatchNorm1d(d_model), Transpose(1, 2))

    def forward(self, src, prev=None):
        src2, attn, scores = self.self_attn(src, prev)
        src = self.norm_attn(src + src2)
        src = self.norm_ffn(src + self.ff(src))
        return src, scores


class TSTiEncoder(nn.Module):  # i means channel-independent
    def __init__(self, patch_num, patch_len, n_layers, d_model, n_heads, d_ff):
        super().__init__()
        self.W_P = nn.Linear(patch_len, d_model)
        self.W_pos = nn.Parameter(torch.empty(patch_num, d_model).uniform_(-0.02, 0.02))
        self.layers = nn.ModuleList([TSTEncoderLayer(d_model, n_heads, d_ff) for _ in range(n_layers)])

    def forward(self, x):  # x: [bs x nvars x patch_len x patch_num]
        n_vars = x.shape[1]
        x = self.W_P(x.permute(0, 1, 3, 2))
        u = torch.reshape(x, (x.shape[0] * x.shape[1], x.shape[2], x.shape[3])) + self.W_pos
        scores = None
        for mod in self.layers:
            u, scores = mod(u, prev=scores)
        z = torch.reshape(u, (-1, n_vars, u.shape[-2], u.shape[-1]))
        return z.permute(0, 1, 3, 2)


class PatchTST_backbone(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.revin_layer = RevIN(args.enc_in)
        self.patch_len, self.stride = args.patch_len, args.stride
        patch_num = int((args.seq_len - args.patch_len) / args.stride + 1)
        self.padding_patch_layer = nn.ReplicationPad1d((0, args.stride))
        patch_num += 1
        self.backbone = TSTiEncoder(patch_num, args.patch_len, args.e_layers, args.d_model, args.n_heads, args.d_ff)
        self.flatten = nn.Flatten(start_dim=-2)
        self.linear = nn.Linear(args.d_model * patch_num, args.pred_len)

    def forward(self, z):  # z: [bs x nvars x seq_len]
        z = self.revin_layer(z.permute(0, 2, 1), "norm").permute(0, 2, 1)
        z = self.padding_patch_layer(z)
        z = z.unfold(dimension=-1, size=self.patch_len, step=self.stride).permute(0, 1, 3, 2)
        z = self.linear(self.flatten(self.backbone(z)))
        return self.revin_layer(z.permute(0, 2, 1), "denorm").permute(0, 2, 1)


def main():
    parser = argparse.ArgumentParser(description="PatchTST")
    parser.add_argument("--enc_in", type=int, default=3)
    parser.add_argument("--seq_len", type=int, default=32)
    parser.add_argument("--pred_len", type=int, default=8)
    parser.add_argument("--patch_len", type=int, default=8)
    parser.add_argument("--stride", type=int, default=4)
    parser.add_argument("--e_layers", type=int, default=2)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--d_model", type=int, default=16)
    parser.add_argument("--d_ff", type=int, default=32)
    args = parser.parse_args([])

    torch.manual_seed(0)
    model = PatchTST_backbone(args).eval()
    x = torch.randn(2, args.enc_in, args.seq_len).cumsum(-1)  # [bs x nvars x seq_len]
    with torch.no_grad():
        y = model(x)
        # Channel independence: changing channel 2 leaves channels 0 and 1 unchanged.
        x2 = x.clone()
        x2[:, 2] = 5.0 * torch.randn(2, args.seq_len)
        y2 = model(x2)
        assert torch.allclose(y[:, :2], y2[:, :2], atol=1e-5)

        # Residual attention: layer 2 equals SDPA with layer 1's raw scores given as an additive float mask.
        layer1, layer2 = model.backbone.layers
        z = model.padding_patch_layer(model.revin_layer(x.permute(0, 2, 1), "norm").permute(0, 2, 1))
        z = z.unfold(-1, args.patch_len, args.stride)
        u = model.backbone.W_P(z).reshape(-1, z.shape[2], args.d_model) + model.backbone.W_pos
        u1, scores1 = layer1(u)
        att = layer2.self_attn
        bs = u1.shape[0]
        def heads(t):
            return t.view(bs, -1, att.n_heads, att.d_k).transpose(1, 2)
        ref = F.scaled_dot_product_attention(heads(att.W_Q(u1)), heads(att.W_K(u1)), heads(att.W_V(u1)),
                                             attn_mask=scores1)
        ref = att.to_out(ref.transpose(1, 2).reshape(bs, -1, args.d_model))
        got, _, _ = att(u1, prev=scores1)
        assert torch.allclose(got, ref, atol=1e-5)
    print("patchtst forecast:", tuple(y.shape))


if __name__ == "__main__":
    main()
