"""MVDream multi-view diffusion: the self-attention of every view attends the patches of all views of the object.

Follows bytedance/MVDream mvdream/ldm/modules/attention.py (MemoryEfficientCrossAttention; BasicTransformerBlock3D
.forward: x = rearrange(x, "(b f) l c -> b (f l) c", f=num_frames) before attn1, back to "(b f) l c" after,
while cross-attention to the text context stays per view) and mvdream/ldm/interface / camera_utils (4 views
with camera embeddings added to the timestep embedding). Recalled, not read line by line.

Mask meant: none. Multi-view consistency comes from letting all num_frames views of one object share one
self-attention (an "inflated" 2D attention into 3D): each view's patches attend every view, including itself.
Different objects in the batch stay apart (the reshape keeps b separate). Cross-attention reads the full CLIP
context of the prompt, unpadded (CLIP's text encoder output is used at full length 77 in SD; here length 6).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def rearrange_to_views(x, num_frames):   # "(b f) l c -> b (f l) c"
    bf, l, c = x.shape
    return x.reshape(bf // num_frames, num_frames * l, c)


def rearrange_from_views(x, num_frames):  # "b (f l) c -> (b f) l c"
    b, fl, c = x.shape
    return x.reshape(b * num_frames, fl // num_frames, c)


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=4, dim_head=8):
        super().__init__()
        inner = heads * dim_head
        context_dim = context_dim or query_dim
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(context_dim, inner, bias=False)
        self.to_v = nn.Linear(context_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def forward(self, x, context=None):
        context = x if context is None else context
        b = x.shape[0]
        q, k, v = (t.view(b, t.shape[1], self.heads, -1).transpose(1, 2)
                   for t in (self.to_q(x), self.to_k(context), self.to_v(context)))
        out = F.scaled_dot_product_attention(q, k, v)
        return self.to_out(out.transpose(1, 2).reshape(b, x.shape[1], -1))


class BasicTransformerBlock3D(nn.Module):
    def __init__(self, dim=32, context_dim=24):
        super().__init__()
        self.attn1 = CrossAttention(dim)
        self.attn2 = CrossAttention(dim, context_dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x, context=None, num_frames=1):
        x = rearrange_to_views(x, num_frames)
        x = self.attn1(self.norm1(x)) + x
        x = rearrange_from_views(x, num_frames)
        return self.attn2(self.norm2(x), context=context) + x


num_frames, objects, hw = 4, 2, 9
x = torch.randn(objects * num_frames, hw, 32)                        # UNet features, views folded into batch
context = torch.randn(objects, 6, 24).repeat_interleave(num_frames, 0)  # same prompt for the views of an object
block = BasicTransformerBlock3D().eval()
with torch.no_grad():
    out = block(x, context=context, num_frames=num_frames)
    # reference: explicit mask over the flat (objects * views * patches) sequence: same object only
    flat = x.reshape(1, -1, 32)
    obj = torch.arange(flat.shape[1]) // (num_frames * hw)
    allowed = obj[:, None] == obj[None, :]
    a = block.attn1
    h = block.norm1(flat)
    q, k, v = (t.view(1, -1, 4, 8).transpose(1, 2) for t in (a.to_q(h), a.to_k(h), a.to_v(h)))
    s = (q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~allowed, float("-inf"))
    y = a.to_out((s.softmax(-1) @ v).transpose(1, 2).reshape(1, -1, 32)) + flat
    y = y.reshape(objects * num_frames, hw, 32)
    ref = block.attn2(block.norm2(y), context=context) + y
    assert torch.allclose(out, ref, atol=1e-5)
print(f"{objects} objects x {num_frames} views x {hw} patches: views attend jointly ok")
