"""d3rlpy's Decision Transformer: left-padded trajectory slices for training, a stateful wrapper for acting.

Ported from takuseno/d3rlpy @38c34b6f99fde82875e2ad81d1ba1f7a7da34137:
  d3rlpy/models/torch/transformers.py (create_attention_mask, CausalSelfAttention, MLP, Block,
      SimplePositionEncoding, GPT2, _init_weights, ContinuousDecisionTransformer)
  d3rlpy/models/torch/encoders.py (VectorEncoder), d3rlpy/models/builders.py
      (create_continuous_decision_transformer: embedding table of max_timestep + 1 rows)
  d3rlpy/dataset/utils.py (batch_pad_array), d3rlpy/dataset/trajectory_slicers.py (BasicTrajectorySlicer),
      d3rlpy/dataset/mini_batch.py (TrajectoryMiniBatch.from_partial_trajectories),
      d3rlpy/torch_utility.py (TorchTrajectoryMiniBatch.from_batch)
  d3rlpy/algos/transformer/inputs.py (TransformerInput, TorchTransformerInput.from_numpy)
  d3rlpy/algos/transformer/torch/decision_transformer_impl.py (DecisionTransformerImpl.compute_loss,
      inner_predict: the model is handed `1 - masks`)
  d3rlpy/algos/transformer/base.py (StatefulTransformerWrapper.predict)

The slicer cuts a window of `context_size` steps ending at `end_index`; a window near the start of an episode is
zero-padded at the front, `masks` is 1 on real steps, and timesteps start at 1 so 0 marks a pad. The model
interleaves (return-to-go, state, action) per step, repeats the step mask three times, masks future tokens with
the registered tril buffer and adds `(1 - masks) * -10000` over the keys; actions are read at the state tokens.
In eval mode the last (placeholder) action token is dropped. Dropout is set to 0 so the checks are exact.

Checked: each window's predicted actions on its real steps, the batch loss and its gradients equal a run of the
same model on the window's real steps alone (no padding); while acting, each action equals a run on the
unpadded recent history.
"""
import dataclasses
import math
from collections import deque
from typing import Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


# --------------------------------------------------------------------------- dataset

def batch_pad_array(array: np.ndarray, pad_size: int) -> np.ndarray:
    batch_size = array.shape[0]
    shape = array.shape[1:]
    padded_array = np.zeros((pad_size + batch_size, *shape), dtype=array.dtype)
    padded_array[-batch_size:] = array
    return padded_array


@dataclasses.dataclass(frozen=True)
class Episode:
    observations: np.ndarray  # (L, obs)
    actions: np.ndarray  # (L, act)
    rewards: np.ndarray  # (L, 1)
    terminated: bool

    def size(self) -> int:
        return int(self.actions.shape[0])


@dataclasses.dataclass(frozen=True)
class PartialTrajectory:
    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    returns_to_go: np.ndarray
    terminals: np.ndarray
    timesteps: np.ndarray
    masks: np.ndarray
    length: int


class BasicTrajectorySlicer:
    def __call__(self, episode: Episode, end_index: int, size: int) -> PartialTrajectory:
        end = end_index + 1
        start = max(end - size, 0)
        actual_size = end - start

        # prepare terminal flags
        terminals = np.zeros((actual_size, 1), dtype=np.float32)
        if episode.terminated and end_index == episode.size() - 1:
            terminals[-1][0] = 1.0

        # slice data
        observations = episode.observations[start:end]
        actions = episode.actions[start:end]
        rewards = episode.rewards[start:end]
        ret = np.sum(episode.rewards[start:])
        # cumsum includes the current timestep
        all_returns_to_go = ret - np.cumsum(episode.rewards[start:], axis=0) + episode.rewards[start:]
        returns_to_go = all_returns_to_go[:actual_size].reshape((-1, 1))

        # prepare metadata
        timesteps = np.arange(start, end) + 1
        masks = np.ones(end - start, dtype=np.float32)

        # compute backward padding size
        pad_size = size - actual_size

        if pad_size == 0:
            return PartialTrajectory(observations, actions, rewards, returns_to_go, terminals,
                                     timesteps, masks, length=size)

        return PartialTrajectory(
            observations=batch_pad_array(observations, pad_size),
            actions=batch_pad_array(actions, pad_size),
            rewards=batch_pad_array(rewards, pad_size),
            returns_to_go=batch_pad_array(returns_to_go, pad_size),
            terminals=batch_pad_array(terminals, pad_size),
            timesteps=batch_pad_array(timesteps, pad_size),
            masks=batch_pad_array(masks, pad_size),
            length=size,
        )


@dataclasses.dataclass(frozen=True)
class TorchTrajectoryMiniBatch:
    observations: torch.Tensor  # (B, L, obs)
    actions: torch.Tensor  # (B, L, act)
    rewards: torch.Tensor  # (B, L, 1)
    returns_to_go: torch.Tensor  # (B, L, 1)
    terminals: torch.Tensor  # (B, L, 1)
    timesteps: torch.Tensor  # (B, L)
    masks: torch.Tensor  # (B, L)

    @classmethod
    def from_partial_trajectories(cls, trajectories: Sequence[PartialTrajectory]) -> "TorchTrajectoryMiniBatch":
        def stack(name: str) -> torch.Tensor:
            array = np.stack([getattr(traj, name) for traj in trajectories], axis=0)
            return torch.tensor(array.astype(np.float32))

        return cls(
            observations=stack("observations"),
            actions=stack("actions"),
            rewards=stack("rewards"),
            returns_to_go=stack("returns_to_go"),
            terminals=stack("terminals"),
            timesteps=stack("timesteps").long(),
            masks=stack("masks"),
        )


# --------------------------------------------------------------------------- model

def create_attention_mask(context_size: int) -> torch.Tensor:
    mask = torch.ones(context_size, context_size, dtype=torch.float32)
    return torch.tril(mask).view(1, 1, context_size, context_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_size: int, num_heads: int, context_size: int, attn_dropout: float,
                 resid_dropout: float):
        super().__init__()
        self._num_heads = num_heads
        self._context_size = context_size
        self._k = nn.Linear(embed_size, embed_size)
        self._q = nn.Linear(embed_size, embed_size)
        self._v = nn.Linear(embed_size, embed_size)
        self._proj = nn.Linear(embed_size, embed_size)
        self._attn_dropout = nn.Dropout(attn_dropout)
        self._proj_dropout = nn.Dropout(resid_dropout)
        mask = create_attention_mask(context_size)
        self.register_buffer("_mask", mask)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        assert x.dim() == 3, f"Expects (B, T, N), but got {x.shape}"
        assert attention_mask.dim() == 2, f"Expects (B, T), but got {attention_mask.shape}"
        batch_size, context_size, _ = x.shape
        assert context_size <= self._context_size, "Exceeds context_size"

        # (B, T, N) -> (B, T, H, N / H) -> (B, H, T, N / H)
        shape = (batch_size, context_size, self._num_heads, -1)
        k = self._k(x).view(shape).transpose(1, 2)
        q = self._q(x).view(shape).transpose(1, 2)
        v = self._v(x).view(shape).transpose(1, 2)

        # (B, H, T, N / H) -> (B, H, T, T)
        qkT = torch.matmul(q, k.transpose(2, 3))
        attention = qkT / math.sqrt(k.shape[-1])
        attention = attention.masked_fill(self._mask[..., :context_size, :context_size] == 0, -10000)
        attention = attention + attention_mask.view(batch_size, 1, 1, context_size) * -10000
        attention = F.softmax(attention, dim=-1)
        attention = self._attn_dropout(attention)

        # (B, H, T, T) x (B, H, T, N / H) -> (B, H, T, N / H)
        output = torch.matmul(attention, v)
        # (B, H, T, N / H) -> (B, T, N)
        output = output.transpose(1, 2).reshape(batch_size, context_size, -1)

        return self._proj_dropout(self._proj(output))


class MLP(nn.Module):
    def __init__(self, in_size: int, out_size: int, pre_activation_hidden_size: int,
                 post_activation_hidden_size: int, dropout: float, activation: nn.Module):
        super().__init__()
        self._l1 = nn.Linear(in_size, pre_activation_hidden_size)
        self._l2 = nn.Linear(post_activation_hidden_size, out_size)
        self._dropout = nn.Dropout(dropout)
        self._activation = activation

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self._activation(self._l1(x))
        h = self._dropout(self._l2(h))
        return h


class Block(nn.Module):
    def __init__(self, layer_width: int, pre_activation_ff_hidden_size: int, post_activation_ff_hidden_size: int,
                 num_heads: int, context_size: int, attn_dropout: float, resid_dropout: float,
                 activation: nn.Module):
        super().__init__()
        self._attention = CausalSelfAttention(
            embed_size=layer_width, num_heads=num_heads, context_size=context_size,
            attn_dropout=attn_dropout, resid_dropout=resid_dropout,
        )
        self._mlp = MLP(
            in_size=layer_width, out_size=layer_width,
            pre_activation_hidden_size=pre_activation_ff_hidden_size,
            post_activation_hidden_size=post_activation_ff_hidden_size,
            dropout=resid_dropout, activation=activation,
        )
        self._layer_norm1 = nn.LayerNorm(layer_width, eps=0.003)
        self._layer_norm2 = nn.LayerNorm(layer_width, eps=0.003)

    def forward(self, inpt: tuple) -> tuple:
        x, attention_mask = inpt
        norm_x = self._layer_norm1(x)
        x = x + self._attention(norm_x, attention_mask)
        norm_x = self._layer_norm2(x)
        x = x + self._mlp(norm_x)
        return x, attention_mask


class SimplePositionEncoding(nn.Module):
    def __init__(self, embed_dim: int, max_timestep: int):
        super().__init__()
        self._embed = nn.Embedding(max_timestep, embed_dim)

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        assert t.dim() == 2, "Expects (B, T)"
        # (B, T) -> (B, T, N)
        return self._embed(t)


class GPT2(nn.Module):
    def __init__(self, layer_width: int, pre_activation_ff_hidden_size: int, post_activation_ff_hidden_size: int,
                 num_heads: int, context_size: int, num_layers: int, attn_dropout: float, resid_dropout: float,
                 embed_dropout: float, activation: nn.Module):
        super().__init__()
        blocks = [
            Block(
                layer_width=layer_width,
                pre_activation_ff_hidden_size=pre_activation_ff_hidden_size,
                post_activation_ff_hidden_size=post_activation_ff_hidden_size,
                num_heads=num_heads, context_size=context_size,
                attn_dropout=attn_dropout, resid_dropout=resid_dropout, activation=activation,
            )
            for _ in range(num_layers)
        ]
        self._transformer = nn.Sequential(*blocks)
        self._layer_norm = nn.LayerNorm(layer_width, eps=0.003)
        self._dropout = nn.Dropout(embed_dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self._dropout(x)
        h, _ = self._transformer((h, attention_mask))
        h = self._layer_norm(h)
        return h


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.LayerNorm):
        module.bias.data.zero_()
        module.weight.data.fill_(1.0)


class VectorEncoder(nn.Module):
    def __init__(self, observation_shape: Sequence[int], hidden_units: Sequence[int]):
        super().__init__()
        layers = []
        in_units = [observation_shape[0]] + list(hidden_units[:-1])
        for in_unit, out_unit in zip(in_units, hidden_units):
            layers.append(nn.Linear(in_unit, out_unit))
            layers.append(nn.ReLU())
        self._layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._layers(x)


class ContinuousDecisionTransformer(nn.Module):
    def __init__(self, encoder: nn.Module, embed_size: int, position_encoding: nn.Module, action_size: int,
                 num_heads: int, context_size: int, num_layers: int, attn_dropout: float, resid_dropout: float,
                 embed_dropout: float, activation: nn.Module):
        super().__init__()
        self._position_encoding = position_encoding
        self._embed_ln = nn.LayerNorm(embed_size)
        self._gpt2 = GPT2(
            layer_width=embed_size,
            pre_activation_ff_hidden_size=4 * embed_size,
            post_activation_ff_hidden_size=4 * embed_size,
            num_heads=num_heads,
            context_size=3 * context_size,
            num_layers=num_layers,
            attn_dropout=attn_dropout,
            resid_dropout=resid_dropout,
            embed_dropout=embed_dropout,
            activation=activation,
        )
        self.apply(_init_weights)

        self._encoder = encoder
        self._rtg_embed = nn.Linear(1, embed_size)
        self._action_embed = nn.Linear(action_size, embed_size)
        self._output = nn.Linear(embed_size, action_size)

    def forward(self, x: torch.Tensor, action: torch.Tensor, return_to_go: torch.Tensor, timesteps: torch.Tensor,
                attention_mask: torch.Tensor) -> torch.Tensor:
        batch_size, context_size, _ = return_to_go.shape
        position_embedding = self._position_encoding(timesteps)

        flat_x = x.view(-1, *x.shape[2:])
        flat_state_embedding = self._encoder(flat_x)
        state_embedding = flat_state_embedding.view(batch_size, context_size, -1)
        state_embedding = state_embedding + position_embedding

        action_embedding = self._action_embed(action) + position_embedding
        rtg_embedding = self._rtg_embed(return_to_go) + position_embedding

        # (B, T, N) -> (B, 3, T, N)
        h = torch.stack([rtg_embedding, state_embedding, action_embedding], dim=1)
        # (B, 3, T, N) -> (B, T, 3, N) -> (B, T * 3, N)
        h = h.transpose(1, 2).reshape(batch_size, 3 * context_size, -1)

        # repeat attention mask
        # (B, T) -> (B, 3, T)
        attention_mask = torch.stack([attention_mask, attention_mask, attention_mask], dim=1)
        # (B, 3, T) -> (B, T, 3) -> (B, T * 3)
        attention_mask = attention_mask.transpose(1, 2).reshape(batch_size, 3 * context_size)

        # for inference, drop the last step action to prevent copy
        if not self.training:
            h = h[:, :-1, :]
            attention_mask = attention_mask[:, :-1]

        h = self._gpt2(self._embed_ln(h), attention_mask)

        return torch.tanh(self._output(h[:, 1::3, :]))


def create_continuous_decision_transformer(observation_size: int, action_size: int, hidden_units: Sequence[int],
                                           num_heads: int, max_timestep: int, num_layers: int,
                                           context_size: int) -> ContinuousDecisionTransformer:
    encoder = VectorEncoder((observation_size,), hidden_units)
    hidden_size = hidden_units[-1]
    position_encoding = SimplePositionEncoding(hidden_size, max_timestep + 1)
    return ContinuousDecisionTransformer(
        encoder=encoder, embed_size=hidden_size, position_encoding=position_encoding, action_size=action_size,
        num_heads=num_heads, context_size=context_size, num_layers=num_layers,
        attn_dropout=0.0, resid_dropout=0.0, embed_dropout=0.0, activation=nn.ReLU(),
    )


# --------------------------------------------------------------------------- algorithm

@dataclasses.dataclass(frozen=True)
class TransformerInput:
    observations: np.ndarray  # (L, obs)
    actions: np.ndarray  # (L, act)
    rewards: np.ndarray  # (L, 1)
    returns_to_go: np.ndarray  # (L, 1)
    timesteps: np.ndarray  # (L,)

    @property
    def length(self) -> int:
        return int(self.actions.shape[0])


@dataclasses.dataclass(frozen=True)
class TorchTransformerInput:
    observations: torch.Tensor  # (1, L, obs)
    actions: torch.Tensor  # (1, L, act)
    rewards: torch.Tensor  # (1, L, 1)
    returns_to_go: torch.Tensor  # (1, L, 1)
    timesteps: torch.Tensor  # (1, L)
    masks: torch.Tensor  # (1, L)
    length: int

    @classmethod
    def from_numpy(cls, inpt: TransformerInput, context_size: int) -> "TorchTransformerInput":
        if context_size < inpt.length:
            observations = inpt.observations[inpt.length - context_size:inpt.length]
            actions = inpt.actions[-context_size:]
            rewards = inpt.rewards[-context_size:]
            returns_to_go = inpt.returns_to_go[-context_size:]
            timesteps = inpt.timesteps[-context_size:]
            masks = np.ones(context_size, dtype=np.float32)
        else:
            pad_size = context_size - inpt.length
            observations = batch_pad_array(inpt.observations, pad_size)
            actions = batch_pad_array(inpt.actions, pad_size)
            rewards = batch_pad_array(inpt.rewards, pad_size)
            returns_to_go = batch_pad_array(inpt.returns_to_go, pad_size)
            timesteps = batch_pad_array(inpt.timesteps, pad_size)
            masks = batch_pad_array(np.ones(inpt.length, dtype=np.float32), pad_size)

        def to_torch(array: np.ndarray) -> torch.Tensor:
            return torch.tensor(np.asarray(array, dtype=np.float32))

        return TorchTransformerInput(
            observations=to_torch(observations).unsqueeze(0),
            actions=to_torch(actions).unsqueeze(0),
            rewards=to_torch(rewards).unsqueeze(0),
            returns_to_go=to_torch(returns_to_go).unsqueeze(0),
            timesteps=to_torch(timesteps).long().unsqueeze(0),
            masks=to_torch(masks).unsqueeze(0),
            length=context_size,
        )


class DecisionTransformer:
    def __init__(self, transformer: ContinuousDecisionTransformer, context_size: int, max_timestep: int,
                 learning_rate: float):
        self.transformer = transformer
        self.context_size = context_size
        self.max_timestep = max_timestep
        self.action_size = transformer._output.out_features
        self.optim = torch.optim.Adam(transformer.parameters(), lr=learning_rate)

    def inner_predict(self, inpt: TorchTransformerInput) -> torch.Tensor:
        # (1, T, A)
        action = self.transformer(inpt.observations, inpt.actions, inpt.returns_to_go, inpt.timesteps,
                                  1 - inpt.masks)
        # (1, T, A) -> (A,)
        return action[0][-1]

    @torch.no_grad()
    def predict(self, inpt: TransformerInput) -> np.ndarray:
        self.transformer.eval()
        torch_inpt = TorchTransformerInput.from_numpy(inpt, self.context_size)
        return self.inner_predict(torch_inpt).numpy()

    def compute_loss(self, batch: TorchTrajectoryMiniBatch) -> torch.Tensor:
        action = self.transformer(batch.observations, batch.actions, batch.returns_to_go, batch.timesteps,
                                  1 - batch.masks)
        # (B, T, A) -> (B, T)
        loss = ((action - batch.actions) ** 2).sum(dim=-1)
        return (loss.reshape(-1) * batch.masks.reshape(-1)).mean()

    def update(self, batch: TorchTrajectoryMiniBatch) -> float:
        self.transformer.train()
        self.optim.zero_grad()
        loss = self.compute_loss(batch)
        loss.backward()
        self.optim.step()
        return float(loss.detach())


class StatefulTransformerWrapper:
    def __init__(self, algo: DecisionTransformer, target_return: float):
        self._algo = algo
        self._target_return = target_return
        self._return_rest = target_return
        context_size = algo.context_size
        self._observations: deque = deque([], maxlen=context_size)
        self._actions: deque = deque([self._get_pad_action()], maxlen=context_size)
        self._rewards: deque = deque([], maxlen=context_size)
        self._returns_to_go: deque = deque([], maxlen=context_size)
        self._timesteps: deque = deque([], maxlen=context_size)
        self._timestep = 1
        self.last_input: Optional[TransformerInput] = None

    def predict(self, x: np.ndarray, reward: float) -> np.ndarray:
        self._observations.append(x)
        self._rewards.append(reward)
        self._returns_to_go.append(self._return_rest - reward)
        self._timesteps.append(self._timestep)

        inpt = TransformerInput(
            observations=np.array(self._observations),
            actions=np.array(self._actions),
            rewards=np.array(self._rewards).reshape((-1, 1)),
            returns_to_go=np.array(self._returns_to_go).reshape((-1, 1)),
            timesteps=np.array(self._timesteps),
        )
        self.last_input = inpt
        action = self._algo.predict(inpt)
        self._actions[-1] = action
        self._actions.append(self._get_pad_action())
        self._timestep = min(self._timestep + 1, self._algo.max_timestep)
        self._return_rest -= reward
        return action

    def _get_pad_action(self) -> np.ndarray:
        return np.zeros(self._algo.action_size, dtype=np.float32)


# --------------------------------------------------------------------------- a toy environment and dataset

class PointMass:
    """Drive a 3-D point to the origin; the episode ends when it gets close or after `horizon` steps."""

    def __init__(self, rng: np.random.Generator, horizon: int):
        self._rng = rng
        self._horizon = horizon

    def reset(self) -> np.ndarray:
        self._t = 0
        self._pos = self._rng.uniform(-1.0, 1.0, size=3).astype(np.float32)
        return self._pos.copy()

    def step(self, action: np.ndarray):
        self._t += 1
        push = np.array([action[0], action[1], 0.5 * (action[0] - action[1])], dtype=np.float32)
        self._pos = (0.9 * self._pos + 0.2 * push).astype(np.float32)
        dist = float(np.linalg.norm(self._pos))
        terminated = dist < 0.15
        truncated = self._t >= self._horizon
        return self._pos.copy(), -dist, terminated, truncated


def collect_episode(rng: np.random.Generator, length: int) -> Episode:
    env = PointMass(rng, horizon=length)
    obs = env.reset()
    observations, actions, rewards = [], [], []
    while True:
        action = np.clip(-obs[:2] + 0.3 * rng.standard_normal(2), -1.0, 1.0).astype(np.float32)
        observations.append(obs)
        actions.append(action)
        obs, reward, terminated, truncated = env.step(action)
        rewards.append([reward])
        if terminated or truncated:
            break
    return Episode(np.array(observations, dtype=np.float32), np.array(actions, dtype=np.float32),
                   np.array(rewards, dtype=np.float32), terminated)


# --------------------------------------------------------------------------- references

def unpadded_slice(slicer: BasicTrajectorySlicer, episode: Episode, end_index: int,
                   context_size: int) -> PartialTrajectory:
    """The same window cut to its real steps only (pad_size == 0)."""
    actual_size = min(end_index + 1, context_size)
    return slicer(episode, end_index, actual_size)


def window_actions(model: ContinuousDecisionTransformer, traj: PartialTrajectory) -> torch.Tensor:
    batch = TorchTrajectoryMiniBatch.from_partial_trajectories([traj])
    assert bool((batch.masks == 1).all())
    return model(batch.observations, batch.actions, batch.returns_to_go, batch.timesteps,
                 torch.zeros_like(batch.masks))[0]


def main() -> None:
    torch.set_num_threads(1)  # a tiny model: one thread is faster than several on small matmuls
    torch.manual_seed(0)
    rng = np.random.default_rng(0)

    context_size, max_timestep, batch_size = 6, 40, 8
    observation_size, action_size = 3, 2

    episodes = [collect_episode(rng, length) for length in (3, 5, 9, 14, 20, 27)]
    transformer = create_continuous_decision_transformer(
        observation_size=observation_size, action_size=action_size, hidden_units=[32, 32], num_heads=2,
        max_timestep=max_timestep, num_layers=2, context_size=context_size,
    )
    dt = DecisionTransformer(transformer, context_size=context_size, max_timestep=max_timestep, learning_rate=1e-3)
    slicer = BasicTrajectorySlicer()

    # ---- training: padded batch of windows vs each window run alone on its real steps
    n_padded_windows = 0
    for step in range(4):
        picks = []
        for _ in range(batch_size):
            episode = episodes[int(rng.integers(len(episodes)))]
            picks.append((episode, int(rng.integers(episode.size()))))
        if step == 0:  # make sure the first batch has windows cut short by the episode start
            picks[0] = (episodes[0], 0)
            picks[1] = (episodes[3], 2)
        trajs = [slicer(episode, end_index, context_size) for episode, end_index in picks]
        batch = TorchTrajectoryMiniBatch.from_partial_trajectories(trajs)
        n_padded_windows += int((batch.masks.sum(dim=1) < context_size).sum())

        transformer.train()
        transformer.zero_grad()
        action = transformer(batch.observations, batch.actions, batch.returns_to_go, batch.timesteps,
                             1 - batch.masks)
        loss = dt.compute_loss(batch)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in transformer.named_parameters() if p.grad is not None}

        transformer.zero_grad()
        ref_loss = torch.zeros(())
        for i, (episode, end_index) in enumerate(picks):
            ref = window_actions(transformer, unpadded_slice(slicer, episode, end_index, context_size))
            n_real = ref.shape[0]
            real_actions = torch.tensor(episode.actions[end_index + 1 - n_real:end_index + 1])
            assert torch.allclose(action[i, context_size - n_real:], ref.detach(), atol=1e-5), (step, i)
            ref_loss = ref_loss + ((ref - real_actions) ** 2).sum()
        ref_loss = ref_loss / (batch_size * context_size)
        ref_loss.backward()
        assert torch.allclose(loss, ref_loss, atol=1e-6), (float(loss), float(ref_loss))
        for name, p in transformer.named_parameters():
            if name in grads:
                assert torch.allclose(grads[name], p.grad, atol=1e-6), name

        dt.update(batch)
    assert n_padded_windows > 0

    # ---- acting: the stateful wrapper pads the recent history on the left until it holds context_size steps
    env = PointMass(np.random.default_rng(1), horizon=12)
    wrapper = StatefulTransformerWrapper(dt, target_return=-1.0)
    obs, reward, done, n_steps = env.reset(), 0.0, False, 0
    while not done:
        action = wrapper.predict(obs, reward)
        inpt = wrapper.last_input
        with torch.no_grad():
            transformer.eval()
            ref = dt.inner_predict(TorchTransformerInput.from_numpy(inpt, inpt.length)).numpy()
        assert np.allclose(action, ref, atol=1e-5), (n_steps, action, ref)
        obs, reward, terminated, truncated = env.step(action)
        done = terminated or truncated
        n_steps += 1
    assert n_steps > context_size

    print(f"train: {n_padded_windows} left-padded windows matched their unpadded runs; "
          f"act: {n_steps} steps matched the unpadded history; last loss {loss.item():.5f}")


if __name__ == "__main__":
    main()
