# octo-pytorch, a PyTorch port of Octo (s1lent4gnt/octo-pytorch commit 3380db5, "better handling of batch attention
# mask"): Encoder1DBlock collapsed the BlockTransformer's (batch, 1, seq, seq) mask to attention_mask[0, 0], so every
# sample in a batch was attended with the first sample's timestep-padding mask.
import sys
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatch
from typing import Any, Dict, List, Mapping, Optional, Union

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


def find_match(pattern_dict: Dict[str, Any], name: str, default: Any) -> Any:
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
    def create(cls, group, timestep: int):
        return cls(timestep=timestep, name=group.name, attention_rules=group.attention_rules)

    def should_attend_to(self, other_metadata: "TokenMetadata") -> bool:
        attention_rule = find_match(self.attention_rules, other_metadata.name, AttentionRule.NEVER)
        if attention_rule == AttentionRule.CAUSAL:
            return other_metadata.timestep <= self.timestep
        elif attention_rule == AttentionRule.CURRENT:
            return other_metadata.timestep == self.timestep
        elif attention_rule == AttentionRule.STRICT_PAST:
            return other_metadata.timestep < self.timestep
        elif attention_rule == AttentionRule.ALL:
            return True
        elif attention_rule == AttentionRule.NEVER:
            return False
        raise ValueError(f"Invalid attention rule: {attention_rule}")


@dataclass
class PrefixGroup:
    tokens: torch.Tensor
    mask: torch.Tensor
    name: str
    attention_rules: Mapping[str, AttentionRule]


@dataclass
class TimestepGroup:
    tokens: torch.Tensor
    mask: torch.Tensor
    name: str
    attention_rules: Mapping[str, AttentionRule]


class MLPBlock(nn.Module):
    def __init__(self, mlp_dim, out_dim=None, dropout_rate=0.1):
        super().__init__()
        self.dense1 = nn.Linear(mlp_dim if out_dim is None else out_dim, mlp_dim)
        self.dropout1 = nn.Dropout(dropout_rate)
        self.dense2 = nn.Linear(mlp_dim, mlp_dim if out_dim is None else out_dim)
        self.dropout2 = nn.Dropout(dropout_rate)

    def forward(self, inputs):
        x = F.gelu(self.dense1(inputs), approximate="tanh")
        return self.dropout2(self.dense2(self.dropout1(x)))


class Encoder1DBlock(nn.Module):
    def __init__(self, mlp_dim, num_heads, d_model=768, dropout_rate=0.1, attention_dropout_rate=0.1):
        super().__init__()
        self.num_heads = num_heads
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.attention = nn.MultiheadAttention(
            embed_dim=d_model, num_heads=num_heads, dropout=attention_dropout_rate, bias=True, batch_first=True
        )
        self.mlp = MLPBlock(mlp_dim=mlp_dim, out_dim=d_model, dropout_rate=dropout_rate)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, inputs: torch.Tensor, attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.norm1(inputs)
        if FIXED:
            # Convert boolean mask to additive mask (True -> 0, False -> -inf)
            if attention_mask.dtype == torch.bool:
                attention_mask = (
                    attention_mask.float()
                    .masked_fill(~attention_mask, float("-inf"))
                    .masked_fill(attention_mask, 0.0)
                )
        else:
            # Process attention mask
            if attention_mask is not None:
                # Attention_mask comes in as (batch, 1, seq, seq)
                # PyTorch MultiheadAttention expects (batch * num_heads, seq, seq) or (seq, seq)
                # We'll use the simpler (seq, seq) format by taking the first batch
                if attention_mask.dim() == 4:
                    # Take the first batch and squeeze out the head dimension
                    attention_mask = attention_mask[0, 0]  # (seq, seq)
                # Convert boolean mask to additive mask (True -> 0, False -> -inf)
                if attention_mask.dtype == torch.bool:
                    attention_mask = (
                        attention_mask.float()
                        .masked_fill(~attention_mask, float("-inf"))
                        .masked_fill(attention_mask, 0.0)
                    )
        x, _ = self.attention(x, x, x, attn_mask=attention_mask, need_weights=False)
        x = self.dropout(x)
        x = x + inputs
        y = self.mlp(self.norm2(x))
        return x + y


class Transformer(nn.Module):
    def __init__(self, num_layers, mlp_dim, num_attention_heads, d_model=768, dropout_rate=0.1,
                 attention_dropout_rate=0.1, add_position_embedding=False):
        super().__init__()
        self.encoder_blocks = nn.ModuleList([
            Encoder1DBlock(mlp_dim=mlp_dim, num_heads=num_attention_heads, d_model=d_model,
                           dropout_rate=dropout_rate, attention_dropout_rate=attention_dropout_rate)
            for _ in range(num_layers)
        ])
        self.encoder_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x, attention_mask=None):
        for encoder_block in self.encoder_blocks:
            x = encoder_block(x, attention_mask)
        return self.encoder_norm(x)


class BlockTransformer(nn.Module):
    def __init__(self, transformer_kwargs: Dict[str, Any], enforce_causal: bool = True):
        super().__init__()
        self.transformer_kwargs = transformer_kwargs
        self.enforce_causal = enforce_causal
        self.transformer = Transformer(**transformer_kwargs)

    def forward(self, prefix_groups: List[PrefixGroup], timestep_groups: List[TimestepGroup]):
        input_tokens = self._assemble_input_tokens(prefix_groups, timestep_groups)
        attention_mask = self._generate_attention_mask(prefix_groups, timestep_groups)
        output = self.transformer(input_tokens, attention_mask)
        n_prefix = sum(g.tokens.shape[1] for g in prefix_groups)
        B, horizon = timestep_groups[0].tokens.shape[:2]
        return output[:, n_prefix:].reshape(B, horizon, -1, output.shape[-1])

    def _assemble_input_tokens(self, prefix_groups, timestep_groups):
        all_prefix_tokens = torch.cat([group.tokens for group in prefix_groups], dim=1)
        all_timestep_tokens = torch.cat([group.tokens for group in timestep_groups], dim=2)
        batch_size, horizon, n_tokens, d = all_timestep_tokens.shape
        all_timestep_tokens = all_timestep_tokens.view(batch_size, horizon * n_tokens, d)
        return torch.cat([all_prefix_tokens, all_timestep_tokens], dim=1)

    def _generate_attention_mask(self, prefix_groups, timestep_groups):
        def _get_position(i, tokens_per_elem):
            return np.searchsorted(np.cumsum(tokens_per_elem), i, side="right")

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

        for i in range(total_tokens):
            for j in range(total_tokens):
                attention_mask[i, j] = int(get_token_metadata(i).should_attend_to(get_token_metadata(j)))

        device = timestep_groups[0].tokens.device
        attention_mask = torch.from_numpy(attention_mask).bool().to(device)
        pad_attention_mask = self._generate_pad_attention_mask(prefix_groups, timestep_groups)
        batch_size = pad_attention_mask.shape[0]
        attention_mask = attention_mask.unsqueeze(0).expand(batch_size, -1, -1)  # (batch, total_tokens, total_tokens)
        if not FIXED:
            attention_mask = attention_mask.unsqueeze(1)  # (batch, 1, total_tokens, total_tokens)
        attention_mask = attention_mask & pad_attention_mask
        if FIXED:
            num_attention_heads = self.transformer_kwargs["num_attention_heads"]
            attention_mask = attention_mask.unsqueeze(1).expand(batch_size, num_attention_heads, total_tokens, total_tokens)
            # 3380db5 wrote .view(); the follow-up f4b313d changed it to .reshape() (view fails for batch > 1)
            attention_mask = attention_mask.reshape(batch_size * num_attention_heads, total_tokens, total_tokens)
        return attention_mask

    def _generate_pad_attention_mask(self, prefix_groups, timestep_groups):
        batch_size = timestep_groups[0].tokens.shape[0]
        prefix_pad_mask = torch.cat([group.mask for group in prefix_groups], dim=1)
        timestep_pad_mask = torch.cat([group.mask for group in timestep_groups], dim=2)
        batch_size, horizon, n_tokens = timestep_pad_mask.shape[:3]
        timestep_pad_mask = timestep_pad_mask.reshape(batch_size, -1)
        pad_mask = torch.cat([prefix_pad_mask, timestep_pad_mask], dim=1)
        total_tokens = pad_mask.shape[1]
        if FIXED:
            pad_mask = pad_mask.unsqueeze(1)  # (batch, 1, total_tokens)
            pad_mask = pad_mask.expand(batch_size, total_tokens, total_tokens)
        else:
            pad_mask = pad_mask.unsqueeze(1).unsqueeze(2)  # (batch, 1, 1, total_tokens)
            pad_mask = pad_mask.expand(batch_size, 1, total_tokens, total_tokens)
        return pad_mask


class OctoTransformer(nn.Module):
    """Trimmed OctoTransformer: task prefix tokens, proprio obs tokens, one readout_action token per timestep."""

    def __init__(self, d=32, heads=4, horizon=2, n_task=3, n_obs=2, state_dim=6):
        super().__init__()
        self.n_obs = n_obs
        self.task_proj = nn.Linear(8, d)
        self.obs_proj = nn.Linear(state_dim, n_obs * d)
        self.task_pos = nn.Parameter(torch.randn(1, n_task, d) * 0.02)
        self.obs_pos = nn.Parameter(torch.randn(1, horizon, n_obs, d) * 0.02)
        self.readout_pos = nn.Parameter(torch.randn(1, horizon, 1, d) * 0.02)
        self.transformer = BlockTransformer(dict(num_layers=2, mlp_dim=64, num_attention_heads=heads, d_model=d))

    def forward(self, observations, tasks, timestep_pad_mask):
        B, horizon = timestep_pad_mask.shape
        task_tokens = self.task_proj(tasks["language"]) + self.task_pos
        prefix = [PrefixGroup(task_tokens, torch.ones(B, task_tokens.shape[1], dtype=torch.bool), "task_language",
                              {"task_*": AttentionRule.CAUSAL})]
        obs_tokens = self.obs_proj(observations["proprio"]).view(B, horizon, self.n_obs, -1) + self.obs_pos
        obs_pad_mask = torch.logical_and(timestep_pad_mask[:, :, None], torch.ones(B, horizon, self.n_obs, dtype=torch.bool))
        readout = torch.zeros(B, horizon, 1, obs_tokens.shape[-1]) + self.readout_pos
        timestep = [
            TimestepGroup(obs_tokens, obs_pad_mask, "obs_proprio",
                          {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL}),
            TimestepGroup(readout, torch.ones(B, horizon, 1, dtype=torch.bool), "readout_action",
                          {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL,
                           "readout_action": AttentionRule.CAUSAL}),
        ]
        out = self.transformer(prefix, timestep)
        return out[:, :, self.n_obs]  # readout_action embeddings (B, horizon, d)


def main():
    torch.manual_seed(0)
    model = OctoTransformer().eval()
    B, horizon = 3, 2
    observations = {"proprio": torch.randn(B, horizon, 6)}
    tasks = {"language": torch.randn(B, 3, 8)}
    # sample 0 is mid-episode (full window); samples 1 and 2 are at the first step of their episode, so the
    # first timestep of the window is padding.
    timestep_pad_mask = torch.tensor([[True, True], [False, True], [False, True]])
    with torch.no_grad():
        batched = model(observations, tasks, timestep_pad_mask)
        worst = 0.0
        for b in range(B):
            alone = model({"proprio": observations["proprio"][b : b + 1]}, {"language": tasks["language"][b : b + 1]},
                          timestep_pad_mask[b : b + 1])
            worst = max(worst, (batched[b, -1] - alone[0, -1]).abs().max().item())
    print(f"max |readout_action(batched) - readout_action(each sample alone)| = {worst:.6f}")


if __name__ == "__main__":
    main()
