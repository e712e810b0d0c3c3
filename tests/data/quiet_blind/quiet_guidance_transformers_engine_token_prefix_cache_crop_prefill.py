# Citation: guidance-ai/guidance guidance/models/transformers/_transformers.py (TransformersEngine.get_logits, the
#   version with get_max_cache_shape and the StaticCache / HybridCache re-initialisation; library file id 4629050333).
# guidance keeps one cache across calls: `_cached_token_ids` lists the tokens whose keys and values sit in
# `_past_key_values`. Each call finds how many leading tokens the new token list shares with them, crops the cache
# back (one token short of the shared prefix, so there is always a new token to get logits for), and runs only the
# new tokens with position_ids past_length.. and an all-ones attention mask over past + new. A chat program is
# driven through it: a system prompt, a user turn, an assistant prefill forced in as one chunk, greedy tokens one at
# a time, then a second user turn continuing the same conversation, then a different answer to the first turn
# (the cache is cropped back into the conversation). The self-check runs every token list from scratch with no
# cache and compares the last logits at every call.
import sys
import warnings

import torch
import transformers as transformers_package
from transformers import LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore", category=FutureWarning)
torch.manual_seed(0)


class TransformersEngine:
    def __init__(self, model):
        self.model_obj = model
        self.device = torch.device("cpu")
        self._past_key_values = None
        self._cached_logits = None
        self._cached_token_ids = []
        self.vocab_size = model.config.vocab_size
        self.engine_input_tokens = 0

    def get_logits(self, token_ids):
        # make sure we don't run off the end of the model
        if len(token_ids) >= getattr(self.model_obj.config, "max_position_embeddings", 1e10):
            raise Exception("Attempted to run a transformers model past its maximum context window size")

        # get the number of cache positions we are using
        cache_token_ids = self._cached_token_ids
        num_cached = 0
        for id in cache_token_ids:
            if (
                num_cached >= len(cache_token_ids)
                or num_cached >= len(token_ids)
                or token_ids[num_cached] != id
            ):
                break
            num_cached += 1

        # reset the cache length according to that number of positions
        past_key_values = self._past_key_values
        max_cache_shape = None
        if past_key_values is None:
            past_length = 0
        elif isinstance(past_key_values, tuple):
            past_length = past_key_values[0][0].size(-2)
        elif isinstance(past_key_values, transformers_package.Cache):
            past_length = past_key_values.get_seq_length()
            try:
                max_cache_shape = past_key_values.get_max_cache_shape()
            except AttributeError:
                # guidance falls back to get_max_length(); the installed DynamicCache has neither (unbounded)
                max_cache_shape = None
            if max_cache_shape is not None and max_cache_shape < 0:
                max_cache_shape = None
        else:
            raise TypeError(f"Unknown type of past_key_values: {type(past_key_values)}")

        if max_cache_shape is not None and len(token_ids) > max_cache_shape:
            warnings.warn("Cache is too small. Resetting cache.")
            self._past_key_values = None
            past_length = 0
        elif past_length > num_cached:
            past_length = max(0, num_cached - 1)
            if isinstance(past_key_values, tuple):
                self._past_key_values = tuple(
                    tuple(p[..., :past_length, :] for p in v) for v in past_key_values
                )
            else:
                # guidance calls crop(past_length); the installed transformers' crop takes the number of tokens
                # to remove, as a negative count
                self._past_key_values.crop(past_length - self._past_key_values.get_seq_length())

        cache_token_ids[past_length:] = []

        # call the model
        new_token_ids = token_ids[past_length:]
        if len(new_token_ids) > 0:
            with torch.no_grad():
                model_out = self.model_obj(
                    input_ids=torch.tensor(new_token_ids).unsqueeze(0).to(self.device),
                    past_key_values=self._past_key_values,
                    use_cache=True,
                    position_ids=torch.arange(past_length, past_length + len(new_token_ids))
                    .unsqueeze(0)
                    .to(self.device),
                    attention_mask=torch.ones(1, past_length + len(new_token_ids)).to(self.device),
                    return_dict=True,
                    output_attentions=False,
                    output_hidden_states=False,
                )

            # save the results
            self._past_key_values = model_out.past_key_values
            cache_token_ids.extend(new_token_ids)
            self._cached_logits = model_out.logits[0, -1, : self.vocab_size].float().cpu().numpy()
            self.engine_input_tokens += len(new_token_ids)

        return self._cached_logits


config = LlamaConfig(
    vocab_size=89,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)
model = LlamaForCausalLM(config).eval()
engine = TransformersEngine(model)


@torch.no_grad()
def reference_logits(token_ids):
    """The whole token list from scratch: no cache, no mask, positions 0..n-1."""
    return model(input_ids=torch.tensor([token_ids]), use_cache=False).logits[0, -1].numpy()


calls = 0


def check(token_ids):
    global calls
    got = engine.get_logits(list(token_ids))
    ref = reference_logits(list(token_ids))
    assert abs(got - ref).max() < 1e-4, (len(token_ids), abs(got - ref).max())
    calls += 1
    return got


def greedy(token_ids, n):
    out = list(token_ids)
    for _ in range(n):
        out.append(int(check(out).argmax()))
    return out


g = torch.Generator().manual_seed(1)
rand = lambda n: torch.randint(3, 89, (n,), generator=g).tolist()
SYSTEM, USER1, PREFILL, USER2, OTHER_PREFILL = rand(12), rand(6), rand(4), rand(5), rand(3)

# turn 1: system + user, then the assistant's forced prefix in one chunk, then greedy tokens
turn1 = greedy(SYSTEM + USER1, 0)
check(turn1)
turn1 = greedy(turn1 + PREFILL, 6)
# turn 2 continues the same conversation: only the new user turn goes through the model
before = engine.engine_input_tokens
turn2 = greedy(turn1 + USER2, 5)
# (the last greedy token of turn 1 is not cached yet: it goes in with the user turn, then 4 single steps)
assert engine.engine_input_tokens - before == 1 + len(USER2) + 4
# a different answer to turn 1: the cache is cropped back to the shared system + user prefix
alt = greedy(SYSTEM + USER1 + OTHER_PREFILL, 4)
# back to a token list one token short of what is cached, then the full system prompt again
check(alt[:-1])
check(SYSTEM)
print("ok: %d get_logits calls match the uncached reference" % calls)
sys.exit(0)
