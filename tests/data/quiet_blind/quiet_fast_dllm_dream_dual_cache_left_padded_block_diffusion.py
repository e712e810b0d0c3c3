"""Correct program: Fast-dLLM's block-wise Dream diffusion decoding with a dual KV cache,
on a LEFT-padded batch of prompts, shrunk to tiny sizes (CPU, float64).

Ported from NVlabs/Fast-dLLM
  dream/model/generation_utils_block.py @4e9aeecc4c87fe0c0c9b1e206bd1a6abddf7176e
      (DreamGenerationMixin._sample: bidirectional [B, 1, N, N] bool mask from the
       left-padded attention_mask, block loop, prefill + dual cache, replace_position,
       row slicing attention_mask[:, :, block_start:block_end, :], entropy confidence)
  dream/model/modeling_dream.py @6a3fe3242cdec7e9e314784f6cbc27a841b239ce
      (DreamSdpaAttention.forward with dual_cache: keys/values cached BEFORE RoPE, block
       keys written into the cache in place, RoPE applied to the whole cache and to the
       queries at [block_end - q_len, block_end); SDPA with is_causal=False and the bool
       mask; DreamBaseModel.forward position_ids = arange over the full length)

Masking facts of the original that this port keeps:
  * the mask is bool, True = may attend; it is the outer AND of the padded 1-D mask, so a
    left pad row is fully masked (SDPA returns 0 for such rows since torch 2.5) and pad
    keys are hidden from every real query; the generated [MASK] slots are attended
    bidirectionally (value 1.0 in the padded 1-D mask);
  * position ids run 0..N-1 from column 0 even on padded rows (tok_idx is computed and
    passed, but the base model overwrites position_ids).  RoPE only sees differences of
    positions, so a constant left offset does not change any score: each row must decode
    exactly as its prompt decodes alone, unpadded, with no mask ("full").

Checks (all must hold):
  1. batched prefill logits at real positions == each prompt alone (independent
     per-query loop reference, no mask);
  2. batched dual-cache diffusion decoding == each prompt decoded alone by the same
     generator with attention_mask=None ("full" path);
  3. == an independent loop implementation of the same dual-cache schedule per prompt.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
DT = torch.float64


class DreamConfig:
    vocab_size = 40
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    num_key_value_heads = 2
    rope_theta = 10000.0
    rms_norm_eps = 1e-6
    pad_token_id = 38
    mask_token_id = 39
    max_position_embeddings = 64


# ----------------------------------------------------------------- model (modeling_dream.py)
class DreamRMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DreamRotaryEmbedding(nn.Module):
    def __init__(self, config):
        super().__init__()
        dim = config.hidden_size // config.num_attention_heads
        inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=DT) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].to(DT)
        freqs = (inv_freq_expanded @ position_ids_expanded).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, block_end_index=None):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    query_len, key_len = q.shape[-2], k.shape[-2]
    if block_end_index is None:
        q_embed = (q * cos[:, :, key_len - query_len: key_len, :]) + (
            rotate_half(q) * sin[:, :, key_len - query_len: key_len, :])
    else:
        e = int(block_end_index.item())
        q_embed = (q * cos[:, :, e - query_len: e, :]) + (rotate_half(q) * sin[:, :, e - query_len: e, :])
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def repeat_kv(hidden_states, n_rep):
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


class DreamMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DreamSdpaAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.hidden_size // self.num_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.is_causal = False
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=False,
                position_embeddings=None, replace_position=None, dual_cache=False):
        bsz, q_len, _ = hidden_states.size()
        query_states = self.q_proj(hidden_states)
        key_states = self.k_proj(hidden_states)
        value_states = self.v_proj(hidden_states)

        if past_key_value is not None:
            if dual_cache:
                past_key, past_value = past_key_value
                replace_indices = replace_position.nonzero(as_tuple=True)[1]
                B = replace_position.shape[0]
                for batch_idx in range(B):
                    batch_replace_indices = replace_position[batch_idx].nonzero(as_tuple=True)[0]
                    if len(batch_replace_indices) > 0:
                        past_key[batch_idx, batch_replace_indices] = key_states[batch_idx, :len(batch_replace_indices)]
                        past_value[batch_idx, batch_replace_indices] = value_states[batch_idx, :len(batch_replace_indices)]
                key_states = past_key
                value_states = past_value
            else:
                past_key, past_value = past_key_value
                key_states = torch.cat([past_key, key_states], dim=-2)
                value_states = torch.cat([past_value, value_states], dim=-2)

        past_key_value = (key_states, value_states) if use_cache else None

        query_states = query_states.view(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key_states = key_states.view(bsz, -1, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value_states = value_states.view(bsz, -1, self.num_key_value_heads, self.head_dim).transpose(1, 2)

        cos, sin = position_embeddings
        if dual_cache:
            query_states, key_states = apply_rotary_pos_emb(
                query_states, key_states, cos, sin, block_end_index=replace_indices.max() + 1)
        else:
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)

        key_states = repeat_kv(key_states, self.num_key_value_groups)
        value_states = repeat_kv(value_states, self.num_key_value_groups)

        attn_output = F.scaled_dot_product_attention(
            query_states, key_states, value_states,
            attn_mask=attention_mask if isinstance(attention_mask, torch.Tensor) else None,
            dropout_p=0.0,
            is_causal=False,  # hard coded: Dream is a bidirectional (masked diffusion) LM
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, q_len, self.hidden_size)
        return self.o_proj(attn_output), past_key_value


class DreamDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DreamSdpaAttention(config, layer_idx)
        self.mlp = DreamMLP(config)
        self.input_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, past_key_value=None, use_cache=False,
                position_embeddings=None, dual_cache=False, replace_position=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, present = self.self_attn(
            hidden_states, attention_mask=attention_mask, past_key_value=past_key_value,
            use_cache=use_cache, position_embeddings=position_embeddings,
            replace_position=replace_position, dual_cache=dual_cache)
        hidden_states = residual + hidden_states
        residual = hidden_states
        hidden_states = residual + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, present


class Output:
    def __init__(self, logits, past_key_values):
        self.logits = logits
        self.past_key_values = past_key_values


class DreamModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([DreamDecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = DreamRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DreamRotaryEmbedding(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past_key_values=None,
                use_cache=False, dual_cache=False, replace_position=None):
        inputs_embeds = self.embed_tokens(input_ids)
        past_seen_tokens = past_key_values[0][0].shape[1] if past_key_values is not None else 0
        # As in DreamBaseModel.forward: position ids are rebuilt here (the tok_idx passed in
        # is not used); RoPE is shift-invariant, so left padding does not matter.
        if not dual_cache:
            position_ids = torch.arange(past_seen_tokens + inputs_embeds.shape[1]).unsqueeze(0)
        else:
            if past_key_values is not None:
                position_ids = torch.arange(past_seen_tokens).unsqueeze(0)
            else:
                position_ids = torch.arange(inputs_embeds.shape[1]).unsqueeze(0)
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids)
        attn_key_values = [] if use_cache else None
        for layer_idx, layer in enumerate(self.layers):
            layer_past = past_key_values[layer_idx] if past_key_values is not None else None
            hidden_states, present = layer(
                hidden_states, attention_mask=attention_mask, past_key_value=layer_past,
                use_cache=use_cache, position_embeddings=position_embeddings,
                dual_cache=dual_cache, replace_position=replace_position)
            if use_cache:
                attn_key_values.append(present)
        hidden_states = self.norm(hidden_states)
        return Output(self.lm_head(hidden_states), attn_key_values)


# --------------------------------------------------- generation (generation_utils_block.py)
def sample_tokens(logits, temperature=0.0, top_p=None, top_k=None, margin_confidence=False, neg_entropy=False):
    if temperature > 0:
        logits = logits / temperature
    probs = torch.softmax(logits, dim=-1)
    confidence, x0 = probs.max(dim=-1)  # temperature == 0 path
    if neg_entropy:
        epsilon = 1e-10
        log_probs = torch.log(probs + epsilon)
        confidence = torch.sum(probs * log_probs, dim=-1)
    return confidence, x0


@torch.no_grad()
def diffusion_generate(model, input_ids, attention_mask, max_new_tokens, steps, block_length,
                       mask_token_id, eps=1e-3, temperature=0.0, dual_cache=True):
    max_length = input_ids.shape[1] + max_new_tokens
    x = F.pad(input_ids, (0, max_length - input_ids.shape[1]), value=mask_token_id)
    gen_length = max_length - input_ids.shape[1]
    assert gen_length % block_length == 0
    num_blocks = gen_length // block_length
    assert steps % num_blocks == 0
    steps_per_block = steps // num_blocks
    timesteps = torch.linspace(1, eps, steps_per_block + 1)

    if attention_mask is not None and torch.any(attention_mask == 0.0):
        # we do not mask the [MASK] tokens so value = 1.0
        attention_mask = F.pad(attention_mask, (0, max_length - attention_mask.shape[1]), value=1.0)
        tok_idx = attention_mask.long().cumsum(-1) - 1
        tok_idx.masked_fill_(attention_mask == 0, 1)
        # [B, N] -> [B, 1, N, N]
        attention_mask = torch.logical_and(
            attention_mask.unsqueeze(1).unsqueeze(-2),
            attention_mask.unsqueeze(1).unsqueeze(-1),
        )
    else:
        tok_idx = None
        attention_mask = "full"

    prefill_logits = []
    for num_block in range(num_blocks):
        current_block_start = input_ids.shape[1] + num_block * block_length
        current_block_end = current_block_start + block_length

        model_output = model(x, attention_mask, tok_idx, use_cache=True)
        past_key_values = model_output.past_key_values
        logits = model_output.logits
        prefill_logits.append(logits.clone())
        logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
        confidence, x0 = sample_tokens(logits, temperature=temperature)
        x[:, current_block_start] = x0[:, current_block_start]

        if not dual_cache:
            past_key_values = [tuple(t[:, :current_block_start, :] for t in kv) for kv in past_key_values]
        else:
            replace_position = torch.zeros_like(x, dtype=torch.bool)
            replace_position[:, current_block_start:current_block_end] = 1

        i = 1
        while True:
            if dual_cache:
                mask_index = (x[:, current_block_start:current_block_end] == mask_token_id)
            else:
                mask_index = (x[:, current_block_start:] == mask_token_id)
            if not isinstance(attention_mask, str):
                if dual_cache:
                    # query = block tokens, key = full sequence: [B, 1, block_length, N]
                    current_attention_mask = attention_mask[:, :, current_block_start:current_block_end, :]
                else:
                    current_attention_mask = attention_mask[:, :, current_block_start:, :]
            else:
                current_attention_mask = attention_mask

            if dual_cache:
                model_output = model(x[:, current_block_start:current_block_end], current_attention_mask,
                                     tok_idx[:, current_block_start:current_block_end] if tok_idx is not None else None,
                                     past_key_values=past_key_values, use_cache=True, dual_cache=dual_cache,
                                     replace_position=replace_position)
            else:
                model_output = model(x[:, current_block_start:], current_attention_mask,
                                     tok_idx[:, current_block_start:] if tok_idx is not None else None,
                                     past_key_values=past_key_values, use_cache=True)
            logits = model_output.logits
            logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)
            if i == steps_per_block:
                break
            t = timesteps[i]
            s = timesteps[i + 1]
            mask_index[:, block_length:] = False
            mask_logits = logits[mask_index]
            confidence, x0 = sample_tokens(mask_logits, temperature, neg_entropy=True)
            num_mask_token = mask_index.sum() / mask_index.shape[0]
            number_transfer_tokens = int(num_mask_token * (1 - s / t)) if i < steps_per_block - 1 else int(num_mask_token)
            full_confidence = torch.full_like(x[:, current_block_start:current_block_end], -torch.inf, dtype=logits.dtype)
            full_confidence[mask_index] = confidence
            full_confidence[:, block_length:] = -torch.inf
            if number_transfer_tokens > 0:
                _, transfer_index = torch.topk(full_confidence, number_transfer_tokens)
                x_ = torch.zeros_like(x[:, current_block_start:current_block_end], dtype=torch.long) + mask_token_id
                x_[mask_index] = x0.clone()
                row_indices = torch.arange(x.size(0)).unsqueeze(1).expand_as(transfer_index)
                x[:, current_block_start:current_block_end][row_indices, transfer_index] = x_[row_indices, transfer_index]
            i += 1
            if (x[:, current_block_start:current_block_end] == mask_token_id).sum() == 0:
                break
    return x, prefill_logits


# ------------------------------------------------ independent reference (one prompt, no pads)
def ref_layer_full(layer, h, pos):
    """Plain loop attention over ALL positions of one unpadded row (no mask needed)."""
    att = layer.self_attn
    nh, nkv, hd = att.num_heads, att.num_key_value_heads, att.head_dim
    x = layer.input_layernorm(h)
    k_raw, v_raw = att.k_proj(x), att.v_proj(x)
    out = ref_attend(layer, x, k_raw, v_raw, pos, pos)
    h = h + out
    return h + layer.mlp(layer.post_attention_layernorm(h)), k_raw, v_raw


def rope_vec(v, p, inv_freq):
    ang = p * inv_freq
    c = torch.cat([ang.cos(), ang.cos()])
    s = torch.cat([ang.sin(), ang.sin()])
    return v * c + rotate_half(v) * s


def ref_attend(layer, xq, k_raw, v_raw, q_pos, k_pos):
    att = layer.self_attn
    nh, nkv, hd = att.num_heads, att.num_key_value_heads, att.head_dim
    inv = REF_INV_FREQ
    q = att.q_proj(xq).view(-1, nh, hd)
    k = k_raw.view(-1, nkv, hd)
    v = v_raw.view(-1, nkv, hd)
    rows = []
    for a in range(q.shape[0]):
        heads = []
        for hh in range(nh):
            g = hh // (nh // nkv)
            qa = rope_vec(q[a, hh], q_pos[a], inv)
            scores = torch.stack([qa @ rope_vec(k[j, g], k_pos[j], inv) for j in range(k.shape[0])]) / math.sqrt(hd)
            w = torch.softmax(scores, dim=0)
            heads.append((w[:, None] * v[:, g]).sum(0))
        rows.append(torch.cat(heads))
    return att.o_proj(torch.stack(rows))


def ref_forward_full(model, ids):
    pos = torch.arange(ids.shape[0], dtype=DT)
    h = model.embed_tokens(ids)
    kv = []
    for layer in model.layers:
        h, k_raw, v_raw = ref_layer_full(layer, h, pos)
        kv.append((k_raw, v_raw))
    return model.lm_head(model.norm(h)), kv


def ref_forward_block(model, block_ids, kv, start, end):
    """Dual cache step: block keys replace their slots in a copy of the cached keys."""
    n = kv[0][0].shape[0]
    kpos = torch.arange(n, dtype=DT)
    qpos = torch.arange(start, end, dtype=DT)
    h = model.embed_tokens(block_ids)
    for layer, (k_c, v_c) in zip(model.layers, kv):
        att = layer.self_attn
        x = layer.input_layernorm(h)
        k_full, v_full = k_c.clone(), v_c.clone()
        k_full[start:end] = att.k_proj(x)
        v_full[start:end] = att.v_proj(x)
        k_c.copy_(k_full)
        v_c.copy_(v_full)  # the original writes the block into the cache in place
        h = h + ref_attend(layer, x, k_full, v_full, qpos, kpos)
        h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(model.norm(h))


@torch.no_grad()
def ref_generate_alone(model, prompt, max_new_tokens, steps, block_length, mask_id, eps=1e-3):
    P = prompt.shape[0]
    x = torch.cat([prompt, torch.full((max_new_tokens,), mask_id)])
    num_blocks = max_new_tokens // block_length
    spb = steps // num_blocks
    ts = torch.linspace(1, eps, spb + 1)
    for b in range(num_blocks):
        start, end = P + b * block_length, P + (b + 1) * block_length
        logits, kv = ref_forward_full(model, x)
        x[start] = logits[start - 1].argmax()
        i = 1
        while True:
            lg = ref_forward_block(model, x[start:end], kv, start, end)
            lg = torch.cat([lg[:1], lg[:-1]])
            if i == spb:
                break
            masked = (x[start:end] == mask_id).nonzero().flatten().tolist()
            n = len(masked)
            k = int(torch.tensor(float(n)) * (1 - ts[i + 1] / ts[i])) if i < spb - 1 else n
            conf = {}
            for j in masked:
                p = torch.softmax(lg[j], -1)
                conf[j] = (p * torch.log(p + 1e-10)).sum().item()
            chosen = sorted(masked, key=lambda j: -conf[j])[:k]
            for j in chosen:
                x[start + j] = lg[j].argmax()
            i += 1
            if (x[start:end] == mask_id).sum() == 0:
                break
    return x


def main():
    cfg = DreamConfig()
    model = DreamModel(cfg).to(DT).eval()
    global REF_INV_FREQ
    REF_INV_FREQ = model.rotary_emb.inv_freq

    g = torch.Generator().manual_seed(1)
    lengths = [5, 3, 7]
    prompts = [torch.randint(0, 36, (n,), generator=g) for n in lengths]
    N0 = max(lengths)
    input_ids = torch.full((len(prompts), N0), cfg.pad_token_id)
    attention_mask = torch.zeros(len(prompts), N0, dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as the Dream / Fast-dLLM eval scripts do
        input_ids[r, N0 - len(p):] = p
        attention_mask[r, N0 - len(p):] = 1

    kw = dict(max_new_tokens=8, steps=8, block_length=4, mask_token_id=cfg.mask_token_id)
    out, prefill_logits = diffusion_generate(model, input_ids.clone(), attention_mask, dual_cache=True, **kw)

    ok = True
    # 1. prefill logits of the first block, real positions vs an independent loop reference
    for r, p in enumerate(prompts):
        x_alone = torch.cat([p, torch.full((kw["max_new_tokens"],), cfg.mask_token_id)])
        ref_logits, _ = ref_forward_full(model, x_alone)
        got = prefill_logits[0][r, N0 - len(p):]
        good = torch.allclose(got, ref_logits, atol=1e-9, rtol=1e-9)
        print(f"row {r}: prefill logits (real positions) match loop reference: {good}")
        ok &= good
    assert all(torch.isfinite(l).all() for l in prefill_logits)

    # 2./3. decoded tokens vs each prompt alone (same generator, no mask) and the loop reference
    for r, p in enumerate(prompts):
        alone, _ = diffusion_generate(model, p[None].clone(), None, dual_cache=True, **kw)
        ref = ref_generate_alone(model, p.clone(), kw["max_new_tokens"], kw["steps"],
                                 kw["block_length"], cfg.mask_token_id)
        got = out[r, N0 - len(p):]
        m1 = torch.equal(got, alone[0])
        m2 = torch.equal(got, ref)
        print(f"row {r}: generated {got[len(p):].tolist()} alone {alone[0, len(p):].tolist()} "
              f"ref {ref[len(p):].tolist()} -> match alone={m1} ref={m2}")
        ok &= m1 and m2
        assert (got != cfg.mask_token_id).all()
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
