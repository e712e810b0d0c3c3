# Correct, a shape the rule must stay quiet on (nikhilbarhate99/min-decision-transformer's way): trajectories shorter
# than the context are padded with zeros on the RIGHT, `traj_mask` (1 = a real step) is used only to mask the loss,
# and the (return, state, action) tokens are interleaved under a causal mask (an eager softmax over masked scores):
# no token of a real step can see a later, padded one, so the mask is not needed in the attention.
import math

import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(2)


class MaskedCausalAttention(nn.Module):
    def __init__(self, h_dim, max_T, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.q_net, self.k_net, self.v_net = nn.Linear(h_dim, h_dim), nn.Linear(h_dim, h_dim), nn.Linear(h_dim, h_dim)
        self.proj_net = nn.Linear(h_dim, h_dim)
        self.register_buffer("mask", torch.tril(torch.ones((max_T, max_T))).view(1, 1, max_T, max_T))

    def forward(self, x):
        B, T, C = x.shape
        N, D = self.n_heads, C // self.n_heads
        q = self.q_net(x).view(B, T, N, D).transpose(1, 2)
        k = self.k_net(x).view(B, T, N, D).transpose(1, 2)
        v = self.v_net(x).view(B, T, N, D).transpose(1, 2)
        weights = q @ k.transpose(2, 3) / math.sqrt(D)
        weights = weights.masked_fill(self.mask[..., :T, :T] == 0, float("-inf"))
        attention = F.softmax(weights, dim=-1)
        return self.proj_net((attention @ v).transpose(1, 2).contiguous().view(B, T, N * D))


class Block(nn.Module):
    def __init__(self, h_dim, max_T, n_heads):
        super().__init__()
        self.attention = MaskedCausalAttention(h_dim, max_T, n_heads)
        self.mlp = nn.Sequential(nn.Linear(h_dim, 4 * h_dim), nn.GELU(), nn.Linear(4 * h_dim, h_dim))
        self.ln1, self.ln2 = nn.LayerNorm(h_dim), nn.LayerNorm(h_dim)

    def forward(self, x):
        x = self.ln1(x + self.attention(x))
        return self.ln2(x + self.mlp(x))


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, act_dim, n_blocks, h_dim, context_len, n_heads, max_timestep=100):
        super().__init__()
        self.h_dim = h_dim
        self.transformer = nn.Sequential(*[Block(h_dim, 3 * context_len, n_heads) for _ in range(n_blocks)])
        self.embed_ln = nn.LayerNorm(h_dim)
        self.embed_timestep = nn.Embedding(max_timestep, h_dim)
        self.embed_rtg = nn.Linear(1, h_dim)
        self.embed_state = nn.Linear(state_dim, h_dim)
        self.embed_action = nn.Linear(act_dim, h_dim)
        self.predict_action = nn.Sequential(nn.Linear(h_dim, act_dim), nn.Tanh())

    def forward(self, timesteps, states, actions, returns_to_go):
        B, T, _ = states.shape
        time = self.embed_timestep(timesteps)
        h = torch.stack((self.embed_rtg(returns_to_go) + time, self.embed_state(states) + time,
                         self.embed_action(actions) + time), dim=1).permute(0, 2, 1, 3).reshape(B, 3 * T, self.h_dim)
        h = self.transformer(self.embed_ln(h)).reshape(B, T, 3, self.h_dim).permute(0, 2, 1, 3)
        return self.predict_action(h[:, 1])


state_dim, act_dim, context_len = 3, 2, 5
model = DecisionTransformer(state_dim, act_dim, n_blocks=2, h_dim=16, context_len=context_len, n_heads=2)
timesteps, states, actions, rtg, traj_mask = [], [], [], [], []
for n in (5, 2, 4):  # right padding: the real steps first, zeros after them
    pad = context_len - n
    states.append(torch.cat([torch.randn(n, state_dim), torch.zeros(pad, state_dim)]))
    actions.append(torch.cat([torch.rand(n, act_dim) * 2 - 1, torch.zeros(pad, act_dim)]))
    rtg.append(torch.cat([torch.randn(n, 1), torch.zeros(pad, 1)]))
    timesteps.append(torch.cat([torch.arange(n), torch.zeros(pad, dtype=torch.long)]))
    traj_mask.append(torch.cat([torch.ones(n, dtype=torch.long), torch.zeros(pad, dtype=torch.long)]))
timesteps, states, actions = torch.stack(timesteps), torch.stack(states), torch.stack(actions)
rtg, traj_mask = torch.stack(rtg), torch.stack(traj_mask)

action_preds = model(timesteps, states, actions, rtg)
real = traj_mask.view(-1) > 0
loss = F.mse_loss(action_preds.reshape(-1, act_dim)[real], actions.reshape(-1, act_dim)[real])
loss.backward()
print("loss = %.4f" % loss.item())
