# lucidrains/pi-zero-pytorch commit a9981f5: the non-flex attention path made actions bidirectional with
# causal_mask[..., seq_len:] = False, which unmasked the action columns for every query, so the
# image/language/state prefix attended to the noisy action chunk (fix: causal_mask[..., seq_len:, seq_len:]).
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def softclamp(t, value):
    return (t / value).tanh() * value


def max_neg_value(t):
    return -torch.finfo(t.dtype).max


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2, softclamp_value=50.):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.softclamp_value = softclamp_value
        dim_inner = dim_head * heads
        self.rmsnorm = nn.RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim_inner, bias=False)
        self.to_actions_qkvg = nn.Linear(dim, 4 * dim_inner, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)
        self.to_actions_out = nn.Linear(dim_inner, dim, bias=False)

    def split_heads(self, t):
        return t.unflatten(-1, (self.heads, -1)).transpose(1, 2)

    def merge_heads(self, t):
        return t.transpose(1, 2).flatten(2)

    def forward(self, multimodal_seq, actions, mask=None):
        seq_len, device = multimodal_seq.shape[-2], multimodal_seq.device

        multimodal_seq = self.rmsnorm(multimodal_seq)
        mq, mk, mv = self.to_qkv(multimodal_seq).chunk(3, dim=-1)
        aq, ak, av, ag = self.to_actions_qkvg(actions).chunk(4, dim=-1)
        mq, mk, mv, aq, ak, av, ag = tuple(self.split_heads(t) for t in (mq, mk, mv, aq, ak, av, ag))

        q, k, v = tuple(torch.cat(tensors, dim=-2) for tensors in zip((mq, mk, mv), (aq, ak, av)))

        q = q * self.scale
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        sim = softclamp(sim, self.softclamp_value)

        causal_mask = torch.ones(sim.shape[-2:], dtype=torch.bool, device=device).triu(1)

        if mask is not None:
            causal_mask = (~mask)[:, None, None, :] | causal_mask

        if FIXED:
            causal_mask[..., seq_len:, seq_len:] = False  # actions have bidirectional attention, lining up with Transfusion paper
        else:
            causal_mask[..., seq_len:] = False  # actions have bidirectional attention, lining up with Transfusion paper

        sim = sim.masked_fill(causal_mask, max_neg_value(sim))
        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        gates = F.pad(ag.sigmoid(), (0, 0, out.shape[-2] - ag.shape[-2], 0), value=1.)
        out = self.merge_heads(out * gates)

        mout, aout = out[:, :seq_len], out[:, seq_len:]
        return self.to_out(mout), self.to_actions_out(aout)


class PiZero(nn.Module):
    def __init__(self, dim=16, num_tokens=32, depth=2, dim_action_input=4, lm_pad_id=0):
        super().__init__()
        self.lm_pad_id = lm_pad_id
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.to_joint_state_tokens = nn.Linear(6, dim)
        self.to_action_tokens = nn.Linear(dim_action_input, dim)
        self.layers = nn.ModuleList([Attention(dim) for _ in range(depth)])
        self.to_logits = nn.Linear(dim, num_tokens)
        self.actions_to_pred_flow = nn.Linear(dim, dim_action_input)

    def forward(self, visual_tokens, token_ids, joint_state, noised_actions):
        language_tokens = self.token_emb(token_ids)
        joint_state_tokens = self.to_joint_state_tokens(joint_state)[:, None]
        state_tokens = torch.cat((visual_tokens, language_tokens, joint_state_tokens), dim=-2)
        action_tokens = self.to_action_tokens(noised_actions)

        language_mask = token_ids != self.lm_pad_id
        state_length = state_tokens.shape[-2]
        command_length = token_ids.shape[-1]
        mask = F.pad(language_mask, (state_length - command_length - 1, 1 + action_tokens.shape[-2]), value=True)

        for attn in self.layers:
            s_out, a_out = attn(state_tokens, action_tokens, mask=mask)
            state_tokens = state_tokens + s_out
            action_tokens = action_tokens + a_out

        return self.to_logits(state_tokens), self.actions_to_pred_flow(action_tokens)


model = PiZero().eval()
visual_tokens = torch.randn(2, 4, 16)
token_ids = torch.tensor([[5, 6, 7, 8, 9], [3, 4, 2, 0, 0]])
joint_state = torch.randn(2, 6)
actions = torch.randn(2, 6, 4)
times = torch.rand(2, 1, 1)
noise = torch.randn_like(actions)

with torch.no_grad():
    # flow matching training step: two different noise levels for the same observation
    lang_logits_a, _ = model(visual_tokens, token_ids, joint_state, times * actions + (1 - times) * noise)
    lang_logits_b, _ = model(visual_tokens, token_ids, joint_state, 0.5 * actions + 0.5 * noise)

print(f"fixed={FIXED} prefix (vlm) logits change when only the noised actions change: "
      f"{(lang_logits_a - lang_logits_b).abs().max().item():.4f}")
