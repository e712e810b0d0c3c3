# Follows octo-models/octo octo/model/components/block_transformer.py (TokenMetadata.should_attend_to, generate_attention_mask,
# generate_pad_attention_mask) with the rules of octo_transformer.py: task prefix (timestep -1), obs and readout groups per timestep;
# nothing attends to readouts but readouts; key-side padding for padded language tokens and the padded first history step (True = attend).
import math
from enum import Enum
from fnmatch import fnmatch

import numpy as np
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
D, NH, horizon = 32, 4, 3


class AttentionRule(Enum):
    NEVER = "never"
    CAUSAL = "other.timestep <= self.timestep"
    CURRENT = "other.timestep == self.timestep"
    STRICT_PAST = "other.timestep < self.timestep"
    ALL = "all"


def find_match(pattern_dict, name, default):
    matches = [v for k, v in pattern_dict.items() if fnmatch(name, k)]
    return matches[0] if matches else default


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


C = AttentionRule.CAUSAL
prefix_groups = [dict(name="task_language", n=3, rules={"task_*": C})]
timestep_groups = [
    dict(name="obs_primary", n=2, rules={"task_*": C, "obs_*": C}),
    dict(name="readout_action", n=1, rules={"task_*": C, "obs_*": C, "readout_action": C}),
]


def token_metadata():
    metas = []
    for g in prefix_groups:
        metas += [TokenMetadata(g["name"], -1, g["rules"])] * g["n"]
    for t in range(horizon):
        for g in timestep_groups:
            metas += [TokenMetadata(g["name"], t, g["rules"])] * g["n"]
    return metas


def generate_attention_mask(prefix_masks, timestep_masks):
    metas = token_metadata()
    n = len(metas)
    attention_mask = np.zeros((n, n), dtype=int)
    for i in range(n):
        for j in range(n):
            attention_mask[i, j] = int(metas[i].should_attend_to(metas[j]))
    prefix_pad = torch.cat(prefix_masks, dim=1)
    ts_pad = torch.cat(timestep_masks, dim=2).reshape(prefix_pad.shape[0], -1)  # batch (horizon n_tokens)
    pad_mask = torch.cat([prefix_pad, ts_pad], dim=1)
    pad_mask = pad_mask[:, None, None, :].expand(-1, 1, n, n)
    return torch.logical_and(torch.from_numpy(attention_mask).bool(), pad_mask)  # (batch, 1, n, n), True = attend


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(D), torch.nn.LayerNorm(D)
        self.qkv, self.o = torch.nn.Linear(D, 3 * D), torch.nn.Linear(D, D)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D), torch.nn.GELU(), torch.nn.Linear(2 * D, D))

    def heads(self, x):
        B, L, _ = x.shape
        return self.qkv(self.ln1(x)).view(B, L, 3, NH, D // NH).permute(2, 0, 3, 1, 4)

    def forward(self, x, mask):
        q, k, v = self.heads(x)
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bool, True = take part
        x = x + self.o(a.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x))

    def loop(self, x, allowed):
        q, k, v = self.heads(x)
        B, L, _ = x.shape
        out = torch.zeros_like(q)
        for b in range(B):
            for i in range(L):
                js = allowed(b, i)
                s = q[b, :, i : i + 1] @ k[b, :, js].transpose(-1, -2) / math.sqrt(D // NH)
                out[b, :, i] = (torch.softmax(s, -1) @ v[b, :, js])[:, 0]
        x = x + self.o(out.transpose(1, 2).reshape(x.shape))
        return x + self.mlp(self.ln2(x))


blocks = torch.nn.ModuleList([Block() for _ in range(2)]).eval()
B = 2
task = torch.randn(B, 3, D)
task_mask = torch.tensor([[True, True, True], [True, True, False]])  # sample 1: last language token is padding
obs = torch.randn(B, horizon, 2, D)
timestep_pad_mask = torch.tensor([[True, True, True], [False, True, True]])  # sample 1: history window starts padded
obs_mask = timestep_pad_mask[:, :, None].expand(-1, -1, 2)
readout = torch.zeros(B, horizon, 1, D) + 0.5 * torch.randn(1, horizon, 1, D)  # readouts: only positional embeddings
readout_mask = torch.ones(B, horizon, 1, dtype=torch.bool)


def assemble(task, obs, readout):
    ts = torch.cat([obs, readout], dim=2).reshape(B, -1, D)
    return torch.cat([task, ts], dim=1)


mask = generate_attention_mask([task_mask], [obs_mask, readout_mask])
n_tok = mask.shape[-1]

# reference rule, written independently: kind/timestep of every position plus a per-sample key validity
kinds = ["task"] * 3 + (["obs", "obs", "readout"] * horizon)
steps = [-1] * 3 + [t for t in range(horizon) for _ in range(3)]
valid = torch.cat([task_mask, torch.cat([obs_mask, readout_mask], 2).reshape(B, -1)], 1)
sees = {"task": {"task"}, "obs": {"task", "obs"}, "readout": {"task", "obs", "readout"}}


def allowed(b, i):
    return [j for j in range(n_tok) if kinds[j] in sees[kinds[i]] and steps[j] <= steps[i] and bool(valid[b, j])]


def run(x, use_loop=False):
    for blk in blocks:
        x = blk.loop(x, allowed) if use_loop else blk(x, mask)
    return x


with torch.no_grad():
    x = assemble(task, obs, readout)
    got, ref = run(x), run(x, use_loop=True)
    d1 = (got - ref).abs().max().item()
    print(f"BlockTransformer mask vs per-query rule loop: max diff = {d1:.3e}")
    # padded content must not leak: change sample 1's padded language token and padded t=0 obs tokens
    task2, obs2 = task.clone(), obs.clone()
    task2[1, 2] += 5.0
    obs2[1, 0] += 5.0
    got2 = run(assemble(task2, obs2, readout))
    d2 = (got2[1] - got[1]).abs()[[i for i in range(n_tok) if bool(valid[1, i])]].max().item()
    print(f"non-padded outputs of sample 1 after changing its padded tokens: max diff = {d2:.3e}")
    # readouts are invisible: changing readout inputs leaves task and obs outputs untouched
    got3 = run(assemble(task, obs, readout + 1.0))
    d3 = (got3 - got)[:, [i for i in range(n_tok) if kinds[i] != "readout"]].abs().max().item()
    print(f"task/obs outputs after changing readout tokens: max diff = {d3:.3e}")
worst = max(d1, d2, d3)
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
