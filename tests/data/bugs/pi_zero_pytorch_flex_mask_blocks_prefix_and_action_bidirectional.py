# lucidrains/pi-zero-pytorch commit 346bb05 ("fix flex attention masking"): the flex attention mask_fn for
# pi0 AND-ed "key_index >= prefix_causal_length" into the causal mask, so no token could attend to the
# state/language prefix and the action chunk was not bidirectional.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def create_pizero_attn_mask(prefix_causal_length, mask):
    # the pi-zero attention is a triangular causal mask, but bidirectional attention for the actions at the very right hand side

    if not FIXED:
        def mask_fn(batch_index, head_index, query_index, key_index):
            return (
                mask[batch_index, key_index] &      # variable length states
                (query_index >= key_index) &        # causal
                (key_index >= prefix_causal_length)  # bidirectional
            )
        return mask_fn

    def mask_fn(batch_index, head_index, query_index, key_index):
        key_mask = mask[batch_index, key_index]   # variable length states
        causal_mask = query_index >= key_index    # causal

        bidirectional_action_mask = (             # bidirectional action mask
            (key_index >= prefix_causal_length) &
            (query_index >= prefix_causal_length)
        )

        return (key_mask & causal_mask) | bidirectional_action_mask

    return mask_fn


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2):
        super().__init__()
        self.heads = heads
        dim_inner = dim_head * heads
        self.rmsnorm = nn.RMSNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * dim_inner, bias=False)
        self.to_actions_qkvg = nn.Linear(dim, 4 * dim_inner, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)
        self.to_actions_out = nn.Linear(dim_inner, dim, bias=False)

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def forward(self, multimodal_seq, actions, mask=None, flex_attn_fn=None):
        seq_len = multimodal_seq.shape[-2]
        multimodal_seq = self.rmsnorm(multimodal_seq)
        mq, mk, mv = self.to_qkv(multimodal_seq).chunk(3, dim=-1)
        aq, ak, av, ag = self.to_actions_qkvg(actions).chunk(4, dim=-1)
        mq, mk, mv, aq, ak, av, ag = tuple(self.split_heads(t) for t in (mq, mk, mv, aq, ak, av, ag))
        q, k, v = tuple(torch.cat(tensors, dim=-2) for tensors in zip((mq, mk, mv), (aq, ak, av)))

        out = flex_attn_fn(q, k, v)

        out = out.transpose(1, 2).flatten(2)
        m_out, a_out = out[:, :seq_len], out[:, seq_len:]
        return self.to_out(m_out), self.to_actions_out(a_out * ag.transpose(1, 2).flatten(2).sigmoid())


class PiZero(nn.Module):
    def __init__(self, dim=16, num_tokens=32, depth=2, dim_action_input=4, lm_pad_id=0):
        super().__init__()
        self.lm_pad_id = lm_pad_id
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.to_action_tokens = nn.Linear(dim_action_input, dim)
        self.layers = nn.ModuleList([Attention(dim) for _ in range(depth)])
        self.actions_to_pred_flow = nn.Linear(dim, dim_action_input)

    def forward(self, images, token_ids, actions):
        visual_tokens = images                         # stand-in for the vit features
        language_tokens = self.token_emb(token_ids)
        state_tokens = torch.cat((visual_tokens, language_tokens), dim=-2)
        action_tokens = self.to_action_tokens(actions)

        language_mask = token_ids != self.lm_pad_id
        state_length = state_tokens.shape[-2]
        command_length = token_ids.shape[-1]
        mask = F.pad(language_mask, (state_length - command_length, action_tokens.shape[-2]), value=True)

        prefix_length = state_tokens.shape[-2]
        seq_len = prefix_length + action_tokens.shape[-2]
        block_mask = create_block_mask(
            create_pizero_attn_mask(prefix_length, mask=mask),
            B=mask.shape[0], H=None, Q_LEN=seq_len, KV_LEN=seq_len, device=state_tokens.device
        )
        flex_attn_fn = partial(flex_attention, block_mask=block_mask)

        for attn in self.layers:
            s_out, a_out = attn(state_tokens, action_tokens, mask=mask, flex_attn_fn=flex_attn_fn)
            state_tokens = state_tokens + s_out
            action_tokens = action_tokens + a_out
        return self.actions_to_pred_flow(action_tokens)


model = PiZero().eval()
images = torch.randn(2, 4, 16)
token_ids = torch.tensor([[5, 6, 7, 8, 0, 0], [9, 3, 4, 0, 0, 0]])  # right-padded commands
actions = torch.randn(2, 5, 4)

with torch.no_grad():
    flow = model(images, token_ids, actions)
    # same batch with the image features changed: the predicted flow must depend on the observation
    flow_other_obs = model(images + 1.0, token_ids, actions)

print(f"fixed={FIXED} action flow change when the observation changes: {(flow - flow_other_obs).abs().max().item():.4f}")
