# hao-ai-lab/FastVideo commit dad62979e: the block-causal + sink training attention of the causal Wan DiT was
# given rolling_window_tokens = local_attn_size * frame_seqlen, but local_attn_size counts the sink frames too,
# so every query block past the second saw one frame more of history than the rolling KV cache keeps.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class CausalTrainAttentionPlan:
    kind: str
    num_frames: int
    frame_seqlen: int
    num_frame_per_block: int
    local_attn_size: int  # total budget in frames: sink frames plus the trailing window
    sink_size: int
    sm_scale: float


def blockwise_frame_visible(q_frame, kv_frame, *, num_frame_per_block, local_attn_size, sink_size):
    """Pure-PyTorch reference: own block end, sink frames plus a (local_attn_size - sink_size) frame window."""
    block_end = (q_frame // num_frame_per_block + 1) * num_frame_per_block
    if kv_frame >= block_end:
        return False
    if local_attn_size == -1:
        return True
    rolling = max(0, int(local_attn_size) - int(sink_size))
    if kv_frame >= block_end - rolling:
        return True
    return kv_frame < sink_size


def _block_causal_sink_fwd(q, k, v, tokens_per_block, sink_tokens, rolling_window_tokens, sm_scale):
    """Row geometry of the fused forward: sink columns [0, S_TOK) plus window [e_tok - ROLLING_TOK, e_tok)."""
    L = q.shape[-2]
    r = torch.arange(L)[:, None]
    c = torch.arange(L)[None, :]
    e_tok = (r // tokens_per_block + 1) * tokens_per_block
    win_lo = (e_tok - rolling_window_tokens).clamp(min=0)
    visible = (c < e_tok) & ((c < sink_tokens) | (c >= win_lo))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=sm_scale)


def block_causal_sink_forward(q, k, v, plan):
    if FIXED:
        rolling_window_tokens = max(plan.local_attn_size - plan.sink_size, 0) * plan.frame_seqlen
    else:
        rolling_window_tokens = plan.local_attn_size * plan.frame_seqlen
    return _block_causal_sink_fwd(
        q, k, v,
        plan.num_frame_per_block * plan.frame_seqlen,  # tokens_per_block
        plan.sink_size * plan.frame_seqlen,  # sink_tokens
        rolling_window_tokens,
        float(plan.sm_scale),
    )


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)

    def forward(self, x, plan):
        B, L, C = x.shape
        q, k, v = self.qkv(x).view(B, L, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = block_causal_sink_forward(q.contiguous(), k.contiguous(), v.contiguous(), plan)
        return self.o(out.transpose(1, 2).reshape(B, L, C))


class CausalWanBlock(nn.Module):
    def __init__(self, dim=32, num_heads=2):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = CausalWanSelfAttention(dim, num_heads)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, plan):
        x = x + self.self_attn(self.norm1(x), plan)
        return x + self.ffn(self.norm2(x))


num_frames, frame_seqlen, dim = 9, 2, 32
plan = CausalTrainAttentionPlan(kind="blockwise", num_frames=num_frames, frame_seqlen=frame_seqlen,
                                num_frame_per_block=3, local_attn_size=4, sink_size=1,
                                sm_scale=1.0 / (16 ** 0.5))
blocks = nn.ModuleList([CausalWanBlock(dim) for _ in range(2)])
head = nn.Linear(dim, 4)
opt = torch.optim.AdamW(list(blocks.parameters()) + list(head.parameters()), lr=1e-3)

# causal training forward over the full noisy clip: tokens of 9 latent frames, 2 tokens per frame
x0 = torch.randn(2, num_frames * frame_seqlen, dim)
target = torch.randn(2, num_frames * frame_seqlen, 4)
for step in range(3):
    h = x0
    for blk in blocks:
        h = blk(h, plan)
    loss = F.mse_loss(head(h), target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"step {step} loss {loss.item():.4f}")

# compare the fused attention with the frame-level reference the streaming KV cache follows
with torch.no_grad():
    q, k, v = torch.randn(3, 1, 2, num_frames * frame_seqlen, 16).unbind(0)
    frames = torch.arange(num_frames * frame_seqlen) // frame_seqlen
    ref_mask = torch.tensor([[blockwise_frame_visible(int(a), int(b), num_frame_per_block=3, local_attn_size=4,
                                                      sink_size=1) for b in frames] for a in frames])
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=ref_mask, scale=plan.sm_scale)
    out = block_causal_sink_forward(q, k, v, plan)
print("max |fused - reference|:", (out - ref).abs().max().item())
