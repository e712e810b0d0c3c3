# lucidrains/block-recurrent-transformer-pytorch commit c78f5ff: in AttentionBlock the state vectors
# cross-attend (from_state_cross_attn, no mask) to the look-back-concatenated block keys, i.e. the zero-padded
# previous block and the width-padding tokens, instead of only the current block's real keys.
import sys
import math
from functools import partial
import torch
import torch.nn.functional as F
from torch import nn, einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def divisible_by(numer, denom):
    return (numer % denom) == 0


def pad_at_dim(t, pad, dim=-1, value=0.):
    dims_from_right = (- dim - 1) if dim < 0 else (t.ndim - dim - 1)
    zeros = ((0, 0) * dims_from_right)
    return F.pad(t, (*zeros, *pad), value=value)


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class Attend(nn.Module):
    # non-flash path of Attend
    def __init__(self, causal=False):
        super().__init__()
        self.causal = causal

    def forward(self, q, k, v, mask=None):
        b = q.shape[0]
        qs = q.shape
        q = q.reshape(-1, *q.shape[-3:])            # pack '* h n d'
        k = k.reshape(-1, *k.shape[-2:])            # pack '* n d' (single key/value head)
        v = v.reshape(-1, *v.shape[-2:])
        scale = q.shape[-1] ** -0.5
        sim = einsum("b h i d, b j d -> b h i j", q, k) * scale
        if exists(mask):
            if mask.ndim != 2:
                mask = mask.repeat(b, *((1,) * (mask.ndim - 1)))  # 'w ... -> (b w) ...'
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        if self.causal:
            i, j = sim.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool).triu(j - i + 1)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b j d -> b h i d", attn, v)
        return out.reshape(*qs[:-2], out.shape[-2], out.shape[-1])


class Attention(nn.Module):
    def __init__(self, dim_head, causal=False):
        super().__init__()
        self.attend = Attend(causal=causal)

    def forward(self, q, k, v, mask=None):
        return self.attend(q, k, v, mask=mask)


class AttentionBlock(nn.Module):
    def __init__(self, dim, block_width, dim_head=16, heads=2, num_state_vectors=0):
        super().__init__()
        inner_dim = dim_head * heads
        self.heads = heads
        self.norm = LayerNorm(dim)
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(dim, dim_head * 2, bias=False)
        self.attn = Attention(dim_head)
        self.block_width = block_width
        self.is_recurrent_layer = num_state_vectors > 0
        self.to_out = nn.Linear(inner_dim * (2 if self.is_recurrent_layer else 1), dim, bias=False)
        if self.is_recurrent_layer:
            self.state_norm = LayerNorm(dim)
            self.q_to_state = nn.Linear(dim, inner_dim, bias=False)
            self.q_from_state = nn.Linear(dim, inner_dim, bias=False)
            self.state_to_q = nn.Linear(dim, inner_dim, bias=False)
            self.state_to_kv = nn.Linear(dim, dim_head * 2, bias=False)
            self.init_state = nn.Parameter(torch.randn(num_state_vectors, dim))
            self.state_pos_ids = nn.Parameter(torch.randn(num_state_vectors, dim))
            self.to_state_out = nn.Linear(inner_dim * 2, dim, bias=False)
            self.to_state_cross_attn = Attention(dim_head)
            self.state_self_attn = Attention(dim_head)
            self.from_state_cross_attn = Attention(dim_head)
            self.state_out_to_gate = nn.Linear(dim, dim)
            self.learned_ema_beta = nn.Parameter(torch.randn(dim))

    def forward(self, x, attn_mask=None, return_memories_and_states=None, xl_memories=None, states=None):
        batch, seq_len, _, width = *x.shape, self.block_width

        if not divisible_by(seq_len, width):
            padding_to_width_multiple = math.ceil(seq_len / width) * width - seq_len
            x = pad_at_dim(x, (0, padding_to_width_multiple), dim=-2, value=0)

        x = self.norm(x)
        q, k, v = (self.to_q(x), *self.to_kv(x).chunk(2, dim=-1))
        q = q.view(batch, q.shape[1], self.heads, -1).transpose(1, 2)  # 'b n (h d) -> b h n d'

        # 'b ... (w n) d -> b w ... n d'
        bq = q.view(batch, self.heads, -1, width, q.shape[-1]).permute(0, 2, 1, 3, 4)
        bk = k.view(batch, -1, width, k.shape[-1])
        bv = v.view(batch, -1, width, v.shape[-1])

        orig_bk, orig_bv = bk, bv  # added by the fix

        memories = None
        if return_memories_and_states:
            memories = torch.stack((bk[:, -1], bv[:, -1]))

        if exists(xl_memories):
            past_k, past_v = xl_memories
            bk = torch.cat((past_k[:, None], bk), dim=1)
            bv = torch.cat((past_v[:, None], bv), dim=1)
        else:
            bk = pad_at_dim(bk, (1, 0), value=0., dim=1)
            bv = pad_at_dim(bv, (1, 0), value=0., dim=1)

        if exists(attn_mask):
            attn_mask = attn_mask[None, None].repeat(bq.shape[1], 1, 1, 1)  # 'i j -> w 1 i j'
            attn_mask[0, 0, :, :width] = exists(xl_memories)

        bk = torch.cat((bk[:, :-1], bk[:, 1:]), dim=-2)
        bv = torch.cat((bv[:, :-1], bv[:, 1:]), dim=-2)

        out = self.attn(bq, bk, bv, mask=attn_mask)
        out = out.permute(0, 1, 3, 2, 4).reshape(batch, -1, out.shape[2] * out.shape[-1])  # 'b w h n d -> b (w n) (h d)'
        out = out[:, :seq_len]

        new_states = None
        if self.is_recurrent_layer:
            x_blocks = x[:, :seq_len].split(width, dim=-2)
            to_state_out = torch.empty((batch, 0, out.shape[-1]), dtype=out.dtype)
            if not exists(states):
                states = self.init_state

            if FIXED:
                kv_blocks = zip(orig_bk.unbind(dim=1), orig_bv.unbind(dim=1))
            else:
                kv_blocks = zip(bk.unbind(dim=1), bv.unbind(dim=1))

            for ind, (x_block, (xk_block, xv_block)) in enumerate(zip(x_blocks, kv_blocks)):
                is_last = ind == (len(x_blocks) - 1)

                if FIXED:
                    block_seq_len = x_block.shape[-2]
                    xk_block, xv_block = xk_block[..., :block_seq_len, :], xv_block[..., :block_seq_len, :]

                orig_states = states
                states = self.state_norm(states)
                states = states + self.state_pos_ids

                q_to_state = self.q_to_state(x_block)
                q_from_state = self.q_from_state(states)
                split = lambda t: t.view(*t.shape[:-2], t.shape[-2], self.heads, -1).transpose(-2, -3)
                q_to_state, q_from_state = map(split, (q_to_state, q_from_state))

                state_q, state_k, state_v = (self.state_to_q(states), *self.state_to_kv(states).chunk(2, dim=-1))
                state_q = split(state_q)
                if state_q.ndim == 3:
                    state_q = state_q[None].expand(batch, -1, -1, -1)
                    state_k = state_k[None].expand(batch, -1, -1)
                    state_v = state_v[None].expand(batch, -1, -1)

                to_state_out_block = self.to_state_cross_attn(q_to_state, state_k, state_v)
                to_state_out_block = to_state_out_block.transpose(1, 2).flatten(2)
                to_state_out = torch.cat((to_state_out, to_state_out_block), dim=-2)

                if return_memories_and_states or not is_last:
                    if q_from_state.ndim == 3:
                        q_from_state = q_from_state[None].expand(batch, -1, -1, -1)
                    state_out = self.state_self_attn(state_q, state_k, state_v)
                    from_state_out = self.from_state_cross_attn(q_from_state, xk_block, xv_block)
                    state_out = torch.cat((state_out, from_state_out), dim=-1)
                    state_out = state_out.transpose(1, 2).flatten(2)
                    state_out = self.to_state_out(state_out)
                    z = self.state_out_to_gate(state_out)
                    learned_ema_decay = self.learned_ema_beta.sigmoid()
                    states = learned_ema_decay * z + (1 - learned_ema_decay) * orig_states

            out = torch.cat((out, to_state_out), dim=-1)
            if return_memories_and_states:
                new_states = states

        return self.to_out(out), memories, new_states


def get_causal_attn_mask(width):
    causal_mask = torch.ones((width, 2 * width), dtype=torch.bool).tril(width)
    i_arange = torch.arange(width)
    j_arange = torch.arange(width * 2)
    rel_pos = ((i_arange[:, None] + width) - j_arange[None, :]).abs()
    return causal_mask & (rel_pos < width)


dim, width = 32, 8
block = AttentionBlock(dim, block_width=width, num_state_vectors=4).eval()
x = torch.randn(2, 12, dim)  # 12 tokens -> two blocks, the second padded to width with 4 zero tokens
attn_mask = get_causal_attn_mask(width)

with torch.no_grad():
    _, _, states_full = block(x, attn_mask=attn_mask, return_memories_and_states=True)
    # reference: the recurrence block by block, so each state update only ever sees that block's real tokens
    _, _, s1 = block(x[:, :8], attn_mask=attn_mask, return_memories_and_states=True)
    _, _, s2 = block(x[:, 8:], attn_mask=attn_mask, return_memories_and_states=True, states=s1)

print("max |states(12 tokens at once) - states(block by block)|: %.6f" % (states_full - s2).abs().max().item())
