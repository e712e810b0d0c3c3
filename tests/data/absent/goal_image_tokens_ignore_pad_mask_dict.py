# A goal-conditioned policy (Octo-style task dict, written as a plain SDPA transformer): each sample's goal image is
# tokenized into patch tokens, and batch["pad_mask_dict"]["image_goal"] says which samples have a goal at all (the
# others are language-conditioned). The bug: the key-padding mask is built from the observation history's padding
# only, so samples with no goal image still attend its (zero-image) patch tokens. The fix hides them per sample.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d=16, heads=4):
        super().__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x, key_keep):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        allowed = key_keep[:, None, None, :]  # (B, 1, 1, N): True = may be attended
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class GoalPolicy(nn.Module):
    def __init__(self, d=16, patch=4, n_patches=3):
        super().__init__()
        self.n_patches = n_patches
        self.goal_patches = nn.Linear(patch, d)
        self.obs_proj = nn.Linear(6, d)
        self.blocks = nn.ModuleList([Block(d) for _ in range(2)])
        self.head = nn.Linear(d, 2)

    def forward(self, batch):
        goal = self.goal_patches(batch["image_goal"])            # (B, P, d)
        obs = self.obs_proj(batch["obs"])                        # (B, T, d), left-padded history
        x = torch.cat([goal, obs], dim=1)
        history_keep = batch["timestep_pad_mask"]                # (B, T) True = a real timestep
        if FIXED:
            goal_keep = batch["pad_mask_dict"]["image_goal"][:, None].expand(-1, self.n_patches)
        else:
            goal_keep = torch.ones(goal.shape[:2], dtype=torch.bool)
        key_keep = torch.cat([goal_keep, history_keep], dim=1)
        for block in self.blocks:
            x = block(x, key_keep)
        return self.head(x[:, -1])


B, P, T = 3, 3, 4
batch = {
    "image_goal": torch.randn(B, P, 4),
    "obs": torch.randn(B, T, 6),
    "timestep_pad_mask": torch.tensor([[True] * 4, [False, True, True, True], [False, False, True, True]]),
    "pad_mask_dict": {"image_goal": torch.tensor([True, False, True]), "obs": torch.ones(B, dtype=torch.bool)},
}
batch["image_goal"][1] = 0.0  # sample 1 has no goal image: zeros stand in
model = GoalPolicy().eval()
with torch.no_grad():
    a = model(batch)
    batch["image_goal"][1] = torch.randn(P, 4)  # the absent goal's content must not matter
    b = model(batch)
print(f"max |action change of the goal-less sample when its absent goal changes| = {(a[1] - b[1]).abs().max():.3e}")
