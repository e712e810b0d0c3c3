# Follows transformers tests/models/t5/test_modeling_t5.py (batched generation with a padded encoder) and
# src/transformers/models/t5/modeling_t5.py: the encoder key-padding mask (1 = keep) is reused as the
# cross-attention mask, and relative position bias is added on top; padded batch must equal each input alone.
import torch
from transformers import T5Config, T5ForConditionalGeneration

torch.manual_seed(7)
cfg = T5Config(vocab_size=71, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
               relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
               pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)
model = T5ForConditionalGeneration(cfg).double().eval()
model.generation_config.eos_token_id = None

srcs = [torch.randint(2, 71, (n,)) for n in (4, 11, 7)]
T = max(len(s) for s in srcs)
ids = torch.zeros(len(srcs), T, dtype=torch.long)
am = torch.zeros(len(srcs), T, dtype=torch.long)
for i, s in enumerate(srcs):
    ids[i, :len(s)] = s     # T5 pads the encoder on the right
    am[i, :len(s)] = 1

worst = 0.0
for impl in ("sdpa", "eager"):
    model.set_attn_implementation(impl)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=am, max_new_tokens=8, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
        batched = torch.stack(out.logits, 1)
        enc = model.encoder(input_ids=ids, attention_mask=am).last_hidden_state
        for i, s in enumerate(srcs):
            alone = model.generate(s.unsqueeze(0), max_new_tokens=8, do_sample=False,
                                   output_logits=True, return_dict_in_generate=True)
            assert torch.equal(alone.sequences[0], out.sequences[i])
            enc_alone = model.encoder(input_ids=s.unsqueeze(0)).last_hidden_state[0]
            d = max((torch.stack(alone.logits, 1)[0] - batched[i]).abs().max().item(),
                    (enc[i, :len(s)] - enc_alone).abs().max().item())
            assert d == d, "NaN"
            worst = max(worst, d)
print(f"max |padded batch - alone| = {worst:.3e}")
assert worst < 1e-6  # generate() returns logits as float32
