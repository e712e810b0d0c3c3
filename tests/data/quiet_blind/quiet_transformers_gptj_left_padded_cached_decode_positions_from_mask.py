"""GPT-J batched greedy decoding from LEFT-padded prompts with a KV cache, written as a manual loop.

Uses huggingface/transformers' own GPT-J code (installed 5.25.0), a tiny model built from
GPTJConfig (random weights, no download):
  src/transformers/models/gptj/modeling_gptj.py
    GPTJModel.forward     -- create_causal_mask(attention_mask, cache, position_ids): causal over the
                             cache + new tokens, padded keys closed;
    GPTJAttention.forward -- partial rotary (rotary_dim < head_dim) from the sin/cos table
                             embed_positions[position_ids], K/V appended to the cache.
  src/transformers/generation/utils.py prepare_inputs_for_generation -- position_ids taken from
                             the 2D mask: cumsum(-1) - 1, padded slots set to 1, last columns kept.

The loop (as a serving script writes it around model(...)): prefill the padded prompt batch with
its mask and mask-derived positions, then feed one token per step with the cache, the mask grown
by a column of ones and the position = number of real tokens so far - 1.

Check: each row equals the prompt decoded alone, unpadded and WITHOUT a cache (full recompute of
the whole sequence every step, default positions 0..n-1), token for token and in step logits;
model.generate on the padded batch gives the same tokens too.
"""
import torch
from transformers import GPTJConfig, GPTJForCausalLM

PAD = 0
PROMPTS = [[5, 9, 21, 7, 33], [14, 2, 40], [30]]
NEW_TOKENS = 7


def build():
    torch.manual_seed(0)
    cfg = GPTJConfig(vocab_size=48, n_embd=32, n_layer=2, n_head=4, rotary_dim=4, n_positions=64,
                     bos_token_id=1, eos_token_id=2, pad_token_id=PAD)
    cfg._attn_implementation = 'eager'
    model = GPTJForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)
    return model


def left_pad(prompts):
    L = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), L), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), L), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, L - len(p):] = torch.tensor(p)
        mask[b, L - len(p):] = 1
    return ids, mask


def positions_from_mask(attention_mask, n_new):
    position_ids = attention_mask.long().cumsum(-1) - 1
    position_ids.masked_fill_(attention_mask == 0, 1)
    return position_ids[:, -n_new:]


@torch.no_grad()
def batched_cached_decode(model, ids, mask):
    cache = None
    attention_mask = mask
    cur = ids
    tokens, step_logits = [], []
    for _ in range(NEW_TOKENS):
        position_ids = positions_from_mask(attention_mask, cur.shape[1])
        out = model(input_ids=cur, attention_mask=attention_mask, position_ids=position_ids,
                    cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits[:, -1]
        nxt = logits.argmax(-1, keepdim=True)
        step_logits.append(logits)
        tokens.append(nxt)
        cur = nxt
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=1)
    return torch.cat(tokens, 1), torch.stack(step_logits, 1)


@torch.no_grad()
def alone_no_cache(model, prompt):
    seq = list(prompt)
    logits_steps = []
    for _ in range(NEW_TOKENS):
        out = model(input_ids=torch.tensor([seq]), use_cache=False)
        lg = out.logits[0, -1]
        logits_steps.append(lg)
        seq.append(int(lg.argmax()))
    return seq[len(prompt):], torch.stack(logits_steps)


def main():
    model = build()
    ids, mask = left_pad(PROMPTS)
    toks, step_logits = batched_cached_decode(model, ids, mask)
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=PAD,
                             eos_token_id=None, use_cache=True)
    L = ids.shape[1]
    ok_all = True
    for b, p in enumerate(PROMPTS):
        want, want_logits = alone_no_cache(model, p)
        got = toks[b].tolist()
        got_gen = gen[b, L:].tolist()
        diff = float((step_logits[b] - want_logits).abs().max())
        match = got == want and got_gen == want and diff < 1e-3
        ok_all &= match
        print(f'row {b} (prompt {len(p)}, left-padded to {L}): loop={got} generate={got_gen} alone={want} '
              f'step-logits max|diff|={diff:.2e} match={match}')
    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
