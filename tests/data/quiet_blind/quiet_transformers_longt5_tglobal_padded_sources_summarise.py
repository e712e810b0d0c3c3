"""Correct program: a tiny LongT5 with transient-global ("TGlobal") encoder attention
(transformers' LongT5ForConditionalGeneration built from LongT5Config, no download),
trained-style teacher forcing and greedy decoding on RIGHT-padded long-ish sources.

Citation: huggingface/transformers src/transformers/models/longt5/modeling_longt5.py
(release v5.25.0, the installed one):
  _make_global_fixed_block_ids  - each real token gets the id of its fixed global block
                                  (global_block_size tokens; orphan tokens of a last partial
                                  block go to the block before), padding gets -1, and
                                  global_segment_ids marks which of the seq_len // gbs global
                                  slots hold a real block;
  _create_global_aggregates     - one-hot(block_ids) einsum: the global tokens are sums over
                                  the real tokens of each block (padding summed into a dropped
                                  extra slot);
  LongT5TransientGlobalAttention.forward / compute_side_bias
                                - every query attends the 3 local blocks of block_len =
                                  local_radius + 1 (_get_local_attention_mask, padding -> -1e10)
                                  and the side (global) keys whose segment id equals its own
                                  mask value (-1e10 otherwise), plus relative-position buckets;
  LongT5Stack.forward           - the decoder: causal self-attention and cross-attention over
                                  the padded encoder memory with the 1/0 source mask.

Checks (float64 weights; LongT5 takes its softmax in float32, so tolerances are 1e-5):
  1. encoder hidden states of the padded batch at real tokens == each source run alone,
     unpadded (attention_mask of ones);
  2. teacher-forced logits at real target positions == each (source, target) pair alone,
     unpadded; the batch loss (labels -100 on padding) == a double loop over rows and real
     target tokens of per-token cross entropy;
  3. model.generate (greedy) on the padded batch == a hand-written no-cache greedy loop per
     source alone.
"""
import sys

import torch
import torch.nn.functional as F
from transformers import LongT5Config, LongT5ForConditionalGeneration

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

PAD, EOS, START = 0, 1, 0
config = LongT5Config(
    vocab_size=64,
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    local_radius=3,
    global_block_size=4,
    encoder_attention_type="transient-global",
    relative_attention_num_buckets=8,
    relative_attention_max_distance=32,
    dropout_rate=0.0,
    pad_token_id=PAD,
    eos_token_id=EOS,
    decoder_start_token_id=START,
)
model = LongT5ForConditionalGeneration(config).eval()

# sources of different lengths (longer than a few local blocks and global blocks)
lengths = [23, 14, 9, 18]
sources = [torch.randint(2, config.vocab_size, (n,)) for n in lengths]
for s in sources:
    s[-1] = EOS
tgt_lengths = [6, 3, 5, 4]
targets = [torch.randint(2, config.vocab_size, (n,)) for n in tgt_lengths]
for t in targets:
    t[-1] = EOS


def pad_right(seqs, value):
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), value, dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, : len(s)] = s
    return out


input_ids = pad_right(sources, PAD)
attention_mask = (input_ids != PAD).long()
labels = pad_right(targets, -100)
decoder_input_ids = model._shift_right(labels)
decoder_attention_mask = (labels != -100).long()

with torch.no_grad():
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        decoder_input_ids=decoder_input_ids,
        decoder_attention_mask=decoder_attention_mask,
        labels=labels,
    )

    # 1. encoder: padded batch vs each source alone
    for i, s in enumerate(sources):
        alone = model.get_encoder()(
            input_ids=s[None], attention_mask=torch.ones(1, len(s), dtype=torch.long)
        ).last_hidden_state[0]
        torch.testing.assert_close(enc[i, : len(s)], alone, rtol=1e-5, atol=1e-5)

    # 2. teacher forcing: logits per pair alone, loss as a double loop
    total, count = 0.0, 0
    for i, (s, t) in enumerate(zip(sources, targets)):
        dec_in = torch.cat([torch.tensor([START]), t[:-1]])[None]
        logits = model(
            input_ids=s[None],
            attention_mask=torch.ones(1, len(s), dtype=torch.long),
            decoder_input_ids=dec_in,
        ).logits[0]
        torch.testing.assert_close(out.logits[i, : len(t)], logits, rtol=1e-5, atol=1e-5)
        for j in range(len(t)):
            total += F.cross_entropy(logits[j][None], t[j][None]).item()
            count += 1
    torch.testing.assert_close(out.loss.item(), total / count, rtol=1e-5, atol=1e-5)

    # 3. greedy generation on the padded batch vs a no-cache greedy loop per source
    max_new = 7
    gen = model.generate(
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=max_new,
        do_sample=False,
        num_beams=1,
    )
    for i, s in enumerate(sources):
        ids = torch.tensor([[START]])
        for _ in range(max_new):
            nxt = model(input_ids=s[None], decoder_input_ids=ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
            if nxt.item() == EOS:
                break
        row = gen[i]
        n = ids.shape[1]
        assert torch.equal(row[:n], ids[0]), (i, row.tolist(), ids[0].tolist())
        assert (row[n:] == PAD).all(), (i, row.tolist())

print("ok: LongT5 TGlobal padded batch matches per-source runs, loss double loop, greedy loop")
sys.exit(0)
