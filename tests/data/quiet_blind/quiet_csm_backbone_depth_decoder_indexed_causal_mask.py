"""Sesame CSM frame generation: backbone + depth decoder over torchtune KV caches, ported small.

Follows SesameAILabs/csm @2d720827843b653c4d67bb4445b1c0a4f59e646f:
  models.py     _create_causal_mask (tril over max_seq_len), _index_causal_mask
                (mask[input_pos, :] -> (b, s, max_seq_len)), Model.setup_caches
                (backbone cache max_seq_len, decoder cache decoder_max_seq_len =
                audio_num_codebooks, one causal mask buffer for each),
                Model.generate_frame (backbone prefill / one-frame step; the decoder's caches
                are reset every frame, then [last_h, c0] at positions 0, 1 and one codebook
                per call after), _embed_tokens / tokens_mask (zeroes the unused columns of a
                frame's embedding, not an attention mask)
  generator.py  Generator.generate (text frames use the last column, audio frames the
                first K columns plus an all-zero EOS frame; curr_pos = curr_pos[:, -1:] + 1)
torchtune pieces CSM relies on, written in plain torch with the same semantics:
  torchtune/modules/kv_cache.py       KVCache.update (writes at its own cache_pos counter,
                                       returns the whole max_seq_len buffer), reset
  torchtune/modules/attention.py      MultiHeadAttention.forward (RoPE at input_pos, GQA
                                       expand after the cache, bool mask[:, None] into SDPA,
                                       True = attend)
  torchtune/modules/transformer.py    TransformerDecoder.forward(tokens, mask, input_pos)

The cache buffers hold max_seq_len slots; slots not yet written are zeros and are hidden
because row p of the tril mask is True only on keys 0..p. Checked against a cache-free
recomputation of the whole prefix (backbone) and the whole depth sequence (decoder) every
frame, each attention done by slicing keys 0..t per query (no mask).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


# ---------------- torchtune stand-ins ----------------
class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, num_kv_heads, head_dim, dtype):
        super().__init__()
        cache_shape = (batch_size, num_kv_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("v_cache", torch.zeros(cache_shape, dtype=dtype), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, cache_shape[2]), persistent=False)
        self.batch_size = batch_size

    @property
    def size(self):
        return self.cache_pos[0].item()

    def reset(self):
        self.k_cache.zero_()
        self.v_cache.zero_()
        self.cache_pos -= self.size

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
    def __init__(self, dim, max_seq_len, base=10_000):
        super().__init__()
        theta = 1.0 / (base ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        seq_idx = torch.arange(max_seq_len, dtype=theta.dtype)
        idx_theta = torch.einsum("i, j -> ij", seq_idx, theta).float()
        self.register_buffer("cache", torch.stack([torch.cos(idx_theta), torch.sin(idx_theta)], dim=-1),
                             persistent=False)

    def forward(self, x, input_pos):
        # x: [b, s, n_h, h_d]
        seq_len = x.size(1)
        rope_cache = self.cache[:seq_len] if input_pos is None else self.cache[input_pos]
        xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
        rope_cache = rope_cache.view(-1, xshaped.size(1), 1, xshaped.size(3), 2)
        x_out = torch.stack([
            xshaped[..., 0] * rope_cache[..., 0] - xshaped[..., 1] * rope_cache[..., 1],
            xshaped[..., 1] * rope_cache[..., 0] + xshaped[..., 0] * rope_cache[..., 1],
        ], -1)
        return x_out.flatten(3).type_as(x)


class MultiHeadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, num_kv_heads, max_seq_len):
        super().__init__()
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim = embed_dim // num_heads
        self.q_proj = nn.Linear(embed_dim, num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_kv_heads * self.head_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = RotaryPositionalEmbeddings(self.head_dim, max_seq_len)
        self.kv_cache = None
        self.is_causal = True

    def setup_cache(self, batch_size, dtype, max_seq_len):
        self.kv_cache = KVCache(batch_size, max_seq_len, self.num_kv_heads, self.head_dim, dtype)

    def forward(self, x, mask=None, input_pos=None, reference=False):
        b, s_x, _ = x.shape
        q_per_kv = self.num_heads // self.num_kv_heads
        q = self.q_proj(x).view(b, s_x, self.num_kv_heads * q_per_kv, self.head_dim)
        q = self.pos_embeddings(q, input_pos=input_pos).transpose(1, 2)
        k = self.k_proj(x).view(b, s_x, -1, self.head_dim)
        v = self.v_proj(x).view(b, s_x, -1, self.head_dim)
        k = self.pos_embeddings(k, input_pos=input_pos).transpose(1, 2)
        v = v.transpose(1, 2)
        if not reference and self.kv_cache is not None:
            k, v = self.kv_cache.update(k, v)
        if self.num_heads != self.num_kv_heads:
            expand_shape = (b, self.num_kv_heads, q_per_kv, -1, self.head_dim)
            k = k.unsqueeze(2).expand(expand_shape).flatten(1, 2)
            v = v.unsqueeze(2).expand(expand_shape).flatten(1, 2)
        if reference:
            out = torch.zeros_like(q)
            for t in range(s_x):  # whole prefix present: query t sees keys 0..t
                w = torch.softmax(q[:, :, t:t + 1] @ k[:, :, :t + 1].transpose(-1, -2) / self.head_dim ** 0.5, -1)
                out[:, :, t:t + 1] = w @ v[:, :, :t + 1]
        else:
            if mask is not None:
                mask = mask[:, None, :, :]  # shape: [b, 1, s, s]
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=0.0,
                is_causal=self.kv_cache is None and mask is None and self.is_causal)
        out = out.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(out)


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, dim, heads, kv_heads, max_seq_len):
        super().__init__()
        self.attn = MultiHeadAttention(dim, heads, kv_heads, max_seq_len)
        self.sa_norm = nn.RMSNorm(dim, eps=1e-5)
        self.mlp_norm = nn.RMSNorm(dim, eps=1e-5)
        self.w1 = nn.Linear(dim, 2 * dim, bias=False)
        self.w3 = nn.Linear(dim, 2 * dim, bias=False)
        self.w2 = nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x, mask=None, input_pos=None, reference=False):
        h = self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos, reference=reference) + x
        y = self.mlp_norm(h)
        return self.w2(F.silu(self.w1(y)) * self.w3(y)) + h


class TransformerDecoder(nn.Module):
    def __init__(self, dim, heads, kv_heads, num_layers, max_seq_len):
        super().__init__()
        self.layers = nn.ModuleList([TransformerSelfAttentionLayer(dim, heads, kv_heads, max_seq_len)
                                     for _ in range(num_layers)])
        self.norm = nn.RMSNorm(dim, eps=1e-5)
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Identity()
        self.output = nn.Identity()

    def setup_caches(self, batch_size, dtype, decoder_max_seq_len=None):
        n = decoder_max_seq_len if decoder_max_seq_len is not None else self.max_seq_len
        for layer in self.layers:
            layer.attn.setup_cache(batch_size, dtype, n)

    def caches_are_enabled(self):
        return self.layers[0].attn.kv_cache is not None

    def reset_caches(self):
        for layer in self.layers:
            layer.attn.kv_cache.reset()

    def forward(self, tokens, mask=None, input_pos=None, reference=False):
        if self.caches_are_enabled() and mask is None and not reference:
            raise ValueError("KV-caches are setup for inference mode, causal masks must be provided!")
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos, reference=reference)
        return self.output(self.norm(h))


# ---------------- CSM models.py ----------------
def _create_causal_mask(seq_len, device):
    return torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device))


def _index_causal_mask(mask, input_pos):
    """mask: (max_seq_len, max_seq_len), input_pos: (batch_size, seq_len)
    Returns: (batch_size, seq_len, max_seq_len)"""
    r = mask[input_pos, :]
    return r


def sample_topk(logits, topk, temperature):
    # topk=1 here: the kept logit is the argmax, so the exponential race is deterministic
    logits = logits / temperature
    indices_to_remove = logits < torch.topk(logits, topk)[0][..., -1, None]
    scores_processed = logits.masked_fill(indices_to_remove, -float("Inf"))
    probs = torch.softmax(F.log_softmax(scores_processed, dim=-1), dim=-1)
    q = torch.empty_like(probs).exponential_(1)
    return torch.argmax(probs / q, dim=-1, keepdim=True).to(dtype=torch.int)


class Model(nn.Module):
    def __init__(self, text_vocab_size=40, audio_vocab_size=16, audio_num_codebooks=4,
                 backbone_dim=32, decoder_dim=16, max_seq_len=64):
        super().__init__()
        self.audio_vocab_size, self.audio_num_codebooks = audio_vocab_size, audio_num_codebooks
        self.backbone = TransformerDecoder(backbone_dim, 4, 2, 2, max_seq_len)
        self.decoder = TransformerDecoder(decoder_dim, 4, 2, 2, max_seq_len)
        self.text_embeddings = nn.Embedding(text_vocab_size, backbone_dim)
        self.audio_embeddings = nn.Embedding(audio_vocab_size * audio_num_codebooks, backbone_dim)
        self.projection = nn.Linear(backbone_dim, decoder_dim, bias=False)
        self.codebook0_head = nn.Linear(backbone_dim, audio_vocab_size, bias=False)
        self.audio_head = nn.Parameter(torch.randn(audio_num_codebooks - 1, decoder_dim, audio_vocab_size))

    def setup_caches(self, max_batch_size):
        dtype = next(self.parameters()).dtype
        device = next(self.parameters()).device
        self.backbone.setup_caches(max_batch_size, dtype)
        self.decoder.setup_caches(max_batch_size, dtype, decoder_max_seq_len=self.audio_num_codebooks)
        self.register_buffer("backbone_causal_mask", _create_causal_mask(self.backbone.max_seq_len, device))
        self.register_buffer("decoder_causal_mask", _create_causal_mask(self.audio_num_codebooks, device))

    def reset_caches(self):
        self.backbone.reset_caches()
        self.decoder.reset_caches()

    def _embed_audio(self, codebook, tokens):
        return self.audio_embeddings(tokens + codebook * self.audio_vocab_size)

    def _embed_tokens(self, tokens):
        text_embeds = self.text_embeddings(tokens[:, :, -1]).unsqueeze(-2)
        audio_tokens = tokens[:, :, :-1] + (
            self.audio_vocab_size * torch.arange(self.audio_num_codebooks, device=tokens.device))
        audio_embeds = self.audio_embeddings(audio_tokens.view(-1)).reshape(
            tokens.size(0), tokens.size(1), self.audio_num_codebooks, -1)
        return torch.cat([audio_embeds, text_embeds], dim=-2)

    def generate_frame(self, tokens, tokens_mask, input_pos, temperature, topk):
        b, s, _ = tokens.size()
        assert self.backbone.caches_are_enabled(), "backbone caches are not enabled"
        curr_backbone_mask = _index_causal_mask(self.backbone_causal_mask, input_pos)
        embeds = self._embed_tokens(tokens)
        masked_embeds = embeds * tokens_mask.unsqueeze(-1)
        h = masked_embeds.sum(dim=2)
        h = self.backbone(h, input_pos=input_pos, mask=curr_backbone_mask)

        last_h = h[:, -1, :]
        c0_logits = self.codebook0_head(last_h)
        c0_sample = sample_topk(c0_logits, topk, temperature)
        c0_embed = self._embed_audio(0, c0_sample)

        curr_h = torch.cat([last_h.unsqueeze(1), c0_embed], dim=1)
        curr_sample = c0_sample.clone()
        curr_pos = torch.arange(0, curr_h.size(1), device=curr_h.device).unsqueeze(0).repeat(curr_h.size(0), 1)

        # Decoder caches must be reset every frame.
        self.decoder.reset_caches()
        logits = [c0_logits]
        for i in range(1, self.audio_num_codebooks):
            curr_decoder_mask = _index_causal_mask(self.decoder_causal_mask, curr_pos)
            decoder_h = self.decoder(self.projection(curr_h), input_pos=curr_pos, mask=curr_decoder_mask)
            ci_logits = torch.mm(decoder_h[:, -1, :], self.audio_head[i - 1])
            logits.append(ci_logits)
            ci_sample = sample_topk(ci_logits, topk, temperature)
            ci_embed = self._embed_audio(i, ci_sample)
            curr_h = ci_embed
            curr_sample = torch.cat([curr_sample, ci_sample], dim=1)
            curr_pos = curr_pos[:, -1:] + 1
        return curr_sample, torch.stack(logits, 1)

    # independent reference: no cache, whole prefix / whole depth sequence recomputed
    def reference_frame(self, all_tokens, all_mask):
        h = (self._embed_tokens(all_tokens) * all_mask.unsqueeze(-1)).sum(dim=2)
        pos = torch.arange(h.size(1)).unsqueeze(0)
        h = self.backbone(h, input_pos=pos, reference=True)
        last_h = h[:, -1, :]
        c0_logits = self.codebook0_head(last_h)
        sample = [c0_logits.argmax(-1, keepdim=True).int()]
        depth = [last_h.unsqueeze(1), self._embed_audio(0, sample[0])]
        logits = [c0_logits]
        for i in range(1, self.audio_num_codebooks):
            seq = torch.cat(depth, dim=1)
            dpos = torch.arange(seq.size(1)).unsqueeze(0)
            dh = self.decoder(self.projection(seq), input_pos=dpos, reference=True)
            ci_logits = torch.mm(dh[:, -1, :], self.audio_head[i - 1])
            logits.append(ci_logits)
            sample.append(ci_logits.argmax(-1, keepdim=True).int())
            depth.append(self._embed_audio(i, sample[-1]))
        return torch.cat(sample, 1), torch.stack(logits, 1)


def text_frames(ids, K):
    f = torch.zeros(len(ids), K + 1).long()
    m = torch.zeros(len(ids), K + 1).bool()
    f[:, -1] = torch.tensor(ids)
    m[:, -1] = True
    return f, m


def audio_frames(codes, K):  # codes (K, T); an all-zero EOS frame is appended
    codes = torch.cat([codes, torch.zeros(codes.size(0), 1).long()], dim=1)
    f = torch.zeros(codes.size(1), K + 1).long()
    m = torch.zeros(codes.size(1), K + 1).bool()
    f[:, :-1] = codes.transpose(0, 1)
    m[:, :-1] = True
    return f, m


@torch.inference_mode()
def main():
    K = 4
    model = Model(audio_num_codebooks=K).eval()
    model.setup_caches(1)
    model.reset_caches()

    g = torch.Generator().manual_seed(1)
    parts = [text_frames(torch.randint(1, 40, (6,), generator=g).tolist(), K),
             audio_frames(torch.randint(1, 16, (K, 5), generator=g), K),
             text_frames(torch.randint(1, 40, (4,), generator=g).tolist(), K)]
    prompt_tokens = torch.cat([p[0] for p in parts], 0)
    prompt_mask = torch.cat([p[1] for p in parts], 0)

    curr_tokens = prompt_tokens.unsqueeze(0)
    curr_tokens_mask = prompt_mask.unsqueeze(0)
    curr_pos = torch.arange(0, prompt_tokens.size(0)).unsqueeze(0).long()
    all_tokens, all_mask = curr_tokens.clone(), curr_tokens_mask.clone()

    ok = True
    n_frames = 0
    for _ in range(12):
        sample, logits = model.generate_frame(curr_tokens, curr_tokens_mask, curr_pos, temperature=0.9, topk=1)
        ref_sample, ref_logits = model.reference_frame(all_tokens, all_mask)
        same = torch.equal(sample, ref_sample) and torch.allclose(logits / 0.9, ref_logits / 0.9, atol=1e-4)
        ok &= same
        n_frames += 1
        if torch.all(sample == 0):
            break  # eos
        curr_tokens = torch.cat([sample, torch.zeros(1, 1).long()], dim=1).unsqueeze(1)
        curr_tokens_mask = torch.cat([torch.ones_like(sample).bool(), torch.zeros(1, 1).bool()], dim=1).unsqueeze(1)
        curr_pos = curr_pos[:, -1:] + 1
        all_tokens = torch.cat([all_tokens, curr_tokens.long()], 1)
        all_mask = torch.cat([all_mask, curr_tokens_mask], 1)

    print(f"prompt frames {prompt_tokens.size(0)}, generated frames {n_frames}, "
          f"backbone cache fill {model.backbone.layers[0].attn.kv_cache.size}/{model.backbone.max_seq_len}")
    print("cached generate_frame matches cache-free reference:", ok)
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
