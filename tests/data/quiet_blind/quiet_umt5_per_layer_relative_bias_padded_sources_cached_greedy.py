"""Correct program: a tiny UMT5 (transformers' UMT5ForConditionalGeneration, built from
UMT5Config, no download) translating a RIGHT-padded batch of sources, teacher-forced
on right-padded targets and decoded greedily with the encoder-decoder KV cache.

Project: huggingface/transformers src/transformers/models/umt5/modeling_umt5.py
(v5.25.0, the installed release): UMT5Stack.forward (create_bidirectional_mask for the
encoder and for the cross-attention over encoder_attention_mask, create_causal_mask over
the self-attention cache), UMT5Attention.forward / compute_bias(query_length, key_length,
past_seen_tokens) / _relative_position_bucket, eager_attention_forward (scores + position
bias + additive mask, no 1/sqrt(d) scaling), UMT5ForConditionalGeneration._shift_right.

What differs from T5 and is kept: EVERY layer owns its relative_attention_bias (T5 only
has it in layer 0 and reuses it), so each layer adds its own bucketed bias; the decoder's
buckets are unidirectional and, with a cache, the query positions are offset by the number
of cached tokens (past_seen_tokens).  The padding is carried only by the masks: the encoder
pad keys by the bidirectional additive mask, the cross-attention pad keys by the
encoder_attention_mask, the decoder pad keys plus the future by the causal mask.

Checks (float64):
  1. teacher-forced logits at real target positions == each pair run alone, unpadded, masks None;
  2. a hand-written cached greedy loop (cache reused, encoder run once, encoder mask kept)
     == model.generate on the padded batch == each source generated alone
     == a no-cache loop that re-runs the whole decoder prefix every step.
"""
import warnings

import torch
from transformers import UMT5Config, UMT5ForConditionalGeneration
from transformers.utils import logging as hf_logging

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
torch.manual_seed(0)

PAD, EOS = 0, 1


def build():
    cfg = UMT5Config(
        vocab_size=48, d_model=32, d_kv=8, d_ff=48, num_heads=4, num_layers=2, num_decoder_layers=2,
        relative_attention_num_buckets=8, relative_attention_max_distance=16, dropout_rate=0.0,
        feed_forward_proj="gated-gelu", pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
        tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    model = UMT5ForConditionalGeneration(cfg).to(torch.float64).eval()
    # the default T5 init gives near-uniform attention at this size: make scores and biases matter
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "relative_attention_bias" in n:
                p.normal_(0.0, 1.5)
            elif n.endswith(".q.weight") or n.endswith(".k.weight") or n.endswith(".v.weight"):
                p.normal_(0.0, 0.5)
            elif n.endswith(".o.weight") or ".wi" in n or n.endswith(".wo.weight"):
                p.normal_(0.0, 0.4)
            elif n == "shared.weight" or n == "lm_head.weight":
                p.normal_(0.0, 1.0)
        model.lm_head.weight[PAD].fill_(0.0)  # the pad id is never emitted by the tiny model
    # every attention layer has its own bias table (UMT5), not only layer 0 (T5)
    n_tables = sum(1 for n, _ in model.named_parameters() if "relative_attention_bias" in n)
    assert n_tables == 2 + 2, n_tables
    return model


def pad_right(seqs, value):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), value, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


@torch.no_grad()
def greedy_cached(model, input_ids, attention_mask, max_new):
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    B = input_ids.shape[0]
    dec = torch.full((B, 1), model.config.decoder_start_token_id, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    cache = None
    step_in = dec
    for _ in range(max_new):
        out = model(encoder_outputs=enc, attention_mask=attention_mask, decoder_input_ids=step_in,
                    past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = out.logits[:, -1].argmax(-1)
        nxt = torch.where(done, torch.full_like(nxt, PAD), nxt)
        dec = torch.cat([dec, nxt[:, None]], 1)
        done |= nxt == EOS
        step_in = nxt[:, None]
        if done.all():
            break
    return dec


@torch.no_grad()
def greedy_no_cache_alone(model, src, max_new):
    ids = torch.tensor([src])
    dec = torch.tensor([[model.config.decoder_start_token_id]])
    for _ in range(max_new):
        logits = model(input_ids=ids, decoder_input_ids=dec, use_cache=False).logits
        nxt = logits[0, -1].argmax()
        dec = torch.cat([dec, nxt.view(1, 1)], 1)
        if nxt.item() == EOS:
            break
    return dec[0]


def strip(seq):
    seq = seq.tolist()
    out = [seq[0]]
    for t in seq[1:]:
        out.append(t)
        if t == EOS:
            break
    return out


def main():
    model = build()
    g = torch.Generator().manual_seed(3)
    srcs = [torch.randint(2, 48, (n,), generator=g).tolist() + [EOS] for n in (6, 2, 4)]
    tgts = [torch.randint(2, 48, (n,), generator=g).tolist() + [EOS] for n in (3, 5, 1)]
    input_ids, attention_mask = pad_right(srcs, PAD)
    labels, lab_mask = pad_right(tgts, -100)
    decoder_input_ids = model._shift_right(labels)       # -100 -> pad, start = pad (0)
    decoder_attention_mask = torch.cat([torch.ones(len(tgts), 1, dtype=torch.long), lab_mask[:, :-1]], 1)

    ok = True
    with torch.no_grad():
        out = model(input_ids=input_ids, attention_mask=attention_mask,
                    decoder_input_ids=decoder_input_ids, decoder_attention_mask=decoder_attention_mask,
                    labels=labels)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            alone = model(input_ids=torch.tensor([s]), labels=torch.tensor([t]))
            good = torch.allclose(out.logits[i, :len(t)], alone.logits[0], atol=1e-10, rtol=1e-9)
            print(f"pair {i}: teacher-forced logits match alone: {good}")
            ok &= good
        # per-token loss: the batch loss is the mean over all real label tokens
        per_tok = torch.cat([
            torch.nn.functional.cross_entropy(model(input_ids=torch.tensor([s]), labels=torch.tensor([t])).logits[0],
                                              torch.tensor(t), reduction="none") for s, t in zip(srcs, tgts)])
        good = torch.allclose(out.loss, per_tok.mean(), atol=1e-10)
        print(f"batch loss == mean of per-pair token losses: {good}")
        ok &= good

    max_new = 7
    mine = greedy_cached(model, input_ids, attention_mask, max_new)
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                             do_sample=False, num_beams=1)
    for i, s in enumerate(srcs):
        with torch.no_grad():
            alone = model.generate(input_ids=torch.tensor([s]), max_new_tokens=max_new, do_sample=False, num_beams=1)[0]
        ref = greedy_no_cache_alone(model, s, max_new)
        a, b, c, d = strip(mine[i]), strip(gen[i]), strip(alone), ref.tolist()
        good = a == b == c == d
        print(f"source {i}: cached loop {a[1:]} generate {b[1:]} alone {c[1:]} no-cache {d[1:]} -> {good}")
        ok &= good
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
