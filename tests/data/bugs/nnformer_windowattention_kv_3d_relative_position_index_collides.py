# 282857341/nnFormer PR #88 (commit fbf2244, "fix the bug about position table"): WindowAttention_kv builds the 3D
# relative_position_index with strides (3*Wh-1, 2*Wh-1, 1) instead of ((2*Wh-1)*(2*Ww-1), 2*Ww-1, 1), so distinct
# 3D offsets collide on one bias-table row and the per-window bias added before the shifted-window mask is wrong.
import sys
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class WindowAttention_kv(nn.Module):

    def __init__(self, dim, window_size, num_heads, qkv_bias=True, qk_scale=None, attn_drop=0., proj_drop=0.):
        super().__init__()
        self.dim = dim
        self.window_size = window_size
        self.num_heads = num_heads
        head_dim = dim // num_heads
        self.scale = qk_scale or head_dim ** -0.5

        self.relative_position_bias_table = nn.Parameter(
            torch.zeros((2 * window_size[0] - 1) * (2 * window_size[1] - 1) * (2 * window_size[2] - 1),
                        num_heads))

        coords_s = torch.arange(self.window_size[0])
        coords_h = torch.arange(self.window_size[1])
        coords_w = torch.arange(self.window_size[2])
        coords = torch.stack(torch.meshgrid([coords_s, coords_h, coords_w], indexing="ij"))
        coords_flatten = torch.flatten(coords, 1)
        relative_coords = coords_flatten[:, :, None] - coords_flatten[:, None, :]
        relative_coords = relative_coords.permute(1, 2, 0).contiguous()
        relative_coords[:, :, 0] += self.window_size[0] - 1  # shift to start from 0
        relative_coords[:, :, 1] += self.window_size[1] - 1
        relative_coords[:, :, 2] += self.window_size[2] - 1

        if FIXED:
            relative_coords[:, :, 0] *= (2 * self.window_size[1] - 1) * (2 * self.window_size[2] - 1)
            relative_coords[:, :, 1] *= 2 * self.window_size[2] - 1
        else:
            relative_coords[:, :, 0] *= 3 * self.window_size[1] - 1
            relative_coords[:, :, 1] *= 2 * self.window_size[1] - 1

        relative_position_index = relative_coords.sum(-1)
        self.register_buffer("relative_position_index", relative_position_index)

        self.kv = nn.Linear(dim, dim * 2, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        nn.init.trunc_normal_(self.relative_position_bias_table, std=.02)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, skip, x_up, mask=None):
        B_, N, C = skip.shape
        kv = self.kv(skip)
        q = x_up
        kv = kv.reshape(B_, N, 2, self.num_heads, C // self.num_heads).permute(2, 0, 3, 1, 4).contiguous()
        q = q.reshape(B_, N, self.num_heads, C // self.num_heads).permute(0, 2, 1, 3).contiguous()
        k, v = kv[0], kv[1]
        q = q * self.scale
        attn = (q @ k.transpose(-2, -1))
        relative_position_bias = self.relative_position_bias_table[self.relative_position_index.view(-1)].view(
            self.window_size[0] * self.window_size[1] * self.window_size[2],
            self.window_size[0] * self.window_size[1] * self.window_size[2], -1)
        relative_position_bias = relative_position_bias.permute(2, 0, 1).contiguous()
        attn = attn + relative_position_bias.unsqueeze(0)
        if mask is not None:
            nW = mask.shape[0]
            attn = attn.view(B_ // nW, nW, self.num_heads, N, N) + mask.unsqueeze(1).unsqueeze(0)
            attn = attn.view(-1, self.num_heads, N, N)
            attn = self.softmax(attn)
        else:
            attn = self.softmax(attn)
        attn = self.attn_drop(attn)
        x = (attn @ v).transpose(1, 2).reshape(B_, N, C)
        x = self.proj(x)
        x = self.proj_drop(x)
        return x


ws = (2, 4, 4)   # (S, H, W) window, as in the decoder's 3D windows
dim, heads = 32, 2
attn = WindowAttention_kv(dim, ws, heads).eval()
with torch.no_grad():
    attn.relative_position_bias_table.normal_(0, 1.0)

# offset -> table row actually used; a correct index is one row per distinct 3D offset
coords = torch.stack(torch.meshgrid([torch.arange(s) for s in ws], indexing="ij")).flatten(1).T  # N, 3
N = coords.shape[0]
row_of = {}
offsets_of_row = {}
for i in range(N):
    for j in range(N):
        off = tuple((coords[i] - coords[j]).tolist())
        r = int(attn.relative_position_index[i, j])
        row_of[off] = r
        offsets_of_row.setdefault(r, set()).add(off)
collided = sum(len(s) for s in offsets_of_row.values() if len(s) > 1)

# reference: the bias must depend only on the 3D offset -> canonical row (ds, dh, dw) of the table
def canonical(off):
    ds, dh, dw = off[0] + ws[0] - 1, off[1] + ws[1] - 1, off[2] + ws[2] - 1
    return (ds * (2 * ws[1] - 1) + dh) * (2 * ws[2] - 1) + dw

skip = torch.randn(4, N, dim)
x_up = torch.randn(4, N, dim)
with torch.no_grad():
    out = attn(skip, x_up)
    ref_index = torch.tensor([[canonical(tuple((coords[i] - coords[j]).tolist())) for j in range(N)] for i in range(N)])
    saved = attn.relative_position_index.clone()
    attn.relative_position_index.copy_(ref_index)
    ref = attn(skip, x_up)
    attn.relative_position_index.copy_(saved)
print("3D offsets sharing a bias row with another offset: %d" % collided)
print("max |out - offset-indexed reference| = %.6f" % (out - ref).abs().max().item())
