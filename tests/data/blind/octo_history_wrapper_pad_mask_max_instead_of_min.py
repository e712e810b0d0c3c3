# Octo (octo-models/octo#73, commit 8b0e267): HistoryWrapper's stack_and_pad computed
# pad_length = horizon - max(num_obs, horizon): 0 while the history holds padding (pad_mask all ones, so the
# BlockTransformer attends to the duplicated first observation), negative later (real past frames masked out).
# Torch port of the BlockTransformer attention-rule mask + pad mask (flax boolean-mask convention: True = attend).
import sys
from collections import deque
from enum import Enum
from fnmatch import fnmatch

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- octo/utils/gym_wrappers.py
def stack_and_pad(history: list, num_obs: int):
    horizon = len(history)
    full_obs = {k: np.stack([dic[k] for dic in history]) for k in history[0]}
    if FIXED:
        pad_length = horizon - min(num_obs, horizon)
    else:
        pad_length = horizon - max(num_obs, horizon)
    pad_mask = np.ones(horizon)
    pad_mask[:pad_length] = 0
    full_obs["pad_mask"] = pad_mask
    return full_obs


class ToyEnv:
    def __init__(self, seed, state_dim=6):
        self.rng = np.random.RandomState(seed)
        self.state_dim = state_dim

    def reset(self):
        return {"proprio": self.rng.randn(self.state_dim).astype(np.float32)}, {}

    def step(self, action):
        return {"proprio": self.rng.randn(self.state_dim).astype(np.float32)}, 0.0, False, False, {}


class HistoryWrapper:
    def __init__(self, env, horizon: int):
        self.env = env
        self.horizon = horizon
        self.history = deque(maxlen=self.horizon)
        self.num_obs = 0

    def step(self, action):
        obs, reward, done, trunc, info = self.env.step(action)
        self.num_obs += 1
        self.history.append(obs)
        assert len(self.history) == self.horizon
        full_obs = stack_and_pad(self.history, self.num_obs)
        return full_obs, reward, done, trunc, info

    def reset(self, **kwargs):
        obs, info = self.env.reset(**kwargs)
        self.num_obs = 1
        self.history.extend([obs] * self.horizon)
        full_obs = stack_and_pad(self.history, self.num_obs)
        return full_obs, info


# ---------------------------------------------------------------- octo/model/components/block_transformer.py
class AttentionRule(Enum):
    NEVER = "never"
    CAUSAL = "other.timestep <= self.timestep"
    CURRENT = "other.timestep == self.timestep"
    STRICT_PAST = "other.timestep < self.timestep"
    ALL = "all"


class Group:
    def __init__(self, tokens, mask, name, attention_rules):
        self.tokens, self.mask, self.name, self.attention_rules = tokens, mask, name, attention_rules


def find_match(pattern_dict, name, default):
    for pattern, value in pattern_dict.items():
        if fnmatch(name, pattern):
            return value
    return default


class TokenMetadata:
    def __init__(self, name, timestep, attention_rules):
        self.name, self.timestep, self.attention_rules = name, timestep, attention_rules

    def should_attend_to(self, other):
        rule = find_match(self.attention_rules, other.name, AttentionRule.NEVER)
        if rule == AttentionRule.CAUSAL:
            return other.timestep <= self.timestep
        if rule == AttentionRule.CURRENT:
            return other.timestep == self.timestep
        if rule == AttentionRule.STRICT_PAST:
            return other.timestep < self.timestep
        if rule == AttentionRule.ALL:
            return True
        return False


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, attention_mask):
        B, N, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, N, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # bool, True = attend
        x = x + self.out(y.transpose(1, 2).reshape(B, N, D))
        return x + self.mlp(self.ln2(x))


class BlockTransformer(nn.Module):
    def __init__(self, d, heads, layers):
        super().__init__()
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.LayerNorm(d)

    def forward(self, prefix_groups, timestep_groups):
        horizon = timestep_groups[0].tokens.shape[1]
        prefix = torch.cat([g.tokens for g in prefix_groups], dim=1)
        ts = torch.cat([g.tokens for g in timestep_groups], dim=2)
        x = torch.cat([prefix, ts.flatten(1, 2)], dim=1)
        attention_mask = self.generate_attention_mask(prefix_groups, timestep_groups)
        for blk in self.blocks:
            x = blk(x, attention_mask)
        x = self.norm(x)
        n_prefix = prefix.shape[1]
        return x[:, n_prefix:].reshape(x.shape[0], horizon, ts.shape[2], -1)

    def generate_attention_mask(self, prefix_groups, timestep_groups):
        def _get_position(i, tokens_per_elem):
            return np.searchsorted(np.cumsum(tokens_per_elem), i, side="right")

        horizon = timestep_groups[0].tokens.shape[1]
        tokens_per_prefix_group = [g.tokens.shape[1] for g in prefix_groups]
        tokens_per_timestep_group = [g.tokens.shape[2] for g in timestep_groups]
        tokens_for_prefix = sum(tokens_per_prefix_group)
        tokens_per_time_step = sum(tokens_per_timestep_group)
        total_tokens = tokens_for_prefix + tokens_per_time_step * horizon
        attention_mask = np.zeros((total_tokens, total_tokens), dtype=int)

        def get_token_metadata(i):
            if i < tokens_for_prefix:
                position = _get_position(i, tokens_per_prefix_group)
                g = prefix_groups[position]
                return TokenMetadata(g.name, -1, g.attention_rules)
            i -= tokens_for_prefix
            timestep, i = divmod(i, tokens_per_time_step)
            position = _get_position(i, tokens_per_timestep_group)
            g = timestep_groups[position]
            return TokenMetadata(g.name, timestep, g.attention_rules)

        for i in range(total_tokens):
            for j in range(total_tokens):
                attention_mask[i, j] = int(get_token_metadata(i).should_attend_to(get_token_metadata(j)))

        pad_attention_mask = self.generate_pad_attention_mask(prefix_groups, timestep_groups)
        return torch.logical_and(torch.from_numpy(attention_mask).bool(), pad_attention_mask)

    def generate_pad_attention_mask(self, prefix_groups, timestep_groups):
        batch_size, horizon = timestep_groups[0].tokens.shape[:2]
        prefix_pad_mask = torch.cat([g.mask for g in prefix_groups], dim=1)
        timestep_pad_mask = torch.cat([g.mask for g in timestep_groups], dim=2).flatten(1, 2)
        pad_mask = torch.cat([prefix_pad_mask, timestep_pad_mask], dim=1).bool()
        n = pad_mask.shape[1]
        return pad_mask[:, None, None, :].expand(batch_size, 1, n, n)


# ---------------------------------------------------------------- octo/model/octo_module.py (trimmed)
class OctoTransformer(nn.Module):
    def __init__(self, state_dim=6, d=32, heads=4, layers=2, horizon=3, n_task=3, n_obs=2):
        super().__init__()
        self.n_obs = n_obs
        self.task_proj = nn.Linear(8, d)
        self.obs_proj = nn.Linear(state_dim, n_obs * d)
        self.pos = nn.ParameterDict({
            "task_language": nn.Parameter(torch.randn(1, n_task, d) * 0.02),
            "obs_proprio": nn.Parameter(torch.randn(1, horizon, n_obs, d) * 0.02),
            "readout_action": nn.Parameter(torch.randn(1, horizon, 1, d) * 0.02),
        })
        self.transformer = BlockTransformer(d, heads, layers)
        self.head = nn.Linear(d, 4)

    def forward(self, observations, tasks, pad_mask):
        B, horizon = pad_mask.shape
        task_tokens = self.task_proj(tasks["language"]) + self.pos["task_language"]
        prefix = [Group(task_tokens, torch.ones(B, task_tokens.shape[1]), "task_language",
                        {"task_*": AttentionRule.CAUSAL})]
        obs_tokens = self.obs_proj(observations["proprio"]).view(B, horizon, self.n_obs, -1)
        obs_tokens = obs_tokens + self.pos["obs_proprio"][:, :horizon]
        tok_mask = torch.ones(B, horizon, self.n_obs, dtype=torch.bool)
        obs_pad_mask = torch.logical_and(pad_mask[:, :, None].bool(), tok_mask)  # timesteps that are padding
        obs_rules = {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL}
        readout_tokens = torch.zeros(B, horizon, 1, obs_tokens.shape[-1]) + self.pos["readout_action"][:, :horizon]
        readout_rules = {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL,
                         "readout_action": AttentionRule.CAUSAL}
        timestep = [
            Group(obs_tokens, obs_pad_mask, "obs_proprio", obs_rules),
            Group(readout_tokens, torch.ones(B, horizon, 1), "readout_action", readout_rules),
        ]
        out = self.transformer(prefix, timestep)
        return self.head(out[:, :, self.n_obs])  # action head on readout_action, (B, horizon, 4)


def main():
    torch.manual_seed(0)
    horizon = 3
    model = OctoTransformer(horizon=horizon).eval()
    tasks = {"language": torch.randn(1, 3, 8)}
    env = HistoryWrapper(ToyEnv(seed=0), horizon)

    worst = 0.0
    obs, _ = env.reset()
    for t in range(4):
        pad_mask = torch.from_numpy(obs["pad_mask"])[None]
        proprio = torch.from_numpy(obs["proprio"])[None]
        with torch.no_grad():
            act = model({"proprio": proprio}, tasks, pad_mask)[:, -1]
            # reference: same call with whatever sits in the padded history slots replaced by zeros;
            # the true number of real timesteps is min(t + 1, horizon)
            n_pad = horizon - min(t + 1, horizon)
            ref_proprio = proprio.clone()
            ref_proprio[:, :n_pad] = 0.0
            ref = model({"proprio": ref_proprio}, tasks, pad_mask)[:, -1]
        worst = max(worst, (act - ref).abs().max().item())
        print(f"step {t}: pad_mask={obs['pad_mask'].astype(int).tolist()}")
        obs, *_ = env.step(act[0].numpy())
    print(f"max |action(duplicated-obs padding) - action(zeroed padding)| = {worst:.6f}")


if __name__ == "__main__":
    main()
