"""gemma_pytorch (google/gemma_pytorch) Gemma 2: the local sliding-window mask is built from the rows of the
already position-sliced causal mask, so on decode steps the window is anchored at key 0.

Citation: google/gemma_pytorch commit cb7c015 ("Add Gemma3"), which replaced the Gemma 2 sliding mask of
gemma/model.py (GemmaAttention.forward, since 6a24d4d "Supporting Gemma V2") with a ``local_mask`` built in
GemmaForCausalLM.generate.

The bug: GemmaAttention receives ``mask = mask_tensor.index_select(2, input_positions)`` (shape
[1, 1, input_len, max_seq_len]) and for LOCAL_SLIDING layers does
``sliding_mask = triu(ones_like(mask), -W + 1) * tril(ones_like(mask), W - 1)``. triu/tril count rows of
the sliced tensor, not positions: right for the prefill (rows 0..min_prompt_len-1 are positions
0..min_prompt_len-1), but a decode step's single row is row 0, so the sliding layers keep keys 0..W-1 and
mask out the last W tokens once the sequence is longer than the window.

The fix: generate builds ``local_mask_tensor = mask_tensor + tril(full(-2.38e38), diagonal=-W)`` over
positions, selects its rows with the same ``input_positions`` and the sliding layers use ``mask = local_mask``.

Trimmed: no tokenizer (prompts are token id lists, pad_id 0), no quantisation, greedy sampler
(temperature None), float32, tiny sizes and random weights; sliding_window_size shrunk to 4.
"""

import dataclasses
import enum
import sys
from typing import List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


class Architecture(enum.Enum):
    GEMMA_1 = 1
    GEMMA_2 = 2


@dataclasses.dataclass
class GemmaConfig:
    architecture: Architecture = Architecture.GEMMA_1
    vocab_size: int = 256000
    max_position_embeddings: int = 8192
    num_hidden_layers: int = 28
    num_attention_heads: int = 16
    num_key_value_heads: int = 16
    hidden_size: int = 3072
    intermediate_size: int = 24576
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    dtype: str = 'float32'
    quant: bool = False
    attn_types: Optional[Sequence[AttentionType]] = None
    sliding_window_size: Optional[int] = None
    final_logit_softcapping: Optional[float] = None
    attn_logit_softcapping: Optional[float] = None
    query_pre_attn_scalar: Optional[int] = None
    use_pre_ffw_norm: bool = False
    use_post_ffw_norm: bool = False

    def get_dtype(self) -> Optional[torch.dtype]:
        return {'float32': torch.float32, 'float': torch.float32}.get(self.dtype, None)


def get_config_for_tiny_v2() -> GemmaConfig:
    return GemmaConfig(
        architecture=Architecture.GEMMA_2,
        vocab_size=64,
        max_position_embeddings=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        head_dim=8,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
        query_pre_attn_scalar=8,
        use_pre_ffw_norm=True,
        use_post_ffw_norm=True,
        attn_types=[AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL],
        sliding_window_size=4,
    )


class Sampler(nn.Module):

    def __init__(self, vocab_size: int, config: GemmaConfig):
        super().__init__()
        self.vocab_size = vocab_size
        self.config = config

    @torch.no_grad()
    def forward(self, embedding, hidden_states, output_positions, temperatures, top_ps, top_ks):
        # Select the last element for each sequence.
        hidden_states = hidden_states.index_select(1, output_positions).squeeze(dim=1)
        logits = torch.matmul(hidden_states, embedding.t())
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping

        if temperatures is None:
            return torch.argmax(logits, dim=-1).squeeze(dim=-1), logits
        raise NotImplementedError("trimmed: greedy only")


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta**(torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    x_ = torch.view_as_complex(torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int, quant: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features)), requires_grad=False)
        self.quant = quant

    def forward(self, x):
        return F.linear(x, self.weight)


class Embedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int, quant: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num_embeddings, embedding_dim)), requires_grad=False)
        self.quant = quant

    def forward(self, x):
        return F.embedding(x, self.weight)


class RMSNorm(torch.nn.Module):

    def __init__(self, dim: int, eps: float = 1e-6, add_unit_offset: bool = True):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        if self.add_unit_offset:
            output = output * (1 + self.weight.float())
        else:
            output = output * self.weight.float()
        return output.type_as(x)


class GemmaMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int, quant: bool):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, quant)
        self.up_proj = Linear(hidden_size, intermediate_size, quant)
        self.down_proj = Linear(intermediate_size, hidden_size, quant)

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh")
        up = self.up_proj(x)
        fuse = gate * up
        outputs = self.down_proj(fuse)
        return outputs


class GemmaAttention(nn.Module):

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 attn_logit_softcapping: Optional[float], query_pre_attn_scalar: Optional[int],
                 head_dim: int, quant: bool, attn_type: AttentionType,
                 sliding_window_size: Optional[int] = None):
        super().__init__()

        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads

        assert self.num_heads % self.num_kv_heads == 0
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads

        self.hidden_size = hidden_size
        self.head_dim = head_dim

        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim

        if query_pre_attn_scalar is not None:
            self.scaling = query_pre_attn_scalar**-0.5
        else:
            self.scaling = self.head_dim**-0.5

        self.qkv_proj = Linear(self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                               quant=quant)
        self.o_proj = Linear(self.num_heads * self.head_dim, self.hidden_size, quant=quant)

        self.attn_type = attn_type
        self.sliding_window_size = sliding_window_size
        self.attn_logit_softcapping = attn_logit_softcapping

    def forward(self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor, kv_write_indices: torch.Tensor,
                kv_cache: Tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
                local_mask: torch.Tensor = None) -> torch.Tensor:
        hidden_states_shape = hidden_states.shape
        assert len(hidden_states_shape) == 3

        batch_size, input_len, _ = hidden_states_shape

        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)

        # Positional embedding.
        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)

        # Write new kv cache.
        # [batch_size, input_len, n_local_kv_heads, head_dim]
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(1, kv_write_indices, xk)
        v_cache.index_copy_(1, kv_write_indices, xv)

        key = k_cache
        value = v_cache
        if self.num_kv_heads != self.num_heads:
            # [batch_size, max_seq_len, n_local_heads, head_dim]
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)

        # [batch_size, n_local_heads, input_len, head_dim]
        q = xq.transpose(1, 2)
        # [batch_size, n_local_heads, max_seq_len, head_dim]
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)

        # [batch_size, n_local_heads, input_len, max_seq_len]
        q.mul_(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if FIXED:
            if (self.attn_type == AttentionType.LOCAL_SLIDING
                    and self.sliding_window_size is not None
                    and local_mask is not None):
                mask = local_mask
        else:
            if (self.attn_type == AttentionType.LOCAL_SLIDING
                    and self.sliding_window_size is not None):
                all_ones = torch.ones_like(mask)
                sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
                    all_ones, self.sliding_window_size - 1)
                mask = torch.where(sliding_mask == 1, mask, -2.3819763e38)
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)

        # [batch_size, n_local_heads, input_len, head_dim]
        output = torch.matmul(scores, v)

        # [batch_size, input_len, hidden_dim]
        output = (output.transpose(1, 2).contiguous().view(batch_size, input_len, -1))
        output = self.o_proj(output)
        return output


class Gemma2DecoderLayer(nn.Module):

    def __init__(self, config: GemmaConfig, attn_type: AttentionType):
        super().__init__()
        self.attn_type = attn_type
        self.self_attn = GemmaAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            attn_logit_softcapping=config.attn_logit_softcapping,
            query_pre_attn_scalar=config.query_pre_attn_scalar,
            head_dim=config.head_dim,
            quant=config.quant,
            attn_type=attn_type,
            sliding_window_size=config.sliding_window_size,
        )
        self.mlp = GemmaMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
                            quant=config.quant)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                                          if config.use_pre_ffw_norm else None)
        self.post_feedforward_layernorm = (RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
                                           if config.use_post_ffw_norm else None)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_cache, mask, local_mask):
        # Self Attention
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(
            hidden_states=hidden_states,
            freqs_cis=freqs_cis,
            kv_write_indices=kv_write_indices,
            kv_cache=kv_cache,
            mask=mask,
            local_mask=local_mask,
        )
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        # MLP
        residual = hidden_states
        if self.pre_feedforward_layernorm is not None:
            hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        if self.post_feedforward_layernorm is not None:
            hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        return hidden_states


class GemmaModel(nn.Module):

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.config = config
        self.vocab_size = config.vocab_size

        self.layers = nn.ModuleList()
        for i in range(config.num_hidden_layers):
            if config.architecture == Architecture.GEMMA_2:
                attn_type = (config.attn_types[i] if config.attn_types is not None else AttentionType.GLOBAL)
                self.layers.append(Gemma2DecoderLayer(config, attn_type))
            else:
                raise ValueError(f'Unknown architecture: {config.architecture}')
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, kv_write_indices, kv_caches, mask, local_mask):
        for i in range(len(self.layers)):
            layer = self.layers[i]
            hidden_states = layer(
                hidden_states=hidden_states,
                freqs_cis=freqs_cis,
                kv_write_indices=kv_write_indices,
                kv_cache=kv_caches[i],
                mask=mask,
                local_mask=local_mask,
            )
        hidden_states = self.norm(hidden_states)
        return hidden_states


class GemmaForCausalLM(nn.Module):

    def __init__(self, config: GemmaConfig, pad_id: int = 0):
        super().__init__()
        self.config = config
        assert config.hidden_size % config.num_attention_heads == 0

        max_seq_len = config.max_position_embeddings
        head_dim = config.head_dim
        vocab_size = config.vocab_size

        self.pad_id = pad_id  # stands in for self.tokenizer.pad_id
        self.embedder = Embedding(vocab_size, config.hidden_size, config.quant)
        self.model = GemmaModel(config)
        self.sampler = Sampler(vocab_size, config)

        # Pre-compute rotary embedding table.
        rope_theta = getattr(config, 'rope_theta', 10000)
        freqs_cis = precompute_freqs_cis(head_dim, max_seq_len * 2, theta=rope_theta)
        self.register_buffer('freqs_cis', freqs_cis)

    @torch.no_grad()
    def forward(self, input_token_ids, input_positions, kv_write_indices, kv_caches, mask, output_positions,
                temperatures, top_ps, top_ks, local_mask=None, **kwargs):
        freqs_cis = self.freqs_cis.index_select(0, input_positions)
        kv_write_indices = input_positions

        # [batch_size, input_len, hidden_size]
        hidden_states = self.embedder(input_token_ids)
        # Gemma normalizes the embedding by sqrt(hidden_size).
        normalizer = torch.tensor(self.config.hidden_size**0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer

        hidden_states = self.model(
            hidden_states=hidden_states,
            freqs_cis=freqs_cis,
            kv_write_indices=kv_write_indices,
            kv_caches=kv_caches,
            mask=mask,
            local_mask=local_mask,
        )
        embedder_weight = self.embedder.weight
        next_tokens, logits = self.sampler(
            embedding=embedder_weight,
            hidden_states=hidden_states,
            output_positions=output_positions,
            temperatures=temperatures,
            top_ps=top_ps,
            top_ks=top_ks,
        )
        return next_tokens, logits

    def generate(self, prompt_tokens: Sequence[Sequence[int]], device, output_len: int = 100,
                 temperature: Union[float, None] = None, top_p: float = 1.0, top_k: int = 100):
        """Generates responses for given prompts (already tokenized) using Gemma model."""
        batch_size = len(prompt_tokens)
        min_prompt_len = min(len(p) for p in prompt_tokens)
        max_prompt_len = max(len(p) for p in prompt_tokens)
        max_seq_len = max_prompt_len + output_len
        assert max_seq_len <= self.config.max_position_embeddings

        # build KV caches
        kv_caches = []
        for _ in range(self.config.num_hidden_layers):
            size = (batch_size, max_seq_len, self.config.num_key_value_heads, self.config.head_dim)
            dtype = self.config.get_dtype()
            k_cache = torch.zeros(size=size, dtype=dtype, device=device)
            v_cache = torch.zeros(size=size, dtype=dtype, device=device)
            kv_caches.append((k_cache, v_cache))

        # prepare inputs
        token_ids_tensor = torch.full((batch_size, max_seq_len), self.pad_id, dtype=torch.int64)
        input_token_ids_tensor = torch.full((batch_size, min_prompt_len), self.pad_id, dtype=torch.int64)
        for i, p in enumerate(prompt_tokens):
            token_ids_tensor[i, :len(p)] = torch.tensor(p)
            input_token_ids_tensor[i, :min_prompt_len] = torch.tensor(p[:min_prompt_len])
        token_ids_tensor = token_ids_tensor.to(device)
        input_token_ids_tensor = input_token_ids_tensor.to(device)
        prompt_mask_tensor = token_ids_tensor != self.pad_id
        input_positions_tensor = torch.arange(0, min_prompt_len, dtype=torch.int64).to(device)
        mask_tensor = torch.full((1, 1, max_seq_len, max_seq_len), -2.3819763e38).to(torch.float)
        mask_tensor = torch.triu(mask_tensor, diagonal=1).to(device)
        if FIXED:
            local_mask_tensor = mask_tensor + torch.tril(
                torch.full((1, 1, max_seq_len, max_seq_len), -2.3819763e38),
                diagonal=-self.config.sliding_window_size,
            ) if self.config.sliding_window_size else None
        else:
            local_mask_tensor = None
        curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
        curr_local_mask_tensor = local_mask_tensor.index_select(
            2, input_positions_tensor) if local_mask_tensor is not None else None
        output_positions_tensor = torch.LongTensor([min_prompt_len - 1]).to(device)
        temperatures_tensor = None if not temperature else torch.FloatTensor([temperature] * batch_size).to(device)
        top_ps_tensor = torch.FloatTensor([top_p] * batch_size).to(device)
        top_ks_tensor = torch.LongTensor([top_k] * batch_size).to(device)
        output_index = torch.tensor(min_prompt_len, dtype=torch.int64).to(device)

        # Prefill up to min_prompt_len tokens, then treat other prefill as
        # decode and ignore output.
        for i in range(max_seq_len - min_prompt_len):
            next_token_ids, _ = self(
                input_token_ids=input_token_ids_tensor,
                input_positions=input_positions_tensor,
                kv_write_indices=None,
                kv_caches=kv_caches,
                mask=curr_mask_tensor,
                output_positions=output_positions_tensor,
                temperatures=temperatures_tensor,
                top_ps=top_ps_tensor,
                top_ks=top_ks_tensor,
                local_mask=curr_local_mask_tensor,
            )

            curr_prompt_mask = prompt_mask_tensor.index_select(1, output_index).squeeze(dim=1)
            curr_token_ids = token_ids_tensor.index_select(1, output_index).squeeze(dim=1)
            output_token_ids = torch.where(curr_prompt_mask, curr_token_ids, next_token_ids).unsqueeze(dim=1)
            token_ids_tensor.index_copy_(1, output_index, output_token_ids)

            input_token_ids_tensor = output_token_ids
            input_positions_tensor = output_index.unsqueeze(dim=-1)
            curr_mask_tensor = mask_tensor.index_select(2, input_positions_tensor)
            curr_local_mask_tensor = local_mask_tensor.index_select(
                2, input_positions_tensor) if local_mask_tensor is not None else None
            output_positions_tensor = torch.tensor(0, dtype=torch.int64).to(device)
            output_index = output_index + 1

        token_ids = token_ids_tensor.tolist()
        results = []
        for i, tokens in enumerate(token_ids):
            trimmed_output = tokens[len(prompt_tokens[i]):len(prompt_tokens[i]) + output_len]
            results.append(trimmed_output)
        return results


def main():
    torch.manual_seed(0)
    config = get_config_for_tiny_v2()
    model = GemmaForCausalLM(config, pad_id=0).eval()
    for name, p in model.named_parameters():
        nn.init.normal_(p, std=0.05 if name.startswith("embedder") else 0.5)

    prompts = [[5, 17, 23, 8, 41, 12, 33, 7], [9, 30, 4, 22, 50, 11]]
    outputs = model.generate(prompts, device="cpu", output_len=8, temperature=None)
    for p, out in zip(prompts, outputs):
        print(f"prompt {p} -> {out}")


if __name__ == "__main__":
    main()
