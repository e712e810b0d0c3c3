"""FastFold (OpenFold's Evoformer with fused kernels): the fused scale-mask softmax fills masked logits with -inf.

Citation: hpcaitech/FastFold#12, commit ed759cf "fix mask softmax and support inference for arbitrary
length sequences" (fastfold/model/kernel/cuda_native/csrc/softmax_cuda_kernel.cu,
fastfold_softmax_scale_mask_* and fastfold_softmax_scale_mask_bias_*).

The bug: the fused kernels behind ``scale_mask_softmax`` / ``scale_mask_bias_softmax`` (used by
``SelfAttention`` in fastfold/model/ops.py for MSA row attention with pair bias and MSA column
attention) wrote ``buf[i] = -1 * CUDART_INF_F`` wherever ``mask == 0``. A softmax row whose keys
are all masked - every row of an MSA sequence that is only padding (OpenFold pads the MSA to
``max_msa_clusters`` and sets ``msa_mask`` to 0 there) - then computes exp(-inf - (-inf)) = NaN.
Those NaN rows are the values of the next column attention and the inputs of the outer product
mean, where a 0 weight or a 0 mask times NaN is still NaN, so every residue's MSA and pair
representation becomes NaN.

The fix: fill masked logits with a large finite negative number (``-1 * 1e9``; ``-1 * 10e9`` in
the bias kernels), so all-masked rows give finite (uniform) weights that later masks remove.

The CUDA kernels are written here in torch with the kernel's own row layout
(``rows = prod(shape[:-1])``, the mask row picked by ``row_offset / (head * cols)``, the bias row by
``row_offset % (head * cols)``). Dynamic axial parallelism runs on one rank, so scatter / gather
are the identity. The Evoformer block is trimmed to its MSA stack and the outer product mean
(the pair stack is left out); sizes are tiny and weights random (the zero-initialised output
projections are re-drawn so the block is not an identity).
"""

import math
import sys
from functools import reduce
from operator import mul

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# ---- fastfold/model/kernel/cuda_native/csrc/softmax_cuda_kernel.cu (ported) --------------------
MASK_FILL = -1 * 1e9 if FIXED else -float("inf")
MASK_BIAS_FILL = -1 * 10e9 if FIXED else -float("inf")


def fastfold_softmax_scale_mask(input, mask, rows, cols, scale, head, bias=None, fill=MASK_FILL):
    row_input = input.reshape(rows, cols)
    row_offset = torch.arange(rows)
    mask_ptr = mask.reshape(-1, cols)[row_offset // (head * cols)]
    buf = row_input * scale
    if bias is not None:
        bias_ptr = bias.reshape(-1, cols)[row_offset % (head * cols)]
        buf = buf + bias_ptr
    buf = torch.where(mask_ptr == 0, torch.full_like(buf, fill), buf)
    warp_max = buf.max(dim=-1, keepdim=True).values
    buf = torch.exp(buf - warp_max)
    warp_sum = buf.sum(dim=-1, keepdim=True)
    return (buf / warp_sum).reshape(input.shape)


# ---- fastfold/model/kernel/cuda_native/softmax.py ----------------------------------------------
def scale_mask_softmax(input, mask, scale):
    input_ = input.contiguous()
    mask_ = mask.contiguous()
    cols = input_.shape[-1]
    rows = reduce(mul, input.shape[:-1])
    head = input.shape[2]
    return fastfold_softmax_scale_mask(input_, mask_, rows, cols, scale, head)


def scale_mask_bias_softmax(input, mask, bias, scale):
    input_ = input.contiguous()
    mask_ = mask.contiguous()
    bias_ = bias.contiguous()
    cols = input_.shape[-1]
    rows = reduce(mul, input.shape[:-1])
    head = input.shape[2]
    return fastfold_softmax_scale_mask(input_, mask_, rows, cols, scale, head, bias=bias_,
                                       fill=MASK_BIAS_FILL)


# ---- fastfold/distributed (one rank) and fastfold/model/kernel/jit/fused_ops.py ----------------
def scatter(x, dim):
    return x


def gather_async(x, dim):
    return x, None


def gather_async_opp(x, work, dim):
    return x


def row_to_col(x):
    return x


def bias_sigmod_ele(y, bias, z):
    return torch.sigmoid(y + bias) * z


def bias_dropout_add(x, bias, dropmask, residual, prob: float, training: bool):
    out = (x + bias) * F.dropout(dropmask, p=prob, training=training)
    return residual + out


# ---- fastfold/model/ops.py ---------------------------------------------------------------------
class Linear(nn.Linear):

    def __init__(self, feature_in, feature_out, initializer='linear', use_bias=True, bias_init=0.):
        super(Linear, self).__init__(feature_in, feature_out, bias=use_bias)
        self.use_bias = use_bias
        if self.use_bias:
            with torch.no_grad():
                self.bias.fill_(bias_init)


class Transition(nn.Module):

    def __init__(self, d, n=4):
        super(Transition, self).__init__()
        self.norm = nn.LayerNorm(d)
        self.linear1 = Linear(d, n * d, initializer='relu')
        self.linear2 = Linear(n * d, d, initializer='zeros')

    def forward(self, src):
        x = self.norm(src)
        x = self.linear2(F.relu(self.linear1(x)))
        return src + x


class OutProductMean(nn.Module):

    def __init__(self, n_feat=64, n_feat_out=128, n_feat_proj=32):
        super(OutProductMean, self).__init__()
        self.layernormM = nn.LayerNorm(n_feat)
        self.linear_a = Linear(n_feat, n_feat_proj)
        self.linear_b = Linear(n_feat, n_feat_proj)
        self.o_linear = Linear(n_feat_proj * n_feat_proj, n_feat_out, initializer='zero',
                               use_bias=True)

    def forward(self, M, M_mask):
        M = self.layernormM(M)
        right_act = self.linear_b(M)
        right_act_all, work = gather_async(right_act, dim=2)
        left_act = self.linear_a(M)
        M_mask = M_mask.unsqueeze(-1)
        M_mask_col = scatter(M_mask, dim=2)
        left_act = M_mask_col * left_act
        norm = torch.einsum('bsid,bsjd->bijd', M_mask_col, M_mask)
        right_act_all = gather_async_opp(right_act_all, work, dim=2)
        right_act_all = M_mask * right_act_all
        O = torch.einsum('bsid,bsje->bijde', left_act, right_act_all)
        O = O.reshape(*O.shape[:3], -1)  # rearrange 'b i j d e -> b i j (d e)'
        Z = self.o_linear(O)
        Z /= (1e-3 + norm)
        return Z


class SelfAttention(nn.Module):
    """Multi-Head SelfAttention dealing with [batch_size1, batch_size2, len, dim] tensors"""

    def __init__(self, qkv_dim, c, n_head, out_dim, gating=True, last_bias_fuse=False):
        super(SelfAttention, self).__init__()
        self.qkv_dim = qkv_dim
        self.c = c
        self.n_head = n_head
        self.out_dim = out_dim
        self.gating = gating
        self.last_bias_fuse = last_bias_fuse
        self.scaling = self.c**(-0.5)
        self.to_qkv = Linear(qkv_dim, 3 * n_head * c, initializer='linear', use_bias=False)
        if gating:
            self.gating_bias = nn.parameter.Parameter(data=torch.ones((n_head * c,)))
            self.gating_linear = Linear(qkv_dim, n_head * c, initializer='zero', use_bias=False)
        self.o_linear = Linear(n_head * c, out_dim, initializer='zero',
                               use_bias=(not last_bias_fuse))

    def forward(self, in_data, mask, nonbatched_bias=None):
        qkv = self.to_qkv(in_data).chunk(3, dim=-1)
        # rearrange 'b1 b2 n (h d) -> b1 b2 h n d'
        q, k, v = map(lambda t: t.reshape(*t.shape[:3], self.n_head, -1).transpose(2, 3), qkv)
        logits = torch.matmul(q, k.transpose(-1, -2))
        if nonbatched_bias is not None:
            bias = gather_async_opp(*nonbatched_bias, dim=1)
            bias = bias.permute(0, 3, 1, 2)  # rearrange 'b q k h -> b h q k'
            weights = scale_mask_bias_softmax(logits, mask, bias.unsqueeze(1), self.scaling)
        else:
            weights = scale_mask_softmax(logits, mask, self.scaling)
        weighted_avg = torch.matmul(weights, v)
        # rearrange 'b1 b2 h n d -> b1 b2 n (h d)'
        weighted_avg = weighted_avg.transpose(2, 3)
        weighted_avg = weighted_avg.reshape(*weighted_avg.shape[:3], -1)
        if self.gating:
            gate_values = self.gating_linear(in_data)
            weighted_avg = bias_sigmod_ele(gate_values, self.gating_bias, weighted_avg)
        output = self.o_linear(weighted_avg)
        return output


# ---- fastfold/model/msa.py ---------------------------------------------------------------------
class MSARowAttentionWithPairBias(nn.Module):

    def __init__(self, d_node, d_pair, c=32, n_head=8, p_drop=0.15):
        super(MSARowAttentionWithPairBias, self).__init__()
        self.d_node = d_node
        self.d_pair = d_pair
        self.c = c
        self.n_head = n_head
        self.p_drop = p_drop
        self.layernormM = nn.LayerNorm(d_node)
        self.layernormZ = nn.LayerNorm(d_pair)
        _init_weights = torch.nn.init.normal_(torch.zeros([n_head, d_pair]),
                                              std=1.0 / math.sqrt(d_pair))
        self.linear_b_weights = nn.parameter.Parameter(data=_init_weights, requires_grad=True)
        self.attention = SelfAttention(qkv_dim=d_node, c=c, n_head=n_head, out_dim=d_node,
                                       gating=True, last_bias_fuse=True)
        self.out_bias = nn.parameter.Parameter(data=torch.zeros((d_node,)), requires_grad=True)

    def forward(self, M_raw, Z, M_mask):
        M = self.layernormM(M_raw)
        Z = self.layernormZ(Z)
        b = F.linear(Z, self.linear_b_weights)
        b, work = gather_async(b, dim=1)
        M = self.attention(M, M_mask, (b, work))
        dropout_mask = torch.ones_like(M[:, 0:1, :, :], device=M.device, dtype=M.dtype)
        return bias_dropout_add(M, self.out_bias, dropout_mask, M_raw, prob=self.p_drop,
                                training=self.training)


class MSAColumnAttention(nn.Module):

    def __init__(self, d_node, c=32, n_head=8):
        super(MSAColumnAttention, self).__init__()
        self.d_node = d_node
        self.c = c
        self.n_head = n_head
        self.layernormM = nn.LayerNorm(d_node)
        self.attention = SelfAttention(qkv_dim=d_node, c=c, n_head=n_head, out_dim=d_node,
                                       gating=True)

    def forward(self, M_raw, M_mask):
        M = M_raw.transpose(-2, -3)
        M = self.layernormM(M)
        M_mask = M_mask.transpose(-1, -2)
        M = self.attention(M, M_mask)
        M = M.transpose(-2, -3)
        return M_raw + M


class MSAStack(nn.Module):

    def __init__(self, d_node, d_pair, p_drop=0.15):
        super(MSAStack, self).__init__()
        self.MSARowAttentionWithPairBias = MSARowAttentionWithPairBias(d_node=d_node,
                                                                       d_pair=d_pair,
                                                                       p_drop=p_drop)
        self.MSAColumnAttention = MSAColumnAttention(d_node=d_node)
        self.MSATransition = Transition(d=d_node)

    def forward(self, node, pair, node_mask):
        node_mask_row = scatter(node_mask, dim=1)
        node = self.MSARowAttentionWithPairBias(node, pair, node_mask_row)
        node = row_to_col(node)
        node_mask_col = scatter(node_mask, dim=2)
        node = self.MSAColumnAttention(node, node_mask_col)
        node = self.MSATransition(node)
        return node


# ---- fastfold/utils/inject_openfold.py EvoformerBlock (pair stack left out) --------------------
class EvoformerBlock(nn.Module):

    def __init__(self, c_m, c_z):
        super(EvoformerBlock, self).__init__()
        self.msa_stack = MSAStack(c_m, c_z, p_drop=0.15)
        self.communication = OutProductMean(n_feat=c_m, n_feat_out=c_z, n_feat_proj=8)

    def forward(self, m, z, msa_mask, pair_mask):
        m = m.unsqueeze(0)
        z = z.unsqueeze(0)
        msa_mask = msa_mask.unsqueeze(0)
        pair_mask = pair_mask.unsqueeze(0)
        m = self.msa_stack(m, z, msa_mask)
        z = z + self.communication(m, msa_mask)
        return m.squeeze(0), z.squeeze(0)


def main():
    torch.manual_seed(0)
    c_m, c_z, n_res, max_msa_clusters = 32, 16, 7, 5
    block = EvoformerBlock(c_m, c_z).eval()
    with torch.no_grad():  # stand-in for trained weights: redraw the zero-initialised projections
        for name, p in block.named_parameters():
            if p.dim() == 2 and p.abs().sum() == 0:
                p.normal_(0.0, 0.2)

    # One protein with 3 MSA sequences; OpenFold's make_fixed_size pads the MSA features to
    # max_msa_clusters rows and msa_mask is 0 on the padded rows.
    n_seq = 3
    m = torch.zeros(max_msa_clusters, n_res, c_m)
    m[:n_seq] = torch.randn(n_seq, n_res, c_m)
    msa_mask = torch.zeros(max_msa_clusters, n_res)
    msa_mask[:n_seq] = 1.0
    seq_mask = torch.ones(n_res)
    pair_mask = seq_mask[:, None] * seq_mask[None, :]
    z = torch.randn(n_res, n_res, c_z)

    with torch.no_grad():
        m_out, z_out = block(m, z, msa_mask, pair_mask)

    print("fixed" if FIXED else "buggy")
    print("first MSA row, residue 0:", m_out[0, 0, :4])
    print("pair z[0, 1]:", z_out[0, 1, :4])
    print("NaN in real MSA rows:", bool(torch.isnan(m_out[:n_seq]).any()),
          "NaN in pair:", bool(torch.isnan(z_out).any()))


if __name__ == "__main__":
    main()
