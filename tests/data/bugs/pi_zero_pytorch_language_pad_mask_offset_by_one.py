# lucidrains/pi-zero-pytorch, issue #12 (fixed in lucidrains/pi-zero-pytorch commit 6716ce2)
# PiZero.forward pads the language key-padding mask with (state_length - command_length - 1, 1 + actions):
# the mask is shifted one token left, so the last (padded) language token is attended and rotary positions shift.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import einsum

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

LinearNoBias = lambda i, o: nn.Linear(i, o, bias=False)

def exists(v):
    return v is not None

def softclamp(t, value):
    if value <= 0.:
        return t
    return (t / value).tanh() * value

def max_neg_value(t):
    return -torch.finfo(t.dtype).max

# rotary_embedding_torch style (interleaved), positions given explicitly as floats
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        self.register_buffer('inv_freq', 1. / (theta ** (torch.arange(0, dim, 2).float() / dim)))

    def forward(self, seq):
        freqs = seq[..., None] * self.inv_freq
        return freqs.repeat_interleave(2, dim=-1)

def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)

def apply_rotary_emb(freqs, t):
    return t * freqs.cos() + rotate_half(t) * freqs.sin()

class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=2, softclamp_value=50.):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        dim_inner = dim_head * heads
        self.rmsnorm = nn.RMSNorm(dim)
        self.to_qkv = LinearNoBias(dim, 3 * dim_inner)
        self.to_out = LinearNoBias(dim_inner, dim)
        self.to_actions_qkvg = LinearNoBias(dim, 4 * dim_inner)
        self.to_actions_out = LinearNoBias(dim_inner, dim)
        self.softclamp_value = softclamp_value

    def split_heads(self, t):
        b, n, _ = t.shape
        return t.view(b, n, self.heads, -1).transpose(1, 2)

    def merge_heads(self, t):
        b, h, n, d = t.shape
        return t.transpose(1, 2).reshape(b, n, h * d)

    def forward(self, multimodal_seq, actions, rotary_emb=None, mask=None):
        seq_len, device = multimodal_seq.shape[-2], multimodal_seq.device
        multimodal_seq = self.rmsnorm(multimodal_seq)

        mq, mk, mv = self.to_qkv(multimodal_seq).chunk(3, dim=-1)
        aq, ak, av, ag = self.to_actions_qkvg(actions).chunk(4, dim=-1)
        mq, mk, mv, aq, ak, av, ag = tuple(self.split_heads(t) for t in (mq, mk, mv, aq, ak, av, ag))

        q, k, v = tuple(torch.cat(tensors, dim=-2) for tensors in zip((mq, mk, mv), (aq, ak, av)))

        if exists(rotary_emb):
            q = apply_rotary_emb(rotary_emb, q)
            k = apply_rotary_emb(rotary_emb, k)

        q = q * self.scale
        sim = einsum('b h i d, b h j d -> b h i j', q, k)
        sim = softclamp(sim, self.softclamp_value)

        causal_mask = torch.ones(sim.shape[-2:], dtype=torch.bool, device=device).triu(1)

        if exists(mask):
            # einx.logical_or('b j, i j -> b 1 i j', ~mask, causal_mask)
            causal_mask = (~mask)[:, None, None, :] | causal_mask[None, None]

        causal_mask[..., seq_len:, seq_len:] = False  # actions have bidirectional attention

        sim = sim.masked_fill(causal_mask, max_neg_value(sim))
        attn = sim.softmax(dim=-1)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        gates = F.pad(ag.sigmoid(), (0, 0, out.shape[-2] - ag.shape[-2], 0), value=1.)
        out = out * gates
        out = self.merge_heads(out)

        state_out, actions_out = out[:, :seq_len], out[:, seq_len:]
        return self.to_out(state_out), self.to_actions_out(actions_out)

class PiZero(nn.Module):
    def __init__(self, dim=32, num_tokens=50, dim_action_input=3, depth=2, dim_head=16, heads=2, lm_pad_id=-1):
        super().__init__()
        self.lm_pad_id = lm_pad_id
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.to_action_tokens = nn.Linear(dim_action_input, dim)
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                Attention(dim, dim_head, heads),
                nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim)),
                nn.Sequential(nn.RMSNorm(dim), nn.Linear(dim, dim * 2), nn.GELU(), nn.Linear(dim * 2, dim)),
            ]))
        self.final_actions_norm = nn.RMSNorm(dim)
        self.actions_to_pred_flow = LinearNoBias(dim, dim_action_input)

    def forward(self, images, token_ids, actions):
        # images already encoded as (batch, seq, dim)
        visual_tokens = images
        language_tokens = self.token_emb(token_ids.clamp(min=0))
        action_tokens = self.to_action_tokens(actions)
        action_with_registers_length = action_tokens.shape[-2]

        state_tokens = torch.cat((visual_tokens, language_tokens), dim=-2)

        command_length = token_ids.shape[-1]
        language_mask = token_ids != self.lm_pad_id
        state_length = state_tokens.shape[-2]

        if FIXED:
            mask = F.pad(language_mask, (state_length - command_length, action_with_registers_length), value=True)
        else:
            mask = F.pad(language_mask, (state_length - command_length - 1, 1 + action_with_registers_length), value=True)

        # rotary embeddings
        seq = mask.float().cumsum(dim=-1)
        rotary_emb = self.rotary_emb(seq)
        rotary_emb = rotary_emb[:, None]  # b n d -> b 1 n d

        for attn, state_ff, actions_ff in self.layers:
            state_attn_out, actions_attn_out = attn(state_tokens, action_tokens, rotary_emb=rotary_emb, mask=mask)
            state_tokens = state_tokens + state_attn_out
            action_tokens = action_tokens + actions_attn_out
            state_tokens = state_ff(state_tokens) + state_tokens
            action_tokens = actions_ff(action_tokens) + action_tokens

        return self.actions_to_pred_flow(self.final_actions_norm(action_tokens))

model = PiZero().eval()

B, NV, NL, NA = 2, 4, 6, 4
images = torch.randn(B, NV, 32)
token_ids = torch.randint(0, 50, (B, NL))
token_ids[1, 4:] = -1            # second command is 4 tokens, right padded with lm_pad_id
actions = torch.randn(B, NA, 3)

with torch.no_grad():
    batched = model(images, token_ids, actions)
    alone = model(images[1:], token_ids[1:, :4], actions[1:])   # same sample, no padding

diff = (batched[1] - alone[0]).abs().max().item()
print(f"max |padded-batch action flow - unpadded single| = {diff:.6e}")
