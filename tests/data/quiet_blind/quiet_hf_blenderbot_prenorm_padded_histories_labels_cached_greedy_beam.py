"""Correct program: a tiny Blenderbot (transformers' BlenderbotForConditionalGeneration, built from
BlenderbotConfig, no download) answering a RIGHT-padded batch of dialogue histories: trained
teacher-forced on right-padded replies (labels padded with -100), then decoded greedily and by
beam search with the encoder-decoder cache.

Project: huggingface/transformers src/transformers/models/blenderbot/modeling_blenderbot.py
(v5.25.0, the installed release): BlenderbotEncoder.forward (create_bidirectional_mask over the
source attention_mask), BlenderbotDecoder.forward (create_causal_mask over the decoder
attention_mask, or a mask of ones of cache_length + seq_length when none is given;
create_bidirectional_mask over encoder_attention_mask for the cross-attention),
BlenderbotLearnedPositionalEmbedding (positions arange(cache_length, cache_length + seq_len), no
offset, the same for every row), BlenderbotForConditionalGeneration.forward (labels ->
shift_tokens_right(labels, pad_token_id, decoder_start_token_id), the -100s turned into pads).
BlenderbotTokenizer.build_inputs_with_special_tokens appends only </s> (no <s>); the collator
below stands in for the tokenizer's padding="longest" (right side) and DataCollatorForSeq2Seq's
label_pad_token_id=-100.

What Blenderbot does differently from BART and is kept: pre-LayerNorm layers (normalize_before)
with a final layer_norm on each stack, no layernorm_embedding, positions without BART's +2
offset. Positions count from 0 for every row, so only right padding keeps each real token at its
own position; the pad keys are hidden by the masks: the encoder's pads by the source
attention_mask, the same mask handed to the decoder as encoder_attention_mask for the
cross-attention, and the reply's pads sit after every real reply token, behind the causal mask.

Checks (float64):
  1. the batched loss equals the token-weighted mean of each pair's loss run alone, unpadded, and
     the logits at every real reply position equal that solo run;
  2. a hand-written cached greedy loop (encoder run once, its attention_mask kept for every step)
     == a no-cache loop re-running the whole reply prefix == model.generate on the padded batch
     == each history generated alone; and beam search (num_beams=3) on the padded batch == each
     history beam-searched alone.
"""
import warnings

import torch
from transformers import BlenderbotConfig, BlenderbotForConditionalGeneration
from transformers.utils import logging as hf_logging

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
torch.manual_seed(0)

PAD, BOS, EOS = 0, 1, 2
VOCAB = 64
MAX_NEW = 7


def build():
    cfg = BlenderbotConfig(
        vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.3, scale_embedding=False,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, decoder_start_token_id=BOS,
        forced_eos_token_id=None, encoder_no_repeat_ngram_size=0, no_repeat_ngram_size=0, min_length=0,
        max_length=32, length_penalty=1.0,
    )
    cfg._attn_implementation = "eager"
    model = BlenderbotForConditionalGeneration(cfg).to(torch.float64).eval()
    with torch.no_grad():
        # at this size the reply's own tokens drown the history: make the cross-attention weigh more
        for name, p in model.named_parameters():
            if ".encoder_attn." in name and name.endswith("proj.weight"):
                p.mul_(2.0)
        # the tiny model must never emit the pad id, or a row's reply could stop "looking" padded
        model.final_logits_bias[0, PAD] = -1e4
    return model


def encode_history(turns):
    """BlenderbotTokenizer: the turns joined into one source, </s> appended, no <s>."""
    ids = [t for turn in turns for t in turn]
    return ids + [EOS]


def collate(sources, replies):
    """padding="longest" on the right for the sources; labels padded with -100 (DataCollatorForSeq2Seq)."""
    src_len = max(len(s) for s in sources)
    tgt_len = max(len(r) for r in replies)
    input_ids = torch.full((len(sources), src_len), PAD, dtype=torch.long)
    attention_mask = torch.zeros((len(sources), src_len), dtype=torch.long)
    labels = torch.full((len(replies), tgt_len), -100, dtype=torch.long)
    for i, (s, r) in enumerate(zip(sources, replies)):
        input_ids[i, : len(s)] = torch.tensor(s)
        attention_mask[i, : len(s)] = 1
        labels[i, : len(r)] = torch.tensor(r)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def rand_ids(n, g):
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


def make_data():
    g = torch.Generator().manual_seed(7)
    histories = [
        [rand_ids(3, g), rand_ids(4, g)],
        [rand_ids(2, g)],
        [rand_ids(5, g), rand_ids(3, g), rand_ids(4, g)],
        [rand_ids(4, g), rand_ids(2, g)],
    ]
    replies = [rand_ids(n, g) + [EOS] for n in (5, 2, 7, 3)]
    return [encode_history(h) for h in histories], replies


def check_teacher_forcing(model, sources, replies):
    batch = collate(sources, replies)
    with torch.no_grad():
        out = model(**batch)
    n_tokens = (batch["labels"] != -100).sum()
    total, worst = 0.0, 0.0
    for i, (s, r) in enumerate(zip(sources, replies)):
        with torch.no_grad():
            solo = model(input_ids=torch.tensor([s]), labels=torch.tensor([r]))
        total = total + solo.loss * len(r)
        worst = max(worst, (out.logits[i, : len(r)] - solo.logits[0]).abs().max().item())
    loss_err = (out.loss - total / n_tokens).abs().item()
    print(f"teacher forcing: batched loss {out.loss.item():.6f}, loss err {loss_err:.2e}, logits err {worst:.2e}")
    assert loss_err < 1e-9 and worst < 1e-9


def strip(row):
    row = row.tolist()
    return row[: row.index(EOS) + 1] if EOS in row else row


def greedy_cached(model, input_ids, attention_mask):
    encoder_outputs = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    decoder_input_ids = torch.full((input_ids.size(0), 1), model.config.decoder_start_token_id)
    out_ids = decoder_input_ids
    cache = None
    done = torch.zeros(input_ids.size(0), dtype=torch.bool)
    for _ in range(MAX_NEW):
        out = model(
            encoder_outputs=encoder_outputs, attention_mask=attention_mask,
            decoder_input_ids=decoder_input_ids, cache=cache, use_cache=True,
        )
        cache = out.cache
        next_tok = out.logits[:, -1].argmax(-1)
        next_tok = torch.where(done, torch.full_like(next_tok, PAD), next_tok)
        done |= next_tok == EOS
        out_ids = torch.cat([out_ids, next_tok[:, None]], dim=1)
        decoder_input_ids = next_tok[:, None]
    return out_ids


def greedy_recompute(model, input_ids, attention_mask):
    out_ids = torch.full((input_ids.size(0), 1), model.config.decoder_start_token_id)
    done = torch.zeros(input_ids.size(0), dtype=torch.bool)
    for _ in range(MAX_NEW):
        out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=out_ids, use_cache=False)
        next_tok = out.logits[:, -1].argmax(-1)
        next_tok = torch.where(done, torch.full_like(next_tok, PAD), next_tok)
        done |= next_tok == EOS
        out_ids = torch.cat([out_ids, next_tok[:, None]], dim=1)
    return out_ids


def check_generation(model, sources):
    batch = collate(sources, [[EOS]] * len(sources))
    input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        cached = greedy_cached(model, input_ids, attention_mask)
        recomputed = greedy_recompute(model, input_ids, attention_mask)
        greedy = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW, num_beams=1, do_sample=False
        )
        beams = model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=MAX_NEW, num_beams=3, do_sample=False,
            early_stopping=True,
        )
        for i, s in enumerate(sources):
            solo_ids = torch.tensor([s])
            solo_greedy = model.generate(input_ids=solo_ids, max_new_tokens=MAX_NEW, num_beams=1, do_sample=False)
            solo_beams = model.generate(
                input_ids=solo_ids, max_new_tokens=MAX_NEW, num_beams=3, do_sample=False, early_stopping=True
            )
            want = strip(solo_greedy[0])
            assert strip(cached[i]) == want, (i, strip(cached[i]), want)
            assert strip(recomputed[i]) == want, (i, strip(recomputed[i]), want)
            assert strip(greedy[i]) == want, (i, strip(greedy[i]), want)
            assert strip(beams[i]) == strip(solo_beams[0]), (i, strip(beams[i]), strip(solo_beams[0]))
            print(f"history {i} ({len(s)} tokens): greedy {want}, beam {strip(solo_beams[0])}")


def main():
    model = build()
    sources, replies = make_data()
    print("source lengths", [len(s) for s in sources], "reply lengths", [len(r) for r in replies])
    check_teacher_forcing(model, sources, replies)
    check_generation(model, sources)
    print("ok")


if __name__ == "__main__":
    main()
