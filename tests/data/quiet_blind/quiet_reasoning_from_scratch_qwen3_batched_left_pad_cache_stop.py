# Citation: rasbt/reasoning-from-scratch @f79c9cd0ae7d824aa4e9a9bc2ca4a85167f81958:
#   reasoning_from_scratch/qwen3_batched.py (Qwen3Model.forward, GroupedQueryAttention.forward,
#   apply_rope_with_pos_ids, generate_text_basic_batched_cache, generate_text_basic_batched_cache_stop,
#   shrink_kv_cache_inplace), reasoning_from_scratch/qwen3.py (KVCache),
#   ch03/02_math500-verifier-scripts/evaluate_math500_batched.py (encode and left-pad).
# The book's padding-aware batched Qwen3: prompts are left-padded with pad_id and attn_mask = token_ids != pad_id.
# Each forward builds the causal mask for [Q = num_tokens, K = pos_end] from a triu over the cache length, ORs in
# the key padding mask (attn_mask == 0) and zeroes the padded query rows' inputs; positions are one shared
# arange(pos_start, pos_end) for every row (RoPE is relative, so a left-padded row's shift cancels in q.k).
# Decode appends a 1 column to the mask per step; the _stop variant drops finished rows from the batch, the KV
# cache and the mask. A tiny model (float32) is built from the config dict with random weights.
# Checked against each prompt alone, unpadded, with no cache (a greedy loop re-running the whole sequence):
# the prefill's last logits, every generated token, and the _stop variant's EOS-filled outputs.
import torch
import torch.nn as nn

torch.manual_seed(0)

QWEN_CONFIG_TINY = {
    "vocab_size": 96,
    "context_length": 64,
    "emb_dim": 32,
    "n_heads": 4,
    "n_layers": 2,
    "hidden_dim": 64,
    "head_dim": 8,
    "qk_norm": True,
    "n_kv_groups": 2,
    "rope_base": 10_000.0,
    "dtype": torch.float32,
}


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


class Qwen3Model(nn.Module):
    def __init__(self, cfg, float32_upcast=True):
        super().__init__()
        self.tok_emb = nn.Embedding(cfg["vocab_size"], cfg["emb_dim"], dtype=cfg["dtype"])
        self.trf_blocks = nn.ModuleList(
            [TransformerBlock(cfg, float32_upcast=float32_upcast) for _ in range(cfg["n_layers"])]
        )
        self.final_norm = RMSNorm(cfg["emb_dim"])
        self.out_head = nn.Linear(cfg["emb_dim"], cfg["vocab_size"], bias=False, dtype=cfg["dtype"])
        if cfg["head_dim"] is None:
            head_dim = cfg["emb_dim"] // cfg["n_heads"]
        else:
            head_dim = cfg["head_dim"]
        cos, sin = compute_rope_params(
            head_dim=head_dim, theta_base=cfg["rope_base"], context_length=cfg["context_length"]
        )
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.cfg = cfg

    def forward(self, in_idx, cache=None, attn_mask=None):
        tok_embeds = self.tok_emb(in_idx)
        x = tok_embeds
        B, num_tokens = x.shape[0], x.shape[1]

        # Derive pos_start from cache content (layer 0 K length) if present
        if cache is not None and cache.get(0) is not None:
            prev_k0, _ = cache.get(0)                 # (B, G_kv, L_prev, D)
            pos_start = prev_k0.size(2)               # L_prev
        else:
            pos_start = 0

        pos_end = pos_start + num_tokens

        # Build causal mask for [Q=num_tokens, K=pos_end]
        base = torch.triu(
            torch.ones(pos_end, pos_end, device=x.device, dtype=torch.bool), diagonal=1
        )
        causal4d = base[pos_start:pos_end, :pos_end][None, None, :, :]

        has_pad = attn_mask is not None and (~attn_mask[:, :pos_end]).any().item()
        if has_pad:
            # Mask out padded keys so they don't appear in the softmax denominator
            kpm = (attn_mask[:, :pos_end] == 0).view(B, 1, 1, pos_end)
            mask = causal4d | kpm
        else:
            mask = causal4d

        pos_ids_current = torch.arange(pos_start, pos_end, device=x.device).unsqueeze(0).expand(B, -1)

        # zero-out padded query rows so their Q/K/V become zeros and don't affect cache
        if attn_mask is not None:
            qmask = attn_mask[:, pos_start:pos_end].unsqueeze(-1)
            x = x * qmask.to(x.dtype)

        for i, block in enumerate(self.trf_blocks):
            blk_cache = cache.get(i) if cache else None
            x, new_blk_cache = block(x, mask, self.cos, self.sin, cache=blk_cache, pos_ids=pos_ids_current)
            if cache is not None:
                cache.update(i, new_blk_cache)

        x = self.final_norm(x)
        logits = self.out_head(x.to(self.cfg["dtype"]))
        return logits

    def reset_kv_cache(self):
        pass


class TransformerBlock(nn.Module):
    def __init__(self, cfg, float32_upcast=True):
        super().__init__()
        self.att = GroupedQueryAttention(
            d_in=cfg["emb_dim"],
            num_heads=cfg["n_heads"],
            head_dim=cfg["head_dim"],
            num_kv_groups=cfg["n_kv_groups"],
            qk_norm=cfg["qk_norm"],
            dtype=cfg["dtype"],
            float32_upcast=float32_upcast,
        )
        self.ff = FeedForward(cfg)
        self.norm1 = RMSNorm(cfg["emb_dim"], eps=1e-6)
        self.norm2 = RMSNorm(cfg["emb_dim"], eps=1e-6)

    def forward(self, x, mask, cos, sin, cache=None, pos_ids=None):
        shortcut = x
        x = self.norm1(x)
        x, next_cache = self.att(x, mask, cos, sin, cache=cache, pos_ids=pos_ids)
        x = x + shortcut
        shortcut = x
        x = self.norm2(x)
        x = self.ff(x)
        x = x + shortcut
        return x, next_cache


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


class GroupedQueryAttention(nn.Module):
    def __init__(self, d_in, num_heads, num_kv_groups, head_dim=None, qk_norm=False, dtype=None,
                 float32_upcast=True):
        super().__init__()
        assert num_heads % num_kv_groups == 0, "num_heads must be divisible by num_kv_groups"
        self.num_heads = num_heads
        self.num_kv_groups = num_kv_groups
        self.group_size = num_heads // num_kv_groups
        if head_dim is None:
            assert d_in % num_heads == 0
            head_dim = d_in // num_heads
        self.head_dim = head_dim
        self.d_out = num_heads * head_dim
        self.W_query = nn.Linear(d_in, self.d_out, bias=False, dtype=dtype)
        self.W_key = nn.Linear(d_in, num_kv_groups * head_dim, bias=False, dtype=dtype)
        self.W_value = nn.Linear(d_in, num_kv_groups * head_dim, bias=False, dtype=dtype)
        self.out_proj = nn.Linear(self.d_out, d_in, bias=False, dtype=dtype)
        if qk_norm:
            self.q_norm = RMSNorm(head_dim, eps=1e-6)
            self.k_norm = RMSNorm(head_dim, eps=1e-6)
        else:
            self.q_norm = self.k_norm = None
        self.float32_upcast = float32_upcast

    def forward(self, x, mask, cos, sin, cache=None, pos_ids=None):
        b, num_tokens, _ = x.shape
        queries = self.W_query(x)
        keys = self.W_key(x)
        values = self.W_value(x)

        queries = queries.view(b, num_tokens, self.num_heads, self.head_dim).transpose(1, 2)
        keys_new = keys.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)
        values_new = values.view(b, num_tokens, self.num_kv_groups, self.head_dim).transpose(1, 2)

        if self.q_norm:
            queries = self.q_norm(queries)
        if self.k_norm:
            keys_new = self.k_norm(keys_new)

        # Apply RoPE (per-token position ids)
        queries = apply_rope_with_pos_ids(queries, cos, sin, pos_ids)
        keys_new = apply_rope_with_pos_ids(keys_new, cos, sin, pos_ids)
        if cache is not None:
            prev_k, prev_v = cache
            keys = torch.cat([prev_k, keys_new], dim=2)
            values = torch.cat([prev_v, values_new], dim=2)
        else:
            keys, values = keys_new, values_new
        next_cache = (keys, values)

        keys = keys.repeat_interleave(self.group_size, dim=1)
        values = values.repeat_interleave(self.group_size, dim=1)

        score_dtype = torch.float32 if self.float32_upcast else queries.dtype
        attn_scores = torch.matmul(queries.to(score_dtype), keys.transpose(2, 3).to(score_dtype))
        attn_scores = attn_scores / self.head_dim**0.5

        # Apply mask with -inf so masked entries are exactly zero after softmax
        attn_scores = attn_scores.masked_fill(mask, -torch.inf)

        # Stable log-sum-exp over the unmasked set
        row_max = attn_scores.amax(dim=-1, keepdim=True)
        row_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
        exp_scores = torch.exp(attn_scores - row_max)
        exp_scores = exp_scores.masked_fill(mask, 0.0)

        denom = exp_scores.sum(dim=-1, keepdim=True)
        attn_weights = exp_scores / denom.clamp(min=torch.finfo(exp_scores.dtype).tiny)
        attn_weights = attn_weights.to(values.dtype)

        context = torch.matmul(attn_weights, values)
        context = context.transpose(1, 2).reshape(b, num_tokens, self.d_out)
        return self.out_proj(context), next_cache


def compute_rope_params(head_dim, theta_base=10_000, context_length=4096, dtype=torch.float32):
    assert head_dim % 2 == 0, "Embedding dimension must be even"
    inv_freq = 1.0 / (theta_base ** (torch.arange(0, head_dim, 2, dtype=dtype)[: (head_dim // 2)].float() / head_dim))
    positions = torch.arange(context_length, dtype=dtype)
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=1)
    cos = torch.cos(angles)
    sin = torch.sin(angles)
    return cos, sin


def apply_rope_with_pos_ids(x, cos, sin, pos_ids):
    B, H, L, D = x.shape
    cos_sel = cos[pos_ids]  # (B, L, D)
    sin_sel = sin[pos_ids]
    cos_sel = cos_sel.unsqueeze(1)
    sin_sel = sin_sel.unsqueeze(1)
    x1 = x[..., : D // 2]
    x2 = x[..., D // 2:]
    rotated = torch.cat((-x2, x1), dim=-1)
    x_rotated = (x * cos_sel) + (rotated * sin_sel)
    return x_rotated.to(dtype=x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, emb_dim, eps=1e-6, bias=False, qwen3_compatible=True):
        super().__init__()
        self.eps = eps
        self.qwen3_compatible = qwen3_compatible
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim)) if bias else None

    def forward(self, x):
        input_dtype = x.dtype
        if self.qwen3_compatible:
            x = x.to(torch.float32)
        variance = x.pow(2).mean(dim=-1, keepdim=True)
        norm_x = x * torch.rsqrt(variance + self.eps)
        norm_x = norm_x * self.scale
        if self.shift is not None:
            norm_x = norm_x + self.shift
        return norm_x.to(input_dtype)


@torch.inference_mode()
def generate_text_basic_batched_cache(model, token_ids, max_new_tokens, eos_token_id=None, attn_mask=None,
                                      pad_id=None):
    device = token_ids.device
    model.eval()
    batch_size, input_length = token_ids.shape

    if attn_mask is None and pad_id is not None:
        attn_mask = (token_ids != pad_id).to(torch.bool)
    if attn_mask is not None:
        attn_mask = attn_mask.to(torch.bool).to(device)

    cache = KVCache(n_layers=model.cfg["n_layers"])

    # Prefill
    out = model(token_ids, cache=cache, attn_mask=attn_mask)[:, -1]

    if eos_token_id is not None:
        finished = (token_ids[:, -1] == eos_token_id)
    else:
        finished = None

    cur_attn = attn_mask
    generated_tokens = []
    for _ in range(max_new_tokens):
        if eos_token_id is not None and finished is not None and torch.all(finished):
            break

        next_token = torch.argmax(out, dim=-1, keepdim=True)

        if eos_token_id is not None:
            eos_tok = next_token.new_full((batch_size, 1), eos_token_id)
            next_token = torch.where(finished.view(batch_size, 1), eos_tok, next_token)

        # Extend mask to include the newly generated token
        if cur_attn is not None:
            ones = torch.ones((batch_size, 1), dtype=cur_attn.dtype, device=device)
            cur_attn = torch.cat([cur_attn, ones], dim=1)

        out = model(next_token, cache=cache, attn_mask=cur_attn)[:, -1]
        generated_tokens.append(next_token)

        if eos_token_id is not None:
            finished = finished | (next_token.squeeze(1) == eos_token_id)

    if generated_tokens:
        return torch.cat(generated_tokens, dim=1)
    return token_ids[:, input_length:]


def shrink_kv_cache_inplace(cache, keep_mask, n_layers):
    if keep_mask.dtype != torch.bool:
        keep_mask = keep_mask.to(torch.bool)
    for i in range(n_layers):
        kv = cache.get(i)
        if kv is None:
            continue
        K, V = kv
        K = K[keep_mask]
        V = V[keep_mask]
        cache.update(i, (K, V))


@torch.inference_mode()
def generate_text_basic_batched_cache_stop(model, token_ids, max_new_tokens, eos_token_id=None, attn_mask=None,
                                           pad_id=None):
    device = token_ids.device
    model.eval()
    B, T0 = token_ids.shape

    if attn_mask is None and pad_id is not None:
        attn_mask = (token_ids != pad_id)
    if attn_mask is not None:
        attn_mask = attn_mask.to(torch.bool).to(device)

    cache = KVCache(n_layers=model.cfg["n_layers"])
    out = model(token_ids, cache=cache, attn_mask=attn_mask)[:, -1]  # (B, V)

    finished_full = torch.zeros(B, dtype=torch.bool, device=device)
    active_idx = torch.arange(B, device=device)
    cur_attn_active = attn_mask
    generated_full_steps = []

    for _ in range(max_new_tokens):
        next_token_active = torch.argmax(out, dim=-1, keepdim=True)

        fill_val = int(eos_token_id) if eos_token_id is not None else 0
        step_full = torch.full((B, 1), fill_value=fill_val, dtype=token_ids.dtype, device=device)
        step_full.index_copy_(0, active_idx, next_token_active)
        generated_full_steps.append(step_full)

        if eos_token_id is not None:
            newly_finished_active = (next_token_active.squeeze(1) == eos_token_id)
            finished_full.index_put_(
                (active_idx,), newly_finished_active | finished_full.index_select(0, active_idx)
            )
        else:
            newly_finished_active = torch.zeros_like(next_token_active.squeeze(1), dtype=torch.bool, device=device)

        if eos_token_id is not None and torch.all(finished_full):
            break

        keep_mask_active = ~newly_finished_active
        if keep_mask_active.ndim == 0:
            keep_any = bool(keep_mask_active.item())
        else:
            keep_any = bool(keep_mask_active.any().item())
        if not keep_any:
            break

        next_token_survivors = next_token_active[keep_mask_active]
        active_idx = active_idx[keep_mask_active]

        if cur_attn_active is not None:
            cur_attn_active = cur_attn_active[keep_mask_active]
            ones = torch.ones((cur_attn_active.size(0), 1), dtype=cur_attn_active.dtype, device=device)
            cur_attn_active = torch.cat([cur_attn_active, ones], dim=1)

        shrink_kv_cache_inplace(cache, keep_mask_active, model.cfg["n_layers"])

        out = model(next_token_survivors, cache=cache, attn_mask=cur_attn_active)[:, -1]

    if generated_full_steps:
        return torch.cat(generated_full_steps, dim=1)
    return torch.empty((B, 0), dtype=token_ids.dtype, device=device)


def left_pad(tokenized, pad_id):
    # evaluate_math500_batched.py: "Encode and left-pad"
    max_len = max(len(t) for t in tokenized)
    left_padded = [([pad_id] * (max_len - len(t)) + t) if pad_id is not None else t for t in tokenized]
    return torch.tensor(left_padded, dtype=torch.long)


@torch.no_grad()
def reference_greedy(model, prompt, n):
    # one prompt, unpadded, no cache: re-run the whole sequence for every new token
    seq = list(prompt)
    first_logits = None
    out = []
    for step in range(n):
        logits = model(torch.tensor([seq]), cache=None, attn_mask=None)[0, -1]
        if step == 0:
            first_logits = logits
        tok = int(torch.argmax(logits))
        out.append(tok)
        seq.append(tok)
    return first_logits, out


def main():
    cfg = QWEN_CONFIG_TINY
    model = Qwen3Model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.3)
    model.eval()

    pad_id = 0
    vocab = cfg["vocab_size"]
    g = torch.Generator().manual_seed(1)
    lens = [6, 11, 3, 8]
    tokenized = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lens]
    input_ids = left_pad(tokenized, pad_id)
    max_new = 7

    refs = [reference_greedy(model, t, max_new) for t in tokenized]
    assert all(pad_id not in toks for _, toks in refs)

    # prefill logits at the last column against each prompt alone
    cache = KVCache(n_layers=cfg["n_layers"])
    with torch.inference_mode():
        pre = model(input_ids, cache=cache, attn_mask=input_ids != pad_id)[:, -1]
    for b, (first_logits, _) in enumerate(refs):
        err = (pre[b] - first_logits).abs().max().item()
        assert err < 1e-4, (b, err)

    # plain batched generation, no EOS
    gen = generate_text_basic_batched_cache(model, input_ids, max_new, eos_token_id=None, pad_id=pad_id)
    for b, (_, toks) in enumerate(refs):
        assert gen[b].tolist() == toks, (b, gen[b].tolist(), toks)

    # with EOS: pick a token that row 1 emits at its third step as the EOS id
    eos_id = refs[1][1][2]
    assert eos_id != pad_id and eos_id not in refs[1][1][:2]
    expected = []
    for _, toks in refs:
        row = []
        done = False
        for t in toks:
            row.append(eos_id if done else t)
            done = done or t == eos_id
        expected.append(row)
    firsts = [row.index(eos_id) + 1 if eos_id in row else max_new for row in expected]
    n_cols = max(firsts)
    assert firsts[1] == 3 and n_cols == max_new  # row 1 stops early, the others run on

    gen_eos = generate_text_basic_batched_cache(model, input_ids, max_new, eos_token_id=eos_id, pad_id=pad_id)
    assert gen_eos.shape[1] == n_cols, (gen_eos.shape, n_cols)
    for b in range(len(lens)):
        assert gen_eos[b].tolist() == expected[b][:n_cols], (b, gen_eos[b].tolist(), expected[b])

    gen_stop = generate_text_basic_batched_cache_stop(model, input_ids, max_new, eos_token_id=eos_id,
                                                      pad_id=pad_id)
    assert gen_stop.shape[1] == n_cols, (gen_stop.shape, n_cols)
    for b in range(len(lens)):
        assert gen_stop[b].tolist() == expected[b][:n_cols], (b, gen_stop[b].tolist(), expected[b])

    print("ok: prefill logits, greedy tokens, EOS and early-stop outputs match each prompt alone")


if __name__ == "__main__":
    main()
