"""M2M100 translation of a right-padded source batch, greedy decoding with a cache written out by hand.

Follows huggingface/transformers:
  models/m2m_100/tokenization_m2m_100.py  source = [src_lang_code] + tokens + [eos], padding on the right
  models/m2m_100/modeling_m2m_100.py  M2M100ScaledWordEmbedding, M2M100SinusoidalPositionalEmbedding with
      create_position_ids_from_input_ids(input_ids, padding_idx): positions count only non-pad tokens;
      encoder self-attention and decoder cross-attention both take the source attention_mask
  generation/utils.py  _prepare_encoder_decoder_kwargs_for_generation (encoder run once, its attention_mask kept
      for every decoder step), decoder_start_token_id = eos, forced_bos_token_id = target language code,
      EncoderDecoderCache(DynamicCache, DynamicCache) reused across steps
Built from M2M100Config (2+2 layers, d_model 32, vocab 60), never from_pretrained. float64.
The source attention_mask is the program's statement of which source tokens exist; passing it at every step
keeps cross-attention off the right pads. Reference: each source translated alone, unpadded, no cache.
"""
import torch
from transformers import M2M100Config, M2M100ForConditionalGeneration
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

torch.manual_seed(0)

PAD, BOS, EOS, SRC_LANG, TGT_LANG, NEW = 1, 0, 2, 50, 51, 6
config = M2M100Config(vocab_size=60, d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=PAD, bos_token_id=BOS,
                      eos_token_id=EOS, decoder_start_token_id=EOS, dropout=0.0, attention_dropout=0.0, init_std=0.3,
                      tie_word_embeddings=False)
config._attn_implementation = "sdpa"
model = M2M100ForConditionalGeneration(config).eval().double()

sources = [[SRC_LANG] + torch.randint(3, 50, (n,)).tolist() + [EOS] for n in (7, 4, 1)]
width = max(map(len, sources))
input_ids = torch.tensor([s + [PAD] * (width - len(s)) for s in sources])
attention_mask = (input_ids != PAD).long()


def greedy(input_ids, attention_mask, use_cache):
    b = input_ids.shape[0]
    encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    dec = torch.full((b, 1), EOS)
    cache = EncoderDecoderCache(DynamicCache(config=config), DynamicCache(config=config)) if use_cache else None
    all_logits = []
    for step in range(NEW + 1):
        step_ids = dec[:, -1:] if (use_cache and step > 0) else dec
        out = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                    decoder_input_ids=step_ids, cache=cache, use_cache=use_cache)
        logits = out.logits[:, -1, :]
        if step == 0:  # forced_bos_token_id: the first generated token is the target language code
            nxt = torch.full((b, 1), TGT_LANG)
        else:
            all_logits.append(logits)
            nxt = logits.argmax(-1, keepdim=True)
        dec = torch.cat([dec, nxt], 1)
    return dec, encoder_outputs.last_hidden_state, torch.stack(all_logits, 1)


with torch.no_grad():
    dec, enc, logits = greedy(input_ids, attention_mask, use_cache=True)
    max_diff = 0.0
    for i, s in enumerate(sources):
        d1, e1, l1 = greedy(torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long), use_cache=False)
        max_diff = max(max_diff, (enc[i, : len(s)] - e1[0]).abs().max().item(),
                       (logits[i] - l1[0]).abs().max().item())
        assert dec[i].tolist() == d1[0].tolist()

print("translations", dec[:, 2:].tolist())
print("max |padded cached batch - alone uncached| (encoder states, step logits):", max_diff)
assert max_diff < 1e-10
