# google/tunix commit e31e280e ("[Tunix] A few fixes to Gemma4 model implementation"); tunix/models/gemma4/model.py
# and tunix/rl/common.py read at e31e280e^ (JAX/Flax NNX, ported to torch; Pallas splash attention replaced by a
# dense torch stand-in with the same mask objects and SegmentIds semantics).
# Bug: the RL log-prob path (compute_per_token_logps -> process_ids) hands the model `segment_ids` (the per-position
# non-pad mask, because the splash kernel cannot take the 2-D attn_mask), but Gemma4.__call__ did
# `del segment_ids  # unused until seq packing lands`, so with use_flash_attention=True the splash kernel ran with its
# CausalMask / LocalMask only and the completion tokens of a left-padded row attended the prompt's pad tokens.
# Fix: segment_ids are threaded through DecoderLayer -> Attention and given to the kernel as
# splash.SegmentIds(q=segment_ids, kv=segment_ids).
import inspect
import sys
from collections import namedtuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
K_MASK = -2.3819763e38


# ----------------------------------------------------------------------------- splash attention (stand-in)
class CausalMask:
    def __init__(self, shape, offset=0):
        self.shape = shape
        self.offset = offset

    def dense(self):
        q, k = self.shape
        return torch.ones(q, k, dtype=torch.bool).tril(self.offset)


class LocalMask:
    def __init__(self, shape, window_size, offset):
        self.shape = shape
        self.window_size = window_size
        self.offset = offset

    def dense(self):
        q, k = self.shape
        left, right = self.window_size
        qi = torch.arange(q)[:, None] + self.offset
        ki = torch.arange(k)[None, :]
        ok = torch.ones(q, k, dtype=torch.bool)
        if left is not None:
            ok &= ki >= qi - left
        if right is not None:
            ok &= ki <= qi + right
        return ok


class MultiHeadMask:
    def __init__(self, masks):
        self.masks = masks


SegmentIds = namedtuple("SegmentIds", ["q", "kv"])


def make_splash_mha(multi_head_mask, block_sizes=None, head_shards=1, q_seq_shards=1):
    dense = torch.stack([m.dense() for m in multi_head_mask.masks])  # [H, Tq, Tk]

    def kernel(q, k, v, segment_ids=None):
        # q: [H, Tq, D], k/v: [H, Tk, D] for one example (the caller vmaps over the batch); no softmax scaling
        mask = dense
        if segment_ids is not None:
            mask = mask & (segment_ids.q[:, None] == segment_ids.kv[None, :])[None]
        logits = torch.einsum("hqd,hkd->hqk", q, k)
        logits = torch.where(mask, logits, torch.full_like(logits, K_MASK))
        return torch.einsum("hqk,hkd->hqd", logits.softmax(-1), v)

    return kernel


# ----------------------------------------------------------------------------- tunix/models/gemma4/model.py
class AttentionType:
    GLOBAL = "global"
    LOCAL_SLIDING = "local_sliding"


class ModelConfig:
    num_layers = 2
    num_embed = 64
    embed_dim = 32
    hidden_dim = 64
    num_heads = 4
    head_dim = 8
    num_kv_heads = 2
    attention_types = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)
    sliding_window_size = 4
    use_flash_attention = True
    flash_attention_block_size = 128
    final_logit_softcap = 30.0


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * (1 + self.scale)


def apply_rope(inputs, positions, base_frequency=10_000, scale_factor=1.0):
    # inputs: [B, T, N, H], positions: [B, T]
    head_dim = inputs.shape[-1]
    fraction = 2 * torch.arange(0, head_dim // 2, dtype=torch.float32) / head_dim
    timescale = base_frequency ** fraction
    sinusoid_inp = positions[..., None].float() / timescale[None, None, :]
    sinusoid_inp = sinusoid_inp[..., None, :] / scale_factor
    sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
    first_half, second_half = inputs.chunk(2, dim=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return torch.cat([first_part, second_part], dim=-1)


class Attention(nn.Module):
    def __init__(self, config, attn_type):
        super().__init__()
        self.config = config
        self.attn_type = attn_type
        self.num_kv_heads = config.num_kv_heads
        self.q_einsum = nn.Linear(config.embed_dim, config.num_heads * config.head_dim, bias=False)
        self.kv_einsum = nn.Linear(config.embed_dim, 2 * config.num_kv_heads * config.head_dim, bias=False)
        self.attn_vec_einsum = nn.Linear(config.num_heads * config.head_dim, config.embed_dim, bias=False)
        self._query_norm = RMSNorm(config.head_dim)
        self._key_norm = RMSNorm(config.head_dim)
        self.rope_base_frequency = 10_000 if attn_type == AttentionType.LOCAL_SLIDING else 1_000_000

    @property
    def use_gqa(self):
        return self.num_kv_heads != self.config.num_heads and self.num_kv_heads > 1

    def block(self, x, segment_pos, cache, attn_mask, kv_shared_cache=None, segment_ids=None):
        b, seq_len, _ = x.shape
        query_proj = self.q_einsum(x).view(b, seq_len, self.config.num_heads, self.config.head_dim)
        query_proj = self._query_norm(query_proj)
        query_proj = apply_rope(query_proj, segment_pos, base_frequency=self.rope_base_frequency)
        key_proj, value_proj = self.kv_einsum(x).view(b, seq_len, 2, self.num_kv_heads, self.config.head_dim).unbind(2)
        value_var = value_proj.pow(2).mean(-1, keepdim=True)
        value_proj = value_proj * torch.rsqrt(value_var + 1e-06)
        key_proj = self._key_norm(key_proj)
        key_proj = apply_rope(key_proj, segment_pos, base_frequency=self.rope_base_frequency)
        new_cache = None

        _, _, qh, _ = query_proj.shape

        if self.config.use_flash_attention and seq_len > 1:
            query_proj = query_proj.transpose(1, 2)
            # the splash kernel takes grouped kv heads; repeat them to the query heads
            key_proj = key_proj.repeat_interleave(qh // self.num_kv_heads, dim=2).transpose(1, 2)
            value_proj = value_proj.repeat_interleave(qh // self.num_kv_heads, dim=2).transpose(1, 2)

            if self.attn_type == AttentionType.LOCAL_SLIDING:
                mask = LocalMask((seq_len, seq_len), window_size=(self.config.sliding_window_size - 1, 0), offset=0)
            else:
                mask = CausalMask((seq_len, seq_len))
            multi_head_mask = MultiHeadMask([mask for _ in range(qh)])
            splash_attn_kernel = make_splash_mha(multi_head_mask)

            if segment_ids is not None:
                def sharded_splash_attn(kernel, q_block, k_block, v_block, q_seg_block, kv_seg_block):
                    outs = []
                    for i in range(q_block.shape[0]):  # jax.vmap(kernel)
                        seg_ids = SegmentIds(q=q_seg_block[i], kv=kv_seg_block[i])
                        outs.append(kernel(q_block[i], k_block[i], v_block[i], segment_ids=seg_ids))
                    return torch.stack(outs)

                qkv = sharded_splash_attn(splash_attn_kernel, query_proj, key_proj, value_proj, segment_ids, segment_ids)
            else:
                def sharded_splash_attn(kernel, q_block, k_block, v_block):
                    return torch.stack([kernel(q_block[i], k_block[i], v_block[i]) for i in range(q_block.shape[0])])

                qkv = sharded_splash_attn(splash_attn_kernel, query_proj, key_proj, value_proj)
            encoded = qkv.transpose(1, 2)
        else:
            t = seq_len
            n_groups = qh // self.num_kv_heads
            query_reshaped = query_proj.reshape(b, t, self.num_kv_heads, n_groups, -1)
            logits = torch.einsum("BTKGH,BSKH->BTKGS", query_reshaped, key_proj).reshape(b, t, qh, -1)
            attn_mask = attn_mask[..., :seq_len]
            if self.attn_type == AttentionType.LOCAL_SLIDING:
                all_ones = torch.ones_like(attn_mask)
                sliding_mask = torch.triu(all_ones, -1 * self.config.sliding_window_size + 1) * torch.tril(
                    all_ones, self.config.sliding_window_size - 1)
                attn_mask = sliding_mask * attn_mask
            attn = torch.where(attn_mask.unsqueeze(-2).bool(), logits, torch.full_like(logits, K_MASK))
            attn = attn.float().softmax(-1)
            probs_reshaped = attn.reshape(b, t, self.num_kv_heads, n_groups, -1)
            encoded = torch.einsum("BTKGS,BSKH->BTKGH", probs_reshaped, value_proj).reshape(b, t, qh, -1)

        attn_output = self.attn_vec_einsum(encoded.reshape(b, seq_len, -1))
        return new_cache, attn_output, (key_proj, value_proj)

    def forward(self, x, segment_pos, cache, attn_mask, kv_shared_cache=None, segment_ids=None):
        return self.block(x, segment_pos, cache, attn_mask, kv_shared_cache=kv_shared_cache, segment_ids=segment_ids)


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gating_einsum = nn.Linear(config.embed_dim, 2 * config.hidden_dim, bias=False)
        self.linear = nn.Linear(config.hidden_dim, config.embed_dim, bias=False)

    def forward(self, x):
        gate, up = self.gating_einsum(x).chunk(2, dim=-1)
        return self.linear(F.gelu(gate, approximate="tanh") * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, attn_type):
        super().__init__()
        self.pre_attention_norm = RMSNorm(config.embed_dim)
        self.attn = Attention(config, attn_type)
        self.post_attention_norm = RMSNorm(config.embed_dim)
        self.pre_ffw_norm = RMSNorm(config.embed_dim)
        self.mlp = FeedForward(config)
        self.post_ffw_norm = RMSNorm(config.embed_dim)

    def forward(self, x, segment_pos, cache, attn_mask, per_layer_input=None, kv_shared_cache=None, segment_ids=None):
        norm = self.pre_attention_norm(x)
        cache, attn, kv = self.attn(norm, segment_pos, cache, attn_mask, kv_shared_cache=kv_shared_cache,
                                    segment_ids=segment_ids)
        attn = self.post_attention_norm(attn)
        attn = attn + x
        ffw = self.post_ffw_norm(self.mlp(self.pre_ffw_norm(attn)))
        return cache, ffw + attn, kv


class Embedder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.input_embedding = nn.Parameter(torch.randn(config.num_embed, config.embed_dim) * 0.5)
        self.embed_dim = config.embed_dim

    def encode(self, x):
        return self.input_embedding[x] * self.embed_dim ** 0.5

    def decode(self, x):
        return x @ self.input_embedding.T


class Gemma4(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedder = Embedder(config)
        self.layers = nn.ModuleList([DecoderLayer(config, config.attention_types[i % len(config.attention_types)])
                                     for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.embed_dim)

    def forward(self, tokens, positions=None, cache=None, attention_mask=None, decode_only_last_token=False,
                segment_ids=None):
        if not FIXED:
            # Accepted for RL pipeline compatibility; unused until seq packing lands.
            del segment_ids
            segment_ids = None
        if positions is None:
            B, T = tokens.shape
            positions = torch.arange(T)[None, :].expand(B, T)
        x = self.embedder.encode(tokens)
        for layer in self.layers:
            _, x, _ = layer(x, positions, None, attention_mask, segment_ids=segment_ids)
        x = self.final_norm(x)
        logits = self.embedder.decode(x).float()
        if self.config.final_logit_softcap is not None:
            logits = logits / self.config.final_logit_softcap
            logits = torch.tanh(logits) * self.config.final_logit_softcap
        return logits, None


# ----------------------------------------------------------------------------- tunix/sft/utils.py, tunix/rl/common.py
def make_causal_attn_mask(input_mask):
    seq_len = input_mask.shape[-1]
    attn_mask = input_mask[..., None, :]
    causal_mask = torch.tril(torch.ones((seq_len, seq_len), dtype=torch.bool))
    return attn_mask & causal_mask[None, ...]


def build_positions_from_mask(input_mask):
    positions = torch.cumsum(input_mask.long(), dim=-1)
    return positions - (positions >= 1).long()


def selective_log_softmax(logits, input_ids):
    logps = F.log_softmax(logits, dim=-1)
    return torch.gather(logps, -1, input_ids[..., None])[..., 0]


def process_ids(prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids=None, segment_positions=None):
    prompt_completion_ids = torch.cat([prompt_tokens, completion_tokens], dim=1)
    if segment_ids is not None:
        if segment_positions is None:
            raise ValueError("segment_positions must be explicitly provided for packed sequences. ")
        attn_mask = None  # Relies on segment_ids inside the model
        return prompt_completion_ids, segment_positions, attn_mask, None

    prompt_mask = prompt_tokens != pad_id
    completion_mask = completion_tokens != pad_id
    prompt_completion_mask = torch.cat([prompt_mask, completion_mask], dim=-1)
    positions = build_positions_from_mask(prompt_completion_mask)
    attn_mask = make_causal_attn_mask(prompt_completion_mask)
    # 1-D per-position non-pad mask, used as ``segment_ids`` by attention kernels that cannot consume the 2-D mask
    input_seg_ids = prompt_completion_mask.int()
    return prompt_completion_ids, positions, attn_mask, input_seg_ids


@torch.no_grad()
def compute_per_token_logps(model, prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids=None,
                            segment_positions=None, temperature=1.0):
    input_tokens, calculated_positions, attn_mask, input_seg_ids = process_ids(
        prompt_tokens, completion_tokens, pad_id, eos_id, segment_ids, segment_positions)
    model_kwargs = {"positions": calculated_positions, "cache": None, "attention_mask": attn_mask}
    try:
        sig = inspect.signature(model.forward)
        has_segment_ids = ("segment_ids" in sig.parameters) or any(
            p.kind == inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
    except Exception:
        has_segment_ids = False
    if has_segment_ids:
        if segment_ids is not None:
            model_kwargs["segment_ids"] = segment_ids
        elif input_seg_ids is not None:
            model_kwargs["segment_ids"] = input_seg_ids

    logits, _ = model(input_tokens, **model_kwargs)
    logits_to_keep = completion_tokens.shape[1]
    logits = logits[:, -logits_to_keep - 1: -1, :]
    if temperature != 0.0 and temperature != 1.0:
        logits = logits / temperature
    input_tokens_to_keep = input_tokens[:, -logits_to_keep:]
    return selective_log_softmax(logits, input_tokens_to_keep)


def compute_kl_divergence(per_token_logps, ref_per_token_logps):
    kl = ref_per_token_logps - per_token_logps
    return (torch.exp(kl) - kl - 1.0).clamp(-10.0, 10.0)


def main():
    torch.manual_seed(0)
    config = ModelConfig()
    policy = Gemma4(config).eval()
    torch.manual_seed(1)
    reference = Gemma4(config).eval()

    pad_id, eos_id = 0, 1
    # left-padded prompts, right-padded completions (as the rollout returns them)
    prompt_tokens = torch.tensor([[0, 0, 0, 0, 0, 11, 12, 13],
                                  [21, 22, 23, 24, 25, 26, 27, 28]])
    completion_tokens = torch.tensor([[31, 32, 33, 34, eos_id, 0],
                                      [41, 42, 43, 44, 45, eos_id]])
    completion_mask = (completion_tokens != pad_id).float()

    logps = compute_per_token_logps(policy, prompt_tokens, completion_tokens, pad_id, eos_id)
    ref_logps = compute_per_token_logps(reference, prompt_tokens, completion_tokens, pad_id, eos_id)
    kl = (compute_kl_divergence(logps, ref_logps) * completion_mask).sum() / completion_mask.sum()

    print("fixed" if FIXED else "buggy")
    print("policy per-token logps (row 0 has a left-padded prompt):\n", (logps * completion_mask).numpy().round(4))
    print(f"mean per-token KL(policy || reference) = {kl.item():.6f}")


if __name__ == "__main__":
    main()
