"""CORL Decision Transformer: the padding mask is built after the trajectory was padded.

Citation: tinkoff-ai/CORL#21, fixed by PR tinkoff-ai/CORL#26 (commit 02fb70f, merge ef80957;
an equal earlier fix is commit ed03823). Read in the upstream git history of algorithms/dt.py.

Bug: `SequenceDataset.__prepare_sample` pads states/actions/returns to `seq_len` (zeros on the
right, `pad_along_axis`) and only then computes
`mask = np.hstack([np.ones(states.shape[0]), np.zeros(self.seq_len - states.shape[0])])`;
`states.shape[0]` is already `seq_len`, so the mask is all ones. The training loop passes
`padding_mask = ~mask.to(torch.bool)` to `DecisionTransformer.forward`, which interleaves it
over (return, state, action) tokens and gives it to `nn.MultiheadAttention(key_padding_mask=...)`
next to the causal `attn_mask`: the padded timesteps at the end of a short trajectory tail are
never masked, so the padded query tokens attend to padded keys and the loss
`(loss * mask.unsqueeze(-1)).mean()` counts them.
Fix: build `mask` before padding.

This program: the D4RL loader is replaced by two synthetic in-memory trajectories (same dict
keys); `start_idx` is chosen near the end of a trajectory so the window is padded (length 3 of
seq_len 5). One training forward pass and loss, no optimizer step.
"""
import random
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import IterableDataset

FIXED = "--fixed" in sys.argv


def pad_along_axis(arr: np.ndarray, pad_to: int, axis: int = 0, fill_value: float = 0.0) -> np.ndarray:
    pad_size = pad_to - arr.shape[axis]
    if pad_size <= 0:
        return arr
    npad = [(0, 0)] * arr.ndim
    npad[axis] = (0, pad_size)
    return np.pad(arr, pad_width=npad, mode="constant", constant_values=fill_value)


def load_synthetic_trajectories(state_dim, action_dim, lens, rng):
    traj = []
    for n in lens:
        rewards = rng.standard_normal(n).astype(np.float32)
        traj.append({
            "observations": rng.standard_normal((n, state_dim)).astype(np.float32),
            "actions": np.tanh(rng.standard_normal((n, action_dim))).astype(np.float32),
            "rewards": rewards,
            "returns": np.cumsum(rewards[::-1])[::-1].copy(),
        })
    obs = np.concatenate([t["observations"] for t in traj])
    info = {"obs_mean": obs.mean(0, keepdims=True), "obs_std": obs.std(0, keepdims=True) + 1e-6,
            "traj_lens": np.array(lens)}
    return traj, info


class SequenceDataset(IterableDataset):
    def __init__(self, dataset, info, seq_len: int = 10, reward_scale: float = 1.0):
        self.dataset = dataset
        self.reward_scale = reward_scale
        self.seq_len = seq_len
        self.state_mean = info["obs_mean"]
        self.state_std = info["obs_std"]
        self.sample_prob = info["traj_lens"] / info["traj_lens"].sum()

    def prepare_sample(self, traj_idx, start_idx):
        traj = self.dataset[traj_idx]
        states = traj["observations"][start_idx : start_idx + self.seq_len]
        actions = traj["actions"][start_idx : start_idx + self.seq_len]
        returns = traj["returns"][start_idx : start_idx + self.seq_len]
        time_steps = np.arange(start_idx, start_idx + self.seq_len)

        states = (states - self.state_mean) / self.state_std
        returns = returns * self.reward_scale
        if FIXED:
            # pad up to seq_len if needed
            mask = np.hstack([np.ones(states.shape[0]), np.zeros(self.seq_len - states.shape[0])])
        if states.shape[0] < self.seq_len:
            states = pad_along_axis(states, pad_to=self.seq_len)
            actions = pad_along_axis(actions, pad_to=self.seq_len)
            returns = pad_along_axis(returns, pad_to=self.seq_len)
        if not FIXED:
            mask = np.hstack([np.ones(states.shape[0]), np.zeros(self.seq_len - states.shape[0])])
        return states, actions, returns, time_steps, mask

    def __iter__(self):
        while True:
            traj_idx = np.random.choice(len(self.dataset), p=self.sample_prob)
            start_idx = random.randint(0, self.dataset[traj_idx]["rewards"].shape[0] - 1)
            yield self.prepare_sample(traj_idx, start_idx)


class TransformerBlock(nn.Module):
    def __init__(self, seq_len, embedding_dim, num_heads, attention_dropout, residual_dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(embedding_dim)
        self.norm2 = nn.LayerNorm(embedding_dim)
        self.drop = nn.Dropout(residual_dropout)
        self.attention = nn.MultiheadAttention(embedding_dim, num_heads, attention_dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(embedding_dim, 4 * embedding_dim), nn.GELU(),
            nn.Linear(4 * embedding_dim, embedding_dim), nn.Dropout(residual_dropout),
        )
        # True value indicates that the corresponding position is not allowed to attend
        self.register_buffer("causal_mask", ~torch.tril(torch.ones(seq_len, seq_len)).to(bool))
        self.seq_len = seq_len

    def forward(self, x: torch.Tensor, padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        causal_mask = self.causal_mask[: x.shape[1], : x.shape[1]]
        norm_x = self.norm1(x)
        attention_out = self.attention(
            query=norm_x, key=norm_x, value=norm_x,
            attn_mask=causal_mask, key_padding_mask=padding_mask, need_weights=False,
        )[0]
        x = x + self.drop(attention_out)
        x = x + self.mlp(self.norm2(x))
        return x


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, action_dim, seq_len=10, episode_len=1000, embedding_dim=128,
                 num_layers=4, num_heads=8, attention_dropout=0.0, residual_dropout=0.0,
                 embedding_dropout=0.0, max_action=1.0):
        super().__init__()
        self.emb_drop = nn.Dropout(embedding_dropout)
        self.emb_norm = nn.LayerNorm(embedding_dim)
        self.out_norm = nn.LayerNorm(embedding_dim)
        # additional seq_len embeddings for padding timesteps
        self.timestep_emb = nn.Embedding(episode_len + seq_len, embedding_dim)
        self.state_emb = nn.Linear(state_dim, embedding_dim)
        self.action_emb = nn.Linear(action_dim, embedding_dim)
        self.return_emb = nn.Linear(1, embedding_dim)
        self.blocks = nn.ModuleList([
            TransformerBlock(3 * seq_len, embedding_dim, num_heads, attention_dropout, residual_dropout)
            for _ in range(num_layers)
        ])
        self.action_head = nn.Sequential(nn.Linear(embedding_dim, action_dim), nn.Tanh())
        self.seq_len = seq_len
        self.embedding_dim = embedding_dim
        self.max_action = max_action

    def forward(self, states, actions, returns_to_go, time_steps, padding_mask=None):
        batch_size, seq_len = states.shape[0], states.shape[1]
        time_emb = self.timestep_emb(time_steps)
        state_emb = self.state_emb(states) + time_emb
        act_emb = self.action_emb(actions) + time_emb
        returns_emb = self.return_emb(returns_to_go.unsqueeze(-1)) + time_emb
        # [batch_size, seq_len * 3, emb_dim], (r_0, s_0, a_0, r_1, s_1, a_1, ...)
        sequence = (
            torch.stack([returns_emb, state_emb, act_emb], dim=1)
            .permute(0, 2, 1, 3)
            .reshape(batch_size, 3 * seq_len, self.embedding_dim)
        )
        if padding_mask is not None:
            # [batch_size, seq_len * 3], stack mask identically to fit the sequence
            padding_mask = (
                torch.stack([padding_mask, padding_mask, padding_mask], dim=1)
                .permute(0, 2, 1)
                .reshape(batch_size, 3 * seq_len)
            )
        out = self.emb_norm(sequence)
        out = self.emb_drop(out)
        for block in self.blocks:
            out = block(out, padding_mask=padding_mask)
        out = self.out_norm(out)
        # predict actions only from state embeddings
        return self.action_head(out[:, 1::3]) * self.max_action


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    rng = np.random.default_rng(0)
    state_dim, action_dim, seq_len, episode_len = 4, 2, 5, 20
    trajectories, info = load_synthetic_trajectories(state_dim, action_dim, [12, 9], rng)
    dataset = SequenceDataset(trajectories, info, seq_len=seq_len, reward_scale=0.001)
    # one window in the middle of trajectory 0, one at the tail of trajectory 1 (3 real steps)
    batch = [dataset.prepare_sample(0, 2), dataset.prepare_sample(1, 6)]
    batch = [torch.as_tensor(np.stack(x)) for x in zip(*batch)]
    states, actions, returns, time_steps, mask = batch
    states, actions, returns = states.float(), actions.float(), returns.float()

    model = DecisionTransformer(state_dim, action_dim, seq_len=seq_len, episode_len=episode_len,
                                embedding_dim=32, num_layers=2, num_heads=4)
    model.eval()  # no dropout: deterministic and the fast path is off either way with attn_mask
    padding_mask = ~mask.to(torch.bool)
    predicted_actions = model(states=states, actions=actions, returns_to_go=returns,
                              time_steps=time_steps, padding_mask=padding_mask)
    loss = F.mse_loss(predicted_actions, actions.detach(), reduction="none")
    # [batch_size, seq_len, action_dim] * [batch_size, seq_len, 1]
    loss = (loss * mask.unsqueeze(-1)).mean()
    print("masked steps:", int((~mask.bool()).sum()), "loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
