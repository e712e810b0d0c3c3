# Citation: Physical-Intelligence/openpi#705 ("potential bug in setting `positions` value for new
#   token during decoding"), fix proposed in Physical-Intelligence/openpi#707 ("pi0_fast: fix
#   off-by-one in next-token positions"; the PR was still open when last read). The same line is
#   in openpi at commit 0d3eb2db836e443a6ca9debb242d0aabe4628f1f.
# Upstream: src/openpi/models/pi0_fast.py -- make_attn_mask, left_to_right_align,
#   Pi0FAST.sample_actions (prefill of the right-aligned prefix into the KV cache, then the
#   `step` loop that decodes FAST action tokens one by one with `positions` and `mask`).
# Bug: the prefix is placed at rotary positions 0..prefill_len-1 (cumsum(prefix_mask) - 1), but
#   the decode loop gives the k-th generated token position prefill_len + step + 1, so position
#   prefill_len is never used and every action token sits one place further than training put it
#   (training uses cumsum(input_mask) - 1 over prefix + action tokens, contiguous).
# Fix: positions = prefill_len[:, None] + step (the first new token goes at position prefill_len).
#
# JAX/flax code ported to plain torch; the Gemma decoder is shrunk to 2 layers, width 32, a 4-head
# rotary attention with a preallocated KV cache written at cache index prefill_size + step, as
# big_vision's gemma `decode=True` path does.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

VOCAB = 96
WIDTH = 32
HEADS = 4
HEAD_DIM = WIDTH // HEADS
DEPTH = 2
MAX_DECODING_STEPS = 6
NUM_IMG_TOKENS = 4


def make_attn_mask(input_mask, mask_ar):
    """openpi: tokens attend to valid tokens whose cumulative ar-mask is <= their own."""
    mask_ar = torch.broadcast_to(mask_ar, input_mask.shape)
    cumsum = torch.cumsum(mask_ar.long(), dim=1)
    attn_mask = cumsum[:, None, :] <= cumsum[:, :, None]
    valid_mask = input_mask[:, None, :] & input_mask[:, :, None]
    return attn_mask & valid_mask


def left_to_right_align(x, input_mask, attn_mask):
    """openpi: converts one example from left-aligned to right-aligned (vmapped over batch)."""
    assert x.ndim == 2
    assert input_mask.ndim == 1
    assert attn_mask.ndim == 2
    seqlen = int((input_mask.long() * torch.arange(input_mask.shape[0])).max()) + 1
    x = torch.roll(x, -seqlen, dims=0)
    input_mask = torch.roll(input_mask, -seqlen, dims=0)
    attn_mask = torch.roll(attn_mask, (-seqlen, -seqlen), dims=(0, 1))
    return x, input_mask, attn_mask


def put_along_last_axis(arr, indices, values):
    out = arr.clone()
    out.scatter_(-1, indices, values.to(out.dtype))
    return out


def apply_rope(x, positions, max_wavelength=10_000):
    # x: (B, L, H, D), positions: (B, L)
    freq_exponents = (2.0 / x.shape[-1]) * torch.arange(x.shape[-1] // 2, dtype=torch.float32)
    timescale = max_wavelength**freq_exponents
    radians = positions[..., None].float() / timescale[None, None, :]
    radians = radians[..., None, :]
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = torch.split(x, x.shape[-1] // 2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * (1 + self.scale)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = nn.Linear(WIDTH, WIDTH, bias=False)
        self.o = nn.Linear(WIDTH, WIDTH, bias=False)
        nn.init.normal_(self.q.weight, std=0.6)
        nn.init.normal_(self.k.weight, std=0.6)
        nn.init.normal_(self.o.weight, std=0.4)

    def forward(self, x, positions, attn_mask, cache, cache_idx):
        b, l, _ = x.shape
        q = self.q(x).view(b, l, HEADS, HEAD_DIM)
        k = self.k(x).view(b, l, HEADS, HEAD_DIM)
        v = self.v(x).view(b, l, HEADS, HEAD_DIM)
        q = apply_rope(q, positions)
        k = apply_rope(k, positions)
        if cache is not None:
            k_cache, v_cache = cache
            k_cache[:, cache_idx : cache_idx + l] = k
            v_cache[:, cache_idx : cache_idx + l] = v
            k, v = k_cache, v_cache
        q = q.transpose(1, 2) * HEAD_DIM**-0.5
        logits = q @ k.permute(0, 2, 3, 1)  # (B, H, L, S)
        big_neg = -2.3819763e38
        logits = torch.where(attn_mask[:, None, :, :], logits, torch.full_like(logits, big_neg))
        probs = F.softmax(logits, dim=-1)
        out = probs @ v.transpose(1, 2)
        out = out.transpose(1, 2).reshape(b, l, WIDTH)
        return self.o(out)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre_attention_norm = RMSNorm(WIDTH)
        self.attn = Attention()
        self.pre_ffw_norm = RMSNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(approximate="tanh"), nn.Linear(4 * WIDTH, WIDTH))

    def forward(self, x, positions, attn_mask, cache, cache_idx):
        x = x + self.attn(self.pre_attention_norm(x), positions, attn_mask, cache, cache_idx)
        return x + self.mlp(self.pre_ffw_norm(x))


class GemmaLLM(nn.Module):
    """Stand-in for PaliGemma.llm: embed_only, or a decoder pass with an optional KV cache."""

    def __init__(self):
        super().__init__()
        self.embedder = nn.Embedding(VOCAB, WIDTH)
        nn.init.normal_(self.embedder.weight, std=0.05)
        self.layers = nn.ModuleList([Block() for _ in range(DEPTH)])
        self.final_norm = RMSNorm(WIDTH)

    def embed(self, tokens):
        return self.embedder(tokens) * WIDTH**0.5

    def forward(self, embedded_prefix, mask, positions, decode=False, kv_cache=None):
        b, l, _ = embedded_prefix.shape
        if decode and kv_cache is None:
            size = mask.shape[-1]
            kv_cache = {
                "idx": 0,
                "layers": [
                    (torch.zeros(b, size, HEADS, HEAD_DIM), torch.zeros(b, size, HEADS, HEAD_DIM))
                    for _ in self.layers
                ],
            }
        x = embedded_prefix
        idx = kv_cache["idx"] if decode else 0
        for i, layer in enumerate(self.layers):
            cache = kv_cache["layers"][i] if decode else None
            x = layer(x, positions, mask, cache, idx)
        if decode:
            kv_cache["idx"] = idx + l
        x = self.final_norm(x)
        logits = x @ self.embedder.weight.T
        return logits, kv_cache, None


class Pi0FAST(nn.Module):
    def __init__(self):
        super().__init__()
        self.llm = GemmaLLM()
        self.img_proj = nn.Linear(12, WIDTH)

    def embed_inputs(self, images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask):
        input_mask, ar_mask, token_embeddings = [], [], []
        # image tokens: always valid, bidirectional prefix (ar 0)
        image_token_embeddings = self.img_proj(images)
        token_embeddings.append(image_token_embeddings)
        input_mask.append(torch.ones(images.shape[:2], dtype=torch.bool))
        ar_mask.append(torch.zeros(images.shape[:2], dtype=torch.long))
        # prompt ("Task: ..., State: ...;\nAction: "), right padded by the FAST tokenizer
        token_embeddings.append(self.llm.embed(tokenized_prompt))
        input_mask.append(tokenized_prompt_mask)
        ar_mask.append(token_ar_mask)
        return torch.cat(token_embeddings, dim=1), torch.cat(input_mask, dim=1), torch.cat(ar_mask, dim=1)

    @torch.no_grad()
    def sample_actions(self, images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask,
                       max_decoding_steps=MAX_DECODING_STEPS):
        prefix_token_embeddings, prefix_mask, prefix_ar_mask = self.embed_inputs(
            images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask
        )
        prefix_attn_mask = make_attn_mask(prefix_mask, prefix_ar_mask)

        # left to right align all input token sequences
        aligned = [
            left_to_right_align(prefix_token_embeddings[i], prefix_mask[i], prefix_attn_mask[i])
            for i in range(prefix_mask.shape[0])
        ]
        prefix_token_embeddings = torch.stack([a[0] for a in aligned])
        prefix_mask = torch.stack([a[1] for a in aligned])
        prefix_attn_mask = torch.stack([a[2] for a in aligned])

        prefill_size = prefix_token_embeddings.shape[1]
        prefill_len = torch.sum(prefix_mask.long(), dim=-1)
        prefix_start = prefill_size - prefill_len

        # first fill KV cache with a forward pass of the prefix
        # pad attention mask to set the size of the KV cache (prefill_size + max_decoding_steps)
        prefix_attn_mask = F.pad(prefix_attn_mask, (0, max_decoding_steps), value=False)
        prefix_positions = torch.cumsum(prefix_mask.long(), dim=-1) - 1
        prefix_logits, kv_cache, _ = self.llm(
            embedded_prefix=prefix_token_embeddings, mask=prefix_attn_mask, positions=prefix_positions, decode=True
        )

        last_logit = prefix_logits[:, -1:]
        output_tokens = torch.zeros((last_logit.shape[0], max_decoding_steps), dtype=torch.long)
        step_logits = []

        step = 0
        all_eos = False
        while (not all_eos) and step < max_decoding_steps:
            token = torch.argmax(last_logit, dim=-1)  # temperature 0.0
            output_tokens = put_along_last_axis(output_tokens, torch.full((token.shape[0], 1), step), token)

            has_eos = torch.any(token == 1, dim=-1)
            all_eos = bool(torch.all(has_eos))

            # Decode one step
            token_embedding = self.llm.embed(token)
            if FIXED:
                positions = prefill_len[:, None] + step
            else:
                positions = prefill_len[:, None] + step + 1
            ar = torch.arange(prefill_size + max_decoding_steps)
            mask = torch.logical_and(
                ar[None, None, :] >= prefix_start[:, None, None],
                ar[None, None, :] < (prefill_size + step + 1),
            )
            last_logit, kv_cache, _ = self.llm(
                embedded_prefix=token_embedding, mask=mask, positions=positions, decode=True, kv_cache=kv_cache
            )
            step_logits.append(last_logit[:, 0])
            step += 1
        return output_tokens, torch.stack(step_logits, dim=1)

    @torch.no_grad()
    def teacher_forced_logits(self, images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask, action_tokens):
        """compute_loss layout: prefix + action tokens in one pass, positions cumsum(input_mask) - 1."""
        b = images.shape[0]
        lens = tokenized_prompt_mask.sum(-1)
        rows, masks, ars = [], [], []
        for i in range(b):
            real = tokenized_prompt[i, : lens[i]]
            pad = tokenized_prompt.shape[1] - lens[i]
            rows.append(torch.cat([real, action_tokens[i], torch.zeros(pad, dtype=torch.long)]))
            masks.append(torch.cat([torch.ones(lens[i] + action_tokens.shape[1], dtype=torch.bool),
                                    torch.zeros(pad, dtype=torch.bool)]))
            ars.append(torch.cat([torch.zeros(lens[i], dtype=torch.long),
                                  torch.ones(action_tokens.shape[1], dtype=torch.long),
                                  torch.zeros(pad, dtype=torch.long)]))
        emb, input_mask, ar_mask = self.embed_inputs(images, torch.stack(rows), torch.stack(masks), torch.stack(ars))
        attn_mask = make_attn_mask(input_mask, ar_mask)
        positions = torch.cumsum(input_mask.long(), dim=1) - 1
        logits, _, _ = self.llm(emb, attn_mask, positions, decode=False)
        out = []
        for i in range(b):
            start = NUM_IMG_TOKENS + int(lens[i])
            out.append(logits[i, start : start + action_tokens.shape[1]])
        return torch.stack(out)


def main():
    model = Pi0FAST().eval()
    B = 2
    images = torch.randn(B, NUM_IMG_TOKENS, 12)
    max_len = 10
    prompt_lens = [7, 10]
    tokenized_prompt = torch.zeros(B, max_len, dtype=torch.long)
    tokenized_prompt_mask = torch.zeros(B, max_len, dtype=torch.bool)
    for i, n in enumerate(prompt_lens):
        tokenized_prompt[i, :n] = torch.randint(2, VOCAB, (n,))
        tokenized_prompt_mask[i, :n] = True
    token_ar_mask = torch.zeros(B, max_len, dtype=torch.long)  # prefix: bidirectional

    tokens, step_logits = model.sample_actions(images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask)
    print("mode:", "fixed" if FIXED else "buggy")
    print("decoded FAST tokens:", tokens.tolist())

    # score the decoded chunk the way training lays it out (teacher forcing, one pass)
    tf_logits = model.teacher_forced_logits(images, tokenized_prompt, tokenized_prompt_mask, token_ar_mask, tokens)
    # decode step k's output predicts token k+1; teacher-forced position k predicts token k+1 too
    diff = (step_logits[:, :-1] - tf_logits[:, :-1]).abs().max().item()
    logp = F.log_softmax(step_logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).sum().item()
    print(f"max |decode logits - one-pass logits| = {diff:.6f}")
    print(f"sum log p(next token) during decode = {logp:.4f}")


if __name__ == "__main__":
    main()
