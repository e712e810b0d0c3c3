# lablup/mlxcel#994, fixed by lablup/mlxcel#1002 ("fix(speculative): correct the draft KV cache rewind
# arithmetic"), src/lib/mlxcel-core/src/speculative/mod.rs, SpeculativeGenerator::generate. Rust/MLX,
# ported to torch with a tiny Hugging Face Llama for both the main and the draft model.
#
# Each round the draft loop forwards current_token, d_0 .. d_{k-2} through the draft model (one token per
# forward, positions taken from the cache offset), then the main model verifies [current_token, d_0 ..
# d_{k-1}] in one forward. On a round that rejects, both caches are trimmed back to the kept prefix.
# Before the fix the draft cache was trimmed by min(rejected + 1, k) -- two entries more than the round
# had to give back -- and on a fully accepted round the last proposal (never forwarded through the draft)
# was never put into the draft cache at all. The draft model's cache then holds fewer keys than the
# sequence has tokens, and its next forward sits at an offset that is too small, so it drafts from a
# context and positions that lag the emitted sequence more every round.
# The fix trims the draft cache by rejected - 1 and replays the owed last proposal at the head of the
# next round's first draft forward (pending_draft_context).
import sys

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv

PREFILL_STEP_SIZE = 512


class KVCache:
    """mlxcel's KVCache: an offset into the keys/values; trim rewinds the offset."""

    def __init__(self):
        self.cache = DynamicCache()

    @property
    def offset(self):
        return self.cache.get_seq_length()

    def trim(self, n):
        n = min(n, self.offset)
        if n > 0:
            self.cache.crop(-n)
        return n


def trim_caches(caches, n):
    if n <= 0:
        return 0
    trimmed = 0
    for cache in caches:
        trimmed = cache.trim(n)
    return trimmed


class LanguageModel:
    def __init__(self, model):
        self.model = model

    def forward(self, input_ids, caches, mask=None):
        # RoPE positions and the causal mask follow the cache offset, as in mlxcel's models.
        out = self.model(input_ids=input_ids, cache=caches[0].cache, attention_mask=mask,
                         use_cache=True)
        return out.logits

    def make_caches(self):
        return [KVCache()]


def sample_greedy(logits):
    return int(logits[0, -1].argmax())


class SpeculativeGenerator:
    def __init__(self):
        self.main_caches = [KVCache()]
        self.draft_caches = [KVCache()]
        self.generated_tokens = []
        self.pending_draft_context = None
        self.rounds = 0
        self.proposed_draft_tokens = 0
        self.accepted_draft_tokens = 0

    @torch.no_grad()
    def generate(self, main_model, draft_model, prompt_tokens, max_tokens, num_draft, eos_tokens=()):
        # PREFILL: all but the last prompt token, in PREFILL_STEP_SIZE chunks.
        n = len(prompt_tokens)
        consumed = 0
        while n - consumed > 1:
            step = min(PREFILL_STEP_SIZE, n - consumed - 1)
            chunk = torch.tensor([prompt_tokens[consumed:consumed + step]])
            main_model.forward(chunk, self.main_caches, None)
            draft_model.forward(chunk, self.draft_caches, None)
            consumed += step
        last_input = torch.tensor([prompt_tokens[consumed:]])
        main_logits = main_model.forward(last_input, self.main_caches, None)
        draft_model.forward(last_input, self.draft_caches, None)
        first_token = sample_greedy(main_logits)
        if first_token in eos_tokens or max_tokens == 0:
            return list(self.generated_tokens)
        self.generated_tokens.append(first_token)

        current_token = first_token
        done = False
        while len(self.generated_tokens) < max_tokens and not done:
            # Step 1: draft
            draft_tokens = []
            draft_token = current_token
            for _ in range(num_draft):
                if FIXED and self.pending_draft_context is not None:
                    owed, self.pending_draft_context = self.pending_draft_context, None
                    draft_input = torch.tensor([[owed, draft_token]])
                else:
                    draft_input = torch.tensor([[draft_token]])
                draft_logits = draft_model.forward(draft_input, self.draft_caches, None)
                draft_token = sample_greedy(draft_logits)
                draft_tokens.append(draft_token)
                if draft_token in eos_tokens:
                    break
            if not draft_tokens:
                break

            # Step 2: verify [current_token, d_0 .. d_{k-1}] in one forward
            verify_tokens = [current_token] + draft_tokens
            verify_input = torch.tensor([verify_tokens])
            main_logits = main_model.forward(verify_input, self.main_caches, None)

            # Step 3: accept the matching prefix
            seq_len = main_logits.shape[1]
            accepted = 0
            for i, d in enumerate(draft_tokens):
                if i >= seq_len:
                    break
                main_token = int(main_logits[0, i].argmax())
                if main_token == d:
                    accepted += 1
                    if d in eos_tokens:
                        done = True
                        break
                    self.generated_tokens.append(d)
                    if FIXED and i + 1 == len(draft_tokens):
                        self.pending_draft_context = d
                    if len(self.generated_tokens) >= max_tokens:
                        done = True
                        break
                else:
                    if main_token in eos_tokens:
                        done = True
                    else:
                        self.generated_tokens.append(main_token)
                    break

            if accepted == len(draft_tokens) and not done and len(self.generated_tokens) < max_tokens:
                bonus_token = int(main_logits[0, seq_len - 1].argmax())
                if bonus_token in eos_tokens:
                    done = True
                else:
                    self.generated_tokens.append(bonus_token)
                current_token = bonus_token
            elif not done:
                current_token = self.generated_tokens[-1]

            self.rounds += 1
            self.proposed_draft_tokens += len(draft_tokens)
            self.accepted_draft_tokens += accepted

            # Step 4: rewind
            rejected = len(draft_tokens) - accepted
            if rejected > 0:
                trim_caches(self.main_caches, rejected)
                if FIXED:
                    trim_caches(self.draft_caches, rejected - 1)
                else:
                    draft_trim = rejected + 1
                    trim_caches(self.draft_caches, min(draft_trim, len(draft_tokens)))

        return list(self.generated_tokens)


def build(seed, layers):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg).eval()


def main():
    target = build(0, 2)
    # The draft: the target's first layer with its embeddings and head (a layer-skip style drafter).
    draft = build(0, 1)
    draft.model.embed_tokens.load_state_dict(target.model.embed_tokens.state_dict())
    draft.model.layers[0].load_state_dict(target.model.layers[0].state_dict())
    draft.model.norm.load_state_dict(target.model.norm.state_dict())
    draft.lm_head.load_state_dict(target.lm_head.state_dict())

    torch.manual_seed(1)
    prompt = torch.randint(3, 96, (12,)).tolist()
    gen = SpeculativeGenerator()
    tokens = gen.generate(LanguageModel(target), LanguageModel(draft), prompt, max_tokens=40, num_draft=4)
    print("generated:", tokens)
    print("rounds=%d proposed=%d accepted=%d acceptance_rate=%.4f" % (
        gen.rounds, gen.proposed_draft_tokens, gen.accepted_draft_tokens,
        gen.accepted_draft_tokens / max(gen.proposed_draft_tokens, 1)))
    print("main cache offset=%d draft cache offset=%d sequence=%d" % (
        gen.main_caches[0].offset, gen.draft_caches[0].offset, len(prompt) + len(tokens)))


if __name__ == "__main__":
    main()
