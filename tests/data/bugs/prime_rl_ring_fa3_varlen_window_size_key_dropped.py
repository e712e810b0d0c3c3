# prime-rl ring attention (context parallel) over FA3's low-level varlen forward.
#
# Citation: PrimeIntellect-ai/prime-rl#2352 (commit 20454ecd7) and #2417 (commit 0deb4abaa),
# src/prime_rl/trainer/models/layers/ring_attn.py (_fa3_varlen_forward, _RingFA3Varlen) and
# layers/attn.py (window_size = (sliding_window - 1, 0) for sliding layers).
#
# Bug: _fa3_varlen_forward fills FA3's `_flash_attn_forward` keyword dict from
# ring_flash_attn's get_default_args() and writes the window only `if "window_size" in params`.
# The installed FA3 forward takes `causal` plus `window_size_left` / `window_size_right`, so the
# sliding window of a local layer (AFMoE-style, window 8 here) never reached the kernel: every
# context-parallel rank ran plain causal attention over the all-gathered keys.
# Fix: the window is written under whichever names the kernel's signature has
# (`_set_fa3_signature_params`: window_size, or window_size_left / window_size_right).
#
# The FA3 kernel is a plain-torch stand-in with FA3's keyword names; the CP group is simulated
# in one process (the all-gather is a torch.cat of the ranks' local K/V).
import inspect
import sys
from functools import cache

import torch

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------------------
# stand-in for flash_attn_interface._flash_attn_forward (FA3 keyword names)
# ---------------------------------------------------------------------------
def _flash_attn_forward(
    q,
    k,
    v,
    k_new=None,
    v_new=None,
    qv=None,
    out=None,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    cu_seqlens_k_new=None,
    seqused_q=None,
    seqused_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    page_table=None,
    kv_batch_idx=None,
    leftpad_k=None,
    rotary_cos=None,
    rotary_sin=None,
    seqlens_rotary=None,
    q_descale=None,
    k_descale=None,
    v_descale=None,
    softmax_scale=None,
    causal=False,
    window_size_left=-1,
    window_size_right=-1,
    attention_chunk=0,
    softcap=0.0,
    rotary_interleaved=True,
    scheduler_metadata=None,
    num_splits=1,
    pack_gqa=None,
    sm_margin=0,
):
    # q: (total_q, nheads, d), k/v: (total_k, nheads_k, d); causal is bottom-right aligned.
    total_q, nheads, d = q.shape
    nheads_k = k.shape[1]
    if softmax_scale is None:
        softmax_scale = d ** (-0.5)
    out = torch.zeros_like(q)
    lse = torch.full((nheads, total_q), float("-inf"), dtype=torch.float32)
    for b in range(cu_seqlens_q.numel() - 1):
        qs, qe = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        ks, ke = int(cu_seqlens_k[b]), int(cu_seqlens_k[b + 1])
        lq, lk = qe - qs, ke - ks
        qb = q[qs:qe].transpose(0, 1)  # (h, lq, d)
        kb = k[ks:ke].transpose(0, 1).repeat_interleave(nheads // nheads_k, dim=0)
        vb = v[ks:ke].transpose(0, 1).repeat_interleave(nheads // nheads_k, dim=0)
        scores = (qb @ kb.transpose(-1, -2)).float() * softmax_scale
        q_pos = torch.arange(lq)[:, None] + (lk - lq)
        k_pos = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= k_pos <= q_pos
        if window_size_left >= 0:
            allowed &= k_pos >= q_pos - window_size_left
        if window_size_right >= 0:
            allowed &= k_pos <= q_pos + window_size_right
        scores = scores.masked_fill(~allowed, float("-inf"))
        lse[:, qs:qe] = torch.logsumexp(scores, dim=-1)
        out[qs:qe] = (torch.softmax(scores, dim=-1).to(vb.dtype) @ vb).transpose(0, 1)
    return out, lse, None, None


# ---------------------------------------------------------------------------
# ring_flash_attn.utils.get_default_args
# ---------------------------------------------------------------------------
@cache
def _get_default_args(func):
    spec = inspect.getfullargspec(func)
    defaults = spec.defaults if spec.defaults is not None else ()
    padded_defaults = (None,) * (len(spec.args) - len(defaults)) + defaults
    args = dict(zip(spec.args, padded_defaults))
    if "softcap" in args:
        args["softcap"] = 0.0
    return args


def get_default_args(func):
    return _get_default_args(func)


# ---------------------------------------------------------------------------
# prime_rl/trainer/models/layers/ring_attn.py
# ---------------------------------------------------------------------------
def _set_fa3_signature_params(params: dict, causal: bool, window_size: tuple[int, int]) -> None:
    if "is_causal" in params:
        params["is_causal"] = causal
    else:
        params["causal"] = causal

    if "window_size" in params:
        params["window_size"] = window_size
    else:
        params["window_size_left"] = window_size[0]
        params["window_size_right"] = window_size[1]


def _fa3_varlen_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float,
    causal: bool,
    window_size: tuple[int, int] = (-1, -1),
) -> tuple[torch.Tensor, torch.Tensor]:
    params = get_default_args(_flash_attn_forward).copy()
    if not FIXED:
        params.update(
            {
                "q": q,
                "k": k,
                "v": v,
                "cu_seqlens_q": cu_seqlens_q,
                "cu_seqlens_k": cu_seqlens_k,
                "max_seqlen_q": max_seqlen_q,
                "max_seqlen_k": max_seqlen_k,
                "softmax_scale": softmax_scale,
                "causal": causal,
            }
        )
        if "window_size" in params:
            params["window_size"] = window_size
    else:
        params.update(
            {
                "q": q,
                "k": k,
                "v": v,
                "cu_seqlens_q": cu_seqlens_q,
                "cu_seqlens_k": cu_seqlens_k,
                "max_seqlen_q": max_seqlen_q,
                "max_seqlen_k": max_seqlen_k,
                "softmax_scale": softmax_scale,
            }
        )
        _set_fa3_signature_params(params, causal, window_size)
    out, lse, _, _ = _flash_attn_forward(**params)
    return out, lse


class SimCPGroup:
    """The CP process group, simulated: each rank's local K/V are registered, all_gather concatenates."""

    def __init__(self, world_size):
        self.world_size = world_size
        self.k_shards = [None] * world_size
        self.v_shards = [None] * world_size

    def all_gather(self, shards, head_slice):
        return torch.cat([s[:, head_slice] for s in shards], dim=0)


def ring_fa3_varlen_forward(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
    local_k_slice, heads_k_stride, causal, group, window_size_left=-1, window_size_right=-1,
):
    # _RingFA3Varlen.forward (llama3_flash_attn_varlen pattern: all-gather K/V, slice the keys
    # this rank's queries can reach, run FA3 on the slice).
    window_size = (window_size_left, window_size_right)
    softmax_scale = q.shape[-1] ** (-0.5)
    out_list = []
    lse_list = []
    nheads = q.shape[1]
    total_k, nheads_k, head_dim = k.shape
    for i in range(0, nheads_k, heads_k_stride):
        kv_k = group.all_gather(group.k_shards, slice(i, i + heads_k_stride))
        kv_v = group.all_gather(group.v_shards, slice(i, i + heads_k_stride))
        q_i = q[:, i * nheads // nheads_k : (i + heads_k_stride) * nheads // nheads_k]
        k_i = kv_k[local_k_slice]
        v_i = kv_v[local_k_slice]
        out_i, lse_i = _fa3_varlen_forward(
            q=q_i,
            k=k_i,
            v=v_i,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
        )
        out_list.append(out_i)
        lse_list.append(lse_i)
    out = torch.cat(out_list, dim=1)
    return out


# ---------------------------------------------------------------------------
# a sliding-window attention layer (layers/attn.py ring path), CP world size 2
# ---------------------------------------------------------------------------
class RingSlidingAttention(torch.nn.Module):
    def __init__(self, hidden_size=32, num_heads=4, num_kv_heads=2, sliding_window=8):
        super().__init__()
        self.head_dim = hidden_size // num_heads
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.q_proj = torch.nn.Linear(hidden_size, num_heads * self.head_dim, bias=False)
        self.k_proj = torch.nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = torch.nn.Linear(hidden_size, num_kv_heads * self.head_dim, bias=False)
        self.o_proj = torch.nn.Linear(num_heads * self.head_dim, hidden_size, bias=False)

    def project(self, h):
        t = h.shape[0]
        q = self.q_proj(h).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(h).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(h).view(t, self.num_kv_heads, self.head_dim)
        return q, k, v

    def forward_rank(self, q, rank, group, local_len):
        window_size = (-1, -1)
        sliding_window = getattr(self, "sliding_window", None)
        if sliding_window is not None:
            window_size = (sliding_window - 1, 0)
        # one packed document spans both ranks: rank r holds tokens [r*L, (r+1)*L)
        k_stop = (rank + 1) * local_len
        cu_seqlens_q = torch.tensor([0, local_len], dtype=torch.int32)
        cu_seqlens_k = torch.tensor([0, k_stop], dtype=torch.int32)
        out = ring_fa3_varlen_forward(
            q, group.k_shards[rank], group.v_shards[rank], cu_seqlens_q, cu_seqlens_k,
            local_len, k_stop, local_k_slice=slice(0, k_stop), heads_k_stride=1, causal=True,
            group=group, window_size_left=window_size[0], window_size_right=window_size[1],
        )
        return self.o_proj(out.reshape(out.shape[0], -1))


def main():
    torch.manual_seed(0)
    world_size, local_len, hidden = 2, 12, 32
    attn = RingSlidingAttention(hidden_size=hidden).eval()
    hidden_states = torch.randn(world_size * local_len, hidden)  # one document, 24 tokens
    group = SimCPGroup(world_size)
    qs = []
    with torch.no_grad():
        for r in range(world_size):
            q, k, v = attn.project(hidden_states[r * local_len : (r + 1) * local_len])
            group.k_shards[r], group.v_shards[r] = k, v
            qs.append(q)
        outs = [attn.forward_rank(qs[r], r, group, local_len) for r in range(world_size)]
    out = torch.cat(outs, dim=0)
    print("mode:", "fixed" if FIXED else "buggy")
    print("attention output shape:", tuple(out.shape))
    print("rank 0 last token output[:4]:", [round(x, 4) for x in outs[0][-1, :4].tolist()])
    print("rank 1 last token output[:4]:", [round(x, 4) for x in outs[1][-1, :4].tolist()])
    print("output checksum: %.6f" % out.abs().sum().item())


if __name__ == "__main__":
    main()
