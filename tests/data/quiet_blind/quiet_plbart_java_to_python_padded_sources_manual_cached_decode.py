# Correct program (quiet batch quiet-r80b).
#
# Ported from huggingface/transformers @fe70f22d5e5206a4890993abb916bc9c220c2790 (the port of uclanlp/PLBART's
# code translation models, e.g. uclanlp/plbart-java-cs):
#   src/transformers/models/plbart/modeling_plbart.py  PLBartForConditionalGeneration / PLBartEncoder (padding
#       mask from attention_mask) / PLBartDecoder (causal self-attention over the cache, cross-attention with
#       encoder_attention_mask = the source attention_mask; PLBartLearnedPositionalEmbedding from cache_length)
#   src/transformers/models/plbart/tokenization_plbart.py  set_src_lang_special_tokens (prefix [], suffix
#       [</s>, src_lang_code]), right padding; decoder_start_token_id = the target language code
# Trimmed: a tiny PLBartConfig with random weights, token and language-code ids written by hand; the decode loop
# that generate() runs (encoder once, decoder one token a step with the EncoderDecoderCache) written out by hand.
#
# Batch of Java snippets of different lengths, right-padded with pad=1, attention_mask = input_ids != pad; the
# encoder output and the attention_mask go to every decoder step; the decoder starts from __python__.
#
# Self-check: each snippet decoded alone (no padding) gives the same greedy tokens and next-token log-probs at every
# step as its row of the padded batch; each cached step's logits equal an uncached recompute of the padded batch
# over the whole decoded prefix; the encoder states at real positions equal the snippet encoded alone.
import sys

import torch
import torch.nn.functional as F
from transformers import PLBartConfig, PLBartForConditionalGeneration

torch.manual_seed(0)
BOS, PAD, EOS = 0, 1, 2
JAVA, PYTHON, EN = 60, 61, 62  # language codes after the sentencepiece pieces
STEPS = 6

config = PLBartConfig(
    vocab_size=64,
    max_position_embeddings=64,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    init_std=0.3,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    decoder_start_token_id=PYTHON,
)
model = PLBartForConditionalGeneration(config).eval()


def encode_src(tokens, src_lang_code=JAVA):
    # PLBartTokenizer.set_src_lang_special_tokens: prefix_tokens = [], suffix_tokens = [eos, src_lang_code]
    return tokens + [EOS, src_lang_code]


def pad_right(seqs):
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
    return input_ids, (input_ids != PAD).long()


def decode(input_ids, attention_mask, steps):
    encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    decoder_input_ids = torch.full((input_ids.shape[0], 1), config.decoder_start_token_id, dtype=torch.long)
    cache = None
    cur = decoder_input_ids
    step_logits = []
    for _ in range(steps):
        out = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask, decoder_input_ids=cur,
                    cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[:, -1, :]
        logits[:, PAD] = float("-inf")
        step_logits.append(logits)
        cur = logits.argmax(-1, keepdim=True)
        decoder_input_ids = torch.cat([decoder_input_ids, cur], dim=-1)
    return decoder_input_ids, torch.stack(step_logits, 1), encoder_outputs.last_hidden_state


g = torch.Generator().manual_seed(5)
sources = [encode_src(torch.randint(3, 60, (n,), generator=g).tolist()) for n in (7, 2, 11, 4)]
input_ids, attention_mask = pad_right(sources)

failures = 0
with torch.no_grad():
    b_ids, b_logits, b_enc = decode(input_ids, attention_mask, STEPS)

    # uncached recompute of the padded batch over the decoded prefix
    full = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=b_ids[:, :-1],
                 use_cache=False).logits
    full[:, :, PAD] = float("-inf")
    if not torch.allclose(full, b_logits, atol=1e-4):
        failures += 1
        print(f"cached steps vs recompute differ by {(full - b_logits).abs().max().item():.3g}")

    for i, src in enumerate(sources):
        ids = torch.tensor([src])
        a_ids, a_logits, a_enc = decode(ids, torch.ones_like(ids), STEPS)
        if not torch.equal(a_ids[0], b_ids[i]):
            failures += 1
            print(f"snippet {i}: batch {b_ids[i].tolist()} alone {a_ids[0].tolist()}")
        a_lp, b_lp = F.log_softmax(a_logits[0], -1), F.log_softmax(b_logits[i], -1)
        if not torch.allclose(a_lp, b_lp, atol=1e-5):
            failures += 1
            print(f"snippet {i}: step log-probs differ")
        n = len(src)
        if not torch.allclose(a_enc[0], b_enc[i, :n], atol=1e-5):
            failures += 1
            print(f"snippet {i}: encoder states differ by {(a_enc[0] - b_enc[i, :n]).abs().max().item():.3g}")

if failures:
    print(f"FAILED: {failures} mismatches")
    sys.exit(1)
print("ok: padded PLBart batch with a cached decoder matches each snippet alone and an uncached recompute")
