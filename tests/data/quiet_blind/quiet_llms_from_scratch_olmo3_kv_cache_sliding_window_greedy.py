# Citation: rasbt/LLMs-from-scratch @28c65cdfbc3338e2e040016eea4b7fdf556e4d57: ch05/13_olmo3/standalone-olmo3-plus-kv-cache.ipynb
#   (added in #914, commit bc6f335; last changed by be5e2a33310b9e6d24dc96f3478c97ae15ff0daf, #959): FeedForward,
#   RMSNorm, compute_rope_params (YaRN), apply_rope, GroupedQueryAttention, TransformerBlock, Olmo3Model
#   (create_masks, forward), KVCache, generate_text_basic_stream, OLMO3_CONFIG_7B's layout.
# The book's from-scratch OLMo 3, shrunk (float32 instead of bfloat16, tiny sizes, window 4 instead of 4096, GQA 4:2 as
# in the 32B config). Olmo3Model.create_masks builds two boolean (1, 1, q, k) masks (True = masked) from a
# (pos_end, pos_end) triu: mask_global (future) and mask_local (future OR i - j >= sliding_window), slicing rows
# pos_start:pos_end. A "sliding_attention" block keeps only the last sliding_window unrotated keys/values in its
# cache and takes the last prev_len + num_tokens columns of mask_local; a "full_attention" block keeps everything.
# RoPE is applied to the cached keys at offset start_pos - prev_len. generate_text_basic_stream prefills the prompt
# batch (equal-length, unpadded prompts: the notebook's generator has no padding) and feeds one greedy token per step.
# Self-check: against a hand-written reference (per sequence, no cache, one query and one key at a time, the window
# written as i - W < j <= i), the uncached forward's logits, every cached step's logits and the streamed tokens agree.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)
torch.set_num_threads(1)




class FeedForward(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.fc1 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc2 = nn.Linear(cfg["emb_dim"], cfg["hidden_dim"], dtype=cfg["dtype"], bias=False)
        self.fc3 = nn.Linear(cfg["hidden_dim"], cfg["emb_dim"], dtype=cfg["dtype"], bias=False)

    def forward(self, x):
        x_fc1 = self.fc1(x)
        x_fc2 = self.fc2(x)
        x = nn.functional.silu(x_fc1) * x_fc2
        return self.fc3(x)

class RMSNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x):
        input_dtype = x.dtype
        x_f = x.float()
        var = x_f.pow(2).mean(dim=-1, keepdim=True)
        x_norm = x_f * torch.rsqrt(var + self.eps)
        return (self.weight * x_norm).to(input_dtype)



def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, attention_factor=1.0, rope_type="default", rope_factor=1.0, rope_orig_max=8192, beta_fast=32.0, beta_slow=1.0, dtype=torch.float32):
    assert head_dim % 2 == 0, "Embedding dimension must be even"

    if rope_type == "yarn":
        # Compute YaRN-style frequency scaling (as per https://huggingface.co/papers/2309.00071)

        def find_correction_dim(num_rotations, dim, base, max_position_embeddings):
            """Inverse dimension formula to find the dimension based on the number of rotations"""
            return (dim * math.log(max_position_embeddings / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

        def find_correction_range(low_rot, high_rot, dim, base, max_position_embeddings):
            """Find dimension range bounds based on rotations"""
            low = find_correction_dim(low_rot, dim, base, max_position_embeddings)
            high = find_correction_dim(high_rot, dim, base, max_position_embeddings)
            low = math.floor(low)
            high = math.ceil(high)
            return max(low, 0), min(high, dim - 1)

        def linear_ramp_factor(min_val, max_val, dim):
            if min_val == max_val:
                max_val += 0.001  # Prevent singularity
            linear_func = (torch.arange(dim, dtype=torch.float32) - min_val) / (max_val - min_val)
            ramp_func = torch.clamp(linear_func, 0, 1)
            return ramp_func

        # Base frequencies
        pos_freqs = theta_base ** (torch.arange(0, head_dim, 2, dtype=dtype) / head_dim)
        inv_freq_extrapolation = 1.0 / pos_freqs  # No scaling (extrapolation)
        inv_freq_interpolation = 1.0 / (rope_factor * pos_freqs)  # With scaling (interpolation)

        # Find the range where we blend between interpolation and extrapolation
        low, high = find_correction_range(beta_fast, beta_slow, head_dim, theta_base, rope_orig_max)

        # Get n-dimensional rotational scaling corrected for extrapolation
        inv_freq_extrapolation_factor = 1 - linear_ramp_factor(low, high, head_dim // 2).to(dtype=dtype)
        inv_freq = (
            inv_freq_interpolation * (1 - inv_freq_extrapolation_factor)
            + inv_freq_extrapolation * inv_freq_extrapolation_factor
        )
    else:
        # Default RoPE
        inv_freq = 1.0 / (
            theta_base ** (
                torch.arange(0, head_dim, 2, dtype=dtype)[: head_dim // 2].float()
                / head_dim
            )
        )

    # Generate position indices
    positions = torch.arange(context_length, dtype=dtype)

    # Compute the base angles (shape: [context_length, head_dim // 2])
    angles = positions.unsqueeze(1) * inv_freq.unsqueeze(0)

    # Expand to full head_dim (shape: [context_length, head_dim])
    angles = torch.cat([angles, angles], dim=1)

    # Precompute sine and cosine
    cos = torch.cos(angles) * attention_factor
    sin = torch.sin(angles) * attention_factor

    return cos, sin


def apply_rope(x, cos, sin, offset=0):
    # x: (batch_size, num_heads, seq_len, head_dim)
    batch_size, num_heads, seq_len, head_dim = x.shape
    assert head_dim % 2 == 0, "Head dimension must be even"

    # Split x into first half and second half
    x1 = x[..., : head_dim // 2]  # First half
    x2 = x[..., head_dim // 2 :]  # Second half

    # Adjust sin and cos shapes
    cos = cos[offset:offset + seq_len, :].unsqueeze(0).unsqueeze(0)  # Shape: (1, 1, seq_len, head_dim)
    sin = sin[offset:offset + seq_len, :].unsqueeze(0).unsqueeze(0)

    # Apply the rotary transformation
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rotated = (x * cos) + (rotated * sin)

    # It's ok to use lower-precision after applying cos and sin rotation
    return x_rotated.to(dtype=x.dtype)

class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim, attention_bias=False, dtype=None, sliding_window=None, attn_type="full_attention"):
        super().__init__()
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"

        self.num_heads = num_heads
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups

        self.head_dim = head_dim
        self.d_out = num_heads * head_dim
        self.attn_type = attn_type
        self.sliding_window = sliding_window if attn_type == "sliding_attention" else None

        # Projections
        self.W_query = nn.Linear(d_in, self.d_out, bias=attention_bias, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * head_dim, bias=attention_bias, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=attention_bias, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=attention_bias, dtype=dtype)

        # Olmo3-style RMSNorm over the flattened projections
        self.q_norm = RMSNorm(self.d_out)
        self.k_norm = RMSNorm(num_kv_groups * head_dim)

    def forward(self, x, mask, cos, sin, start_pos=0, cache=None):
        b, num_tokens, _ = x.shape

        # Apply projections
        queries = self.W_query(x)  # (b, num_tokens, num_heads * head_dim)
        keys = self.W_key(x)       # (b, num_tokens, num_kv_groups * head_dim)
        values = self.W_value(x)   # (b, num_tokens, num_kv_groups * head_dim)

        # Normalize q and k
        queries = self.q_norm(queries)
        keys_new = self.k_norm(keys)

        # Reshape to (b, heads, seq, head_dim)
        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys_new = keys_new.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values_new = values.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)

        # Cache unrotated K/V
        prev_len = 0
        if cache is not None:
            prev_k, prev_v = cache
            if prev_k is not None:
                prev_len = prev_k.size(2)
                keys_cat_raw = torch.cat([prev_k, keys_new], dim=2)
                values_cat_raw = torch.cat([prev_v, values_new], dim=2)
            else:
                keys_cat_raw = keys_new
                values_cat_raw = values_new
        else:
            keys_cat_raw = keys_new
            values_cat_raw = values_new

        # Apply RoPE with offsets for cached tokens
        queries = apply_rope(queries, cos, sin, offset=start_pos)
        keys = apply_rope(keys_cat_raw, cos, sin, offset=start_pos - prev_len)

        # Expand KV groups to full head count
        if self.group_size > 1:
            keys = keys.repeat_interleave(self.group_size, dim=1)
            values = values_cat_raw.repeat_interleave(self.group_size, dim=1)
        else:
            values = values_cat_raw

        # Scaling before the matmul seems to be a bit more stable for Olmo
        scale = self.head_dim ** -0.5  # Python float
        queries = queries * scale

        # Update cache with unrotated K/V
        if cache is not None and cache[0] is not None:
            next_cache = (
                torch.cat([cache[0], keys_new], dim=2),
                torch.cat([cache[1], values_new], dim=2),
            )
        else:
            next_cache = (keys_new, values_new)

        # Attention
        attn_scores = queries @ keys.transpose(2, 3)
        if mask is not None:
            attn_scores = attn_scores.masked_fill(mask, -torch.inf)

        attn_weights = torch.softmax(attn_scores, dim=-1)
        context = (attn_weights @ values).transpose(1, 2).reshape(b, num_tokens, self.d_out)
        out = self.out_proj(context)

        return out, next_cache

class TransformerBlock(nn.Module):
    def __init__(self, cfg, attn_type):
        super().__init__()
        self.attn_type = attn_type
        self.sliding_window = cfg["sliding_window"]
        self.att = GroupedQueryAttention(
            d_in=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            num_kv_groups=cfg["n_kv_heads"],
            head_dim=cfg["head_dim"],
            attention_bias=cfg["attention_bias"],
            dtype=cfg["dtype"],
            sliding_window=cfg["sliding_window"],
            attn_type=attn_type,
        )
        self.ff = FeedForward(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"])
        self.post_feedforward_layernorm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"])

    def forward(self, x, mask_global, mask_local, cos, sin, start_pos=0, cache=None):
        shortcut = x
        if self.attn_type == "sliding_attention":
            if cache is not None and isinstance(cache, tuple):
                prev_k, _ = cache
                prev_len = prev_k.size(2) if prev_k is not None else 0
            else:
                prev_len = 0
            eff_kv_len = prev_len + x.size(1)
            attn_mask = mask_local[..., -eff_kv_len:]
        else:
            attn_mask = mask_global

        x_attn, next_cache = self.att(x, attn_mask, cos, sin, start_pos=start_pos, cache=cache)
        if next_cache is not None and self.attn_type == "sliding_attention":
            k, v = next_cache
            if k.size(2) > self.sliding_window:
                k = k[:, :, -self.sliding_window:, :]
                v = v[:, :, -self.sliding_window:, :]
            next_cache = (k, v)

        x_attn = self.post_attention_layernorm(x_attn)
        x = shortcut + x_attn

        shortcut = x
        x_ffn = self.ff(x)
        x_ffn = self.post_feedforward_layernorm(x_ffn)
        x = shortcut + x_ffn
        return x, next_cache

class Olmo3Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        assert cfg["layer_types"] is not None and len(cfg["layer_types"]) == cfg["n_layers"]

        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.blocks = nn.ModuleList([TransformerBlock(cfg, attn_type) for attn_type in cfg["layer_types"]])
        self.final_norm = RMSNorm(cfg["emb_dim"], eps=cfg["rms_norm_eps"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        self.cfg = cfg
        self.current_pos = 0

        cos, sin = compute_rope_params(
            head_dim=cfg["head_dim"],
            context_length=cfg["context_length"],
            theta_base=cfg["rope_base"],
            attention_factor=cfg["rope_attention_factor"],
            rope_type=cfg["rope_type"],
            rope_factor=cfg["rope_factor"],
            rope_orig_max=cfg["rope_orig_max"],
            dtype=torch.float32,
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def create_masks(self, cur_len, device, pos_start=0, pos_end=None):
        if pos_end is None:
            pos_end = cur_len
        total_len = pos_end

        ones = torch.ones((total_len, total_len), dtype=torch.bool, device=device)
        # mask_global_full (future is masked: j > i)
        mask_global_full = torch.triu(ones, diagonal=1)

        # far_past (too far back is masked: i - j >= sliding_window)
        far_past_full = torch.triu(ones, diagonal=self.cfg["sliding_window"]).T

        # Local (sliding_window) = future OR far-past
        # mask_local
        mask_local_full = mask_global_full | far_past_full

        row_slice = slice(pos_start, pos_end)
        mask_global = mask_global_full[row_slice, :pos_end][None, None, :, :]
        mask_local = mask_local_full[row_slice, :pos_end][None, None, :, :]
        return mask_global, mask_local

    def forward(self, input_ids, cache=None):
        b, seq_len = input_ids.shape
        x = self.tok_emb(input_ids)

        if cache is not None:
            pos_start = self.current_pos
            pos_end = pos_start + seq_len
            self.current_pos = pos_end
            mask_global, mask_local = self.create_masks(
                cur_len=seq_len, device=x.device, pos_start=pos_start, pos_end=pos_end
            )
        else:
            pos_start = 0
            mask_global, mask_local = self.create_masks(
                cur_len=seq_len, device=x.device, pos_start=0, pos_end=seq_len
            )

        cos = self.cos
        sin = self.sin

        for i, block in enumerate(self.blocks):
            blk_cache = cache.get(i) if cache is not None else None
            x, new_blk_cache = block(
                x,
                mask_global=mask_global,
                mask_local=mask_local,
                cos=cos,
                sin=sin,
                start_pos=pos_start,
                cache=blk_cache,
            )

            if cache is not None:
                cache.update(i, new_blk_cache)

        x = self.final_norm(x)
        logits = self.out_head(x.to(self.cfg["dtype"]))
        return logits

    def reset_kv_cache(self):
        self.current_pos = 0

class KVCache:
    def __init__(self, n_layers):
        self.cache = [None] * n_layers

    def get(self, layer_idx):
        return self.cache[layer_idx]

    def update(self, layer_idx, value):
        self.cache[layer_idx] = value

    def get_all(self):
        return self.cache

    def reset(self):
        for i in range(len(self.cache)):
            self.cache[i] = None

def generate_text_basic_stream(model, token_ids, max_new_tokens, eos_token_id=None, context_size=None):

    model.eval()
    with torch.no_grad():
        cache = KVCache(n_layers=model.cfg["n_layers"])
        model.reset_kv_cache()

        logits = model(token_ids, cache=cache)

        for _ in range(max_new_tokens):
            next_token = torch.argmax(logits[:, -1], dim=-1, keepdim=True)

            if (eos_token_id is not None
                   and torch.all(next_token == eos_token_id)):
               break

            yield next_token

            token_ids = torch.cat([token_ids, next_token], dim=1)

            logits = model(next_token, cache=cache)

OLMO3_CONFIG_TINY = {
    "vocab_size": 97,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 8,
    "hidden_dim": 48,
    "head_dim": 8,
    "n_kv_heads": 2,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "sliding_window": 4,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "sliding_attention",
        "sliding_attention",
        "sliding_attention",
        "full_attention",
    ],
    "rope_base": 500_000.0,
    "rope_attention_factor": 1.2079441541679836,
    "rope_type": "yarn",
    "rope_factor": 8.0,
    "rope_orig_max": 16,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "rms_norm_eps": 1e-6,
    "dtype": torch.float32,
    "eos_token_id": 95,
    "pad_token_id": 96,
}


# ---------------------------------------------------------------- reference, written by hand
def ref_rmsnorm(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean() + eps))


def ref_rotate(vec, pos, cos_table, sin_table):
    # rotate each (d, d + half) pair of one head vector by the angle of absolute position `pos`
    half = vec.numel() // 2
    c, s = cos_table[pos], sin_table[pos]
    out = torch.empty_like(vec)
    for d in range(half):
        a, b = vec[d], vec[d + half]
        out[d] = a * c[d] - b * s[d]
        out[d + half] = b * c[d + half] + a * s[d + half]
    return out


def ref_logits(model, ids):
    """Logits for one unpadded sequence (a list of ids), no cache, attention one (query, key) pair at a time."""
    cfg = model.cfg
    W = cfg["sliding_window"]
    hd = cfg["head_dim"]
    group = cfg["n_heads"] // cfg["n_kv_heads"]
    eps = cfg["rms_norm_eps"]
    T = len(ids)
    with torch.no_grad():
        x = model.tok_emb.weight[torch.tensor(ids)].clone()
        for blk, kind in zip(model.blocks, cfg["layer_types"]):
            att = blk.att
            qs, ks, vs = [], [], []
            for t in range(T):
                q = ref_rmsnorm(att.W_query.weight @ x[t], att.q_norm.weight, att.q_norm.eps)
                k = ref_rmsnorm(att.W_key.weight @ x[t], att.k_norm.weight, att.k_norm.eps)
                v = att.W_value.weight @ x[t]
                qs.append([ref_rotate(q[h * hd:(h + 1) * hd], t, model.cos, model.sin) for h in range(cfg["n_heads"])])
                ks.append([ref_rotate(k[g * hd:(g + 1) * hd], t, model.cos, model.sin) for g in range(cfg["n_kv_heads"])])
                vs.append([v[g * hd:(g + 1) * hd] for g in range(cfg["n_kv_heads"])])
            new_x = torch.empty_like(x)
            for i in range(T):
                heads = []
                for h in range(cfg["n_heads"]):
                    g = h // group
                    if kind == "sliding_attention":
                        seen = [j for j in range(T) if i - W < j <= i]
                    else:
                        seen = [j for j in range(T) if j <= i]
                    scores = torch.stack([(qs[i][h] * ks[j][g]).sum() / math.sqrt(hd) for j in seen])
                    p = torch.exp(scores - scores.max())
                    p = p / p.sum()
                    heads.append(sum(p[n] * vs[j][g] for n, j in enumerate(seen)))
                a = att.out_proj.weight @ torch.cat(heads)
                h1 = x[i] + ref_rmsnorm(a, blk.post_attention_layernorm.weight, eps)
                f = blk.ff.fc3.weight @ (torch.nn.functional.silu(blk.ff.fc1.weight @ h1) * (blk.ff.fc2.weight @ h1))
                new_x[i] = h1 + ref_rmsnorm(f, blk.post_feedforward_layernorm.weight, eps)
            x = new_x
        x = torch.stack([ref_rmsnorm(x[t], model.final_norm.weight, model.final_norm.eps) for t in range(T)])
        return x @ model.out_head.weight.T


def main():
    cfg = OLMO3_CONFIG_TINY
    model = Olmo3Model(cfg)
    model.eval()

    prompts = torch.randint(0, cfg["vocab_size"] - 2, (2, 9))   # two prompts of 9 tokens, window 4
    max_new_tokens = 10

    # 1) the notebook's uncached forward (cell `model(torch.tensor([1, 2, 3]).unsqueeze(0))`) on the whole batch
    with torch.no_grad():
        full = model(prompts)
    for b in range(prompts.size(0)):
        ref = ref_logits(model, prompts[b].tolist())
        err = (full[b] - ref).abs().max().item()
        assert err < 1e-4, ("uncached forward", b, err)

    # 2) the notebook's streaming greedy generator with its KVCache
    streamed = [tok for tok in generate_text_basic_stream(
        model=model, token_ids=prompts, max_new_tokens=max_new_tokens, eos_token_id=cfg["eos_token_id"])]
    generated = torch.cat(streamed, dim=1) if streamed else prompts[:, :0]

    # 3) the same cached loop, keeping each step's logits to compare with the reference on the whole prefix
    cache = KVCache(n_layers=cfg["n_layers"])
    model.reset_kv_cache()
    step_logits = []
    with torch.no_grad():
        logits = model(prompts, cache=cache)
        step_logits.append(logits[:, -1])
        for t in range(generated.size(1)):
            logits = model(generated[:, t:t + 1], cache=cache)
            step_logits.append(logits[:, -1])
    assert all(c is None or c[0].size(2) <= cfg["sliding_window"]
               for c, kind in zip(cache.get_all(), cfg["layer_types"]) if kind == "sliding_attention")

    worst = 0.0
    for b in range(prompts.size(0)):
        seq = prompts[b].tolist()
        ref_tokens = []
        for step in range(max_new_tokens):
            ref_last = ref_logits(model, seq)[-1]
            if step < len(step_logits):
                worst = max(worst, (step_logits[step][b] - ref_last).abs().max().item())
            top2 = torch.topk(ref_last, 2).values
            assert (top2[0] - top2[1]).item() > 1e-3, "near tie in the reference's greedy pick"
            nxt = int(ref_last.argmax())
            ref_tokens.append(nxt)
            seq = seq + [nxt]
        # the stream stops early only when every row picks eos at once
        n = generated.size(1)
        assert generated[b].tolist() == ref_tokens[:n], (b, generated[b].tolist(), ref_tokens)
    assert worst < 1e-4, worst
    print("prompt length", prompts.size(1), "window", cfg["sliding_window"], "generated", generated.size(1),
          "tokens per row; max |logit - reference|", f"{worst:.2e}")
    print(generated.tolist())


if __name__ == "__main__":
    main()
