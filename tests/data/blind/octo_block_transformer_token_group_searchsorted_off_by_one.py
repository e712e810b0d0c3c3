"""Octo BlockTransformer: token -> group lookup off by one at every group boundary.

Citation: octo-models/octo#75 ("Incorrect attention mask computation"), fix proposed in
octo-models/octo#76 ("Fix potential off-by-one error in attention mask generation", by the
author of block_transformer.py). The stored upstream `octo/model/components/block_transformer.py`
(main) carries the fix: `_get_position` uses `np.searchsorted(..., side='right')`.

Bug: `BlockTransformer.generate_attention_mask` finds the group of token `i` with
`np.searchsorted(np.cumsum(tokens_per_elem), i)` (default side='left'). For the first token of
every group after the first, `cumsum[k] == i`, so the token is attributed to the previous group.
In the issue, the `readout_action` token at t=1 was labelled `obs_wrist`, so observation tokens
attended to it (readouts must be invisible to observations) and it lost its own readout rule.
Fix: `side='right'`.

This program: Octo is JAX/Flax; the group/rule logic (AttentionRule, TokenMetadata,
PrefixGroup/TimestepGroup, generate_attention_mask, generate_pad_attention_mask) is written as
upstream with numpy, and the Flax `MultiHeadDotProductAttention(mask=...)` (True = attend) is
rendered as torch SDPA with the same boolean mask. Groups: task (prefix, 2 tokens, one padded
in sample 1), obs_primary (3), obs_wrist (2), readout_action (1), horizon 2.
"""
import sys
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatch
from typing import Mapping

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class AttentionRule(Enum):
    NEVER = "never"
    CAUSAL = "other.timestep <= self.timestep"
    CURRENT = "other.timestep == self.timestep"
    STRICT_PAST = "other.timestep < self.timestep"
    ALL = "all"


@dataclass
class PrefixGroup:
    tokens: torch.Tensor  # (batch, n_tokens, d)
    mask: torch.Tensor  # (batch, n_tokens)
    name: str
    attention_rules: Mapping[str, AttentionRule]


@dataclass
class TimestepGroup:
    tokens: torch.Tensor  # (batch, horizon, n_tokens, d)
    mask: torch.Tensor  # (batch, horizon, n_tokens)
    name: str
    attention_rules: Mapping[str, AttentionRule]


def find_match(pattern_dict, name, default):
    for pattern, value in pattern_dict.items():
        if fnmatch(name, pattern):
            return value
    return default


@dataclass
class TokenMetadata:
    name: str
    timestep: int  # -1 for prefix tokens
    attention_rules: Mapping[str, AttentionRule]

    @classmethod
    def create(cls, group, timestep):
        return cls(timestep=timestep, name=group.name, attention_rules=group.attention_rules)

    def should_attend_to(self, other_metadata):
        attention_rule = find_match(self.attention_rules, other_metadata.name, AttentionRule.NEVER)
        if attention_rule == AttentionRule.CAUSAL:
            return other_metadata.timestep <= self.timestep
        elif attention_rule == AttentionRule.CURRENT:
            return other_metadata.timestep == self.timestep
        elif attention_rule == AttentionRule.STRICT_PAST:
            return other_metadata.timestep < self.timestep
        elif attention_rule == AttentionRule.ALL:
            return True
        return False


class Encoder1DBlock(nn.Module):
    def __init__(self, d, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x, attention_mask):
        b, n, d = x.shape
        h = self.ln1(x)
        q, k, v = self.qkv(h).view(b, n, 3, self.num_heads, d // self.num_heads).permute(2, 0, 3, 1, 4)
        # flax MultiHeadDotProductAttention(mask=...): True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)
        x = x + self.out(a.transpose(1, 2).reshape(b, n, d))
        return x + self.mlp(self.ln2(x))


class BlockTransformer(nn.Module):
    def __init__(self, transformer_kwargs):
        super().__init__()
        self.layers = nn.ModuleList(
            Encoder1DBlock(transformer_kwargs["d"], transformer_kwargs["num_attention_heads"])
            for _ in range(transformer_kwargs["num_layers"])
        )

    def forward(self, prefix_groups, timestep_groups):
        input_tokens = self.assemble_input_tokens(prefix_groups, timestep_groups)
        attention_mask = self.generate_attention_mask(prefix_groups, timestep_groups)
        x = input_tokens
        for layer in self.layers:
            x = layer(x, attention_mask)
        return x

    def assemble_input_tokens(self, prefix_groups, timestep_groups):
        all_prefix_tokens = torch.cat([g.tokens for g in prefix_groups], dim=1)
        all_timestep_tokens = torch.cat([g.tokens for g in timestep_groups], dim=2)
        all_timestep_tokens = all_timestep_tokens.flatten(1, 2)  # batch (horizon n_tokens) d
        return torch.cat([all_prefix_tokens, all_timestep_tokens], dim=1)

    def generate_attention_mask(self, prefix_groups, timestep_groups):
        def _get_position(i, tokens_per_elem):
            if FIXED:
                return np.searchsorted(np.cumsum(tokens_per_elem), i, side="right")
            return np.searchsorted(np.cumsum(tokens_per_elem), i)

        horizon = timestep_groups[0].tokens.shape[1]
        tokens_per_prefix_group = [group.tokens.shape[1] for group in prefix_groups]
        tokens_per_timestep_group = [group.tokens.shape[2] for group in timestep_groups]

        tokens_for_prefix = sum(tokens_per_prefix_group)
        tokens_per_time_step = sum(tokens_per_timestep_group)

        total_tokens = tokens_for_prefix + tokens_per_time_step * horizon
        attention_mask = np.zeros((total_tokens, total_tokens), dtype=int)

        def get_token_metadata(i):
            if i < tokens_for_prefix:
                position = _get_position(i, tokens_per_prefix_group)
                return TokenMetadata.create(prefix_groups[position], timestep=-1)
            i -= tokens_for_prefix
            timestep, i = divmod(i, tokens_per_time_step)
            position = _get_position(i, tokens_per_timestep_group)
            return TokenMetadata.create(timestep_groups[position], timestep)

        for i in range(total_tokens):  # Token attending
            for j in range(total_tokens):  # Token being attended to
                metadata_i = get_token_metadata(i)
                metadata_j = get_token_metadata(j)
                attention_mask[i, j] = int(metadata_i.should_attend_to(metadata_j))

        pad_attention_mask = self.generate_pad_attention_mask(prefix_groups, timestep_groups)
        return torch.logical_and(torch.from_numpy(attention_mask).bool(), pad_attention_mask)

    def generate_pad_attention_mask(self, prefix_groups, timestep_groups):
        batch_size, horizon = timestep_groups[0].tokens.shape[:2]
        prefix_pad_mask = torch.cat([group.mask for group in prefix_groups], dim=1)
        timestep_pad_mask = torch.cat([group.mask for group in timestep_groups], dim=2).flatten(1, 2)
        pad_mask = torch.cat([prefix_pad_mask, timestep_pad_mask], dim=1)
        n = pad_mask.shape[1]
        return pad_mask[:, None, None, :].expand(batch_size, 1, n, n)


def main():
    torch.manual_seed(0)
    batch, horizon, d = 2, 2, 32
    task_rules = {"task_*": AttentionRule.CAUSAL}
    observation_rules = {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL}
    readout_rules = {
        "task_*": AttentionRule.CAUSAL,
        "obs_*": AttentionRule.CAUSAL,
        "readout_action": AttentionRule.CAUSAL,
    }
    task_mask = torch.tensor([[True, True], [True, False]])
    prefix_groups = [PrefixGroup(torch.randn(batch, 2, d), task_mask, "task_language", task_rules)]

    def ts_group(n, name, rules):
        return TimestepGroup(torch.randn(batch, horizon, n, d), torch.ones(batch, horizon, n, dtype=torch.bool), name, rules)

    timestep_groups = [
        ts_group(3, "obs_primary", observation_rules),
        ts_group(2, "obs_wrist", observation_rules),
        ts_group(1, "readout_action", readout_rules),
    ]
    model = BlockTransformer({"d": d, "num_attention_heads": 4, "num_layers": 2}).eval()
    with torch.no_grad():
        out = model(prefix_groups, timestep_groups)
    # embeddings of the readout_action token at each timestep (what the action head reads)
    readout = out.view(batch, -1, d)[:, 2:].view(batch, horizon, 6, d)[:, :, 5]
    print("readout_action embedding norm per timestep:", readout.norm(dim=-1).flatten().tolist())


if __name__ == "__main__":
    main()
