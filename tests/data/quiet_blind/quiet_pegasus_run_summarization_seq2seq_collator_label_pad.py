# Correct program (quiet batch quiet-r90b).
#
# Ported from huggingface/transformers (installed 5.25.0):
#   src/transformers/models/pegasus/modeling_pegasus.py  PegasusForConditionalGeneration.forward (labels ->
#       decoder_input_ids by shift_tokens_right, -100 -> pad, decoder_start_token_id = pad = 0), PegasusEncoder
#       (padding mask from attention_mask), PegasusDecoder (causal mask; cross-attention over encoder_attention_mask),
#       CrossEntropyLoss over labels (ignore_index -100)
#   src/transformers/data/data_collator.py  DataCollatorForSeq2Seq (label_pad_token_id=-100, decoder_input_ids
#       from model.prepare_decoder_input_ids_from_labels)
#   examples/pytorch/summarization/run_summarization.py  preprocess_function / data_collator set-up
#       (label_pad_token_id = -100 if data_args.ignore_pad_token_for_loss), teacher-forced Seq2SeqTrainer step
# Tiny PegasusConfig (sinusoidal positions, pre-LN), an in-memory WordLevel tokenizer; no download.
#
# Self-check: the collated batch (right-padded articles with attention_mask, summaries padded with -100) gives, at
# every real summary position, the logits each article/summary pair gives run alone unpadded; the model's loss
# equals a loop over pair x real label of -log p from the unpadded runs divided by the label count; one optimizer
# step of the teacher-forced loss runs.
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    DataCollatorForSeq2Seq,
    PegasusConfig,
    PegasusForConditionalGeneration,
    PreTrainedTokenizerFast,
)

torch.manual_seed(0)

words = "the cat sat on mat dog ran far away a big red ball rolled down hill quickly home slowly".split()
vocab = {"[PAD]": 0, "[CLS]": 1, "[SEP]": 2, "[UNK]": 3}
for w in words:
    vocab[w] = len(vocab)
tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
tok.pre_tokenizer = WhitespaceSplit()
tokenizer = PreTrainedTokenizerFast(
    tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]"
)
tokenizer.padding_side = "right"

config = PegasusConfig(
    vocab_size=len(vocab),
    d_model=32,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    max_position_embeddings=64,
    pad_token_id=0,
    eos_token_id=2,
    decoder_start_token_id=0,
    forced_eos_token_id=2,
    dropout=0.1,
    attention_dropout=0.1,
    activation_dropout=0.1,
)
model = PegasusForConditionalGeneration(config)

articles = [
    "the big red ball rolled down the hill quickly",
    "a dog ran home",
    "the cat sat on the mat slowly",
]
summaries = [
    "ball rolled",
    "a dog ran far away home",
    "cat sat",
]

max_source_length, max_target_length = 16, 16


def preprocess_function(examples):
    # run_summarization.py: model_inputs = tokenizer(inputs, ...); labels = tokenizer(text_target=targets, ...)
    model_inputs = tokenizer(examples["document"], max_length=max_source_length, truncation=True)
    labels = tokenizer(text_target=examples["summary"], max_length=max_target_length, truncation=True)
    model_inputs["labels"] = labels["input_ids"]
    return model_inputs


def add_sep(ids):
    return ids + [tokenizer.sep_token_id]


enc = preprocess_function({"document": articles, "summary": summaries})
features = []
for i in range(len(articles)):
    ids = add_sep(enc["input_ids"][i])
    features.append({"input_ids": ids, "attention_mask": [1] * len(ids), "labels": add_sep(enc["labels"][i])})

label_pad_token_id = -100  # data_args.ignore_pad_token_for_loss
data_collator = DataCollatorForSeq2Seq(tokenizer, model=model, label_pad_token_id=label_pad_token_id)
batch = data_collator(features)
assert (batch["attention_mask"] == 0).any() and (batch["labels"] == -100).any()
assert "decoder_input_ids" in batch

# --- teacher-forced eval forward on the padded batch -------------------------------------------------------------
model.eval()
with torch.no_grad():
    out = model(**batch)
    loss_b = out.loss
    logits_b = out.logits  # (B, T, V)

# --- reference: each pair alone, unpadded; the loss as a loop ------------------------------------------------------
nll_sum, count = 0.0, 0
with torch.no_grad():
    for i, f in enumerate(features):
        ids = torch.tensor([f["input_ids"]])
        lab = torch.tensor([f["labels"]])
        o = model(input_ids=ids, labels=lab)
        n = lab.shape[1]
        assert torch.allclose(logits_b[i, :n], o.logits[0], atol=1e-5), i
        lp = torch.log_softmax(o.logits[0].float(), dim=-1)
        for j in range(n):
            nll_sum += -lp[j, f["labels"][j]].item()
            count += 1
ref_loss = nll_sum / count
assert abs(loss_b.item() - ref_loss) < 1e-5, (loss_b.item(), ref_loss)

# --- one teacher-forced training step (Seq2SeqTrainer's compute_loss: outputs.loss) -------------------------------
model.train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
train_loss = model(**batch).loss
train_loss.backward()
optimizer.step()
assert torch.isfinite(train_loss)

print(f"ok: batch loss {loss_b.item():.5f} == per-pair loop {ref_loss:.5f}; train step loss {train_loss.item():.4f}")
