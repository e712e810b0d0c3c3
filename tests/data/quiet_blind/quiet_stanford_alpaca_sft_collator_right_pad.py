"""Stanford Alpaca supervised fine-tuning batch, shrunk to a tiny Llama.

Ported from tatsu-lab/stanford_alpaca train.py (stored version 15b51ae3):
  * PROMPT_DICT prompt_input / prompt_no_input templates,
  * preprocess(): tokenizes source+target and source alone, sets
    label[:source_len] = IGNORE_INDEX so only the response (and its EOS) is trained,
  * DataCollatorForSupervisedDataset: pad_sequence(..., padding_value=pad_token_id)
    on the right, labels padded with IGNORE_INDEX,
    attention_mask = input_ids.ne(tokenizer.pad_token_id).
Alpaca adds a dedicated "[PAD]" token (smart_tokenizer_and_embedding_resize), so the pad id
never equals EOS and `ne(pad)` keeps every real token, including the trained EOS.

The model is transformers' LlamaForCausalLM built from a tiny LlamaConfig (no download),
SDPA attention: causal x the collator's padding mask.

Check: each example run alone, unpadded, gives the same per-token log-probs on its response
tokens, and the batch loss equals the token-weighted mean of the per-example losses.
"""
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)

IGNORE_INDEX = -100
PROMPT_DICT = {
    "prompt_input": (
        "Below is an instruction. Input gives context.\n\n"
        "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
    ),
    "prompt_no_input": (
        "Below is an instruction.\n\n"
        "### Instruction:\n{instruction}\n\n### Response:"
    ),
}


class CharTokenizer:
    """A byte-level stand-in for the Llama tokenizer: bos, eos, and an added [PAD]."""

    def __init__(self):
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.eos_token = "</s>"
        self.pad_token_id = 258  # added by smart_tokenizer_and_embedding_resize
        self.model_max_length = 160

    def __len__(self):
        return 259

    def encode(self, text):
        ids = [self.bos_token_id]
        body = text
        has_eos = body.endswith(self.eos_token)
        if has_eos:
            body = body[: -len(self.eos_token)]
        ids += list(body.encode("utf-8"))
        if has_eos:
            ids.append(self.eos_token_id)
        return ids[: self.model_max_length]


def _tokenize_fn(strings, tokenizer):
    input_ids = labels = [torch.tensor(tokenizer.encode(t)) for t in strings]
    input_ids_lens = labels_lens = [int(ids.ne(tokenizer.pad_token_id).sum()) for ids in input_ids]
    return dict(input_ids=input_ids, labels=labels, input_ids_lens=input_ids_lens, labels_lens=labels_lens)


def preprocess(sources, targets, tokenizer):
    examples = [s + t for s, t in zip(sources, targets)]
    examples_tokenized, sources_tokenized = [_tokenize_fn(strings, tokenizer) for strings in (examples, sources)]
    input_ids = examples_tokenized["input_ids"]
    labels = copy.deepcopy(input_ids)
    for label, source_len in zip(labels, sources_tokenized["input_ids_lens"]):
        label[:source_len] = IGNORE_INDEX
    return dict(input_ids=input_ids, labels=labels)


class DataCollatorForSupervisedDataset:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, instances):
        input_ids, labels = tuple([inst[key] for inst in instances] for key in ("input_ids", "labels"))
        input_ids = torch.nn.utils.rnn.pad_sequence(input_ids, batch_first=True, padding_value=self.tokenizer.pad_token_id)
        labels = torch.nn.utils.rnn.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
        return dict(input_ids=input_ids, labels=labels, attention_mask=input_ids.ne(self.tokenizer.pad_token_id))


def token_logps(logits, labels):
    """Shifted next-token log-probs, zero where the label is IGNORE_INDEX."""
    logits = logits[:, :-1, :]
    labels = labels[:, 1:].clone()
    keep = labels != IGNORE_INDEX
    labels[~keep] = 0
    lp = torch.gather(logits.log_softmax(-1), 2, labels.unsqueeze(2)).squeeze(2)
    return lp * keep, keep


def main():
    tok = CharTokenizer()
    cfg = LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).eval()

    data = [
        dict(instruction="Add", input="2+3", output="5"),
        dict(instruction="Name a colour.", input="", output="Blue, like the sky at noon."),
        dict(instruction="Reverse", input="abc", output="cba"),
    ]
    sources = [
        PROMPT_DICT["prompt_input"].format_map(ex) if ex.get("input", "") != "" else PROMPT_DICT["prompt_no_input"].format_map(ex)
        for ex in data
    ]
    targets = [f"{ex['output']}{tok.eos_token}" for ex in data]
    dd = preprocess(sources, targets, tok)
    instances = [dict(input_ids=i, labels=l) for i, l in zip(dd["input_ids"], dd["labels"])]
    batch = DataCollatorForSupervisedDataset(tok)(instances)
    lens = [len(i) for i in dd["input_ids"]]
    print("lengths", lens, "padded to", batch["input_ids"].shape[1])

    with torch.no_grad():
        out = model(**batch)
        lp_b, keep_b = token_logps(out.logits, batch["labels"])

        ok = True
        tot_sum, tot_n = 0.0, 0
        for b, inst in enumerate(instances):
            ids = inst["input_ids"].unsqueeze(0)
            lab = inst["labels"].unsqueeze(0)
            alone = model(input_ids=ids)
            lp_a, keep_a = token_logps(alone.logits, lab)
            L = ids.shape[1] - 1
            same_keep = torch.equal(keep_a[0], keep_b[b, :L]) and not keep_b[b, L:].any()
            close = torch.allclose(lp_a[0], lp_b[b, :L], atol=1e-5)
            ok &= same_keep and close
            tot_sum += float(-lp_a.sum())
            tot_n += int(keep_a.sum())
            print(f"example {b}: trained tokens {int(keep_a.sum())}, batch vs alone max diff "
                  f"{(lp_a[0] - lp_b[b, :L]).abs().max().item():.2e}")
        ref_loss = tot_sum / tot_n
        ok &= abs(ref_loss - out.loss.item()) < 1e-5
        print(f"batch loss {out.loss.item():.6f} vs token-weighted alone {ref_loss:.6f}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
