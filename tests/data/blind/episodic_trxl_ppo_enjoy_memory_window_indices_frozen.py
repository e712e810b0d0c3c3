# MarcoMeter/episodic-transformer-memory-ppo#14 (commit aa56f08): enjoy.py's init_transformer_memory repeats the
# first window [0..L-1] max_episode_steps-1 times instead of memory_length-1 times, so at rollout the agent's
# sliding memory window (and its positional indices) stays frozen on the first steps of the episode.
import sys

import numpy as np
import torch
from torch import nn
from torch.distributions import Categorical
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads):
        super(MultiHeadAttention, self).__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_size = embed_dim // num_heads
        self.values = nn.Linear(self.head_size, self.head_size, bias=False)
        self.keys = nn.Linear(self.head_size, self.head_size, bias=False)
        self.queries = nn.Linear(self.head_size, self.head_size, bias=False)
        self.fc_out = nn.Linear(self.num_heads * self.head_size, embed_dim)

    def forward(self, values, keys, query, mask):
        N = query.shape[0]
        value_len, key_len, query_len = values.shape[1], keys.shape[1], query.shape[1]
        values = values.reshape(N, value_len, self.num_heads, self.head_size)
        keys = keys.reshape(N, key_len, self.num_heads, self.head_size)
        query = query.reshape(N, query_len, self.num_heads, self.head_size)
        values = self.values(values)
        keys = self.keys(keys)
        queries = self.queries(query)
        energy = torch.einsum("nqhd,nkhd->nhqk", [queries, keys])
        # Mask padded indices so their attention weights become 0
        if mask is not None:
            energy = energy.masked_fill(mask.unsqueeze(1).unsqueeze(1) == 0, float("-1e20"))  # -inf causes NaN
        attention = torch.softmax(energy / (self.embed_dim ** (1 / 2)), dim=3)
        out = torch.einsum("nhql,nlhd->nqhd", [attention, values]).reshape(N, query_len, self.num_heads * self.head_size)
        out = self.fc_out(out)
        return out, attention


class GRUGate(nn.Module):
    def __init__(self, input_dim, bg=0.0):
        super(GRUGate, self).__init__()
        self.Wr = nn.Linear(input_dim, input_dim, bias=False)
        self.Ur = nn.Linear(input_dim, input_dim, bias=False)
        self.Wz = nn.Linear(input_dim, input_dim, bias=False)
        self.Uz = nn.Linear(input_dim, input_dim, bias=False)
        self.Wg = nn.Linear(input_dim, input_dim, bias=False)
        self.Ug = nn.Linear(input_dim, input_dim, bias=False)
        self.bg = nn.Parameter(torch.full([input_dim], bg))
        self.sigmoid = nn.Sigmoid()
        self.tanh = nn.Tanh()
        for lin in (self.Wr, self.Ur, self.Wz, self.Uz, self.Wg, self.Ug):
            nn.init.xavier_uniform_(lin.weight)

    def forward(self, x, y):
        r = self.sigmoid(self.Wr(y) + self.Ur(x))
        z = self.sigmoid(self.Wz(y) + self.Uz(x) - self.bg)
        h = self.tanh(self.Wg(y) + self.Ug(torch.mul(r, x)))
        return torch.mul(1 - z, x) + torch.mul(z, h)


class TransformerBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, config):
        super(TransformerBlock, self).__init__()
        self.attention = MultiHeadAttention(embed_dim, num_heads)
        self.use_gtrxl = config["gtrxl"] if "gtrxl" in config else False
        if self.use_gtrxl:
            self.gate1 = GRUGate(embed_dim, config["gtrxl_bias"])
            self.gate2 = GRUGate(embed_dim, config["gtrxl_bias"])
        self.layer_norm = config["layer_norm"]
        self.norm1 = nn.LayerNorm(embed_dim)
        self.norm2 = nn.LayerNorm(embed_dim)
        if self.layer_norm == "pre":
            self.norm_kv = nn.LayerNorm(embed_dim)
        self.fc = nn.Sequential(nn.Linear(embed_dim, embed_dim), nn.ReLU())

    def forward(self, value, key, query, mask):
        if self.layer_norm == "pre":
            query_ = self.norm1(query)
            value = self.norm_kv(value)
            key = value
        else:
            query_ = query
        attention, attention_weights = self.attention(value, key, query_, mask)
        h = self.gate1(query, attention) if self.use_gtrxl else attention + query
        if self.layer_norm == "post":
            h = self.norm1(h)
        h_ = self.norm2(h) if self.layer_norm == "pre" else h
        forward = self.fc(h_)
        out = self.gate2(h, forward) if self.use_gtrxl else forward + h
        if self.layer_norm == "post":
            out = self.norm2(out)
        return out, attention_weights


class SinusoidalPosition(nn.Module):
    """Relative positional encoding"""
    def __init__(self, dim, min_timescale=2., max_timescale=1e4):
        super().__init__()
        freqs = torch.arange(0, dim, min_timescale)
        inv_freqs = max_timescale ** (-freqs / dim)
        self.register_buffer('inv_freqs', inv_freqs)

    def forward(self, seq_len):
        seq = torch.arange(seq_len - 1, -1, -1.)
        sinusoidal_inp = seq[:, None] * self.inv_freqs[None, :]  # rearrange(seq, 'n -> n ()') * rearrange(inv_freqs, 'd -> () d')
        return torch.cat((sinusoidal_inp.sin(), sinusoidal_inp.cos()), dim=-1)


class Transformer(nn.Module):
    def __init__(self, config, input_dim, max_episode_steps):
        super().__init__()
        self.config = config
        self.num_blocks = config["num_blocks"]
        self.embed_dim = config["embed_dim"]
        self.num_heads = config["num_heads"]
        self.max_episode_steps = max_episode_steps
        self.activation = nn.ReLU()
        self.linear_embedding = nn.Linear(input_dim, self.embed_dim)
        nn.init.orthogonal_(self.linear_embedding.weight, np.sqrt(2))
        if config["positional_encoding"] == "relative":
            self.pos_embedding = SinusoidalPosition(dim=self.embed_dim)
        self.transformer_blocks = nn.ModuleList([
            TransformerBlock(self.embed_dim, self.num_heads, config) for _ in range(self.num_blocks)])

    def forward(self, h, memories, mask, memory_indices):
        h = self.activation(self.linear_embedding(h))
        if self.config["positional_encoding"] == "relative":
            pos_embedding = self.pos_embedding(self.max_episode_steps)[memory_indices]
            memories = memories + pos_embedding.unsqueeze(2)
        out_memories = []
        for i, block in enumerate(self.transformer_blocks):
            out_memories.append(h.detach())
            h, attention_weights = block(memories[:, :, i], memories[:, :, i], h.unsqueeze(1), mask)
            h = h.squeeze()
            if len(h.shape) == 1:
                h = h.unsqueeze(0)
        return h, torch.stack(out_memories, dim=1)


class ActorCriticModel(nn.Module):
    def __init__(self, config, obs_dim, action_space_shape, max_episode_length):
        super().__init__()
        self.hidden_size = config["hidden_layer_size"]
        self.memory_layer_size = config["transformer"]["embed_dim"]
        self.lin_hidden = nn.Linear(obs_dim, self.memory_layer_size)
        nn.init.orthogonal_(self.lin_hidden.weight, np.sqrt(2))
        self.transformer = Transformer(config["transformer"], self.memory_layer_size, max_episode_length)
        self.lin_policy = nn.Linear(self.memory_layer_size, self.hidden_size)
        nn.init.orthogonal_(self.lin_policy.weight, np.sqrt(2))
        self.lin_value = nn.Linear(self.memory_layer_size, self.hidden_size)
        self.policy_branches = nn.ModuleList([nn.Linear(self.hidden_size, n) for n in action_space_shape])
        self.value = nn.Linear(self.hidden_size, 1)

    def forward(self, obs, memory, memory_mask, memory_indices):
        h = F.relu(self.lin_hidden(obs))
        h, memory = self.transformer(h, memory, memory_mask, memory_indices)
        h_policy = F.relu(self.lin_policy(h))
        h_value = F.relu(self.lin_value(h))
        value = self.value(h_value).reshape(-1)
        pi = [Categorical(logits=branch(h_policy)) for branch in self.policy_branches]
        return pi, value, memory


def init_transformer_memory(trxl_conf, max_episode_steps, device):
    """enjoy.py: initial episodic memory, memory mask and sliding memory window indices."""
    memory_mask = torch.tril(torch.ones((trxl_conf["memory_length"], trxl_conf["memory_length"])), diagonal=-1)
    memory = torch.zeros((1, max_episode_steps, trxl_conf["num_blocks"], trxl_conf["embed_dim"])).to(device)
    if FIXED:
        repetitions = torch.repeat_interleave(torch.arange(0, trxl_conf["memory_length"]).unsqueeze(0), trxl_conf["memory_length"] - 1, dim=0).long()
    else:
        repetitions = torch.repeat_interleave(torch.arange(0, trxl_conf["memory_length"]).unsqueeze(0), max_episode_steps - 1, dim=0).long()
    memory_indices = torch.stack([torch.arange(i, i + trxl_conf["memory_length"]) for i in range(max_episode_steps - trxl_conf["memory_length"] + 1)]).long()
    memory_indices = torch.cat((repetitions, memory_indices))
    return memory, memory_mask, memory_indices


def trainer_memory_setup(memory_length, max_episode_length, num_blocks, embed_dim):
    """trainer.py (the training-time path): same tensors built by PPOTrainer.__init__."""
    memory = torch.zeros((1, max_episode_length, num_blocks, embed_dim), dtype=torch.float32)
    memory_mask = torch.tril(torch.ones((memory_length, memory_length)), diagonal=-1)
    repetitions = torch.repeat_interleave(torch.arange(0, memory_length).unsqueeze(0), memory_length - 1, dim=0).long()
    memory_indices = torch.stack([torch.arange(i, i + memory_length) for i in range(max_episode_length - memory_length + 1)]).long()
    memory_indices = torch.cat((repetitions, memory_indices))
    return memory, memory_mask, memory_indices


def run_episode(model, observations, memory, memory_mask, memory_indices, memory_length):
    """enjoy.py main loop (deterministic observations instead of a rendered env)."""
    logits = []
    for t in range(observations.shape[0]):
        obs = observations[t:t + 1]
        in_memory = memory[0, memory_indices[t].unsqueeze(0)]
        t_ = max(0, min(t, memory_length - 1))
        mask = memory_mask[t_].unsqueeze(0)
        indices = memory_indices[t].unsqueeze(0)
        policy, value, new_memory = model(obs, in_memory, mask, indices)
        memory[:, t] = new_memory
        logits.append(policy[0].logits)
    return torch.cat(logits)


config = {
    "hidden_layer_size": 32,
    "transformer": {"num_blocks": 2, "embed_dim": 32, "num_heads": 2, "memory_length": 4,
                    "positional_encoding": "relative", "layer_norm": "pre", "gtrxl": True, "gtrxl_bias": 0.0},
}
max_episode_steps, obs_dim = 16, 6
model = ActorCriticModel(config, obs_dim, (3,), max_episode_steps).eval()
observations = torch.randn(max_episode_steps, obs_dim)
L = config["transformer"]["memory_length"]

with torch.no_grad():
    memory, memory_mask, memory_indices = init_transformer_memory(config["transformer"], max_episode_steps, "cpu")
    rollout_logits = run_episode(model, observations, memory, memory_mask, memory_indices, L)
    memory, memory_mask, memory_indices_ref = trainer_memory_setup(L, max_episode_steps, 2, 32)
    train_logits = run_episode(model, observations, memory, memory_mask, memory_indices_ref, L)

print("window at t=%d: %s (trainer: %s)" % (L + 2, memory_indices[L + 2].tolist(), memory_indices_ref[L + 2].tolist()))
print("max |policy logits (enjoy rollout) - policy logits (trainer windows)| = %.6f"
      % (rollout_logits - train_logits).abs().max().item())
