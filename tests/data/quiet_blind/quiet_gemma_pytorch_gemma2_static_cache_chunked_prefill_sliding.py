# Citation: google/gemma_pytorch gemma/model.py @014acb7ac4563a5f77c76d7ff98f31b568c16508
#   (GemmaAttention.forward: k_cache.index_copy_(1, kv_write_indices, xk) into a preallocated (B, max_seq_len, Hkv, D)
#   cache, scores over the whole cache + mask, local_mask on LOCAL_SLIDING layers; GemmaForCausalLM.forward:
#   kv_write_indices = input_positions; GemmaForCausalLM.generate: mask_tensor = triu(-2.38e38, 1) of
#   (1, 1, max_seq_len, max_seq_len), local_mask_tensor = mask_tensor + tril(-2.38e38, -sliding_window_size),
#   rows picked with index_select(2, input_positions_tensor)) and gemma/config.py (GemmaConfig, get_config_for_2b_v2:
#   Gemma 2 alternating [LOCAL_SLIDING, GLOBAL] layers, logit softcapping).
# Tiny Gemma 2 (sliding_window_size = 3), float32, no tokenizer (token id lists, pad_id 0). Two uses of the same
# forward: (a) generate() as written: right-padded prompts of unequal length, prefill of min_prompt_len, then one
# token a step with the longer prompt teacher-forced; (b) a prompt prefilled in chunks of 3 into the static cache,
# each chunk's input_positions = its cache offset and its mask rows index_select'ed at those positions, then decode.
# Checked against a per-sequence, unpadded, cache-free recompute whose mask is a double loop (j <= i, and i - j < 3
# on the sliding layers): all chunk logits, decode logits, and generate's greedy tokens.
import dataclasses
import enum
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
NEG = -2.3819763e38
PAD_ID = 0


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


class Architecture(enum.Enum):
    GEMMA_1 = 1
    GEMMA_2 = 2


@dataclasses.dataclass
class GemmaConfig:
    architecture: Architecture = Architecture.GEMMA_2
    vocab_size: int = 48
    max_position_embeddings: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    hidden_size: int = 32
    intermediate_size: int = 64
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    dtype: str = 'float32'
    attn_types: Optional[Sequence[AttentionType]] = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL) * 2
    sliding_window_size: Optional[int] = 3
    final_logit_softcapping: Optional[float] = 30.0
    attn_logit_softcapping: Optional[float] = 50.0
    query_pre_attn_scalar: Optional[int] = None
    use_pre_ffw_norm: bool = True
    use_post_ffw_norm: bool = True

    def get_dtype(self):
        return torch.float32


def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta**(torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)


def apply_rotary_emb(x, freqs_cis):
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class Sampler(nn.Module):
    def __init__(self, vocab_size, config):
        super().__init__()
        self.vocab_size = vocab_size
        self.config = config

    @torch.no_grad()
    def forward(self, embedding, hidden_states, output_positions, temperatures, top_ps, top_ks):
        hidden_states = hidden_states.index_select(1, output_positions).squeeze(dim=1)
        logits = torch.matmul(hidden_states, embedding.t())
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        assert temperatures is None  # greedy only in this port
        return torch.argmax(logits, dim=-1).squeeze(dim=-1), logits


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, add_unit_offset=True):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(0.1 * torch.randn(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        output = output * (1 + self.weight.float()) if self.add_unit_offset else output * self.weight.float()
        return output.type_as(x)


class GemmaMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class GemmaAttention(nn.Module):
    def __init__(self, config: GemmaConfig, attn_type: AttentionType):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scaling = (config.query_pre_attn_scalar or self.head_dim)**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)
        self.attn_type = attn_type
        self.sliding_window_size = config.sliding_window_size
        self.attn_logit_softcapping = config.attn_logit_softcapping

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask=None):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)

        # Write new kv cache.
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)

        key, value = k_cache, v_cache
        if self.num_kv_heads != self.num_heads:
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)
        q = xq.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)

        # [batch_size, n_local_heads, input_len, max_seq_len]
        q.mul_(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if (self.attn_type == AttentionType.LOCAL_SLIDING and self.sliding_window_size is not None
                and local_mask is not None):
            mask = local_mask
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return self.o_proj(output)


class Gemma2DecoderLayer(nn.Module):
    def __init__(self, config, attn_type):
        super().__init__()
        self.attn_type = attn_type
        self.self_attn = GemmaAttention(config=config, attn_type=attn_type)
        self.mlp = GemmaMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states=hidden_states, freqs_cis=freqs_cis,
                                       kv_write_indices=kv_write_indices, kv_cache=kv_cache, mask=mask,
                                       local_mask=local_mask)
        hidden_states = residual + self.post_attention_layernorm(hidden_states)
        residual = hidden_states
        hidden_states = self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(hidden_states)))
        return residual + hidden_states


class GemmaModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layers = nn.ModuleList([
            Gemma2DecoderLayer(config, config.attn_types[i % len(config.attn_types)])
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_caches, mask, local_mask):
        for i, layer in enumerate(self.layers):
            hidden_states = layer(hidden_states=hidden_states, freqs_cis=freqs_cis.get(layer.attn_type),
                                  kv_write_indices=kv_write_indices, kv_cache=kv_caches[i], mask=mask,
                                  local_mask=local_mask)
        return self.norm(hidden_states)


class GemmaForCausalLM(nn.Module):
    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.config = config
        self.embedder = nn.Embedding(config.vocab_size, config.hidden_size)
        self.model = GemmaModel(config)
        self.sampler = Sampler(config.vocab_size, config)
        self.register_buffer('freqs_cis', precompute_freqs_cis(config.head_dim, config.max_position_embeddings * 2))

    @torch.no_grad()
    def forward(self, input_token_ids, input_positions, kv_write_indices, kv_caches, mask, output_positions,
                temperatures, top_ps, top_ks, local_mask=None, **kwargs):
        freqs_cis = {
            AttentionType.LOCAL_SLIDING: self.freqs_cis.index_select(0, input_positions),
            AttentionType.GLOBAL: self.freqs_cis.index_select(0, input_positions),
        }
        kv_write_indices = input_positions
        hidden_states = self.embedder(input_token_ids)
        hidden_states = hidden_states * torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = self.model(hidden_states=hidden_states, freqs_cis=freqs_cis,
                                   kv_write_indices=kv_write_indices, kv_caches=kv_caches, mask=mask,
                                   local_mask=local_mask)
        return self.sampler(embedding=self.embedder.weight, hidden_states=hidden_states,
                            output_positions=output_positions, temperatures=temperatures, top_ps=top_ps,
                            top_ks=top_ks)

    def _kv_caches(self, batch_size, max_seq_len):
        kv_caches = []
        for _ in range(self.config.num_hidden_layers):
            size = (batch_size, max_seq_len, self.config.num_key_value_heads, self.config.head_dim)
            kv_caches.append((torch.zeros(size, dtype=self.config.get_dtype()),
                              torch.zeros(size, dtype=self.config.get_dtype())))
        return kv_caches

    def _mask_tensors(self, max_seq_len):
        mask_tensor = torch.full((1, 1, max_seq_len, max_seq_len), -2.3819763e38).to(torch.float)
        mask_tensor = torch.triu(mask_tensor, diagonal=1)
        local_mask_tensor = mask_tensor + torch.tril(
            torch.full((1, 1, max_seq_len, max_seq_len), -2.3819763e38),
            diagonal=-self.config.sliding_window_size,
        ) if self.config.sliding_window_size else None
        return mask_tensor, local_mask_tensor

    def generate(self, prompt_tokens: List[List[int]], output_len: int):
        """GemmaForCausalLM.generate as written (token ids in, greedy: temperature=None)."""
        batch_size = len(prompt_tokens)
        min_prompt_len = min(len(p) for p in prompt_tokens)
        max_prompt_len = max(len(p) for p in prompt_tokens)
        max_seq_len = max_prompt_len + output_len
        kv_caches = self._kv_caches(batch_size, max_seq_len)

        token_ids_tensor = torch.full((batch_size, max_seq_len), PAD_ID, dtype=torch.int64)
        input_token_ids_tensor = torch.full((batch_size, min_prompt_len), PAD_ID, dtype=torch.int64)
        for i, p in enumerate(prompt_tokens):
            token_ids_tensor[i, :len(p)] = torch.tensor(p)
            input_token_ids_tensor[i, :min_prompt_len] = torch.tensor(p[:min_prompt_len])
        prompt_mask_tensor = token_ids_tensor != PAD_ID
        input_positions_tensor = torch.arange(0, min_prompt_len, dtype=torch.int64)
        mask_tensor, local_mask_tensor = self._mask_tensors(max_seq_len)
        curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
        curr_local_mask_tensor = local_mask_tensor.index_select(2, input_positions_tensor)
        output_positions_tensor = torch.LongTensor([min_prompt_len - 1])
        output_index = torch.tensor(min_prompt_len, dtype=torch.int64)

        for i in range(max_seq_len - min_prompt_len):
            next_token_ids, _ = self(input_token_ids=input_token_ids_tensor,
                                     input_positions=input_positions_tensor, kv_write_indices=None,
                                     kv_caches=kv_caches, mask=curr_mask_tensor,
                                     output_positions=output_positions_tensor, temperatures=None, top_ps=None,
                                     top_ks=None, local_mask=curr_local_mask_tensor)
            curr_prompt_mask = prompt_mask_tensor.index_select(1, output_index).squeeze(dim=1)
            curr_token_ids = token_ids_tensor.index_select(1, output_index).squeeze(dim=1)
            output_token_ids = torch.where(curr_prompt_mask, curr_token_ids, next_token_ids).unsqueeze(dim=1)
            token_ids_tensor.index_copy_(1, output_index, output_token_ids)

            input_token_ids_tensor = output_token_ids
            input_positions_tensor = output_index.unsqueeze(dim=-1)
            curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
            curr_local_mask_tensor = local_mask_tensor.index_select(2, input_positions_tensor)
            output_positions_tensor = torch.tensor(0, dtype=torch.int64)
            output_index = output_index + 1

        token_ids = token_ids_tensor.tolist()
        return [tokens[len(prompt_tokens[i]):len(prompt_tokens[i]) + output_len] for i, tokens in enumerate(token_ids)]


def chunked_prefill_then_decode(model, input_ids, chunk_size, n_decode):
    """The same forward driven chunk by chunk: each chunk's rows of the mask are its cache positions."""
    batch_size, prompt_len = input_ids.shape
    max_seq_len = prompt_len + n_decode
    kv_caches = model._kv_caches(batch_size, max_seq_len)
    mask_tensor, local_mask_tensor = model._mask_tensors(max_seq_len)
    chunk_logits = []
    for s in range(0, prompt_len, chunk_size):
        input_positions_tensor = torch.arange(s, min(s + chunk_size, prompt_len), dtype=torch.int64)
        n = input_positions_tensor.numel()
        next_token_ids, logits = model(input_token_ids=input_ids[:, s:s + n], input_positions=input_positions_tensor,
                                       kv_write_indices=None, kv_caches=kv_caches,
                                       mask=mask_tensor.index_select(2, input_positions_tensor),
                                       output_positions=torch.arange(n), temperatures=None, top_ps=None,
                                       top_ks=None, local_mask=local_mask_tensor.index_select(2, input_positions_tensor))
        chunk_logits.append(logits.reshape(batch_size, n, -1))
    next_ids = chunk_logits[-1][:, -1].argmax(-1)
    decoded, decode_logits = [], []
    for t in range(n_decode):
        decoded.append(next_ids)
        pos = torch.tensor([prompt_len + t])
        next_ids, logits = model(input_token_ids=next_ids[:, None], input_positions=pos, kv_write_indices=None,
                                 kv_caches=kv_caches, mask=mask_tensor.index_select(2, pos),
                                 output_positions=torch.tensor(0, dtype=torch.int64), temperatures=None,
                                 top_ps=None, top_ks=None, local_mask=local_mask_tensor.index_select(2, pos))
        decode_logits.append(logits)
    return torch.cat(chunk_logits, 1), torch.stack(decoded, 1), torch.stack(decode_logits, 1)


def reference_logits(model, ids):
    """One sequence, unpadded, whole prefix at once, mask from a double loop."""
    L = len(ids)
    W = model.config.sliding_window_size
    glob = torch.zeros(1, 1, L, L)
    loc = torch.zeros(1, 1, L, L)
    for i in range(L):
        for j in range(L):
            if j > i:
                glob[0, 0, i, j] = float("-inf")
            if j > i or i - j >= W:
                loc[0, 0, i, j] = float("-inf")
    pos = torch.arange(L)
    _, logits = model(input_token_ids=torch.tensor([ids]), input_positions=pos, kv_write_indices=None,
                      kv_caches=model._kv_caches(1, L), mask=glob, output_positions=pos, temperatures=None,
                      top_ps=None, top_ks=None, local_mask=loc)
    return logits.reshape(L, -1)


def reference_greedy(model, ids, n):
    ids = list(ids)
    out = []
    for _ in range(n):
        nxt = int(reference_logits(model, ids)[-1].argmax())
        out.append(nxt)
        ids.append(nxt)
    return out


def main():
    config = GemmaConfig()
    model = GemmaForCausalLM(config).eval()

    # (a) generate() as written: right-padded prompts of unequal length.
    prompts = [[5, 9, 13, 2, 7], [3, 8, 1, 22, 17, 30, 4, 11]]
    outs = model.generate(prompts, output_len=5)
    for p, o in zip(prompts, outs):
        assert o == reference_greedy(model, p, 5), (p, o)

    # (b) chunked prefill (chunks of 3 = the window) into the static cache, then decode.
    input_ids = torch.randint(1, config.vocab_size, (2, 10))
    logits, decoded, decode_logits = chunked_prefill_then_decode(model, input_ids, chunk_size=3, n_decode=4)
    for b in range(2):
        ref = reference_logits(model, input_ids[b].tolist())
        assert torch.allclose(logits[b], ref, atol=1e-4), b
        full = input_ids[b].tolist() + decoded[b].tolist()
        ref_full = reference_logits(model, full)
        assert torch.allclose(decode_logits[b], ref_full[10:14], atol=1e-4), b
        assert decoded[b].tolist() == reference_greedy(model, input_ids[b].tolist(), 4), b
    print("ok: gemma_pytorch static cache, sliding-window layers, generate() and chunked prefill match reference")


if __name__ == "__main__":
    main()
