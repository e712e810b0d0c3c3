"""robomimic BC-Transformer: `algo.transformer.causal = False` never reaches the attention mask.

Citation: ARISE-Initiative/robomimic#196 ("Question about causal masking in BC_transformer"; the maintainer:
"the causal config flag isn't reflected in the policy codebase at all"), fixed by commit 4e69381 ("Configure
transformer causality variable", robocasa branch). Read before and after: robomimic/models/base_nets.py
(`transformer_args_from_config`), robomimic/models/obs_nets.py (`MIMO_Transformer`), robomimic/models/policy_nets.py
(`TransformerActorNetwork`), robomimic/models/transformers.py (`CausalSelfAttention` -> `SelfAttention`,
`SelfAttentionBlock`, `GPT_Backbone`), robomimic/algo/bc.py (`BC_Transformer`), robomimic/config/bc_config.py.

Bug: with `pred_future_acs` the policy reads o_{t-h+1..t} and is supervised on a_t..a_{t+h-1}; `get_action` returns
output[:, 0] (the token of the OLDEST frame) as a_t. The config template sets `transformer.causal = False` for this,
but `transformer_args_from_config` dropped the key and `CausalSelfAttention` always registered a lower-triangular
mask, so the first token only ever saw the oldest observation frame.

Fix: `transformer_args_from_config` reads `causal`, it is threaded through MIMO_Transformer / GPT_Backbone /
SelfAttentionBlock, and `SelfAttention` fills the mask with ones when `causal is False`.
"""

import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Config(dict):
    __getattr__ = dict.__getitem__


# bc_transformer.json template (frame_stack == context_length), trimmed
transformer_config = Config(enabled=True, context_length=4, embed_dim=32, num_layers=2, num_heads=4,
                            emb_dropout=0.1, attn_dropout=0.1, block_output_dropout=0.1,
                            supervise_all_steps=True, pred_future_acs=True, causal=False)


def transformer_args_from_config(transformer_config):
    transformer_args = dict(
        transformer_context_length=transformer_config.context_length,
        transformer_embed_dim=transformer_config.embed_dim,
        transformer_num_heads=transformer_config.num_heads,
        transformer_emb_dropout=transformer_config.emb_dropout,
        transformer_attn_dropout=transformer_config.attn_dropout,
        transformer_block_output_dropout=transformer_config.block_output_dropout,
    )
    if "num_layers" in transformer_config:
        transformer_args["transformer_num_layers"] = transformer_config.num_layers
    if FIXED and "causal" in transformer_config:
        transformer_args["transformer_causal"] = transformer_config.causal
    return transformer_args


class SelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, context_length, causal=True, attn_dropout=0.1, output_dropout=0.1):
        super().__init__()
        self.embed_dim, self.num_heads, self.context_length = embed_dim, num_heads, context_length
        self.nets = nn.ModuleDict()
        self.nets["qkv"] = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.nets["attn_dropout"] = nn.Dropout(attn_dropout)
        self.nets["output_dropout"] = nn.Dropout(output_dropout)
        self.nets["output"] = nn.Linear(embed_dim, embed_dim)
        # causal mask (ensures attention is only over previous inputs) - just a lower triangular matrix of 1s
        mask = torch.tril(torch.ones(context_length, context_length)).view(1, 1, context_length, context_length)
        if FIXED and causal is False:
            mask[:] = 1
        self.register_buffer("mask", mask)

    def forward(self, x):
        B, T, D = x.shape
        NH = self.num_heads
        DH = D // NH
        q, k, v = torch.chunk(self.nets["qkv"](x), 3, dim=-1)
        k = k.view(B, T, NH, DH).transpose(1, 2)
        q = q.view(B, T, NH, DH).transpose(1, 2)
        v = v.view(B, T, NH, DH).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[..., :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.nets["attn_dropout"](att)
        y = (att @ v).transpose(1, 2).contiguous().view(B, T, D)
        return self.nets["output_dropout"](self.nets["output"](y))


class SelfAttentionBlock(nn.Module):
    def __init__(self, embed_dim, num_heads, context_length, causal=True, attn_dropout=0.1, output_dropout=0.1):
        super().__init__()
        self.nets = nn.ModuleDict()
        self.nets["attention"] = SelfAttention(embed_dim, num_heads, context_length, causal=causal,
                                               attn_dropout=attn_dropout, output_dropout=output_dropout)
        self.nets["mlp"] = nn.Sequential(nn.Linear(embed_dim, 4 * embed_dim), nn.GELU(),
                                         nn.Linear(4 * embed_dim, embed_dim), nn.Dropout(output_dropout))
        self.nets["ln1"] = nn.LayerNorm(embed_dim)
        self.nets["ln2"] = nn.LayerNorm(embed_dim)

    def forward(self, x):
        x = x + self.nets["attention"](self.nets["ln1"](x))
        return x + self.nets["mlp"](self.nets["ln2"](x))


class GPT_Backbone(nn.Module):
    def __init__(self, embed_dim, context_length, causal=True, attn_dropout=0.1, block_output_dropout=0.1,
                 num_layers=6, num_heads=8):
        super().__init__()
        self.embed_dim, self.context_length = embed_dim, context_length
        self.nets = nn.ModuleDict()
        self.nets["transformer"] = nn.Sequential(*[
            SelfAttentionBlock(embed_dim, num_heads, context_length, causal=causal, attn_dropout=attn_dropout,
                               output_dropout=block_output_dropout) for _ in range(num_layers)])
        self.nets["output_ln"] = nn.LayerNorm(embed_dim)

    def forward(self, inputs):
        assert inputs.shape[1:] == (self.context_length, self.embed_dim), inputs.shape
        return self.nets["output_ln"](self.nets["transformer"](inputs))


class TransformerActorNetwork(nn.Module):
    """MIMO_Transformer trimmed to low-dim observation encoders and a tanh action decoder."""

    def __init__(self, obs_shapes, ac_dim, transformer_embed_dim, transformer_num_layers, transformer_num_heads,
                 transformer_context_length, transformer_causal=True, transformer_emb_dropout=0.1,
                 transformer_attn_dropout=0.1, transformer_block_output_dropout=0.1):
        super().__init__()
        self.obs_shapes = obs_shapes
        obs_dim = sum(s[0] for s in obs_shapes.values())
        self.nets = nn.ModuleDict()
        self.nets["embed_encoder"] = nn.Linear(obs_dim, transformer_embed_dim)
        self.nets["embed_ln"] = nn.LayerNorm(transformer_embed_dim)
        self.nets["embed_drop"] = nn.Dropout(transformer_emb_dropout)
        self.nets["transformer"] = GPT_Backbone(
            embed_dim=transformer_embed_dim, num_layers=transformer_num_layers, num_heads=transformer_num_heads,
            context_length=transformer_context_length, causal=transformer_causal,
            attn_dropout=transformer_attn_dropout, block_output_dropout=transformer_block_output_dropout)
        self.nets["decoder"] = nn.Linear(transformer_embed_dim, ac_dim)
        self.params = nn.ParameterDict()
        self.params["embed_timestep"] = nn.Parameter(torch.zeros(1, transformer_context_length, transformer_embed_dim))
        nn.init.normal_(self.params["embed_timestep"], std=0.02)

    def forward(self, obs_dict, actions=None, goal_dict=None):
        inputs = torch.cat([obs_dict[k] for k in self.obs_shapes], dim=-1)  # [B, T, D_obs]
        embeddings = self.nets["embed_encoder"](inputs) + self.params["embed_timestep"]
        embeddings = self.nets["embed_drop"](self.nets["embed_ln"](embeddings))
        transformer_outputs = self.nets["transformer"](embeddings)
        return torch.tanh(self.nets["decoder"](transformer_outputs))


class BC_Transformer:
    def __init__(self, algo_config, obs_shapes, ac_dim):
        self.algo_config = algo_config
        self.nets = nn.ModuleDict()
        self.nets["policy"] = TransformerActorNetwork(
            obs_shapes=obs_shapes, ac_dim=ac_dim, **transformer_args_from_config(algo_config.transformer))
        self.context_length = algo_config.transformer.context_length
        self.supervise_all_steps = algo_config.transformer.supervise_all_steps
        self.pred_future_acs = algo_config.transformer.pred_future_acs

    def process_batch_for_training(self, batch):
        h = self.context_length
        input_batch = {"obs": {k: batch["obs"][k][:, :h, :] for k in batch["obs"]}, "goal_obs": None}
        ac_start = h - 1 if self.pred_future_acs else 0
        input_batch["actions"] = batch["actions"][:, ac_start:ac_start + h, :]
        return input_batch

    def compute_loss(self, batch):
        predictions = self.nets["policy"](obs_dict=batch["obs"], actions=None, goal_dict=batch["goal_obs"])
        return F.mse_loss(predictions, batch["actions"])

    def get_action(self, obs_dict, goal_dict=None):
        assert not self.nets.training
        output = self.nets["policy"](obs_dict, actions=None, goal_dict=goal_dict)
        if self.supervise_all_steps and self.algo_config.transformer.pred_future_acs:
            return output[:, 0, :]
        return output[:, -1, :]


def main():
    obs_shapes = {"robot0_eef_pos": (3,), "object": (5,)}
    algo = BC_Transformer(Config(transformer=transformer_config), obs_shapes, ac_dim=2)
    algo.nets.eval()
    h = transformer_config.context_length
    # SequenceDataset with frame_stack = h and seq_length = h: obs window o_{t-h+1..t}, actions a_{t-h+1..t+h-1}
    batch = {"obs": {k: torch.randn(2, 2 * h - 1, s[0]) for k, s in obs_shapes.items()},
             "actions": torch.tanh(torch.randn(2, 2 * h - 1, 2))}
    with torch.no_grad():
        loss = algo.compute_loss(algo.process_batch_for_training(batch))
        obs_window = {k: v[:, :h] for k, v in batch["obs"].items()}
        action = algo.get_action(obs_window)
    print("train loss", loss.item())
    print("a_t", action.tolist())


if __name__ == "__main__":
    main()
