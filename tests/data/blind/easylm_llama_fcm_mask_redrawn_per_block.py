"""EasyLM LLaMA (JAX/Flax, ported to torch): the forgetful causal mask was drawn anew in every block.

Citation: young-geng/EasyLM commit 9fbfd1a ("Fixed FCM masking for llama"),
EasyLM/models/llama/llama_model.py (FlaxLLaMABlock, FlaxLLaMABlockCollection, FlaxLLaMAAttention).

The bug: with forgetful causal masking on (``fcm_max_ratio > 0``, training, ``deterministic=False``)
``FlaxLLaMABlock.__call__`` sampled its own ``fcm_ratio`` and its own random keep-mask from the
``'fcm'`` rng, so each layer of one training step saw a different set of forgotten keys.  FCM (and
EasyLM's GPT-J, which the LLaMA port was copied from) draws one mask per step in the block
collection and hands that same mask to every layer.

The fix: the FCM sampling moves from ``FlaxLLaMABlock`` into ``FlaxLLaMABlockCollection.__call__``
and the mask is passed to each block as ``fcm_mask``.

Ported at tiny sizes with random weights: the config object, the precomputed boolean causal mask
sliced to the query/key length, ``combine_masks(attention_mask, causal_mask, fcm_mask)``, the
``lax.select`` to a finfo.min bias, complex rotary embedding and the train step's BOS-shifted inputs
and masked cross-entropy.  jax's per-module ``make_rng('fcm')`` streams become one seeded
``torch.Generator`` consumed in call order.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class LLaMAConfig:
    def __init__(
        self,
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        max_sequence_length=32,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        bos_token_id=0,
        eos_token_id=1,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        fcm_min_ratio=0.0,
        fcm_max_ratio=0.0,
    ):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.max_sequence_length = max_sequence_length
        self.rms_norm_eps = rms_norm_eps
        self.initializer_range = initializer_range
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.resid_pdrop = resid_pdrop
        self.embd_pdrop = embd_pdrop
        self.attn_pdrop = attn_pdrop
        self.fcm_min_ratio = fcm_min_ratio
        self.fcm_max_ratio = fcm_max_ratio


def make_causal_mask(x):
    # flax.linen.make_causal_mask: (batch, 1, len, len), True = attend
    idxs = torch.arange(x.shape[-1])
    return (idxs[None, :, None] >= idxs[None, None, :]).unsqueeze(1).expand(x.shape[0], 1, -1, -1)


def combine_masks(*masks):
    masks = [m for m in masks if m is not None]
    if not masks:
        return None
    mask = masks[0].bool()
    for other in masks[1:]:
        mask = torch.logical_and(mask, other.bool())
    return mask


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.kernel = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return out * self.kernel


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end).float()
    freqs = torch.outer(t, freqs)
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    # add head dim
    freqs_cis = freqs_cis.reshape(*freqs_cis.shape[:2], 1, *freqs_cis.shape[2:])
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class FlaxLLaMAAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_dim = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = self.embed_dim // self.num_heads
        self.wq = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(self.embed_dim, self.num_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(self.embed_dim, config.hidden_size, bias=False)
        self.register_buffer(
            "causal_mask",
            make_causal_mask(torch.ones((1, config.max_sequence_length), dtype=torch.bool)),
            persistent=False,
        )
        self.register_buffer(
            "freqs_cis",
            precompute_freqs_cis(self.head_dim, config.max_sequence_length * 2),
            persistent=False,
        )

    def _split_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.num_heads, self.head_dim))

    def _merge_heads(self, hidden_states):
        return hidden_states.reshape(hidden_states.shape[:2] + (self.embed_dim,))

    def forward(self, hidden_states, attention_mask, position_ids, deterministic=True, fcm_mask=None):
        xq, xk, xv = self.wq(hidden_states), self.wk(hidden_states), self.wv(hidden_states)
        xq = self._split_heads(xq)
        xk = self._split_heads(xk)
        xv = self._split_heads(xv)

        freqs_cis = self.freqs_cis[position_ids]
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        query_length, key_length = xq.shape[1], xk.shape[1]
        causal_mask = self.causal_mask[:, :, :query_length, :key_length]

        batch_size = hidden_states.shape[0]
        causal_mask = causal_mask.expand((batch_size,) + causal_mask.shape[1:])

        attention_mask = attention_mask[:, None, None, :].expand(causal_mask.shape)
        attention_mask = combine_masks(attention_mask, causal_mask, fcm_mask)

        # transform boolean mask into float mask
        attention_bias = torch.where(
            attention_mask,
            torch.zeros((), dtype=xq.dtype),
            torch.full((), torch.finfo(xq.dtype).min, dtype=xq.dtype),
        )

        # flax dot_product_attention_weights: (batch, heads, q, k)
        attn_weights = torch.einsum("bqhd,bkhd->bhqk", xq / (self.head_dim ** 0.5), xk)
        attn_weights = attn_weights + attention_bias
        attn_weights = attn_weights.softmax(dim=-1)

        attn_output = torch.einsum("...hqk,...khd->...qhd", attn_weights, xv)
        attn_output = self._merge_heads(attn_output)
        attn_output = self.wo(attn_output)
        return (attn_output,)


class FlaxLLaMAMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.w1 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.w3 = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)

    def forward(self, x, deterministic=True):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def sample_fcm_mask(config, rng, batch_size, seq_length):
    # Apply forgetful causal mask
    fcm_ratio = config.fcm_min_ratio + (config.fcm_max_ratio - config.fcm_min_ratio) * torch.rand(
        (batch_size, 1, 1, 1), generator=rng
    )
    fcm_mask = torch.rand((batch_size, 1, seq_length, seq_length), generator=rng) > fcm_ratio
    fcm_mask[:, :, :, 0] = True
    return fcm_mask.bool()


class FlaxLLaMABlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.attention = FlaxLLaMAAttention(config)
        self.feed_forward = FlaxLLaMAMLP(config)
        self.attention_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, deterministic=True,
                fcm_mask=None, rngs=None):
        if not FIXED:
            if not deterministic and self.config.fcm_max_ratio > 0:
                batch_size, seq_length = hidden_states.shape[0], hidden_states.shape[1]
                fcm_mask = sample_fcm_mask(self.config, rngs["fcm"], batch_size, seq_length)
            else:
                fcm_mask = None

        attn_outputs = self.attention(
            self.attention_norm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            deterministic=deterministic,
            fcm_mask=fcm_mask,
        )
        hidden_states = hidden_states + attn_outputs[0]
        hidden_states = hidden_states + self.feed_forward(self.ffn_norm(hidden_states), deterministic=deterministic)
        return (hidden_states,) + attn_outputs[1:]


class FlaxLLaMABlockCollection(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([FlaxLLaMABlock(config) for _ in range(config.num_hidden_layers)])

    def forward(self, hidden_states, attention_mask=None, position_ids=None, deterministic=True, rngs=None):
        fcm_mask = None
        if FIXED:
            if not deterministic and self.config.fcm_max_ratio > 0:
                batch_size, seq_length = hidden_states.shape[0], hidden_states.shape[1]
                fcm_mask = sample_fcm_mask(self.config, rngs["fcm"], batch_size, seq_length)

        for block in self.blocks:
            layer_outputs = block(
                hidden_states,
                attention_mask,
                position_ids,
                deterministic,
                fcm_mask,
                rngs,
            )
            hidden_states = layer_outputs[0]
        return (hidden_states,)


class FlaxLLaMAForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.hidden_size)
        self.h = FlaxLLaMABlockCollection(config)
        self.ln_f = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=config.initializer_range * 10)

    def forward(self, input_ids, attention_mask=None, position_ids=None, deterministic=True, rngs=None):
        batch_size, sequence_length = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(sequence_length)[None, :].expand(batch_size, sequence_length)
        if attention_mask is None:
            attention_mask = torch.ones((batch_size, sequence_length))
        hidden_states = self.wte(input_ids)
        hidden_states = self.h(hidden_states, attention_mask, position_ids, deterministic, rngs)[0]
        hidden_states = self.ln_f(hidden_states)
        return self.lm_head(hidden_states)


def cross_entropy_loss_and_accuracy(logits, tokens, valid=None):
    if valid is None:
        valid = torch.ones(tokens.shape[:2])
    valid = valid.float()
    valid_text_length = torch.clamp(valid.sum(-1), min=1e-10)
    token_log_prob = torch.gather(F.log_softmax(logits, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
    token_log_prob = torch.where(valid > 0.0, token_log_prob, torch.zeros(()))
    loss = -torch.mean(token_log_prob.sum(-1) / valid_text_length)
    correct = torch.where(valid > 0.0, logits.argmax(-1) == tokens, torch.zeros((), dtype=torch.bool))
    accuracy = torch.mean(correct.sum(-1) / valid_text_length)
    return loss, accuracy


def main():
    torch.manual_seed(0)
    config = LLaMAConfig(fcm_min_ratio=0.1, fcm_max_ratio=0.6)
    model = FlaxLLaMAForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)

    data_rng = torch.Generator().manual_seed(1)
    fcm_rng = torch.Generator().manual_seed(2)

    for step in range(3):
        tokens = torch.randint(2, config.vocab_size, (2, 16), generator=data_rng)
        loss_masks = torch.ones_like(tokens)
        bos_tokens = torch.full((tokens.shape[0], 1), config.bos_token_id, dtype=torch.long)
        inputs = torch.cat([bos_tokens, tokens[:, :-1]], dim=1)
        logits = model(inputs, deterministic=False, rngs={"fcm": fcm_rng})
        loss, accuracy = cross_entropy_loss_and_accuracy(logits, tokens, loss_masks)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step}: loss {loss.item():.6f} accuracy {accuracy.item():.4f}")

    with torch.no_grad():
        eval_tokens = torch.randint(2, config.vocab_size, (2, 16), generator=data_rng)
        eval_inputs = torch.cat([torch.zeros((2, 1), dtype=torch.long), eval_tokens[:, :-1]], dim=1)
        eval_loss, _ = cross_entropy_loss_and_accuracy(model(eval_inputs, deterministic=True), eval_tokens)
    print(f"eval loss {eval_loss.item():.6f}")


if __name__ == "__main__":
    main()
