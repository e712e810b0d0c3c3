# Citation: guandeh17/Self-Forcing wan/modules/causal_model.py (CausalWanModel._prepare_blockwise_causal_attn_mask,
#   CausalWanSelfAttention.forward training path), commit a48b50fbad25e050f8105088ed9d4fdafb256d84.
# Autoregressive video diffusion: tokens are [frame 0][frame 1]...; each frame block attends bidirectionally inside
# itself and to every earlier frame (kv_idx < ends[q_idx]), optionally only the last local_attn_size frames.
# The sequence is right-padded to a multiple of 128 for flex_attention; padded queries have ends == 0 and keep only
# their diagonal (q_idx == kv_idx), so no row is empty, and the padded outputs are sliced off ([:, :, :-padded_length]).
import math
import warnings

import torch
import torch.nn as nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

warnings.filterwarnings("ignore")
torch.manual_seed(0)


class WanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.dim = dim
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return self._norm(x.float()).type_as(x) * self.weight

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)


def rope_params(max_seq_len, dim, theta=10000):
    assert dim % 2 == 0
    freqs = torch.outer(torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float64).div(dim)))
    freqs = torch.polar(torch.ones_like(freqs), freqs)
    return freqs


def rope_apply(x, grid_sizes, freqs):
    n, c = x.size(2), x.size(3) // 2
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    output = []
    for i, (f, h, w) in enumerate(grid_sizes.tolist()):
        seq_len = f * h * w
        x_i = torch.view_as_complex(x[i, :seq_len].to(torch.float64).reshape(seq_len, n, -1, 2))
        freqs_i = torch.cat([
            freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
            freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1)
        ], dim=-1).reshape(seq_len, 1, -1)
        x_i = torch.view_as_real(x_i * freqs_i).flatten(2)
        x_i = torch.cat([x_i, x[i, seq_len:]])
        output.append(x_i)
    return torch.stack(output).float()


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, local_attn_size=-1, sink_size=0, qk_norm=True, eps=1e-6):
        assert dim % num_heads == 0
        super().__init__()
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.local_attn_size = local_attn_size
        self.sink_size = sink_size
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x, seq_lens, grid_sizes, freqs, block_mask, kv_cache=None, current_start=0, cache_start=None):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim

        def qkv_fn(x):
            q = self.norm_q(self.q(x)).view(b, s, n, d)
            k = self.norm_k(self.k(x)).view(b, s, n, d)
            v = self.v(x).view(b, s, n, d)
            return q, k, v

        q, k, v = qkv_fn(x)
        assert kv_cache is None  # training path
        roped_query = rope_apply(q, grid_sizes, freqs).type_as(v)
        roped_key = rope_apply(k, grid_sizes, freqs).type_as(v)

        padded_length = math.ceil(q.shape[1] / 128) * 128 - q.shape[1]
        padded_roped_query = torch.cat(
            [roped_query, torch.zeros([q.shape[0], padded_length, q.shape[2], q.shape[3]], device=q.device, dtype=v.dtype)],
            dim=1)
        padded_roped_key = torch.cat(
            [roped_key, torch.zeros([k.shape[0], padded_length, k.shape[2], k.shape[3]], device=k.device, dtype=v.dtype)],
            dim=1)
        padded_v = torch.cat(
            [v, torch.zeros([v.shape[0], padded_length, v.shape[2], v.shape[3]], device=v.device, dtype=v.dtype)],
            dim=1)

        x = flex_attention(
            query=padded_roped_query.transpose(2, 1),
            key=padded_roped_key.transpose(2, 1),
            value=padded_v.transpose(2, 1),
            block_mask=block_mask
        )[:, :, :-padded_length].transpose(2, 1)

        x = x.flatten(2)
        x = self.o(x)
        return x


def _prepare_blockwise_causal_attn_mask(device, num_frames=21, frame_seqlen=1560, num_frame_per_block=1,
                                        local_attn_size=-1) -> BlockMask:
    total_length = num_frames * frame_seqlen

    # we do right padding to get to a multiple of 128
    padded_length = math.ceil(total_length / 128) * 128 - total_length

    ends = torch.zeros(total_length + padded_length, device=device, dtype=torch.long)

    # Block-wise causal mask will attend to all elements that are before the end of the current chunk
    frame_indices = torch.arange(start=0, end=total_length, step=frame_seqlen * num_frame_per_block, device=device)

    for tmp in frame_indices:
        ends[tmp:tmp + frame_seqlen * num_frame_per_block] = tmp + frame_seqlen * num_frame_per_block

    def attention_mask(b, h, q_idx, kv_idx):
        if local_attn_size == -1:
            return (kv_idx < ends[q_idx]) | (q_idx == kv_idx)
        else:
            return ((kv_idx < ends[q_idx]) & (kv_idx >= (ends[q_idx] - local_attn_size * frame_seqlen))) | (q_idx == kv_idx)

    block_mask = create_block_mask(attention_mask, B=None, H=None, Q_LEN=total_length + padded_length,
                                   KV_LEN=total_length + padded_length, _compile=False, device=device)
    return block_mask


dim, num_heads = 48, 4
num_frames, h, w = 5, 4, 5  # frame_seqlen = 20, total 100 -> padded to 128
frame_seqlen = h * w
d = dim // num_heads
freqs = torch.cat([rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)), rope_params(1024, 2 * (d // 6))], dim=1)
grid_sizes = torch.tensor([[num_frames, h, w]] * 2)
seq_lens = torch.tensor([num_frames * frame_seqlen] * 2)

attn = CausalWanSelfAttention(dim, num_heads)
x = torch.randn(2, num_frames * frame_seqlen, dim)
target = torch.randn_like(x)
for num_frame_per_block, local_attn_size in ((1, -1), (1, 2)):
    block_mask = _prepare_blockwise_causal_attn_mask("cpu", num_frames=num_frames, frame_seqlen=frame_seqlen,
                                                     num_frame_per_block=num_frame_per_block,
                                                     local_attn_size=local_attn_size)
    with torch.no_grad():  # FlexAttention has no CPU backward: evaluate the denoising loss only
        out = attn(x, seq_lens, grid_sizes, freqs, block_mask)
    loss = torch.nn.functional.mse_loss(out, target)
    print(f"block={num_frame_per_block} local={local_attn_size} loss={loss.item():.4f}")
