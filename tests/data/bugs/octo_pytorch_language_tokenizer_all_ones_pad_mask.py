# s1lent4gnt/octo-pytorch commit b2fd085 ("nit match jax pad_mask")
# LanguageTokenizer returned an all-ones pad mask, so samples whose pad_mask_dict marks the language
# instruction as absent still had readout/obs tokens attend to the (meaningless) task_language tokens.
import sys
from dataclasses import dataclass
from enum import Enum
from fnmatch import fnmatch
from typing import Any, Dict, List, Mapping

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


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
    timestep: int
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
        return False


@dataclass
class TokenGroup:
    tokens: torch.Tensor
    mask: torch.Tensor


@dataclass
class PrefixGroup(TokenGroup):
    name: str
    attention_rules: Mapping[str, AttentionRule]


@dataclass
class TimestepGroup(TokenGroup):
    name: str
    attention_rules: Mapping[str, AttentionRule]


def generate_proper_pad_mask(tokens, pad_mask_dict, keys):
    if pad_mask_dict is None:
        return torch.ones(tokens.shape[:-1], dtype=torch.bool, device=tokens.device)
    if not all([key in pad_mask_dict for key in keys]):
        return torch.ones(tokens.shape[:-1], dtype=torch.bool, device=tokens.device)
    pad_mask = torch.stack([pad_mask_dict[key] for key in keys], dim=-1)
    pad_mask = torch.any(pad_mask, dim=-1)
    pad_mask = pad_mask.unsqueeze(-1).expand(tokens.shape[:-1])
    return pad_mask


class Encoder1DBlock(nn.Module):
    def __init__(self, mlp_dim, num_heads, d_model):
        super().__init__()
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.attention = nn.MultiheadAttention(embed_dim=d_model, num_heads=num_heads, dropout=0.0, bias=True, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d_model, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, d_model))

    def forward(self, inputs, attention_mask=None):
        x = self.norm1(inputs)
        if attention_mask.dtype == torch.bool:
            attention_mask = (
                attention_mask.float()
                .masked_fill(~attention_mask, float("-inf"))
                .masked_fill(attention_mask, 0.0)
            )
        x, _ = self.attention(x, x, x, attn_mask=attention_mask, need_weights=False)
        x = x + inputs
        y = self.mlp(self.norm2(x))
        return x + y


class Transformer(nn.Module):
    def __init__(self, num_layers, mlp_dim, num_attention_heads, d_model):
        super().__init__()
        self.encoder_blocks = nn.ModuleList(
            [Encoder1DBlock(mlp_dim, num_attention_heads, d_model) for _ in range(num_layers)]
        )
        self.encoder_norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, x, attention_mask=None):
        for encoder_block in self.encoder_blocks:
            x = encoder_block(x, attention_mask)
        return self.encoder_norm(x)


class BlockTransformer(nn.Module):
    def __init__(self, transformer_kwargs):
        super().__init__()
        self.transformer_kwargs = transformer_kwargs
        self.transformer = Transformer(**transformer_kwargs)

    def forward(self, prefix_groups: List[PrefixGroup], timestep_groups: List[TimestepGroup]):
        horizon = timestep_groups[0].tokens.shape[1]
        prefix = torch.cat([g.tokens for g in prefix_groups], dim=1)
        ts = torch.cat([g.tokens for g in timestep_groups], dim=2)
        b, h, n, d = ts.shape
        input_tokens = torch.cat([prefix, ts.reshape(b, h * n, d)], dim=1)
        attention_mask = self._generate_attention_mask(prefix_groups, timestep_groups)
        output = self.transformer(input_tokens, attention_mask)
        n_prefix = prefix.shape[1]
        ts_out = output[:, n_prefix:].reshape(b, h, n, d)
        splits = torch.split(ts_out, [g.tokens.shape[2] for g in timestep_groups], dim=2)
        return {g.name: s for g, s in zip(timestep_groups, splits)}

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

        attention_mask = torch.from_numpy(attention_mask).bool()
        pad_attention_mask = self._generate_pad_attention_mask(prefix_groups, timestep_groups)
        batch_size = pad_attention_mask.shape[0]
        attention_mask = attention_mask.unsqueeze(0).expand(batch_size, -1, -1)
        attention_mask = attention_mask & pad_attention_mask
        num_attention_heads = self.transformer_kwargs["num_attention_heads"]
        attention_mask = attention_mask.unsqueeze(1).expand(batch_size, num_attention_heads, total_tokens, total_tokens)
        return attention_mask.reshape(batch_size * num_attention_heads, total_tokens, total_tokens)

    def _generate_pad_attention_mask(self, prefix_groups, timestep_groups):
        prefix_pad_mask = torch.cat([group.mask for group in prefix_groups], dim=1)
        timestep_pad_mask = torch.cat([group.mask for group in timestep_groups], dim=2)
        batch_size = timestep_pad_mask.shape[0]
        timestep_pad_mask = timestep_pad_mask.reshape(batch_size, -1)
        pad_mask = torch.cat([prefix_pad_mask, timestep_pad_mask], dim=1)
        total_tokens = pad_mask.shape[1]
        return pad_mask.unsqueeze(1).expand(batch_size, total_tokens, total_tokens)


class LanguageTokenizer(nn.Module):
    """T5 encoder replaced by a tiny random stand-in (no pretrained download)."""

    def __init__(self, d=32, vocab=100, proper_pad_mask=FIXED):
        super().__init__()
        self.proper_pad_mask = proper_pad_mask
        self.t5_encoder = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, d))

    def forward(self, language_input, tasks=None):
        tokens = self.t5_encoder(language_input["input_ids"])
        if self.proper_pad_mask:   # after the fix
            pad_mask = generate_proper_pad_mask(tokens, tasks.get("pad_mask_dict", None), ("language_instruction",))
        else:                      # before the fix: "All true attention mask, simple torch.ones"
            pad_mask = torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device)
        return TokenGroup(tokens, pad_mask)


class OctoModel(nn.Module):
    def __init__(self, d=32, obs_dim=12, n_obs_tokens=2, horizon=2, n_lang=5):
        super().__init__()
        self.d = d
        self.n_obs_tokens = n_obs_tokens
        self.language_tokenizer = LanguageTokenizer(d)
        self.task_language_projection = nn.Linear(d, d)
        self.task_language_pos_embedding = nn.Parameter(torch.randn(1, n_lang, d) * 0.02)
        self.obs_primary_projection = nn.Linear(obs_dim, d * n_obs_tokens)
        self.obs_primary_pos_embedding = nn.Parameter(torch.randn(1, horizon, n_obs_tokens, d) * 0.02)
        self.readout_embedding = nn.Parameter(torch.randn(1, horizon, 1, d) * 0.02)
        self.transformer = BlockTransformer(dict(num_layers=2, mlp_dim=64, num_attention_heads=2, d_model=d))
        self.action_head = nn.Linear(d, 4)

    def forward(self, observations, tasks, timestep_pad_mask):
        batch_size, horizon = timestep_pad_mask.shape
        task_attention_rules = {"task_*": AttentionRule.CAUSAL}
        obs_attention_rules = {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL}

        token_group = self.language_tokenizer(tasks["language_instruction"], tasks)
        projected = self.task_language_projection(token_group.tokens)
        processed = projected + self.task_language_pos_embedding[:, : projected.shape[1]]
        prefix_groups = [PrefixGroup(tokens=processed, mask=token_group.mask, name="task_language_instruction",
                                     attention_rules=task_attention_rules)]

        obs = self.obs_primary_projection(observations["image_primary"]).view(batch_size, horizon, self.n_obs_tokens, self.d)
        obs = obs + self.obs_primary_pos_embedding[:, :horizon]
        obs_mask = torch.logical_and(timestep_pad_mask.unsqueeze(-1),
                                     torch.ones(batch_size, horizon, self.n_obs_tokens, dtype=torch.bool))
        timestep_groups = [TimestepGroup(tokens=obs, mask=obs_mask, name="obs_image_primary",
                                         attention_rules=obs_attention_rules)]

        readout_tokens = torch.zeros((batch_size, horizon, 1, self.d)) + self.readout_embedding[:, :horizon]
        readout_mask = torch.ones((batch_size, horizon, 1), dtype=torch.bool)
        readout_attention_rules = {"task_*": AttentionRule.CAUSAL, "obs_*": AttentionRule.CAUSAL,
                                   "readout_action": AttentionRule.CAUSAL}
        timestep_groups.append(TimestepGroup(tokens=readout_tokens, mask=readout_mask, name="readout_action",
                                             attention_rules=readout_attention_rules))

        outputs = self.transformer(prefix_groups, timestep_groups)
        return self.action_head(outputs["readout_action"][:, :, 0])


model = OctoModel().eval()
B, H, L = 2, 2, 5
observations = {"image_primary": torch.randn(B, H, 12)}
timestep_pad_mask = torch.ones(B, H, dtype=torch.bool)
input_ids = torch.randint(0, 100, (B, L))
pad_mask_dict = {"language_instruction": torch.tensor([True, False])}  # sample 1 has no language instruction

def run(ids):
    tasks = {"language_instruction": {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
             "pad_mask_dict": pad_mask_dict}
    with torch.no_grad():
        return model(observations, tasks, timestep_pad_mask)

a = run(input_ids)
ids2 = input_ids.clone()
ids2[1] = torch.randint(0, 100, (L,))   # different (absent) instruction tokens for sample 1
b = run(ids2)
diff = (a[1] - b[1]).abs().max().item()
print(f"max |readout actions change for sample without language when its language tokens change| = {diff:.6e}")
