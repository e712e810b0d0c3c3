"""alpaca-lora's SFT batches: left padding (pad id 0 = unk), prompt labels set to -100.

Port of tloen/alpaca-lora @8bb8579e403dc78e37fe81ffbb253c413007323f:
  finetune.py        tokenizer.pad_token_id = 0; tokenizer.padding_side = "left";
                     tokenize() (appends EOS, labels = input_ids copy);
                     generate_and_tokenize_prompt() with train_on_inputs=False
                     (labels = [-100] * user_prompt_len + labels[user_prompt_len:]);
                     transformers.DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8,
                     return_tensors="pt", padding=True)
  utils/prompter.py + templates/alpaca.json   (the prompt text)
The model is transformers' LlamaForCausalLM built from a tiny LlamaConfig (no weights
downloaded, LoRA adapters left out: they do not touch the masks); the LlamaTokenizer is
replaced by an in-memory word-level tokenizer with the same special ids (unk 0, <s> 1, </s> 2)
and the same BOS-prepending. The batch is left-padded and, as in finetune.py, no position_ids are
passed: every row's RoPE positions start at 0 under its pads, a constant shift per row that
RoPE's relative scores do not see; the pads are hidden by attention_mask and their labels are
-100 (so is every prompt label, including the one right after the pads).
Checked for eager and sdpa attention against each example run alone, unpadded
(summed token losses / number of supervised tokens, and the logits at every real position).
"""
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import DataCollatorForSeq2Seq, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

torch.manual_seed(0)

TEMPLATE = {
    "prompt_input": "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
    "prompt_no_input": "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n",
}


def generate_prompt(instruction, input=None, label=None):
    if input:
        res = TEMPLATE["prompt_input"].format(instruction=instruction, input=input)
    else:
        res = TEMPLATE["prompt_no_input"].format(instruction=instruction)
    if label:
        res = f"{res}{label}"
    return res


DATA = [
    {"instruction": "Name a color.", "input": "", "output": "Blue."},
    {"instruction": "Add the numbers.", "input": "two and three", "output": "The sum is five, which is the answer."},
    {"instruction": "Say hello in French.", "input": "", "output": "Bonjour, my friend."},
]


def build_tokenizer():
    words = set()
    for d in DATA:
        words.update(generate_prompt(d["instruction"], d["input"], d["output"]).split())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for w in sorted(words):
        vocab[w] = len(vocab)
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    return t


tokenizer = build_tokenizer()
tokenizer.pad_token_id = 0  # unk. we want this to be different from the eos token
tokenizer.padding_side = "left"  # Allow batched inference
cutoff_len = 256
train_on_inputs = False
add_eos_token = False


def tokenize(prompt, add_eos_token=True):
    result = tokenizer(prompt, truncation=True, max_length=cutoff_len, padding=False, return_tensors=None)
    if (
        result["input_ids"][-1] != tokenizer.eos_token_id
        and len(result["input_ids"]) < cutoff_len
        and add_eos_token
    ):
        result["input_ids"].append(tokenizer.eos_token_id)
        result["attention_mask"].append(1)
    result["labels"] = result["input_ids"].copy()
    return result


def generate_and_tokenize_prompt(data_point):
    full_prompt = generate_prompt(data_point["instruction"], data_point["input"], data_point["output"])
    tokenized_full_prompt = tokenize(full_prompt)
    if not train_on_inputs:
        user_prompt = generate_prompt(data_point["instruction"], data_point["input"])
        tokenized_user_prompt = tokenize(user_prompt, add_eos_token=add_eos_token)
        user_prompt_len = len(tokenized_user_prompt["input_ids"])
        if add_eos_token:
            user_prompt_len -= 1
        tokenized_full_prompt["labels"] = [-100] * user_prompt_len + tokenized_full_prompt["labels"][user_prompt_len:]
    return tokenized_full_prompt


def reference(model, features):
    """Each example alone, unpadded, no attention_mask: summed CE over supervised tokens."""
    total, count, logits_rows = 0.0, 0, []
    for f in features:
        ids = torch.tensor([f["input_ids"]])
        labels = torch.tensor(f["labels"])
        logits = model(input_ids=ids).logits[0]
        logits_rows.append(logits)
        sl, lab = logits[:-1], labels[1:]
        keep = lab != -100
        total = total + F.cross_entropy(sl[keep], lab[keep], reduction="sum")
        count += int(keep.sum())
    return total / count, logits_rows


def main():
    features = [generate_and_tokenize_prompt(d) for d in DATA]
    collator = DataCollatorForSeq2Seq(tokenizer, pad_to_multiple_of=8, return_tensors="pt", padding=True)
    batch = collator([dict(f) for f in features])
    L = batch["input_ids"].shape[1]
    print("lengths", [len(f["input_ids"]) for f in features], "padded to", L)
    assert L % 8 == 0
    for r, f in enumerate(features):
        n = len(f["input_ids"])
        assert batch["attention_mask"][r, : L - n].eq(0).all() and batch["attention_mask"][r, L - n:].eq(1).all()
        assert batch["labels"][r, : L - n].eq(-100).all()

    ok = True
    for impl in ("eager", "sdpa"):
        config = LlamaConfig(
            vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            pad_token_id=0, bos_token_id=1, eos_token_id=2,
        )
        config._attn_implementation = impl
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).eval()
        with torch.no_grad():
            out = model(**batch)  # input_ids, attention_mask, labels; no position_ids, as the Trainer passes it
            ref_loss, ref_logits = reference(model, features)
        err_loss = abs(out.loss.item() - ref_loss.item())
        err_logits = 0.0
        for r, f in enumerate(features):
            n = len(f["input_ids"])
            err_logits = max(err_logits, (out.logits[r, L - n:] - ref_logits[r]).abs().max().item())
        ok &= err_loss < 1e-4 and err_logits < 1e-4
        print(f"{impl}: batch loss {out.loss.item():.6f} vs unpadded {ref_loss.item():.6f} "
              f"(|diff| {err_loss:.2e}), max |logit diff| at real positions {err_logits:.2e}")
    print("MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
