# Citation: kuleshov-group/bd3lms models/dit.py @1c3e8f4 (block_diff_mask, DIT.gen_mask, DDiTBlock.cross_attn,
#   DIT.forward sample_mode indexing).
# Masking: training input is [x_t ; x_0] (2n tokens). block_diff_mask (bool keep, SDPA attn_mask) = block-diagonal
#   within each noisy block, offset block-causal so noisy block b sees clean blocks < b, and block-causal among clean
#   blocks. x_t and x_0 get the same rotary positions. At sampling (no KV cache) the mask is indexed
#   [n:n+L, n:n+L]: the current noisy block is bidirectional and sees all earlier denoised blocks.
import math
from functools import partial
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


def block_diff_mask(b, h, q_idx, kv_idx, block_size=None, n=None):
  # Indicate whether token belongs to xt or x0
  x0_flag_q = (q_idx >= n)
  x0_flag_kv = (kv_idx >= n)

  # Compute block indices
  block_q = torch.where(x0_flag_q == 1, (q_idx - n) // block_size, q_idx // block_size)
  block_kv = torch.where(x0_flag_kv == 1, (kv_idx - n) // block_size, kv_idx // block_size)

  # **1. Block Diagonal Mask (M_BD) **
  block_diagonal = (block_q == block_kv) & (x0_flag_q == x0_flag_kv)

  # **2. Offset Block-Causal Mask (M_OBC) **
  offset_block_causal = ((block_q > block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 0))

  # **3. Block-Causal Mask (M_BC) **
  block_causal = (block_q >= block_kv) & (x0_flag_kv == 1) & (x0_flag_q == 1)

  # **4. Combine Masks **
  return block_diagonal | offset_block_causal | block_causal


class Rotary(nn.Module):
  def __init__(self, dim, base=10_000):
    super().__init__()
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    self.register_buffer('inv_freq', inv_freq)

  def forward(self, x, seq_dim=1):
    t = torch.arange(x.shape[seq_dim], device=x.device).type_as(self.inv_freq)
    freqs = torch.einsum("i,j->ij", t, self.inv_freq.clone())
    emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
    cos = emb.cos()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    sin = emb.sin()[None, :, None, None, :].repeat(1, 1, 3, 1, 1)
    # This makes the transformation on v an identity.
    cos[:, :, 2, :, :].fill_(1.)
    sin[:, :, 2, :, :].fill_(0.)
    return cos, sin


def rotate_half(x):
  x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
  return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb_torchscript(qkv, cos, sin):
  return (qkv * cos) + (rotate_half(qkv) * sin)


class DDiTBlock(nn.Module):
  def __init__(self, n, dim, n_heads, block_size, mlp_ratio=4):
    super().__init__()
    self.n = n
    self.n_heads = n_heads
    self.block_size = block_size
    self.norm1 = nn.LayerNorm(dim)
    self.attn_qkv = nn.Linear(dim, 3 * dim, bias=False)
    self.attn_out = nn.Linear(dim, dim, bias=False)
    self.norm2 = nn.LayerNorm(dim)
    self.mlp = nn.Sequential(nn.Linear(dim, mlp_ratio * dim), nn.GELU(approximate='tanh'), nn.Linear(mlp_ratio * dim, dim))

  def get_qkv(self, x, rotary_cos_sin):
    qkv = self.attn_qkv(x)
    b, s, _ = qkv.shape
    qkv = qkv.reshape(b, s, 3, self.n_heads, -1)  # 'b s (three h d) -> b s three h d'
    cos, sin = rotary_cos_sin
    return apply_rotary_pos_emb_torchscript(qkv, cos.to(qkv.dtype), sin.to(qkv.dtype))

  def cross_attn(self, qkv, mask=None):
    scale = qkv.shape[-1]
    qkv = qkv.transpose(1, 3)
    mask = mask.bool() if mask is not None else None
    x = F.scaled_dot_product_attention(query=qkv[:, :, 0], key=qkv[:, :, 1], value=qkv[:, :, 2],
                                       attn_mask=mask, is_causal=False, scale=1 / math.sqrt(scale))
    x = x.transpose(1, 2)
    return x.reshape(x.shape[0], x.shape[1], -1)  # 'b s h d -> b s (h d)'

  def forward(self, x, rotary_cos_sin, mask=None, sample_mode=False):
    x_skip = x
    x = self.norm1(x)
    if mask is not None and not sample_mode:
      qkv_x = self.get_qkv(x[:, :self.n], rotary_cos_sin)
      qkv_x0 = self.get_qkv(x[:, self.n:], rotary_cos_sin)
      qkv = torch.cat((qkv_x, qkv_x0), dim=1)
    else:
      qkv = self.get_qkv(x, rotary_cos_sin)
    x = self.cross_attn(qkv, mask=mask)
    x = x_skip + self.attn_out(x)
    return x + self.mlp(self.norm2(x))


class DIT(nn.Module):
  def __init__(self, vocab_size, n, block_size, dim=64, n_heads=4, n_blocks=2):
    super().__init__()
    self.n = n
    self.block_size = block_size
    self.vocab_embed = nn.Embedding(vocab_size, dim)
    self.rotary_emb = Rotary(dim // n_heads)
    self.blocks = nn.ModuleList([DDiTBlock(n, dim, n_heads, block_size) for _ in range(n_blocks)])
    self.norm_final = nn.LayerNorm(dim)
    self.linear = nn.Linear(dim, vocab_size)
    self.gen_mask(n, block_size)

  def gen_mask(self, seqlen, block_size, attn_backend='sdpa'):
    self.block_diff_mask = block_diff_mask(b=None, h=None, q_idx=torch.arange(seqlen * 2)[:, None],
                                           kv_idx=torch.arange(seqlen * 2)[None, :], block_size=block_size, n=seqlen)

  def forward(self, indices, sample_mode=False):
    x = self.vocab_embed(indices)
    mask = self.block_diff_mask
    if sample_mode:
      # index block-causal mask only during sampling
      mask = mask[self.n:self.n + x.shape[1], self.n:self.n + x.shape[1]]
      rotary_cos_sin = self.rotary_emb(x)
    else:
      rotary_cos_sin = self.rotary_emb(x[:, :self.n])
    for blk in self.blocks:
      x = blk(x, rotary_cos_sin, mask=mask, sample_mode=sample_mode)
    x = self.linear(self.norm_final(x))
    if not sample_mode:
      x = x[:, :self.n]
    return x


VOCAB, MASK_ID, N, BS = 50, 49, 16, 4
model = DIT(VOCAB, N, BS)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

# training step: per-block noise levels, loss on masked x_t positions
x0 = torch.randint(0, MASK_ID, (2, N))
t = torch.rand(2, N // BS).repeat_interleave(BS, dim=1)
move = torch.rand(2, N) < t
xt = torch.where(move, torch.full_like(x0, MASK_ID), x0)
logits = model(torch.cat([xt, x0], dim=1))
loss = (F.cross_entropy(logits.transpose(1, 2), x0, reduction='none') * move).sum() / move.sum().clamp(min=1)
loss.backward()
opt.step()

# semi-autoregressive sampling, block by block (no KV cache path), 2 denoising steps per block
model.eval()
with torch.no_grad():
  x = torch.empty(1, 0, dtype=torch.long)
  for blk in range(N // BS):
    x = torch.cat([x, torch.full((1, BS), MASK_ID)], dim=1)
    for step in range(2):
      logits = model(x, sample_mode=True)[:, -BS:]
      logits[..., MASK_ID] = -float('inf')
      pred = logits.argmax(-1)
      still = x[:, -BS:] == MASK_ID
      unmask = still & (torch.rand(1, BS) < (0.5 if step == 0 else 1.0))
      x[:, -BS:] = torch.where(unmask, pred, x[:, -BS:])
print(f"loss {loss.item():.4f} sample {x.tolist()[0]}")
