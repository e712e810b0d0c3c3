"""CORL Decision Transformer: tokens concatenated by modality under a causal mask (tinkoff-ai/CORL#3).

Citation: tinkoff-ai/CORL PR #3 "Fixing Decision Transformer underperformance", merged as commit e4f6175
(branch commit 3313f7b "fixing dt underperformance, bug in sequence concat"). Read in the upstream git history:
algorithms/dt.py before and after e4f6175 (`TransformerBlock`, `DecisionTransformer.forward`).

Bug: the model builds a GPT-style sequence meant to be interleaved in time, (R_0, s_0, a_0, R_1, s_1, a_1, ...),
and every block applies a causal `attn_mask` (`~torch.tril(...)`) to `nn.MultiheadAttention`. But the sequence
was `torch.concat([returns_emb, state_emb, act_emb], dim=1)`, i.e. (R_0..R_T, s_0..s_T, a_0..a_T). Under the
causal mask every state token then sees all returns-to-go of the window (future ones too) and every action token
sees all states; and `out[:, 1::3]`, read as "the state tokens", picks arbitrary positions. The PR says this was
the main reason for DT's poor D4RL scores.

Fix: `torch.stack([returns_emb, state_emb, act_emb], dim=1).permute(0, 2, 1, 3).reshape(B, 3 * L, E)`, the
interleaved order the causal mask was written for. (The same PR also added a key padding mask for short windows;
the pre-fix dataset always sampled full windows, so this program keeps full windows and only switches the order.)

This program: the pre-fix TrainConfig / TransformerBlock / DecisionTransformer, one training step on a batch of
full windows; the causal mask is the same in both runs, the token order it is applied to differs, so the keys
each (R, s, a) token attends differ. Prints the masked action MSE.
"""

import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TrainConfig:
    # model params
    embedding_dim: int = 32
    num_layers: int = 2
    num_heads: int = 4
    seq_len: int = 5
    episode_len: int = 50
    attention_dropout: float = 0.0
    residual_dropout: float = 0.0
    embedding_dropout: float = 0.0
    max_action: float = 1.0
    # training params
    batch_size: int = 3
    reward_scale: float = 0.001
    state_dim: int = 6
    action_dim: int = 2


class TransformerBlock(nn.Module):
    def __init__(self, seq_len, embedding_dim, num_heads, attention_dropout, residual_dropout):
        super().__init__()
        self.norm1 = nn.LayerNorm(embedding_dim)
        self.norm2 = nn.LayerNorm(embedding_dim)
        self.drop = nn.Dropout(residual_dropout)
        self.attention = nn.MultiheadAttention(embedding_dim, num_heads, attention_dropout, batch_first=True)
        self.mlp = nn.Sequential(
            nn.Linear(embedding_dim, 4 * embedding_dim),
            nn.GELU(),
            nn.Linear(4 * embedding_dim, embedding_dim),
            nn.Dropout(residual_dropout),
        )
        # True value indicates that the corresponding position is not allowed to attend
        self.register_buffer("causal_mask", ~torch.tril(torch.ones(seq_len, seq_len)).to(bool))
        self.seq_len = seq_len

    # [batch_size, seq_len, emb_dim] -> [batch_size, seq_len, emb_dim]
    def forward(self, x: torch.FloatTensor) -> torch.FloatTensor:
        causal_mask = self.causal_mask[: x.shape[1], : x.shape[1]]
        norm_x = self.norm1(x)
        attention_out = self.attention(norm_x, norm_x, norm_x, attn_mask=causal_mask, need_weights=False)[0]
        x = x + self.drop(attention_out)
        x = x + self.mlp(self.norm2(x))
        return x


class DecisionTransformer(nn.Module):
    def __init__(self, state_dim, action_dim, seq_len=10, episode_len=1000, embedding_dim=128, num_layers=4,
                 num_heads=8, attention_dropout=0.0, residual_dropout=0.0, embedding_dropout=0.0, max_action=1.0):
        super().__init__()
        self.emb_drop = nn.Dropout(embedding_dropout)
        self.emb_norm = nn.LayerNorm(embedding_dim)
        self.out_norm = nn.LayerNorm(embedding_dim)
        self.timestep_emb = nn.Embedding(episode_len, embedding_dim)
        self.state_emb = nn.Linear(state_dim, embedding_dim)
        self.action_emb = nn.Linear(action_dim, embedding_dim)
        self.return_emb = nn.Linear(1, embedding_dim)
        self.blocks = nn.Sequential(
            *[
                TransformerBlock(
                    seq_len=3 * seq_len,
                    embedding_dim=embedding_dim,
                    num_heads=num_heads,
                    attention_dropout=attention_dropout,
                    residual_dropout=residual_dropout,
                )
                for _ in range(num_layers)
            ]
        )
        self.action_head = nn.Sequential(nn.Linear(embedding_dim, action_dim), nn.Tanh())
        self.seq_len = seq_len
        self.embedding_dim = embedding_dim
        self.max_action = max_action

    def forward(
        self,
        states: torch.FloatTensor,  # [batch_size, seq_len, state_dim]
        actions: torch.FloatTensor,  # [batch_size, seq_len, action_dim]
        returns_to_go: torch.FloatTensor,  # [batch_size, seq_len, 1]
        time_steps: torch.LongTensor,  # [batch_size, seq_len]
    ) -> torch.FloatTensor:
        batch_size, seq_len = states.shape[0], states.shape[1]
        # [batch_size, seq_len, emb_dim]
        time_emb = self.timestep_emb(time_steps)
        state_emb = self.state_emb(states) + time_emb
        act_emb = self.action_emb(actions) + time_emb
        returns_emb = self.return_emb(returns_to_go) + time_emb
        # [batch_size, seq_len * 3, emb_dim], (r_0, s_0, a_0, r_1, s_1, a_1, ...)
        if FIXED:
            sequence = (
                torch.stack([returns_emb, state_emb, act_emb], dim=1)
                .permute(0, 2, 1, 3)
                .reshape(batch_size, 3 * seq_len, self.embedding_dim)
            )
        else:
            # during evaluation last action will be dummy padding (just zeros)
            sequence = torch.concat([returns_emb, state_emb, act_emb], dim=1)
        # LayerNorm and Dropout as in original implementation
        sequence = self.emb_norm(sequence)
        sequence = self.emb_drop(sequence)
        out = self.out_norm(self.blocks(sequence))
        # [batch_size, seq_len, action_dim]
        # predict actions from state embeddings
        out = self.action_head(out[:, 1::3]) * self.max_action
        return out


def main():
    torch.manual_seed(0)
    config = TrainConfig()
    model = DecisionTransformer(
        state_dim=config.state_dim,
        action_dim=config.action_dim,
        seq_len=config.seq_len,
        episode_len=config.episode_len,
        embedding_dim=config.embedding_dim,
        num_layers=config.num_layers,
        num_heads=config.num_heads,
        attention_dropout=config.attention_dropout,
        residual_dropout=config.residual_dropout,
        embedding_dropout=config.embedding_dropout,
        max_action=config.max_action,
    )
    # A batch of full windows, as the pre-fix SequenceDataset sampled them (start indices per trajectory).
    starts = torch.tensor([0, 7, 20])
    time_steps = starts[:, None] + torch.arange(config.seq_len)[None, :]
    states = torch.randn(config.batch_size, config.seq_len, config.state_dim)
    actions = torch.rand(config.batch_size, config.seq_len, config.action_dim) * 2 - 1
    rewards = torch.rand(config.batch_size, config.seq_len) * 100
    returns = rewards.flip(1).cumsum(1).flip(1)[..., None] * config.reward_scale
    model.train()
    predicted_actions = model(states, actions, returns, time_steps)
    loss = F.mse_loss(predicted_actions, actions.detach())
    print(f"action MSE: {loss.item():.6f}")


if __name__ == "__main__":
    main()
