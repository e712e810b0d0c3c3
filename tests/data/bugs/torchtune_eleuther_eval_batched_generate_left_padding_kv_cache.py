"""torchtune eleuther_eval generation: left-padded batches decode through the KV cache's causal mask only.

Citation: meta-pytorch/torchtune#1250 (issue "Fix generation for bsz > 1", found by @iankur in
meta-pytorch/torchtune#1237 for the Eleuther eval recipe), closed by meta-pytorch/torchtune#1424
("[RFC] Batched inference 🤝 KV-cache 🤝 compile").

Bug: with KV caches set up, ``TransformerDecoder.forward`` ignored any padding and always used the cache's
own mask, ``mask = self.causal_mask[None, input_pos]`` (a ``torch.tril`` over ``max_seq_len``); the eval
recipe's ``_model_generate`` left-pads the batch of contexts (``left_pad_sequence``) and returned
``torch.ones_like(x)`` as the "mask" the harness expects.  Every shorter context's real tokens, and every
generated token, attended its left padding; issue #1250 lists the per-sample masks that were wanted.

Fix (#1424): ``generate`` takes ``pad_id``, builds ``padding_masks = prompt != pad_id``, turns them into
per-sample causal masks over the cache (``get_causal_mask_from_padding_mask``), and passes ``mask=`` / ``input_pos=`` rows at prefill and at
every decode step; the decoder accepts a mask with caches enabled.

This program keeps those names (plain torch, SDPA as torchtune's attention calls it).  Two contexts of 6
and 2 tokens (4 pads), max_seq_len 12, 3 generated tokens: buggy, row 1's queries see its pads at prefill
and at each decode step.  The PR descriptions were read, not the diff; the padding-derived RoPE positions
of the fix are left out (this model has learned positions and no RoPE).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class KVCache(nn.Module):
    def __init__(self, batch_size, max_seq_len, num_heads, head_dim):
        super().__init__()
        shape = (batch_size, num_heads, max_seq_len, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape), persistent=False)

    def update(self, input_pos, k_val, v_val):
        # write at the batch's cache slots (the same columns for every row)
        slots = input_pos if input_pos.ndim == 1 else input_pos[0]
        self.k_cache[:, :, slots] = k_val
        self.v_cache[:, :, slots] = v_val
        return self.k_cache, self.v_cache


class CausalSelfAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_seq_len):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.max_seq_len = max_seq_len
        self.q_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.output_proj = nn.Linear(embed_dim, embed_dim, bias=False)
        self.pos_embeddings = nn.Embedding(max_seq_len, embed_dim)
        self.kv_cache = None

    def forward(self, x, *, mask=None, input_pos=None):
        bsz, seq_len, _ = x.shape
        pos = input_pos if input_pos is not None else torch.arange(seq_len)
        x = x + self.pos_embeddings(pos).expand(bsz, seq_len, -1)
        q = self.q_proj(x).view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(bsz, seq_len, self.num_heads, self.head_dim).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)
        if mask is not None:
            mask = mask[:, None, :, :]
        output = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=self.kv_cache is None and mask is None
        )
        return self.output_proj(output.transpose(1, 2).reshape(bsz, seq_len, -1))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, embed_dim, num_heads, max_seq_len):
        super().__init__()
        self.attn = CausalSelfAttention(embed_dim, num_heads, max_seq_len)
        self.mlp = nn.Sequential(nn.Linear(embed_dim, 2 * embed_dim), nn.SiLU(), nn.Linear(2 * embed_dim, embed_dim))
        self.sa_norm = nn.LayerNorm(embed_dim)
        self.mlp_norm = nn.LayerNorm(embed_dim)

    def forward(self, x, *, mask=None, input_pos=None):
        h = x + self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.mlp_norm(h))


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size=64, embed_dim=32, num_heads=4, num_layers=2, max_seq_len=12):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, embed_dim)
        self.layers = nn.ModuleList(
            [TransformerDecoderLayer(embed_dim, num_heads, max_seq_len) for _ in range(num_layers)]
        )
        self.norm = nn.LayerNorm(embed_dim)
        self.output = nn.Linear(embed_dim, vocab_size, bias=False)
        self.causal_mask = None

    def setup_caches(self, batch_size):
        for layer in self.layers:
            layer.attn.kv_cache = KVCache(batch_size, self.max_seq_len, layer.attn.num_heads, layer.attn.head_dim)
        self.causal_mask = torch.tril(torch.ones(self.max_seq_len, self.max_seq_len, dtype=torch.bool))

    def caches_are_enabled(self):
        return self.layers[0].attn.kv_cache is not None

    def forward(self, tokens, *, mask=None, input_pos=None):
        h = self.tok_embeddings(tokens)
        if self.causal_mask is not None:
            if input_pos is None:
                raise ValueError("Caches are setup, but the position of input token is missing")
            if not FIXED:
                if mask is not None:
                    raise ValueError("An attention mask was set. Cannot use a non-causal mask for inference")
                # shape: [1, input_pos_len, m_s]
                # in most cases input_pos_len should be 1
                mask = self.causal_mask[None, input_pos]
            elif mask is None:
                raise ValueError("KV-caches are enabled: a mask over the cache must be passed")
        for layer in self.layers:
            h = layer(h, mask=mask, input_pos=input_pos)
        return self.output(self.norm(h))


def get_causal_mask_from_padding_mask(padding_mask, target_seq_len=None):
    bsz, seq_len = padding_mask.shape
    target_seq_len = seq_len if target_seq_len is None else target_seq_len
    mask = torch.tril(torch.ones(seq_len, target_seq_len, dtype=torch.bool))[None].expand(bsz, -1, -1).clone()
    mask[:, :, :seq_len] &= padding_mask[:, None, :].expand(-1, seq_len, -1)
    mask.diagonal(dim1=1, dim2=2)[:] = True
    return mask


def generate_next_token(model, input_pos, x, mask=None):
    logits = model(x, input_pos=input_pos, mask=mask)
    return logits[:, -1].argmax(-1, keepdim=True)


@torch.no_grad()
def generate(model, prompt, *, max_generated_tokens, pad_id=0):
    bsz, prompt_length = prompt.size()
    total_response_length = prompt_length + max_generated_tokens
    generated_tokens = prompt.clone()
    if FIXED:
        padding_masks = generated_tokens != pad_id
        padding_masks = F.pad(padding_masks, (0, max_generated_tokens), value=True)
        masks = get_causal_mask_from_padding_mask(padding_masks, target_seq_len=model.max_seq_len)
        # torchtune also derives RoPE positions from padding_masks (get_position_ids_from_padding_mask); this
        # model's cache is written at column indices, so the columns serve as input_pos here
        cache_pos = torch.arange(total_response_length)
        tokens = generate_next_token(model, input_pos=cache_pos[:prompt_length], x=prompt,
                                     mask=masks[:, :prompt_length])
    else:
        input_pos = torch.arange(0, model.max_seq_len)
        tokens = generate_next_token(model, input_pos=input_pos[:prompt_length], x=prompt)
    generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    curr_pos = prompt_length
    for _ in range(max_generated_tokens - 1):
        if FIXED:
            tokens = generate_next_token(model, input_pos=cache_pos[curr_pos].unsqueeze(0), x=tokens,
                                         mask=masks[:, curr_pos, None, :])
        else:
            curr_input_pos = input_pos[curr_pos].unsqueeze(0)
            tokens = generate_next_token(model, input_pos=curr_input_pos, x=tokens.clone())
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
        curr_pos += 1
    return generated_tokens


def left_pad_sequence(sequences, padding_value=0):
    max_len = max(len(s) for s in sequences)
    return torch.stack([F.pad(s, (max_len - len(s), 0), value=padding_value) for s in sequences])


class _EvalWrapper:
    """The recipe's lm-eval HFLM subclass, reduced to the batched generation path."""

    def __init__(self, model, pad_id=0, max_gen_toks=3):
        self._model = model
        self._pad_id = pad_id
        self._max_gen_toks = max_gen_toks

    def tok_batch_encode(self, batch_ids):
        x = left_pad_sequence([torch.tensor(ids) for ids in batch_ids], padding_value=self._pad_id)
        return x, torch.ones_like(x)  # return 'mask' b/c it's expected by the harness

    def _model_generate(self, context, **generation_kwargs):
        self._model.setup_caches(batch_size=context.size(0))
        return generate(self._model, context, max_generated_tokens=self._max_gen_toks, pad_id=self._pad_id)


def main():
    torch.manual_seed(0)
    model = TransformerDecoder().eval()
    harness = _EvalWrapper(model)
    context, _ = harness.tok_batch_encode([[5, 9, 13, 17, 21, 25], [7, 11]])
    out = harness._model_generate(context)
    print(f"{'fixed' if FIXED else 'buggy'} generated {out[:, context.size(1):].tolist()}")


if __name__ == "__main__":
    main()
