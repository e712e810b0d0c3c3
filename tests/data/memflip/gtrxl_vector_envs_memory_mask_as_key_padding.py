# Written another way (a GTrXL-style recurrent policy over vectorised environments): each env keeps an episodic memory
# of its last 4 hidden states in a zero-initialised buffer and a `memory_mask` (True = a slot already written). The
# attention is nn.MultiheadAttention (batch_first) from the current step over [memory slots | current step]. The bug:
# the keep mask is handed as `key_padding_mask`, whose True means *ignore*, so every env attends only to its empty
# slots and not to its own step. The fix: key_padding_mask = ~keep.
import sys
from types import SimpleNamespace

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(3)
cfg = SimpleNamespace(obs_dim=5, dim=16, heads=2, memory_length=4, num_envs=3, n_actions=4)


class MemoryBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.norm_q, self.norm_kv = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.ReLU(), nn.Linear(2 * dim, dim))

    def forward(self, x, memory, memory_mask):
        q = self.norm_q(x)  # (E, 1, D)
        kv = self.norm_kv(torch.cat([memory, x], dim=1))  # (E, S + 1, D): the memory window, then the current step
        keep = torch.cat([memory_mask, torch.ones_like(memory_mask[:, :1])], dim=1)
        padding = ~keep if FIXED else keep
        out, _ = self.attn(q, kv, kv, key_padding_mask=padding, need_weights=False)
        x = x + out
        return x + self.ff(x)


class RecurrentPolicy(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.encode = nn.Linear(cfg.obs_dim, cfg.dim)
        self.block = MemoryBlock(cfg.dim, cfg.heads)
        self.logits = nn.Linear(cfg.dim, cfg.n_actions)

    def forward(self, obs, memory, memory_mask):
        x = torch.relu(self.encode(obs)).unsqueeze(1)
        h = self.block(x, memory, memory_mask)
        return self.logits(h[:, 0]), x[:, 0].detach()


policy = RecurrentPolicy(cfg).eval()
memory = torch.zeros(cfg.num_envs, cfg.memory_length, cfg.dim)  # nobody wrote these slots yet
memory_mask = torch.zeros(cfg.num_envs, cfg.memory_length, dtype=torch.bool)
written = torch.tensor([1, 0, 2])  # envs reset at different times: steps already in each env's episode
with torch.no_grad():
    for env, n in enumerate(written.tolist()):
        memory[env, :n] = torch.randn(n, cfg.dim)
        memory_mask[env, :n] = True
    for step in range(2):
        obs = torch.randn(cfg.num_envs, cfg.obs_dim)
        logits, state = policy(obs, memory.clone(), memory_mask.clone())
        slot = written.clamp(max=cfg.memory_length - 1)
        memory[torch.arange(cfg.num_envs), slot] = state  # each env writes its step into its next slot
        memory_mask[torch.arange(cfg.num_envs), slot] = True
        written = written + 1
        print("step", step, "actions", logits.argmax(-1).tolist())
