# takuseno/d3rlpy commit 9251cdeb ("Apply attention mask based on batch.masks"): ContinuousDecisionTransformer never
# received the trajectory masks, so the zero-padded timesteps the trajectory slicer prepends to short trajectories were
# attended to (only the causal mask was applied) and counted in the loss.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


def create_attention_mask(context_size):
    mask = torch.ones(context_size, context_size, dtype=torch.float32)
    return torch.tril(mask).view(1, 1, context_size, context_size)


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_size, num_heads, context_size, attn_dropout, resid_dropout):
        super().__init__()
        self._num_heads = num_heads
        self._context_size = context_size
        self._k = nn.Linear(embed_size, embed_size)
        self._q = nn.Linear(embed_size, embed_size)
        self._v = nn.Linear(embed_size, embed_size)
        self._proj = nn.Linear(embed_size, embed_size)
        self._attn_dropout = nn.Dropout(attn_dropout)
        self._proj_dropout = nn.Dropout(resid_dropout)
        self.register_buffer("_mask", create_attention_mask(context_size))

    def forward(self, x, attention_mask=None):
        batch_size, context_size, _ = x.shape
        assert context_size <= self._context_size, "Exceeds context_size"
        shape = (batch_size, context_size, self._num_heads, -1)
        k = self._k(x).view(shape).transpose(1, 2)
        q = self._q(x).view(shape).transpose(1, 2)
        v = self._v(x).view(shape).transpose(1, 2)
        qkT = torch.matmul(q, k.transpose(2, 3))
        attention = qkT / math.sqrt(k.shape[-1])
        if FIXED:
            attention = attention.masked_fill(self._mask[..., :context_size, :context_size] == 0, -10000)
            attention = attention + attention_mask.view(batch_size, 1, 1, context_size) * -10000
        else:
            attention = attention.masked_fill(self._mask[..., :context_size, :context_size] == 0, float("-inf"))
        attention = F.softmax(attention, dim=-1)
        attention = self._attn_dropout(attention)
        output = torch.matmul(attention, v)
        output = output.transpose(1, 2).reshape(batch_size, context_size, -1)
        return self._proj_dropout(self._proj(output))


class MLP(nn.Module):
    def __init__(self, in_size, out_size, pre_activation_hidden_size, post_activation_hidden_size, dropout, activation):
        super().__init__()
        self._l1 = nn.Linear(in_size, pre_activation_hidden_size)
        self._l2 = nn.Linear(post_activation_hidden_size, out_size)
        self._dropout = nn.Dropout(dropout)
        self._activation = activation

    def forward(self, x):
        return self._dropout(self._l2(self._activation(self._l1(x))))


class Block(nn.Module):
    def __init__(self, layer_width, pre_ff, post_ff, num_heads, context_size, attn_dropout, resid_dropout, activation):
        super().__init__()
        self._attention = CausalSelfAttention(layer_width, num_heads, context_size, attn_dropout, resid_dropout)
        self._mlp = MLP(layer_width, layer_width, pre_ff, post_ff, resid_dropout, activation)
        self._layer_norm1 = nn.LayerNorm(layer_width, eps=0.003)
        self._layer_norm2 = nn.LayerNorm(layer_width, eps=0.003)

    def forward(self, inpt):
        x, attention_mask = inpt
        norm_x = self._layer_norm1(x)
        x = x + self._attention(norm_x, attention_mask)
        norm_x = self._layer_norm2(x)
        x = x + self._mlp(norm_x)
        return x, attention_mask


class SimplePositionEncoding(nn.Module):
    def __init__(self, embed_dim, max_timestep):
        super().__init__()
        self._embed = nn.Embedding(max_timestep, embed_dim)

    def forward(self, t):
        return self._embed(t)


class GPT2(nn.Module):
    def __init__(self, layer_width, num_heads, context_size, num_layers, attn_dropout, resid_dropout, embed_dropout, activation):
        super().__init__()
        self._transformer = nn.Sequential(*[
            Block(layer_width, 4 * layer_width, 4 * layer_width, num_heads, context_size, attn_dropout, resid_dropout, activation)
            for _ in range(num_layers)])
        self._layer_norm = nn.LayerNorm(layer_width, eps=0.003)
        self._dropout = nn.Dropout(embed_dropout)

    def forward(self, x, attention_mask):
        h = self._dropout(x)
        h, _ = self._transformer((h, attention_mask))
        return self._layer_norm(h)


def _init_weights(module):
    if isinstance(module, (nn.Linear, nn.Embedding)):
        module.weight.data.normal_(mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            module.bias.data.zero_()
    elif isinstance(module, nn.LayerNorm):
        module.bias.data.zero_()
        module.weight.data.fill_(1.0)


class VectorEncoder(nn.Module):
    def __init__(self, observation_shape, hidden_units):
        super().__init__()
        layers, in_units = [], [observation_shape[0]] + list(hidden_units[:-1])
        for in_unit, out_unit in zip(in_units, hidden_units):
            layers += [nn.Linear(in_unit, out_unit), nn.ReLU()]
        self._layers = nn.Sequential(*layers)

    def forward(self, x):
        return self._layers(x)


class ContinuousDecisionTransformer(nn.Module):
    def __init__(self, encoder, embed_size, position_encoding, action_size, num_heads, context_size, num_layers,
                 attn_dropout, resid_dropout, embed_dropout, activation):
        super().__init__()
        self._position_encoding = position_encoding
        self._embed_ln = nn.LayerNorm(embed_size)
        self._gpt2 = GPT2(embed_size, num_heads, 3 * context_size, num_layers, attn_dropout, resid_dropout,
                          embed_dropout, activation)
        self.apply(_init_weights)
        self._encoder = encoder
        self._rtg_embed = nn.Linear(1, embed_size)
        self._action_embed = nn.Linear(action_size, embed_size)
        self._output = nn.Linear(embed_size, action_size)

    def forward(self, x, action, return_to_go, timesteps, attention_mask=None):
        batch_size, context_size, _ = return_to_go.shape
        position_embedding = self._position_encoding(timesteps)
        flat_x = x.view(-1, *x.shape[2:])
        state_embedding = self._encoder(flat_x).view(batch_size, context_size, -1)
        state_embedding = state_embedding + position_embedding
        action_embedding = self._action_embed(action) + position_embedding
        rtg_embedding = self._rtg_embed(return_to_go) + position_embedding
        h = torch.stack([rtg_embedding, state_embedding, action_embedding], dim=1)
        h = h.transpose(1, 2).reshape(batch_size, 3 * context_size, -1)
        if FIXED:
            # repeat attention mask (B, T) -> (B, 3, T) -> (B, T * 3)
            attention_mask = torch.stack([attention_mask, attention_mask, attention_mask], dim=1)
            attention_mask = attention_mask.transpose(1, 2).reshape(batch_size, 3 * context_size)
        # for inference, drop the last step action to prevent copy
        if not self.training:
            h = h[:, :-1, :]
            if FIXED:
                attention_mask = attention_mask[:, :-1]
        h = self._gpt2(self._embed_ln(h), attention_mask)
        return torch.tanh(self._output(h[:, 1::3, :]))


def batch_pad_array(array, pad_size):
    """d3rlpy.dataset.utils.batch_pad_array: zero padding in front of the trajectory."""
    batch_size = array.shape[0]
    padded_array = np.zeros((pad_size + batch_size, *array.shape[1:]), dtype=array.dtype)
    padded_array[-batch_size:] = array
    return padded_array


def slice_trajectory(traj, size):
    """BasicTrajectorySlicer for an episode shorter than the context: pad in front, masks 0 on padding."""
    actual_size = traj["observations"].shape[0]
    pad_size = size - actual_size
    masks = np.ones(actual_size, dtype=np.float32)
    return {k: batch_pad_array(v, pad_size) for k, v in dict(traj, masks=masks).items()}


obs_dim, action_size, context_size, max_timestep = 5, 3, 6, 50
transformer = ContinuousDecisionTransformer(
    VectorEncoder((obs_dim,), [32, 32]), 32, SimplePositionEncoding(32, max_timestep), action_size, num_heads=2,
    context_size=context_size, num_layers=2, attn_dropout=0.0, resid_dropout=0.0, embed_dropout=0.0, activation=nn.GELU())

lengths = [6, 4, 2]
trajs = []
for n in lengths:
    trajs.append({
        "observations": np.random.randn(n, obs_dim).astype(np.float32),
        "actions": np.random.uniform(-1, 1, (n, action_size)).astype(np.float32),
        "returns_to_go": np.random.randn(n, 1).astype(np.float32),
        "timesteps": np.arange(n, dtype=np.int64),
    })
batch = {k: torch.tensor(np.stack([slice_trajectory(t, context_size)[k] for t in trajs]))
         for k in ["observations", "actions", "returns_to_go", "timesteps", "masks"]}

transformer.train()  # DecisionTransformerImpl.compute_loss runs the model in training mode
if FIXED:
    action = transformer(batch["observations"], batch["actions"], batch["returns_to_go"], batch["timesteps"],
                         1 - batch["masks"])
else:
    action = transformer(batch["observations"], batch["actions"], batch["returns_to_go"], batch["timesteps"])
loss = ((action - batch["actions"]) ** 2).sum(dim=-1)
loss = (loss.reshape(-1) * batch["masks"].reshape(-1)).mean() if FIXED else loss.mean()
loss.backward()

# Reference: each trajectory alone, without any padding.
max_diff = 0.0
with torch.no_grad():
    for i, t in enumerate(trajs):
        n = lengths[i]
        alone = transformer(torch.tensor(t["observations"])[None], torch.tensor(t["actions"])[None],
                            torch.tensor(t["returns_to_go"])[None], torch.tensor(t["timesteps"])[None],
                            torch.zeros(1, n))
        max_diff = max(max_diff, (action[i, -n:].detach() - alone[0]).abs().max().item())

print("training loss = %.6f" % loss.item())
print("max |predicted actions (left-padded batch) - predicted actions (each trajectory alone)| = %.6f" % max_diff)
