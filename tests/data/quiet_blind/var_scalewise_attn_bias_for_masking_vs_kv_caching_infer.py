"""VAR (visual autoregressive, next-scale prediction): the block-wise causal training bias over scales equals
scale-by-scale inference with kv caching and no bias at all.

Follows FoundationVision/VAR, models/var.py:
  VAR.__init__:
      d = torch.cat([torch.full((pn*pn,), i) for i, pn in enumerate(self.patch_nums)]).view(1, self.L, 1)
      dT = d.transpose(1, 2)
      lvl_1L = dT[:, 0].contiguous()
      attn_bias_for_masking = torch.where(d >= dT, 0., -torch.inf).reshape(1, 1, self.L, self.L)
  VAR.forward (teacher forcing): x_BLC = block(x=x_BLC, cond_BD=..., attn_bias=attn_bias)
  VAR.autoregressive_infer_cfg: for b in self.blocks: b.attn.kv_caching(True); each stage runs the
      pn*pn tokens of one scale with attn_bias=None; models/basic_var.py SelfAttention concatenates
      cached_k / cached_v along the token axis when caching is on.
A token sees every token of its own scale and of all coarser scales; that is the whole of the mask.
Reduced: patch_nums (1, 2, 3, 4), 2 blocks without AdaLN conditioning, float64. Inputs are the teacher-forced
word embeddings of each scale (sos for scale 0, upsampled previous-scale features after it).
Check: logits of every scale from the biased full forward equal those from the cached stage loop.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

patch_nums = (1, 2, 3, 4)
L = sum(pn * pn for pn in patch_nums)
C, HEADS, DEPTH, V = 32, 4, 2, 24


class SelfAttention(nn.Module):  # models/basic_var.py, reduced
    def __init__(self):
        super().__init__()
        self.mat_qkv = nn.Linear(C, 3 * C)
        self.proj = nn.Linear(C, C)
        self.caching, self.cached_k, self.cached_v = False, None, None

    def kv_caching(self, enable):
        self.caching, self.cached_k, self.cached_v = enable, None, None

    def forward(self, x, attn_bias):
        B, Lx, _ = x.shape
        q, k, v = self.mat_qkv(x).view(B, Lx, 3, HEADS, C // HEADS).permute(2, 0, 3, 1, 4).unbind(0)
        if self.caching:
            if self.cached_k is None:
                self.cached_k, self.cached_v = k, v
            else:
                k = self.cached_k = torch.cat((self.cached_k, k), dim=2)
                v = self.cached_v = torch.cat((self.cached_v, v), dim=2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_bias)
        return self.proj(out.transpose(1, 2).reshape(B, Lx, C))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = SelfAttention()
        self.ln1, self.ln2 = nn.LayerNorm(C), nn.LayerNorm(C)
        self.ffn = nn.Sequential(nn.Linear(C, 4 * C), nn.GELU(approximate="tanh"), nn.Linear(4 * C, C))

    def forward(self, x, attn_bias):
        x = x + self.attn(self.ln1(x), attn_bias)
        return x + self.ffn(self.ln2(x))


d = torch.cat([torch.full((pn * pn,), i) for i, pn in enumerate(patch_nums)]).view(1, L, 1)
dT = d.transpose(1, 2)
lvl_1L = dT[:, 0].contiguous()
attn_bias_for_masking = torch.where(d >= dT, 0.0, -torch.inf).reshape(1, 1, L, L)

blocks = nn.ModuleList(Block() for _ in range(DEPTH)).eval()
lvl_embed = nn.Embedding(len(patch_nums), C)
pos_1LC = torch.randn(1, L, C) * 0.02
head = nn.Sequential(nn.LayerNorm(C), nn.Linear(C, V))

B = 2
x_BLC_wo_prefix = torch.randn(B, L, C)  # teacher-forced inputs: sos (scale 0) + next-scale inputs
with torch.no_grad():
    x = x_BLC_wo_prefix + lvl_embed(lvl_1L.expand(B, -1)) + pos_1LC
    attn_bias = attn_bias_for_masking[:, :, :L, :L]
    for b in blocks:
        x = b(x, attn_bias)
    logits_train = head(x)

    for b in blocks:
        b.attn.kv_caching(True)
    cur_L, stage_logits = 0, []
    for si, pn in enumerate(patch_nums):
        sl = slice(cur_L, cur_L + pn * pn)
        cur_L += pn * pn
        x = x_BLC_wo_prefix[:, sl] + lvl_embed.weight[si] + pos_1LC[:, sl]
        for b in blocks:
            x = b(x, attn_bias=None)
        stage_logits.append(head(x))
    for b in blocks:
        b.attn.kv_caching(False)
    logits_infer = torch.cat(stage_logits, dim=1)

diff = (logits_train - logits_infer).abs().max().item()
print(f"max |block-causal bias forward - kv-cached stage loop| logits: {diff:.3e}")
assert cur_L == L and diff < 1e-10
