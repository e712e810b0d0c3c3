# OpenDiT / VideoSys (NUS-HPC-AI-Lab/VideoSys#116, fixing issue #115): MultiHeadCrossAttention.torch_impl builds
# the text-padding mask as a bool tensor and fills [:, :, :m] (the *valid* prompt tokens) with -1e9, which becomes
# True == +1.0 on real tokens and 0 on padding, so padded T5 tokens are never masked out of cross-attention.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadCrossAttention(nn.Module):
    def __init__(self, d_model, num_heads, attn_drop=0.0, proj_drop=0.0, enable_flashattn=False):
        super(MultiHeadCrossAttention, self).__init__()
        assert d_model % num_heads == 0, "d_model must be divisible by num_heads"
        self.d_model = d_model
        self.num_heads = num_heads
        self.head_dim = d_model // num_heads
        self.enable_flashattn = enable_flashattn
        self.q_linear = nn.Linear(d_model, d_model)
        self.kv_linear = nn.Linear(d_model, d_model * 2)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(d_model, d_model)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x, cond, mask=None):
        # query/value: img tokens; key: condition; mask: if padding tokens
        B, N, C = x.shape
        q = self.q_linear(x).view(1, -1, self.num_heads, self.head_dim)
        kv = self.kv_linear(cond).view(1, -1, 2, self.num_heads, self.head_dim)
        k, v = kv.unbind(2)
        x = self.torch_impl(q, k, v, mask, B, N, C)  # enable_flashattn=False (CPU)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x

    def torch_impl(self, q, k, v, mask, B, N, C):
        q = q.view(B, -1, self.num_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, -1, self.num_heads, self.head_dim).transpose(1, 2)
        v = v.view(B, -1, self.num_heads, self.head_dim).transpose(1, 2)

        if FIXED:
            attn_mask = torch.zeros(B, N, k.shape[2], dtype=torch.float32, device=q.device)
            for i, m in enumerate(mask):
                attn_mask[i, :, m:] = -1e8
        else:
            attn_mask = torch.zeros(B, N, k.shape[2], dtype=torch.bool, device=q.device)
            for i, m in enumerate(mask):
                attn_mask[i, :, :m] = -1e9

        scale = 1 / q.shape[-1] ** 0.5
        q = q * scale
        attn = q @ k.transpose(-2, -1)
        if FIXED:
            attn = attn.to(torch.float32)
        if mask is not None:
            attn = attn + attn_mask.unsqueeze(1)
        if not FIXED:
            attn = attn.to(torch.float32)
        attn = attn.softmax(-1)
        attn = attn.to(v.dtype)
        out = attn @ v
        x = out.transpose(1, 2).contiguous().view(B, N, C)
        return x


# tiny STDiT-like setting: B=2 videos, N=16 spatial-temporal tokens, T5 prompts padded to 12 tokens
B, N, L, C, H = 2, 16, 12, 32, 4
y_lens = [5, 9]
attn = MultiHeadCrossAttention(C, H).eval()
x = torch.randn(B, N, C)
cond = torch.randn(B, L, C)
for i, m in enumerate(y_lens):
    cond[i, m:] = torch.randn(L - m, C) * 3.0  # padded T5 positions carry non-zero embeddings

with torch.no_grad():
    out = attn(x, cond, mask=y_lens)
    # reference: each sample alone, with only its real prompt tokens as keys
    ref = torch.cat([attn(x[i:i + 1], cond[i:i + 1, :m], mask=[m]) for i, m in enumerate(y_lens)])

print(f"max |padded-batch - per-sample unpadded| = {(out - ref).abs().max().item():.6f}")
