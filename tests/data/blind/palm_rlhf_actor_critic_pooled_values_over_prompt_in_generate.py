# lucidrains/PaLM-rlhf-pytorch commit a0b9774 ("fix pooled critic values during generation, thanks to
# @Nightbringers"), palm_rlhf_pytorch/palm_rlhf_pytorch.py ActorCritic.generate, read at a0b9774^ and a0b9774.
#
# PPO for a PaLM policy with a pooled critic (critic_pooled_values = True): the critic's value is a masked mean
# of the critic PaLM's embeddings. A batch of sampled sequences is right-padded (pad_value 0) after each row's
# eos. In RLHFTrainer.learn the critic pools over `action_masks = ~prompt_masks & masks` (the sampled tokens up
# to and including eos), but ActorCritic.generate, which produces the stored old_values, handed forward the eos
# mask alone, so old_values were pooled over the prompt tokens as well as the actions.
# Fix: generate builds `action_mask = ~prompt_mask`, ANDs the eos mask into it and passes `mask = action_mask`.
#
# Trimmed port: PaLM (ParallelTransformerBlock, multi-query attention, xpos rotary, causal mask), PaLM.generate
# with eos padding, ActorCritic (no LoRA), one PPO minibatch of RLHFTrainer.learn (advantages, value loss).
# einops calls are written out in torch. The reward model is replaced by a fixed score per row.
import math
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def identity(t, *args, **kwargs):
    return t


# utils.py

def log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def masked_mean(seq, mask=None, dim=1, keepdim=False):
    if not exists(mask):
        return seq.mean(dim=dim)

    if seq.ndim == 3:
        mask = mask.unsqueeze(-1)

    masked_seq = seq.masked_fill(~mask, 0.)
    numer = masked_seq.sum(dim=dim, keepdim=keepdim)
    denom = mask.sum(dim=dim, keepdim=keepdim)

    masked_mean = numer / denom.clamp(min=1e-3)
    masked_mean = masked_mean.masked_fill(denom == 0, 0.)
    return masked_mean


def gumbel_noise(t):
    noise = torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(noise))


def gumbel_sample(t, temperature=1., dim=-1):
    return ((t / max(temperature, 1e-10)) + gumbel_noise(t)).argmax(dim=dim)


def top_k(logits, thres=0.9):
    k = math.ceil((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(1, ind, val)
    return probs


# palm_rlhf_pytorch.py

class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class Residual(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, **kwargs):
        return self.fn(x, **kwargs) + x


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, scale_base=512):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

        self.scale_base = scale_base
        scale = (torch.arange(0, dim, 2) + 0.4 * dim) / (1.4 * dim)
        self.register_buffer('scale', scale)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)

        power = (t - (seq_len // 2)) / self.scale_base
        scale = self.scale ** power.unsqueeze(-1)
        scale = torch.cat((scale, scale), dim=-1)

        return freqs, scale


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t, scale=1.):
    return (t * pos.cos() * scale) + (rotate_half(t) * pos.sin() * scale)


class SwiGLU(nn.Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim=-1)
        return F.silu(gate) * x


class ParallelTransformerBlock(nn.Module):
    def __init__(self, dim, dim_head=64, causal=True, heads=8, ff_mult=4, xpos_scale_base=512):
        super().__init__()
        self.norm = LayerNorm(dim)

        attn_inner_dim = dim_head * heads
        ff_inner_dim = dim * ff_mult
        self.fused_dims = (attn_inner_dim, dim_head, dim_head, (ff_inner_dim * 2))

        self.heads = heads
        self.scale = dim_head ** -0.5
        self.causal = causal

        self.rotary_emb = RotaryEmbedding(dim_head, scale_base=xpos_scale_base)

        self.fused_attn_ff_proj = nn.Linear(dim, sum(self.fused_dims), bias=False)
        self.attn_out = nn.Linear(attn_inner_dim, dim, bias=False)

        self.ff_out = nn.Sequential(
            SwiGLU(),
            nn.Linear(ff_inner_dim, dim, bias=False)
        )

        self.register_buffer("mask", None, persistent=False)
        self.register_buffer("pos_emb", None, persistent=False)
        self.register_buffer("pos_emb_scale", None, persistent=False)

    def get_mask(self, n, device):
        if exists(self.mask) and self.mask.shape[-1] >= n:
            return self.mask[:n, :n]

        mask = torch.ones((n, n), device=device, dtype=torch.bool).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        return mask

    def get_rotary_embedding(self, n, device):
        if exists(self.pos_emb) and self.pos_emb.shape[-2] >= n:
            return self.pos_emb[:n], self.pos_emb_scale[:n]

        pos_emb, scale = self.rotary_emb(n, device=device)
        self.register_buffer("pos_emb", pos_emb, persistent=False)
        self.register_buffer("pos_emb_scale", scale, persistent=False)
        return pos_emb, scale

    def forward(self, x):
        n, device, h = x.shape[1], x.device, self.heads

        x = self.norm(x)

        q, k, v, ff = self.fused_attn_ff_proj(x).split(self.fused_dims, dim=-1)

        b = q.shape[0]
        q = q.view(b, n, h, -1).transpose(1, 2)   # b n (h d) -> b h n d

        q = q * self.scale

        positions, scale = self.get_rotary_embedding(n, device)

        q = apply_rotary_pos_emb(positions, q, scale)
        k = apply_rotary_pos_emb(positions, k, scale ** -1)

        sim = einsum("b h i d, b j d -> b h i j", q, k)

        if self.causal:
            causal_mask = self.get_mask(n, device)
            sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)

        out = einsum("b h i j, b j d -> b h i d", attn, v)

        out = out.transpose(1, 2).reshape(b, n, -1)   # b h n d -> b n (h d)

        return self.attn_out(out) + self.ff_out(ff)


class PaLM(nn.Module):
    def __init__(self, *, dim, num_tokens, depth, causal=True, dim_head=64, heads=8, ff_mult=4,
                 rotary_xpos_scale_base=512):
        super().__init__()
        self.dim = dim
        self.num_tokens = num_tokens

        self.token_emb = nn.Embedding(num_tokens, dim)
        self.layers = nn.ModuleList([])

        for _ in range(depth):
            self.layers.append(Residual(ParallelTransformerBlock(
                dim=dim, causal=causal, dim_head=dim_head, heads=heads, ff_mult=ff_mult,
                xpos_scale_base=rotary_xpos_scale_base
            )))

        self.norm = LayerNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)
        self.to_logits.weight = self.token_emb.weight

        nn.init.normal_(self.token_emb.weight, std=0.02)

    @torch.no_grad()
    def generate(self, seq_len, prompt=None, temperature=1., filter_logits_fn=top_k, filter_thres=0.9,
                 pad_value=0., eos_token=None, return_seq_without_prompt=True, **kwargs):
        n, out = prompt.shape[-1], prompt.clone()

        sample_num_times = max(1, seq_len - prompt.shape[-1])

        for _ in range(sample_num_times):
            logits, embeds = self.forward(out, return_logits_with_embedding=True, **kwargs)
            logits, embeds = logits[:, -1], embeds[:, -1]

            if exists(filter_logits_fn):
                logits = filter_logits_fn(logits, thres=filter_thres)

            sample = gumbel_sample(logits, temperature=temperature, dim=-1)
            out = torch.cat((out, sample[:, None]), dim=-1)

            if exists(eos_token):
                is_eos_tokens = (out == eos_token)

                if is_eos_tokens.any(dim=-1).all():
                    # mask out everything after the eos tokens
                    shifted_is_eos_tokens = F.pad(is_eos_tokens, (1, -1))
                    mask = shifted_is_eos_tokens.float().cumsum(dim=-1) >= 1
                    out = out.masked_fill(mask, pad_value)
                    break

        if return_seq_without_prompt:
            out = out[..., n:]

        return out

    def forward(self, x, return_only_embedding=False, return_logits_with_embedding=False):
        x = self.token_emb(x)

        for layer in self.layers:
            x = layer(x)

        embeds = self.norm(x)

        if return_only_embedding:
            return embeds

        logits = self.to_logits(x)

        return (logits, embeds) if return_logits_with_embedding else logits


PPOActionCriticReturn = namedtuple('PPOActionCriticReturn', [
    'actions', 'sequence', 'mask', 'prompt_mask', 'action_logits', 'values'
])


class ActorCritic(nn.Module):
    def __init__(self, palm, critic_palm=None, pooled_values=False):
        super().__init__()
        self.actor_palm = palm
        self.critic_palm = critic_palm

        self.pooled_values = pooled_values
        self.value_head = nn.Sequential(nn.Linear(palm.dim, 1))

        nn.init.zeros_(self.value_head[0].bias)
        nn.init.orthogonal_(self.value_head[0].weight, gain=math.sqrt(2))

    @torch.no_grad()
    def generate(self, state, max_seq_len, eos_token=None, return_values=False, **kwargs):
        actions = self.actor_palm.generate(
            max_seq_len,
            prompt=state,
            eos_token=eos_token,
            **kwargs
        )

        sequence = torch.cat((state, actions), dim=-1)
        action_len = actions.shape[-1]
        state_len = state.shape[-1]

        prompt_mask = torch.arange(sequence.shape[-1], device=state.device) < state_len
        prompt_mask = prompt_mask.unsqueeze(0).expand(sequence.shape[0], -1)

        if FIXED:
            action_mask = ~prompt_mask

        mask = None
        if exists(eos_token):
            mask = ((sequence == eos_token).cumsum(dim=-1) == 0)
            mask = F.pad(mask, (1, -1), value=True)  # include eos token
            if FIXED:
                action_mask &= mask

        action_logits, value = self.forward(
            sequence,
            mask=action_mask if FIXED else mask,
            return_values=return_values
        )

        return PPOActionCriticReturn(actions, sequence, mask, prompt_mask, action_logits, value)

    def forward(self, x, mask=None, return_values=True):
        action_logits = self.actor_palm(x)

        if not return_values:
            return action_logits, None

        critic_embeds = self.critic_palm(x, return_only_embedding=True)

        if self.pooled_values:
            critic_embeds = masked_mean(critic_embeds, mask, dim=1)

        values = self.value_head(critic_embeds).squeeze(-1)

        return action_logits, values


# ppo.py

def log_prob(prob, indices):
    return log(prob.gather(-1, indices[..., None])).squeeze(-1)


def masked_normalize(t, eps=1e-5, mask=None, dim=None):
    dim = default(dim, tuple(range(t.ndim)))
    kwargs = dict(dim=dim, keepdim=True)

    mean = masked_mean(t, mask=mask, **kwargs)
    mean_centered = t - mean
    var = masked_mean(mean_centered ** 2, mask=mask, **kwargs)

    return mean_centered * var.clamp(min=eps).rsqrt()


def clipped_value_loss(values, rewards, old_values, clip):
    value_clipped = old_values + (values - old_values).clamp(-clip, clip)
    value_loss_1 = (value_clipped.flatten() - rewards) ** 2
    value_loss_2 = (values.flatten() - rewards) ** 2
    return torch.mean(torch.max(value_loss_1, value_loss_2))


def main():
    torch.manual_seed(0)

    num_tokens, eos_token, pad_value = 8, 3, 0
    palm = PaLM(dim=32, num_tokens=num_tokens, depth=2, dim_head=8, heads=4)
    critic_palm = PaLM(dim=32, num_tokens=num_tokens, depth=2, dim_head=8, heads=4)
    with torch.no_grad():
        palm.token_emb.weight.normal_(std=0.1)
        critic_palm.token_emb.weight.normal_(std=0.5)
    actor_critic = ActorCritic(palm, critic_palm, pooled_values=True).eval()

    # one prompt, several samples (as RLHFTrainer.generate repeats its prompt num_samples times)
    prompt = torch.tensor([5, 1, 4, 7, 2, 6])
    state = prompt.unsqueeze(0).expand(4, -1).contiguous()

    (actions, sequences, mask, prompt_mask, action_logits, old_values) = actor_critic.generate(
        state, max_seq_len=32, eos_token=eos_token, return_values=True, filter_thres=0., pad_value=pad_value
    )

    action_len = actions.shape[-1]
    action_probs = action_logits.softmax(dim=-1)
    old_log_probs = log_prob(action_probs, sequences)[:, -action_len:]

    # stand-in for reward_model(sequences, prompt_mask=prompt_mask, mask=mask): a fixed score per row
    rewards = torch.tensor([0.9, -0.2, 0.4, -0.7])

    print("sequences:\n", sequences)
    print("old_values (from generate):", [round(v, 4) for v in old_values.tolist()])

    # RLHFTrainer.learn, one minibatch
    value_clip = 0.4
    prompt_masks, masks = prompt_mask, mask
    action_masks = ~prompt_masks & masks

    with torch.no_grad():
        action_logits, values = actor_critic(sequences, mask=action_masks)

    advantages = masked_normalize(rewards - old_values)
    value_loss = clipped_value_loss(values, rewards, old_values, value_clip).mean()

    print("values (in learn):           ", [round(v, 4) for v in values.tolist()])
    print("advantages:", [round(a, 4) for a in advantages.tolist()])
    print(f"critic_loss: {value_loss.item():.4f}")


if __name__ == "__main__":
    main()
