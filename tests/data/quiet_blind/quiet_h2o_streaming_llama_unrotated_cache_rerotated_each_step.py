# Correct program (quiet batch quiet-r147a).
# Ported from FMInference/H2O h2o_hf/utils_real_drop/modify_llama.py @ac75c2a (H2OKVCache_LayerWise.__call__ /
# _update_hh_score, _make_causal_mask, apply_rotary_pos_emb_single, H2OLlamaAttention_streaming.forward) as driven
# by h2o_hf/run_streaming.py greedy_generate. The streaming H2O attention keeps its KV cache *unrotated*: each call
# rotates the query at position kv_seq_len - 1 (its slot in the cache, not its place in the text) and re-rotates
# every cached key at its index in the cache (arange(kv_seq_len)), so that after the heavy-hitter eviction the kept
# keys sit at contiguous positions. The mask is remade inside the attention by _make_causal_mask (causal over the
# prompt, all zeros over the cache when decoding one token); the accumulated softmax weights pick, per head, the
# hh_size heaviest tokens outside the recent_size window.
# Trimmed for CPU: a tiny two-layer Llama with random weights and a toy vocabulary (no weights loaded, no
# pretraining_tp, no rope scaling), the old LlamaRotaryEmbedding (cos_cached / sin_cached up to seq_len) written
# out. The upstream cache serves one sequence (`.squeeze()` and `attn.sum(0)`); here the heavy-hitter scores are
# kept per row, `(bsz, num_heads, kv_len)`, so a batch of equal-length prompts (no padding) generates together, and
# the decode query's position is set for every row (upstream tested `position_ids.nelement() > 1` and wrote
# `position_ids[0][0]`, one row's worth).
# Self-check: the batched greedy generation equals each prompt generated alone; every step's logits equal a
# per-row, per-head double loop (float64) that keeps its own lists of kept tokens, scores and unrotated keys; and
# while nothing has been evicted, they equal a plain causal forward over the whole text with ordinary RoPE.
import math

import torch
import torch.nn.functional as F
from torch import nn


class LlamaConfig:
    def __init__(self, **kwargs):
        self.vocab_size = 48
        self.hidden_size = 32
        self.intermediate_size = 64
        self.num_hidden_layers = 2
        self.num_attention_heads = 4
        self.num_key_value_heads = 4
        self.max_position_embeddings = 64
        self.rope_theta = 10000.0
        self.rms_norm_eps = 1e-6
        self.hh_size = 2
        self.recent_size = 4
        for k, v in kwargs.items():
            setattr(self, k, v)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings=2048, base=10000, device=None):
        super().__init__()
        self.dim = dim
        self.max_position_embeddings = max_position_embeddings
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2).float().to(device) / self.dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._set_cos_sin_cache(seq_len=max_position_embeddings, device=self.inv_freq.device, dtype=torch.get_default_dtype())

    def _set_cos_sin_cache(self, seq_len, device, dtype):
        self.max_seq_len_cached = seq_len
        t = torch.arange(self.max_seq_len_cached, device=device, dtype=self.inv_freq.dtype)
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos()[None, None, :, :].to(dtype), persistent=False)
        self.register_buffer("sin_cached", emb.sin()[None, None, :, :].to(dtype), persistent=False)

    def forward(self, x, seq_len=None):
        if seq_len > self.max_seq_len_cached:
            self._set_cos_sin_cache(seq_len=seq_len, device=x.device, dtype=x.dtype)
        return (
            self.cos_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
            self.sin_cached[:, :, :seq_len, ...].to(dtype=x.dtype),
        )


def _make_causal_mask(bsz: int, tgt_len: int, past_key_values_length: int, dtype: torch.dtype, device: torch.device):
    """
    Make causal mask used for bi-directional self-attention.
    """
    mask = torch.full((tgt_len, tgt_len), torch.finfo(dtype).min, device=device)
    mask_cond = torch.arange(mask.size(-1), device=device)
    mask.masked_fill_(mask_cond < (mask_cond + 1).view(mask.size(-1), 1), 0)
    mask = mask.to(dtype)

    if past_key_values_length > 0:
        mask = torch.cat([torch.zeros(tgt_len, past_key_values_length, dtype=dtype, device=device), mask], dim=-1)
    return mask[None, None, :, :].expand(bsz, 1, tgt_len, tgt_len + past_key_values_length)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    # The first two dimensions of cos and sin are always 1, so we can `squeeze` them.
    cos = cos.squeeze(1).squeeze(0)  # [seq_len, dim]
    sin = sin.squeeze(1).squeeze(0)  # [seq_len, dim]
    cos = cos[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    sin = sin[position_ids].unsqueeze(1)  # [bs, 1, seq_len, dim]
    x_embed = (x * cos) + (rotate_half(x) * sin)
    return x_embed


class H2OKVCache_LayerWise:
    def __init__(self, hh_size=4, recent_size=512, k_seq_dim=2, v_seq_dim=2):
        self.hh_size = hh_size
        self.recent_size = recent_size
        self.cache_size = hh_size + recent_size
        self.k_seq_dim = k_seq_dim
        self.v_seq_dim = v_seq_dim
        self.hh_score = None

    def __call__(self, past_key_values, attn_score_cache):
        self._update_hh_score(attn_score_cache)

        if past_key_values is None:
            return None
        seq_len = past_key_values[0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values

        # hh-selection
        bsz, num_heads, _, head_dim = past_key_values[0].shape

        select_hh_scores = self.hh_score[:, :, : seq_len - self.recent_size]
        _, keep_topk = torch.topk(select_hh_scores, self.hh_size, dim=-1)
        keep_topk = keep_topk.sort().values

        keep_recent = torch.arange(seq_len - self.recent_size, seq_len, device=keep_topk.device).expand(
            bsz, num_heads, self.recent_size
        )
        keep_idx = torch.cat([keep_topk, keep_recent], dim=-1)

        mask = torch.zeros(self.hh_score.shape, dtype=torch.bool).to(past_key_values[0].device)
        mask = mask.scatter(-1, keep_idx, 1)

        k_hh_recent = past_key_values[0][mask].view(bsz, num_heads, -1, head_dim)
        v_hh_recent = past_key_values[1][mask].view(bsz, num_heads, -1, head_dim)

        self.hh_score = self.hh_score[mask].view(bsz, num_heads, self.cache_size)

        return (k_hh_recent, v_hh_recent)

    def _update_hh_score(self, attn_score_cache):
        num_new_tokens = attn_score_cache.shape[2]

        if self.hh_score is None:
            self.hh_score = attn_score_cache.sum(2)
        else:
            attn_score_cache = attn_score_cache.sum(2)
            attn_score_cache[:, :, :-num_new_tokens] += self.hh_score
            self.hh_score = attn_score_cache

    def _clean_scores(self):
        self.hh_score = None


class H2OLlamaAttention_streaming(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_position_embeddings = config.max_position_embeddings
        self.rope_theta = config.rope_theta
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(
            self.head_dim, max_position_embeddings=self.max_position_embeddings, base=self.rope_theta
        )
        self.kv_cache = H2OKVCache_LayerWise(
            hh_size=config.hh_size, recent_size=config.recent_size, k_seq_dim=2, v_seq_dim=2
        )

    def _clean_cache(self):
        self.kv_cache._clean_scores()

    def forward(self, hidden_states, position_ids, past_key_value=None, use_cache=True):
        bsz, q_len, _ = hidden_states.size()

        query_states = self.q_proj(hidden_states).view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = self.k_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = self.v_proj(hidden_states).view(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        # remake causal mask
        attention_mask = _make_causal_mask(
            bsz=bsz,
            tgt_len=q_len,
            past_key_values_length=past_key_value[0].shape[-2] if past_key_value is not None else 0,
            dtype=query_states.dtype,
            device=query_states.device,
        )

        kv_seq_len = key_states.shape[-2]
        if past_key_value is not None:
            kv_seq_len += past_key_value[0].shape[-2]

        if not position_ids.shape[-1] > 1:
            position_ids = position_ids.clone()
            position_ids[:, 0] = kv_seq_len - 1

        cos, sin = self.rotary_emb(value_states, seq_len=kv_seq_len)
        ### Shift Pos: query pos is min(cache_size, idx)
        query_states = apply_rotary_pos_emb_single(query_states, cos, sin, position_ids)

        if past_key_value is not None:
            key_states = torch.cat([past_key_value[0], key_states], dim=2)
            value_states = torch.cat([past_key_value[1], value_states], dim=2)

        past_key_value = (key_states, value_states) if use_cache else None

        ### Shift Pos: key pos is the pos in cache (Rolling KV Cache and using relative pos emb)
        key_position_ids = torch.arange(kv_seq_len, device=position_ids.device).unsqueeze(0)
        key_states = apply_rotary_pos_emb_single(key_states, cos, sin, key_position_ids)

        attn_weights = torch.matmul(query_states, key_states.transpose(2, 3)) / math.sqrt(self.head_dim)
        attn_weights = attn_weights + attention_mask
        attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query_states.dtype)

        past_key_value = self.kv_cache(past_key_value, attn_weights.detach().clone())

        attn_output = torch.matmul(attn_weights, value_states)
        attn_output = attn_output.transpose(1, 2).contiguous().reshape(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class LlamaRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


class LlamaMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attn = H2OLlamaAttention_streaming(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, position_ids, past_key_value=None):
        residual = hidden_states
        hidden_states, present = self.self_attn(self.input_layernorm(hidden_states), position_ids, past_key_value)
        hidden_states = residual + hidden_states
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class H2OLlamaForCausalLM_streaming(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _clean_cache(self):
        for layer in self.layers:
            layer.self_attn._clean_cache()

    def forward(self, input_ids, past_key_values=None):
        bsz, seq_length = input_ids.shape
        past_key_values_length = past_key_values[0][0].shape[2] if past_key_values is not None else 0
        # LlamaModel.forward: positions continue after what is cached
        position_ids = torch.arange(past_key_values_length, past_key_values_length + seq_length).unsqueeze(0)
        position_ids = position_ids.expand(bsz, seq_length)

        hidden_states = self.embed_tokens(input_ids)
        next_cache = []
        for idx, layer in enumerate(self.layers):
            past = past_key_values[idx] if past_key_values is not None else None
            hidden_states, present = layer(hidden_states, position_ids, past)
            next_cache.append(present)
        return self.lm_head(self.norm(hidden_states)), next_cache


@torch.no_grad()
def greedy_generate(model, input_ids, max_gen_len):
    """run_streaming.greedy_generate, batched: returns the generated ids and each step's last-position logits."""
    model._clean_cache()
    logits, past_key_values = model(input_ids=input_ids, past_key_values=None)
    step_logits = [logits[:, -1, :]]
    pred_token_idx = logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
    generated_ids = [pred_token_idx]
    for _ in range(max_gen_len - 1):
        logits, past_key_values = model(input_ids=pred_token_idx, past_key_values=past_key_values)
        step_logits.append(logits[:, -1, :])
        pred_token_idx = logits[:, -1, :].argmax(dim=-1).unsqueeze(1)
        generated_ids.append(pred_token_idx)
    return torch.cat(generated_ids, dim=1), torch.stack(step_logits, dim=1)


# ---------------------------------------------------------------- references


def rope_angle_rotate(vec, pos, base):
    """Rotate one head vector (rotate_half layout) to position `pos`, written from the formula."""
    d = len(vec)
    half = d // 2
    out = [0.0] * d
    for i in range(half):
        theta = pos * base ** (-2.0 * i / d)
        c, s = math.cos(theta), math.sin(theta)
        out[i] = vec[i] * c - vec[i + half] * s
        out[i + half] = vec[i + half] * c + vec[i] * s
    return torch.tensor(out, dtype=torch.float64)


def reference_row_logits(model, tokens, prompt_len):
    """One row, float64, lists of kept tokens per layer and head; returns the logits after the prompt and each
    generated token (teacher-forced with `tokens`)."""
    cfg = model.config
    H, D = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    hh, recent = cfg.hh_size, cfg.recent_size
    p = {n: t.detach().double() for n, t in model.named_parameters()}

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean() + cfg.rms_norm_eps)

    # per layer, per head: list of [unrotated key, value, accumulated score]
    caches = [[[] for _ in range(H)] for _ in range(cfg.num_hidden_layers)]
    out_logits = []
    steps = [tokens[:prompt_len]] + [[t] for t in tokens[prompt_len:]]
    for chunk in steps:
        hs = [p["embed_tokens.weight"][t].clone() for t in chunk]
        for li in range(cfg.num_hidden_layers):
            pre = f"layers.{li}."
            normed = [rms(h, p[pre + "input_layernorm.weight"]) for h in hs]
            attn_out = [torch.zeros(cfg.hidden_size, dtype=torch.float64) for _ in hs]
            for h in range(H):
                sl = slice(h * D, (h + 1) * D)
                cache = caches[li][h]
                n_old = len(cache)
                new_q = [(p[pre + "self_attn.q_proj.weight"] @ x)[sl] for x in normed]
                for x in normed:
                    cache.append([(p[pre + "self_attn.k_proj.weight"] @ x)[sl],
                                  (p[pre + "self_attn.v_proj.weight"] @ x)[sl], 0.0])
                kv_len = len(cache)
                rotated_keys = [rope_angle_rotate(entry[0].tolist(), j, cfg.rope_theta) for j, entry in enumerate(cache)]
                added = [0.0] * kv_len
                for qi, q in enumerate(new_q):
                    # prompt: token qi sits at qi; one decode token sits at the cache's last slot
                    qpos = qi if len(chunk) > 1 else kv_len - 1
                    qr = rope_angle_rotate(q.tolist(), qpos, cfg.rope_theta)
                    visible = range(n_old + qi + 1)
                    scores = [float(qr @ rotated_keys[j]) / math.sqrt(D) for j in visible]
                    m = max(scores)
                    ex = [math.exp(s - m) for s in scores]
                    z = sum(ex)
                    o = torch.zeros(D, dtype=torch.float64)
                    for j, e in zip(visible, ex):
                        o += (e / z) * cache[j][1]
                        added[j] += e / z
                    attn_out[qi][sl] = o
                for j in range(kv_len):
                    cache[j][2] += added[j]
                if kv_len > hh + recent:
                    old = sorted(range(kv_len - recent), key=lambda j: -cache[j][2])[:hh]
                    keep = sorted(old) + list(range(kv_len - recent, kv_len))
                    caches[li][h] = [cache[j] for j in keep]
            hs = [h_ + p[pre + "self_attn.o_proj.weight"] @ a for h_, a in zip(hs, attn_out)]
            new_hs = []
            for h_ in hs:
                x = rms(h_, p[pre + "post_attention_layernorm.weight"])
                mlp = p[pre + "mlp.down_proj.weight"] @ (
                    F.silu(p[pre + "mlp.gate_proj.weight"] @ x) * (p[pre + "mlp.up_proj.weight"] @ x)
                )
                new_hs.append(h_ + mlp)
            hs = new_hs
        out_logits.append(p["lm_head.weight"] @ rms(hs[-1], p["norm.weight"]))
    return torch.stack(out_logits)


def full_causal_logits(model, tokens):
    """The same weights, no cache and no eviction: ordinary RoPE at positions 0..T-1 under a causal mask."""
    ids = torch.tensor([tokens])
    T = ids.shape[1]
    hidden = model.embed_tokens(ids)
    pos = torch.arange(T).unsqueeze(0)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    for layer in model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(hidden)
        q = attn.q_proj(x).view(1, T, attn.num_heads, attn.head_dim).transpose(1, 2)
        k = attn.k_proj(x).view(1, T, attn.num_heads, attn.head_dim).transpose(1, 2)
        v = attn.v_proj(x).view(1, T, attn.num_heads, attn.head_dim).transpose(1, 2)
        cos, sin = attn.rotary_emb(v, seq_len=T)
        q = apply_rotary_pos_emb_single(q, cos, sin, pos)
        k = apply_rotary_pos_emb_single(k, cos, sin, pos)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal)
        hidden = hidden + attn.o_proj(o.transpose(1, 2).reshape(1, T, -1))
        hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
    return model.lm_head(model.norm(hidden))[0]


def main():
    torch.manual_seed(0)
    config = LlamaConfig()
    model = H2OLlamaForCausalLM_streaming(config).eval()
    with torch.no_grad():
        for prm in model.parameters():
            if prm.dim() > 1:
                prm.normal_(0.0, 0.3)

    prompt_len, max_gen_len = 5, 9
    prompts = torch.randint(2, config.vocab_size, (3, prompt_len))
    generated, logits = greedy_generate(model, prompts, max_gen_len)
    cache_size = config.hh_size + config.recent_size

    for b in range(prompts.shape[0]):
        alone_ids, alone_logits = greedy_generate(model, prompts[b : b + 1], max_gen_len)
        assert torch.equal(alone_ids[0], generated[b]), (b, alone_ids[0], generated[b])
        torch.testing.assert_close(alone_logits[0], logits[b], atol=1e-5, rtol=1e-5)

        tokens = prompts[b].tolist() + generated[b, :-1].tolist()
        ref = reference_row_logits(model, tokens, prompt_len)
        torch.testing.assert_close(logits[b].double(), ref, atol=1e-4, rtol=1e-4)

        # steps whose cache never went past cache_size: nothing evicted yet, so the positions are the text's own
        with torch.no_grad():
            full = full_causal_logits(model, tokens)
        for step in range(max_gen_len):
            if prompt_len + step <= cache_size:
                torch.testing.assert_close(logits[b, step], full[prompt_len - 1 + step], atol=1e-5, rtol=1e-5)
        print(f"row {b}: prompt {prompts[b].tolist()} -> {generated[b].tolist()}")

    print(f"batched H2O streaming generation (hh_size={config.hh_size}, recent_size={config.recent_size}) "
          f"matches each row alone, the double-loop reference and, before eviction, a full causal forward")


if __name__ == "__main__":
    main()
