# fla-org/flash-linear-attention#45 (commit 113e3d9, "[Attn] fix negative value of seqlen offset during sft").
#
# fla.layers.attn.Attention (the softmax layer fla's Transformer and its hybrids use) shifted its rotary
# offset by `attention_mask.sum(-1) - attention_mask.shape[-1]` whenever a mask was given, meant for
# left-padded generation with a cache. In SFT (no cache, right padding) that made the offset negative
# for every padded row, so the row's tokens were looked up at rotary positions below 0 of the cos / sin
# table (the Triton kernel reads before the table; this torch stand-in indexes from its end).
# The fix applies the padding shift only when past_key_values is given.
#
# Ported from fla/layers/attn.py, fla/modules/rotary.py, fla/ops/rotary.py,
# fla/models/transformer/{configuration,modeling}_transformer.py at 113e3d9^ (Triton / flash-attn
# kernels replaced by plain torch stand-ins that keep their arguments).

import sys
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.configuration_utils import PretrainedConfig

FIXED = "--fixed" in sys.argv


class TransformerConfig(PretrainedConfig):
    model_type = 'transformer'

    def __init__(self, vocab_size=32000, hidden_size=2048, hidden_ratio=4, intermediate_size=None,
                 num_hidden_layers=24, num_heads=32, num_kv_heads=None, hidden_act="swish",
                 window_size=None, max_position_embeddings=2048, norm_eps=1e-6, use_cache=True,
                 pad_token_id=None, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.hidden_ratio = hidden_ratio
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.window_size = window_size
        self.max_position_embeddings = max_position_embeddings
        self.hidden_act = hidden_act
        self.norm_eps = norm_eps
        self.use_cache = use_cache
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x, residual=None, prenorm=False):
        if residual is not None:
            x = x + residual
            residual = x
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return (y, residual) if prenorm else y


# ---- fla/ops/rotary.py: apply_rotary (rotary_kernel stand-in: cos / sin read at rm + SEQLEN_OFFSETS) ----
def apply_rotary(x, cos, sin, seqlen_offsets: Union[int, torch.Tensor] = 0, interleaved=False):
    batch, seqlen, nheads, headdim = x.shape
    seqlen_ro, rotary_dim = cos.shape
    rotary_dim *= 2
    assert seqlen_ro >= seqlen, "seqlen_ro must be >= seqlen"
    if isinstance(seqlen_offsets, torch.Tensor):
        assert seqlen_offsets.shape == (batch,)
        assert seqlen_offsets.dtype in [torch.int32, torch.int64]
        rm_cs = torch.arange(seqlen)[None, :] + seqlen_offsets[:, None]
    else:
        assert seqlen_offsets + seqlen <= seqlen_ro
        rm_cs = (torch.arange(seqlen) + seqlen_offsets)[None, :].expand(batch, seqlen)
    c = cos[rm_cs][:, :, None, :].float()   # (batch, seqlen, 1, rotary_dim / 2)
    s = sin[rm_cs][:, :, None, :].float()
    x0, x1 = x[..., :rotary_dim // 2].float(), x[..., rotary_dim // 2:rotary_dim].float()
    o0 = x0 * c - x1 * s
    o1 = x0 * s + x1 * c
    return torch.cat([o0, o1, x[..., rotary_dim:].float()], dim=-1).to(x.dtype)


# ---- fla/modules/rotary.py ----
class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base=10000.0, interleaved=False):
        super().__init__()
        self.dim = dim
        self.base = float(base)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.interleaved = interleaved
        self._seq_len_cached = 0
        self._cos_cached = None
        self._sin_cached = None

    def _update_cos_sin_cache(self, seqlen, device=None, dtype=None):
        if seqlen > self._seq_len_cached or self._cos_cached is None or self._cos_cached.dtype != dtype:
            self._seq_len_cached = seqlen
            t = torch.arange(seqlen, device=device, dtype=torch.float32)
            freqs = torch.outer(t, self.inv_freq)
            self._cos_cached = torch.cos(freqs).to(dtype)
            self._sin_cached = torch.sin(freqs).to(dtype)

    def forward(self, q, k, seqlen_offset: Union[int, torch.Tensor] = 0, max_seqlen: Optional[int] = None):
        seqlen = q.shape[1]
        if max_seqlen is not None:
            self._update_cos_sin_cache(max_seqlen, device=q.device, dtype=q.dtype)
        elif isinstance(seqlen_offset, int):
            self._update_cos_sin_cache(seqlen + seqlen_offset, device=q.device, dtype=q.dtype)
        q = apply_rotary(q, self._cos_cached, self._sin_cached, seqlen_offsets=seqlen_offset)
        k = apply_rotary(k, self._cos_cached, self._sin_cached, seqlen_offsets=seqlen_offset)
        return q, k


# ---- flash_attn stand-ins (same arguments) ----
def index_first_axis(x, indices):
    return x[indices]


def pad_input(hidden_states, indices, batch, seqlen):
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.view(batch, seqlen, *hidden_states.shape[1:])


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           causal=False, window_size=(-1, -1)):
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        qs, qe = cu_seqlens_q[i].item(), cu_seqlens_q[i + 1].item()
        ks, ke = cu_seqlens_k[i].item(), cu_seqlens_k[i + 1].item()
        qi, ki, vi = (t.transpose(0, 1) for t in (q[qs:qe], k[ks:ke], v[ks:ke]))
        lq, lk = qe - qs, ke - ks
        row = torch.arange(lq)[:, None] + (lk - lq)
        col = torch.arange(lk)[None, :]
        allowed = torch.ones(lq, lk, dtype=torch.bool)
        if causal:
            allowed &= col <= row
        if window_size[0] >= 0:
            allowed &= col >= row - window_size[0]
        out[qs:qe] = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=allowed).transpose(0, 1)
    return out


def flash_attn_func(q, k, v, causal=False, window_size=(-1, -1)):
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal)
    return o.transpose(1, 2)


# ---- fla/layers/attn.py ----
class Attention(nn.Module):

    def __init__(self, hidden_size=2048, num_heads=32, num_kv_heads=None, window_size=None,
                 max_position_embeddings=None, layer_idx=None):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = self.num_heads if num_kv_heads is None else num_kv_heads
        self.num_kv_groups = num_heads // self.num_kv_heads
        self.hidden_size = hidden_size
        self.head_dim = self.hidden_size // self.num_heads
        self.kv_dim = self.num_kv_heads * self.head_dim
        self.window_size = window_size
        self.max_position_embeddings = max_position_embeddings
        self.layer_idx = layer_idx

        self.q_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.kv_dim, bias=False)
        self.o_proj = nn.Linear(self.hidden_size, self.hidden_size, bias=False)

        self.rotary = RotaryEmbedding(self.head_dim)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                use_cache=False, **kwargs):
        batch_size, q_len, _ = hidden_states.size()
        q = self.q_proj(hidden_states).view(batch_size, q_len, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(batch_size, q_len, self.num_kv_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(batch_size, q_len, self.num_kv_heads, self.head_dim)

        seqlen_offset = 0
        if FIXED:
            if past_key_values is not None:
                seqlen_offset = past_key_values.get_seq_length(self.layer_idx)

                if attention_mask is not None:
                    # to deliminate the offsets of padding tokens
                    seqlen_offset = seqlen_offset + attention_mask.sum(-1) - attention_mask.shape[-1]
        else:
            if past_key_values is not None:
                seqlen_offset = past_key_values.get_seq_length(self.layer_idx)

            if attention_mask is not None:
                # to deliminate the offsets of padding tokens
                seqlen_offset = seqlen_offset + attention_mask.sum(-1) - attention_mask.shape[-1]
        q, k = self.rotary(q, k, seqlen_offset, self.max_position_embeddings)

        if past_key_values is not None:
            k, v = past_key_values.update(k.transpose(1, 2), v.transpose(1, 2), self.layer_idx)
            k, v = k.transpose(1, 2), v.transpose(1, 2)
        if self.num_kv_groups > 1:
            k = k.repeat_interleave(self.num_kv_groups, dim=2)
            v = v.repeat_interleave(self.num_kv_groups, dim=2)

        # Contains at least one padding token in the sequence
        if attention_mask is not None:
            q, k, v, indices_q, cu_seq_lens, max_seq_lens = self._upad_input(q, k, v, attention_mask, q_len)
            cu_seqlens_q, cu_seqlens_k = cu_seq_lens
            max_seqlen_q, max_seqlen_k = max_seq_lens
            o = flash_attn_varlen_func(
                q, k, v,
                cu_seqlens_q=cu_seqlens_q,
                cu_seqlens_k=cu_seqlens_k,
                max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k,
                causal=True,
                window_size=(-1, -1) if self.window_size is None else (self.window_size-1, 0)
            )
            o = pad_input(o, indices_q, batch_size, q_len)
        else:
            o = flash_attn_func(
                q, k, v,
                causal=True,
                window_size=(-1, -1) if self.window_size is None else (self.window_size-1, 0)
            )
        o = o.reshape(batch_size, q_len, self.hidden_size)
        o = self.o_proj(o)
        return o, None, past_key_values

    def _upad_input(self, q, k, v, attention_mask, q_len):
        seqlens = attention_mask.sum(-1, dtype=torch.int32)
        indices_k = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
        max_seqlen_k = seqlens.max().item()
        cu_seqlens_k = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
        batch_size, seq_len, num_key_value_heads, head_dim = k.shape

        k = index_first_axis(k.reshape(batch_size * seq_len, num_key_value_heads, head_dim), indices_k)
        v = index_first_axis(v.reshape(batch_size * seq_len, num_key_value_heads, head_dim), indices_k)
        if q_len == seq_len:
            q = index_first_axis(q.reshape(batch_size * seq_len, self.num_heads, head_dim), indices_k)
            cu_seqlens_q = cu_seqlens_k
            max_seqlen_q = max_seqlen_k
            indices_q = indices_k
        else:
            raise NotImplementedError("only the training (q_len == k_len) path is ported")
        return q, k, v, indices_q, (cu_seqlens_q, cu_seqlens_k), (max_seqlen_q, max_seqlen_k)


# ---- fla/models/transformer/modeling_transformer.py ----
class TransformerMLP(nn.Module):
    def __init__(self, hidden_size, hidden_ratio=None, intermediate_size=None, hidden_act='swish'):
        super().__init__()
        if hidden_ratio is None:
            hidden_ratio = 4
        if intermediate_size is None:
            intermediate_size = int(hidden_size * hidden_ratio * 2 / 3)
            intermediate_size = 256 * ((intermediate_size + 256 - 1) // 256)
        self.gate_proj = nn.Linear(hidden_size, intermediate_size * 2, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        gate, y = self.gate_proj(x).chunk(2, -1)
        return self.down_proj(F.silu(gate) * y)


class TransformerBlock(nn.Module):
    def __init__(self, config: TransformerConfig, layer_idx: int):
        super().__init__()
        self.attn_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.attn = Attention(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            window_size=config.window_size,
            max_position_embeddings=config.max_position_embeddings,
            layer_idx=layer_idx
        )
        self.mlp_norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.mlp = TransformerMLP(config.hidden_size, config.hidden_ratio, config.intermediate_size, config.hidden_act)

    def forward(self, hidden_states, attention_mask=None, past_key_values=None, output_attentions=False,
                use_cache=False, **kwargs):
        residual = hidden_states
        hidden_states = self.attn_norm(hidden_states)
        hidden_states, attentions, past_key_values = self.attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            use_cache=use_cache,
            output_attentions=output_attentions
        )
        hidden_states, residual = self.mlp_norm(hidden_states, residual, True)
        hidden_states = self.mlp(hidden_states)
        hidden_states = residual + hidden_states
        return (hidden_states,)


class TransformerForCausalLM(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([TransformerBlock(config, i) for i in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, attention_mask=None, labels=None):
        hidden_states = self.embeddings(input_ids)
        for layer in self.layers:
            hidden_states = layer(hidden_states, attention_mask=attention_mask, past_key_values=None,
                                  use_cache=False)[0]
        logits = self.lm_head(self.norm(hidden_states))
        loss = None
        if labels is not None:
            loss_fct = nn.CrossEntropyLoss()
            labels = torch.cat((labels[..., 1:], torch.full_like(labels[:, :1], loss_fct.ignore_index)), 1)
            loss = loss_fct(logits.view(-1, self.config.vocab_size), labels.view(-1))
        return loss, logits


def sft_collate(examples, pad_token_id):
    """Right-padded SFT batch: prompt tokens unlabelled, response tokens labelled, pads masked out."""
    max_len = max(len(p) + len(r) for p, r in examples)
    input_ids, attention_mask, labels = [], [], []
    for prompt, response in examples:
        ids = prompt + response
        n_pad = max_len - len(ids)
        input_ids.append(ids + [pad_token_id] * n_pad)
        attention_mask.append([1] * len(ids) + [0] * n_pad)
        labels.append([-100] * len(prompt) + response + [-100] * n_pad)
    return (torch.tensor(input_ids), torch.tensor(attention_mask), torch.tensor(labels))


def main():
    torch.manual_seed(0)
    config = TransformerConfig(vocab_size=96, hidden_size=64, num_hidden_layers=2, num_heads=4,
                               max_position_embeddings=64, pad_token_id=0, intermediate_size=128)
    model = TransformerForCausalLM(config)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    g = torch.Generator().manual_seed(1)
    examples = []
    for plen, rlen in [(7, 5), (4, 2), (5, 3), (3, 4)]:
        prompt = torch.randint(3, 96, (plen,), generator=g).tolist()
        response = torch.randint(3, 96, (rlen,), generator=g).tolist()
        examples.append((prompt, response))
    input_ids, attention_mask, labels = sft_collate(examples, config.pad_token_id)

    for step in range(3):
        loss, logits = model(input_ids, attention_mask=attention_mask, labels=labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"step {step} sft loss {loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        _, logits = model(input_ids, attention_mask=attention_mask)
    n = int(attention_mask[1].sum())
    print("row 1 last real token, top logits:", logits[1, n - 1].topk(3).indices.tolist(),
          f"{logits[1, n - 1].max().item():.6f}")


if __name__ == "__main__":
    main()
