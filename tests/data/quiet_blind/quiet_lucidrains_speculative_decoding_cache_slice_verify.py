# Correct program (quiet batch quiet-r93b).
# Citation: lucidrains/speculative-decoding speculative_decoding/speculative_decoding.py
#   @72171ac (base_decoding, speculative_decoding, CausalAttention, Decoder, RotaryEmbedding).
# Speculative decoding (Leviathan et al., algorithm 1) as the project writes it: a small Decoder drafts
# gamma tokens through its own cache, the big Decoder verifies all of them in one cached forward
# (CausalAttention's `triu(j - i + 1)` mask over cache + new keys, rotary applied after the cache concat),
# and the caches are sliced back to the accepted length (the batch-of-one path). einops' rearrange is
# written out with torch ops; beartype is dropped. At a near-zero temperature both samplers are greedy, so
# the output must equal a hand-written greedy loop that re-runs the big net on the whole sequence with no
# cache; every verify forward's logits are also checked against an uncached run.
import math
import sys
from collections import namedtuple

import torch
import torch.nn.functional as F
from torch import einsum, nn
from torch.nn import Module, ModuleList

Cache = namedtuple('Cache', ['cached_kvs', 'embeds'])


def exists(val):
    return val is not None


def log(t, eps=1e-20):
    return torch.log(t.clamp(min=eps))


def gumbel_noise(t):
    noise = torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(noise))


def gumbel_sample(t, temperature=1., dim=-1):
    return ((t / max(temperature, 1e-10)) + gumbel_noise(t)).argmax(dim=dim)


def top_k(logits, thres=0.9):
    k = math.ceil((1 - thres) * logits.shape[-1])
    val, ind = torch.topk(logits, k)
    probs = torch.full_like(logits, float('-inf'))
    probs.scatter_(-1, ind, val)
    return probs


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len):
        t = torch.arange(seq_len, device=self.inv_freq.device).type_as(self.inv_freq)
        freqs = einsum('i, j -> i j', t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(pos, t):
    seq_len = t.shape[-2]
    pos = pos[-seq_len:, :]
    return t * pos.cos() + rotate_half(t) * pos.sin()


VERIFY_CHECKS = []


@torch.no_grad()
def base_decoding(net, prompt, seq_len, temperature=1., filter_thres=0.9):
    prompt_seq_len, out = prompt.shape[-1], prompt.clone()
    sample_num_times = max(0, seq_len - prompt_seq_len)

    cache = None

    for _ in range(sample_num_times):
        logits, cache = net(out, cache=cache, return_cache=True)
        logits = logits[:, -1]

        logits = top_k(logits, thres=filter_thres)
        sample = gumbel_sample(logits, temperature=temperature, dim=-1)

        out = torch.cat((out, sample[..., None]), dim=-1)

    return out[..., prompt_seq_len:]


def safe_div(num, den, eps=1e-10):
    return num / max(den, eps)


def find_first_true_index(bool_tensor, dim=-1):
    return (bool_tensor.cumsum(dim=dim) == 0).sum(dim=dim)


@torch.no_grad()
def speculative_decoding(net, small_net, prompt, seq_len, gamma=5, temperature=1., filter_thres=0.9,
                         lenience=1., pad_id=0):
    batch, prompt_seq_len, out, device = *prompt.shape, prompt.clone(), prompt.device

    cache = None
    small_cache = None

    num_steps = 0
    total_accepted = 0

    batch_range = torch.arange(batch, device=device, dtype=torch.long)[..., None]
    seq_lens = torch.full((batch,), prompt_seq_len, device=device, dtype=torch.long)

    while (seq_lens < seq_len).any():

        # predict with smaller network

        all_small_logits = []
        q_sampled_out = []

        for _ in range(gamma):
            small_logits, small_cache = small_net(
                out,
                seq_start_pos=out.shape[-1] - seq_lens,
                cache=small_cache,
                return_cache=True
            )

            small_logits = small_logits[:, -1]

            small_logits = top_k(small_logits, thres=filter_thres)
            all_small_logits.append(small_logits)

            sample = gumbel_sample(small_logits, temperature=temperature, dim=-1)
            out = torch.cat((out, sample[..., None]), dim=-1)
            seq_lens += 1

            q_sampled_out.append(sample.reshape(batch, 1, 1))

        q_sampled_out = torch.cat(q_sampled_out, dim=-2)
        small_logits = torch.stack(all_small_logits, dim=-2)

        # verify with larger network

        logits, cache = net(
            out,
            seq_start_pos=out.shape[-1] - seq_lens,
            cache=cache,
            return_cache=True
        )

        VERIFY_CHECKS.append((out.clone(), logits.clone()))

        logits = logits[..., -(gamma + 1):, :]
        logits = top_k(logits, thres=filter_thres)

        prob = safe_div(logits, temperature).softmax(dim=-1)
        small_prob = safe_div(small_logits, temperature).softmax(dim=-1)

        p, prob_next = prob[:, :-1], prob[:, -1]

        p = p.gather(-1, q_sampled_out)
        q = small_prob.gather(-1, q_sampled_out) * lenience

        p, q = [t.squeeze(-1) for t in (p, q)]

        r = torch.zeros_like(q).float().uniform_(0, 1)

        accepted = find_first_true_index(r > (p / q))

        total_accepted += accepted.float().mean()
        num_steps += 1

        num_rejected = gamma - accepted
        has_rejected = num_rejected > 0

        accepted = accepted[:, None]
        accepted.clamp_(max=gamma - 1)
        adjusted_prob = F.relu(prob[batch_range, accepted] - small_prob[batch_range, accepted])
        adjusted_prob = adjusted_prob / adjusted_prob.sum(dim=-1, keepdim=True)
        adjusted_prob = adjusted_prob[:, 0]

        prob_next = torch.where(
            has_rejected[..., None],
            adjusted_prob,
            prob_next
        )

        # slice everything back to the accepted length, including kv caches

        seq_lens -= num_rejected
        max_seq_len = seq_lens.amax()

        cached_kv, _ = cache
        small_cached_kv, _ = small_cache

        # batch size of 1: just slice to max_seq_len
        out = out[..., :max_seq_len]
        cached_kv = cached_kv[..., :max_seq_len, :]
        small_cached_kv = small_cached_kv[..., :max_seq_len, :]

        cache = (cached_kv, None)
        small_cache = (small_cached_kv, None)

        next_token = torch.multinomial(prob_next, 1)

        out = torch.cat((out, next_token), dim=-1)
        seq_lens += 1

    num_pad_left = out.shape[-1] - seq_lens
    max_pad_left = num_pad_left.amax()
    out = F.pad(out, (0, max_pad_left), value=pad_id)

    seq_len_range = torch.arange(seq_len, device=device, dtype=torch.long)
    out = out[batch_range, seq_len_range + num_pad_left[..., None]]

    return out[..., prompt_seq_len:], total_accepted / num_steps


class CausalAttention(Module):
    def __init__(self, dim, *, dim_head=64, heads=8):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        dim_inner = dim_head * heads

        self.norm = nn.RMSNorm(dim)

        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias=False)
        self.to_out = nn.Linear(dim_inner, dim, bias=False)

    def forward(self, x, cache=None, context_mask=None, rotary_emb=None):
        h, device = self.heads, x.device

        x = self.norm(x)

        b, n, _ = x.shape
        # 'b n (qkv h d) -> qkv b h n d'
        q, k, v = self.to_qkv(x).reshape(b, n, 3, h, -1).permute(2, 0, 3, 1, 4)

        if exists(cache):
            ck, cv = cache.unbind(dim=1)
            k = torch.cat((ck, k), dim=-2)
            v = torch.cat((cv, v), dim=-2)

        cached_kv = torch.stack((k, v), dim=1)

        if exists(rotary_emb):
            q = apply_rotary_pos_emb(rotary_emb, q)
            k = apply_rotary_pos_emb(rotary_emb, k)

        sim = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale

        i, j = sim.shape[-2:]
        causal_mask = torch.ones((i, j), device=device, dtype=torch.bool).triu(j - i + 1)

        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        if exists(context_mask):
            context_mask = context_mask[:, None, None, :]
            sim = sim.masked_fill(~context_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim=-1)

        out = einsum('b h i j, b h j d -> b h i d', attn, v)

        out = out.transpose(1, 2).reshape(b, i, -1)
        out = self.to_out(out)

        return out, cached_kv


def FeedForward(dim, mult=4):
    dim_inner = dim * mult
    return nn.Sequential(
        nn.RMSNorm(dim),
        nn.Linear(dim, dim_inner),
        nn.GELU(),
        nn.Linear(dim_inner, dim)
    )


class Decoder(Module):
    def __init__(self, *, num_tokens, dim, depth, heads=8, dim_head=64, ff_mult=4, ignore_index=-1):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)

        self.layers = ModuleList([])

        self.rotary_emb = RotaryEmbedding(dim=dim_head)

        for _ in range(depth):
            self.layers.append(ModuleList([
                CausalAttention(dim=dim, dim_head=dim_head, heads=heads),
                FeedForward(dim=dim, mult=ff_mult)
            ]))

        self.to_logits = nn.Sequential(
            nn.RMSNorm(dim),
            nn.Linear(dim, num_tokens, bias=False)
        )

        self.ignore_index = ignore_index

    def forward(self, x, return_loss=False, return_cache=False, seq_start_pos=None, cache=None):
        if return_loss:
            x, labels = x[:, :-1], x[:, 1:]

        x = self.token_emb(x)

        # handle seq start pos offset

        self_attn_kv_mask = None
        if exists(seq_start_pos):
            batch, seq_len = x.shape[:2]
            seq_range = torch.arange(seq_len, device=x.device, dtype=torch.long)
            self_attn_kv_mask = seq_range >= seq_start_pos[..., None]

        rotary_emb = self.rotary_emb(x.shape[-2])

        new_cached_kvs = []

        cache_kvs = cache_embeds = None

        if exists(cache):
            cache_kvs, cache_embeds = cache

        if exists(cache_kvs):
            iter_cache_kvs = iter(cache_kvs.unbind(dim=1))
        else:
            iter_cache_kvs = iter([])

        # if cache passed in, just use the last tokens

        if exists(cache):
            num_tokens_keep = x.shape[-2] - cache_kvs.shape[-2]
            x = x[:, -num_tokens_keep:]

        for attn, ff in self.layers:
            residual = x
            attn_out, cached_kv = attn(x, rotary_emb=rotary_emb, cache=next(iter_cache_kvs, None))
            x = residual + attn_out

            new_cached_kvs.append(cached_kv)

            x = ff(x) + x

        new_cached_kvs = torch.stack(new_cached_kvs, dim=1)

        logits = self.to_logits(x)

        if not return_loss:
            if not return_cache:
                return logits
            return logits, Cache(new_cached_kvs, x)

        return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=self.ignore_index)


def greedy_reference(net, prompt, seq_len, filter_thres):
    out = prompt.clone()
    while out.shape[-1] < seq_len:
        logits = net(out)[:, -1]
        logits = top_k(logits, thres=filter_thres)
        out = torch.cat((out, logits.argmax(-1, keepdim=True)), dim=-1)
    return out[..., prompt.shape[-1]:]


def main():
    torch.manual_seed(0)
    num_tokens = 32
    net = Decoder(num_tokens=num_tokens, dim=32, depth=3, heads=2, dim_head=16).eval()
    small_net = Decoder(num_tokens=num_tokens, dim=32, depth=1, heads=2, dim_head=16).eval()
    # the draft shares the big net's embedding and head so that some drafts are accepted, some rejected
    small_net.token_emb.weight.data.copy_(net.token_emb.weight.data)
    small_net.to_logits.load_state_dict(net.to_logits.state_dict())

    filter_thres = 0.5
    temperature = 1e-6
    seq_len = 28
    for seed, prompt_len in ((1, 5), (2, 7), (3, 3)):
        g = torch.Generator().manual_seed(seed)
        prompt = torch.randint(0, num_tokens, (1, prompt_len), generator=g)

        VERIFY_CHECKS.clear()
        spec_out, mean_accepted = speculative_decoding(net, small_net, prompt, seq_len, gamma=4,
                                                       temperature=temperature, filter_thres=filter_thres)
        base_out = base_decoding(net, prompt, seq_len, temperature=temperature, filter_thres=filter_thres)
        ref_out = greedy_reference(net, prompt, seq_len, filter_thres)

        assert torch.equal(base_out, ref_out), (base_out, ref_out)
        assert torch.equal(spec_out, ref_out), (spec_out, ref_out)

        for seq, logits in VERIFY_CHECKS:
            full = net(seq)
            n = logits.shape[-2]
            torch.testing.assert_close(logits, full[:, -n:], atol=1e-4, rtol=1e-4)

        print(f"prompt {prompt_len}: {len(VERIFY_CHECKS)} verify steps, mean accepted "
              f"{float(mean_accepted):.2f}, output {spec_out.tolist()[0]}")

    print("ok")


if __name__ == "__main__":
    main()
