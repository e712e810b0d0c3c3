# Citation: NVIDIA/kvpress kvpress/pipeline.py @8bb29b9c3078452a86d692f29123fa6c793e2b05
#   (KVPressTextGenerationPipeline._forward, generate_answer, _remove_answer_from_cache).
# A long context is prefilled once into a DynamicCache through `model.model` (no lm head); every question then
# continues that cache: the question tokens go in at positions context_length.., greedy decoding appends the
# answer's tokens one at a time, and after each answer the cache is cut back to the context's length so the
# next question sees only the context. No press here (press=None), batch of one, no attention mask, as the
# pipeline calls the model. The self-check runs each context + question + answer-so-far from scratch with no
# cache and compares every greedy token and the last logits. (kvpress passes num_logits_to_keep=1; the installed
# transformers names it logits_to_keep.)
import sys
import warnings

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

warnings.filterwarnings("ignore", category=FutureWarning)
torch.manual_seed(0)

config = LlamaConfig(
    vocab_size=97,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=96,
    bos_token_id=1,
    pad_token_id=0,
)
model = LlamaForCausalLM(config).eval()
model.generation_config.eos_token_id = 96


class KVPressTextGenerationPipeline:
    """The decoding half of kvpress' pipeline, without the tokenizer (ids in, ids out)."""

    def __init__(self, model):
        self.model = model

    def preprocess(self, context_ids, questions_ids, max_context_length=200):
        context_ids = context_ids[:, :max_context_length]
        return {"context_ids": context_ids, "questions_ids": questions_ids}

    @torch.no_grad()
    def _forward(self, input_tensors, max_new_tokens=50, press=None, cache=None):
        context_ids = input_tensors["context_ids"]
        context_length = context_ids.shape[1]

        # Prefilling using the press on the context
        if cache is None:
            cache = DynamicCache()

        # We run the model without the lm head for pre-filling.
        self.model.model(
            input_ids=context_ids,
            past_key_values=cache,
        )

        # Greedy decoding for each question
        answers = []
        for question_ids in input_tensors["questions_ids"]:
            cache_seq_lengths = [cache.get_seq_length(layer_idx) for layer_idx in range(len(cache))]
            answer = self.generate_answer(
                question_ids=question_ids,
                cache=cache,
                context_length=context_length,
                max_new_tokens=max_new_tokens,
            )
            self._remove_answer_from_cache(cache, cache_seq_lengths)
            answers.append(answer)
        return answers

    def _remove_answer_from_cache(self, cache, cache_seq_lengths):
        for layer_idx, sequence_length in enumerate(cache_seq_lengths):
            cache.layers[layer_idx].keys = cache.layers[layer_idx].keys[:, :, :sequence_length]
            cache.layers[layer_idx].values = cache.layers[layer_idx].values[:, :, :sequence_length]

    def generate_answer(self, question_ids, cache, context_length, max_new_tokens):
        position_ids = torch.arange(context_length, context_length + question_ids.shape[1]).unsqueeze(0)

        outputs = self.model(
            input_ids=question_ids,
            past_key_values=cache,
            position_ids=position_ids,
            logits_to_keep=1,
        )
        first_logits = outputs.logits[0, -1].clone()

        position_ids = position_ids[:, -1:] + 1
        generated_ids = [outputs.logits[0, -1].argmax()]

        should_stop_token_ids = self.model.generation_config.eos_token_id
        if not isinstance(should_stop_token_ids, list):
            should_stop_token_ids = [should_stop_token_ids]

        for i in range(max_new_tokens - 1):
            outputs = self.model(
                input_ids=generated_ids[-1].unsqueeze(0).unsqueeze(0),
                past_key_values=cache,
                position_ids=position_ids + i,
            )
            new_id = outputs.logits[0, -1].argmax()
            generated_ids.append(new_id)
            if new_id.item() in should_stop_token_ids:
                break
        return [int(t) for t in generated_ids], first_logits


@torch.no_grad()
def reference_answer(context_ids, question_ids, max_new_tokens):
    """Greedy decoding by re-running the whole unpadded sequence from scratch at each step."""
    seq = torch.cat([context_ids, question_ids], dim=1)
    first_logits = None
    out = []
    for _ in range(max_new_tokens):
        logits = model(input_ids=seq, use_cache=False).logits[0, -1]
        if first_logits is None:
            first_logits = logits
        new_id = int(logits.argmax())
        out.append(new_id)
        if new_id == 96:
            break
        seq = torch.cat([seq, torch.tensor([[new_id]])], dim=1)
    return out, first_logits


pipe = KVPressTextGenerationPipeline(model)
context_ids = torch.randint(2, 96, (1, 23))
questions_ids = [torch.randint(2, 96, (1, n)) for n in (5, 9, 3)]
inputs = pipe.preprocess(context_ids, questions_ids)
answers = pipe._forward(inputs, max_new_tokens=8)

for q, (ids, first_logits) in zip(questions_ids, answers):
    ref_ids, ref_logits = reference_answer(context_ids, q, 8)
    assert ids == ref_ids, (ids, ref_ids)
    assert torch.allclose(first_logits, ref_logits, atol=1e-4), (first_logits - ref_logits).abs().max()

# the questions answered in another order over a fresh cache give the same answers
answers_rev = pipe._forward({"context_ids": context_ids, "questions_ids": questions_ids[::-1]}, max_new_tokens=8)
assert [a[0] for a in answers_rev[::-1]] == [a[0] for a in answers]
print("ok: %d questions over one prefilled context" % len(answers))
sys.exit(0)
