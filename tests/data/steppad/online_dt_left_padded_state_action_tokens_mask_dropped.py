# Written another way (an Online-DT style data loader, facebookresearch/online-dt's `get_batch`): trajectories shorter
# than the context are padded with zeros on the left and an `attention_mask` (1 = a real step) is kept beside them;
# the policy embeds each step as two tokens, (state, action), interleaved, and runs SDPA with is_causal=True. The bug:
# the training step never hands the mask on, so the first real tokens of a short trajectory attend the zero padding.
# The fix: the mask, repeated for both tokens of a step, joins the causal mask handed to SDPA.
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(1)
rng = np.random.default_rng(1)


@dataclass
class PolicyConfig:
    state_dim: int = 4
    act_dim: int = 2
    hidden: int = 16
    heads: int = 2
    layers: int = 2
    max_len: int = 5
    max_ep_len: int = 100


class SelfAttention(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.heads = cfg.heads
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.out = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x, keep=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        if keep is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return self.out(y.transpose(1, 2).reshape(b, n, d))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.hidden), nn.LayerNorm(cfg.hidden)
        self.attn = SelfAttention(cfg)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden, 2 * cfg.hidden), nn.GELU(), nn.Linear(2 * cfg.hidden, cfg.hidden))

    def forward(self, x, keep=None):
        x = x + self.attn(self.ln1(x), keep)
        return x + self.mlp(self.ln2(x))


class StateActionTransformer(nn.Module):
    def __init__(self, cfg: PolicyConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_state = nn.Linear(cfg.state_dim, cfg.hidden)
        self.embed_action = nn.Linear(cfg.act_dim, cfg.hidden)
        self.embed_time = nn.Embedding(cfg.max_ep_len, cfg.hidden)
        self.blocks = nn.ModuleList([Layer(cfg) for _ in range(cfg.layers)])
        self.predict_action = nn.Linear(cfg.hidden, cfg.act_dim)

    def forward(self, states, actions, timesteps, attention_mask=None):
        b, t, _ = states.shape
        time = self.embed_time(timesteps)
        tokens = torch.stack([self.embed_state(states) + time, self.embed_action(actions) + time], dim=2)
        tokens = tokens.reshape(b, 2 * t, -1)  # s_0, a_0, s_1, a_1, ...
        keep = None
        if attention_mask is not None:
            real = attention_mask.bool().repeat_interleave(2, dim=1)  # (B, 2T): both tokens of a step
            causal = torch.ones(2 * t, 2 * t, dtype=torch.bool).tril()
            own = torch.eye(2 * t, dtype=torch.bool)  # (a padded token sees itself: no empty row)
            keep = (causal & (real[:, None, :] | own))[:, None]
        for block in self.blocks:
            tokens = block(tokens, keep)
        return torch.tanh(self.predict_action(tokens[:, 0::2]))  # each action from its state token


def get_batch(trajectories, cfg):
    """Online-DT's loader: the last max_len steps of each trajectory, zeros on the left, a mask of its real steps."""
    s, a, ts, mask = [], [], [], []
    for traj in trajectories:
        tlen = min(len(traj["observations"]), cfg.max_len)
        pad = cfg.max_len - tlen
        s.append(np.concatenate([np.zeros((pad, cfg.state_dim)), traj["observations"][-tlen:]]))
        a.append(np.concatenate([np.zeros((pad, cfg.act_dim)), traj["actions"][-tlen:]]))
        ts.append(np.concatenate([np.zeros(pad), np.arange(tlen)]))
        mask.append(np.concatenate([np.zeros(pad), np.ones(tlen)]))
    as_float = lambda x: torch.tensor(np.stack(x), dtype=torch.float32)  # noqa: E731
    return as_float(s), as_float(a), torch.tensor(np.stack(ts), dtype=torch.long), torch.tensor(np.stack(mask))


def train_step(model, optimizer, states, actions, timesteps, attention_mask):
    if FIXED:
        predicted = model(states, actions, timesteps, attention_mask=attention_mask)
    else:
        predicted = model(states, actions, timesteps)
    real = attention_mask.bool()
    loss = ((predicted - actions) ** 2).sum(-1)[real].mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


cfg = PolicyConfig()
model = StateActionTransformer(cfg)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
trajectories = [{"observations": rng.normal(size=(n, cfg.state_dim)), "actions": rng.uniform(-1, 1, size=(n, cfg.act_dim))}
                for n in (7, 3, 2, 5)]
states, actions, timesteps, attention_mask = get_batch(trajectories, cfg)
print("loss = %.4f" % train_step(model, optimizer, states, actions, timesteps, attention_mask))
