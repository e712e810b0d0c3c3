# Citation: EleutherAI/lm-evaluation-harness @4e7e0d47f33bc71070c1d38394bafbb52b117163:
# lm_eval/models/huggingface.py (HFLM.tok_batch_encode padding_side="left", HFLM._model_generate, HFLM.generate_until),
# lm_eval/models/utils_hf.py (MultiTokenEOSCriteria, stop_sequences_criteria), lm_eval/models/utils.py
# (handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text), lm_eval/tasks/humaneval/humaneval.yaml and
# lm_eval/tasks/triviaqa/default.yaml (until / do_sample); the model is transformers' Starcoder2ForCausalLM (v5.25.0
# installed) from a tiny Starcoder2Config (3 layers, sliding_window=16, random weights), run as
# `--gen_kwargs max_gen_toks=16,cache_implementation=static`.
# Requests are grouped by their generation kwargs, sorted longest first, batched three at a time and LEFT-padded by
# the tokenizer (pad = eos = <|endoftext|>); the padding attention_mask goes to model.generate, which fills a static
# cache whose layers are StaticSlidingWindowLayer (16 slots), and the harness's MultiTokenEOSCriteria decode the
# tail of each row to stop the batch once every row has met a stop sequence; EOS rows are padded. Each continuation
# is checked against a hand-written Starcoder2 forward (plain torch, one prompt at a time, no padding, no cache, its
# causal sliding window built by a double loop) run greedily, then cut by the same stop strings.
import collections
import copy
import math

import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast, Starcoder2Config, Starcoder2ForCausalLM

torch.manual_seed(3)
torch.set_num_threads(1)

EOT = "<|endoftext|>"
CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 \n():#=_,.+-*\"'[]<>?"


def build_tokenizer():
    # a character-level stand-in for the StarCoder2 tokenizer: <|endoftext|> is bos / eos / unk, no pad token
    vocab = {EOT: 0}
    for c in CHARS:
        vocab.setdefault(c, len(vocab))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=EOT))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=EOT, eos_token=EOT, unk_token=EOT)


# ---- lm_eval/models/utils_hf.py ----
class MultiTokenEOSCriteria(transformers.StoppingCriteria):
    """Criteria to stop on the specified multi-token sequence."""

    def __init__(self, sequence, tokenizer, initial_decoder_input_length, batch_size):
        self.initial_decoder_input_length = initial_decoder_input_length
        self.done_tracker = [False] * batch_size
        self.sequence = sequence
        self.sequence_ids = tokenizer.encode(sequence, add_special_tokens=False)
        # look back 2 tokens more than the stop sequence takes to encode
        self.sequence_id_len = len(self.sequence_ids) + 2
        self.tokenizer = tokenizer

    def __call__(self, input_ids, scores, **kwargs) -> bool:
        lookback_ids_batch = input_ids[:, self.initial_decoder_input_length:]
        lookback_ids_batch = lookback_ids_batch[:, -self.sequence_id_len:]
        lookback_tokens_batch = self.tokenizer.batch_decode(lookback_ids_batch)
        for i, done in enumerate(self.done_tracker):
            if not done:
                self.done_tracker[i] = self.sequence in lookback_tokens_batch[i]
        return False not in self.done_tracker


def stop_sequences_criteria(tokenizer, stop_sequences, initial_decoder_input_length, batch_size):
    return transformers.StoppingCriteriaList(
        [MultiTokenEOSCriteria(sequence, tokenizer, initial_decoder_input_length, batch_size)
         for sequence in stop_sequences]
    )


# ---- lm_eval/models/utils.py ----
def handle_stop_sequences(until, eos):
    if isinstance(until, str):
        until = [until]
    elif until is None:
        until = []
    if eos is not None and eos not in until:
        until.append(eos)
    return until


def normalize_gen_kwargs(gen_kwargs, default_max_gen_toks=256):
    kwargs = copy.deepcopy(gen_kwargs)
    until = kwargs.get("until", [])
    if not isinstance(until, list):
        until = [until]
    max_gen_toks = kwargs.pop("max_gen_toks", None)
    kwargs["max_gen_toks"] = int(max_gen_toks if max_gen_toks is not None else default_max_gen_toks)
    kwargs["until"] = until
    if not kwargs.get("do_sample", False):
        kwargs["temperature"] = 0.0
    return kwargs


def postprocess_generated_text(generation, stop):
    if stop:
        for term in stop:
            if len(term) > 0:
                generation = generation.split(term)[0]
    return generation


# ---- lm_eval/models/huggingface.py (HFLM, causal backend) ----
class HFLM:
    def __init__(self, model, tokenizer, batch_size, max_length):
        self.model = model
        self.tokenizer = tokenizer
        if self.tokenizer.pad_token is None:  # configure_pad_token: unk, else eos
            self.tokenizer.pad_token = self.tokenizer.unk_token or self.tokenizer.eos_token
        self.batch_size = batch_size
        self._max_length = max_length
        self.max_gen_toks = 256

    @property
    def eot_token_id(self):
        return self.tokenizer.eos_token_id

    def tok_encode(self, string):
        return self.tokenizer.encode(string)

    def tok_batch_encode(self, strings, padding_side="left", left_truncate_len=None, truncation=False):
        old_padding_side = self.tokenizer.padding_side
        self.tokenizer.padding_side = padding_side
        encoding = self.tokenizer(strings, truncation=truncation, padding="longest", return_tensors="pt")
        if left_truncate_len:
            encoding["input_ids"] = encoding["input_ids"][:, -left_truncate_len:]
            encoding["attention_mask"] = encoding["attention_mask"][:, -left_truncate_len:]
        self.tokenizer.padding_side = old_padding_side
        return encoding["input_ids"], encoding["attention_mask"]

    def tok_decode(self, tokens, skip_special_tokens=True):
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def _model_generate(self, context, max_length, stop, **generation_kwargs):
        generation_kwargs["temperature"] = generation_kwargs.get("temperature", 0.0)
        do_sample = generation_kwargs.get("do_sample")
        if (temp := generation_kwargs.get("temperature")) == 0.0 and do_sample is None:
            generation_kwargs["do_sample"] = do_sample = False
        if do_sample is False and temp == 0.0:
            generation_kwargs.pop("temperature", None)
        stopping_criteria = stop_sequences_criteria(self.tokenizer, stop, context.shape[1], context.shape[0])
        return self.model.generate(
            input_ids=context,
            max_length=max_length,
            stopping_criteria=stopping_criteria,
            pad_token_id=self.tokenizer.pad_token_id,
            use_cache=True,
            **generation_kwargs,
        )

    def generate_until(self, requests):
        res = [None] * len(requests)
        # Collator(sort_fn=_collate, group_by="gen_kwargs"): longest context first, one gen_kwargs per batch
        groups = collections.defaultdict(list)
        for idx, (context, gen_kwargs) in enumerate(requests):
            groups[repr(sorted(gen_kwargs.items()))].append(idx)
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        for indices in groups.values():
            indices = sorted(indices, key=lambda i: (-len(self.tok_encode(requests[i][0])), requests[i][0]))
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                contexts = [requests[i][0] for i in chunk]
                gen_kwargs = requests[chunk[0]][1]
                kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
                max_gen_toks = kwargs.pop("max_gen_toks")
                max_ctx_len = self._max_length - max_gen_toks
                context_enc, attn_masks = self.tok_batch_encode(contexts, left_truncate_len=max_ctx_len)
                max_length = kwargs.pop("max_length", context_enc.shape[1] + max_gen_toks)
                with torch.no_grad():
                    cont = self._model_generate(context=context_enc, attention_mask=attn_masks, stop=until,
                                                max_length=max_length, **kwargs)
                for i, cont_toks in zip(chunk, cont.tolist()):
                    cont_toks = cont_toks[context_enc.shape[1]:]
                    s = self.tok_decode(cont_toks)
                    res[i] = (postprocess_generated_text(s, until), cont_toks, context_enc.shape[1])
        return res


# ---- a Starcoder2 forward written by hand, one unpadded sequence, no cache ----
def window_mask(n, W):
    # query i sees key j when j is not ahead of it and fewer than W positions behind
    return torch.tensor([[j <= i and i - j < W for j in range(n)] for i in range(n)])


def reference_logits(model, ids, allowed_full):
    cfg = model.config
    m = model.model
    n = len(ids)
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = cfg.hidden_size // nh
    theta = cfg.rope_parameters["rope_theta"]
    allowed = allowed_full[:n, :n]
    inv_freq = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    ang = torch.arange(n, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()

    def rope(x):  # x: (heads, n, hd)
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    h = m.embed_tokens.weight[torch.tensor(ids)]
    for layer in m.layers:
        a = layer.self_attn
        x = F.layer_norm(h, (cfg.hidden_size,), layer.input_layernorm.weight, layer.input_layernorm.bias,
                         cfg.norm_epsilon)
        q = (x @ a.q_proj.weight.T + a.q_proj.bias).view(n, nh, hd).transpose(0, 1)
        k = (x @ a.k_proj.weight.T + a.k_proj.bias).view(n, nkv, hd).transpose(0, 1)
        v = (x @ a.v_proj.weight.T + a.v_proj.bias).view(n, nkv, hd).transpose(0, 1)
        q, k = rope(q), rope(k)
        out = torch.zeros(nh, n, hd)
        for head in range(nh):
            kv = head // (nh // nkv)
            s = q[head] @ k[kv].T / math.sqrt(hd)
            s = s.masked_fill(~allowed, float("-inf"))
            out[head] = s.softmax(-1) @ v[kv]
        h = h + out.transpose(0, 1).reshape(n, nh * hd) @ a.o_proj.weight.T + a.o_proj.bias
        x = F.layer_norm(h, (cfg.hidden_size,), layer.post_attention_layernorm.weight,
                         layer.post_attention_layernorm.bias, cfg.norm_epsilon)
        x = F.gelu(x @ layer.mlp.c_fc.weight.T + layer.mlp.c_fc.bias, approximate="tanh")
        h = h + x @ layer.mlp.c_proj.weight.T + layer.mlp.c_proj.bias
    h = F.layer_norm(h, (cfg.hidden_size,), m.norm.weight, m.norm.bias, cfg.norm_epsilon)
    return h @ model.lm_head.weight.T


def reference_generate(model, tokenizer, prompt, max_gen_toks):
    ids = tokenizer.encode(prompt)
    allowed = window_mask(len(ids) + max_gen_toks, model.config.sliding_window)
    out = []
    with torch.no_grad():
        for _ in range(max_gen_toks):
            logits = reference_logits(model, ids + out, allowed)
            tok = int(logits[-1].argmax())
            out.append(tok)
            if tok == tokenizer.eos_token_id:
                break
    return out


def main():
    tokenizer = build_tokenizer()
    eos_id = tokenizer.eos_token_id
    config = Starcoder2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                              sliding_window=16, initializer_range=0.2, bos_token_id=eos_id, eos_token_id=eos_id)
    model = Starcoder2ForCausalLM(config).eval()
    lm = HFLM(model, tokenizer, batch_size=3, max_length=128)

    # two tasks, grouped apart by their generation kwargs: humaneval (code, its stop lines) and triviaqa ("\n", ".",
    # ","), each run with `--gen_kwargs max_gen_toks=16,cache_implementation=static` merged in
    cli = {"max_gen_toks": 16, "cache_implementation": "static"}
    humaneval = {"until": ["\nclass", "\ndef", "\n#", "\nif", "\nprint"], "do_sample": False, **cli}
    triviaqa = {"until": ["\n", ".", ","], "do_sample": False, "temperature": 0.0, **cli}
    requests = [
        ('def add(a, b):\n    """Return a + b."""\n', humaneval),
        ("Question: Who wrote Hamlet?\nAnswer:", triviaqa),
        ('def fib(n):\n    """n-th Fibonacci number, fib(0) = 0."""\n    if n < 2:\n        return n\n', humaneval),
        ("Question: What is the capital city of Australia?\nAnswer:", triviaqa),
        ("def sq(x):\n", humaneval),
        ("Question: Who is Zeus?\nAnswer:", triviaqa),
        ("Question: In which year did the Titanic sink?\nAnswer:", triviaqa),
    ]
    results = lm.generate_until(requests)

    for (p, gen_kwargs), (text, cont_toks, width) in zip(requests, results):
        until = gen_kwargs["until"] + [EOT]
        ref = reference_generate(model, tokenizer, p, gen_kwargs["max_gen_toks"])
        ref_text = postprocess_generated_text(tokenizer.decode(ref, skip_special_tokens=True), until)
        # the batch may stop early once every row has met a stop sequence; compare what it produced
        n = min(len(cont_toks), len(ref))
        assert cont_toks[:n] == ref[:n], (p, cont_toks, ref)
        assert all(t == tokenizer.pad_token_id for t in cont_toks[n:]), (p, cont_toks, ref)  # after its EOS
        assert text == ref_text, (p, text, ref_text)
        print(repr(p[:24]), "len", len(tokenizer.encode(p)), "padded to", width, "->", repr(text))
    print("ok: lm-eval generate_until over a static sliding-window cache matches the unpadded reference")


if __name__ == "__main__":
    main()
