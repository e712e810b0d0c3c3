# NVIDIA-NeMo/Megatron-Bridge#3484 (commit 10d6e76, "fix: pass total_tokens for SSM seq_idx in packed
# sequences", fixes #3474).
#
# Packed (THD) SFT of a hybrid Mamba/attention model (Nemotron-H style). Megatron-Core's PackedSeqParams
# derives the per-token `seq_idx` that the Mamba mixer hands to its conv1d + chunk-scan kernel only when
# `total_tokens` is set. Before the fix, Bridge's _forward_step_common / get_packed_seq_params never passed
# `total_tokens`, so `seq_idx` stayed None: the attention layers kept each document to itself through
# cu_seqlens, but the Mamba layers ran the whole packed row as one sequence, carrying conv and SSM state
# from one document into the next. The fix passes total_tokens = tokens.size(1) (labels.size(1) on the
# last pipeline stage) into the batch dict and on to PackedSeqParams.
#
# Ported in plain torch on CPU: PackedSeqParams.__post_init__ as megatron.core writes it,
# get_packed_seq_params and the packed branch of _forward_step_common as Bridge writes them, and
# MambaMixer.ssm_training / an attention layer in Megatron's [s, b, h] layout. The fused kernels
# (mamba_split_conv1d_scan_combined, TE's thd attention) are replaced by reference loops with the same
# arguments.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- megatron/core/packed_seq_params.py
@dataclass
class PackedSeqParams:
    qkv_format: str = None
    cu_seqlens_q: Tensor = None
    cu_seqlens_kv: Tensor = None
    cu_seqlens_q_padded: Tensor = None
    cu_seqlens_kv_padded: Tensor = None
    max_seqlen_q: int = None
    max_seqlen_kv: int = None
    total_tokens: int = None
    seq_idx: Tensor = None

    def __post_init__(self):
        cu_seqlens = self.cu_seqlens_q_padded if self.cu_seqlens_q_padded is not None else self.cu_seqlens_q
        if isinstance(cu_seqlens, Tensor) and self.total_tokens is not None:
            total_tokens_tensor = torch.tensor([self.total_tokens], dtype=cu_seqlens.dtype, device=cu_seqlens.device)
            cu_seqlens_with_max = torch.cat([cu_seqlens, total_tokens_tensor])
            seq_lengths = cu_seqlens_with_max[1:] - cu_seqlens_with_max[:-1]
            seq_lengths = seq_lengths.clamp(min=0)
            self.seq_idx = (
                torch.repeat_interleave(torch.arange(seq_lengths.numel(), device=cu_seqlens.device), seq_lengths)
                .to(torch.int32)
                .unsqueeze(0)
            )


# ---------------------------------------------------------------- bridge/training/utils/packed_seq_utils.py
def get_packed_seq_params(batch):
    cu_seqlens_padded = batch["cu_seqlens"].squeeze()
    cu_seqlens_unpadded = batch.get("cu_seqlens_unpadded")
    if cu_seqlens_unpadded is not None:
        cu_seqlens_unpadded = cu_seqlens_unpadded.squeeze()

    cu_seqlens_argmin = batch.get("cu_seqlens_argmin")
    cu_seqlens_unpadded_argmin = batch.get("cu_seqlens_unpadded_argmin")

    if cu_seqlens_argmin is not None:
        cu_seqlens_padded = cu_seqlens_padded[: cu_seqlens_argmin.item()]
    else:
        cu_seqlens_padded = cu_seqlens_padded[: torch.argmin(cu_seqlens_padded)]

    if cu_seqlens_unpadded is not None:
        if cu_seqlens_unpadded_argmin is not None:
            cu_seqlens_unpadded = cu_seqlens_unpadded[: cu_seqlens_unpadded_argmin.item()]
        else:
            cu_seqlens_unpadded = cu_seqlens_unpadded[: torch.argmin(cu_seqlens_unpadded)]

    max_seqlen = batch["max_seqlen"].squeeze() if "max_seqlen" in batch else None
    total_tokens = batch.get("total_tokens") if FIXED else None  # pre-fix: never read, PackedSeqParams default

    if cu_seqlens_unpadded is not None:
        return PackedSeqParams(
            cu_seqlens_q=cu_seqlens_unpadded,
            cu_seqlens_kv=cu_seqlens_unpadded,
            cu_seqlens_q_padded=cu_seqlens_padded,
            cu_seqlens_kv_padded=cu_seqlens_padded,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            total_tokens=total_tokens,
            qkv_format="thd",
        )
    else:
        return PackedSeqParams(
            cu_seqlens_q=cu_seqlens_padded,
            cu_seqlens_kv=cu_seqlens_padded,
            max_seqlen_q=max_seqlen,
            max_seqlen_kv=max_seqlen,
            total_tokens=total_tokens,
            qkv_format="thd",
        )


# ---------------------------------------------------------------- kernel stand-ins
def causal_conv1d_ref(x, weight, bias, seq_idx, activation="silu"):
    """x (b, d, l), weight (d, w): depthwise causal conv; with seq_idx a tap never reads another sequence."""
    b, d, l = x.shape
    w = weight.shape[1]
    out = torch.zeros_like(x)
    for t in range(l):
        acc = bias.view(1, d).expand(b, d).clone()
        for k in range(w):
            s = t - (w - 1) + k
            if s < 0:
                continue
            tap = x[:, :, s]
            if seq_idx is not None:
                same = (seq_idx[:, s] == seq_idx[:, t]).to(x.dtype).unsqueeze(1)
                tap = tap * same
            acc = acc + tap * weight[:, k]
        out[:, :, t] = acc
    return F.silu(out) if activation in ("silu", "swish") else out


def mamba_split_conv1d_scan_combined(zxBCdt, conv1d_weight, conv1d_bias, dt_bias, A, D, chunk_size,
                                     activation="silu", headdim=None, ngroups=1, norm_before_gate=False,
                                     seq_idx=None):
    """Reference for mamba_ssm's fused kernel (no rmsnorm_weight: out = y * silu(z))."""
    b, l, _ = zxBCdt.shape
    nheads = A.shape[0]
    d_inner = nheads * headdim
    d_state = (conv1d_weight.shape[0] - d_inner) // (2 * ngroups)
    z, xBC, dt = torch.split(zxBCdt, [d_inner, d_inner + 2 * ngroups * d_state, nheads], dim=-1)
    xBC = causal_conv1d_ref(xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx, activation).transpose(1, 2)
    x, B, C = torch.split(xBC, [d_inner, ngroups * d_state, ngroups * d_state], dim=-1)
    x = x.reshape(b, l, nheads, headdim)
    B = B.reshape(b, l, ngroups, d_state).repeat_interleave(nheads // ngroups, dim=2)
    C = C.reshape(b, l, ngroups, d_state).repeat_interleave(nheads // ngroups, dim=2)
    dt = F.softplus(dt + dt_bias)
    h = torch.zeros(b, nheads, headdim, d_state)
    ys = []
    for t in range(l):
        if seq_idx is not None and t > 0:
            keep = (seq_idx[:, t] == seq_idx[:, t - 1]).to(h.dtype).view(b, 1, 1, 1)
            h = h * keep
        dA = torch.exp(dt[:, t] * A)
        h = h * dA.view(b, nheads, 1, 1) + (dt[:, t].view(b, nheads, 1, 1) * x[:, t].unsqueeze(-1)
                                             * B[:, t].unsqueeze(2))
        y = (h * C[:, t].unsqueeze(2)).sum(-1) + x[:, t] * D.view(1, nheads, 1)
        ys.append(y.reshape(b, d_inner))
    y = torch.stack(ys, dim=1)
    return y * F.silu(z)


# ---------------------------------------------------------------- model (Megatron [s, b, h] layout)
class Config:
    hidden_size = 32
    num_attention_heads = 4
    mamba_num_heads = 4
    mamba_head_dim = 8
    mamba_state_dim = 8
    mamba_num_groups = 1
    d_conv = 4
    chunk_size = 128
    vocab_size = 64
    hybrid_override_pattern = "M*M"


class MambaMixer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.headdim = config.mamba_head_dim
        self.nheads = config.mamba_num_heads
        self.ngroups = config.mamba_num_groups
        self.d_state = config.mamba_state_dim
        self.d_inner = self.nheads * self.headdim
        self.chunk_size = config.chunk_size
        self.activation = "silu"
        self.norm_before_gate = False
        self.D_has_hdim = False
        conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.in_proj = nn.Linear(config.hidden_size, self.d_inner + conv_dim + self.nheads, bias=False)
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, config.d_conv, groups=conv_dim, padding=config.d_conv - 1)
        self.dt_bias = nn.Parameter(torch.rand(self.nheads) * 0.5)
        self.A_log = nn.Parameter(torch.log(torch.rand(self.nheads) * 0.5 + 0.1))
        self.D = nn.Parameter(torch.ones(self.nheads))
        self.norm = nn.LayerNorm(self.d_inner)
        self.out_proj = nn.Linear(self.d_inner, config.hidden_size, bias=False)

    def forward(self, hidden_states, packed_seq_params=None):
        zxBCdt = self.in_proj(hidden_states)
        y = self.ssm_training(zxBCdt, packed_seq_params)
        return self.out_proj(self.norm(y))

    def ssm_training(self, zxBCdt, packed_seq_params=None):
        zxBCdt = zxBCdt.transpose(0, 1).contiguous()  # l b d -> b l d
        A = -torch.exp(self.A_log.float())
        seq_idx = None
        if packed_seq_params is not None:
            seq_idx = packed_seq_params.seq_idx
        y = mamba_split_conv1d_scan_combined(
            zxBCdt,
            self.conv1d.weight.squeeze(1),
            self.conv1d.bias,
            self.dt_bias.float(),
            A,
            D=self.D,
            chunk_size=self.chunk_size,
            activation=self.activation,
            headdim=None if self.D_has_hdim else self.headdim,
            ngroups=self.ngroups,
            norm_before_gate=self.norm_before_gate,
            seq_idx=seq_idx,
        )
        return y.transpose(0, 1).contiguous()  # b l d -> l b d


class SelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.nh = config.num_attention_heads
        self.hd = config.hidden_size // self.nh
        self.linear_qkv = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.linear_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden_states, packed_seq_params=None):
        s, b, _ = hidden_states.shape
        q, k, v = self.linear_qkv(hidden_states).view(s, b, 3, self.nh, self.hd).unbind(2)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            # TE thd attention: causal within each [cu_seqlens[i], cu_seqlens[i+1]) segment
            cu = packed_seq_params.cu_seqlens_q
            doc = torch.zeros(s, dtype=torch.long)
            for i in range(cu.numel() - 1):
                doc[int(cu[i]):int(cu[i + 1])] = i
            pos = torch.arange(s)
            mask = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])
            out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                 v.permute(1, 2, 0, 3), attn_mask=mask)
        else:
            out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3),
                                                 v.permute(1, 2, 0, 3), is_causal=True)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))


class HybridLayer(nn.Module):
    def __init__(self, config, kind):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size)
        self.mixer = MambaMixer(config) if kind == "M" else SelfAttention(config)

    def forward(self, hidden_states, packed_seq_params=None):
        return hidden_states + self.mixer(self.norm(hidden_states), packed_seq_params=packed_seq_params)


class MambaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embedding = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(config, k) for k in config.hybrid_override_pattern)
        self.final_norm = nn.LayerNorm(config.hidden_size)
        self.output_layer = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, position_ids, attention_mask, labels=None, packed_seq_params=None):
        hidden_states = self.embedding(input_ids).transpose(0, 1)  # [s, b, h]
        for layer in self.layers:
            hidden_states = layer(hidden_states, packed_seq_params=packed_seq_params)
        logits = self.output_layer(self.final_norm(hidden_states)).transpose(0, 1)  # [b, s, v]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               reduction="none").view_as(labels)


# ---------------------------------------------------------------- data: one packed SFT micro-batch
def get_batch():
    g = torch.Generator().manual_seed(1)
    doc_lens = [7, 5, 8]
    docs = [torch.randint(1, 64, (n + 1,), generator=g) for n in doc_lens]
    tokens = torch.cat([d[:-1] for d in docs]).unsqueeze(0)
    labels = torch.cat([d[1:] for d in docs]).unsqueeze(0)
    loss_mask = torch.ones_like(tokens, dtype=torch.float)
    position_ids = torch.cat([torch.arange(n) for n in doc_lens]).unsqueeze(0)
    # Bridge's packed dataset pads cu_seqlens with -1 and gives the argmin
    cu_seqlens = torch.tensor([[0, 7, 12, 20, -1, -1]], dtype=torch.int32)
    cu_seqlens_argmin = torch.tensor([[4]])
    max_seqlen = torch.tensor([[8]])
    return tokens, labels, loss_mask, None, position_ids, cu_seqlens, cu_seqlens_argmin, max_seqlen, None, None


# ---------------------------------------------------------------- bridge/training/gpt_step.py
def _forward_step_common(model):
    (tokens, labels, loss_mask, attention_mask, position_ids, cu_seqlens, cu_seqlens_argmin, max_seqlen,
     cu_seqlens_unpadded, cu_seqlens_unpadded_argmin) = get_batch()

    forward_args = {
        "input_ids": tokens,
        "position_ids": position_ids,
        "attention_mask": attention_mask,
        "labels": labels,
    }

    if cu_seqlens is not None:
        packed_seq_params = {
            "cu_seqlens": cu_seqlens,
            "cu_seqlens_argmin": cu_seqlens_argmin,
            "max_seqlen": max_seqlen,
            "cu_seqlens_unpadded": cu_seqlens_unpadded,
            "cu_seqlens_unpadded_argmin": cu_seqlens_unpadded_argmin,
        }
        if FIXED:
            packed_seq_params["total_tokens"] = tokens.size(1) if tokens is not None else labels.size(1)
        forward_args["packed_seq_params"] = get_packed_seq_params(packed_seq_params)

    output_tensor = model(**forward_args)
    return output_tensor, loss_mask


def main():
    torch.manual_seed(0)
    model = MambaModel(Config()).eval()
    with torch.no_grad():
        losses, loss_mask = _forward_step_common(model)
    loss = (losses * loss_mask).sum() / loss_mask.sum()
    print("per-token loss:", [round(v, 4) for v in losses[0].tolist()])
    print("loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
