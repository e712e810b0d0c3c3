# Correct program (quiet batch quiet-r85a).
# Ported from huggingface/transformers examples/pytorch/translation/run_translation_no_trainer.py
# @00e3e798432b8e5e7f89bbbc7fd1e8df064f7f65 (preprocess_function, DataCollatorForSeq2Seq with
# label_pad_token_id=-100, the training loop's `model(**batch)`, the eval loop's
# `generate(batch["input_ids"], attention_mask=batch["attention_mask"], **gen_kwargs)`), run with an mBART model
# (decoder_start_token_id set to the target language code, as the script does for MBartTokenizer).
# Without --pad_to_max_length the collator pads the sources with the tokenizer (right side, pad id 1, an
# attention_mask of 1 = real) and pads the labels by hand with -100; it then asks the model for
# decoder_input_ids (mBART's shift_tokens_right: -100 -> pad, the last real label, the language code, wrapped to
# the front). No decoder_attention_mask is passed: the decoder's own causal mask covers it, its pads come last.
# Self-check: the batched training loss and the logits at every real label position equal a per-example run on the
# unpadded pair with no attention masks; the batched greedy translation of every row equals that row translated
# alone.
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, MBartConfig, MBartForConditionalGeneration, PreTrainedTokenizerFast

torch.manual_seed(0)

BOS, PAD, EOS, UNK = 0, 1, 2, 3
EN_XX, RO_RO = 60, 61  # language codes, as the last ids of the vocabulary

vocab = {"<s>": BOS, "<pad>": PAD, "</s>": EOS, "<unk>": UNK}
vocab.update({f"w{i}": i for i in range(4, 60)})
vocab.update({"en_XX": EN_XX, "ro_RO": RO_RO})
tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                    bos_token="<s>", pad_token="<pad>", eos_token="</s>", unk_token="<unk>")
tokenizer.padding_side = "right"
tokenizer.src_lang, tokenizer.tgt_lang = "en_XX", "ro_RO"


def mbart_encode(texts, lang_code, max_length):
    """MBartTokenizer's layout: X </s> <lang_code> (no bos), truncated, not padded (padding=False)."""
    out = {"input_ids": [], "attention_mask": []}
    for text in texts:
        ids = [vocab[w] for w in text.split()][: max_length - 2] + [EOS, lang_code]
        out["input_ids"].append(ids)
        out["attention_mask"].append([1] * len(ids))
    return out


args = SimpleNamespace(max_source_length=16, max_target_length=10, val_max_target_length=9, num_beams=1,
                       pad_to_max_length=False, ignore_pad_token_for_loss=True, source_lang="en_XX",
                       target_lang="ro_RO", per_device_train_batch_size=3, per_device_eval_batch_size=3)
padding = "max_length" if args.pad_to_max_length else False


def preprocess_function(examples):
    inputs = [ex["en"] for ex in examples["translation"]]
    targets = [ex["ro"] for ex in examples["translation"]]
    model_inputs = mbart_encode(inputs, EN_XX, args.max_source_length)
    labels = mbart_encode(targets, RO_RO, args.max_target_length)
    if padding == "max_length" and args.ignore_pad_token_for_loss:
        labels["input_ids"] = [
            [(l if l != tokenizer.pad_token_id else -100) for l in label] for label in labels["input_ids"]
        ]
    model_inputs["labels"] = labels["input_ids"]
    return model_inputs


config = MBartConfig(vocab_size=64, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                     decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
                     bos_token_id=BOS, pad_token_id=PAD, eos_token_id=EOS, forced_eos_token_id=EOS,
                     dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, init_std=0.3,
                     scale_embedding=True)
model = MBartForConditionalGeneration(config).double()
# Set decoder_start_token_id (the script's mBART branch)
model.config.decoder_start_token_id = tokenizer.convert_tokens_to_ids(args.target_lang)
model.generation_config.decoder_start_token_id = model.config.decoder_start_token_id

raw = {"translation": [
    {"en": "w4 w5 w6 w7 w8 w9 w10 w11 w12", "ro": "w30 w31 w32"},
    {"en": "w13 w14 w15", "ro": "w33 w34 w35 w36 w37 w38"},
    {"en": "w16 w17 w18 w19 w20", "ro": "w39"},
]}
processed = preprocess_function(raw)
dataset = [{k: processed[k][i] for k in processed} for i in range(3)]

label_pad_token_id = -100 if args.ignore_pad_token_for_loss else tokenizer.pad_token_id
data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=label_pad_token_id,
                                       pad_to_multiple_of=None)
train_dataloader = DataLoader(dataset, shuffle=False, collate_fn=data_collator,
                              batch_size=args.per_device_train_batch_size)
eval_dataloader = DataLoader(dataset, collate_fn=data_collator, batch_size=args.per_device_eval_batch_size)

# training step (dropout is 0, so train mode is deterministic)
model.train()
batch = next(iter(train_dataloader))
outputs = model(**batch)
loss = outputs.loss
loss.backward()

# eval: generation over the padded sources
model.eval()
gen_kwargs = {"max_length": args.val_max_target_length, "num_beams": args.num_beams}
with torch.no_grad():
    eval_batch = next(iter(eval_dataloader))
    generated_tokens = model.generate(eval_batch["input_ids"], attention_mask=eval_batch["attention_mask"],
                                      do_sample=False, **gen_kwargs)

# Reference 1: every pair alone, unpadded, no masks; decoder input = [ro_RO] + labels[:-1].
total, count = 0.0, 0
with torch.no_grad():
    for i, ex in enumerate(dataset):
        src = torch.tensor([ex["input_ids"]])
        lab = torch.tensor(ex["labels"])
        dec_in = torch.cat([torch.tensor([RO_RO]), lab[:-1]])[None]
        ref = model(input_ids=src, decoder_input_ids=dec_in).logits[0]
        n = len(lab)
        assert torch.allclose(outputs.logits[i, :n].detach(), ref, atol=1e-9), i
        total += torch.nn.functional.cross_entropy(ref, lab, reduction="sum").item()
        count += n
assert abs(loss.item() - total / count) < 1e-9, (loss.item(), total / count)

# Reference 2: every source translated alone.
with torch.no_grad():
    for i, ex in enumerate(dataset):
        src = torch.tensor([ex["input_ids"]])
        alone = model.generate(src, attention_mask=torch.ones_like(src), do_sample=False, **gen_kwargs)[0]
        row = generated_tokens[i]
        assert torch.equal(row[: len(alone)], alone), (i, row, alone)
        assert bool((row[len(alone):] == PAD).all()), (i, row, alone)
print("mBART loss", round(loss.item(), 6), "== per-example", round(total / count, 6),
      "| translations", generated_tokens.tolist())
