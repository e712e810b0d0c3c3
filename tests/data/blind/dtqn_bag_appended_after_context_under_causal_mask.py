# kevslinger/DTQN commit 984df35 ("Flip transformer input so bag comes before context (for masked attention
# purposes)"), dtqn/networks/dtqn.py DTQN.forward.
# DTQN keeps a "bag" of observations that fell out of the agent's context window and feeds them to the transformer
# beside the context. Before the fix the bag embeddings were concatenated AFTER the history tokens, while every
# TransformerLayer applies its causal attn_mask (triu(-inf), sized history_len + bag_size + 1) to the whole
# sequence: no history token can attend to a bag slot, which sits at a later position, so the Q-values read back
# from ffn(x)[:, :history_len] never depend on the bag. Fix: concatenate (bag, history) and read the Q-values from
# ffn(x)[:, -history_len:], so the causal mask lets every history step see the whole bag.
# (Continuous observations, res gates, post-LN TransformerLayer over nn.MultiheadAttention, learned positions.)
import sys
from typing import Optional, Union

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class EmbeddingRepresentation(nn.Module):
    def __init__(self, embedding: nn.Module):
        super().__init__()
        self.embedding = embedding

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embedding(x)

    @staticmethod
    def make_continuous_representation(obs_dim: int, outer_embed_size: int):
        embedding = nn.Linear(obs_dim, outer_embed_size)
        return EmbeddingRepresentation(embedding=embedding)


class ResGate(nn.Module):
    """Residual skip connection"""

    def __init__(self, **kwargs):
        super().__init__()

    def forward(self, x, y):
        return x + y


class TransformerLayer(nn.Module):
    def __init__(
        self,
        num_heads: int,
        embed_size: int,
        history_len: int,
        dropout: float,
        attn_gate,
        mlp_gate,
    ):
        super().__init__()
        self.layernorm1 = nn.LayerNorm(embed_size)
        self.layernorm2 = nn.LayerNorm(embed_size)

        self.attention = nn.MultiheadAttention(
            embed_dim=embed_size,
            num_heads=num_heads,
            dropout=dropout,
            batch_first=True,
        )
        self.ffn = nn.Sequential(
            nn.Linear(embed_size, 4 * embed_size),
            nn.ReLU(),
            nn.Linear(4 * embed_size, embed_size),
            nn.Dropout(dropout),
        )
        self.attn_gate = attn_gate
        self.mlp_gate = mlp_gate
        # Just storage for attention weights for visualization
        self.alpha = None

        # Set up causal masking for attention
        self.attn_mask = nn.Parameter(
            torch.triu(torch.ones(history_len, history_len), diagonal=1),
            requires_grad=False,
        )
        self.attn_mask[self.attn_mask.bool()] = -float("inf")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention, self.alpha = self.attention(
            x,
            x,
            x,
            attn_mask=self.attn_mask[: x.size(1), : x.size(1)],
            average_attn_weights=True,
        )
        # Skip connection then LayerNorm
        x = self.attn_gate(x, F.relu(attention))
        x = self.layernorm1(x)
        ffn = self.ffn(x)
        # Skip connection then LayerNorm
        x = self.mlp_gate(x, F.relu(ffn))
        x = self.layernorm2(x)
        return x


class DTQN(nn.Module):
    def __init__(
        self,
        obs_dim: int,
        num_actions: int,
        embed_per_obs_dim: int,
        inner_embed_size: int,
        num_heads: int,
        num_layers: int,
        history_len: int,
        dropout: float = 0.0,
        gate: str = "res",
        identity: bool = False,
        pos: Union[str, int] = 1,
        discrete: bool = False,
        vocab_sizes: Optional[Union[np.ndarray, int]] = None,
        bag_size: int = 0,
        **kwargs,
    ):
        super().__init__()
        self.obs_dim = obs_dim
        self.discrete = discrete
        self.obs_embedding = EmbeddingRepresentation.make_continuous_representation(
            obs_dim=obs_dim, outer_embed_size=inner_embed_size
        )
        pos = int(pos)
        self.position_embedding = nn.Parameter(
            torch.zeros(1, history_len, inner_embed_size),
            requires_grad=False if pos == 0 else True,
        )
        self.bag_embed = nn.Parameter(
            torch.zeros(1, 1, inner_embed_size),
            requires_grad=True if bag_size > 0 else False,
        )
        self.dropout = nn.Dropout(dropout)

        attn_gate = ResGate()
        mlp_gate = ResGate()
        transformer_block = TransformerLayer
        self.transformer_layers = nn.Sequential(
            *[
                transformer_block(
                    num_heads,
                    inner_embed_size,
                    history_len + bag_size + 1,  # Need +1 for the bag eviction policy
                    dropout,
                    attn_gate,
                    mlp_gate,
                )
                for _ in range(num_layers)
            ]
        )

        self.layernorm = nn.LayerNorm(inner_embed_size)
        self.ffn = nn.Sequential(
            nn.Linear(inner_embed_size, inner_embed_size),
            nn.ReLU(),
            nn.Linear(inner_embed_size, num_actions),
        )

        self.history_len = history_len
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.data.normal_(mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                module.bias.data.zero_()
        elif isinstance(module, nn.MultiheadAttention):
            module.in_proj_weight.data.normal_(mean=0.0, std=0.02)
            module.out_proj.weight.data.normal_(mean=0.0, std=0.02)
            module.in_proj_bias.data.zero_()
        elif isinstance(module, nn.LayerNorm):
            module.bias.data.zero_()
            module.weight.data.fill_(1.0)

    def forward(
        self, obss: torch.Tensor, bag: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        history_len = obss.size(1)
        obs_dim = obss.size()[2:] if len(obss.size()) > 3 else obss.size(2)
        assert (
            history_len <= self.history_len
        ), "Cannot forward, history is longer than expected."
        assert (
            obs_dim == self.obs_dim
        ), f"Obs dim is incorrect. Expected {self.obs_dim} got {obs_dim}"

        token_embeddings = self.obs_embedding(obss)
        # batch_size x hist_len x obs_dim
        x = token_embeddings + self.position_embedding[:, :history_len, :]
        if bag is not None:
            bag_embeddings = self.obs_embedding(bag)
            if FIXED:
                parts = (bag_embeddings + self.bag_embed, x)
            else:
                parts = (x, bag_embeddings + self.bag_embed)
            x = self.dropout(torch.cat(parts, dim=1))
        else:
            x = self.dropout(x)
        # Send through transformer
        x = self.transformer_layers(x)
        # Norm and run through a linear layer to get to action space
        x = self.layernorm(x)
        if FIXED:
            return self.ffn(x)[:, -history_len:, :]
        return self.ffn(x)[:, :history_len, :]


class Bag:
    """Stores important observations that would have fallen out of the agent's context"""

    def __init__(self, bag_size: int, obs_mask: Union[int, float], obs_length: int):
        self.bag_size = bag_size
        self.obs_mask = obs_mask
        self.obs_length = obs_length
        self.pos = 0
        self.bag = self.make_empty_bag()

    def reset(self) -> None:
        self.pos = 0
        self.bag = self.make_empty_bag()

    def add(self, obs) -> bool:
        if self.pos < self.bag_size:
            self.bag[self.pos] = obs
            self.pos += 1
            return True
        return False

    def make_empty_bag(self) -> np.ndarray:
        return np.full((self.bag_size, self.obs_length), self.obs_mask, dtype=np.float32)


class Context:
    """The last context_len observations the agent has seen (a sliding window)"""

    def __init__(self, context_len: int, obs_mask: Union[int, float], obs_length: int):
        self.max_length = context_len
        self.obs_mask = obs_mask
        self.obs = np.full((context_len, obs_length), obs_mask, dtype=np.float32)
        self.timestep = 0

    def reset(self, obs):
        self.obs[:] = self.obs_mask
        self.obs[0] = obs
        self.timestep = 0

    def add_transition(self, obs):
        self.timestep += 1
        evicted = None
        if self.timestep >= self.max_length:
            evicted = self.obs[0].copy()
            self.obs = np.roll(self.obs, -1, axis=0)
            self.timestep = self.max_length - 1
        self.obs[self.timestep] = obs
        return evicted


def main():
    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    obs_dim, num_actions, context_len, bag_size = 6, 4, 5, 3
    net = DTQN(
        obs_dim=obs_dim,
        num_actions=num_actions,
        embed_per_obs_dim=0,
        inner_embed_size=32,
        num_heads=4,
        num_layers=2,
        history_len=context_len,
        bag_size=bag_size,
    ).eval()
    # the checkpoint is untrained here: give the layers some scale
    with torch.no_grad():
        for p in net.parameters():
            if p.dim() > 1 and p.requires_grad:
                p.normal_(0.0, 0.3)
        net.position_embedding.normal_(0.0, 0.3)
        net.bag_embed.normal_(0.0, 0.3)

    context = Context(context_len, 0.0, obs_dim)
    bag = Bag(bag_size, 0.0, obs_dim)
    episode = rng.normal(size=(9, obs_dim)).astype(np.float32)
    context.reset(episode[0])
    for obs in episode[1:]:
        evicted = context.add_transition(obs)
        if evicted is not None:
            bag.add(evicted)  # keep the first evicted observations while the bag has room

    # DtqnAgent.get_action
    with torch.no_grad():
        context_tensor = torch.as_tensor(
            context.obs[: min(context.max_length, context.timestep + 1)]
        ).unsqueeze(0)
        q_values = net(context_tensor, torch.as_tensor(bag.bag).unsqueeze(0))
    action = torch.argmax(q_values[:, -1, :]).item()
    print("q_values[-1]:", [round(v, 4) for v in q_values[0, -1].tolist()])
    print("action:", action)

    # DtqnAgent.train: Q(s, a) over sampled histories with their bags
    obss = torch.as_tensor(rng.normal(size=(4, context_len, obs_dim)).astype(np.float32))
    bags = torch.as_tensor(rng.normal(size=(4, bag_size, obs_dim)).astype(np.float32))
    actions = torch.as_tensor(rng.integers(num_actions, size=(4, context_len, 1)))
    rewards = torch.as_tensor(rng.normal(size=(4, context_len)).astype(np.float32))
    with torch.no_grad():
        q = net(obss, bags).gather(2, actions).squeeze()
    loss = F.mse_loss(q, rewards)
    print("loss:", round(loss.item(), 6))


if __name__ == "__main__":
    main()
