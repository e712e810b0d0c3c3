"""Correct program: a tiny PEGASUS-X (transformers' PegasusXForConditionalGeneration, built
from PegasusXConfig, no download) summarising a RIGHT-padded batch of long-ish sources.

Project: huggingface/transformers src/transformers/models/pegasus_x/modeling_pegasus_x.py
(v5.25.0, the installed release):
  PegasusXEncoder.forward   - 1/0 attention_mask -> additive (1 - m) filled with finfo.min,
                              sequence padded to a multiple of block_size with finfo.min,
                              learned global tokens (embed_global) prepended per layer;
  PegasusXEncoderLayer      - odd layers stagger the blocks: pad_local_tokens adds block_size//2
                              zero tokens on both sides with finfo.min in the mask, then
                              unpad_local_tokens cuts them off again;
  PegasusXGlobalLocalAttention.compute_global_attention_representations
                            - global queries attend [globals ; every token], mask padded with 0
                              for the globals (never masked);
  ...compute_local_attention_representations
                            - token queries attend [globals ; tokens of their own block], the
                              mask viewed as (B, num_blocks, block_size) and padded with 0 for the
                              globals, so no row is ever fully masked (every query sees the globals);
  PegasusXDecoder           - create_causal_mask over the cache, create_bidirectional_mask for the
                              cross-attention over the padded encoder memory.

Checks (float64):
  1. the padded batch's encoder output at real tokens == an independent dense reference per
     row, unpadded: one softmax over [globals ; tokens] with an explicit allowed matrix
     (global rows see all, token t sees the globals and tokens of block t//bs, or of block
     (t + bs//2)//bs on staggered layers);
  2. teacher-forced logits at real target positions == each pair alone, unpadded, no masks;
  3. a hand-written cached greedy loop == generate() on the batch == each source alone.
"""
import math
import warnings

import torch
from transformers import PegasusXConfig, PegasusXForConditionalGeneration
from transformers.utils import logging as hf_logging

warnings.filterwarnings("ignore")
hf_logging.set_verbosity_error()
torch.manual_seed(0)

PAD, EOS = 0, 1
BS, G = 4, 2


def build():
    cfg = PegasusXConfig(
        vocab_size=48, max_position_embeddings=64, d_model=32, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, block_size=BS, num_global_tokens=G,
        stagger_local_blocks=True, pad_token_id=PAD, eos_token_id=EOS, decoder_start_token_id=PAD,
        scale_embedding=False, forced_eos_token_id=None, tie_word_embeddings=False,
    )
    cfg._attn_implementation = "eager"
    model = PegasusXForConditionalGeneration(cfg).to(torch.float64).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "embed_global" in n or "shared" in n or "lm_head" in n:
                p.normal_(0.0, 1.0)
            elif p.dim() == 2:
                p.normal_(0.0, 0.7)
        model.lm_head.weight[PAD].zero_()
    return model


def pad_right(seqs, value):
    L = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), L), value, dtype=torch.long)
    mask = torch.zeros(len(seqs), L, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s)
        mask[i, :len(s)] = 1
    return ids, mask


# ------------------------------------------------ independent dense reference (one row)
def dense_layer(layer, h, gh):
    T = h.shape[0]
    att = layer.self_attn
    H, D = att.num_heads, att.head_dim
    x = layer.self_attn_layer_norm(h)
    gx = layer.global_self_attn_layer_norm(gh)
    allx = torch.cat([gx, x])                       # [G + T, d]
    q = att.q_proj(allx).view(-1, H, D).transpose(0, 1) * att.scaling
    k = att.k_proj(allx).view(-1, H, D).transpose(0, 1)
    v = att.v_proj(allx).view(-1, H, D).transpose(0, 1)
    shift = BS // 2 if layer.stagger_blocks_this_layer else 0
    blk = (torch.arange(T) + shift) // BS
    allowed = torch.zeros(G + T, G + T, dtype=torch.bool)
    allowed[:G, :] = True                           # global rows: everything
    allowed[G:, :G] = True                          # token rows: the globals
    allowed[G:, G:] = blk[:, None] == blk[None, :]  # token rows: own (possibly staggered) block
    s = q @ k.transpose(-1, -2)
    s = s.masked_fill(~allowed, float("-inf"))
    o = (torch.softmax(s, -1) @ v).transpose(0, 1).reshape(G + T, -1)
    o = att.out_proj(o)
    h = h + o[G:]
    gh = gh + o[:G]
    ff = lambda z: layer.fc2(layer.activation_fn(layer.fc1(layer.final_layer_norm(z))))
    return h + ff(h), gh + ff(gh)


def dense_encoder(model, src):
    enc = model.get_encoder()
    ids = torch.tensor([src])
    e = enc.embed_tokens(ids)
    h = (e + enc.embed_positions(e))[0]
    gh = enc.embed_global.weight
    for layer in enc.layers:
        h, gh = dense_layer(layer, h, gh)
    return enc.layer_norm(h)


@torch.no_grad()
def greedy_cached(model, input_ids, attention_mask, max_new):
    enc = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
    B = input_ids.shape[0]
    dec = torch.full((B, 1), model.config.decoder_start_token_id, dtype=torch.long)
    done = torch.zeros(B, dtype=torch.bool)
    cache, step_in = None, dec
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
    g = torch.Generator().manual_seed(5)
    srcs = [torch.randint(2, 48, (n,), generator=g).tolist() + [EOS] for n in (10, 2, 6)]
    tgts = [torch.randint(2, 48, (n,), generator=g).tolist() + [EOS] for n in (2, 5, 3)]
    input_ids, attention_mask = pad_right(srcs, PAD)
    labels, lab_mask = pad_right(tgts, -100)
    decoder_input_ids = torch.cat([torch.full((len(tgts), 1), PAD), labels[:, :-1].clamp(min=PAD)], 1)
    decoder_attention_mask = torch.cat([torch.ones(len(tgts), 1, dtype=torch.long), lab_mask[:, :-1]], 1)

    ok = True
    with torch.no_grad():
        enc_b = model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        for i, s in enumerate(srcs):
            ref = dense_encoder(model, s)
            good = torch.allclose(enc_b[i, :len(s)], ref, atol=1e-10, rtol=1e-9)
            print(f"source {i} (len {len(s)}): encoder == dense global/local reference: {good}")
            ok &= good

        out = model(input_ids=input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                    decoder_attention_mask=decoder_attention_mask)
        for i, (s, t) in enumerate(zip(srcs, tgts)):
            alone = model(input_ids=torch.tensor([s]), decoder_input_ids=torch.tensor([[PAD] + t[:-1]]))
            good = torch.allclose(out.logits[i, :len(t)], alone.logits[0], atol=1e-10, rtol=1e-9)
            print(f"pair {i}: teacher-forced logits match alone: {good}")
            ok &= good

    max_new = 6
    mine = greedy_cached(model, input_ids, attention_mask, max_new)
    with torch.no_grad():
        gen = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new,
                             do_sample=False, num_beams=1)
    for i, s in enumerate(srcs):
        with torch.no_grad():
            alone = model.generate(input_ids=torch.tensor([s]), max_new_tokens=max_new, do_sample=False,
                                   num_beams=1)[0]
        a, b, c = strip(mine[i]), strip(gen[i]), strip(alone)
        good = a == b == c
        print(f"source {i}: cached loop {a[1:]} generate {b[1:]} alone {c[1:]} -> {good}")
        ok &= good
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
