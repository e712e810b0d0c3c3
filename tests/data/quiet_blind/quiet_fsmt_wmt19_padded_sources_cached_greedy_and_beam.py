# Correct program (quiet batch quiet-r80b).
#
# Ported from huggingface/transformers @70a406ab7dfb491be5a907f363f8a41dd6c0d6aa (the port of fairseq's WMT19
# en-de / de-en translation models):
#   src/transformers/models/fsmt/modeling_fsmt.py  FSMTForConditionalGeneration, FSMTEncoder (invert_mask of the
#       attention_mask into key_padding_mask), FSMTDecoder (encoder_padding_mask for the encoder attention,
#       _prepare_fsmt_decoder_inputs: decoder padding mask + triu(-inf) causal mask when teacher forcing,
#       SinusoidalPositionalEmbedding.make_positions from the non-pad tokens, plus cache_length when decoding)
#   src/transformers/models/fsmt/tokenization_fsmt.py  build_inputs_with_special_tokens (tokens + </s>), pad right
# Trimmed: a tiny FSMTConfig with random weights instead of facebook/wmt19-en-de; token ids written by hand.
#
# Batch of source sentences of different lengths right-padded with pad=1 (each ends in </s>=2), attention_mask =
# input_ids.ne(pad); translated with model.generate (greedy and beam search, encoder run once, decoder cached) and
# scored teacher-forced with right-padded decoder inputs and decoder_attention_mask.
#
# Self-check: every sentence translated alone (no padding at all) gives the same greedy tokens and step scores and the same beam
# search hypothesis as in the padded batch; teacher-forced log-probs at the real target positions equal each pair run
# alone, and the summed NLL equals a double loop over sentence x target token.
import sys

import torch
import torch.nn.functional as F
from transformers import FSMTConfig, FSMTForConditionalGeneration

torch.manual_seed(0)
PAD, BOS, EOS = 1, 0, 2

config = FSMTConfig(
    langs=["en", "de"],
    src_vocab_size=61,
    tgt_vocab_size=57,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    max_position_embeddings=64,
    dropout=0.0,
    attention_dropout=0.0,
    activation_dropout=0.0,
    pad_token_id=PAD,
    bos_token_id=BOS,
    eos_token_id=EOS,
    decoder_start_token_id=EOS,
    forced_eos_token_id=None,
    num_beams=1,
    max_length=9,
    init_std=0.3,
)
model = FSMTForConditionalGeneration(config).eval()


def build_inputs_with_special_tokens(token_ids_0):
    # FSMTTokenizer: no prefix, one </s> at the end
    return token_ids_0 + [EOS]


def pad_batch(seqs):
    # FSMTTokenizer pads on the right (padding_side="right")
    max_len = max(len(s) for s in seqs)
    input_ids = torch.full((len(seqs), max_len), PAD, dtype=torch.long)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s)
    return input_ids, input_ids.ne(PAD).long()


g = torch.Generator().manual_seed(1)
src_texts = [torch.randint(3, 61, (n,), generator=g).tolist() for n in (9, 3, 6, 1)]
tgt_texts = [torch.randint(3, 57, (n,), generator=g).tolist() for n in (4, 7, 2, 5)]
sources = [build_inputs_with_special_tokens(s) for s in src_texts]
input_ids, attention_mask = pad_batch(sources)

GEN = dict(max_length=9, suppress_tokens=[PAD, BOS], do_sample=False)


def strip(seq):
    out = []
    for t in seq.tolist()[1:]:  # drop decoder_start </s>
        if t == PAD:
            break
        out.append(t)
        if t == EOS:
            break
    return out


failures = 0
with torch.no_grad():
    # greedy, cached; the step scores are compared too
    batch_res = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_beams=1,
                               return_dict_in_generate=True, output_scores=True, **GEN)
    batch_out = batch_res.sequences
    for i, src in enumerate(sources):
        ids = torch.tensor([src])
        alone_res = model.generate(input_ids=ids, attention_mask=ids.ne(PAD).long(), num_beams=1,
                                   return_dict_in_generate=True, output_scores=True, **GEN)
        a, b = strip(alone_res.sequences[0]), strip(batch_out[i])
        if a != b:
            failures += 1
            print(f"greedy sentence {i}: batch {b} alone {a}")
        for t in range(len(a)):
            sa = F.log_softmax(alone_res.scores[t][0], -1)
            sb = F.log_softmax(batch_res.scores[t][i], -1)
            if not torch.allclose(sa, sb, atol=1e-5):
                failures += 1
                print(f"greedy sentence {i} step {t}: scores differ")

    # beam search, cached (beams reorder the cache and expand the encoder padding mask)
    beam_out = model.generate(input_ids=input_ids, attention_mask=attention_mask, num_beams=3, early_stopping=True, **GEN)
    for i, src in enumerate(sources):
        ids = torch.tensor([src])
        alone = model.generate(input_ids=ids, attention_mask=ids.ne(PAD).long(), num_beams=3, early_stopping=True,
                               **GEN)
        a, b = strip(alone[0]), strip(beam_out[i])
        if a != b:
            failures += 1
            print(f"beam sentence {i}: batch {b} alone {a}")

    # teacher forcing: decoder_input_ids = [</s>] + target, labels = target + [</s>], right-padded
    dec_in = [[EOS] + t for t in tgt_texts]
    labels_list = [t + [EOS] for t in tgt_texts]
    decoder_input_ids, decoder_attention_mask = pad_batch(dec_in)
    labels, _ = pad_batch(labels_list)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                   decoder_attention_mask=decoder_attention_mask, use_cache=False).logits
    logp = F.log_softmax(logits, dim=-1)
    batch_nll = F.nll_loss(logp.view(-1, logp.size(-1)), labels.view(-1), ignore_index=PAD, reduction="sum")

    loop_nll = 0.0
    for i in range(len(sources)):
        src = torch.tensor([sources[i]])
        d = torch.tensor([dec_in[i]])
        lp_alone = F.log_softmax(model(input_ids=src, attention_mask=src.ne(PAD).long(), decoder_input_ids=d,
                                       decoder_attention_mask=torch.ones_like(d), use_cache=False).logits, dim=-1)[0]
        n = len(dec_in[i])
        if not torch.allclose(logp[i, :n], lp_alone, atol=1e-5):
            failures += 1
            print(f"teacher forcing sentence {i}: max diff {(logp[i, :n] - lp_alone).abs().max().item():.3g}")
        for t in range(n):
            loop_nll += -lp_alone[t, labels_list[i][t]].item()
    if abs(batch_nll.item() - loop_nll) > 1e-3:
        failures += 1
        print(f"nll batch {batch_nll.item():.6f} loop {loop_nll:.6f}")

if failures:
    print(f"FAILED: {failures} mismatches")
    sys.exit(1)
print("ok: padded FSMT batch matches each sentence alone (greedy, beam, teacher forcing, NLL)")
