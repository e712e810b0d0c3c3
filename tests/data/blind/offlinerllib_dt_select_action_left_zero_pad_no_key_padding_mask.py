# OfflineRL-Lib Decision Transformer (LAMDA-RL/OfflineRL-Lib commit 5663228, "fix: inconsistent padding for dt during
# training and evaluating"): DecisionTransformerPolicy.select_action left-padded short histories with zero tokens and
# passed key_padding_mask=None, so early-episode actions attended to the padding tokens.
import sys
from typing import Optional

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

Attention: nn.Module = nn.MultiheadAttention


class TransformerBlock(nn.Module):
    def __init__(self, embed_dim, seq_len, num_heads, attention_dropout=None, residual_dropout=None, backbone_dim=None):
        super().__init__()
        self.seq_len = seq_len
        if backbone_dim is None:
            backbone_dim = 4 * embed_dim
        self.attention = Attention(
            embed_dim=embed_dim, num_heads=num_heads, dropout=attention_dropout or 0.0, batch_first=True
        )
        self.ln1 = nn.LayerNorm(embed_dim)
        self.ln2 = nn.LayerNorm(embed_dim)
        self.ff = nn.Sequential(
            nn.Linear(embed_dim, backbone_dim),
            nn.GELU(),
            nn.Linear(backbone_dim, embed_dim),
            nn.Dropout(residual_dropout) if residual_dropout else nn.Identity(),
        )

    def forward(self, input, attention_mask=None, key_padding_mask=None):
        B, L, *shape = input.shape
        attention_mask = attention_mask.to(torch.bool)
        residual = input
        input = self.ln1(input)
        attn_output = self.attention(
            query=input, key=input, value=input, need_weights=False,
            attn_mask=attention_mask, key_padding_mask=key_padding_mask,
        )[0]
        residual = residual + attn_output
        residual = residual + self.ff(self.ln2(residual))
        return residual


class Transformer(nn.Module):
    def __init__(self, input_dim, embed_dim, num_layers, seq_len, num_heads, causal=False,
                 attention_dropout=None, residual_dropout=None, embed_dropout=None, position_dim=None):
        super().__init__()
        self.input_embed = nn.Linear(input_dim, embed_dim)
        position_dim = position_dim or seq_len
        self.pos_embed = nn.Embedding(position_dim, embed_dim)
        self.embed_dropout = nn.Dropout(embed_dropout) if embed_dropout else nn.Identity()
        self.out_ln = nn.LayerNorm(embed_dim)
        self.blocks = nn.ModuleList([
            TransformerBlock(embed_dim=embed_dim, seq_len=seq_len, num_heads=num_heads,
                             attention_dropout=attention_dropout, residual_dropout=residual_dropout)
            for _ in range(num_layers)
        ])
        self.causal = causal
        if causal:
            self.register_buffer("causal_mask", ~torch.tril(torch.ones([seq_len, seq_len])).to(torch.bool))
        else:
            self.register_buffer("causal_mask", torch.zeros([seq_len, seq_len]).to(torch.bool))

    def forward(self, inputs, timesteps=None, attention_mask=None, key_padding_mask=None, do_embedding=True):
        B, L, *_ = inputs.shape
        mask = self.causal_mask[:L, :L]
        if attention_mask is not None:
            mask = torch.bitwise_or(attention_mask.to(torch.bool), mask)
        if do_embedding:
            inputs = self.input_embed(inputs)
            if timesteps is not None:
                inputs = inputs + self.pos_embed(timesteps)
        inputs = self.embed_dropout(inputs)
        for i, block in enumerate(self.blocks):
            inputs = block(inputs, attention_mask=mask, key_padding_mask=key_padding_mask)
        inputs = self.out_ln(inputs)
        return inputs


class DecisionTransformer(Transformer):
    def __init__(self, obs_dim, action_dim, embed_dim, num_layers, seq_len, episode_len=1000, num_heads=4,
                 attention_dropout=None, residual_dropout=None, embed_dropout=None):
        super().__init__(
            input_dim=embed_dim, embed_dim=embed_dim, num_layers=num_layers, seq_len=3 * seq_len,
            num_heads=num_heads, causal=True, attention_dropout=attention_dropout,
            residual_dropout=residual_dropout, embed_dropout=embed_dropout,
        )
        self.pos_embed = nn.Embedding(episode_len + seq_len, embed_dim)
        self.obs_embed = nn.Linear(obs_dim, embed_dim)
        self.act_embed = nn.Linear(action_dim, embed_dim)
        self.ret_embed = nn.Linear(1, embed_dim)
        self.action_head = nn.Sequential(nn.Linear(embed_dim, action_dim), nn.Tanh())

    def forward(self, states, actions, returns_to_go, timesteps, attention_mask=None, key_padding_mask=None):
        B, L, *_ = states.shape
        time_embedding = self.pos_embed(timesteps)
        state_embedding = self.obs_embed(states) + time_embedding
        action_embedding = self.act_embed(actions) + time_embedding
        return_embedding = self.ret_embed(returns_to_go) + time_embedding
        if key_padding_mask is not None:
            key_padding_mask = torch.stack([key_padding_mask, key_padding_mask, key_padding_mask], dim=2).reshape(B, 3 * L)
        stacked_input = torch.stack([return_embedding, state_embedding, action_embedding], dim=2).reshape(
            B, 3 * L, state_embedding.shape[-1]
        )
        out = super().forward(inputs=stacked_input, timesteps=None, attention_mask=attention_mask,
                              key_padding_mask=key_padding_mask, do_embedding=False)
        out = self.action_head(out[:, 1::3])
        return out


class DecisionTransformerPolicy(nn.Module):
    def __init__(self, dt, state_dim, action_dim, seq_len, episode_len, device="cpu"):
        super().__init__()
        self.dt = dt
        self.state_dim = state_dim
        self.action_dim = action_dim
        self.seq_len = seq_len
        self.episode_len = episode_len
        self.device = device

    @torch.no_grad()
    def select_action(self, states, actions, returns_to_go, timesteps, **kwargs):
        states = torch.from_numpy(states).float().reshape(1, -1, self.state_dim)[:, -self.seq_len:]
        actions = torch.from_numpy(actions).float().reshape(1, -1, self.action_dim)[:, -self.seq_len:]
        returns_to_go = torch.from_numpy(returns_to_go).float().reshape(1, -1, 1)[:, -self.seq_len:]
        timesteps = torch.from_numpy(timesteps).reshape(1, -1)[:, -self.seq_len:]

        B, L, *_ = states.shape
        if FIXED:
            if self.seq_len > L:
                states = torch.cat([states, torch.zeros(B, self.seq_len - L, self.state_dim)], dim=1)
                actions = torch.cat([actions, torch.zeros(B, self.seq_len - L, self.action_dim)], dim=1)
                returns_to_go = torch.cat([returns_to_go, torch.zeros(B, self.seq_len - L, 1)], dim=1)
                timesteps = torch.cat([timesteps, torch.zeros(B, self.seq_len - L, dtype=torch.int64)], dim=1)
                key_padding_mask = torch.cat([torch.zeros(B, L).bool(), torch.ones(B, self.seq_len - L).bool()], dim=1)
            else:
                key_padding_mask = torch.zeros(B, L).bool()
            action_pred = self.dt(states=states, actions=actions, returns_to_go=returns_to_go,
                                  timesteps=timesteps, attention_mask=None, key_padding_mask=key_padding_mask)
            return action_pred[0, L - 1].squeeze().cpu().numpy()
        if self.seq_len > L:
            states = torch.cat([torch.zeros(B, self.seq_len - L, self.state_dim), states], dim=1)
            actions = torch.cat([torch.zeros(B, self.seq_len - L, self.action_dim), actions], dim=1)
            returns_to_go = torch.cat([torch.zeros(B, self.seq_len - L, 1), returns_to_go], dim=1)
            timesteps = torch.cat([torch.zeros(B, self.seq_len - L, dtype=torch.int64), timesteps], dim=1)
        action_pred = self.dt(
            states=states, actions=actions, returns_to_go=returns_to_go, timesteps=timesteps,
            attention_mask=None,
            key_padding_mask=None,  # we don't need to pass key_padding_mask as all the keys are valid
        )
        return action_pred[0, -1].squeeze().cpu().numpy()


def main():
    torch.manual_seed(0)
    np.random.seed(0)
    obs_dim, act_dim, seq_len, episode_len = 5, 3, 8, 50
    dt = DecisionTransformer(obs_dim, act_dim, embed_dim=32, num_layers=2, seq_len=seq_len,
                             episode_len=episode_len, num_heads=4).eval()
    policy = DecisionTransformerPolicy(dt, obs_dim, act_dim, seq_len, episode_len)

    # evaluation rollout (as in OfflineRL-Lib's eval_decision_transformer): the history grows one step at a time,
    # the action slot of the current step is zeros.
    T = 12
    obs = np.random.randn(T, obs_dim).astype(np.float32)
    acts = np.zeros((T, act_dim), dtype=np.float32)
    rtg = np.linspace(3.0, 1.0, T).astype(np.float32).reshape(T, 1)
    ts = np.arange(T).astype(np.int64)
    worst = 0.0
    for t in range(T):
        a = policy.select_action(obs[: t + 1], acts[: t + 1], rtg[: t + 1], ts[: t + 1])
        # reference: the model on the unpadded (last seq_len steps of the) history
        lo = max(0, t + 1 - seq_len)
        with torch.no_grad():
            ref = dt(torch.from_numpy(obs[lo : t + 1])[None], torch.from_numpy(acts[lo : t + 1])[None],
                     torch.from_numpy(rtg[lo : t + 1])[None], torch.from_numpy(ts[lo : t + 1])[None])[0, -1].numpy()
        worst = max(worst, float(np.abs(a - ref).max()))
        acts[t] = a
    print(f"max |select_action - unpadded-history action| over the rollout = {worst:.6f}")


if __name__ == "__main__":
    main()
