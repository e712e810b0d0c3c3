"""Batched loglikelihood scoring as EleutherAI/lm-evaluation-harness writes it:
lm_eval/models/huggingface.py HFLM._loglikelihood_tokens (inp = (context_enc + continuation_enc)[:-1],
pad_and_concat(padding_len_inp, inps, padding_side="right"), ctxlen = inplen + (logits.shape[0] -
padding_len_inp), _select_cont_toks -> logits[inplen - contlen: inplen], gather, greedy max_equal),
HFLM._model_call (`self.model(inps).logits`: NO attention mask), Collator sorting by -len.
Then multi-turn scoring with prefix-cache reuse as transformers documents it (docs "Re-use cache to
continue generation": prefill once, copy.deepcopy(prompt_cache) per candidate, append the chosen turn).

Intent: right padding after the last real token needs no mask under causal attention; only logits at
real positions (< inplen) are read. The cached conversation is the context each answer is scored in.

Checks: (1) every (context, continuation) loglikelihood and greedy flag from the padded, unmasked batch
equals the request scored alone; (2) each candidate's score with a reused cache equals scoring the full
conversation text from scratch without a cache.
"""
import copy
import torch
import torch.nn.functional as F
from transformers import GPT2Config, GPT2LMHeadModel, DynamicCache

torch.manual_seed(0)
cfg = GPT2Config(vocab_size=50, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=49, eos_token_id=49,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
model = GPT2LMHeadModel(cfg).double().eval()


def pad_and_concat(max_length, tensors, padding_side="right"):
    out = []
    for t in tensors:
        if t.shape[0] < max_length:
            pad = torch.zeros(max_length - t.shape[0], dtype=torch.long)
            t = torch.cat([t, pad]) if padding_side == "right" else torch.cat([pad, t])
        out.append(t.unsqueeze(0))
    return torch.cat(out, 0)


def loglikelihood_tokens(requests, batch_size=4):
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0] + requests[i][1]))
    res = {}
    for s in range(0, len(order), batch_size):
        chunk = order[s:s + batch_size]
        inps, inplens, conts, padding_len_inp = [], [], [], None
        for i in chunk:
            context_enc, continuation_enc = requests[i]
            inp = torch.tensor((context_enc + continuation_enc)[-(cfg.n_positions + 1):][:-1], dtype=torch.long)
            (inplen,) = inp.shape
            padding_len_inp = max(padding_len_inp, inplen) if padding_len_inp is not None else inplen
            inps.append(inp), inplens.append(inplen), conts.append(continuation_enc)
        batched_inps = pad_and_concat(padding_len_inp, inps, padding_side="right")
        multi_logits = F.log_softmax(model(batched_inps).logits, dim=-1)   # _model_call: no mask
        for i, logits, inplen, cont_toks in zip(chunk, multi_logits, inplens, conts):
            contlen = len(cont_toks)
            ctxlen = inplen + (logits.shape[0] - padding_len_inp)
            logits = logits[ctxlen - contlen: ctxlen].unsqueeze(0)
            greedy_tokens = logits.argmax(dim=-1)
            cont = torch.tensor(cont_toks, dtype=torch.long).unsqueeze(0)
            max_equal = bool((greedy_tokens == cont).all())
            res[i] = (float(torch.gather(logits, 2, cont.unsqueeze(-1)).squeeze(-1).sum()), max_equal)
    return [res[i] for i in range(len(requests))]


def score_alone(context_enc, continuation_enc):
    full = torch.tensor(context_enc + continuation_enc)[None]
    lp = F.log_softmax(model(full).logits[0], -1)
    n = len(context_enc)
    tok_lp = lp[n - 1: n - 1 + len(continuation_enc)]
    cont = torch.tensor(continuation_enc)
    return float(tok_lp.gather(1, cont[:, None]).sum()), bool((tok_lp.argmax(-1) == cont).all())


def rand(n):
    return torch.randint(1, 50, (n,)).tolist()


requests = [(rand(c), rand(k)) for c, k in [(9, 3), (4, 1), (12, 5), (2, 2), (6, 1), (15, 2), (3, 6)]]
# a one-token continuation that is the model's own greedy choice, so max_equal is True somewhere
ctx = rand(5)
with torch.no_grad():
    requests.append((ctx, [int(model(torch.tensor(ctx)[None]).logits[0, -1].argmax())]))
    batched = loglikelihood_tokens(requests)
    d1 = max(abs(a[0] - score_alone(*r)[0]) for a, r in zip(batched, requests))
    flags_ok = all(a[1] == score_alone(*r)[1] for a, r in zip(batched, requests))

    # multi-turn: system prompt, then turns; score 3 candidate answers per turn with a reused cache
    history = rand(6)
    cache = DynamicCache()
    out = model(torch.tensor(history)[None], past_key_values=cache, use_cache=True)
    cache, last_logits = out.past_key_values, out.logits[0, -1]
    d2 = 0.0
    for turn in range(3):
        user = rand(4)
        out = model(torch.tensor(user)[None], past_key_values=cache, use_cache=True)
        cache, last_logits = out.past_key_values, out.logits[0, -1]
        history = history + user
        cands = [rand(n) for n in (2, 3, 1)]
        for cand in cands:
            c = copy.deepcopy(cache)
            lp = F.log_softmax(torch.cat([last_logits[None], model(torch.tensor(cand[:-1] or [cand[0]])[None],
                                          past_key_values=c, use_cache=True).logits[0]])[:len(cand)], -1)
            cached_score = float(lp.gather(1, torch.tensor(cand)[:, None]).sum())
            d2 = max(d2, abs(cached_score - score_alone(history, cand)[0]))
        chosen = cands[0]
        out = model(torch.tensor(chosen)[None], past_key_values=cache, use_cache=True)
        cache, last_logits = out.past_key_values, out.logits[0, -1]
        history = history + chosen
    assert cache.get_seq_length() == len(history)

print(f"right-padded unmasked batch vs each request alone: max |ll diff| = {d1:.3e}, greedy flags agree: {flags_ok}")
print(f"multi-turn candidates with deep-copied prefix cache vs full recompute: max diff = {d2:.3e}")
assert d1 < 1e-10 and flags_ok and d2 < 1e-10 and any(a[1] for a in batched)
