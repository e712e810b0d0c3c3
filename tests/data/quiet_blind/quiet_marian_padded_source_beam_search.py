# Citation: huggingface/transformers src/transformers/models/marian/modeling_marian.py @v5.24 (GenerationMixin beam search)
# MarianMT translation of a right-padded source batch with num_beams=3: the tokenizer's attention_mask (1 = real)
# becomes the encoder's padding mask and, expanded num_beams times, the decoder's cross-attention mask over the
# padded memory; the decoder self-attention is causal with a KV cache reordered per beam. Each padded source must
# translate exactly as it does alone.
import torch
from transformers import MarianConfig, MarianMTModel

torch.manual_seed(0)

PAD, EOS = 1, 0  # Marian: pad_token_id doubles as decoder_start_token_id
config = MarianConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                      decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                      pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD, forced_eos_token_id=EOS,
                      init_std=0.3, scale_embedding=True)
model = MarianMTModel(config).eval()

sources = [[10, 11, 12, 13, 14, 15, 16, EOS], [20, 21, 22, EOS], [30, 31, 32, 33, 34, EOS]]
L = max(len(s) for s in sources)
input_ids = torch.full((3, L), PAD)
attention_mask = torch.zeros(3, L, dtype=torch.long)
for i, s in enumerate(sources):  # MarianTokenizer pads on the right
    input_ids[i, :len(s)] = torch.tensor(s)
    attention_mask[i, :len(s)] = 1

gen = dict(num_beams=3, max_new_tokens=5, do_sample=False, early_stopping=True, length_penalty=1.0,
           bad_words_ids=[[PAD]])
with torch.no_grad():
    batched = model.generate(input_ids=input_ids, attention_mask=attention_mask, return_dict_in_generate=True,
                             output_scores=True, **gen)
    for i, s in enumerate(sources):
        single = model.generate(input_ids=torch.tensor([s]), attention_mask=torch.ones(1, len(s), dtype=torch.long),
                                return_dict_in_generate=True, output_scores=True, **gen)
        a = batched.sequences[i]
        b = single.sequences[0]
        n = min(len(a), len(b))
        assert torch.equal(a[:n], b[:n]), (i, a, b)
        assert torch.allclose(batched.sequences_scores[i], single.sequences_scores[0], atol=1e-4)
print("translations", batched.sequences.tolist())
