# Citation: neuralmagic/deepsparse
#   src/deepsparse/transformers/utils/helpers.py @39be9a0f64a1bfb3acd2b8e9e6f23274c3902e7a (compute_engine_inputs,
#   _compute_input_ids, _compute_attention_mask, _compute_positions, create_causal_mask, initialize_kv_cache_state),
#   src/deepsparse/transformers/utils/decoder_kv_cache.py @0bd2b88150c3842a58ab2282b638cb526559f36e (DecoderKVCache
#   setup / update / remove_padded_entries / set_capacity / _expand_capacity). The engine loop (a multi-token engine
#   over prompt chunks of prompt_sequence_length, the single-token engine for the prompt's remainder and for
#   generation, kv_cache.set_capacity when switching) follows TextGenerationPipeline / NLDecoderEngine as recalled,
#   not read at a commit. The ONNX graph (a sparseml KV-cache-injected decoder taking input_ids, attention_mask,
#   positions, causal_mask, past_key_values.N.key/value) is a tiny torch llama stand-in run on numpy inputs.
# DeepSparse runs each prompt (its own session, batch 1) through engines of fixed shapes: the cache holds
# sequence_length - L slots for an input of L tokens, left-padded with zero "blank" entries; attention_mask is
# (1, sequence_length) with the rightmost processed + L entries set; positions count from the processed tokens;
# create_causal_mask gives (1, 1, L, sequence_length): ones over the past, tril over the new tokens, and zeros over
# the count of attention_mask zeros on the left. The graph returns caches of sequence_length entries and
# DecoderKVCache.update drops input_ids_len entries from the left (blank ones first).
# Self-check: every prompt's greedy continuation and the logits behind each generated token match the same
# decoder run on the unpadded prompt + generated prefix alone, all at once, with a plain causal mask and no cache.
from typing import Any, Callable, Dict, List, Union

import numpy
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)
CACHE_INPUT_PREFIX = "past_key_values"
CACHE_OUTPUT_PREFIX = "present"


# ---------------------------------------------------------------- helpers.py
def compute_engine_inputs(onnx_input_names: str, **kwargs) -> List[numpy.ndarray]:
    engine_inputs = []
    for input_name in onnx_input_names:
        if input_name == "causal_mask":
            # delay the computation of the causal mask
            continue
        compute_func = _get_compute_func(input_name)
        engine_inputs.append(compute_func(**kwargs))

    if "causal_mask" in onnx_input_names:
        input_ids, attention_mask, *_ = engine_inputs
        engine_inputs.append(create_causal_mask(input_ids, attention_mask))
    return engine_inputs


def _get_compute_func(input_name: str) -> Callable[..., numpy.ndarray]:
    compute_func = {
        "input_ids": _compute_input_ids,
        "attention_mask": _compute_attention_mask,
        "positions": _compute_positions,
    }.get(input_name)
    if compute_func is None:
        raise ValueError("Could not find compute function " f"for the input_name: {input_name}")
    return compute_func


def _compute_input_ids(token_batch: List[int], **kwargs) -> numpy.ndarray:
    return numpy.array([token_batch])


def _compute_attention_mask(sequence_length: int, prompt_sequence_length: int, num_total_processed_tokens: int,
                            **kwargs) -> numpy.ndarray:
    attention_mask = numpy.zeros((1, sequence_length), dtype=numpy.int64)
    num_attention_entries_to_unmask = min(num_total_processed_tokens + prompt_sequence_length, sequence_length)
    # unmask the bits from the right-hand side
    attention_mask[:, -num_attention_entries_to_unmask:] = 1
    return attention_mask


def _compute_positions(num_total_processed_tokens: int, prompt_sequence_length: int, **kwargs):
    return (
        numpy.arange(num_total_processed_tokens, num_total_processed_tokens + prompt_sequence_length)
        .reshape(1, -1)
        .astype(numpy.int64)
    )


def initialize_kv_cache_state(cache_shape, kv_cache_data_type, output_names, length=None, empty=False):
    batch_size, num_attention_heads, length_, hidden_dims = cache_shape
    kv_cache_tensor = numpy.zeros(
        (batch_size if not empty else 0, num_attention_heads, length if length is not None else length_,
         hidden_dims),
        dtype=kv_cache_data_type,
    )
    cache_keys = [
        output_name.replace(CACHE_OUTPUT_PREFIX, CACHE_INPUT_PREFIX)
        for output_name in output_names
        if output_name.startswith(CACHE_OUTPUT_PREFIX)
    ]
    return {key: kv_cache_tensor for key in cache_keys}


def create_causal_mask(input_ids: Union[numpy.ndarray, List[int]], attention_mask: Union[numpy.ndarray, List[int]],
                       dtype: numpy.dtype = numpy.int64) -> numpy.ndarray:
    if isinstance(input_ids, numpy.ndarray):
        batch_size, input_ids_length = input_ids.shape
    else:
        batch_size, input_ids_length = 1, len(input_ids)

    if isinstance(attention_mask, numpy.ndarray):
        sequence_length = attention_mask.shape[1]
    else:
        sequence_length = len(attention_mask)
        attention_mask = numpy.array(attention_mask)[None, ...]

    if input_ids_length == 1:
        causal_mask = numpy.reshape(attention_mask, (batch_size, 1, 1, sequence_length))
        return causal_mask.astype(dtype)

    causal_mask = numpy.tril(numpy.ones((batch_size, 1, input_ids_length, input_ids_length), dtype=dtype), 0)
    past_causal_mask = numpy.ones((batch_size, 1, input_ids_length, sequence_length - input_ids_length),
                                  dtype=dtype)
    causal_mask = numpy.concatenate((past_causal_mask, causal_mask), axis=-1)

    num_zeros = numpy.count_nonzero(attention_mask == 0)

    # zero out the dimensions that correspond to tokens that we do not
    # want to attend to
    causal_mask[:, :, :, :num_zeros] = 0
    return causal_mask


# ---------------------------------------------------------------- decoder_kv_cache.py
SEQUENCE_LENGTH_AXIS = 2


class DecoderKVCache:
    def __init__(self):
        self.total_num_processed_tokens = None
        self._sequence_len_axis = SEQUENCE_LENGTH_AXIS
        self._freeze_first_position = None
        self._state = None

    def setup(self, state: Dict[str, Any], num_processed_tokens: int = 0, freeze_first_position: bool = False):
        self._state = state
        self._freeze_first_position = freeze_first_position
        self.total_num_processed_tokens = num_processed_tokens

    def update(self, state: Dict[str, Any], input_ids_len: int, increment_total_num_processed_tokens: int = True):
        if increment_total_num_processed_tokens:
            self.total_num_processed_tokens += input_ids_len

        input_state_capacity = state[list(state.keys())[0]].shape[self._sequence_len_axis]
        num_entries_to_delete = input_ids_len
        # compute the number of blank (padded) entries in the cache
        num_padded_entries = max(0, input_state_capacity - self.total_num_processed_tokens)
        num_padded_entries_to_delete = min(num_padded_entries, num_entries_to_delete)
        num_non_padded_entries_to_delete = max(0, num_entries_to_delete - num_padded_entries)

        for name, cache_array in state.items():
            if num_padded_entries_to_delete:
                cache_array = self.remove_padded_entries(cache_array, num_padded_entries_to_delete)
            if num_non_padded_entries_to_delete:
                cache_array = self.remove_non_padded_entries(cache_array, num_non_padded_entries_to_delete)
            state[name] = numpy.ascontiguousarray(cache_array)
        self._state = state

    def remove_padded_entries(self, cache_array, num_padded_entries_to_delete: int):
        return cache_array[:, :, num_padded_entries_to_delete:, :]

    def remove_non_padded_entries(self, cache_array, num_non_padded_entries_to_delete: int):
        new_cache_array = cache_array[:, :, int(self._freeze_first_position) + num_non_padded_entries_to_delete:, :]
        if self._freeze_first_position:
            bos_entries = cache_array[:, :, :1, :]
            new_cache_array = numpy.concatenate([bos_entries, new_cache_array], axis=self._sequence_len_axis)
        return new_cache_array

    def set_capacity(self, capacity: int):
        capacity_difference = self.capacity - capacity
        state = self.cached_inputs
        if capacity_difference > 0:
            self.update(state, input_ids_len=capacity_difference, increment_total_num_processed_tokens=False)
        elif capacity_difference < 0:
            state = self._expand_capacity(state, num_additional_entries=abs(capacity_difference))
            self._state = state

    def _expand_capacity(self, state, num_additional_entries: int, padding_value: int = 0):
        for key, value in state.items():
            zeros = numpy.zeros_like((value[:, :, :num_additional_entries, :]), dtype=value.dtype)
            state[key] = numpy.concatenate([zeros, value], axis=self._sequence_len_axis)
        return state

    @property
    def capacity(self) -> int:
        return self.cached_inputs[list(self.cached_inputs.keys())[0]].shape[self._sequence_len_axis]

    @property
    def cached_inputs(self):
        return self._state


# ---------------------------------------------------------------- the exported graph (stand-in)
VOCAB, HIDDEN, HEADS, LAYERS = 48, 32, 4, 2
HEAD_DIM = HIDDEN // HEADS


def rope(x, positions):
    # x: (b, h, L, d), positions: (b, L)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    ang = positions[:, None, :, None].float() * inv
    ang = torch.cat([ang, ang], dim=-1)
    x1, x2 = x[..., : HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    return x * ang.cos() + torch.cat([-x2, x1], dim=-1) * ang.sin()


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(HIDDEN)
        self.ln2 = nn.LayerNorm(HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.o = nn.Linear(HIDDEN, HIDDEN)
        self.mlp = nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), nn.GELU(), nn.Linear(4 * HIDDEN, HIDDEN))

    def forward(self, x, positions, causal_mask, past_k, past_v):
        b, L, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, L, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        q, k = rope(q, positions), rope(k, positions)
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        scores = q @ k.transpose(-1, -2) / HEAD_DIM ** 0.5
        scores = scores.masked_fill(causal_mask == 0, torch.finfo(scores.dtype).min)
        a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, L, HIDDEN)
        x = x + self.o(a)
        return x + self.mlp(self.ln2(x)), k, v


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList([Layer() for _ in range(LAYERS)])
        self.norm = nn.LayerNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, input_ids, positions, causal_mask, pasts):
        x = self.emb(input_ids)
        presents = []
        for layer, (pk, pv) in zip(self.layers, pasts):
            x, k, v = layer(x, positions, causal_mask, pk, pv)
            presents.append((k, v))
        return self.head(self.norm(x)), presents


MODEL = Decoder().eval()
ONNX_INPUT_NAMES = ["input_ids", "attention_mask", "positions", "causal_mask"]
OUTPUT_NAMES = ["logits"] + [f"{CACHE_OUTPUT_PREFIX}.{i}.{kv}" for i in range(LAYERS) for kv in ("key", "value")]


def engine_run(engine_inputs: List[numpy.ndarray], cache_state: Dict[str, numpy.ndarray]):
    """What the compiled graph does with its numpy inputs (attention_mask itself is not read by the graph)."""
    input_ids, attention_mask, positions, causal_mask = engine_inputs
    pasts = [
        (torch.from_numpy(cache_state[f"{CACHE_INPUT_PREFIX}.{i}.key"]),
         torch.from_numpy(cache_state[f"{CACHE_INPUT_PREFIX}.{i}.value"]))
        for i in range(LAYERS)
    ]
    with torch.no_grad():
        logits, presents = MODEL(torch.from_numpy(input_ids), torch.from_numpy(positions),
                                 torch.from_numpy(causal_mask), pasts)
    new_state = {}
    for i, (k, v) in enumerate(presents):
        new_state[f"{CACHE_INPUT_PREFIX}.{i}.key"] = k.numpy()
        new_state[f"{CACHE_INPUT_PREFIX}.{i}.value"] = v.numpy()
    return logits.numpy(), new_state


# ---------------------------------------------------------------- the pipeline loop
SEQUENCE_LENGTH = 24
PROMPT_SEQUENCE_LENGTH = 4


def run_engine(kv_cache: DecoderKVCache, tokens: List[int]):
    L = len(tokens)
    kv_cache.set_capacity(SEQUENCE_LENGTH - L)
    engine_inputs = compute_engine_inputs(
        ONNX_INPUT_NAMES,
        token_batch=tokens,
        sequence_length=SEQUENCE_LENGTH,
        prompt_sequence_length=L,
        num_total_processed_tokens=kv_cache.total_num_processed_tokens,
    )
    logits, new_state = engine_run(engine_inputs, kv_cache.cached_inputs)
    kv_cache.update(new_state, input_ids_len=L)
    return logits


def generate_one(prompt: List[int], max_new_tokens: int):
    kv_cache = DecoderKVCache()
    kv_cache.setup(
        initialize_kv_cache_state((1, HEADS, SEQUENCE_LENGTH - PROMPT_SEQUENCE_LENGTH, HEAD_DIM), numpy.float32,
                                  OUTPUT_NAMES),
        num_processed_tokens=0,
    )
    # prompt inference: multi-token engine over full chunks, single-token engine for the rest
    n = 0
    while len(prompt) - n >= PROMPT_SEQUENCE_LENGTH:
        logits = run_engine(kv_cache, prompt[n:n + PROMPT_SEQUENCE_LENGTH])
        n += PROMPT_SEQUENCE_LENGTH
    while n < len(prompt):
        logits = run_engine(kv_cache, prompt[n:n + 1])
        n += 1
    generated, step_logits = [], []
    for _ in range(max_new_tokens):
        step_logits.append(logits[0, -1])
        token = int(numpy.argmax(logits[0, -1]))
        generated.append(token)
        if kv_cache.total_num_processed_tokens + 1 > SEQUENCE_LENGTH:
            break
        logits = run_engine(kv_cache, [token])
    return generated, step_logits


def main():
    lengths = [11, 6, 3, 8]
    prompts = [torch.randint(0, VOCAB, (n,)).tolist() for n in lengths]
    max_new_tokens = 9
    worst = 0.0
    for prompt in prompts:
        generated, step_logits = generate_one(prompt, max_new_tokens)
        assert len(generated) == max_new_tokens
        seq = list(prompt)
        for t in range(max_new_tokens):
            # reference: the whole unpadded prefix at once, plain causal mask, empty cache
            S = len(seq)
            ids = torch.tensor([seq])
            pos = torch.arange(S)[None]
            causal = torch.tril(torch.ones(S, S, dtype=torch.long))[None, None]
            empty = [(torch.zeros(1, HEADS, 0, HEAD_DIM), torch.zeros(1, HEADS, 0, HEAD_DIM))] * LAYERS
            with torch.no_grad():
                ref = MODEL(ids, pos, causal, empty)[0][0, -1]
            worst = max(worst, (ref - torch.from_numpy(step_logits[t])).abs().max().item())
            assert int(ref.argmax()) == generated[t], (prompt, t)
            seq.append(generated[t])
    assert worst < 1e-4, worst
    print(f"deepsparse engines: {len(prompts)} prompts through a {SEQUENCE_LENGTH}-slot left-padded KV cache "
          f"(chunks of {PROMPT_SEQUENCE_LENGTH} + single tokens); max |logit diff| vs unpadded runs = {worst:.2e}")


if __name__ == "__main__":
    main()
