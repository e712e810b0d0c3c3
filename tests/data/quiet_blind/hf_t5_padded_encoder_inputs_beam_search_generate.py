"""T5 seq2seq generation with beam search over a padded batch of encoder inputs.

Follows huggingface/transformers examples/pytorch/summarization/run_summarization.py (predict_with_generate:
  the tokenizer pads the sources, Seq2SeqTrainer.prediction_step calls model.generate(**inputs, num_beams=...))
  and src/transformers/generation/utils.py GenerationMixin._beam_search: the encoder runs once with the
  source attention_mask; _expand_inputs_for_generation repeats encoder_outputs and attention_mask num_beams
  times; every decoder step cross-attends with that encoder attention_mask; the decoder starts from
  decoder_start_token_id (= pad id 0 for T5) and is causal over its own cache.
The source padding mask is the program's statement of which encoder tokens exist.
Reduced: T5ForConditionalGeneration from a tiny T5Config (no weights), float64, random token ids.
Check: the padded batch gives the same beams (sequences and sequences_scores) as each source alone,
and the first step's log-probs match a direct no-cache forward of the unpadded source.
"""
import torch
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(0)

PAD, EOS = 0, 1
config = T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                  num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
                  pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, dropout_rate=0.0)
model = T5ForConditionalGeneration(config).double().eval()

sources = [torch.cat([torch.randint(2, 48, (n,)), torch.tensor([EOS])]) for n in (10, 3, 6)]
S = max(len(s) for s in sources)
input_ids = torch.full((len(sources), S), PAD)
attention_mask = torch.zeros(len(sources), S, dtype=torch.long)
for i, s in enumerate(sources):
    input_ids[i, :len(s)], attention_mask[i, :len(s)] = s, 1  # T5 tokenizer pads on the right

gen = dict(num_beams=3, num_return_sequences=2, max_new_tokens=7, do_sample=False, length_penalty=1.0,
           early_stopping=True, output_scores=True, return_dict_in_generate=True)
with torch.no_grad():
    batched = model.generate(input_ids=input_ids, attention_mask=attention_mask, **gen)
    worst_score, same = 0.0, True
    for i, s in enumerate(sources):
        alone = model.generate(input_ids=s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long), **gen)
        for r in range(2):
            a = batched.sequences[2 * i + r]
            b = alone.sequences[r]
            n = max(len(a), len(b))
            a = torch.nn.functional.pad(a, (0, n - len(a)), value=PAD)
            b = torch.nn.functional.pad(b, (0, n - len(b)), value=PAD)
            same &= bool(torch.equal(a, b))
            worst_score = max(worst_score, abs(batched.sequences_scores[2 * i + r] - alone.sequences_scores[r]).item())

    # first decoder step, no cache, unpadded source vs padded source with its mask
    start = torch.full((len(sources), 1), PAD)
    lp_batched = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=start).logits.log_softmax(-1)
    worst_step = max(
        (model(input_ids=s[None], decoder_input_ids=start[:1]).logits.log_softmax(-1)[0] - lp_batched[i]).abs().max().item()
        for i, s in enumerate(sources))
print(f"beams identical: {same}; max |sequences_scores diff|: {worst_score:.3e}; first-step log-prob diff: {worst_step:.3e}")
assert same and worst_score < 1e-10 and worst_step < 1e-10
