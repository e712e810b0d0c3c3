# rwth-i6/returnn commit 324fa79 ("RF fix causal self att with concat state"; the concat-history path came in
# commit 5e5da2a, "RF causal self att, handle concat history"). RETURNN frontend CausalSelfAttention run chunk by
# chunk: the first chunk is encoded over its whole axis and its keys/values kept as CausalSelfAttentionState, the
# next chunk (several frames at once) is called with that state. In `_causal_self_att_step` the state branch
# concatenated the cached keys with the chunk's keys and used the concatenated dim itself as the attention axis;
# RETURNN masks by the sizes of that dim, which were only the per-sequence total lengths (cached + chunk), so every
# frame of the chunk attended to all later frames of the same chunk. Fix: give the key axis per-query sizes
# prev_len + t + 1 (`hist_lens = state.accum_axis sizes + range(axis) + 1`) and replace the concat dim by it.
# (Plain-torch port of returnn/frontend/attention.py and the PyTorch backend's masked softmax; a RETURNN Dim is
# written here as a size tensor; right padding, batch of two sequences with different lengths.)
import sys
from typing import Optional, Tuple

import torch
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class Dim:
    """A (maybe dynamic) dim: ``size`` is a scalar int, or a size tensor broadcast against the batch / query axes."""

    def __init__(self, size, name: str, size_axes=("batch",)):
        self.size = size
        self.name = name
        self.description = name
        self.size_axes = size_axes  # which axes the size tensor runs over: batch and/or the query frames

    def get_size_tensor(self) -> Tensor:
        return self.size if isinstance(self.size, Tensor) else torch.tensor(self.size)


def range_over_dim(dim_value: int) -> Tensor:
    return torch.arange(dim_value)


def get_sequence_mask_broadcast(axis: Dim, kv_len: int) -> Tensor:
    """
    Sequence mask of ``axis`` broadcast to the energy layout [B, H, T_q, T_kv].
    ``axis.size`` is [B] (per-sequence), [T_q] (per query frame), or [B, T_q].
    """
    sizes = axis.get_size_tensor()
    idx = torch.arange(kv_len)
    if axis.size_axes == ("query",):
        return idx[None, None, None, :] < sizes[None, None, :, None]  # [1,1,T_q,T_kv]
    if axis.size_axes == ("batch",):
        return idx[None, None, None, :] < sizes[:, None, None, None]  # [B,1,1,T_kv]
    return idx[None, None, None, :] < sizes[:, None, :, None]  # [B,1,T_q,T_kv]


def softmax(tensor: Tensor, *, axis: Dim) -> Tensor:
    # TorchBackend.softmax: use_mask and axis.need_masking() -> torch.where(mask, x, -inf)
    mask = get_sequence_mask_broadcast(axis, tensor.shape[-1])
    tensor = torch.where(mask, tensor, -float("inf"))
    return torch.softmax(tensor, dim=-1)


def dot_attention(query: Tensor, keys: Tensor, values: Tensor, *, key_dim: int, axis: Dim) -> Tensor:
    """
    :param query: [B, H, T_q, D_k]
    :param keys: [B, H, T_kv, D_k]
    :param values: [B, H, T_kv, D_v]
    """
    query = query * key_dim**-0.5
    energy = torch.matmul(query, keys.transpose(-1, -2))
    att_weights = softmax(energy, axis=axis)
    att = torch.matmul(att_weights, values)
    return att


def concat_handle_dynamic_dims(a: Tensor, a_dim: Dim, b: Tensor, b_dim: Dim) -> Tuple[Tensor, Dim]:
    """rf.concat((a, a_dim), (b, b_dim), handle_dynamic_dims=True) on [B, H, T, F]: b goes right after a's real frames"""
    a_lens, b_lens = a_dim.get_size_tensor(), b_dim.get_size_tensor()
    out_lens = a_lens + b_lens
    out = a.new_zeros(a.shape[0], a.shape[1], a.shape[2] + b.shape[2], a.shape[3])
    for i in range(a.shape[0]):
        la, lb = int(a_lens[i]), int(b_lens[i])
        out[i, :, :la] = a[i, :, :la]
        out[i, :, la : la + lb] = b[i, :, :lb]
    out = out[:, :, : int(out_lens.max())]
    return out, Dim(out_lens, name=f"concat({a_dim.name},{b_dim.name})")


class CausalSelfAttentionState:
    def __init__(self, k_accum: Tensor = None, v_accum: Tensor = None, accum_axis: Dim = None):
        self.k_accum = k_accum
        self.v_accum = v_accum
        self.accum_axis = accum_axis


class CausalSelfAttention(nn.Module):
    """Classic causal self attention"""

    def __init__(self, in_dim: int, *, key_dim_total: int, value_dim_total: int, num_heads: int, with_bias=False):
        super().__init__()
        self.num_heads = num_heads
        self.key_dim_per_head = key_dim_total // num_heads
        self.value_dim_per_head = value_dim_total // num_heads
        self.value_dim_total = value_dim_total
        self.qkv_dim_total = 2 * key_dim_total + value_dim_total
        self.qkv_dim_per_head = 2 * self.key_dim_per_head + self.value_dim_per_head
        self.qkv = nn.Linear(in_dim, self.qkv_dim_total, bias=with_bias)

    def forward_qkv(self, source: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
        B, T, _ = source.shape
        qkv = self.qkv(source).view(B, T, self.num_heads, self.qkv_dim_per_head).transpose(1, 2)
        q, k, v = torch.split(qkv, [self.key_dim_per_head, self.key_dim_per_head, self.value_dim_per_head], dim=-1)
        return q, k, v

    def attention(self, q: Tensor, k: Tensor, v: Tensor, *, kv_axis: Dim) -> Tensor:
        att = dot_attention(q, k, v, key_dim=self.key_dim_per_head, axis=kv_axis)
        B, H, T, Dv = att.shape
        return att.transpose(1, 2).reshape(B, T, H * Dv)

    def forward(self, source: Tensor, axis: Dim, *, state: Optional[CausalSelfAttentionState] = None):
        q, k, v = self.forward_qkv(source)
        k, v, hist_dim, new_state = _causal_self_att_step(k, v, axis=axis, state=state, self=self)
        output = self.attention(q, k, v, kv_axis=hist_dim)
        return output, new_state


def _causal_self_att_step(k: Tensor, v: Tensor, *, axis: Dim, state: Optional[CausalSelfAttentionState], self):
    new_state = CausalSelfAttentionState()
    if state and state.accum_axis is not None and int(state.accum_axis.get_size_tensor().max()) != 0:
        k, concat_dim = concat_handle_dynamic_dims(state.k_accum, state.accum_axis, k, axis)
        v, _ = concat_handle_dynamic_dims(state.v_accum, state.accum_axis, v, axis)
        new_state.k_accum = k
        new_state.v_accum = v
        new_state.accum_axis = concat_dim
        if FIXED:
            t_max = int(axis.get_size_tensor().max())
            hist_lens = state.accum_axis.get_size_tensor()[:, None] + range_over_dim(t_max)[None, :] + 1  # [B,T]
            hist_dim = Dim(hist_lens, name=f"{axis.description}:kv", size_axes=("batch", "query"))
        else:
            hist_dim = concat_dim
    else:  # no state
        new_state.k_accum = k
        new_state.v_accum = v
        new_state.accum_axis = axis
        # See CumConcatLayer and https://github.com/rwth-i6/returnn/issues/391 for the idea.
        t_max = int(axis.get_size_tensor().max())
        hist_dim = Dim(range_over_dim(t_max) + 1, name=f"{axis.description}:kv", size_axes=("query",))
    return k, v, hist_dim, new_state


def main():
    feat_dim, key_dim, value_dim = 8, 6, 10
    model = CausalSelfAttention(feat_dim, key_dim_total=key_dim, value_dim_total=value_dim, num_heads=2)
    model.eval()

    # two streamed chunks per sequence, right padded; lengths differ per sequence
    time1_lens = torch.tensor([5, 3])
    time2_lens = torch.tensor([4, 4])
    B = 2
    data1 = torch.randn(B, int(time1_lens.max()), feat_dim)
    data2 = torch.randn(B, int(time2_lens.max()), feat_dim)
    for i in range(B):
        data1[i, time1_lens[i]:] = 0.0
        data2[i, time2_lens[i]:] = 0.0
    time1_dim = Dim(time1_lens, name="time1")
    time2_dim = Dim(time2_lens, name="time2")

    with torch.no_grad():
        # chunk 1 over its whole axis, then chunk 2 with the state of chunk 1
        res1, state = model(data1, axis=time1_dim)
        res2, state = model(data2, axis=time2_dim, state=state)

        # the same frames as one sequence, for reference
        full_lens = time1_lens + time2_lens
        full = torch.zeros(B, int(full_lens.max()), feat_dim)
        for i in range(B):
            full[i, : time1_lens[i]] = data1[i, : time1_lens[i]]
            full[i, time1_lens[i] : full_lens[i]] = data2[i, : time2_lens[i]]
        out_whole, _ = model(full, axis=Dim(full_lens, name="time"))

    for i in range(B):
        l1, l2 = int(time1_lens[i]), int(time2_lens[i])
        print(f"seq {i}: chunk-2 frame 0 output {[round(x, 4) for x in res2[i, 0, :4].tolist()]}")
        print(f"seq {i}: whole-seq output at that frame {[round(x, 4) for x in out_whole[i, l1, :4].tolist()]}")
        diff = (res2[i, :l2] - out_whole[i, l1 : l1 + l2]).abs().max().item()
        print(f"seq {i}: max |chunked - whole| over chunk 2 = {diff:.6f}")
    print("state accum lengths:", state.accum_axis.get_size_tensor().tolist())


if __name__ == "__main__":
    main()
