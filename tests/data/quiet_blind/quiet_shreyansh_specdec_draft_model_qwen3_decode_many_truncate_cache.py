"""Correct program (quiet batch quiet-r118b).

Draft-model speculative decoding as shreyansh26/Speculative-Decoding writes it, shrunk to tiny sizes:
a small draft model proposes K tokens one at a time on its own cache, the target verifies the whole
chain in one cached forward (`decode_many`), and on a rejection both caches are rolled back by
slicing each layer's keys/values to the accepted prefix (`_truncate_cache`) or by going back to an
earlier PrefixState.

Citation: shreyansh26/Speculative-Decoding
  common/qwen3.py @f55623fc8efaf64fa49d63f5923ab57f7b29de35 (Qwen3Attention.forward: boolean mask
    key_positions <= query_positions with past_len = key_len - query_len, SDPA is_causal=False;
    Qwen3Model.forward: start_position from the cache length; prefill / decode_one / decode_many)
  common/verification.py @ef1e5bc2acf949b771d87482f06a133ad95848dd (PrefixState, _truncate_cache,
    state_after_decoded_tokens, prefill_prefix, advance_prefix_state, greedy_verify_with_state)
  methods/draft_model/inference/infer.py @ef1e5bc2acf949b771d87482f06a133ad95848dd
    (propose_draft_tokens, run_draft_model_speculative_decode, verify_draft_model_chunk)
Trimmed: no checkpoint loading (tiny configs, random weights), greedy only, no hidden-state capture.

The program checks itself: speculative output == plain greedy decoding of the target recomputed
without any cache, and every cached verify forward's logits == the same rows of a cache-free pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


# ---------------------------------------------------------------- common/qwen3.py
@dataclass(slots=True)
class Qwen3Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = False

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


@dataclass(slots=True)
class LayerCache:
    key: torch.Tensor
    value: torch.Tensor


@dataclass(slots=True)
class Qwen3Output:
    logits: torch.Tensor
    hidden_states: dict | None = None
    cache: list | None = None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(dim=-1, keepdim=True)
        normalized = hidden_states * torch.rsqrt(variance + self.eps)
        return normalized * self.weight


class RotaryEmbedding(nn.Module):
    def __init__(self, dim: int, base: float) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.einsum("bi,j->bij", position_ids.float(), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


def rotate_half(tensor: torch.Tensor) -> torch.Tensor:
    first_half, second_half = tensor.chunk(2, dim=-1)
    return torch.cat((-second_half, first_half), dim=-1)


def apply_rotary_embeddings(query, key, cos, sin):
    cos = cos.to(dtype=query.dtype)
    sin = sin.to(dtype=query.dtype)
    cos = cos[:, None, :, :]
    sin = sin[:, None, :, :]
    query = (query * cos) + (rotate_half(query) * sin)
    key = (key * cos) + (rotate_half(key) * sin)
    return query, key


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_queries_per_kv = self.num_attention_heads // self.num_key_value_heads
        self.head_dim = config.head_dim
        self.fast_single_token_gqa = False

        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=True)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=False)
        self.rotary_emb = RotaryEmbedding(self.head_dim, base=config.rope_theta)

    def _reshape(self, tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
        batch, seq_len, _ = tensor.shape
        return tensor.view(batch, seq_len, num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, position_ids, layer_cache: LayerCache | None = None):
        batch_size, query_len, _ = hidden_states.shape
        query = self._reshape(self.q_proj(hidden_states), self.num_attention_heads)
        key = self._reshape(self.k_proj(hidden_states), self.num_key_value_heads)
        value = self._reshape(self.v_proj(hidden_states), self.num_key_value_heads)

        cos, sin = self.rotary_emb(position_ids)
        query, key = apply_rotary_embeddings(query, key, cos, sin)

        if layer_cache is not None:
            key = torch.cat([layer_cache.key, key], dim=2)
            value = torch.cat([layer_cache.value, value], dim=2)

        updated_cache = LayerCache(key=key, value=value)
        use_manual_gqa = self.num_queries_per_kv > 1 and not (self.fast_single_token_gqa and query_len == 1)
        if use_manual_gqa:
            key = key.repeat_interleave(self.num_queries_per_kv, dim=1)
            value = value.repeat_interleave(self.num_queries_per_kv, dim=1)
        key_len = key.shape[2]
        past_len = key_len - query_len
        query_positions = torch.arange(past_len, past_len + query_len, device=hidden_states.device).unsqueeze(-1)
        key_positions = torch.arange(key_len, device=hidden_states.device).unsqueeze(0)
        attn_mask = key_positions <= query_positions
        attn_mask = attn_mask.unsqueeze(0).unsqueeze(0)

        attn_output = F.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attn_mask,
            dropout_p=0.0,
            is_causal=False,
            enable_gqa=self.num_queries_per_kv > 1 and not use_manual_gqa,
        )
        attn_output = attn_output.transpose(1, 2).contiguous().view(
            batch_size, query_len, self.num_attention_heads * self.head_dim
        )
        return self.o_proj(attn_output), updated_cache


class Qwen3MLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, hidden_states):
        return self.down_proj(F.silu(self.gate_proj(hidden_states)) * self.up_proj(hidden_states))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = Qwen3Attention(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)

    def forward(self, hidden_states, position_ids, layer_cache=None):
        residual = hidden_states
        attn_output, updated_cache = self.self_attn(
            self.input_layernorm(hidden_states), position_ids=position_ids, layer_cache=layer_cache
        )
        hidden_states = residual + attn_output
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return hidden_states, updated_cache


class Qwen3Model(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([Qwen3DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.config = config

    def forward(self, input_ids, cache=None):
        if input_ids.ndim != 2:
            raise ValueError(f"expected [batch, seq] input_ids, got {tuple(input_ids.shape)}")

        batch_size, seq_len = input_ids.shape
        hidden_states = self.embed_tokens(input_ids)

        if cache is None:
            cache = [None] * len(self.layers)
            start_position = 0
        else:
            if len(cache) != len(self.layers):
                raise ValueError("cache length does not match number of layers")
            first_cache = next((item for item in cache if item is not None), None)
            start_position = 0 if first_cache is None else first_cache.key.shape[2]

        position_ids = torch.arange(
            start_position, start_position + seq_len, device=input_ids.device, dtype=torch.long
        ).unsqueeze(0).expand(batch_size, -1)

        next_cache = []
        for layer_idx, layer in enumerate(self.layers):
            hidden_states, updated_cache = layer(hidden_states, position_ids=position_ids, layer_cache=cache[layer_idx])
            next_cache.append(updated_cache)

        hidden_states = self.norm(hidden_states)
        return hidden_states, None, next_cache


class Qwen3ForCausalLM(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.config = config
        self.model = Qwen3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def forward(self, input_ids, cache=None) -> Qwen3Output:
        hidden_states, hidden_state_map, next_cache = self.model(input_ids=input_ids, cache=cache)
        logits = self.lm_head(hidden_states)
        return Qwen3Output(logits=logits, hidden_states=hidden_state_map, cache=next_cache)

    def prefill(self, input_ids) -> Qwen3Output:
        return self.forward(input_ids=input_ids, cache=None)

    def decode_one(self, input_ids, cache) -> Qwen3Output:
        if input_ids.shape[1] != 1:
            raise ValueError("decode_one expects a single token per batch element")
        return self.forward(input_ids=input_ids, cache=cache)

    def decode_many(self, input_ids, cache) -> Qwen3Output:
        if input_ids.shape[1] <= 0:
            raise ValueError("decode_many expects at least one token per batch element")
        # Verification needs one cached forward over the full drafted chunk.
        out = self.forward(input_ids=input_ids, cache=cache)
        VERIFY_CALLS.append((input_ids.clone(), cache[0].key.shape[2], out.logits.detach().clone()))
        return out


VERIFY_CALLS: list = []  # (chunk ids, cached length, logits) of every decode_many, checked at the end


# ---------------------------------------------------------------- common/verification.py
@dataclass(slots=True)
class VerificationResult:
    accepted_ids: list
    emitted_ids: list
    target_predictions: list
    proposed_draft_tokens: int
    accepted_draft_tokens: int
    mismatch_index: int | None
    bonus_token: int | None


@dataclass(slots=True)
class PrefixState:
    prefix_ids: list
    cache: list
    last_logits: torch.Tensor
    hidden_states: dict | None = None


def _as_batch_tensor(token_ids: Sequence[int], device=None) -> torch.Tensor:
    if not token_ids:
        raise ValueError("token sequence must not be empty")
    return torch.tensor([list(token_ids)], dtype=torch.long, device=device)


def _truncate_cache(cache, total_length: int):
    truncated = []
    for layer_cache in cache:
        if layer_cache is None:
            truncated.append(None)
            continue
        truncated.append(
            type(layer_cache)(
                key=layer_cache.key[:, :, :total_length, :].detach(),
                value=layer_cache.value[:, :, :total_length, :].detach(),
            )
        )
    return truncated


def state_after_decoded_tokens(state: PrefixState, output, consumed_ids: Sequence[int]) -> PrefixState:
    if not consumed_ids:
        return state

    output_cache = getattr(output, "cache", None) or []
    next_prefix_ids = state.prefix_ids + list(consumed_ids)
    consumed_count = len(consumed_ids)
    if consumed_count == len(output.logits[0]):
        next_cache = output_cache
        next_logits = output.logits[0, -1].detach()
    else:
        total_length = len(next_prefix_ids)
        next_cache = _truncate_cache(output_cache, total_length)
        next_logits = output.logits[0, consumed_count - 1].detach()

    return PrefixState(prefix_ids=next_prefix_ids, cache=next_cache, last_logits=next_logits)


def prefill_prefix(model, prefix_ids: Sequence[int]) -> PrefixState:
    if not prefix_ids:
        raise ValueError("prefix_ids must not be empty")
    device = getattr(model, "device", torch.device("cpu"))
    input_ids = _as_batch_tensor(prefix_ids, device=device)
    output = model.prefill(input_ids) if hasattr(model, "prefill") else model(input_ids)
    return PrefixState(
        prefix_ids=list(prefix_ids),
        cache=getattr(output, "cache", None) or [],
        last_logits=output.logits[0, -1].detach(),
    )


def advance_prefix_state(model, state: PrefixState, token_id: int) -> PrefixState:
    device = getattr(model, "device", torch.device("cpu"))
    next_prefix_ids = state.prefix_ids + [int(token_id)]
    if hasattr(model, "decode_one"):
        token_tensor = torch.tensor([[int(token_id)]], dtype=torch.long, device=device)
        output = model.decode_one(token_tensor, cache=state.cache)
    else:
        output = model(_as_batch_tensor(next_prefix_ids, device=device))
    return PrefixState(
        prefix_ids=next_prefix_ids,
        cache=getattr(output, "cache", None) or [],
        last_logits=output.logits[0, -1].detach(),
    )


def greedy_verify_with_state(model, state: PrefixState, draft_ids: Sequence[int]):
    first_prediction = int(torch.argmax(state.last_logits).item())
    if draft_ids and first_prediction != int(draft_ids[0]):
        updated_state = advance_prefix_state(model, state, first_prediction)
        return VerificationResult(
            accepted_ids=[], emitted_ids=[first_prediction], target_predictions=[first_prediction],
            proposed_draft_tokens=len(draft_ids), accepted_draft_tokens=0, mismatch_index=0, bonus_token=None,
        ), updated_state

    device = getattr(model, "device", torch.device("cpu"))
    if draft_ids:
        output = model.decode_many(_as_batch_tensor(draft_ids, device=device), cache=state.cache)
        prediction_tail = torch.argmax(output.logits[0], dim=-1).tolist()
    else:
        output = None
        prediction_tail = []

    predictions = [first_prediction] + [int(token) for token in prediction_tail]
    accepted_count = 0
    for index, draft_token in enumerate(draft_ids):
        if predictions[index] != int(draft_token):
            break
        accepted_count += 1

    accepted_ids = [int(token) for token in draft_ids[:accepted_count]]
    if accepted_count < len(draft_ids):
        accepted_state = state if accepted_count == 0 else state_after_decoded_tokens(state, output, accepted_ids)
        mismatch_token = int(predictions[accepted_count])
        updated_state = advance_prefix_state(model, accepted_state, mismatch_token)
        return VerificationResult(
            accepted_ids=accepted_ids, emitted_ids=accepted_ids + [mismatch_token],
            target_predictions=predictions[: accepted_count + 1], proposed_draft_tokens=len(draft_ids),
            accepted_draft_tokens=accepted_count, mismatch_index=accepted_count, bonus_token=None,
        ), updated_state

    accepted_state = state if not accepted_ids else state_after_decoded_tokens(state, output, accepted_ids)
    bonus_token = int(predictions[-1])
    updated_state = advance_prefix_state(model, accepted_state, bonus_token)
    return VerificationResult(
        accepted_ids=accepted_ids, emitted_ids=accepted_ids + [bonus_token], target_predictions=predictions,
        proposed_draft_tokens=len(draft_ids), accepted_draft_tokens=accepted_count, mismatch_index=None,
        bonus_token=bonus_token,
    ), updated_state


# ---------------------------------------------------------------- methods/draft_model/inference/infer.py
def propose_draft_tokens(draft_model, draft_state: PrefixState, draft_len: int, eos_token_id: int | None):
    if draft_len <= 0:
        return [], []
    working_state = draft_state
    proposals: list[int] = []
    proposal_states: list[PrefixState] = []
    for _ in range(draft_len):
        next_token = int(torch.argmax(working_state.last_logits).item())  # sample_from_logits, temperature 0
        proposals.append(next_token)
        if eos_token_id is not None and next_token == eos_token_id:
            break
        if len(proposals) >= draft_len:
            break
        working_state = advance_prefix_state(draft_model, working_state, next_token)
        proposal_states.append(working_state)
    return proposals, proposal_states


def verify_draft_model_chunk(target_model, target_state: PrefixState, draft_ids, pending_target_token):
    device = getattr(target_model, "device", torch.device("cpu"))
    accepted_count = 0

    if pending_target_token is None:
        first_prediction = int(torch.argmax(target_state.last_logits).item())
        if draft_ids and first_prediction != int(draft_ids[0]):
            return (
                VerificationResult(
                    accepted_ids=[], emitted_ids=[first_prediction], target_predictions=[first_prediction],
                    proposed_draft_tokens=len(draft_ids), accepted_draft_tokens=0, mismatch_index=0,
                    bonus_token=None,
                ),
                target_state,
                first_prediction,
                0,
            )

        if draft_ids:
            verify_ids = list(draft_ids)
            output = target_model.decode_many(
                torch.tensor([verify_ids], dtype=torch.long, device=device), cache=target_state.cache
            )
            predictions = [first_prediction] + [int(t) for t in torch.argmax(output.logits[0], dim=-1).tolist()]
            target_forward_calls = 1
        else:
            output = None
            predictions = [first_prediction]
            target_forward_calls = 0
        consumed_prefix_ids: list[int] = []
    else:
        verify_ids = [int(pending_target_token)] + [int(token) for token in draft_ids]
        output = target_model.decode_many(
            torch.tensor([verify_ids], dtype=torch.long, device=device), cache=target_state.cache
        )
        predictions = [int(token) for token in torch.argmax(output.logits[0], dim=-1).tolist()]
        target_forward_calls = 1
        consumed_prefix_ids = [int(pending_target_token)]

    for index, draft_token in enumerate(draft_ids):
        if predictions[index] != int(draft_token):
            break
        accepted_count += 1

    accepted_ids = [int(token) for token in draft_ids[:accepted_count]]
    next_token = int(predictions[accepted_count])
    consumed_ids = consumed_prefix_ids + accepted_ids
    next_state = target_state if not consumed_ids else state_after_decoded_tokens(target_state, output, consumed_ids)
    mismatch_index = None if accepted_count == len(draft_ids) else accepted_count
    bonus_token = next_token if mismatch_index is None else None
    return (
        VerificationResult(
            accepted_ids=accepted_ids, emitted_ids=accepted_ids + [next_token],
            target_predictions=predictions[: len(draft_ids) + 1], proposed_draft_tokens=len(draft_ids),
            accepted_draft_tokens=accepted_count, mismatch_index=mismatch_index, bonus_token=bonus_token,
        ),
        next_state,
        next_token,
        target_forward_calls,
    )


def run_draft_model_speculative_decode(
    target_model, draft_model, prompt_ids, max_new_tokens, draft_len, eos_token_id=None, deferred=True
):
    with torch.inference_mode():
        generated: list[int] = []
        target_state = prefill_prefix(target_model, prompt_ids)
        draft_state = prefill_prefix(draft_model, prompt_ids)
        pending_target_token = None
        use_deferred_target_state = (
            deferred and bool(getattr(target_state, "cache", None)) and hasattr(target_model, "decode_many")
        )
        counters = {"speculation_steps": 0, "target_forwards": 0, "draft_forwards": 0,
                    "proposed_draft_tokens": 0, "accepted_draft_tokens": 0}

        while len(generated) < max_new_tokens:
            requested = min(draft_len, max_new_tokens - len(generated))
            draft_ids, proposal_states = propose_draft_tokens(
                draft_model=draft_model, draft_state=draft_state, draft_len=requested, eos_token_id=eos_token_id
            )
            if use_deferred_target_state:
                result, target_state, pending_target_token, target_forward_calls = verify_draft_model_chunk(
                    target_model=target_model, target_state=target_state, draft_ids=draft_ids,
                    pending_target_token=pending_target_token,
                )
            else:
                result, target_state = greedy_verify_with_state(target_model, target_state, draft_ids)
                pending_target_token = None
                target_forward_calls = 1 if result.mismatch_index == 0 else (2 if draft_ids else 1)
            counters["speculation_steps"] += 1
            counters["target_forwards"] += target_forward_calls
            counters["proposed_draft_tokens"] += result.proposed_draft_tokens
            counters["accepted_draft_tokens"] += result.accepted_draft_tokens

            accepted_count = result.accepted_draft_tokens
            draft_forward_calls = len(proposal_states)
            if accepted_count == 0:
                current_draft_state = draft_state
            elif accepted_count < len(draft_ids):
                current_draft_state = proposal_states[accepted_count - 1]
            else:
                if proposal_states:
                    current_draft_state = advance_prefix_state(draft_model, proposal_states[-1], draft_ids[-1])
                else:
                    current_draft_state = advance_prefix_state(draft_model, draft_state, draft_ids[-1])
                draft_forward_calls += 1

            for token in result.emitted_ids[accepted_count:]:
                current_draft_state = advance_prefix_state(draft_model, current_draft_state, token)
                draft_forward_calls += 1

            counters["draft_forwards"] += draft_forward_calls
            draft_state = current_draft_state

            for token in result.emitted_ids:
                if len(generated) >= max_new_tokens:
                    break
                generated.append(token)
                if eos_token_id is not None and token == eos_token_id:
                    return generated, counters

    return generated, counters


# ---------------------------------------------------------------- reference and driver
@torch.no_grad()
def greedy_reference(model, prompt_ids, max_new_tokens):
    """Plain greedy decoding, the whole sequence recomputed each step with no cache."""
    ids = list(prompt_ids)
    for _ in range(max_new_tokens):
        logits = model(_as_batch_tensor(ids)).logits
        ids.append(int(torch.argmax(logits[0, -1]).item()))
    return ids[len(prompt_ids):]


def main() -> None:
    torch.manual_seed(0)
    target_config = Qwen3Config(
        vocab_size=61, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, rms_norm_eps=1e-6,
    )
    target = Qwen3ForCausalLM(target_config).double().eval()

    # The draft shares the target's vocabulary and sizes but is a perturbed copy of it, so it
    # agrees with the target often enough to accept several tokens, and not always.
    draft = Qwen3ForCausalLM(target_config).double().eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(0.15 * param.std() * torch.randn_like(param) if param.numel() > 1 else 0)

    prompts = [[5, 17, 3, 42, 8, 8, 29], [1, 2, 3, 4], [33, 12, 50, 7, 7, 19, 44, 2, 60, 11, 0]]
    max_new_tokens = 16
    totals = {"accepted": 0, "proposed": 0}
    for deferred in (True, False):
        for draft_len in (4,):
            for prompt_ids in prompts:
                VERIFY_CALLS.clear()
                generated, counters = run_draft_model_speculative_decode(
                    target, draft, prompt_ids, max_new_tokens=max_new_tokens, draft_len=draft_len,
                    deferred=deferred,
                )
                expected = greedy_reference(target, prompt_ids, max_new_tokens)
                assert generated == expected, (deferred, draft_len, prompt_ids, generated, expected)

                # every cached verify forward equals the same rows of a cache-free forward
                with torch.no_grad():
                    for chunk, cached_len, logits in VERIFY_CALLS:
                        prefix = (list(prompt_ids) + generated)[:cached_len]
                        full = target(_as_batch_tensor(prefix + chunk[0].tolist())).logits
                        err = (full[:, cached_len:] - logits).abs().max().item()
                        assert err < 1e-9, err

                totals["accepted"] += counters["accepted_draft_tokens"]
                totals["proposed"] += counters["proposed_draft_tokens"]
                print(f"deferred={deferred} K={draft_len} prompt_len={len(prompt_ids)}: "
                      f"accepted {counters['accepted_draft_tokens']}/{counters['proposed_draft_tokens']}, "
                      f"target forwards {counters['target_forwards']}, verify chunks {len(VERIFY_CALLS)}")

    assert 0 < totals["accepted"] < totals["proposed"], totals
    print("speculative output matches greedy target decoding;", totals)


if __name__ == "__main__":
    main()
