# Follows transformers tests/models/bart/test_modeling_bart.py (batched generate) with padding_side="left": the
# encoder mask has zeros on the LEFT (bidirectional, not causal) and is reused for cross-attention; decoder
# queries (9) outnumber the shortest input's keys (3).
import torch
from transformers import BartConfig, BartForConditionalGeneration

torch.manual_seed(8)
cfg = BartConfig(vocab_size=67, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                 decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                 dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
                 eos_token_id=2, decoder_start_token_id=2, forced_bos_token_id=None, forced_eos_token_id=None)
model = BartForConditionalGeneration(cfg).double().eval()
model.generation_config.eos_token_id = None
model.generation_config.forced_eos_token_id = None
model.generation_config.forced_bos_token_id = None
model.generation_config.no_repeat_ngram_size = 0

srcs = [torch.randint(3, 67, (n,)) for n in (3, 10, 6)]
T = max(len(s) for s in srcs)
ids = torch.full((len(srcs), T), 1, dtype=torch.long)
am = torch.zeros(len(srcs), T, dtype=torch.long)
for i, s in enumerate(srcs):
    ids[i, T - len(s):] = s
    am[i, T - len(s):] = 1

worst = 0.0
model.set_attn_implementation("sdpa")  # float64: eager softmax would run in float32 (see qwen2 note)
with torch.no_grad():
    out = model.generate(ids, attention_mask=am, max_new_tokens=9, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
    batched = torch.stack(out.logits, 1)
    for i, s in enumerate(srcs):
        # BART's learned encoder positions count from the first column, so "alone" must be computed
        # with the same left offset: the reference is the encoder mask's effect, i.e. pad keys are ignored.
        # Explicit reference: encoder run alone on [pads..., s] where pad embeddings are replaced by other
        # tokens -> if the mask works, output rows for s cannot change.
        junk = ids[i:i + 1].clone()
        junk[0, :T - len(s)] = torch.randint(3, 67, (T - len(s),))
        alt = model.generate(junk, attention_mask=am[i:i + 1], max_new_tokens=9, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        assert torch.equal(alt.sequences[0], out.sequences[i])
        d = (torch.stack(alt.logits, 1)[0] - batched[i]).abs().max().item()
        assert d == d, "NaN"
        worst = max(worst, d)
print(f"max |left-padded batch - same row with different masked-out tokens| = {worst:.3e}")
assert worst < 1e-6
