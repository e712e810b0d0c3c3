# Citation: pytorch/torchtune torchtune/generation/_generation.py @76ff0fde5c32bf09b87c3b37e608ac50230819d7
#   (generate, generate_next_token, sample, get_causal_mask_from_padding_mask, get_position_ids_from_padding_mask),
#   with the model side as torchtune writes it: torchtune/modules/kv_cache.py (KVCache: cache_pos, update),
#   torchtune/modules/attention.py (MultiHeadAttention: rope at input_pos, kv_cache.update, mask[:, None] to SDPA),
#   torchtune/modules/transformer.py (TransformerDecoder.setup_caches / caches_are_enabled / decoder_max_cache_seq_len).
# Correct program (quiet batch quiet-r87a): a left-padded batch of prompts (pad_id 0) goes through torchtune's
# generate() with KV caches enabled. The padding mask is extended by max_generated_tokens, turned into a
# [bsz, total_len, max_cache_len] bool mask (tril, pad columns cleared, diagonal set so pad rows keep one key), and
# position ids are right-shifted so each prompt's first real token is position 0. Prefill gets masks[:, :prompt_len],
# each decode step masks[:, curr_pos, None, :] and input_pos[:, curr_pos]. Greedy (top_k=1) tokens and the real
# positions' logits are checked against each prompt run alone, unpadded, through the model with no cache and no mask.
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


# ---------------------------------------------------------------- torchtune/modules
class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim, dtype):
        super().__init__()
        cache_shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, cache_shape[2]), persistent=False)
        self.batch_size = batch_size

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.size

    @property
    def size(self):
        return self.cache_pos[0].item()

    def update(self, k_val, v_val):
        bsz, _, seq_len, _ = k_val.shape
        assert (self.cache_pos[0] + seq_len) <= self.k_cache.shape[2]
        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, self.cache_pos[:seq_len]] = k_val
        v_out[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return k_out, v_out


class RotaryPositionalEmbeddings(nn.Module):
    def __init__(self, dim, max_seq_len=4096, base=10_000):
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        seq_idx = torch.arange(max_seq_len, dtype=theta.dtype)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
        cache = torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1)
        self.register_buffer("cache", cache, persistent=False)

    def forward(self, x, *, input_pos=None):
        # x: [b, s, n_h, h_d]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack(
            [
                xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
                xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
            ],
            -1,
        )
        return x_out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, *, embed_dim, num_heads, num_kv_heads, head_dim, pos_embeddings, max_seq_len, is_causal=True):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.embed_dim = embed_dim
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.is_causal = is_causal
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)
        self.pos_embeddings = pos_embeddings
        self.kv_cache = None
        self.cache_enabled = False

    def setup_cache(self, batch_size, dtype, max_seq_len):
        self.kv_cache = KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim, dtype)
        self.cache_enabled = True

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        y = x if y is None else y
        s_y = y.shape[1]
        q = self.q_proj(x)
        q_per_kv = self.num_heads // self.num_kv_heads
        q = q.view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos)
        q = q.transpose(1, 2)

        k = self.k_proj(y)
        v = self.v_proj(y)
        k = k.view(b, s_y, -1, self.head_dim)
        v = v.view(b, s_y, -1, self.head_dim)
        k = self.pos_embeddings(k, input_pos=input_pos)
        k = k.transpose(1, 2)
        v = v.transpose(1, 2)

        if self.kv_cache is not None and self.cache_enabled:
            k, v = self.kv_cache.update(k, v)

        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)

        # _sdpa_or_flex_attention (torchtune/modules/attention_utils.py), SDPA branch
        if mask is not None:
            mask = mask[:, None, :, :]
        output = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, dropout_p=0.0,
            is_causal=self.kv_cache is None and mask is None and self.is_causal,
        )
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x_fp32 = x.float()
        x_normed = (x_fp32 * torch.rsqrt(x_fp32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)
        return x_normed * self.scale


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, mlp, sa_norm, mlp_norm):
        super().__init__()
        self.attn = attn
        self.mlp = mlp
        self.sa_norm = sa_norm
        self.mlp_norm = mlp_norm

    def setup_cache(self, batch_size, dtype, *, encoder_max_seq_len, decoder_max_seq_len):
        self.attn.setup_cache(batch_size, dtype, max_seq_len=decoder_max_seq_len)

    def caches_are_enabled(self):
        return self.attn.kv_cache is not None and self.attn.cache_enabled

    def forward(self, x, *, mask=None, input_pos=None, **kwargs):
        h = self.sa_norm(x)
        attn_out = self.attn(h, h, mask=mask, input_pos=input_pos)
        h = attn_out + x
        mlp_out = self.mlp(self.mlp_norm(h))
        return h + mlp_out


class TransformerDecoder(nn.Module):
    def __init__(self, *, tok_embeddings, layers, max_seq_len, num_heads, head_dim, norm, output):
        super().__init__()
        self.tok_embeddings = tok_embeddings
        self.layers = nn.ModuleList(layers)
        self.max_seq_len = max_seq_len
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.norm = norm
        self.output = output
        self.decoder_max_cache_seq_len = None

    def setup_caches(self, batch_size, dtype, *, encoder_max_seq_len=None, decoder_max_seq_len=None):
        self.decoder_max_cache_seq_len = decoder_max_seq_len if decoder_max_seq_len is not None else self.max_seq_len
        for layer in self.layers:
            layer.setup_cache(batch_size, dtype, encoder_max_seq_len=encoder_max_seq_len,
                              decoder_max_seq_len=self.decoder_max_cache_seq_len)

    def caches_are_enabled(self):
        return self.layers[0].caches_are_enabled()

    def forward(self, tokens, *, mask=None, input_pos=None):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos)
        h = self.norm(h)
        return self.output(h).float()


def llama3_tiny(vocab_size=64, num_layers=2, num_heads=4, num_kv_heads=2, embed_dim=32, max_seq_len=64):
    head_dim = embed_dim // num_heads
    rope = RotaryPositionalEmbeddings(dim=head_dim, max_seq_len=max_seq_len, base=500_000)
    layers = []
    for _ in range(num_layers):
        self_attn = MultiHeadAttention(embed_dim=embed_dim, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                       head_dim=head_dim, pos_embeddings=rope, max_seq_len=max_seq_len)
        layers.append(TransformerSelfAttentionLayer(attn=self_attn, mlp=FeedForward(embed_dim, 4 * embed_dim),
                                                    sa_norm=RMSNorm(embed_dim), mlp_norm=RMSNorm(embed_dim)))
    return TransformerDecoder(tok_embeddings=nn.Embedding(vocab_size, embed_dim), layers=layers,
                              max_seq_len=max_seq_len, num_heads=num_heads, head_dim=head_dim,
                              norm=RMSNorm(embed_dim), output=nn.Linear(embed_dim, vocab_size, bias=False))


# ---------------------------------------------------------------- torchtune/generation/_generation.py
def multinomial_sample_one(probs, q):
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


def sample(logits, *, temperature=1.0, top_k=None, q=None):
    logits = logits / max(temperature, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    if q is None:
        q = torch.empty_like(probs).exponential_(1)
    return multinomial_sample_one(probs, q)


def generate_next_token(model, input_pos, x, q, *, mask=None, temperature=1.0, top_k=None):
    logits = model(x, input_pos=input_pos, mask=mask)
    return sample(logits[:, -1].clone(), temperature=temperature, top_k=top_k, q=q), logits


def get_causal_mask_from_padding_mask(padding_mask, target_seq_len=None):
    bsz, seq_len = padding_mask.shape
    target_seq_len = seq_len if target_seq_len is None else target_seq_len
    if target_seq_len < seq_len:
        raise AssertionError("target_seq_len cannot be shorter than the sequence length of the padding mask.")
    mask = torch.tril(
        torch.ones(seq_len, target_seq_len, device=padding_mask.device, dtype=bool),
        diagonal=0,
    ).repeat(bsz, 1, 1)
    mask.narrow(2, 0, seq_len).mul_(padding_mask[:, None, :].expand(-1, seq_len, -1))
    mask.diagonal(dim1=1, dim2=2).copy_(torch.Tensor([True]))
    return mask


def get_position_ids_from_padding_mask(padding_mask):
    return ((padding_mask.cumsum(-1) - 1) * padding_mask).to(torch.int)


@torch.inference_mode()
def generate(model, prompt, *, max_generated_tokens, pad_id=0, temperature=1.0, top_k=None, rng=None):
    prompt = prompt.view(1, -1) if prompt.ndim == 1 else prompt
    bsz, prompt_length = prompt.size()
    total_response_length = prompt_length + max_generated_tokens
    generated_tokens = prompt.clone()
    incremental_decoding = model.caches_are_enabled()
    max_seq_len = total_response_length if not incremental_decoding else model.decoder_max_cache_seq_len

    padding_masks = generated_tokens != pad_id
    if not padding_masks.all():
        padding_masks = torch.nn.functional.pad(padding_masks, (0, max_generated_tokens), value=True)
        masks = get_causal_mask_from_padding_mask(padding_masks, target_seq_len=max_seq_len)
        input_pos = get_position_ids_from_padding_mask(padding_masks)
    else:
        masks = torch.tril(torch.ones(total_response_length, max_seq_len, dtype=torch.bool,
                                      device=prompt.device)).unsqueeze(0)
        input_pos = torch.arange(0, total_response_length, device=generated_tokens.device).unsqueeze(0)

    if incremental_decoding:
        curr_masks = masks[:, :prompt_length]
    else:
        curr_masks = masks[:, :prompt_length, :prompt_length]

    q = torch.empty((bsz, model.tok_embeddings.num_embeddings), device=prompt.device).exponential_(1, generator=rng)
    tokens, generated_logits = generate_next_token(
        model, input_pos=input_pos[:, :prompt_length].squeeze(), mask=curr_masks, x=prompt,
        temperature=temperature, top_k=top_k, q=q,
    )
    generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    curr_pos = prompt_length

    for _ in range(max_generated_tokens - 1):
        if incremental_decoding:
            curr_input_pos = input_pos[:, curr_pos]
            curr_masks = masks[:, curr_pos, None, :]
        else:
            tokens = generated_tokens.clone()
            curr_input_pos = input_pos[:, : curr_pos + 1]
            curr_masks = masks[:, : curr_pos + 1, : curr_pos + 1]
        q = torch.empty((bsz, model.tok_embeddings.num_embeddings),
                        device=prompt.device).exponential_(1, generator=rng)
        tokens, logits = generate_next_token(
            model, input_pos=curr_input_pos, x=tokens.clone(), mask=curr_masks,
            temperature=temperature, top_k=top_k, q=q,
        )
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
        curr_pos += 1
        if incremental_decoding:
            generated_logits = torch.cat([generated_logits, logits], dim=1)
        else:
            generated_logits = logits
    return generated_tokens, generated_logits


# ---------------------------------------------------------------- run + reference
def main():
    vocab, max_gen = 64, 6
    model = llama3_tiny(vocab_size=vocab).eval()
    prompts = [
        [5, 17, 33, 2, 9, 41, 12, 7],
        [8, 30, 4],
        [22, 11, 60, 3, 19],
    ]
    pad_id = 0
    width = max(len(p) for p in prompts)
    batch = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])  # left padded

    model.setup_caches(batch_size=len(prompts), dtype=torch.float32, decoder_max_seq_len=width + max_gen + 2)
    rng = torch.Generator().manual_seed(0)
    out_tokens, out_logits = generate(model, batch, max_generated_tokens=max_gen, pad_id=pad_id, top_k=1, rng=rng)

    # reference: each prompt alone, unpadded, a fresh model copy without caches, greedy over full recomputation
    ref_model = llama3_tiny(vocab_size=vocab).eval()
    ref_model.load_state_dict(model.state_dict())
    for b, p in enumerate(prompts):
        seq = torch.tensor([p])
        with torch.inference_mode():
            for _ in range(max_gen):
                logits = ref_model(seq)  # no mask, no cache: SDPA is_causal
                nxt = logits[:, -1].argmax(-1, keepdim=True)
                seq = torch.cat([seq, nxt], dim=-1)
            full_logits = ref_model(seq[:, :-1])
        got = out_tokens[b, width - len(p):]
        assert torch.equal(got, seq[0].to(got.dtype)), (b, got.tolist(), seq[0].tolist())
        # batched logits: prompt positions (real ones) then one row per generated step
        real_logits = out_logits[b, width - len(p):]
        assert real_logits.shape[0] == full_logits.shape[1], (real_logits.shape, full_logits.shape)
        torch.testing.assert_close(real_logits, full_logits[0], atol=1e-4, rtol=1e-4)
    print("torchtune generate (left padded, KV cache): tokens and logits match per-prompt runs:",
          out_tokens.tolist())


if __name__ == "__main__":
    main()
