# huggingface/lerobot PR #1717 (fixes #1707): SmolVLAPolicy.forward read the episode padding mask under the
# wrong key "actions_id_pad" (dataset emits "action_is_pad"), so batch.get() returned None and the
# out-of-episode action-chunk steps were never masked out of the flow-matching loss.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

ACTION = "action"
B, CHUNK, ADIM, D, NPREFIX = 3, 8, 4, 32, 6


def make_att_2d_masks(pad_masks, att_masks):
    cumsum = torch.cumsum(att_masks, dim=1)
    att_2d_masks = cumsum[:, None, :] <= cumsum[:, :, None]
    pad_2d_masks = pad_masks[:, None, :] * pad_masks[:, :, None]
    return att_2d_masks & pad_2d_masks


class VLAFlowMatching(nn.Module):
    """Trimmed: prefix (vlm) tokens + suffix (noisy action) tokens, action expert attends to prefix+suffix."""

    def __init__(self):
        super().__init__()
        self.state_proj = nn.Linear(ADIM, D)
        self.action_in_proj = nn.Linear(ADIM, D)
        self.action_time_mlp_in = nn.Linear(2 * D, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.action_out_proj = nn.Linear(D, ADIM)

    def forward(self, prefix, state, actions, noise, time):
        time_expanded = time[:, None, None]
        x_t = time_expanded * noise + (1 - time_expanded) * actions
        u_t = noise - actions
        t_emb = time[:, None, None].expand(B, CHUNK, D)
        suffix = self.action_time_mlp_in(torch.cat([self.action_in_proj(x_t), t_emb], -1))
        embs = torch.cat([prefix, self.state_proj(state)[:, None], suffix], 1)
        q, k, v = (t[:, None] for t in self.qkv(embs).chunk(3, -1))
        pad_masks = torch.ones(B, embs.shape[1], dtype=torch.bool)
        # prefix tokens: 0, state: its own block, action chunk: [1] + [0] * (chunk - 1)
        att_masks = torch.tensor([0] * NPREFIX + [1] + [1] + [0] * (CHUNK - 1), dtype=torch.bool)[None].expand(B, -1)
        att_2d_masks = make_att_2d_masks(pad_masks, att_masks)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=att_2d_masks[:, None])
        v_t = self.action_out_proj(out[:, 0, -CHUNK:])
        losses = F.mse_loss(u_t, v_t, reduction="none")
        return losses


class SmolVLAPolicy(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = VLAFlowMatching()

    def forward(self, batch, noise=None, time=None):
        actions = batch[ACTION]
        if FIXED:
            actions_is_pad = batch.get("action_is_pad")
        else:
            actions_is_pad = batch.get("actions_id_pad")
        loss_dict = {}
        losses = self.model(batch["prefix"], batch["observation.state"], actions, noise, time)
        loss_dict["losses_after_forward"] = losses.clone()
        if actions_is_pad is not None:
            in_episode_bound = ~actions_is_pad
            losses = losses * in_episode_bound.unsqueeze(-1)
            loss_dict["losses_after_in_ep_bound"] = losses.clone()
        losses = losses[:, :, :ADIM]
        loss = losses.mean()
        return loss, loss_dict


# LeRobotDataset-style sample: near episode end the chunk is clamped to the last frame and flagged "_is_pad"
ep_len_left = torch.tensor([8, 5, 3])
action_is_pad = torch.arange(CHUNK)[None] >= ep_len_left[:, None]
actions = torch.randn(B, CHUNK, ADIM)
for b in range(B):
    actions[b, ep_len_left[b]:] = actions[b, ep_len_left[b] - 1]
batch = {
    "prefix": torch.randn(B, NPREFIX, D),
    "observation.state": torch.randn(B, ADIM),
    ACTION: actions,
    "action_is_pad": action_is_pad,
}
policy = SmolVLAPolicy()
noise = torch.randn(B, CHUNK, ADIM)
time = torch.rand(B)
loss, ld = policy(batch, noise, time)
loss.backward()
# reference: mean loss counting only in-episode steps contributions (padded steps zeroed)
ref = (ld["losses_after_forward"] * (~action_is_pad).unsqueeze(-1)).mean()
print(f"loss={loss.item():.6f} padded-step contribution={abs(loss.item() - ref.item()):.6f}")
